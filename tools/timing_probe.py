"""Decided tune/timing.py's gated timer in place of triton's do_bench: a kernel's measured time under a quiet, a loaded
and a busy host (bench/results/2026-11-25-h100-session10.md).

GPU: does a kernel's measured time depend on the host and on the GPU's state? The tuner's old
timer (triton's do_bench, 10 ms warm-up) against solforge.tune.timing (gated batches, steady-state
windows), on kernels of Qwen3-4B's training step, under four conditions.

    python tools/timing_probe.py [--out FILE] [--reps 3]

Cases (bf16, heuristic configs): rmsnorm_bwd 4096 x 2560 (two launches, the second with PDL),
rope with the q/k norm at B1 S4096, rmsnorm 4096 x 2560, and a 32 MB device copy.
Conditions, each timed `--reps` times by both timers (alternating which goes first):
  warm      the GPU busy just before (1 s of copies), nothing else on the host
  idle      the GPU left idle for 3 s before each timing (its clock drops)
  cpu_busy  one spinning process per CPU core meanwhile (a loaded machine: builders, data loaders)
  gil       a Python thread of this process spinning meanwhile (it takes the GIL in 5 ms slices,
            as a busy thread of a user's process would)
Each row has the p50 in µs of every repetition, and the SM clock nvidia-smi read just before.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from e2e import provenance, write_json  # noqa: E402


def old_timer(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1e3


def new_timer(fn: Callable[[], Any]) -> float:
    from solforge.tune.timing import time_kernel

    r = time_kernel(fn, "cuda")
    assert r.ok, r.error
    return r.p50_us


def sm_clock() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def cases() -> list[tuple[str, Callable[[], Any]]]:
    from rope_bwd_sweep import qwen3_inputs

    from solforge.kernels import rmsnorm as RN
    from solforge.kernels import rmsnorm_bwd as RB
    from solforge.kernels import rope as R

    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(4096, 2560, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(2560, device="cuda", generator=g)).to(torch.bfloat16)
    q, k, cos, sin, qw, kw = qwen3_inputs(1, 4096, 32, 8, 128, cos_batch=1)
    src = torch.empty(16 << 20, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return [
        ("rmsnorm_bwd 4096x2560", lambda: RB.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True)),
        ("rope+norm B1 S4096", lambda: R.rope(q, k, cos, sin, qw, kw, 1e-6, norm=True, round_before_weight=True,
                                              heads_first=True)),
        ("rmsnorm 4096x2560", lambda: RN.rmsnorm(x, w, 1e-6)),
        ("copy 32 MB", lambda: dst.copy_(src)),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    res: dict[str, Any] = {**provenance(), "cpu_count": os.cpu_count(), "rows": []}
    cs = cases()
    for _, fn in cs:  # compile everything first
        fn()
    torch.cuda.synchronize()
    big = torch.empty(256 << 20, dtype=torch.bfloat16, device="cuda")

    def warm_gpu() -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < 1.0:
            big.mul_(1.0)
        torch.cuda.synchronize()

    for cond in ("warm", "idle", "cpu_busy", "gil"):
        stop_p = mp.Event()
        procs = [mp.Process(target=_spin, args=(stop_p,), daemon=True) for _ in range(os.cpu_count() or 1)] \
            if cond == "cpu_busy" else []
        for pr in procs:
            pr.start()
        stop_t = threading.Event()
        th = threading.Thread(target=_spin, args=(stop_t,), daemon=True) if cond == "gil" else None
        if th is not None:
            th.start()
        try:
            for name, fn in cs:
                row: dict[str, Any] = {"condition": cond, "case": name, "do_bench_10ms_us": [], "gated_us": [],
                                       "sm_clock_before_mhz": []}
                for rep in range(a.reps):
                    order = [("do_bench_10ms_us", old_timer), ("gated_us", new_timer)]
                    if rep % 2:
                        order.reverse()
                    for key, timer in order:
                        if cond == "idle":
                            time.sleep(3.0)
                        elif cond == "warm":
                            warm_gpu()
                        row["sm_clock_before_mhz"].append(sm_clock())
                        row[key].append(round(timer(fn), 2))
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                write_json(res, a.out, indent=1)
        finally:
            stop_p.set()
            stop_t.set()
            for pr in procs:
                pr.join(timeout=5)
            if th is not None:
                th.join(timeout=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
