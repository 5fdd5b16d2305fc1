"""Generation through the optimized model (generation.route_generate): `optimized.generate` runs
transformers' generate with the model's forward compiled by solforge's backend, so the fused
kernels run in every step; greedy tokens equal the original model's; the model is left as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import DEVICE

import solforge.kernels.rmsnorm as rms
from solforge.integrate import integrate

transformers = pytest.importorskip("transformers")


def _model() -> torch.nn.Module:
    # one layer off the GPU: every family's region is in it, and each graph of a test is a dynamo
    # trace whose time grows with the layers (the decode loops' kernels are a small part of these
    # tests' time); two on a GPU, where the CUDA-graph test's keep-or-drop timing saw two
    torch.manual_seed(0)
    layers = 2 if DEVICE == "cuda" else 1
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=128, head_dim=16)
    return transformers.Qwen3ForCausalLM(cfg).to(DEVICE).eval()


@pytest.fixture
def norm_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts rmsnorm kernel launches: the final norm of every step is one. A launch goes through
    the module's `_launch` (the whole path, or a graph node's site without a bound launch), or
    through a site's bound launch (kernels/launch.py `Bound`), which no rmsnorm launch does twice."""
    from solforge.kernels.launch import Bound

    calls: list[int] = []
    real, real_bound = rms._launch, Bound.__call__

    def spy(*a: Any, **kw: Any) -> None:
        calls.append(1)
        real(*a, **kw)

    def bound_spy(self: Bound, *a: Any) -> None:
        calls.append(1)
        real_bound(self, *a)

    monkeypatch.setattr(rms, "_launch", spy)
    monkeypatch.setattr(Bound, "__call__", bound_spy)
    return calls


@pytest.mark.parametrize("cache", ["static", "dynamic", None])
def test_generate_runs_the_kernels_and_matches(cache: str | None, norm_calls: list[int]) -> None:
    m = _model()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    # 3 tokens: the prompt, the first step, a later step (a dynamic cache's third graph); each step
    # runs every kernel through the interpreter off the GPU
    kw: dict[str, Any] = {"max_new_tokens": 3, "do_sample": False, "disable_compile": True}
    if cache is not None:
        kw["cache_implementation"] = cache
    with torch.no_grad():
        ref = m.generate(ids, **kw)  # None: transformers' default, a dynamic cache
        opt, stats = integrate(m, {})
        out = opt.generate(ids, **kw)
    assert torch.equal(out, ref)
    # one graph for the prompt, then the decode steps: one shape with a static cache; with a
    # dynamic one, the first step's and then one for every later cache length (dynamic shapes);
    # a call that chose no cache gets a static one
    assert stats.graphs == (3 if cache == "dynamic" else 2)
    # the final norm, once a step: the kernel ran in every step, launched from Python or replayed
    # from a CUDA graph (captures call it without running it)
    steps = sum(s.replays for s in stats.step_graphs)
    assert len(norm_calls) - sum(s.captures for s in stats.step_graphs) + steps == 3
    assert "forward" not in m.__dict__  # the swap is undone


def test_generate_restores_the_forward_after_an_error() -> None:
    m = _model()
    opt, _ = integrate(m, {})
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises for a bad argument
        opt.generate(torch.zeros(1, 4, dtype=torch.long, device=DEVICE), max_new_tokens=-3)
    assert "forward" not in m.__dict__


def test_a_model_without_generate_gets_none() -> None:
    m = torch.nn.Linear(4, 4).to(DEVICE)
    opt, _ = integrate(m, {})
    assert not hasattr(opt, "generate")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_generate_replays_decode_steps_from_cuda_graphs(cuda_graphs: bool) -> None:
    m = _model()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    kw: dict[str, Any] = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False,
                          "disable_compile": True, "cache_implementation": "static"}
    with torch.no_grad():
        ref = m.generate(ids, **kw)
        opt, stats = integrate(m, {}, cuda_graphs=cuda_graphs)
        for _ in range(3):  # the later calls reuse (or replace) the first one's captures
            assert torch.equal(opt.generate(ids, **kw), ref)
    replays = sum(s.replays for s in stats.step_graphs)
    if cuda_graphs:
        # 11 decode steps a call: the first call's first two run as they are (compile, timing), the
        # third is captured and replayed, the fourth and sixth run and the fifth replays to judge
        # the capture (a replay costs less than half a run: kept), and the rest replay;
        # the later calls get the first call's cache back, so its capture replays all their steps
        decode = max(stats.step_graphs, key=lambda s: s.replays)
        assert decode.declined is None, decode.summary()
        assert (decode.replays, decode.captures) == (7 + 2 * 11, 1), [s.summary() for s in stats.step_graphs]
        # the prompt: run, timed, then captured and replayed in the third call
        assert replays == decode.replays + 1, [s.summary() for s in stats.step_graphs]
    else:
        assert replays == 0


