"""CUDA-graph replay of launch-bound calls made with autograd recording: a small model's training step.

A training forward of a small model is bound by the host, as a decode step is (stepgraphs.py):
on GPT-2 medium (B1 S1024, 2026-11-25) solforge's step spent ~62 ms of host time on ~8 ms of
kernels, one Python autograd Function per fused op in the forward and one formula per op in the
backward. Replaying both from CUDA graphs takes that host time out, as
`torch.cuda.make_graphed_callables` does for a module: the call's forward and its backward are
captured once, then each call replays the forward and hands autograd one node whose backward
replays the backward.

`StepGraph` (stepgraphs.py) owns one `TrainGraph` and sends it the calls made with autograd
recording where some tensor input requires grad, when its replays are on (an optimized model's
calls: integrate's `cuda_graphs`). `SOLFORGE_TRAIN_GRAPHS=0` turns this part off; it is off
under torch.distributed too (DDP, FSDP2: distributed.py says why).

1. The screen. The first call runs the graph as it is. The next ones are timed in pairs: one with
   events around it (the GPU's time from the call's start to its end, idle gaps included: its
   span), then one behind a sleep kernel long enough that the host enqueues the whole call before
   the GPU starts it (stepgraphs.cuda_busy: the GPU's own work, its busy time). A graph is
   captured only when, in one of its first TRAIN_TIMED pairs, the GPU sat idle (span - busy) for
   at least TRAIN_IDLE of the span: only that idle time is what a replay can take out.
2. The judgement. A forward's idle time can still be hidden in a step: the host enqueues a
   backward faster than the GPU runs it, and the queue of GPU work it leaves covers the next
   forward's gaps. Qwen3-4B's forward on an H100 read 6.2 ms idle of a 60.4 ms span (54.2 busy,
   70.2 of host time: 2026-11-26), yet its replayed step was no faster (191.35 ms against
   189.53-192.09 run as it is, 2026-11-25) and held 8 GB more (41.2 GB against 32.9). So the
   first capture is judged on whole steps, as StepGraph judges its captures on calls: blocks of
   TRAIN_BLOCK replays and TRAIN_BLOCK runs of the graph as it is alternate, and the last call of
   each block is timed from its start to the next call's (the host's clock: in a loop, what a
   step takes whichever side bounds it; only a call whose outputs a backward reached in between
   counts). The capture is kept only if its fastest step is under TRAIN_KEEP of the fastest step
   run as it is; otherwise it is dropped, and the graph runs as it is from then
   on. While judged, a run and the capture's pool are both in memory: a capture is judged only
   where the device has TRAIN_JUDGE_ROOM times its pool's size free, and kept unjudged (as the
   screen found it) where not. A dropped capture's pool goes back to the device at once
   (`give_back_pool`).
   Memory is judged too: a capture whose replayed step's peak reserved memory is more than
   TRAIN_MEMORY times the step run as it is without any capture (the peak of the run steps less
   what the capture reserved, the larger of the growth of the memory reserved across it and its
   pool's own segments, and less what every other capture kept on the device reserved: their
   pools count together) is dropped,
   unless SOLFORGE_TRAIN_MEMORY_RULE=0 (settings.train_memory_rule): on two held-out
   decoders the replayed step's peak reserved memory was 35-45% above torch.compile's. A capture
   kept unjudged for want of room is held to the same rule at once, on the memory reserved then. (Until 2026-11-26 the
   host's enqueue time was compared with the span, and the capture kept without a judgement: a
   GPU-bound forward of more launches than the launch queue holds makes the host wait for the
   GPU, so Qwen3-4B's host time read 0.94 of its span and it was captured.) A capture holds its
   activations and its parameters' gradients in memory of its own, which a model whose step the
   GPU bounds must not pay for nothing.
3. The capture is made on a call whose in-place inputs (parameters, inputs the graph writes) sit
   where they sat on the call before, like StepGraph's. Other tensor inputs are copied into
   buffers the graph reads; those that require grad (activations from a graph before a graph
   break) are leaves of the captured graph, so their gradients come out of the backward too.
4. A replayed call returns copies of the graph's outputs, connected to autograd through one node.
   Its backward copies the incoming gradients into the captured buffers, replays the backward and
   hands each input its gradient:
   - a parameter whose `.grad` may be added to in place (accumulate.accumulates_in_place: dense, same
     dtype, no hooks, AccumulateGrad runs in this backward) gets `.grad += g` here and autograd
     gets no gradient for it, as linears.py does;
   - any other input gets a copy (the captured gradient is overwritten by the next replay, and
     AccumulateGrad would keep the tensor it is handed as `.grad`).
5. Where `.grad` is kept from step to step (gradient accumulation, BASELINES.md's step), that add
   is a pass of its own over every weight, which the graph run as it is does inside its GEMMs
   (linears.py) and row by row (embeddings.py): Llama-3.2-1B's step had 4.5 ms more kernel time
   replayed than run as it is (2026-11-25). So when the last two backwards of a capture found
   every input a parameter whose `.grad` may be added to in place, each at the same address, the
   backward is captured once more before the next forward replay, with the captured leaves'
   `.grad` set to those tensors: the fused paths then add into them as they do when run as they
   are. A backward that finds its `.grad` tensors there replays that graph, and autograd gets no
   gradient; any other replays the regular one. The addresses are checked on every backward.
   `SOLFORGE_TRAIN_ACCUMULATE=0` turns this part off.

The activations a backward replay reads are those of the last forward replay. So a forward is
replayed only when no earlier replay of this capture may still be backpropagated: a second call
before the first one's backward (two micro-batches summed, a graph called twice in one step) runs
the graph as it is, with autograd's own graph. A backward that comes after another forward replay
overwrote its activations (a second backward with `retain_graph=True` after a later call) raises
an error instead of returning wrong gradients.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from solforge import settings
from solforge.runtime.accumulate import accumulates_in_place

# settings.train_graphs, .train_accumulate and .train_memory_rule, kept here: read on every step.
# ACCUMULATE: the accumulating backward (module doc, 5); SOLFORGE_TRAIN_ACCUMULATE=0 leaves every
# backward to the regular one. MEMORY_RULE: captures that add too much memory are dropped (module
# doc, 2); SOLFORGE_TRAIN_MEMORY_RULE=0 keeps them whatever memory they add
ENABLED = True
ACCUMULATE = True
MEMORY_RULE = True


def _follow(s: settings.Settings) -> None:
    global ENABLED, ACCUMULATE, MEMORY_RULE
    ENABLED, ACCUMULATE, MEMORY_RULE = s.train_graphs, s.train_accumulate, s.train_memory_rule


settings.follow(_follow, "train_graphs", "train_accumulate", "train_memory_rule")
# the share of a timed forward's span (events around it, idle gaps included) that the GPU sat idle
# (span - its busy time behind a sleep, stepgraphs.cuda_busy) at or above which it is captured:
# only the idle time is what a replay can take out, and a capture holds memory for good
TRAIN_IDLE = 0.1
# The first capture is then judged on whole steps (module doc, 2): the host's time from a call
# to the next call of the graph, in steady state what a step takes whichever side bounds it.
# Calls go in blocks of TRAIN_BLOCK replays, then TRAIN_BLOCK runs of the graph as it is, and so
# on; the last call of each block is timed (the first ones start from the other kind's queue of
# GPU work). After TRAIN_JUDGE_SAMPLES timed steps of each kind (or TRAIN_JUDGE_MIN of each, when
# the fastest of one is under TRAIN_CLEAR of the other's), the capture is kept only if its fastest
# step is under TRAIN_KEEP of the fastest step run as it is.
TRAIN_BLOCK = 2
TRAIN_JUDGE_SAMPLES = 3
TRAIN_JUDGE_MIN = 2
TRAIN_CLEAR = 0.5
TRAIN_KEEP = 0.97
# calls a judging may take (calls that do not follow the blocks, such as a second forward before a
# backward, do not count a step): past it, the capture is kept as the screen's reading says
TRAIN_JUDGE_CALLS = 40
_clock = time.perf_counter  # the host's clock for whole steps (the CPU tests put in their own)
# a judged run of the graph as it is needs its activations beside the capture's pool, which holds
# the same: judged only where the device has this many times the pool's size free, else the
# capture is kept as the screen found it (a run that does not fit would end the caller's training)
TRAIN_JUDGE_ROOM = 1.25
# a kept capture's step may reserve at most this many times the memory of a step run as it is
# without the capture (module doc, 2; SOLFORGE_TRAIN_MEMORY_RULE=0 lifts it)
TRAIN_MEMORY = 1.10
# ... or this many bytes more, whichever is larger: the rule is for the multi-GB steps where a
# replay's pool cost 35-45% (issue "Never worse"); a small model's step on the H100 (2026-11-27)
# reserved 0.10 GiB run as it is and 0.17 GiB replayed, 70 MiB no user misses, and dropping its
# replay would give up the launch-bound step's whole gain
TRAIN_MEMORY_FLOOR = 256 * 2**20

# captures of the accumulating backward a graph gets, in all, before .grad tensors that keep moving
# (a new .grad each step) are left to the regular backward
MAX_ACCUMULATING = 4
# the sleep ahead of a busy call: this many times its span call's host time, plus AHEAD_MIN_S
# (stepgraphs.py uses the same for its judged calls)
AHEAD_FACTOR = 1.5
AHEAD_MIN_S = 50e-6
# pairs of timed calls (span, then busy; the calls after the first) a graph gets to read
# launch-bound before it is declined: one early reading can be off (a host-bound forward read
# 0.85 of host time for its span on its first timing once, qwen3-tiny, 2026-11-25)
TRAIN_TIMED = 2


def _allocated(device: torch.device | None) -> int:
    """Bytes allocated on `device` by torch (0 off CUDA)."""
    return torch.cuda.memory_allocated(device) if device is not None and device.type == "cuda" else 0


def _reserved(device: torch.device | None) -> int | None:
    """Bytes torch's caching allocator holds from `device` now; None off CUDA."""
    return torch.cuda.memory_reserved(device) if device is not None and device.type == "cuda" else None


