"""CUDA-graph replay of a compiled graph's launch-bound calls: the decode step of `generate`.

solforge's graphs run as Python code calling one op after another. For a decode step of a
0.6B-parameter model that is hundreds of launches (at least ~580: the 15 most frequent kernels of
a profiled run), each costing more host time than GPU time: the GPU waits for the host (2026-11-25:
2.8 s for 64 tokens, 8x transformers' CUDA-graphed path). `StepGraph` wraps each graph the
backend compiles (capture.SolforgeBackend) and, where it is switched on (below), replays the
graph from a CUDA graph when that pays.

Where it is on: inside `step_graphs()`, and in an optimized model made with `cuda_graphs=True`
(the default) on every call without autograd recording (`auto`), e.g. an evaluation loop under
`torch.no_grad()` of a small model, whose forward the host bounds as it bounds a decode step.
`step_graphs(False)` turns it off for a block.

1. The first call runs the graph as it is (Triton compiles its kernels on first launch).
2. The second is timed: host time to enqueue it against the GPU time from events around it. The
   graph is launch-bound when the host's time is at least `LAUNCH_BOUND` of the GPU's (the GPU was
   waiting); otherwise it is never captured (a long prompt's prefill is not).
3. A launch-bound graph is captured on the next call whose in-place inputs (below) sit at the same
   addresses as on the call before it, then replayed on every call with those addresses. When
   they move after a capture that served calls (each `generate` call makes a new static cache),
   the graph is captured again at once.
4. The first capture is judged on its next calls, which alternate between a replay and a run of
   the graph as it is. Each is timed twice: the host's time to enqueue it, and the GPU's time
   busy with it, measured behind a sleep kernel long enough that the GPU does not wait for the
   host in between (`cuda_busy`). Nothing waits for the GPU to read the latter: later calls
   collect it (a call timed right after a wait on the GPU reads several times the host time it
   takes in a loop); where PAY_BACKLOG of them are still out (calls back to back, nothing
   synchronizing), a call waits for them and goes untimed. A call's cost is the larger of the
   two: what a loop of such calls takes, whichever side bounds it. Sampling goes on until the
   cheapest of one is under half the other's, with at least PAY_MIN_RUNS runs in (a decode step:
   after two), or PAY_SAMPLES replays. If the cheapest replay (the input copies, the replay and
   the output copies) does not save a tenth of the cheapest run's cost, the capture is dropped
   and the graph runs as it is from then on. A replay trades host time for GPU time: its copies
   are kernels too. For a piece of one or two kernels between graph breaks, or a lone norm, the
   run's host time is hardly more than the replay's, while the copies can cost the GPU more than
   the kernels (a 4096 x 2048 fp32 LayerNorm: 34 us of copies around a 17 us kernel); such a
   capture only holds memory. So a capture whose replay's GPU time exceeds PAY_GPU_GROWTH times
   a run's (plus PAY_GPU_SLACK_S) is dropped too, whatever the host saves: only a loop
   bound by a slow host would gain from it. (Until 2026-11-26 a call was timed once, from an
   idle GPU until it was done: host and GPU time added up, which kept that LayerNorm's capture.)

The inputs a CUDA graph reads are addresses. Parameters, tensors marked static for dynamo and
inputs the graph writes to (the KV cache, its length counter) are used in place: a replay needs
each at the address it had at capture, so a call where one moved captures again (see 3). Every
other tensor input (token ids, positions, the mask) is copied into a buffer the graph reads. An
output that is an input itself is returned as the caller's tensor; any other output is a copy of
the graph's, so it stays valid after the next replay. A capture that fails (an op that syncs with the host, an
input on the CPU, an output that is a view of an input) is recorded in `declined` and the graph
runs as it is from then on. A call made with autograd recording, where an input requires grad (a
training step), goes to the training side instead (traingraphs.py): its forward and backward are
captured together; under torch.distributed it runs as it is (distributed.py says why).

Dynamo guards each static graph on its inputs' shapes, strides and dtypes, so every call of it
has the captured signature; copied inputs are checked again before the copy. A dynamic-shape graph
(one graph for many sizes) is not replayed as it is: shapes.ShapeDispatch makes a graph per set of
sizes that comes back, each in a StepGraph of its own (`sizes_fixed`), which is.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from solforge.runtime import distributed, traingraphs
from solforge.runtime.shapes import symbolic_inputs
from solforge.runtime.traingraphs import reset_capture_state

_DATA_PTR = torch.Tensor.data_ptr
LAUNCH_BOUND = 0.5  # host enqueue time / GPU time at or above which a graph is worth capturing
# Replays of a new capture, and runs of the graph between them, each costed as the larger of its
# host and GPU time (_judged_replay): a capture is kept only if its cheapest replay cost under
# PAY_MARGIN of the cheapest run. A graph of one or two kernels (a piece between graph breaks, a
# lone norm) can cost less to run than a replay's input copies, launch and output copies, which
# the GPU runs too, while its capture holds a memory pool. The verdict comes once one is under
# PAY_CLEAR of the other with PAY_MIN_RUNS runs sampled (a decode step: after two runs and three
# replays), else after PAY_SAMPLES replays.
PAY_SAMPLES = 16
PAY_CLEAR = 0.5
# Runs sampled before any verdict: a graph's first runs can cost several times its later ones
# (a 4096 x 2048 LayerNorm's second call: 224 us of host time, against ~30 later), and judged on
# one of them, a capture whose copies cost the GPU twice the kernel was kept.
PAY_MIN_RUNS = 2
# Judged calls whose GPU time may be outstanding before a call waits for them (_judged_replay)
PAY_BACKLOG = 2
# A replay may add at most this much GPU time to a run's (factor, then seconds): past it the capture
# is dropped whatever the host saves. Its input and output copies are kernels; where they cost the
# GPU more than the graph's own work (a lone 4096 x 2048 LayerNorm: 72.6 us replayed against 25.3
# us, on an H100, 2026-11-26), a program whose host runs ahead of the GPU pays them in full, and
# only a loop bound by a slow host gains.
PAY_GPU_GROWTH = 1.5
PAY_GPU_SLACK_S = 10e-6
PAY_MARGIN = 0.9

# None: each StepGraph's own default (`auto`: on in an optimized model made with cuda_graphs=True)
_ON: contextvars.ContextVar[bool | None] = contextvars.ContextVar("solforge_step_graphs", default=None)


@contextlib.contextmanager
def step_graphs(enabled: bool = True) -> Iterator[None]:
    """Within this block, solforge's compiled graphs replay launch-bound calls from CUDA graphs
    (`enabled`), or never do (`step_graphs(False)`), whatever their own default."""
    token = _ON.set(enabled)
    try:
        yield
    finally:
        _ON.reset(token)


def _node_args(node: fx.Node) -> list[tuple[Any, Any]]:
    """(schema argument, value) pairs of an OpOverload call."""
    schema = node.target._schema  # type: ignore[union-attr]
    pairs = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            pairs.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            pairs.append((arg, node.kwargs[arg.name]))
    return pairs


def written_inputs(gm: fx.GraphModule) -> set[int]:
    """Indices of the placeholders an op of `gm` may write to, directly or through a view.

    A call whose schema is unknown (a higher-order op, a Python function other than getitem) is
    taken to write every input it reaches: such an input is then used in place, which is always
    correct (only a moved address costs a replay). solforge's own graph functions that write no
    input and return new tensors say so (`solforge_pure`: linears.linears, embeddings.embedding)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reach: dict[fx.Node, set[int]] = {n: {i} for i, n in enumerate(placeholders)}
    written: set[int] = set()

    def bases(value: Any) -> set[int]:
        found: set[int] = set()
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, fx.Node):
                found |= reach.get(leaf, set())
        return found

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        # an OpOverload, or a function standing for one (kernels/direct.py) with its schema
        if isinstance(node.target, torch._ops.OpOverload) or hasattr(node.target, "_schema"):
            aliased: set[int] = set()
            for arg, value in _node_args(node):
                info = arg.alias_info
                if info is None:
                    continue
                b = bases(value)
                aliased |= b
                if info.is_write:
                    written |= b
            if aliased and any(r.alias_info is not None for r in node.target._schema.returns):
                reach[node] = aliased
        elif getattr(node.target, "solforge_pure", False):
            continue
        elif node.target.__name__ == "getitem":  # type: ignore[union-attr]
            b = bases(node.args[0])
            if b:
                reach[node] = b
        else:
            b = bases((node.args, node.kwargs))
            written |= b
            if b:
                reach[node] = b
    return written


