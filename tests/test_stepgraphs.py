"""CUDA-graph replay of launch-bound graph calls (stepgraphs.py).

The CPU tests drive StepGraph with a stand-in for CUDA capture that keeps its contract: capturing
runs nothing (every write is undone), the outputs are fixed tensors the replay writes into, and a
replay reads the captured input tensors. Each call's result is compared with the graph run on
copies of the same inputs. The GPU test runs real CUDA graphs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from solforge.stepgraphs import PAY_SAMPLES, StepGraph, step_graphs, written_inputs


def _step(ids: torch.Tensor, cache: torch.Tensor, length: torch.Tensor, w: torch.Tensor) -> Any:
    """A decode step's pattern: write the new entry into the cache at `length`, bump the counter,
    read the cache."""
    h = w[ids]  # (1, 4)
    cache.index_copy_(0, length.reshape(1), h)
    length.add_(1)
    return cache.sum(0, keepdim=True) @ w.t(), length


def _graph() -> torch.fx.GraphModule:
    return make_fx(_step)(torch.zeros(1, dtype=torch.long), torch.zeros(6, 4), torch.zeros((), dtype=torch.long),
                          torch.randn(10, 4))


def _cache() -> tuple[torch.Tensor, torch.Tensor]:
    """A new cache and its length counter, as the step writes them."""
    return torch.zeros(6, 4), torch.zeros((), dtype=torch.long)


def fake_capture(fn: Any, args: list[Any]) -> tuple[Any, Any]:
    snapshot = [(x, x.clone()) for x in args if isinstance(x, torch.Tensor)]
    out = fn(*args)
    for x, saved in snapshot:  # a capture runs nothing
        x.copy_(saved)
    leaves = pytree.tree_leaves(out)

    def replay() -> None:
        for o, new in zip(leaves, pytree.tree_leaves(fn(*args)), strict=True):
            if isinstance(o, torch.Tensor) and o is not new:
                o.copy_(new)

    return replay, out


def launch_bound(fn: Any, args: Any) -> tuple[Any, float, float]:
    return fn(*args), 1.0, 1.0


def gpu_bound(fn: Any, args: Any) -> tuple[Any, float, float]:
    return fn(*args), 0.001, 1.0


def _wrapped(gm: torch.fx.GraphModule, measure: Any = launch_bound) -> StepGraph:
    return StepGraph(gm, capture=fake_capture, measure=measure, needs_cuda=False)


def test_written_inputs_follow_views() -> None:
    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        a.view(-1)[:2].mul_(2)  # through two views
        return b + c

    gm = make_fx(f)(torch.ones(2, 2), torch.ones(2), torch.ones(2))
    assert written_inputs(gm) == {0}
    assert written_inputs(_graph()) == {1, 2}


def test_steps_replay_and_match_the_graph() -> None:
    gm = _graph()
    step = _wrapped(gm)
    w = torch.randn(10, 4)
    cache, length = _cache()
    ref_cache, ref_length = cache.clone(), length.clone()
    outs = []
    with torch.no_grad(), step_graphs():
        for t in range(6):
            ids = torch.tensor([t + 2])  # a new tensor each step: copied into the graph's buffer
            logits, n = step(ids, cache, length, w)
            ref_logits, _ = gm(ids.clone(), ref_cache, ref_length, w)
            assert torch.equal(logits, ref_logits), t
            assert torch.equal(cache, ref_cache) and torch.equal(length, ref_length), t
            assert n is length  # the counter the graph bumps in place comes back as the caller's tensor
            outs.append((logits, logits.clone()))
    # first call plain, second timed, then captured on the third and replayed from there
    assert (step.captures, step.replays, step.declined) == (1, 4, None)
    assert all(torch.equal(a, b) for a, b in outs)  # each result is the caller's own copy
    assert "replayed 4" in step.summary()


def test_a_moved_cache_is_captured_again() -> None:
    gm = _graph()
    step = _wrapped(gm)
    w = torch.randn(10, 4)
    with torch.no_grad(), step_graphs():
        for cache_no in range(2):  # a new cache (another generate call): other addresses
            cache, length = _cache()
            ref_cache, ref_length = cache.clone(), length.clone()
            for t in range(4):
                ids = torch.tensor([t])
                logits, _ = step(ids, cache, length, w)
                assert torch.equal(logits, gm(ids, ref_cache, ref_length, w)[0]), (cache_no, t)
            assert torch.equal(cache, ref_cache)
    # cache 0: plain, timed, captured and replayed, replayed; cache 1: the capture served calls, so
    # it is captured again at once
    assert (step.captures, step.replays) == (2, 6)


def test_no_replay_outside_the_block_with_grad_or_when_not_launch_bound() -> None:
    gm = _graph()
    w = torch.randn(10, 4)

    def run(step: StepGraph) -> torch.Tensor:
        cache, length = _cache()
        for _ in range(4):
            step(torch.tensor([1]), cache, length, w)
        return length

    step = _wrapped(gm)
    with torch.no_grad():
        run(step)
    assert (step.calls, step.captures) == (0, 0)
    with step_graphs():
        run(step)
    assert (step.calls, step.captures) == (0, 0)
    slow = _wrapped(gm, gpu_bound)
    with torch.no_grad(), step_graphs():
        length = run(slow)
    assert slow.captures == 0 and slow.declined is not None and "not launch-bound" in slow.declined
    assert int(length) == 4  # every call ran


def test_a_capture_whose_replays_cost_more_than_running_the_graph_is_dropped() -> None:
    """The timed call's host time is a nanosecond here: no replay (copies, replay, copies) beats it,
    so after the judged replays the capture goes and every later call runs the graph. Each result
    still equals the graph's."""
    gm = _graph()
    w = torch.randn(10, 4)

    def cheap(fn: Any, args: Any) -> tuple[Any, float, float]:
        return fn(*args), 1e-9, 1e-9  # launch-bound, and cheaper than any replay

    step = _wrapped(gm, cheap)
    cache, length = _cache()
    ref_cache, ref_length = cache.clone(), length.clone()
    with torch.no_grad(), step_graphs():
        for t in range(12):
            ids = torch.tensor([t % 10])
            length.zero_(), ref_length.zero_()  # in place: the cache holds 6 entries
            logits, _ = step(ids, cache, length, w)
            assert torch.equal(logits, gm(ids, ref_cache, ref_length, w)[0]), t
            assert torch.equal(cache, ref_cache) and torch.equal(length, ref_length), t
    # plain, timed, then the capture's first replay and PAY_SAMPLES judged ones; plain from then on
    assert (step.captures, step.replays) == (1, 1 + PAY_SAMPLES)
    assert step.declined is not None and "costs more host time than running the graph" in step.declined
    assert step._replay is None and step._outs == [] and step._copied == []  # its memory is let go
    assert step.replay_host_s is not None and step.replay_host_s > 0


