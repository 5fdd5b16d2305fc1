"""CUDA-graph replay of launch-bound training calls (traingraphs.py, through stepgraphs.StepGraph).

The CPU tests drive it with a stand-in for the two CUDA captures that keeps their contract:
capturing runs nothing (inputs are restored), the outputs, gradient buffers and gradients are
fixed tensors, a forward replay writes the outputs from the captured inputs and a backward replay
writes the gradients of the captured inputs from the last forward replay's activations. Every
result is compared with autograd through the graph run as it is, on copies of the parameters.
The GPU tests run real CUDA graphs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from solforge.runtime import traingraphs
from solforge.runtime.stepgraphs import StepGraph, step_graphs, wall_time
from solforge.runtime.traingraphs import TrainCapture


def _f(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
       count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.nn.functional.gelu(x @ w1.t() + b1)
    count.add_(1)  # a buffer the graph writes (used in place, like a parameter)
    return h @ w2.t(), h.sum(-1), (x > 0).sum()


def _graph() -> torch.fx.GraphModule:
    return make_fx(_f)(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5), torch.randn(2, 5),
                       torch.zeros((), dtype=torch.long))


def fake_capture_train(fn: Any, args: list[Any], needs: list[int], written: list[int]) -> TrainCapture:
    snapshot = [(x, x.detach().clone()) for x in args if isinstance(x, torch.Tensor)]
    with torch.enable_grad():
        out = fn(*args)
    tensors = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    diff = [o for o in tensors if o.requires_grad]
    grad_outputs = [torch.empty_like(o) for o in diff]
    probe = torch.autograd.grad(diff, [args[i] for i in needs], [torch.zeros_like(o) for o in diff],
                                allow_unused=True)
    grads = [None if g is None else torch.full_like(g, float("nan")) for g in probe]
    with torch.no_grad():
        for x, saved in snapshot:  # a capture runs nothing
            x.copy_(saved)
    last: dict[str, Any] = {}

    def forward() -> None:
        with torch.enable_grad():
            new = fn(*args)
        last["out"] = new
        for o, n in zip(tensors, [n for n in pytree.tree_leaves(new) if isinstance(n, torch.Tensor)], strict=True):
            o.copy_(n.detach())

    def backward() -> None:
        new_diff = [n for n in pytree.tree_leaves(last["out"]) if isinstance(n, torch.Tensor) and n.requires_grad]
        # retained: a CUDA graph's backward can be replayed again on the same activations
        got = torch.autograd.grad(new_diff, [args[i] for i in needs], grad_outputs, allow_unused=True,
                                  retain_graph=True)
        for s, g in zip(grads, got, strict=True):
            if s is not None:
                s.copy_(g)

    def accumulating(targets: list[torch.Tensor | None]) -> Any:
        leaves = [args[i] for i in needs]

        def replay() -> None:  # the CUDA version's backward(inputs=...), run on the last activations
            new_diff = [n for n in pytree.tree_leaves(last["out"]) if isinstance(n, torch.Tensor) and n.requires_grad]
            for leaf, t in zip(leaves, targets, strict=True):
                leaf.grad = t
            try:
                torch.autograd.backward(new_diff, grad_outputs, inputs=leaves, retain_graph=True)
            finally:
                for leaf in leaves:
                    leaf.grad = None

        accumulating_made.append(targets)
        return replay

    detached = pytree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out)
    return TrainCapture(forward, backward, detached, [o.requires_grad for o in tensors], grad_outputs, grads,
                        accumulating=accumulating)


accumulating_made: list[Any] = []  # the targets of each accumulating backward the stand-in captured


def launch_bound(fn: Any, args: Any) -> tuple[Any, float, float]:
    return fn(*args), 1.0, 1.0


def gpu_bound(fn: Any, args: Any) -> tuple[Any, float, float]:
    return fn(*args), 0.5, 1.0


def busy(*readings: float) -> Any:
    """A stand-in `cost` whose calls report these GPU busy seconds in turn (the last one after),
    with the sleep ahead each was asked for in `busy.aheads`."""
    left = list(readings)

    def cost(fn: Any, args: Any, ahead_s: float) -> tuple[Any, float, float]:
        cost.aheads.append(ahead_s)  # type: ignore[attr-defined]
        return fn(*args), 0.0, left.pop(0) if len(left) > 1 else left[0]

    cost.aheads = []  # type: ignore[attr-defined]
    return cost


@pytest.fixture(autouse=True)
def _no_judgement(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first capture is kept without judging it on whole steps (traingraphs' module doc, 2),
    so that the tests' counts of replays do not depend on the machine's clock; the tests of the
    judgement put it back."""
    monkeypatch.setattr(traingraphs, "TRAIN_JUDGE_CALLS", 0)


