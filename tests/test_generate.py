"""Generation through the optimized model (integrate.route_generate): `optimized.generate` runs
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
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, head_dim=16)
    return transformers.Qwen3ForCausalLM(cfg).to(DEVICE).eval()


@pytest.fixture
def norm_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts rmsnorm kernel launches (the custom op calls the module's `rmsnorm`): the final norm
    of every step is one."""
    calls: list[int] = []
    real = rms.rmsnorm

    def spy(*a: Any, **kw: Any) -> torch.Tensor:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(rms, "rmsnorm", spy)
    return calls


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generate_runs_the_kernels_and_matches(cache: str, norm_calls: list[int]) -> None:
    m = _model()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kw: dict[str, Any] = {"max_new_tokens": 5, "do_sample": False, "disable_compile": True}
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        ref = m.generate(ids, **kw)
        opt, stats = integrate(m, {})
        out = opt.generate(ids, **kw)
    assert torch.equal(out, ref)
    # one graph for the prompt, then the decode steps: one shape with a static cache, one per
    # cache length with a dynamic one
    assert stats.graphs == (2 if cache == "static" else 5)
    # the final norm, once a step: the kernel ran in every step, launched from Python or replayed
    # from a CUDA graph (captures call it without running it)
    steps = sum(s.replays for s in stats.step_graphs)
    assert len(norm_calls) - sum(s.captures for s in stats.step_graphs) + steps == 5
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
        # 11 decode steps a call: the first call's first two run as they are (compile, timing); a
        # later call's new cache is captured at its first step
        assert replays == 9 + 2 * 11, [s.summary() for s in stats.step_graphs]
    else:
        assert replays == 0