def test_a_kept_capture_says_what_a_call_costs_each_way() -> None:
    gm = _graph()
    step = _wrapped(gm)  # the timed call took 1 s of host time: every replay is cheaper
    w = torch.randn(10, 4)
    cache, length = _cache()
    with torch.no_grad(), step_graphs():
        for t in range(10):
            length.zero_()  # in place: the cache holds 6 entries
            step(torch.tensor([t]), cache, length, w)
    assert step.declined is None and step.replays == 8 and step.replay_host_s is not None
    assert "us replayed, 1000000.0 us run as it is" in step.summary()


def test_auto_replays_without_the_block_and_step_graphs_false_turns_it_off() -> None:
    """An optimized model's graphs (auto: integrate's cuda_graphs) replay every call made without
    autograd recording; `step_graphs(False)` is a block without, and autograd recording is never
    replayed."""
    gm = _graph()
    w = torch.randn(10, 4)

    def run(step: StepGraph) -> None:
        cache, length = _cache()
        ref_cache, ref_length = cache.clone(), length.clone()
        for t in range(4):
            out, _ = step(torch.tensor([t]), cache, length, w)
            assert torch.equal(out, gm(torch.tensor([t]), ref_cache, ref_length, w)[0]), t

    step = StepGraph(gm, capture=fake_capture, measure=launch_bound, needs_cuda=False, auto=True)
    with torch.no_grad(), step_graphs(False):
        run(step)
    assert (step.calls, step.captures) == (0, 0)
    run(step)  # autograd recording on
    assert (step.calls, step.captures) == (0, 0)
    with torch.no_grad():
        run(step)
    assert (step.calls, step.captures, step.replays) == (4, 1, 2)


def test_an_optimized_models_graphs_replay_by_default_and_a_capture_s_do_not() -> None:
    from solforge import capture
    from solforge.integrate import integrate, integrate_captured

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    x = torch.randn(2, 4)
    with torch.no_grad():
        cap = capture.capture(model, (x,))
        assert cap.step_graphs and not any(s.auto for s in cap.step_graphs)
        opt, _ = integrate_captured(cap, {})
        assert all(s.auto for s in cap.step_graphs)
        assert torch.equal(opt(x), model(x))
        opt2, stats = integrate(model, {}, cuda_graphs=False)
        opt2(x)
        assert stats.step_graphs and not any(s.auto for s in stats.step_graphs)


def test_an_output_viewing_an_input_is_not_captured() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[1:], x + y

    gm = make_fx(f)(torch.ones(3), torch.ones(3))
    step = _wrapped(gm)
    with torch.no_grad(), step_graphs():
        for i in range(4):
            x, y = torch.full((3,), float(i)), torch.ones(3)
            a, b = step(x, y)
            assert torch.equal(a, x[1:]) and torch.equal(b, x + y)
    assert step.captures == 0 and "view of input 0" in (step.declined or "")