def _peak_reserved(device: torch.device | None) -> int | None:
    """The most bytes torch's caching allocator has held from `device` (since its peak was last
    reset); None off CUDA."""
    return torch.cuda.max_memory_reserved(device) if device is not None and device.type == "cuda" else None


def _pool_size(pool: Any, device: torch.device | None) -> int | None:
    """Bytes of the segments torch's caching allocator holds from `device` for the private pool
    `pool` (a CUDA graph's, CUDAGraph.pool()): the capture's memory whatever the allocator held
    cached before it; None off CUDA or without a pool."""
    if pool is None or device is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == tuple(pool) and seg.get("device", index) == index)


def _free(device: torch.device | None) -> int | None:
    """Bytes a new allocation on `device` can get: free on the device plus what torch's caching
    allocator holds unused; None off CUDA."""
    if device is None or device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

class TrainCaptureRefused(Exception):
    """A graph whose training calls cannot be replayed; the message says why."""


def reset_capture_state() -> str | None:
    """After a failed CUDA capture: one that ends with an error leaves the CUDA random generators in
    their capturing state (torch 2.11: every later random op on the GPU then fails, "Offset
    increment outside graph capture"). An empty capture that succeeds puts them back. Returns why
    the reset failed, or None."""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    except Exception as e:  # noqa: BLE001 - the caller's decline says what failed first
        return f"{type(e).__name__}: {e}"
    return None


