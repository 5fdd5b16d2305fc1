"""Dynamic shapes (shapes.py): one compiled graph for every size of the dims that changed, its
kernels' configs chosen per call, and the graph made again for sizes that come back, with the
configs of their own workloads and their own CUDA-graph replays."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import DEVICE
from test_stepgraphs import fake_capture, launch_bound
from torch.fx.experimental.proxy_tensor import make_fx

from solforge.integrate import integrate
from solforge.runtime.shapes import ShapeDispatch, bound, hint, symbolic_inputs
from solforge.runtime.stepgraphs import StepGraph, step_graphs

transformers = pytest.importorskip("transformers")


def _scale_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w + x.shape[0]


def _symbolic() -> torch.fx.GraphModule:
    return make_fx(_scale_rows, tracing_mode="symbolic")(torch.randn(5, 4), torch.randn(4))


def test_hint_reads_a_bound_value_and_adds_no_guard() -> None:
    gm = _symbolic()
    x = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]
    rows = x.shape[0]
    assert isinstance(rows, torch.SymInt) and hint(rows) == 5 and hint(rows * 3) == 15
    with bound({rows.node.expr: 9}):
        assert hint(rows) == 9 and hint(rows * 3) == 27
    assert hint(7) == 7 and symbolic_inputs(gm) == [0, 1]  # make_fx's symbolic mode: every size
    assert not rows.node.shape_env.guards  # no size was pinned


def test_a_graph_of_varying_sizes_is_not_replayed_as_it_is() -> None:
    step = StepGraph(_symbolic(), capture=fake_capture, measure=launch_bound, needs_cuda=False)
    w = torch.randn(4)
    with step_graphs(), torch.no_grad():
        for n in (3, 6, 3):
            x = torch.randn(n, 4)
            assert torch.equal(step(x, w), _scale_rows(x, w))
    assert step.replays == 0 and "vary" in (step.declined or "")


def test_the_dispatch_makes_a_graph_for_sizes_that_come_back() -> None:
    gm = _symbolic()
    made: list[tuple[dict[Any, int], StepGraph]] = []

    def specialize(values: dict[Any, int]) -> StepGraph:
        step = StepGraph(gm, capture=fake_capture, measure=launch_bound, needs_cuda=False, sizes_fixed=True)
        made.append((values, step))
        return step

    dispatch = ShapeDispatch(gm, gm, specialize)
    w = torch.randn(4)
    with step_graphs(), torch.no_grad():
        for n in (3, 6, 3, 3, 3, 3, 6, 7):
            x = torch.randn(n, 4)
            assert torch.equal(dispatch(x, w), _scale_rows(x, w))
    # 3 and 6 came back and got their own graph; 7 came once
    assert [list(v.values()) for v, _ in made] == [[3, 4], [6, 4]] and dispatch.made == 2
    three = made[0][1]
    # made and run, timed, captured + replayed, run (the capture is judged: runs and replays alternate)
    assert (three.replays, three.captures) == (1, 1)


def test_a_failure_to_make_one_leaves_the_graph_for_all_sizes() -> None:
    gm = _symbolic()

    def broken(values: dict[Any, int]) -> Any:
        raise RuntimeError("no")

    told: list[str] = []
    dispatch = ShapeDispatch(gm, gm, broken, report=told.append)
    w = torch.randn(4)
    for n in (3, 3, 3):
        x = torch.randn(n, 4)
        assert torch.equal(dispatch(x, w), _scale_rows(x, w))
    assert dispatch.failures == ["RuntimeError: no"] and dispatch.made == 0
    assert len(told) == 1 and "(3, 4)" in told[0] and "RuntimeError: no" in told[0]


def _qwen3() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, head_dim=16)
    return transformers.Qwen3ForCausalLM(cfg).to(DEVICE).eval()


def test_new_lengths_compile_one_graph_and_every_family_still_runs() -> None:
    m = _qwen3()
    opt, stats = integrate(m, {})
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in (8, 12, 16, 12, 20):
            ids = torch.randint(0, 256, (1, n), generator=gen).to(DEVICE)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                got = opt(ids).logits
            assert torch.allclose(got, m(ids).logits, atol=1e-4, rtol=1e-4), n
            ran = {e.name.split("::")[1] for e in prof.events() if e.name.startswith("solforge::")}
            assert ran == {"rmsnorm", "add_rmsnorm", "rope", "swiglu"}, (n, ran)
    # the first length's graph, then one for all lengths (dynamo's automatic dynamic shapes)
    assert stats.graphs == 2 and stats.dynamic and opt.solforge_stats is stats
    assert stats.specialized == 1  # 12 came back


def test_generate_with_new_prompt_lengths_compiles_no_more_graphs() -> None:
    m = _qwen3()
    gen = torch.Generator().manual_seed(2)
    kw: dict[str, Any] = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "disable_compile": True}
    with torch.no_grad():
        opt, stats = integrate(m, {})
        for n in (8, 11, 9, 14):
            ids = torch.randint(0, 256, (1, n), generator=gen).to(DEVICE)
            assert torch.equal(opt.generate(ids, **kw), m.generate(ids, **kw)), n
    # the first prompt's graph, the decode step's (its sizes fixed: a static cache, one token), and
    # one graph for every later prompt length
    assert stats.graphs == 3, stats


def test_a_capture_is_static_whatever_dynamo_saw_before() -> None:
    """dynamo remembers the shapes a function was compiled for across torch.compile calls: a
    capture (what optimize plans and tunes from) still gets a static graph of its inputs."""
    from solforge.capture import capture

    m = torch.nn.RMSNorm(64).to(DEVICE)
    opt, _ = integrate(m, {})
    with torch.no_grad():
        opt(torch.randn(3, 64, device=DEVICE))
        backend = capture(m, (torch.randn(5, 64, device=DEVICE),))
        assert not symbolic_inputs(backend.graphs[0].aten)
        # while a compilation without the capture's setting is dynamic from its first call
        again, stats = integrate(m, {})
        again(torch.randn(7, 64, device=DEVICE))
    assert stats.dynamic and stats.graphs == 1


def test_training_at_new_lengths_gives_the_original_gradients() -> None:
    m = _qwen3().train()
    opt, stats = integrate(m, {}, train=True)
    gen = torch.Generator().manual_seed(3)
    for n in (8, 12, 12, 10):
        ids = torch.randint(0, 256, (1, n), generator=gen).to(DEVICE)
        m.zero_grad(set_to_none=True)
        opt(ids, labels=ids).loss.backward()
        got = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
        m(ids, labels=ids).loss.backward()
        for k, p in m.named_parameters():
            assert p.grad is not None and k in got, k
            assert torch.allclose(got[k], p.grad, atol=1e-5, rtol=1e-4), (n, k)
    assert stats.graphs >= 2 and stats.dynamic and stats.specialized >= 1


def test_a_graph_no_longer_kept_is_released() -> None:
    gm = _symbolic()
    made: list[StepGraph] = []
    evicted: list[Any] = []

    def specialize(values: dict[Any, int]) -> StepGraph:
        made.append(StepGraph(gm, capture=fake_capture, measure=launch_bound, needs_cuda=False, sizes_fixed=True))
        return made[-1]

    def evict(step: Any) -> None:
        step.release()
        evicted.append(step)

    dispatch = ShapeDispatch(gm, gm, specialize, evict=evict)
    dispatch.KEEP = 1
    w = torch.randn(4)
    with step_graphs(), torch.no_grad():
        for n in (3, 3, 3, 3, 6, 6, 3):
            x = torch.randn(n, 4)
            assert torch.equal(dispatch(x, w), _scale_rows(x, w))
    # 3's graph was captured, then dropped for 6's; 3 came back and was made again
    assert made[0].captures == 1 and evicted[:1] == [made[0]] and made[0]._replay is None
    assert len(made) == 3 and evicted == [made[0], made[1]]


def test_a_copy_keeps_the_lowerings_meta() -> None:
    from solforge.runtime.shapes import copy_graph

    gm = _symbolic()
    gm.meta["grad_enabled"] = False
    copy = copy_graph(gm)
    assert copy.meta["grad_enabled"] is False and copy.graph is not gm.graph
    assert [n.meta.get("val") for n in copy.graph.nodes if n.op == "placeholder"] == \
        [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def test_a_region_kept_at_the_tuned_shape_is_kept_at_every_size() -> None:
    """A workload optimize left as the model wrote it (its kernel slower or unverified there) is
    not given a heuristic kernel in the graph for all sizes either."""
    import solforge.kernels.rmsnorm as rms
    from solforge import capture, plan

    m = torch.nn.RMSNorm(64, eps=1e-6).to(DEVICE)
    x = torch.randn(2, 3, 64, device=DEVICE)
    with torch.no_grad():
        (group,) = plan.plan(capture.capture(m, (x,)).graphs)
    torch.compiler.reset()
    opt, stats = integrate(m, {}, keep=[group.workload])
    calls: list[int] = []
    real = rms.rmsnorm
    try:
        rms.rmsnorm = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # type: ignore[assignment]
        with torch.no_grad():
            for n in (3, 5, 7):
                y = torch.randn(2, n, 64, device=DEVICE)
                assert torch.allclose(opt(y), m(y), atol=1e-5)
    finally:
        rms.rmsnorm = real
    assert calls == [] and stats.graphs == 2 and not stats.dynamic and stats.total == 0