def test_the_static_cache_is_handed_back_reset() -> None:
    """Each generate call of transformers makes a new static cache; the optimized model's hands the
    previous one back, reset, so CUDA graphs captured on its addresses replay (generation.py)."""
    m = _model()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    kw: dict[str, Any] = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False, "disable_compile": True,
                          "cache_implementation": "static"}
    with torch.no_grad():
        ref = m.generate(ids, **kw)
        opt, stats = integrate(m, {})
        keeper = opt.generate.static_caches
        for _ in range(3):
            assert torch.equal(opt.generate(ids, **kw), ref)
        assert (keeper.made, keeper.reused) == (1, 2)
        # allocated before the first prompt: the prompt's graph is the same in every call
        assert stats.graphs == 2 and all(layer.is_initialized for layer in keeper.kept[1].layers)
        # a call that returns its cache neither gets the kept one nor leaves its own to be reset
        res = opt.generate(ids, return_dict_in_generate=True, **kw)
        assert torch.equal(res.sequences, ref) and res.past_key_values is not keeper.kept[1]
        assert torch.equal(opt.generate(ids, **kw), ref)
        assert res.past_key_values.get_seq_length() == 8 + 3 - 1  # not reset by the call after it
        assert (keeper.made, keeper.reused) == (1, 3)
        # another length asks for another cache
        longer = opt.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        assert torch.equal(longer, m.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4}))
        assert keeper.made == 2
    assert "_prepare_static_cache" not in m.__dict__ and "forward" not in m.__dict__


def test_a_kept_cache_is_not_handed_to_a_cast_model() -> None:
    """The kept cache's key holds the model's dtype and device: a model cast since gets a new one."""
    from solforge.runtime.generation import StaticCacheKeeper

    class Cache:
        def __init__(self) -> None:
            self.resets = 0

        def reset(self) -> None:
            self.resets += 1

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))

        def _prepare_static_cache(self, cache_implementation: str, batch_size: int, max_cache_len: int,
                                  prefill_chunk_size: int | None, model_kwargs: dict[str, Any]) -> Cache:
            return Cache()

    m = Model()
    keeper = StaticCacheKeeper(m)
    kw: dict[str, Any] = {"cache_implementation": "static", "batch_size": 1, "max_cache_len": 16,
                          "prefill_chunk_size": None, "model_kwargs": {}}
    with keeper.owning(True, None):
        first = keeper(**kw)
        assert keeper(**kw) is first and first.resets == 1
        assert keeper(**{**kw, "batch_size": 2}) is not first
        second = keeper(**kw)
        assert second is not first  # the previous call asked for another one
        m.double()
        assert keeper(**kw) is not second and (keeper.made, keeper.reused) == (4, 1)
    # a call that does not own the keeper neither gets nor leaves a kept cache
    kept = keeper.kept
    assert keeper(**kw) is not kept[1] and keeper.kept is kept and (keeper.made, keeper.reused) == (4, 1)


