"""Timing: CUDA events on the GPU (the tune loop's ground truth); a labelled wall clock elsewhere.

A kernel's time is its device time, whatever the host does meanwhile. triton's do_bench, which
the tuner used before, records (flush, start, call, end) one call after another from the host;
when the host falls behind the GPU (a busy CPU, a slow Python launcher, a stall) the GPU waits
between `start` and the kernel, and the wait is counted as the kernel's time. Here every batch of
timed calls is queued behind a sleep kernel long enough to cover the host's queueing of the whole
batch, so the GPU runs the batch back to back from its queue; that the sleep outlasted the
queueing is checked (its event had not completed when the last call was queued), and a batch
where it did not is timed again behind a longer sleep. The L2 cache is flushed before every call
(a kernel in a model reads its inputs from device memory), as do_bench does.

A GPU that was idle runs at a low clock for a while. Timing starts after `warmup_ms` of flushed
calls, and goes on until the two halves of the last window of samples agree (within STEADY), so a
clock still ramping up is not what gets written down.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from solforge.records import RunResult

FLUSH_BYTES = 256 << 20  # > any GPU's L2 (H100: 50 MB), as do_bench's
# The sleep before a batch lasts GATE_MARGIN x the host's measured queueing time of the batch
# (+ GATE_PAD_S), in cycles at CYCLES_PER_S: a clock above any H100/H200 boost clock, so at a lower
# clock the sleep only lasts longer.
CYCLES_PER_S = 2.0e9
GATE_MARGIN = 2.0
GATE_PAD_S = 100e-6
BATCH_HOST_S = 2e-3  # host queueing time a batch aims at (sleeps of ~4 ms)
MAX_BATCH = 64  # calls a batch: a few hundred queued launches, far below the queue's depth
GATE_RETRIES = 3  # batches timed again behind a longer sleep before accepting an ungated one
STEADY = 0.02  # the two halves of a window's samples agree within 2% (medians)
MAX_WINDOWS = 4


def _quantiles(samples_us: Sequence[float]) -> tuple[float, float, float]:
    s = sorted(samples_us)
    if len(s) == 1:
        return s[0], s[0], s[0]
    q = statistics.quantiles(s, n=10, method="inclusive")  # deciles: q[1] = p20, q[7] = p80
    return q[1], statistics.median(s), q[7]


def steady(samples_us: Sequence[float], tol: float = STEADY) -> bool:
    """Whether the medians of the first and second half of `samples_us` (in time order) agree
    within `tol`: a GPU whose clock is still moving reads a trend, not noise."""
    if len(samples_us) < 4:
        return True
    h = len(samples_us) // 2
    a, b = statistics.median(samples_us[:h]), statistics.median(samples_us[h:])
    return abs(a - b) <= tol * min(a, b)


def batch_size(host_s: float) -> int:
    """Calls per gated batch: about BATCH_HOST_S of host queueing, 4..MAX_BATCH calls."""
    return max(4, min(MAX_BATCH, int(BATCH_HOST_S / max(host_s, 1e-7))))


def sleep_cycles(host_s: float, n: int, margin: float) -> int:
    """Cycles of the gate's sleep for `n` calls each queued in `host_s` seconds."""
    return int((margin * host_s * n + GATE_PAD_S) * CYCLES_PER_S)


def next_gate(host_s: float, margin: float, queued: float, held: bool, first_try: bool) -> tuple[float, float]:
    """The gate's (host_s, margin) after a batch whose calls were each queued in `queued` seconds.

    A batch the sleep did not cover is timed again behind a sleep twice as long, sized by the
    slower of the two queueing times. After a batch covered at its first try, both halve, the
    margin down to GATE_MARGIN at least and the queueing time down to this batch's at least: one
    host stall (another process, a collection) would otherwise leave every later batch behind a
    sleep many times longer than the host needs, the GPU idle meanwhile. Whether a batch was
    covered is still checked for every batch kept."""
    if not held:
        return max(host_s, queued), margin * 2
    if first_try:
        return max(queued, host_s / 2), max(GATE_MARGIN, margin / 2)
    return host_s, margin


