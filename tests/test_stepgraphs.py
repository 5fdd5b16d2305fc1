"""CUDA-graph replay of launch-bound graph calls (stepgraphs.py).

The CPU tests drive StepGraph with a stand-in for CUDA capture that keeps its contract: capturing
runs nothing (every write is undone), the outputs are fixed tensors the replay writes into, and a
replay reads the captured input tensors. Each call's result is compared with the graph run on
copies of the same inputs. The GPU test runs real CUDA graphs."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from solforge.runtime.stepgraphs import PAY_CLEAR, PAY_MARGIN, PAY_SAMPLES, StepGraph, step_graphs, written_inputs


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


class _SlowRun:
    """`gm` whose run costs 20 ms more host time than a replay of it (the stand-in capture's replay
    runs `inner`): every capture is judged worth keeping after its first run and second replay, so
    the counts of replays the tests assert do not depend on the machine."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.inner = gm

    @property
    def graph(self) -> torch.fx.Graph:
        return self.inner.graph

    @property
    def _code(self) -> str:
        return self.inner._code

    def __call__(self, *args: Any) -> Any:
        time.sleep(0.02)
        return self.inner(*args)


def _fast_capture(fn: Any, args: list[Any]) -> tuple[Any, Any]:
    return fake_capture(getattr(fn, "inner", fn), args)


def _wrapped(gm: torch.fx.GraphModule, measure: Any = launch_bound, **kw: Any) -> StepGraph:
    """A StepGraph of `gm` with the stand-in capture, whose runs cost more than its replays."""
    return StepGraph(_SlowRun(gm), capture=_fast_capture, measure=measure, needs_cuda=False, **kw)  # type: ignore[arg-type]


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
        for t in range(6):  # the cache holds 6 entries
            ids = torch.tensor([t + 2])  # a new tensor each step: copied into the graph's buffer
            logits, n = step(ids, cache, length, w)
            ref_logits, _ = gm(ids.clone(), ref_cache, ref_length, w)
            assert torch.equal(logits, ref_logits), t
            assert torch.equal(cache, ref_cache) and torch.equal(length, ref_length), t
            assert n is length  # the counter the graph bumps in place comes back as the caller's tensor
            outs.append((logits, logits.clone()))
    # first call plain, second timed, captured and replayed on the third; the fourth and sixth run
    # the graph and the fifth replays it: with two runs in, the sixth call decides (kept: _SlowRun)
    assert (step.captures, step.replays, step.declined) == (1, 2, None)
    assert step.settled and step.replay_s is not None
    assert all(torch.equal(a, b) for a, b in outs)  # each result is the caller's own copy
    assert "replayed 2" in step.summary()


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
    # cache 0: plain, timed, captured and replayed, run (judging the capture: runs and replays
    # alternate); cache 1: the new addresses run as they are (the capture served one call), then
    # are captured and replayed, then run, which ends the judging (kept), then replayed
    assert (step.captures, step.replays) == (2, 3)


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


def _slow_capture(fn: Any, args: list[Any]) -> tuple[Any, Any]:
    """The stand-in capture, with replays that cost 20 ms more host time than a run."""
    replay, out = fake_capture(fn, args)

    def slow() -> None:
        time.sleep(0.02)
        replay()

    return slow, out


def _decode_steps(step: StepGraph, gm: torch.fx.GraphModule, n: int) -> None:
    """`n` calls of `step` on one cache, each result checked against the graph's."""
    w = torch.randn(10, 4)
    cache, length = _cache()
    ref_cache, ref_length = cache.clone(), length.clone()
    with torch.no_grad(), step_graphs():
        for t in range(n):
            ids = torch.tensor([t % 10])
            length.zero_(), ref_length.zero_()  # in place: the cache holds 6 entries
            logits, _ = step(ids, cache, length, w)
            assert torch.equal(logits, gm(ids, ref_cache, ref_length, w)[0]), t
            assert torch.equal(cache, ref_cache) and torch.equal(length, ref_length), t