def test_a_call_that_chose_no_cache_gets_a_static_one_of_a_rounded_length() -> None:
    """transformers' default cache is dynamic: a new shape, so a new graph, at every step. A call
    that chose none gets a static cache, rounded up in length, so that other lengths reuse it."""
    from transformers import DynamicCache, StaticCache

    from solforge.runtime.generation import CACHE_LENGTH_STEP

    m = _model()
    gen = torch.Generator().manual_seed(4)
    short = torch.randint(0, 256, (1, 8), generator=gen).to(DEVICE)
    long = torch.randint(0, 256, (1, 11), generator=gen).to(DEVICE)
    kw: dict[str, Any] = {"do_sample": False, "disable_compile": True}
    with torch.no_grad():
        opt, stats = integrate(m, {})
        keeper = opt.generate.static_caches
        for ids, n in ((short, 3), (long, 4), (short, 3)):
            ref = m.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            assert torch.equal(opt.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw), ref)
        cache = keeper.kept[1]
        assert isinstance(cache, StaticCache) and cache.get_max_cache_shape() == CACHE_LENGTH_STEP
        # one cache for the three calls; a graph for each prompt length and one decode step
        assert (keeper.made, keeper.reused) == (1, 2) and stats.graphs == 3
        # the caller's choices stand: a dynamic cache asked for, no cache, a cache returned
        graphs = stats.graphs
        # (one token each: each new graph is another dynamo trace, seconds, whatever the device)
        assert torch.equal(opt.generate(short, max_new_tokens=1, use_cache=False, **kw),
                           m.generate(short, max_new_tokens=1, use_cache=False, **kw))
        res = opt.generate(short, max_new_tokens=1, return_dict_in_generate=True, **kw)
        assert isinstance(res.past_key_values, DynamicCache)
        assert torch.equal(res.sequences, m.generate(short, max_new_tokens=1, **kw))
        assert stats.graphs > graphs and keeper.made == 1
        # a generation config passed is not changed
        config = transformers.GenerationConfig(max_new_tokens=2, do_sample=False)
        assert torch.equal(opt.generate(short, generation_config=config, disable_compile=True),
                           m.generate(short, generation_config=config, disable_compile=True))
        assert config.cache_implementation is None and keeper.reused == 3


def test_a_call_while_another_runs_leaves_the_model_as_it_was() -> None:
    """Two generate calls overlapping (another thread): the first one in swaps the compiled
    forward in, the last one out puts the model's own back; the second does not own the kept cache."""
    import threading

    m = _model()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    kw: dict[str, Any] = {"max_new_tokens": 2, "min_new_tokens": 2, "do_sample": False, "disable_compile": True}
    with torch.no_grad():
        ref = m.generate(ids, **kw)
        opt, _ = integrate(m, {})
        keeper = opt.generate.static_caches
        inner: list[torch.Tensor] = []

        def nested() -> None:
            with torch.no_grad():
                inner.append(opt.generate(ids, **kw))

        class InAnotherThread(transformers.LogitsProcessor):
            """Runs a whole generate call in another thread during the first step of this one."""

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                if not inner:
                    t = threading.Thread(target=nested)
                    t.start()
                    t.join()
                return scores

        out = opt.generate(ids, logits_processor=transformers.LogitsProcessorList([InAnotherThread()]), **kw)
    assert torch.equal(out, ref) and len(inner) == 1 and torch.equal(inner[0], ref)
    assert keeper.made == 1 and keeper.reused == 0  # the nested call made its own cache, not kept
    assert "forward" not in m.__dict__ and "_prepare_static_cache" not in m.__dict__


def test_a_decode_loop_of_ones_own_runs_inside_step_graphs() -> None:
    """`solforge.step_graphs()` around a decode loop written by hand with a static cache: the
    tokens are the original model's, and on a GPU the steps replay from a CUDA graph."""
    import solforge

    m = _model()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def loop(model: Any, steps: int) -> torch.Tensor:
        cache = transformers.StaticCache(config=m.config, max_cache_len=32)
        out = model(ids, past_key_values=cache, cache_position=torch.arange(8, device=DEVICE), use_cache=True)
        tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
        for i in range(steps):
            pos = torch.tensor([8 + i], device=DEVICE)
            out = model(tokens[-1], past_key_values=cache, cache_position=pos, use_cache=True)
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
        return torch.cat(tokens, dim=1)

    steps = 10 if DEVICE == "cuda" else 3  # off the GPU nothing replays; each step runs the interpreter
    with torch.no_grad():
        ref = loop(m, steps)
        opt, stats = integrate(m, {})
        with solforge.step_graphs():
            got = loop(opt, steps)
    assert torch.equal(got, ref)
    if DEVICE == "cuda":
        # the step: run, timed, then captured once its cache's addresses held for two calls
        decode = max(stats.step_graphs, key=lambda s: s.replays)
        assert decode.replays >= 6 and decode.captures == 1, [s.summary() for s in stats.step_graphs]
    else:  # the CPU: declined (a CUDA graph reads GPU memory only), the graphs run as they are
        assert all(s.replays == 0 for s in stats.step_graphs)
        assert any("cpu" in s.summary() for s in stats.step_graphs)