def _wrapped(gm: torch.fx.GraphModule, measure: Any = launch_bound, cost: Any = None) -> StepGraph:
    return StepGraph(gm, capture_train=fake_capture_train, measure=measure, needs_cuda=False, auto=True,
                     cost=cost)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((5, 4), (5,), (2, 5))]


def _x(i: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + i))


def _loss(out: Any) -> torch.Tensor:
    return out[0].square().sum() + 0.5 * out[1].sum()


def _train(call: Any, params: list[torch.nn.Parameter], steps: int, *, zero: bool = True,
           x_grad: bool = False) -> tuple[list[torch.Tensor], list[Any]]:
    """`steps` SGD steps through `call`; the losses, and per step the gradients seen."""
    count = torch.zeros((), dtype=torch.long)
    losses, seen = [], []
    for i in range(steps):
        x0 = _x(i).requires_grad_(x_grad)
        x = x0 * 1.5 if x_grad else x0  # an activation from an earlier graph: its gradient is wanted
        out = call(x, *params, count)
        loss = _loss(out)
        loss.backward()
        losses.append(loss.detach())
        seen.append([p.grad.clone() for p in params] + ([x0.grad.clone()] if x_grad else []))
        with torch.no_grad():
            for p in params:
                p -= 0.01 * p.grad  # type: ignore[operator]
        if zero:
            for p in params:
                p.grad = None
    return losses, [count, *seen]


@pytest.mark.parametrize("zero", [True, False], ids=["grad-set-to-none", "grad-accumulated"])
@pytest.mark.parametrize("x_grad", [False, True], ids=["params", "params-and-activation"])
def test_training_calls_replay_with_the_graphs_gradients(zero: bool, x_grad: bool) -> None:
    gm = _graph()
    step = _wrapped(gm)
    got_losses, got = _train(step, _params(), 8, zero=zero, x_grad=x_grad)
    exp_losses, exp = _train(gm, _params(), 8, zero=zero, x_grad=x_grad)
    t = step.training
    assert t is not None and t.declined is None, step.summary()
    # call 1 runs as it is, calls 2 and 3 are timed (its span, then its busy time), call 4 is
    # captured and replayed, then replays
    assert (t.calls, t.captures, t.replays, t.backward_replays) == (8, 1, 5, 5), t.summary()
    # with .grad kept and every input a parameter, backwards 4 and 5 found the .grad tensors at the
    # same addresses: call 6 captured the accumulating backward, and backwards 6 to 8 replayed it
    assert t.accumulated == (3 if not zero and not x_grad else 0), t.summary()
    assert t.accumulating_captures == (1 if not zero and not x_grad else 0)
    assert torch.equal(got[0], exp[0]) and int(got[0]) == 8  # the written buffer: once a call
    for i, (a, b) in enumerate(zip(got_losses, exp_losses, strict=True)):
        assert torch.equal(a, b), i
    for i, (a, b) in enumerate(zip(got[1:], exp[1:], strict=True)):
        for j, (ga, gb) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-6, msg=f"step {i} grad {j}")


def test_the_accumulating_backward_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traingraphs, "ACCUMULATE", False)
    gm = _graph()
    step = _wrapped(gm)
    got_losses, got = _train(step, _params(), 8, zero=False)
    exp_losses, exp = _train(gm, _params(), 8, zero=False)
    t = step.training
    assert t is not None and (t.replays, t.accumulated, t.accumulating_captures) == (5, 0, 0), t.summary()
    for i, (a, b) in enumerate(zip(got[1:], exp[1:], strict=True)):
        for j, (ga, gb) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-6, msg=f"step {i} grad {j}")


def test_grad_tensors_that_move_get_the_regular_backward_then_a_capture_of_their_own() -> None:
    """After the accumulating backward is captured for one set of .grad tensors, new ones (the
    caller replaced them) get the regular backward until they have held for two backwards."""
    gm = _graph()
    step = _wrapped(gm)
    params, ref = _params(), _params()
    count, ref_count = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
    t = None
    for i in range(11):
        if i == 7:  # new .grad tensors, same values
            for p in params:
                p.grad = p.grad.clone()  # type: ignore[union-attr]
        _loss(step(_x(i), *params, count)).backward()
        _loss(gm(_x(i), *ref, ref_count)).backward()
        t = step.training
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6, msg=f"step {i}")
    assert t is not None
    # backwards 6 and 7 added into the first .grad tensors; the moved ones were found by backwards
    # 8 and 9 (the regular one), the accumulating one was captured for them before call 10, and
    # backwards 10 and 11 added into them
    assert (t.accumulating_captures, t.accumulated) == (2, 4), t.summary()
    assert "4 backward(s) adding into .grad in place" in t.summary()