class _Gated:
    """Device times of one callable, each call after an L2 flush, in batches queued behind a sleep."""

    def __init__(self, fn: Callable[[], Any], flush: torch.Tensor | None = None) -> None:
        self.fn = fn
        fn()  # the first call compiles, allocates, autotunes: never timed
        torch.cuda.synchronize()
        self.flush = flush if flush is not None else torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        # the host's queueing time of one flushed, event-timed call (the GPU is idle: no back-pressure)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
        t = time.perf_counter()
        for i in range(3):
            self.flush.zero_()
            ev[2 * i].record()
            fn()
            ev[2 * i + 1].record()
        self.host_s = (time.perf_counter() - t) / 3
        torch.cuda.synchronize()
        # the flush's own device time: the budget counts it (it runs before every timed call)
        ev[6].record()
        self.flush.zero_()
        ev[7].record()
        ev[7].synchronize()
        self.flush_us = ev[6].elapsed_time(ev[7]) * 1e3
        self.n = batch_size(self.host_s)
        self.margin = GATE_MARGIN
        # a callable that waits for the GPU itself (a sync inside) can never be queued ahead: after
        # one batch that failed every retry, the rest are queued without a sleep
        self.gating = True
        self.start = [torch.cuda.Event(enable_timing=True) for _ in range(self.n)]
        self.end = [torch.cuda.Event(enable_timing=True) for _ in range(self.n)]
        self.gate = torch.cuda.Event()

    def batch(self) -> list[float]:
        """One batch's device times (µs), timed again behind a longer sleep (up to GATE_RETRIES
        times) while the host was slower than the sleep."""
        for attempt in range(GATE_RETRIES + 1):
            t = time.perf_counter()
            if self.gating:
                torch.cuda._sleep(sleep_cycles(self.host_s, self.n, self.margin))
            self.gate.record()
            for s, e in zip(self.start, self.end, strict=True):
                self.flush.zero_()
                s.record()
                self.fn()
                e.record()
            held = not self.gate.query()  # still sleeping: every call was queued before the GPU reached it
            queued = (time.perf_counter() - t) / self.n
            self.end[-1].synchronize()
            if held or attempt == GATE_RETRIES or not self.gating:
                self.gating = self.gating and held
                if self.gating:
                    self.host_s, self.margin = next_gate(self.host_s, self.margin, queued, True, attempt == 0)
                return [s.elapsed_time(e) * 1e3 for s, e in zip(self.start, self.end, strict=True)]
            self.host_s, self.margin = next_gate(self.host_s, self.margin, queued, False, attempt == 0)
        raise AssertionError("unreachable")

    def run(self, ms: float) -> list[float]:
        """Samples (µs, in order) of batches until `ms` of device time (calls and flushes) passed."""
        out: list[float] = []
        spent = 0.0
        while not out or spent < ms * 1e3:
            got = self.batch()
            out += got
            spent += sum(got) + self.flush_us * len(got)
        return out