@dataclass
class TrainCapture:
    """What a capture leaves: two replays and the fixed tensors they read and write."""

    forward: Callable[[], None]
    backward: Callable[[], None]
    outputs: Any  # the graph's outputs as captured (pytree); forward replays write them
    differentiable: list[bool]  # per tensor leaf of `outputs`: whether it required grad
    grad_outputs: list[torch.Tensor]  # one buffer per differentiable output leaf; backward reads them
    grads: list[torch.Tensor | None]  # the gradient of each input that requires grad; backward writes them
    generation: int = 0  # forward replays so far: the activations are the last one's
    # captures the backward once more, adding each input's gradient into the given tensor in place
    # instead of writing `grads` (one per input that requires grad; None where its gradient is
    # None): the replay of the result (TrainGraph's accumulating backward); None where not offered
    accumulating: Callable[[Sequence[torch.Tensor | None]], Callable[[], None]] | None = None
    pool: Any = None  # the private memory pool's id (CUDAGraph.pool()); None where there is none


def cuda_capture_train(fn: Callable[..., Any], args: Sequence[Any], needs: Sequence[int],
                       written: Sequence[int] = ()) -> TrainCapture:
    """Capture `fn(*args)` with autograd recording into one CUDA graph, and the gradients of
    `args[i]` for i in `needs` into a second, sharing one private memory pool (the second reads the
    activations the first saves).

    One forward and backward run first on the capture's stream, as make_graphed_callables does:
    what a first call does once (a cuBLAS workspace for the stream, the autograd device thread's
    handles) must not happen inside a capture. The inputs in `written` are put back afterwards:
    the run must leave no trace. Everything runs on the device of the inputs, whatever the
    current device is."""
    device = next(x.device for x in args if isinstance(x, torch.Tensor) and x.is_cuda)
    with torch.cuda.device(device):
        return _capture_train_here(fn, args, needs, written)


def _capture_train_here(fn: Callable[..., Any], args: Sequence[Any], needs: Sequence[int],
                        written: Sequence[int]) -> TrainCapture:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    saved = [(args[i], args[i].detach().clone()) for i in written]
    with torch.cuda.stream(stream):
        with torch.enable_grad():
            out = fn(*args)
        diff = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.grad(diff, [args[i] for i in needs], [torch.ones_like(o) for o in diff], allow_unused=True)
        del out, diff
        with torch.no_grad():
            for x, before in saved:
                x.copy_(before)
    torch.cuda.current_stream().wait_stream(stream)
    del saved
    fwd = torch.cuda.CUDAGraph()
    with torch.enable_grad(), torch.cuda.graph(fwd, stream=stream):
        out = fn(*args)
    tensors = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    diff = [o for o in tensors if o.requires_grad]
    grad_outputs = [torch.empty_like(o) for o in diff]
    bwd = torch.cuda.CUDAGraph()
    leaves = [args[i] for i in needs]
    with torch.cuda.graph(bwd, pool=fwd.pool(), stream=stream):
        # retained: the accumulating backward is captured from the same autograd graph later, and
        # the activations it saves stay allocated in the pool, so no later capture into the pool
        # can put its temporaries where a forward replay writes them
        grads = torch.autograd.grad(diff, leaves, grad_outputs, allow_unused=True, retain_graph=True)
    device = torch.cuda.current_device()
    # the versions the saved tensors were checked against: by the time the accumulating backward is
    # captured, the optimizer has updated the parameters in place and each replay has copied into
    # the input buffers, which autograd's check would refuse (replays read the memory, not versions)
    inputs = [x for x in args if isinstance(x, torch.Tensor)]
    versions = [x._version for x in inputs]

    def accumulating(targets: Sequence[torch.Tensor | None]) -> Callable[[], None]:
        """The backward as a third graph in the pool, run by `backward(inputs=...)` on the captured
        leaves with `.grad` set to `targets`: linears.py and embeddings.py add into them inside their
        GEMMs and row by row (accumulates_in_place), AccumulateGrad adds the rest in place."""
        graph = torch.cuda.CUDAGraph()
        now = [x._version for x in inputs]
        with torch.cuda.device(device):
            try:
                for leaf, t in zip(leaves, targets, strict=True):
                    leaf.grad = t
                _set_versions(inputs, versions)
                with torch.cuda.graph(graph, pool=fwd.pool(), stream=stream):
                    torch.autograd.backward(diff, grad_outputs, inputs=leaves, retain_graph=True)
            finally:
                _set_versions(inputs, now)
                for leaf in leaves:
                    leaf.grad = None
        return graph.replay

    detached = pytree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out)
    return TrainCapture(fwd.replay, bwd.replay, detached, [o.requires_grad for o in tensors], grad_outputs,
                        list(grads), accumulating=accumulating, pool=fwd.pool())