def test_cpu_inputs_are_refused_for_cuda_capture() -> None:
    step = StepGraph(_graph())
    with torch.no_grad(), step_graphs():
        out, _ = step(torch.tensor([1]), torch.zeros(6, 4), torch.zeros((), dtype=torch.long), torch.ones(10, 4))
    assert out.shape == (1, 10)
    assert step.declined is not None and "on the cpu" in step.declined


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_real_cuda_graph_steps_match() -> None:
    gm = _graph().cuda()
    step = StepGraph(gm, measure=launch_bound)  # a graph this small is launch-bound anyway
    w = torch.randn(10, 4, device="cuda")
    cache, length = torch.zeros(6, 4, device="cuda"), torch.zeros((), dtype=torch.long, device="cuda")
    ref_cache, ref_length = cache.clone(), length.clone()
    with torch.no_grad(), step_graphs():
        for t in range(6):
            ids = torch.tensor([t + 1], device="cuda")
            logits, n = step(ids, cache, length, w)
            assert torch.equal(logits, gm(ids, ref_cache, ref_length, w)[0]), t
            assert n is length
    assert torch.equal(cache, ref_cache) and torch.equal(length, ref_length)
    assert (step.captures, step.replays, step.declined) == (1, 4, None)


def test_a_call_while_another_thread_holds_the_graph_runs_it_as_it_is() -> None:
    gm = _graph()
    step = _wrapped(gm)
    w = torch.randn(10, 4)
    cache, length = _cache()
    ref_cache, ref_length = cache.clone(), length.clone()
    with torch.no_grad(), step_graphs():
        for t in range(4):
            ids = torch.tensor([t])
            if t == 3:
                step._lock.acquire()  # another thread inside a replay or capture
            out, _ = step(ids, cache, length, w)
            assert torch.equal(out, gm(ids, ref_cache, ref_length, w)[0]), t
    assert (step.calls, step.captures, step.replays) == (3, 1, 1)  # the last call bypassed the graph
    assert torch.equal(cache, ref_cache)


def test_a_graph_rewritten_in_place_is_captured_again() -> None:
    """integrate_captured rewrites a graph's code in place: a capture of the old code is dropped."""
    gm = _graph()
    step = _wrapped(gm)
    w = torch.randn(10, 4)
    cache, length = _cache()
    with torch.no_grad(), step_graphs():
        for _ in range(4):
            step(torch.tensor([1]), cache, length, w)
        assert (step.captures, step.replays) == (1, 2)
        for node in gm.graph.nodes:  # the same function, written again: new code
            if node.op == "call_function" and node.target is torch.ops.aten.mm.default:
                node.target = torch.ops.aten.matmul.default
        gm.recompile()
        ref_cache, ref_length = cache.clone(), length.clone()
        out, _ = step(torch.tensor([2]), cache, length, w)
        assert torch.equal(out, gm(torch.tensor([2]), ref_cache, ref_length, w)[0])
    assert step.captures == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_an_optimized_small_models_no_grad_forward_replays_on_the_gpu() -> None:
    """A forward of many tiny kernels is launch-bound: under no_grad the optimized model replays it
    from a CUDA graph by itself (calls 1 and 2 run as they are: compile, then timed), with the values
    of the graph run as it is. A call with autograd recording is not one of these replays: it goes
    to the training side (traingraphs.py, tests/test_traingraphs.py), whose first call runs as it is."""
    from solforge.integrate import integrate

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(24):
        layers += [torch.nn.Linear(64, 64), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt, stats = integrate(model, {})
    with torch.no_grad():
        outs = [opt(torch.full((8, 64), 0.01 * i, device="cuda")) for i in range(6)]
        with step_graphs(False):
            plain = [opt(torch.full((8, 64), 0.01 * i, device="cuda")) for i in range(6)]
    (step,) = stats.step_graphs
    assert step.declined is None and step.captures == 1 and step.replays == 4, step.summary()
    for i, (a, b) in enumerate(zip(outs, plain, strict=True)):
        assert torch.equal(a, b), i
    y = opt(torch.ones(8, 64, device="cuda"))  # autograd recording: run as it is, with a graph
    assert y.requires_grad and step.replays == 4
    # (dynamo guards on the grad mode: this call has a graph of its own)
    trained = [s.training for s in stats.step_graphs if s.training is not None]
    assert [(t.calls, t.replays) for t in trained] == [(1, 0)], [s.summary() for s in stats.step_graphs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_no_grad_graph_that_syncs_is_declined_and_random_ops_still_work() -> None:
    """As test_traingraphs' training case: a failed capture with dropout in it leaves the random
    generator usable (stepgraphs.reset_capture_state)."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(x @ w, 0.1, training=True)
        return h.square().sum() + (h > 0).nonzero().float().sum()

    gm = make_fx(f)(torch.randn(4, 8, device="cuda"), torch.randn(8, 8, device="cuda"))
    step = StepGraph(gm, measure=launch_bound, auto=True)
    w = torch.randn(8, 8, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            assert bool(torch.isfinite(step(torch.randn(4, 8, device="cuda"), w)))
    assert step.captures == 0 and "capture failed" in (step.declined or ""), step.summary()
    assert torch.rand(4, device="cuda").shape == (4,)
    torch.nn.functional.dropout(torch.ones(16, device="cuda"), 0.5)