def device_samples(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 50) -> list[float]:
    """Device times (µs) of `fn` on the current CUDA device: `warmup_ms` of calls discarded, then
    windows of `rep_ms` until one is steady (its halves agree within STEADY; at most MAX_WINDOWS).
    Each window after the first replaces the older half: the samples kept are the latest."""
    g = _Gated(fn)
    if warmup_ms > 0:
        g.run(warmup_ms)
    samples = g.run(rep_ms)
    for _ in range(MAX_WINDOWS - 1):
        if steady(samples):
            break
        samples = samples[len(samples) // 2:] + g.run(rep_ms / 2)
    return samples


def time_kernel(fn: Callable[[], Any], device: str, *, warmup_ms: float = 25, rep_ms: float = 50) -> RunResult:
    """Time a short GPU callable (its device time, see the module doc): p20/p50/p80 in µs.

    Off the GPU the callable is run once under a wall clock and the result is marked not
    meaningful: the interpreter's speed says nothing about a GPU's. 50 ms of calls is >= 250 runs
    of a 100 us kernel with its flush: the tuner's ranking is within the ~1-2% run-to-run spread
    seen on the H100.
    """
    try:
        if device == "cuda":
            return RunResult(*_quantiles(device_samples(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)), meaningful=True)
        return _wall_clock(fn, runs=1, warmup=0)  # the interpreter: one run, its time means nothing anyway
    except Exception as e:  # a failure is a record, the tune goes on
        return RunResult(error=f"{type(e).__name__}: {e}".splitlines()[0][:300])


def confirm(fns: Sequence[Callable[[], Any]], device: str, *, rounds: int = 3, warmup_ms: float = 25,
            rep_ms: float = 20) -> list[RunResult]:
    """Time several callables fairly against each other: `rounds` rounds, each timing every callable
    in turn (rep_ms each), so a drift of the GPU's clock or temperature meets them all alike; each
    result is the quantiles of its samples over all rounds. The tuner's finalists, measured minutes
    apart during the search, are compared this way before one is kept (tune.confirm_finalists)."""
    if device != "cuda":
        return [time_kernel(f, device) for f in fns]
    out: list[list[float]] = [[] for _ in fns]
    errors: list[str | None] = [None] * len(fns)
    gated: list[_Gated | None] = []
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    for i, f in enumerate(fns):
        try:
            gated.append(_Gated(f, flush))
        except Exception as e:
            gated.append(None)
            errors[i] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    first = next((g for g in gated if g is not None), None)
    if first is not None and warmup_ms > 0:
        first.run(warmup_ms)  # the GPU's clock up before the first round
    for _ in range(rounds):
        for i, g in enumerate(gated):
            if g is None:
                continue
            try:
                out[i] += g.run(rep_ms)
            except Exception as e:
                gated[i], errors[i] = None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return [RunResult(*_quantiles(s), meaningful=True) if errors[i] is None and s else
            RunResult(error=errors[i] or "no samples") for i, s in enumerate(out)]


def time_model(fn: Callable[[], Any], device: str, *, warmup: int = 1, runs: int = 10, min_runs: int = 5,
               steady: float = 0.01, max_seconds: float = 20.0, settled: Callable[[], bool] | None = None,
               max_warmup: int = 48) -> RunResult:
    """Time a whole forward: CUDA events around each call after `warmup` calls; the median of up to
    `runs` calls, stopping after `min_runs` once the middle of the samples agrees within `steady`
    ((p80 - p20) / p50), or once `max_seconds` have passed with at least 3. A 400 ms forward is
    timed to well under 1% by five steady calls; the other five cost a warm run 4 s per model.

    `settled`: whether `fn` now runs as its later calls will (an optimized model whose CUDA-graph
    replays are still being judged alternates replays and runs: stepgraphs.py); the warm-up goes
    on until it says so, up to `max_warmup` calls or `max_seconds`."""
    return time_models([fn], device, warmup=warmup, runs=runs, min_runs=min_runs, steady=steady,
                       max_seconds=max_seconds, settled=[settled], max_warmup=max_warmup)[0]


def time_models(fns: Sequence[Callable[[], Any]], device: str, *, warmup: int = 1, runs: int = 10,
                min_runs: int = 5, steady: float = 0.01, max_seconds: float = 20.0,
                settled: Sequence[Callable[[], bool] | None] | None = None, max_warmup: int = 48) -> list[RunResult]:
    """`time_model` for several models at once, their timed calls interleaved: each round calls
    every model once, in reverse order every other round, so a drift of the GPU's clock over the
    timing (a clock ramping up after idling, or falling under a long fp32 GEMM's power draw) weighs
    on each model alike (timed one after the other, the second model of a pair may run in another
    state: on KernelBench level 2's GEMM rows, 8192 x 8192 fp32, the optimized model's regions
    saved 3% of the call and the end-to-end check, baseline first, read 1.00x, H200 2026-11-28;
    whether the order was the cause is not yet measured). Stops once every
    model has `min_runs` samples whose middle agrees within `steady`, after `runs` rounds, or once
    `max_seconds` have passed with at least 3 rounds. `settled[i]`: as time_model's, for model i,
    whose warm-up goes on until it says so. An error in any call ends the timing of all: each
    result carries it."""
    gates = list(settled) if settled is not None else [None] * len(fns)
    try:
        if device != "cuda":  # interpreter: one run each, its time means nothing anyway
            return [_wall_clock(fn, runs=1, warmup=0) for fn in fns]
        started = time.perf_counter()
        for fn in fns:
            for _ in range(warmup):
                fn()
        for fn, ok in zip(fns, gates, strict=True):
            n = warmup
            while ok is not None and not ok() and n < max_warmup and time.perf_counter() - started < max_seconds:
                fn()
                n += 1
        torch.cuda.synchronize()
        samples: list[list[float]] = [[] for _ in fns]
        started = time.perf_counter()
        rounds = 0
        while rounds < runs and (rounds < 3 or time.perf_counter() - started < max_seconds):
            order = range(len(fns)) if rounds % 2 == 0 else range(len(fns) - 1, -1, -1)
            for i in order:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fns[i]()
                b.record()
                b.synchronize()
                samples[i].append(a.elapsed_time(b) * 1e3)
            rounds += 1
            if rounds >= min_runs and all(_narrow(s, steady) for s in samples):
                break
        return [RunResult(*_quantiles(s), meaningful=True) for s in samples]
    except Exception as e:
        err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return [RunResult(error=err) for _ in fns]


def _narrow(samples_us: Sequence[float], tol: float) -> bool:
    p20, p50, p80 = _quantiles(samples_us)
    return p80 - p20 <= tol * p50


def _wall_clock(fn: Callable[[], Any], runs: int, warmup: int = 1) -> RunResult:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return RunResult(*_quantiles(samples), meaningful=False)