class CaptureRefused(Exception):
    """A graph that cannot be replayed from a CUDA graph; the message says why."""


def cuda_capture(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Callable[[], None], Any]:
    """Capture `fn(*args)` into a CUDA graph with its own memory pool: (replay, outputs)."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA work of other threads (their own generate, an allocator's cudaMalloc) is
    # neither refused nor able to invalidate this capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn(*args)
    return graph.replay, out


def _timed_call(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, float, Any, Any]:
    """`fn(*args)` between two recorded CUDA events: (outputs, host seconds to enqueue it, the
    events). The host time leaves out the event records."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    out = fn(*args)
    host = time.perf_counter() - t
    end.record()
    return out, host, start, end


def cuda_measure(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, float, float]:
    """Run `fn(*args)`: (outputs, host seconds to enqueue it, GPU seconds from start to end)."""
    out, host, start, end = _timed_call(fn, args)
    end.synchronize()
    return out, host, start.elapsed_time(end) / 1e3


# a judged call's GPU seconds: known, or a function that says them once the GPU is done (else None)
# (`wait=True`: once the GPU is done, waiting for it)
GpuTime = float | Callable[..., float | None]
# clock cycles a second of torch.cuda._sleep's spin, per device, measured at first use
_SLEEP_RATE: dict[int, float] = {}
# the sleep ahead of a costed call: this many times the longest enqueue seen, plus AHEAD_MIN_S
AHEAD_FACTOR, AHEAD_MIN_S = traingraphs.AHEAD_FACTOR, traingraphs.AHEAD_MIN_S