def _set_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Set each tensor's version counter (shared with its views: a parameter's too)."""
    if tensors:
        torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


CaptureTrain = Callable[[Callable[..., Any], Sequence[Any], Sequence[int], Sequence[int]], TrainCapture]


class _Token:
    """Lives as long as one replayed call's autograd node: while it does and its backward has not
    run, the capture's activations are that call's."""

    __slots__ = ("__weakref__", "backwarded", "generation")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.backwarded = False


class _Replayed(torch.autograd.Function):
    """The autograd node of one replayed call: forward copies out the outputs the replay wrote,
    backward replays the captured backward."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)
        outs, call.outputs = call.outputs, []  # the outputs hold this node: a cycle through ctx otherwise
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, call.differentiable, strict=True) if not d])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.call.backward(grads))


class _Call:
    """One replayed call: its outputs and its backward."""

    def __init__(self, owner: TrainGraph, cap: TrainCapture, token: _Token, outputs: list[torch.Tensor],
                 differentiable: list[bool], params: list[torch.nn.Parameter | None]) -> None:
        self.owner, self.cap, self.token = owner, cap, token
        self.outputs, self.differentiable, self.params = outputs, differentiable, params

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        owner, cap = self.owner, self.cap
        if torch.is_grad_enabled():
            raise RuntimeError(
                "solforge: a backward with create_graph=True (a double backward) went through a training "
                "call replayed from a CUDA graph, whose gradients carry no graph of their own. Optimize "
                "with cuda_graphs=False, or set SOLFORGE_TRAIN_GRAPHS=0, for this training loop.")
        if cap.generation != self.token.generation:
            raise RuntimeError(
                "solforge: this backward reads activations that a later call of the same CUDA-graphed "
                "training graph has overwritten (a second backward with retain_graph=True after another "
                "forward). Optimize with cuda_graphs=False, or set SOLFORGE_TRAIN_GRAPHS=0, for this "
                "training loop.")
        bufs = iter(cap.grad_outputs)
        for g, d in zip(grads, self.differentiable, strict=True):
            if not d:
                continue
            buf = next(bufs)
            if g is None:
                buf.zero_()
            elif g.data_ptr() != buf.data_ptr():
                buf.copy_(g)
        # every input a parameter whose .grad may be added to here: where they are
        targets = self._targets()
        where = None if targets is None else tuple(0 if t is None else t.data_ptr() for t in targets)
        acc = owner._acc
        if where is not None and acc is not None and acc[0] is cap and acc[1] == where:
            acc[2]()  # adds into .grad itself: autograd gets no gradient
            self.token.backwarded = True
            owner.backward_replays += 1
            owner.accumulated += 1
            return [None] * len(self.params)
        owner._grads_at(where)
        cap.backward()
        self.token.backwarded = True
        owner.backward_replays += 1
        out: list[torch.Tensor | None] = []
        add_to: list[torch.Tensor] = []
        add_from: list[torch.Tensor] = []
        for x, g in zip(self.params, cap.grads, strict=True):
            if g is None:
                out.append(None)
            elif x is not None and accumulates_in_place(x, g.dtype):
                add_to.append(x.grad)  # type: ignore[arg-type]
                add_from.append(g)
                out.append(None)
            else:
                out.append(g.clone())
        if add_to:
            torch._foreach_add_(add_to, add_from)
        return out

    def _targets(self) -> list[torch.Tensor | None] | None:
        """The `.grad` of each input, where every input is a parameter and each one with a gradient
        may have it added to its `.grad` in place now (accumulate.accumulates_in_place); else None."""
        targets: list[torch.Tensor | None] = []
        for x, g in zip(self.params, self.cap.grads, strict=True):
            if x is None:
                return None
            if g is None:
                targets.append(None)
            elif accumulates_in_place(x, g.dtype):
                targets.append(x.grad)
            else:
                return None
        return targets


def give_back_pool() -> None:
    """After a capture is dropped. Once its graph is gone its pool is free in torch's caching
    allocator, but it stays reserved from the device (what nvidia-smi and other processes see: 8 GB
    for Qwen3-4B's training forward) until torch.cuda.empty_cache(), which this calls. The
    allocator's other cached blocks go back too and are allocated again as needed, once. Nothing
    while a stream is being captured."""
    if torch.cuda.is_available() and torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
        gc.collect()  # the capture's closures and autograd graph can hold each other
        torch.cuda.empty_cache()