def test_a_capture_whose_replays_cost_more_than_running_the_graph_is_dropped() -> None:
    """A replay here costs 20 ms more than a run: after one run and the second replay the capture
    goes, its memory with it, and every later call runs the graph."""
    gm = _graph()
    step = StepGraph(gm, capture=_slow_capture, measure=launch_bound, needs_cuda=False)
    _decode_steps(step, gm, 10)
    # plain, timed, captured and replayed (it uploads), run, replay: judged; runs from then on
    assert (step.captures, step.replays) == (1, 2)
    assert step.declined is not None and "saves too little over running the graph" in step.declined
    assert step._replay is None and step._outs == [] and step._copied == []  # its memory is let go
    assert step.replay_s is not None and step.run_s is not None
    assert step.replay_s >= 0.02 > step.run_s


def test_a_close_call_is_judged_on_more_samples() -> None:
    """Replays and runs that cost about the same (the plain stand-ins) are sampled until
    PAY_SAMPLES replays, then judged on the fastest of each, either way."""
    gm = _graph()
    step = StepGraph(gm, capture=fake_capture, measure=launch_bound, needs_cuda=False)
    _decode_steps(step, gm, 2 + 2 * PAY_SAMPLES + 4)
    assert step.replay_s is not None and step.run_s is not None, step.summary()
    assert (step.declined is None) == (step.replay_s < PAY_MARGIN * step.run_s)
    assert step.captures == 1 and step.replays >= 2


def test_a_capture_whose_replays_cost_less_is_kept_and_says_what_a_call_costs_each_way() -> None:
    gm = _graph()
    step = _wrapped(gm)
    _decode_steps(step, gm, 8)
    # plain, timed, captured and replayed, run, replay, run: judged (kept); then two more replays
    assert step.declined is None and step.replays == 4, step.summary()
    assert step.replay_s is not None and step.run_s is not None
    assert step.run_s >= 0.02 > step.replay_s
    assert "us replayed" in step.summary() and "us run as it is" in step.summary()


def _costed(run: tuple[float, float], replay: tuple[float, float]) -> StepGraph:
    """A StepGraph of the decode graph judged by a stand-in `cost`: each run of the graph reports
    `run` (host s, GPU s), each replay `replay`."""
    gm = _graph()

    def cost(fn: Any, args: Any, ahead_s: float) -> tuple[Any, float, float]:
        assert ahead_s > 0
        host, gpu = run if fn is gm else replay
        return fn(*args), host, gpu

    return StepGraph(gm, capture=fake_capture, measure=launch_bound, needs_cuda=False, cost=cost)


def test_a_replay_that_saves_host_time_but_adds_more_gpu_time_is_dropped() -> None:
    """A replay that takes host time out (5 us to enqueue against a run's 35) but adds GPU time
    (its input and output copies: 40 us against the kernel's 17). A call costs the larger of its
    two parts, 40 against 35: the capture goes. Timed from an idle GPU, as before 2026-11-26, the
    parts add up, 45 against 52, and the capture would have stayed."""
    step = _costed(run=(35e-6, 17e-6), replay=(5e-6, 40e-6))
    gm = step.gm
    assert step.settled  # nothing called yet: nothing to judge
    _decode_steps(step, gm, 4)
    assert not step.settled and step.captures == 1  # captured, being judged
    _decode_steps(step, gm, 2 * PAY_SAMPLES + 4)
    assert step.settled
    assert step.declined is not None and "saves too little over running the graph" in step.declined
    assert (step.replay_s, step.run_s) == (40e-6, 35e-6)
    assert "costs 40.0 us replayed (host 5.0, GPU 40.0) against 35.0 us run as it is (host 35.0, GPU 17.0)" \
        in step.summary()