def test_a_second_call_before_the_backward_runs_as_it_is() -> None:
    """Two micro-batches summed into one backward: the second forward would overwrite the first's
    activations, so it runs with autograd's own graph, and the gradients are the sum's."""
    gm = _graph()
    step = _wrapped(gm)
    params, ref = _params(), _params()
    count, ref_count = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
    for i in range(4):  # up to the capture
        _loss(step(_x(i), *params, count)).backward()
        _loss(gm(_x(i), *ref, ref_count)).backward()
    loss = _loss(step(_x(4), *params, count)) + _loss(step(_x(5), *params, count))
    loss.backward()
    ref_loss = _loss(gm(_x(4), *ref, ref_count)) + _loss(gm(_x(5), *ref, ref_count))
    ref_loss.backward()
    t = step.training
    assert t is not None and (t.replays, t.eager_while_pending) == (2, 1), t.summary()
    assert torch.equal(loss, ref_loss)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6)
    # the backward ran: the next call replays again
    _loss(step(_x(6), *params, count)).backward()
    assert (t.replays, t.eager_while_pending) == (3, 1)


def test_a_call_whose_outputs_were_dropped_does_not_hold_the_next_one_back() -> None:
    gm = _graph()
    step = _wrapped(gm)
    params = _params()
    count = torch.zeros((), dtype=torch.long)
    for i in range(4):
        _loss(step(_x(i), *params, count)).backward()
    step(_x(4), *params, count)  # an evaluation with autograd on: no backward, outputs dropped
    out = step(_x(5), *params, count)
    t = step.training
    assert t is not None and (t.replays, t.eager_while_pending) == (3, 0), t.summary()
    ref = [p.detach().clone().requires_grad_() for p in params]
    torch.testing.assert_close(out[0], gm(_x(5), *ref, count.clone())[0], rtol=0, atol=0)


def test_a_backward_after_a_later_replay_overwrote_its_activations_raises() -> None:
    gm = _graph()
    step = _wrapped(gm)
    params = _params()
    count = torch.zeros((), dtype=torch.long)
    for i in range(4):
        _loss(step(_x(i), *params, count)).backward()
    first = _loss(step(_x(4), *params, count))
    first.backward(retain_graph=True)
    first.backward(retain_graph=True)  # the activations are still this call's: allowed
    _loss(step(_x(5), *params, count)).backward()
    with pytest.raises(RuntimeError, match="overwritten"):
        first.backward()


def test_a_double_backward_through_a_replay_says_what_to_do() -> None:
    gm = _graph()
    step = _wrapped(gm)
    params = _params()
    count = torch.zeros((), dtype=torch.long)
    for i in range(4):
        _loss(step(_x(i), *params, count)).backward()
    with pytest.raises(RuntimeError, match="cuda_graphs=False"):
        torch.autograd.grad(_loss(step(_x(4), *params, count)), params, create_graph=True)


def test_autograd_grad_returns_the_gradients_and_leaves_dot_grad_alone() -> None:
    gm = _graph()
    step = _wrapped(gm)
    params, ref = _params(), _params()
    count = torch.zeros((), dtype=torch.long)
    for p in params:
        p.grad = torch.ones_like(p)
    for i in range(5):
        got = torch.autograd.grad(_loss(step(_x(i), *params, count)), params)
        exp = torch.autograd.grad(_loss(gm(_x(i), *ref, count.clone())), ref)
        for a, b in zip(got, exp, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert step.training is not None and step.training.replays == 2
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)


def test_not_launch_bound_training_calls_are_never_captured() -> None:
    gm = _graph()
    step = _wrapped(gm, gpu_bound, busy(0.95))
    got_losses, _ = _train(step, _params(), 6)
    exp_losses, _ = _train(gm, _params(), 6)
    assert all(torch.equal(a, b) for a, b in zip(got_losses, exp_losses, strict=True))
    t = step.training
    assert t is not None and t.captures == 0 and "not launch-bound" in (t.declined or ""), step.summary()
    assert t.calls == 5 and t.replays == 0  # declined on the second pair; later calls go straight to the graph
    assert "training calls not replayed" in step.summary()
    assert "a forward took 1000.00 ms on the GPU, 950.00 ms of it busy (500.00 ms of host time)" in step.summary()


def test_a_forward_whose_host_waits_on_a_busy_gpu_is_not_captured() -> None:
    """Qwen3-4B's training forward on an H100 (2026-11-26): the host took 56.93 ms to enqueue a
    forward the GPU spent 60.57 ms on, because a GPU-bound call of more launches than the queue
    holds makes the host wait. Its host time is 0.94 of the span, but the GPU was busy for all but
    a few percent of it: a capture takes out nothing and holds memory."""
    gm = _graph()

    def waiting(fn: Any, args: Any) -> tuple[Any, float, float]:
        return fn(*args), 56.93e-3, 60.57e-3

    step = _wrapped(gm, waiting, busy(58.1e-3, 57.9e-3))
    _train(step, _params(), 6)
    t = step.training
    assert t is not None and t.captures == 0 and "not launch-bound" in (t.declined or ""), step.summary()
    # each busy call slept ahead of itself 1.5 times its span call's host time, plus 50 us
    assert busy_aheads(step) == pytest.approx([1.5 * 56.93e-3 + 50e-6] * 2)
    # the pair that read the most idle is the one reported
    assert "60.57 ms on the GPU, 57.90 ms of it busy (56.93 ms of host time)" in t.summary()