def _sleep_cycles_per_s() -> float:
    dev = torch.cuda.current_device()
    rate = _SLEEP_RATE.get(dev)
    if rate is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # loaded before it is timed
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        rate = _SLEEP_RATE[dev] = 2e6 / max(start.elapsed_time(end) / 1e3, 1e-6)
    return rate


def cuda_busy(fn: Callable[..., Any], args: Sequence[Any], ahead_s: float) -> tuple[Any, float, GpuTime]:
    """Run `fn(*args)` behind `ahead_s` seconds of GPU sleep: (outputs, host seconds to enqueue it,
    GPU seconds busy with it). While the GPU still sleeps the host enqueues the whole call, so the
    events around it time the call's own GPU work, not the host's gaps between its launches (as
    long as the enqueue takes less than `ahead_s`; past that, some of the host's time shows).

    Nothing waits for the GPU: the GPU time comes as a function that says it once the call's work
    is done (None before). A call timed right after the host waited on the GPU pays for the wait
    in host time: a 4096 x 2048 LayerNorm's enqueue read 157.6 us so (an H100's host, 2026-11-26),
    and its capture, whose copies cost the GPU more than the kernel, was kept."""
    torch.cuda._sleep(int(ahead_s * _sleep_cycles_per_s()))
    out, host, start, end = _timed_call(fn, args)

    def gpu(wait: bool = False) -> float | None:
        if wait:
            end.synchronize()
        elif not end.query():
            return None
        return start.elapsed_time(end) / 1e3

    return out, host, gpu


def wall_time(fn: Callable[..., Any], args: Sequence[Any], ahead_s: float) -> tuple[Any, float, GpuTime]:
    """`cuda_busy` for the CPU tests' stand-ins: the wall clock as host time, no GPU time."""
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t, 0.0


def _graph_calls(step: Any) -> int:
    return step.calls + (step.training.calls if step.training is not None else 0)