def test_gpu_times_are_collected_when_they_are_in_and_the_verdict_waits_for_them() -> None:
    """`cuda_busy` does not wait for the GPU: each judged call's GPU time comes as a function that
    says it once the work is done. Here each one is in four polls after its call: the samples are
    taken in call order as they come in, and the verdict comes once enough are in. With
    PAY_BACKLOG out, a call waits for them (and is not timed)."""
    gm = _graph()
    ref: list[StepGraph] = []
    made: list[list[int]] = []
    waited: list[bool] = []

    def cost(fn: Any, args: Any, ahead_s: float) -> tuple[Any, float, Any]:
        host, gpu = ((600e-6, 100e-6) if fn is ref[0].gm else (20e-6, 110e-6))
        polls = [0]
        made.append(polls)

        def later(wait: bool = False) -> float | None:
            polls[0] += 1
            waited.append(wait)
            return gpu if wait or polls[0] > 4 else None

        return fn(*args), host, later

    step = StepGraph(gm, capture=fake_capture, measure=launch_bound, needs_cuda=False, cost=cost)
    ref.append(step)
    _decode_steps(step, gm, 4)  # plain, timed, replay, run: both still out
    assert step.judged is None and len(step._pending) == 2 and not any(waited)
    _decode_steps(step, gm, 8)
    assert any(waited)  # a call found PAY_BACKLOG out and waited
    assert step.judged is not None and step.declined is None, step.summary()
    assert step.replay_s == 110e-6 and step.run_s == 600e-6 and step._pending == []


def test_a_replay_whose_copies_cost_the_gpu_more_than_the_graph_is_dropped_whatever_the_host_saves() -> None:
    """A slow host: the run's enqueue 200 us, the replay's 5; but the replay's copies take the
    GPU's part from 30 us to 80, past PAY_GPU_GROWTH x 30 + PAY_GPU_SLACK_S. A program whose host
    runs ahead pays those 80 us on every call: the capture goes although its cost (80) is under
    the run's (200)."""
    from solforge.runtime.stepgraphs import PAY_GPU_GROWTH, PAY_GPU_SLACK_S

    assert 80e-6 > PAY_GPU_GROWTH * 30e-6 + PAY_GPU_SLACK_S and 80e-6 < PAY_MARGIN * 200e-6
    step = _costed(run=(200e-6, 30e-6), replay=(5e-6, 80e-6))
    _decode_steps(step, step.gm, 8)
    assert step.declined is not None and "adds too much GPU time" in step.declined, step.summary()
    assert step._replay is None and step.settled