def busy_aheads(step: StepGraph) -> list[float]:
    return step._cost.aheads  # type: ignore[attr-defined,union-attr]


@pytest.mark.parametrize("idle", [0.12, 0.09])
def test_a_forward_the_gpu_waited_on_is_captured_from_a_tenth_of_its_span(idle: float) -> None:
    """The GPU idle for at least TRAIN_IDLE (a tenth) of a forward's span in one of the first two
    pairs: captured after that pair; below it in both: declined after the second."""
    gm = _graph()
    step = _wrapped(gm, launch_bound, busy(0.99, 1.0 - idle))  # the second pair reads the idle
    _train(step, _params(), 7)
    t = step.training
    assert t is not None
    if idle >= traingraphs.TRAIN_IDLE:
        assert t.declined is None and t.captures == 1 and t.replays == 2, t.summary()
        assert f"1000.00 ms on the GPU, {(1 - idle) * 1e3:.2f} ms of it busy" in t.summary()
    else:
        assert t.captures == 0 and "not launch-bound" in (t.declined or ""), t.summary()


def test_off_by_switch_by_block_and_without_inputs_that_require_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    gm = _graph()
    step = _wrapped(gm)
    with step_graphs(False):
        _train(step, _params(), 4)
    assert step.training is None
    monkeypatch.setattr(traingraphs, "ENABLED", False)
    _train(step, _params(), 4)
    assert step.training is None
    monkeypatch.setattr(traingraphs, "ENABLED", True)
    frozen = [p.detach() for p in _params()]
    for i in range(4):  # autograd on, nothing requires grad: the graph runs as it is
        step(_x(i), *frozen, torch.zeros((), dtype=torch.long))
    assert step.training is None and step.calls == 0


def test_new_parameter_addresses_are_captured_again() -> None:
    gm = _graph()
    step = _wrapped(gm)
    _train(step, _params(), 5)
    got_losses, _ = _train(step, _params(1), 6)  # another model's parameters through the same graph
    exp_losses, _ = _train(gm, _params(1), 6)
    assert all(torch.equal(a, b) for a, b in zip(got_losses, exp_losses, strict=True))
    t = step.training
    assert t is not None and t.captures == 2, t.summary()


def _clocked_steps(monkeypatch: pytest.MonkeyPatch, step: StepGraph, params: list[torch.nn.Parameter],
                   steps: int, replay_s: float, run_s: float, *, zero: bool = True,
                   forwards: int = 1) -> list[str]:
    """`steps` SGD steps through `step` and through its graph, on a stand-in host clock that
    advances by `replay_s` over a step whose forward replayed and by `run_s` over one run as it
    is; every loss and gradient is checked against the graph's. `forwards` calls are summed into
    each backward (micro-batches) from the fifth step on (after the capture: the stand-in capture
    puts every input back, which a forward still to be backpropagated cannot take). What each step
    did, in order."""
    judge_calls = 40 if forwards == 1 else 8
    monkeypatch.setattr(traingraphs, "TRAIN_JUDGE_CALLS", judge_calls)
    now = [0.0]
    monkeypatch.setattr(traingraphs, "_clock", lambda: now[0])
    gm = step.gm
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    count, ref_count = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
    kinds = []
    for i in range(steps):
        before = 0 if step.training is None else step.training.replays
        n = forwards if i >= 4 else 1
        loss = sum(_loss(step(_x(i + k), *params, count)) for k in range(n))
        ref_loss = sum(_loss(gm(_x(i + k), *ref, ref_count)) for k in range(n))
        loss.backward()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), i
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6, msg=f"step {i}")
        replayed = step.training is not None and step.training.replays > before
        kinds.append("R" if replayed else "P")
        now[0] += replay_s if replayed else run_s
        with torch.no_grad():
            for group in (params, ref):
                for p in group:
                    p -= 0.01 * p.grad  # type: ignore[operator]
                    if zero:
                        p.grad = None
    return kinds