# the TrainGraphs holding a capture now (their pools count together in the memory rule)
_HOLDING: weakref.WeakSet[TrainGraph] = weakref.WeakSet()


class TrainGraph:
    """The training-call side of a StepGraph (module doc). `capture` and `measure` are the CUDA
    implementations by default; the CPU tests pass stand-ins with the same contract."""

    def __init__(self, gm: fx.GraphModule, *,
                 capture: CaptureTrain = cuda_capture_train,
                 measure: Callable[..., tuple[Any, float, float]],
                 cost: Callable[..., tuple[Any, float, Any]]) -> None:
        """`measure(fn, args)`: (outputs, host s, GPU span s), stepgraphs.cuda_measure's contract;
        `cost(fn, args, ahead_s)`: (outputs, host s, GPU busy s or a function saying them),
        stepgraphs.cuda_busy's."""
        self.gm = gm
        self._capture = capture
        self._measure = measure
        self._cost = cost
        self.calls = 0
        self.replays = 0
        self.backward_replays = 0
        self.captures = 0
        self.eager_while_pending = 0  # calls run as they are because a replay's backward was still due
        self.launch_bound: bool | None = None
        # the timed pair that read the most idle: its span call's host s and span s, and the busy s
        self.host_s: float | None = None
        self.gpu_s: float | None = None
        self.busy_s: float | None = None
        self._span: tuple[float, float] | None = None  # the last span call's (host s, span s)
        # judging the first capture on whole steps (module doc, 2): the judged calls since the
        # capture (None: not judging), the timed steps of each kind
        self._judge_calls: int | None = None
        self._steps: dict[str, list[float]] = {"replay": [], "run": []}
        self._peaks: dict[str, list[int]] = {"replay": [], "run": []}  # peak reserved bytes at each timed step's end
        # (start, the kind timed or None, [a backward reached its outputs], the call before's had)
        self._last_start: tuple[float, str | None, list[bool], bool] | None = None
        self.judged: tuple[float, float] | None = None  # the fastest step replayed and run, once judged
        self.unjudged: str | None = None  # why the first capture was not judged (too little memory)
        self.pool_bytes = 0  # what the last capture added to the memory allocated (its pool)
        self.pool_reserved: int | None = None  # ... and to the memory reserved (None off CUDA)
        # the peak reserved bytes of a step replayed and of one run as it is without the capture, once judged
        self.peaks: tuple[int, int] | None = None
        self.others = 0  # what other captures' pools reserved when the memory rule was applied
        self.declined: str | None = None
        self._cap: TrainCapture | None = None
        self._key: tuple[Any, ...] | None = None
        self._last_key: tuple[Any, ...] | None = None
        self._served = 0
        self._pending: weakref.ref[_Token] | None = None
        self._needs: list[int] = []
        self._copied: list[tuple[int, torch.Tensor]] = []
        self._outs: list[tuple[str, Any]] = []
        self._out_spec: Any = None
        self._differentiable: list[bool] = []
        self._device: torch.device | None = None  # the CUDA device of the captured inputs
        # the accumulating backward (module doc): (the capture it belongs to, the .grad addresses it
        # adds into, its replay); the addresses the last two regular backwards saw
        self._acc: tuple[TrainCapture, tuple[int, ...], Callable[[], None]] | None = None
        self._grads_seen: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None)
        self.accumulating_captures = 0
        self.accumulated = 0  # backwards replayed into .grad itself
        self.accumulating_declined: str | None = None

    def __call__(self, args: Sequence[Any], key: tuple[Any, ...], inplace: Sequence[int],
                 written: Sequence[int] = ()) -> Any:
        """One call with autograd recording. `key`: the in-place inputs' addresses (StepGraph's);
        `written`: the inputs the graph writes."""
        self.calls += 1
        if self.declined is not None:
            return self.gm(*args)
        now = _clock()
        after_backward = self._step_ended(now)
        key = (*key, *(isinstance(x, torch.Tensor) and x.requires_grad for x in args))
        if self.launch_bound is None:
            if self.calls == 1:  # compilation and first launches: not a measure of anything
                self._last_key = key
                return self.gm(*args)
            self._last_key = key
            return self._judged(args)
        if self._pending_backward():
            self.eager_while_pending += 1
            out = self.gm(*args)
            return out if self._judge_calls is None else self._mark(now, None, out, after_backward)
        if self._cap is not None and key == self._key:
            if self._judge_calls is not None:
                kind = self._judging_kind()
                if kind is None:
                    return self.gm(*args)  # the capture was dropped
                timed = self._judge_calls is not None and self._judge_calls % TRAIN_BLOCK == 0
                out = self.gm(*args) if kind == "run" else self._replay_accumulating(args)
                return self._mark(now, kind if timed else None, out, after_backward)
            return self._replay_accumulating(args)
        if key != self._last_key and self._served < 2:
            self._last_key = key
            return self.gm(*args)
        self._last_key = key
        try:
            first = self.captures == 0
            self._record(args, key, inplace, written)
            if first:
                self._last_start = None
                free = _free(self._device)
                if free is not None and free < TRAIN_JUDGE_ROOM * self.pool_bytes:
                    self.unjudged = (f"{free / 2**30:.1f} GiB free for a run beside the capture's "
                                     f"{self.pool_bytes / 2**30:.1f} GiB")
                    if self._too_much_memory():  # judged on memory now: no steps will be
                        return self.gm(*args)
                else:
                    self._judge_calls = 0
        except TrainCaptureRefused as e:
            self.declined = str(e)
            return self.gm(*args)
        except Exception as e:  # noqa: BLE001 - any capture failure leaves the graph as it is
            self.declined = f"training capture failed: {type(e).__name__}: {str(e)[:200]}"
            self._cap = None
            self._reset()
            return self.gm(*args)
        return self._replay(args)

    def _judged(self, args: Sequence[Any]) -> Any:
        """A timed call (module doc, 1): a span call, then a busy call behind a sleep, which judges
        the pair."""
        if self._span is None:
            out, host, span = self._measure(self.gm, args)
            self._span = (host, span)
            return out
        host, span = self._span
        self._span = None
        out, _, gpu = self._cost(self.gm, args, AHEAD_FACTOR * host + AHEAD_MIN_S)
        busy = gpu(wait=True) if callable(gpu) else gpu
        if busy is None:  # a stand-in that cannot say
            busy = span
        if self.gpu_s is None or self.busy_s is None or (span - busy) * self.gpu_s > (self.gpu_s - self.busy_s) * span:
            self.host_s, self.gpu_s, self.busy_s = host, span, busy
        assert self.gpu_s is not None and self.busy_s is not None
        if self.gpu_s - self.busy_s >= TRAIN_IDLE * self.gpu_s:
            self.launch_bound = True
        elif self.calls > 2 * TRAIN_TIMED:
            self.launch_bound = False
            self.declined = f"training calls not launch-bound: {self._timed_text()}"
        return out

    def _replay_accumulating(self, args: Sequence[Any]) -> Any:
        self._accumulate_from_now(args)
        return self._replay(args)

    def _mark(self, now: float, kind: str | None, out: Any, after_backward: bool) -> Any:
        """A call while the capture is judged, started at `now` (`after_backward`: once a backward
        reached the call before's outputs): a hook on its first output that requires grad says
        when a backward reaches it. With `kind`, its time to the next call is a step of that kind
        if it is a whole step: a backward reached the outputs of the call before it and of it
        before the next call (not so with micro-batches: forwards summed into one backward)."""
        seen = [False]
        first = next((o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad), None)
        if first is not None:
            def reached(g: torch.Tensor) -> None:
                seen[0] = True

            first.register_hook(reached)
        self._last_start = (now, kind, seen, after_backward)
        return out

    def _step_ended(self, now: float) -> bool:
        """At a call's start: the call before's step ends now; if it was a timed, whole step, its
        time goes to its kind. Whether a backward reached the call before's outputs (False where
        that is not known: outside a judgement)."""
        if self._last_start is None:
            return False
        start, kind, seen, after_backward = self._last_start
        self._last_start = None
        if kind is not None and seen[0] and after_backward:
            self._steps[kind].append(now - start)
            peak = _peak_reserved(self._device)
            if peak is not None:
                self._peaks[kind].append(peak)
        return seen[0]

    def _judging_kind(self) -> str | None:
        """While the first capture is judged (module doc, 2): whether this call replays or runs the
        graph as it is, after the judgement the steps so far allow: None once the capture was
        dropped."""
        assert self._judge_calls is not None
        replays, runs = self._steps["replay"], self._steps["run"]
        n = min(len(replays), len(runs))
        clear = n >= TRAIN_JUDGE_MIN and (min(replays) < TRAIN_CLEAR * min(runs)
                                          or min(runs) < TRAIN_CLEAR * min(replays))
        if n >= TRAIN_JUDGE_SAMPLES or clear or self._judge_calls >= TRAIN_JUDGE_CALLS:
            self._judge_calls = None
            if n == 0:  # no whole steps to judge on: the screen's reading stands, memory aside
                return None if self._too_much_memory() else "replay"
            self.judged = (min(replays), min(runs))
            if self.judged[0] >= TRAIN_KEEP * self.judged[1]:
                self.declined = f"a replay saves too little of a step: {self._judged_text()}"
                self.release()
                give_back_pool()
                return None
            return None if self._too_much_memory() else "replay"
        self._judge_calls += 1
        return "replay" if (self._judge_calls - 1) // TRAIN_BLOCK % 2 == 0 else "run"

    def _memory(self) -> tuple[int, int] | None:
        """(the peak reserved bytes of a step replayed, of a step run as it is without any
        capture): the largest peaks read at the end of the timed steps of each kind (where none
        was, the peak now), the run's less what this capture and every other one kept on the
        device reserved (their pools count together: a HF Trainer step of LoRA ran two graphs,
        each judged beside the other's pool); None off CUDA."""
        if self.pool_reserved is None:
            return None
        now = _peak_reserved(self._device)
        replay, run = max(self._peaks["replay"], default=now), max(self._peaks["run"], default=now)
        if replay is None or run is None:
            return None
        return replay, max(0, run - self.pool_reserved - self.others_reserved())

    def others_reserved(self) -> int:
        """What the other captures kept on this graph's device reserved (their pools)."""
        return sum(g.pool_reserved or 0 for g in list(_HOLDING) if g is not self and g._device == self._device)

    def _too_much_memory(self) -> bool:
        """Once the capture is judged (or kept unjudged): whether it raises the step's peak
        reserved memory past TRAIN_MEMORY times that of a step run as it is (and by more than
        TRAIN_MEMORY_FLOOR); if so (and
        SOLFORGE_TRAIN_MEMORY_RULE is on) it is dropped, its pool given back."""
        self.peaks, self.others = self._memory(), self.others_reserved()
        if self.peaks is None or not MEMORY_RULE or \
                self.peaks[0] <= max(TRAIN_MEMORY * self.peaks[1], self.peaks[1] + TRAIN_MEMORY_FLOOR):
            return False
        self.declined = (f"a replay raises the step's peak reserved memory by more than "
                         f"{TRAIN_MEMORY - 1:.0%}: {self._peaks_text()} (SOLFORGE_TRAIN_MEMORY_RULE=0 keeps it)")
        self.release()
        give_back_pool()
        return True

    def _peaks_text(self) -> str:
        assert self.peaks is not None
        return (f"peak reserved {self.peaks[0] / 2**30:.2f} GiB replayed against {self.peaks[1] / 2**30:.2f} GiB "
                "run as it is" + (f", other captures' pools ({self.others / 2**30:.2f} GiB) counted with its own"
                                  if self.others else ""))

    def _judged_text(self) -> str:
        assert self.judged is not None
        return f"a step took {self.judged[0] * 1e3:.2f} ms replayed against {self.judged[1] * 1e3:.2f} ms run as it is"

    def _timed_text(self) -> str:
        assert self.host_s is not None and self.gpu_s is not None and self.busy_s is not None
        return (f"a forward took {self.gpu_s * 1e3:.2f} ms on the GPU, {self.busy_s * 1e3:.2f} ms of it busy "
                f"({self.host_s * 1e3:.2f} ms of host time)")

    def _reset(self) -> None:
        """After a failed CUDA capture: the random generators' state (reset_capture_state)."""
        if self._capture is not cuda_capture_train:
            return
        problem = reset_capture_state()
        if problem is not None:
            self.declined = f"{self.declined}; resetting the capture state failed too: {problem}"

    def _grads_at(self, where: tuple[int, ...] | None) -> None:
        self._grads_seen = (self._grads_seen[1], where)

    def _accumulate_from_now(self, args: Sequence[Any]) -> None:
        """Before a forward replay: capture the accumulating backward for the `.grad` tensors the
        last two backwards found at the same addresses (gradient accumulation, BASELINES.md's step,
        zero_grad(set_to_none=False)) and still find there. Tensors that keep moving get no more
        than MAX_ACCUMULATING captures."""
        cap = self._cap
        before, last = self._grads_seen
        if (not ACCUMULATE or cap is None or cap.accumulating is None or last is None or before != last
                or self.accumulating_declined is not None
                or (self._acc is not None and self._acc[0] is cap and self._acc[1] == last)):
            return
        targets = [None if a == 0 else args[i].grad for i, a in zip(self._needs, last, strict=True)]
        if tuple(0 if t is None else t.data_ptr() for t in targets) != last:
            return
        if self.accumulating_captures >= MAX_ACCUMULATING:
            self.accumulating_declined = f"the .grad tensors moved after {MAX_ACCUMULATING} captures"
            return
        self._acc = None
        try:
            replay = cap.accumulating(targets)
        except Exception as e:  # noqa: BLE001 - the regular backward stays
            self.accumulating_declined = f"capture failed: {type(e).__name__}: {str(e)[:200]}"
            self._reset()
            return
        self._acc = (cap, last, replay)
        self.accumulating_captures += 1

    def _pending_backward(self) -> bool:
        token = self._pending() if self._pending is not None else None
        return token is not None and not token.backwarded

    def _record(self, args: Sequence[Any], key: tuple[Any, ...], inplace: Sequence[int],
                written: Sequence[int]) -> None:
        # the previous capture's memory goes first (a call still holding it keeps it)
        self._cap, self._acc, self._grads_seen = None, None, (None, None)
        _HOLDING.discard(self)
        keep = set(inplace)
        needs = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
        for i in needs:
            if i in keep and not isinstance(args[i], torch.nn.Parameter):
                raise TrainCaptureRefused(f"input {i} requires grad and the graph writes it")
        static: list[Any] = list(args)
        copied: list[tuple[int, torch.Tensor]] = []
        with torch.no_grad():
            for i, x in enumerate(args):
                if isinstance(x, torch.Tensor) and i not in keep:
                    buf = torch.empty_like(x)
                    buf.copy_(x)
                    static[i] = buf.requires_grad_(x.requires_grad)
                    copied.append((i, buf.detach()))
        for i in needs:
            if i in keep:
                # a parameter is captured through a leaf of its own over the same memory: the
                # parameter's AccumulateGrad node may be alive from an earlier step's graph (the
                # caller's last loss holds it), bound to the stream of that step, and a backward
                # captured through it waits on that stream, which ends the capture
                static[i] = args[i].detach().requires_grad_(True)
        device = next((x.device for x in args if isinstance(x, torch.Tensor) and x.is_cuda), None)
        before, reserved = _allocated(device), _reserved(device)
        cap = self._capture(self.gm, static, needs, [i for i in written if isinstance(args[i], torch.Tensor)])
        self.pool_bytes = max(0, _allocated(device) - before)  # the tensors the capture left in its pool
        after = _reserved(device)  # its pool, and what its warm-up run on a stream of its own cached
        # the pool's own segments too: where the allocator already held that much cached, the
        # growth of what it reserved read about nothing (LoRA's first capture: 26 GiB, 2026-11-27)
        self.pool_reserved = None if reserved is None or after is None else \
            max(after - reserved, _pool_size(cap.pool, device) or 0, 0)
        leaves, spec = pytree.tree_flatten(cap.outputs)
        storages = {x.untyped_storage().data_ptr(): i for i, x in enumerate(static) if isinstance(x, torch.Tensor)}
        outs: list[tuple[str, Any]] = []
        seen: set[int] = set()
        for o in leaves:
            if not isinstance(o, torch.Tensor):
                outs.append(("value", o))
                continue
            base = o.untyped_storage().data_ptr()
            if base in storages:
                raise TrainCaptureRefused(f"an output is input {storages[base]} or a view of it: a replay "
                                          "could not return it")
            if base in seen:
                raise TrainCaptureRefused("two outputs share memory: copies of them would not")
            seen.add(base)
            outs.append(("owned", o))
        if len(cap.differentiable) != sum(kind == "owned" for kind, _ in outs) \
                or sum(cap.differentiable) != len(cap.grad_outputs):
            raise TrainCaptureRefused("the captured outputs and their gradient buffers do not match")
        differentiable = list(cap.differentiable)
        self._cap, self._key, self._copied, self._needs = cap, key, copied, needs
        self._device = device
        self._outs, self._out_spec, self._differentiable = outs, spec, differentiable
        self.captures += 1
        self._served = 0
        _HOLDING.add(self)

    def _replay(self, args: Sequence[Any]) -> Any:
        cap = self._cap
        assert cap is not None
        # a graph replays on the current stream of the current device: the model's device
        on = contextlib.nullcontext() if self._device is None else torch.cuda.device(self._device)
        with torch.no_grad(), on:
            for i, buf in self._copied:
                x = args[i]
                if x.shape != buf.shape or x.dtype != buf.dtype:  # dynamo's guards make this unreachable
                    raise RuntimeError(f"solforge training graph: input {i} is {tuple(x.shape)} {x.dtype}, "
                                       f"captured as {tuple(buf.shape)} {buf.dtype}")
                buf.copy_(x)
            cap.forward()
            tensors = [v.clone() for kind, v in self._outs if kind == "owned"]
        cap.generation += 1
        self.replays += 1
        self._served += 1
        token = _Token(cap.generation)
        self._pending = weakref.ref(token)
        inputs = [args[i] for i in self._needs]
        # the backward needs the parameters only (.grad); an activation input is not kept alive
        params = [x if isinstance(x, torch.nn.Parameter) else None for x in inputs]
        call = _Call(self, cap, token, tensors, self._differentiable, params)
        results = iter(_Replayed.apply(call, *inputs))
        leaves = [next(results) if kind == "owned" else v for kind, v in self._outs]
        return pytree.tree_unflatten(leaves, self._out_spec)

    @property
    def settled(self) -> bool:
        """Whether its calls now run the way later ones will: declined, or its capture judged
        (module doc, 2) and replayed often enough that the accumulating backward (5) was captured
        or not."""
        return self.declined is not None or self.calls == 0 or (
            self.captures > 0 and self._judge_calls is None and self.replays >= 3)

    def release(self) -> None:
        self._cap, self._key, self._copied, self._outs, self._acc = None, None, [], [], None
        _HOLDING.discard(self)

    def summary(self) -> str:
        if self.declined is not None:
            return f"training calls not replayed: {self.declined}"
        timed = "" if self.busy_s is None else f" ({self._timed_text()}"
        timed += "" if not timed else f"; {self._judged_text()}" if self.judged is not None else (
            f"; not judged: {self.unjudged}" if self.unjudged is not None else "")
        timed += "" if not timed else f"; {self._peaks_text()})" if self.peaks is not None else ")"
        if self.captures:
            return (f"training: replayed {self.replays} forward(s) and {self.backward_replays} backward(s) "
                    f"from {self.captures} capture(s){timed}"
                    + (f", {self.accumulated} backward(s) adding into .grad in place"
                       if self.accumulated else "")
                    + (f", accumulating backward not used: {self.accumulating_declined}"
                       if self.accumulating_declined else "")
                    + (f", {self.eager_while_pending} call(s) run as they are while a backward was due"
                       if self.eager_while_pending else ""))
        return f"training: {self.calls} call(s), not captured yet"