def settled_since_now(step_graphs: Sequence[Any]) -> Callable[[], bool]:
    """Whether every one of `step_graphs` (a live list) called from now on runs as its later calls
    will (StepGraph.settled): validation times the optimized model once this says so. A graph the
    calls from now on do not reach (one an earlier call of another shape compiled) is not waited
    for."""
    before = {id(s): _graph_calls(s) for s in step_graphs}
    return lambda: all(s.settled or _graph_calls(s) == before.get(id(s), 0) for s in step_graphs)


class StepGraph:
    """A compiled graph that replays launch-bound calls from a CUDA graph (see the module doc).

    Called like the graph. `capture` and `measure` are the CUDA implementations by default; the
    CPU tests pass stand-ins with the same contract."""

    def __init__(self, gm: fx.GraphModule, *, capture: Callable[..., tuple[Callable[[], None], Any]] = cuda_capture,
                 measure: Callable[..., tuple[Any, float, float]] = cuda_measure,
                 cost: Callable[..., tuple[Any, float, GpuTime]] | None = None,
                 needs_cuda: bool = True, sizes_fixed: bool = False, auto: bool = False,
                 capture_train: Callable[..., traingraphs.TrainCapture] | None = None) -> None:
        self.gm = gm
        self._fx = isinstance(gm, fx.GraphModule)
        # a graph with symbolic sizes is replayed only where every call has the same sizes
        # (shapes.ShapeDispatch makes one per set of sizes): a capture is of one set of sizes
        self._sizes_fixed = sizes_fixed
        # replay outside step_graphs() too: every call without autograd recording (the optimized
        # model's default, integrate's cuda_graphs; a capture-only backend leaves it off)
        self.auto = auto
        self._capture = capture
        self._measure = measure
        # a judged call's (outputs, host s, GPU s): cuda_busy on the GPU, the wall clock otherwise
        self._cost = cost if cost is not None else cuda_busy if needs_cuda else wall_time
        self._needs_cuda = needs_cuda
        # whether a call may sit inside the caller's CUDA-graph capture (asked per call only then)
        self._may_be_captured = needs_cuda and torch.cuda.is_available()
        self.calls = 0  # calls made with step graphs on
        self.replays = 0
        self.captures = 0
        self.launch_bound: bool | None = None
        self.host_s: float | None = None
        self.gpu_s: float | None = None
        self.declined: str | None = None
        self._refusal: str | None = None  # why no call of this graph can be captured (_classify)
        self._written: list[int] = []  # the inputs an op of the graph may write (_classify)
        self._capture_train = capture_train
        # the calls made with autograd recording (traingraphs.py), made on the first such call
        self.training: traingraphs.TrainGraph | None = None
        self._inplace: list[int] | None = None
        self._pick: Callable[[Sequence[Any]], tuple[Any, ...]] = lambda _: ()
        self._last_key: tuple[Any, ...] | None = None
        self._replay: Callable[[], None] | None = None
        self._key: tuple[Any, ...] | None = None
        self._served = 0  # replays of the current capture
        # (cost, host s, GPU s) of the first capture's first replays and of the runs between them
        # (_judged_replay)
        self._replay_times: list[tuple[float, float, float]] = []
        self._run_times: list[tuple[float, float, float]] = []
        # judged calls whose GPU time is not in yet: (a run?, host s, GpuTime), in call order
        self._pending: list[tuple[bool, float, GpuTime]] = []
        self._started = [0, 0]  # judged replays and runs made
        # the cost of the cheapest of each, once judged, and that call's host and GPU seconds
        self.replay_s: float | None = None
        self.run_s: float | None = None
        self.judged: tuple[tuple[float, float, float], tuple[float, float, float]] | None = None
        self._lock = threading.Lock()
        self._copied: list[tuple[int, torch.Tensor]] = []
        self._outs: list[tuple[str, Any]] = []
        self._out_spec: Any = None

    def __call__(self, *args: Any) -> Any:
        # A GraphModule's own forward, not its __call__: nn.Module's call machinery and FX's
        # error-reporting wrapper cost ~1.7 us a call (2-core CPU), a decode token's graph's whole
        # budget many times over; the graph has no hooks. Looked up on every call: integrate
        # rewrites graphs in place, and recompile() gives the class a new forward.
        run = self.gm.forward if self._fx else self.gm
        on = _ON.get()
        if not (self.auto if on is None else on):
            return run(*args)
        if torch.is_grad_enabled():
            # no training replays under torch.distributed (FSDP2 moves the weights between a
            # forward and its backward, DDP overlaps its all-reduces with the backward: distributed.py)
            if not traingraphs.ENABLED or not any(isinstance(x, torch.Tensor) and x.requires_grad for x in args) \
                    or distributed.active():
                return run(*args)
            return self._guarded(self._train_call, args)
        if self.declined is not None:
            return run(*args)
        return self._guarded(self._call, args)

    def _guarded(self, call: Callable[[Sequence[Any]], Any], args: Sequence[Any]) -> Any:
        if self._may_be_captured and torch.cuda.is_current_stream_capturing():
            # the caller captures its own CUDA graph around this call (solforge.runtime.graphed, a serving
            # loop): a timing would wait on the GPU and a capture of ours cannot nest in it
            return self.gm(*args)
        # one thread at a time: a replay copies into buffers another call would overwrite, and a
        # capture replaces them; a call meanwhile runs the graph as it is
        if not self._lock.acquire(blocking=False):
            return self.gm(*args)
        try:
            return call(args)
        finally:
            self._lock.release()

    def _train_call(self, args: Sequence[Any]) -> Any:
        """A call with autograd recording: replayed by the training side (traingraphs.py)."""
        if self._inplace is None and self._refusal is None:
            self._refusal = self._classify(args)
        if self._refusal is not None:
            return self.gm(*args)
        if self.training is None:
            self.training = traingraphs.TrainGraph(
                self.gm, capture=self._capture_train or traingraphs.cuda_capture_train, measure=self._measure,
                cost=self._cost)
        elif self.training.declined is not None:
            return self.gm(*args)
        assert self._inplace is not None
        return self.training(args, self._current_key(args), self._inplace, self._written)

    def _call(self, args: Sequence[Any]) -> Any:
        self.calls += 1
        if self._inplace is None and self._refusal is None:
            self._refusal = self._classify(args)
        if self._refusal is not None:
            self.declined = self._refusal
            return self.gm(*args)
        key = self._current_key(args)
        if self._replay is not None and key == self._key:
            return self._run_replay(args) if self.replay_s is not None else self._judged_replay(args)
        if self.launch_bound is None:
            if self.calls == 1:  # compilation and first launches: not a measure of anything
                self._last_key = key
                return self.gm(*args)
            out, self.host_s, self.gpu_s = self._measure(self.gm, args)
            self.launch_bound = self.host_s >= LAUNCH_BOUND * self.gpu_s
            if not self.launch_bound:
                self.declined = (f"not launch-bound: {self.host_s * 1e3:.2f} ms of host time for "
                                 f"{self.gpu_s * 1e3:.2f} ms on the GPU")
            self._last_key = key
            return out
        if key != self._last_key and self._served < 2:
            # new addresses: capture once they hold for two calls, or at once when the last
            # capture served calls (a decode step with a new cache: every generate call makes one)
            self._last_key = key
            return self.gm(*args)
        self._last_key = key
        try:
            self._record(args, key)
        except CaptureRefused as e:
            self.declined = str(e)
            return self.gm(*args)
        except Exception as e:  # noqa: BLE001 - any capture failure leaves the graph as it is
            self.declined = f"capture failed: {type(e).__name__}: {str(e)[:200]}"
            self._replay = None
            if self._capture is cuda_capture:
                problem = reset_capture_state()
                if problem is not None:
                    self.declined += f"; resetting the capture state failed too: {problem}"
            return self.gm(*args)
        return self._run_replay(args) if self.replay_s is not None else self._judged_replay(args)

    def _judged_replay(self, args: Sequence[Any]) -> Any:
        """A call while the first capture is judged: the first replays (it uploads the graph), then
        calls alternate between running the graph as it is and replaying it (alternating puts both
        under the same conditions: a graph's first calls run slower than its later ones). Each is
        costed as the larger of its host time and its GPU time (`cuda_busy`): what a loop of such
        calls takes, whichever side bounds it. The cheapest of each decide: as soon as one is under
        PAY_CLEAR of the other once PAY_MIN_RUNS runs were sampled, else after PAY_SAMPLES
        replays. A capture whose replay does not save at least 1 - PAY_MARGIN of a run's cost is
        dropped."""
        self._collect()
        run_plain = self._started[0] > self._started[1]
        if len(self._pending) >= PAY_BACKLOG:
            # calls back to back with nothing waiting on the GPU: each judged call's sleep ahead
            # puts the GPU further behind, and no GPU time comes in. Catch up, and leave this call
            # untimed: the next one is timed after a call, not right after the wait.
            self._collect(wait=True)
            return self.gm(*args) if run_plain else self._run_replay(args)
        seen = [h for _, h, _ in self._replay_times + self._run_times] + [h for _, h, _ in self._pending]
        ahead = AHEAD_FACTOR * max(seen + [self.host_s or 0.0]) + AHEAD_MIN_S
        out, host, gpu = self._cost(self.gm if run_plain else lambda *a: self._run_replay(a), args, ahead)
        self._started[run_plain] += 1
        self._pending.append((run_plain, host, gpu))
        self._collect()
        if len(self._replay_times) < 2 or not self._run_times:
            return out
        best_replay, best_run = min(self._replay_times[1:]), min(self._run_times)  # the first replay uploaded
        replay, run = best_replay[0], best_run[0]
        undecided = len(self._run_times) < PAY_MIN_RUNS or (replay > PAY_CLEAR * run and run > PAY_CLEAR * replay)
        if undecided and len(self._replay_times) <= PAY_SAMPLES:
            return out  # too close to call yet, or too few runs to tell
        self.replay_s, self.run_s, self.judged = replay, run, (best_replay, best_run)
        self._pending = []
        if replay >= PAY_MARGIN * run:
            self.declined = f"a replay saves too little over running the graph: {self._judged_text()}"
            self._drop_capture()
            traingraphs.give_back_pool()
        elif best_replay[2] > PAY_GPU_GROWTH * best_run[2] + PAY_GPU_SLACK_S:
            self.declined = f"a replay adds too much GPU time (its copies): {self._judged_text()}"
            self._drop_capture()
            traingraphs.give_back_pool()
        return out

    def _collect(self, wait: bool = False) -> None:
        """Judged calls whose GPU time is in, in call order (a stream finishes its work in order);
        `wait`: every one, waiting for the GPU."""
        while self._pending:
            run_plain, host, gpu = self._pending[0]
            g = gpu(wait=wait) if callable(gpu) else gpu
            if g is None:
                return
            self._pending.pop(0)
            (self._run_times if run_plain else self._replay_times).append((max(host, g), host, g))

    def _judged_text(self) -> str:
        assert self.judged is not None
        (r, rh, rg), (p, ph, pg) = self.judged
        return (f"a call costs {r * 1e6:.1f} us replayed (host {rh * 1e6:.1f}, GPU {rg * 1e6:.1f}) against "
                f"{p * 1e6:.1f} us run as it is (host {ph * 1e6:.1f}, GPU {pg * 1e6:.1f})")

    @property
    def settled(self) -> bool:
        """Whether its calls now run the way later ones with the same inputs will: the capture
        judged (or none made: declined, or never called with replays on), and the training side's
        likewise. Validation times an optimized model once every graph has settled."""
        inference = self.declined is not None or self.replay_s is not None or self.calls == 0
        return inference and (self.training is None or self.training.settled)

    def _classify(self, args: Sequence[Any]) -> str | None:
        if not self._sizes_fixed and symbolic_inputs(self.gm):
            return "its input sizes vary from call to call (a dynamic-shape graph)"
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and self._needs_cuda and not x.is_cuda:
                return f"input {i} is on the {x.device.type}: a CUDA graph reads GPU memory only"
        written = written_inputs(self.gm)
        self._written = sorted(written)
        self._inplace = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and (
            i in written or isinstance(x, torch.nn.Parameter) or hasattr(x, "_dynamo_static_input_type"))]
        # the addresses are read on every call (~400 parameters for a 0.6B model): in C, not a loop
        pick = operator.itemgetter(*self._inplace) if self._inplace else (lambda _: ())
        self._pick = pick if len(self._inplace) != 1 else (lambda a: (a[self._inplace[0]],))  # type: ignore[index]
        return None

    def _current_key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        assert self._inplace is not None
        # the graph's code too (integrate_captured rewrites graphs in place): the string itself,
        # held by the key so its id cannot be reused, and compared by identity first
        return (getattr(self.gm, "_code", None), *map(_DATA_PTR, self._pick(args)))

    def _record(self, args: Sequence[Any], key: tuple[Any, ...]) -> None:
        assert self._inplace is not None
        self._replay = None  # drop the previous capture (and its memory) first
        inplace = set(self._inplace)
        static: list[Any] = list(args)
        copied: list[tuple[int, torch.Tensor]] = []
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and i not in inplace:
                buf = torch.empty_like(x)
                buf.copy_(x)
                static[i] = buf
                copied.append((i, buf))
        replay, out = self._capture(self.gm, static)
        leaves, spec = pytree.tree_flatten(out)
        storages = {}
        for i, x in enumerate(static):
            if isinstance(x, torch.Tensor):
                storages.setdefault(x.untyped_storage().data_ptr(), i)
        outs: list[tuple[str, Any]] = []
        seen: set[int] = set()
        for o in leaves:
            if not isinstance(o, torch.Tensor):
                outs.append(("value", o))
                continue
            same = next((i for i, x in enumerate(static) if x is o), None)
            if same is not None:
                outs.append(("input", same))
                continue
            base = o.untyped_storage().data_ptr()
            if base in storages:
                raise CaptureRefused(f"an output is a view of input {storages[base]}: a replay could "
                                     "not return it")
            if base in seen:
                raise CaptureRefused("two outputs share memory: copies of them would not")
            seen.add(base)
            outs.append(("owned", o))
        self._replay, self._key, self._copied = replay, key, copied
        self._outs, self._out_spec = outs, spec
        self.captures += 1
        self._served = 0

    def _run_replay(self, args: Sequence[Any]) -> Any:
        assert self._replay is not None
        for i, buf in self._copied:
            x = args[i]
            if x.shape != buf.shape or x.dtype != buf.dtype:  # dynamo's guards make this unreachable
                raise RuntimeError(f"solforge step graph: input {i} is {tuple(x.shape)} {x.dtype}, "
                                   f"captured as {tuple(buf.shape)} {buf.dtype}")
        if len(self._copied) == 1:
            i, buf = self._copied[0]
            buf.copy_(args[i])
        elif self._copied:  # one launch for all of them where the dtypes allow (ids, positions, mask)
            torch._foreach_copy_([buf for _, buf in self._copied], [args[i] for i, _ in self._copied])
        self._replay()
        self.replays += 1
        self._served += 1
        leaves = [args[v] if kind == "input" else v.clone() if kind == "owned" else v for kind, v in self._outs]
        return pytree.tree_unflatten(leaves, self._out_spec)

    def _drop_capture(self) -> None:
        self._replay, self._key, self._copied, self._outs = None, None, [], []

    def release(self) -> None:
        """Drop the capture, its buffers and its memory pool (a graph no longer called)."""
        with self._lock:
            self._drop_capture()
            if self.training is not None:
                self.training.release()

    def summary(self) -> str:
        if self.declined is not None:
            text = f"not replayed: {self.declined}"
        elif self.captures:
            text = f"replayed {self.replays} call(s) from {self.captures} capture(s)"
            if self.judged is not None:
                text += f" ({self._judged_text()})"
        else:
            text = f"{self.calls} call(s), not captured yet"
        return text if self.training is None else f"{text}; {self.training.summary()}"