@pytest.mark.parametrize("zero", [True, False], ids=["grad-set-to-none", "grad-accumulated"])
def test_a_capture_whose_steps_are_no_faster_is_dropped(monkeypatch: pytest.MonkeyPatch, zero: bool) -> None:
    """Qwen3-4B's case (2026-11-26): the forward passed the screen, but a replayed step takes about
    what a step run as it is does. Blocks of two replays and two runs alternate, the second of each
    timed; after three of each the capture goes, and every call after runs the graph as it is."""
    step = _wrapped(_graph())
    kinds = _clocked_steps(monkeypatch, step, _params(), 20, 0.190, 0.191, zero=zero)
    t = step.training
    assert t is not None
    # plain, span, busy, captured and replayed; then RR PP RR PP RR PP, judged at the next call
    assert "".join(kinds) == "PPPR" + "RRPPRRPPRRPP" + "P" * 4, kinds
    assert t.judged == pytest.approx((0.190, 0.191))
    assert t.declined == ("a replay saves too little of a step: a step took 190.00 ms replayed against "
                          "191.00 ms run as it is"), t.summary()
    assert t._cap is None and t.settled
    assert "training calls not replayed: a replay saves too little" in step.summary()


@pytest.mark.parametrize("zero", [True, False], ids=["grad-set-to-none", "grad-accumulated"])
def test_a_capture_whose_steps_are_faster_is_kept(monkeypatch: pytest.MonkeyPatch, zero: bool) -> None:
    """GPT-2 medium's case (2026-11-25: 64.28 ms a step run as it is, 8.48 replayed): after two
    timed steps of each kind one is under half the other, and the capture stays."""
    step = _wrapped(_graph())
    kinds = _clocked_steps(monkeypatch, step, _params(), 16, 0.0085, 0.0643, zero=zero)
    t = step.training
    assert t is not None and t.declined is None, t.summary()
    assert "".join(kinds) == "PPPR" + "RRPPRRPP" + "R" * 4, kinds
    assert t.judged == pytest.approx((0.0085, 0.0643)) and t.settled
    assert "a step took 8.50 ms replayed against 64.30 ms run as it is" in t.summary()
    if not zero:  # the accumulating backward was captured and used between the runs
        assert t.accumulated > 0, t.summary()


def test_a_capture_not_yet_judged_is_not_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    step = _wrapped(_graph())
    _clocked_steps(monkeypatch, step, _params(), 8, 0.0085, 0.0643)
    t = step.training
    assert t is not None and t.captures == 1 and t.replays >= 3 and t.judged is None
    assert not t.settled and not step.settled


def test_a_capture_is_not_judged_without_room_for_a_run_beside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A judged run needs its activations beside the capture's pool: where the device has less
    than TRAIN_JUDGE_ROOM times the pool free, the capture is kept as the screen found it, and the
    summary says why it was not judged."""
    allocated = iter([0, 1000 * 2**20])  # before and after the capture: a 1000 MiB pool
    monkeypatch.setattr(traingraphs, "_allocated", lambda device: next(allocated))
    monkeypatch.setattr(traingraphs, "_free", lambda device: 1200 * 2**20)  # under 1.25 x 1000 MiB
    step = _wrapped(_graph())
    kinds = _clocked_steps(monkeypatch, step, _params(), 10, 0.190, 0.191)
    t = step.training
    assert t is not None and t.declined is None and t.judged is None and t.settled, t.summary()
    assert "".join(kinds) == "PPP" + "R" * 7, kinds
    assert t.pool_bytes == 1000 * 2**20
    assert "not judged: 1.2 GiB free for a run beside the capture's 1.0 GiB" in t.summary()


GiB = 2**30


def _memory(monkeypatch: pytest.MonkeyPatch, before: float, after: float, peak: float) -> None:
    """Stand-ins for the allocator's readings: `before` and `after` reserved around the capture,
    `peak` the peak reserved read at the end of every timed step (GiB)."""
    reserved = iter([int(before * GiB), int(after * GiB)])
    monkeypatch.setattr(traingraphs, "_reserved", lambda device: next(reserved))
    monkeypatch.setattr(traingraphs, "_peak_reserved", lambda device: int(peak * GiB))


def test_a_faster_capture_that_raises_peak_reserved_memory_past_a_tenth_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that reserved 3 GiB (its pool and its warm-up run) on a 14 GiB peak: a step run as
    it is would peak at 11 GiB, so the replay costs 27% more memory. Faster or not, it goes, its pool
    given back, and the summary gives both peaks."""
    _memory(monkeypatch, 10, 13, 14)
    step = _wrapped(_graph())
    kinds = _clocked_steps(monkeypatch, step, _params(), 16, 0.0085, 0.0643)
    t = step.training
    assert t is not None and t.judged == pytest.approx((0.0085, 0.0643)), t.summary()
    assert "".join(kinds) == "PPPR" + "RRPPRRPP" + "P" * 4, kinds
    assert t.peaks == (14 * GiB, 11 * GiB) and t._cap is None and t.settled
    assert t.declined == ("a replay raises the step's peak reserved memory by more than 10%: peak reserved "
                          "14.00 GiB replayed against 11.00 GiB run as it is (SOLFORGE_TRAIN_MEMORY_RULE=0 keeps it)")


