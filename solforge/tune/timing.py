"""Timing: CUDA events on the GPU (the tune loop's ground truth); a labelled wall clock elsewhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from solforge.records import RunResult


def _quantiles(samples_us: list[float]) -> tuple[float, float, float]:
    s = sorted(samples_us)
    if len(s) == 1:
        return s[0], s[0], s[0]
    q = statistics.quantiles(s, n=10, method="inclusive")  # deciles: q[1] = p20, q[7] = p80
    return q[1], statistics.median(s), q[7]


def time_kernel(fn: Callable[[], Any], device: str, *, warmup_ms: float = 10, rep_ms: float = 50) -> RunResult:
    """Time a short GPU callable: triton's do_bench (CUDA events, L2 flushed before every run so
    each run reads from device memory, as in a real model), p20/p50/p80 in microseconds.

    Off the GPU the callable is run a few times under a wall clock and the result is marked not
    meaningful: the interpreter's speed says nothing about a GPU's. 50 ms of repeats is >= 500 runs
    of a 100 us kernel: the tuner's ranking is within the ~1-2% run-to-run spread seen on the H100.
    """
    try:
        if device == "cuda":
            from triton.testing import do_bench

            p20, p50, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
            return RunResult(p20 * 1e3, p50 * 1e3, p80 * 1e3, meaningful=True)
        return _wall_clock(fn, runs=3)
    except Exception as e:  # a failure is a record, the tune goes on
        return RunResult(error=f"{type(e).__name__}: {e}".splitlines()[0][:300])


def time_model(fn: Callable[[], Any], device: str, *, warmup: int = 1, runs: int = 10, min_runs: int = 5,
               steady: float = 0.01, max_seconds: float = 20.0) -> RunResult:
    """Time a whole forward: CUDA events around each call after `warmup` calls; the median of up to
    `runs` calls, stopping after `min_runs` once the middle of the samples agrees within `steady`
    ((p80 - p20) / p50), or once `max_seconds` have passed with at least 3. A 400 ms forward is
    timed to well under 1% by five steady calls; the other five cost a warm run 4 s per model."""
    try:
        if device != "cuda":  # interpreter: one run, its time means nothing anyway
            return _wall_clock(fn, runs=1, warmup=0)
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        samples: list[float] = []
        started = time.perf_counter()
        while len(samples) < runs and (len(samples) < 3 or time.perf_counter() - started < max_seconds):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3)
            if len(samples) >= min_runs:
                p20, p50, p80 = _quantiles(samples)
                if p80 - p20 <= steady * p50:
                    break
        return RunResult(*_quantiles(samples), meaningful=True)
    except Exception as e:
        return RunResult(error=f"{type(e).__name__}: {e}".splitlines()[0][:300])


def _wall_clock(fn: Callable[[], Any], runs: int, warmup: int = 1) -> RunResult:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return RunResult(*_quantiles(samples), meaningful=False)