def test_a_replay_that_costs_less_on_the_larger_side_is_kept() -> None:
    step = _costed(run=(600e-6, 100e-6), replay=(20e-6, 110e-6))
    _decode_steps(step, step.gm, 8)
    # plain, timed, captured and replayed (uploads), run, replay, run: 110 us is under half of 600
    # (judged: kept), then two more replays
    assert step.settled and step.declined is None and step.replay_s == 110e-6, step.summary()
    assert step.replays == 4


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

    step = _wrapped(gm, auto=True)
    with torch.no_grad(), step_graphs(False):
        run(step)
    assert (step.calls, step.captures) == (0, 0)
    run(step)  # autograd recording on
    assert (step.calls, step.captures) == (0, 0)
    with torch.no_grad():
        run(step)
    assert (step.calls, step.captures, step.replays) == (4, 1, 1)  # the 4th call runs: judging


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
    # plain, timed, captured and replayed, run, replayed; the 6th call replays if the capture was
    # judged worth keeping (a graph of 5 kernels: the host decides)
    assert step.captures == 1 and step.replays >= 2, step.summary()


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
        assert (step.captures, step.replays) == (1, 1)  # plain, timed, captured, run (judging)
        for node in gm.graph.nodes:  # the same function, written again: new code
            if node.op == "call_function" and node.target is torch.ops.aten.mm.default:
                node.target = torch.ops.aten.matmul.default
        gm.recompile()
        for i in range(2):  # the new code runs as it is, then is captured (the old capture served 1)
            ref_cache, ref_length = cache.clone(), length.clone()
            out, _ = step(torch.tensor([2]), cache, length, w)
            assert torch.equal(out, gm(torch.tensor([2]), ref_cache, ref_length, w)[0]), i
    assert step.captures == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_an_optimized_small_models_no_grad_forward_replays_on_the_gpu() -> None:
    """A forward of many tiny kernels is launch-bound: under no_grad the optimized model replays it
    from a CUDA graph by itself (calls 1 and 2 run as they are: compile, then timed; then replays
    and runs alternate, to judge the capture), with the values of the graph run as it is. Its
    replays cost less than half its runs, so the capture is kept once two runs are in. A call with
    autograd recording is not one of these replays: it goes
    to the training side (traingraphs.py, tests/test_traingraphs.py), whose first call runs as it is."""
    from solforge.integrate import integrate

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(24):
        layers += [torch.nn.Linear(64, 64), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt, stats = integrate(model, {})
    with torch.no_grad():
        outs = [opt(torch.full((8, 64), 0.01 * i, device="cuda")) for i in range(13)]
        with step_graphs(False):
            plain = [opt(torch.full((8, 64), 0.01 * i, device="cuda")) for i in range(13)]
    (step,) = stats.step_graphs
    # calls back to back: when the judge's GPU times come in depends on the GPU; half of calls
    # 3-13 at least were replays, and a sync lets the rest in
    assert step.declined is None and step.captures == 1 and step.replays >= 5, step.summary()
    torch.cuda.synchronize()
    with torch.no_grad():
        for _ in range(4):
            opt(torch.ones(8, 64, device="cuda"))
    assert step.settled and step.replay_s is not None and step.run_s is not None, step.summary()
    assert step.replay_s < PAY_CLEAR * step.run_s, step.summary()
    replays = step.replays
    with torch.no_grad():
        opt(torch.ones(8, 64, device="cuda"))
    assert step.replays == replays + 1  # kept: every call replays now
    for i, (a, b) in enumerate(zip(outs, plain, strict=True)):
        assert torch.equal(a, b), i
    y = opt(torch.ones(8, 64, device="cuda"))  # autograd recording: run as it is, with a graph
    assert y.requires_grad and step.replays == replays + 1
    # (dynamo guards on the grad mode: this call has a graph of its own)
    trained = [s.training for s in stats.step_graphs if s.training is not None]
    assert [(t.calls, t.replays) for t in trained] == [(1, 0)], [s.summary() for s in stats.step_graphs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_no_grad_graph_that_syncs_is_declined_and_random_ops_still_work() -> None:
    """As test_traingraphs' training case: a failed capture with dropout in it leaves the random
    generator usable (traingraphs.reset_capture_state)."""

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_busy_times_the_gpu_work_not_the_hosts_gaps() -> None:
    from solforge.runtime.stepgraphs import cuda_busy

    x = torch.randn(1024, device="cuda")

    def gappy(t: torch.Tensor) -> torch.Tensor:
        y = t + 1
        time.sleep(0.002)  # the host's gap between two tiny kernels
        return y * 2

    gappy(x)
    out, host, later = cuda_busy(gappy, (x,), ahead_s=0.006)
    assert callable(later) and later() is None  # nothing waited: the GPU still sleeps
    torch.cuda.synchronize()
    gpu = later()
    assert torch.equal(out, (x + 1) * 2)
    assert gpu is not None and host >= 0.002 and gpu < 0.001, (host, gpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_time_model_warms_up_until_settled() -> None:
    from solforge.tune.timing import time_model

    x = torch.randn(1024, device="cuda")
    calls = [0]

    def fn() -> torch.Tensor:
        calls[0] += 1
        return x * 2

    timed = time_model(fn, "cuda", warmup=1, runs=3, min_runs=3, settled=lambda: calls[0] >= 12)
    assert timed.ok and calls[0] == 12 + 3, calls
    calls[0] = 0
    time_model(fn, "cuda", warmup=1, runs=3, min_runs=3, settled=lambda: False, max_warmup=20)
    assert calls[0] == 20 + 3  # never settles: the warm-up stops at max_warmup


def test_validation_waits_only_for_the_graphs_its_calls_reach() -> None:
    """stepgraphs.settled_since_now: a graph being judged holds the timing back only once a call from
    now on reaches it; one an earlier call compiled and no later call reaches is not waited for."""
    from types import SimpleNamespace

    from solforge.runtime.stepgraphs import settled_since_now

    reached = SimpleNamespace(calls=3, training=None, settled=False)
    left = SimpleNamespace(calls=1, training=None, settled=False)  # e.g. another shape's graph
    graphs: list[Any] = [reached, left]
    settled = settled_since_now(graphs)
    assert settled()  # nothing called since
    reached.calls += 1
    assert not settled()  # reached and still judged
    reached.settled = True
    assert settled()
    training = SimpleNamespace(calls=0, training=SimpleNamespace(calls=1), settled=False)
    graphs.append(training)  # compiled later, and called
    assert not settled()
    training.settled = True
    assert settled()