@pytest.mark.parametrize("after", [13.0, 11.0], ids=["3-GiB-capture-allowed", "1-GiB-capture"])
def test_a_capture_within_the_memory_rule_or_allowed_more_is_kept(monkeypatch: pytest.MonkeyPatch,
                                                                  after: float) -> None:
    """1 GiB on a 14 GiB peak (7.7% over the 13 GiB a step run as it is needs) is within the rule;
    3 GiB is kept only with SOLFORGE_TRAIN_MEMORY_RULE=0. The summary says both peaks."""
    from solforge import settings

    _memory(monkeypatch, 10, after, 14)
    step = _wrapped(_graph())
    with settings.override(train_memory_rule=after != 13.0):
        kinds = _clocked_steps(monkeypatch, step, _params(), 16, 0.0085, 0.0643)
    t = step.training
    assert t is not None and t.declined is None, t.summary()
    assert "".join(kinds) == "PPPR" + "RRPPRRPP" + "R" * 4, kinds
    assert t.peaks == (14 * GiB, int((24 - after) * GiB))
    assert f"peak reserved 14.00 GiB replayed against {24 - after:.2f} GiB run as it is" in t.summary()


def test_the_pools_of_captures_kept_elsewhere_count_with_a_new_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 GiB capture on a 14 GiB peak is within the rule alone (the test above); with another
    graph's capture holding 2 GiB on the device, a step run as it is without any capture would
    peak at 11 GiB, so the two replays together cost 27% more memory: the new one goes, the summary
    names the other pools."""
    class Held:  # another graph's capture kept on the same device (here: none, the CPU stand-in's)
        pool_reserved, _device = 2 * GiB, None

    held = Held()
    traingraphs._HOLDING.add(held)  # type: ignore[arg-type]
    try:
        _memory(monkeypatch, 10, 11, 14)
        step = _wrapped(_graph())
        kinds = _clocked_steps(monkeypatch, step, _params(), 16, 0.0085, 0.0643)
    finally:
        traingraphs._HOLDING.discard(held)  # type: ignore[arg-type]
    t = step.training
    assert t is not None and t.peaks == (14 * GiB, 11 * GiB) and t._cap is None, t.summary()
    assert "".join(kinds) == "PPPR" + "RRPPRRPP" + "P" * 4, kinds
    assert "other captures' pools (2.00 GiB) counted with its own" in (t.declined or ""), t.declined
    assert t not in traingraphs._HOLDING


def test_a_capture_kept_unjudged_for_want_of_room_is_held_to_the_memory_rule_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No room to judge it on steps: the memory reserved at the capture decides (14 GiB against
    the 11 GiB without its 3), and the capture goes before its first replay."""
    allocated = iter([0, 1000 * 2**20])
    monkeypatch.setattr(traingraphs, "_allocated", lambda device: next(allocated))
    monkeypatch.setattr(traingraphs, "_free", lambda device: 1200 * 2**20)
    _memory(monkeypatch, 10, 13, 14)
    step = _wrapped(_graph())
    kinds = _clocked_steps(monkeypatch, step, _params(), 8, 0.190, 0.191)
    t = step.training
    assert t is not None and t.unjudged is not None and t.replays == 0 and t._cap is None, t.summary()
    assert "".join(kinds) == "P" * 8 and "peak reserved 14.00 GiB" in (t.declined or "")


def test_micro_batches_give_no_whole_steps_and_the_capture_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two forwards summed into each backward: a call's time to the next is no step (no backward
    reached its outputs in between), so no step is timed, and after TRAIN_JUDGE_CALLS judged calls
    the capture stays as the screen found it."""
    step = _wrapped(_graph())
    _clocked_steps(monkeypatch, step, _params(), 20, 0.190, 0.191, forwards=2)
    t = step.training
    assert t is not None and t.declined is None and t.judged is None and t.captures == 1, t.summary()
    assert t._steps == {"replay": [], "run": []} and t.settled


def _mlp(depth: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(64, 64), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the real captures")
def test_an_optimized_models_training_calls_reach_the_replay_through_dynamo() -> None:
    """The whole path on the CPU: integrate's graph (with linears.py's grouped call, which writes no
    input: the activation input is copied, not used in place, so its new address each step does not
    stop the capture) sends training calls to the replay; the stand-in capture is put in after the
    first call made the graph, since the real one needs CUDA tensors."""
    from solforge.integrate import integrate

    model, ref = _mlp(4), _mlp(4)
    opt, stats = integrate(model, {})
    sgd, ref_sgd = torch.optim.SGD(model.parameters(), lr=0.01), torch.optim.SGD(ref.parameters(), lr=0.01)
    for i in range(7):
        x = torch.full((8, 64), 0.01 * (i + 1))
        loss, ref_loss = opt(x).square().mean(), ref(x).square().mean()
        if i == 0:
            (step,) = stats.step_graphs
            step._needs_cuda, step._capture_train, step._measure = False, fake_capture_train, launch_bound
            step._cost = wall_time
            step._refusal, step._inplace = None, None  # classified again, without the CUDA-only refusal
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6)
        sgd.step()
        ref_sgd.step()
        sgd.zero_grad()
        ref_sgd.zero_grad()
    t = step.training
    assert t is not None and (t.captures, t.replays) == (1, 3), step.summary()
    shapes = [tuple(n.meta["val"].shape) for n in step.gm.graph.nodes if n.op == "placeholder"]
    (xi,) = [i for i, sh in enumerate(shapes) if sh == (8, 64)]  # the activation input
    assert step._written == [] and step._inplace is not None and xi not in step._inplace


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("zero", [True, False], ids=["grad-set-to-none", "grad-accumulated"])
def test_an_optimized_small_models_training_steps_replay_on_the_gpu(zero: bool) -> None:
    """Many tiny kernels: the training call is launch-bound and replays from CUDA graphs by itself;
    its losses and gradients are those of the same model with the replays off."""
    from solforge.integrate import integrate

    model, ref_model = _mlp().cuda(), _mlp().cuda()
    opt, stats = integrate(model, {})
    ref, _ = integrate(ref_model, {}, cuda_graphs=False)

    def steps(f: Any, m: torch.nn.Module) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        sgd = torch.optim.SGD(m.parameters(), lr=0.01)
        losses, grads = [], []
        for i in range(9):
            x = torch.full((8, 64), 0.01 * (i + 1), device="cuda")
            loss = f(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in m.parameters()])
            sgd.step()
            if zero:
                sgd.zero_grad(set_to_none=True)
        return losses, grads

    got_losses, got = steps(opt, model)
    exp_losses, exp = steps(ref, ref_model)
    (step,) = stats.step_graphs
    t = step.training
    assert t is not None and t.declined is None and t.captures == 1 and t.replays == 6, step.summary()
    assert t.backward_replays == 6
    # with .grad kept: backwards 4 and 5 found it in place, so 6 to 9 replayed the accumulating one
    assert (t.accumulated, t.accumulating_declined) == (0 if zero else 4, None), step.summary()
    for i, (a, b) in enumerate(zip(got_losses, exp_losses, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"loss {i}")
    for i, (a, b) in enumerate(zip(got, exp, strict=True)):
        for j, (ga, gb) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6, msg=f"step {i} grad {j}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_launch_bound_steps_capture_is_judged_on_whole_steps_and_kept_on_the_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real judgement (traingraphs' module doc, 2) on the host's clock: a step of many tiny
    kernels replays much faster than it runs, so the capture is kept; losses and gradients are
    those of the model with the replays off, through the runs and replays that alternate."""
    from solforge.integrate import integrate

    monkeypatch.setattr(traingraphs, "TRAIN_JUDGE_CALLS", 40)
    model, ref_model = _mlp().cuda(), _mlp().cuda()
    opt, stats = integrate(model, {})
    ref, _ = integrate(ref_model, {}, cuda_graphs=False)
    for m, f in ((model, opt), (ref_model, ref)):
        sgd = torch.optim.SGD(m.parameters(), lr=0.01)
        for i in range(24):
            f(torch.full((8, 64), 0.01 * (i + 1), device="cuda")).square().mean().backward()
            sgd.step()
            sgd.zero_grad(set_to_none=True)
    (step,) = stats.step_graphs
    t = step.training
    assert t is not None and t.declined is None and t.judged is not None, step.summary()
    assert t.judged[0] < traingraphs.TRAIN_CLEAR * t.judged[1], step.summary()
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def _graph_pools_bytes() -> int:
    """What CUDA-graph pools reserve from the device now (the allocator's segments outside its
    default pool)."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_dropped_captures_memory_goes_back_to_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture the judgement drops (a stand-in clock makes every replayed step slower) gives its
    pool back to the device at once: what graph pools reserve falls back to what it was before."""
    import gc

    from solforge.integrate import integrate

    monkeypatch.setattr(traingraphs, "TRAIN_JUDGE_CALLS", 40)
    monkeypatch.setattr(traingraphs, "TRAIN_IDLE", float("-inf"))  # past the screen on any machine
    now = [0.0]
    monkeypatch.setattr(traingraphs, "_clock", lambda: now[0])
    gc.collect()
    torch.cuda.empty_cache()
    before = _graph_pools_bytes()  # other tests' graphs still alive
    model = _mlp().cuda()
    opt, stats = integrate(model, {})
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    pools, declined_at = [], None
    for i in range(24):
        t = stats.step_graphs[0].training if stats.step_graphs else None
        replays = t.replays if t is not None else 0
        opt(torch.full((8192, 64), 0.01 * (i + 1), device="cuda")).square().mean().backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)
        t = stats.step_graphs[0].training
        now[0] += 0.2 if t is not None and t.replays > replays else 0.1
        torch.cuda.synchronize()
        pools.append(_graph_pools_bytes() - before)
        if declined_at is None and t is not None and t.declined is not None:
            declined_at = i
    assert t is not None and t.judged is not None, stats.step_graphs[0].summary()
    assert (t.declined or "").startswith("a replay saves too little"), t.summary()
    assert t.pool_bytes > 32 * 2**20, t.pool_bytes  # 16 layers of 2 MiB activations
    # the pool held the activations while the capture lived (pool_bytes, the memory allocated
    # across the capture, also counts memory outside the pool: 131 MiB against 82 on an H100)
    assert declined_at is not None and max(pools[:declined_at]) > 32 * 2**20, [p >> 20 for p in pools]
    assert all(p <= 0 for p in pools[declined_at:]), [p >> 20 for p in pools]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_tiny_transformers_models_training_replays_and_trains_the_same() -> None:
    """qwen3-tiny through solforge's fused ops and their backward formulas: AdamW steps with the
    training replays on (the default) and off give the same losses and parameters."""
    import copy

    import torch.nn.functional as F

    from solforge.integrate import integrate
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device="cuda", dtype=torch.float32, batch=2, seq=8, weights=None, seed=0)
    models = {"on": lm.model.train(), "off": copy.deepcopy(lm.model).train()}
    steps = {"on": integrate(models["on"], {}), "off": integrate(models["off"], {}, cuda_graphs=False)}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, lm.model.config.vocab_size, (2, 9), generator=g).cuda() for _ in range(2)]
    losses: dict[str, list[float]] = {"on": [], "off": []}
    for name, model in models.items():
        fn = steps[name][0]
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(12):
            ids = batches[i % 2]
            loss = F.cross_entropy(fn(ids[:, :-1]).logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            losses[name].append(float(loss))
    stats = steps["on"][1]
    assert stats.total > 0
    trained = [s.training for s in stats.step_graphs if s.training is not None]
    assert trained and sum(t.replays for t in trained) >= 7, [s.summary() for s in stats.step_graphs]
    assert all(t.backward_replays == t.replays for t in trained)
    for a, b in zip(losses["on"], losses["off"], strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), losses
    worst = max(float((q - p).norm() / p.norm())
                for p, q in zip(models["off"].parameters(), models["on"].parameters(), strict=True))
    assert worst < 1e-4, worst


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_graph_that_syncs_is_declined_and_random_ops_still_work() -> None:
    """nonzero syncs with the host, which a capture refuses. The capture fails with the random
    generator registered in it (dropout); afterwards the graph runs as it is, and random ops on the
    GPU work (a failed capture left the generator in its capturing state until _reset)."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(x @ w, 0.1, training=True)
        return h.square().sum() + (h > 0).nonzero().float().sum()

    gm = make_fx(f)(torch.randn(4, 8, device="cuda"), torch.randn(8, 8, device="cuda"))
    step = StepGraph(gm, measure=launch_bound, auto=True)
    w = torch.nn.Parameter(torch.randn(8, 8, device="cuda"))
    for i in range(4):
        step(torch.randn(4, 8, device="cuda"), w).backward()
        assert w.grad is not None and bool(torch.isfinite(w.grad).all()), i
    t = step.training
    assert t is not None and t.captures == 0 and "capture failed" in (t.declined or ""), step.summary()
    assert torch.rand(4, device="cuda").shape == (4,)
    torch.nn.functional.dropout(torch.ones(16, device="cuda"), 0.5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_model_on_another_gpu_than_the_current_one_replays_there() -> None:
    """The model on cuda:1 while cuda:0 is current: the capture and the replays run on cuda:1."""
    from solforge.integrate import integrate

    model, ref_model = _mlp().to("cuda:1"), _mlp().to("cuda:1")
    opt, stats = integrate(model, {})
    ref, _ = integrate(ref_model, {}, cuda_graphs=False)
    with torch.cuda.device(0):
        for i in range(6):
            x = torch.full((8, 64), 0.01 * (i + 1), device="cuda:1")
            loss, ref_loss = opt(x).square().mean(), ref(x).square().mean()
            loss.backward()
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
            for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6)
    trained = [s.training for s in stats.step_graphs if s.training is not None]
    assert trained and trained[0].replays == 4, [s.summary() for s in stats.step_graphs]
