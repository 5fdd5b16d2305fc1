"""Tuning throughput: candidates measured per minute by each runner setup, on real workloads.

    python bench/tune_throughput.py [--setups local,process,process+b4] [--gpus 0,1] [--n 40]
                                    [--out bench/results/NAME.json]

A setup is `RUNNER[+bN]`: `local` (in this process), `process` (one worker process per GPU in
--gpus) or `ray`, and `+bN` adds N compile-only builder processes. Each setup measures the same
candidates from scratch: a fresh Triton cache directory per setup, so every candidate is really
compiled, and the workloads are the Qwen3-4B shapes (B2 S8192, bf16) of the families that exist.
Throughput = candidates with a record / wall seconds of `runner.measure` (worker start-up
included, as a user pays it). Verdicts must agree across setups (printed and stored).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import provenance, write_json  # noqa: E402

from solforge.records import Workload  # noqa: E402
from solforge.tune import candidates, family_module  # noqa: E402
from solforge.tune.runners import make_runner, parse_gpus  # noqa: E402


def workloads(device: str) -> list[Workload]:
    """The Qwen3-4B inference shapes (B2 S8192) of rmsnorm, add_rmsnorm and swiglu."""
    from solforge.kernels import add_rmsnorm, rmsnorm, swiglu

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    rows = 16384 if device == "cuda" else 37
    H, inter = (2560, 9728) if device == "cuda" else (96, 200)
    x = torch.empty(rows, H, dtype=dt, device="meta")
    w = torch.empty(H, dtype=dt, device="meta")
    g = torch.empty(rows, inter, dtype=dt, device="meta")
    out = [rmsnorm.workload_for(x, w, 1e-6), add_rmsnorm.workload_for(x, x, w, 1e-6)]
    out.append(swiglu.workload_for(g, g, "silu"))
    return [Workload(wl.family, wl.shapes, wl.dtypes, wl.params, device) for wl in out]


def run_setup(setup: str, wls: list[Workload], n: int, device: str, gpus: list[int] | None,
              timeout_s: float) -> dict[str, Any]:
    spec, _, b = setup.partition("+b")
    cache = tempfile.mkdtemp(prefix="solforge-bench-triton-")
    os.environ["TRITON_CACHE_DIR"] = cache  # workers inherit it: every compile is a real one
    runner = make_runner(spec, device=device, gpus=gpus, timeout_s=timeout_s, build_workers=int(b or 0))
    cands = [c for wl in wls for c in candidates(family_module(wl.family), wl)[:n]]
    t = time.perf_counter()
    try:
        recs = list(runner.measure(cands))
    finally:
        runner.close()
        shutil.rmtree(cache, ignore_errors=True)
    wall = time.perf_counter() - t
    ok = sum(r.ok for r in recs)
    print(f"{setup:>14}: {len(recs)} candidates ({ok} ok) in {wall:.1f} s = {60 * len(recs) / wall:.1f}/min",
          flush=True)
    return {"setup": setup, "candidates": len(recs), "ok": ok, "wall_s": round(wall, 2),
            "per_min": round(60 * len(recs) / wall, 1),
            "build_s_mean": round(sum(r.build.seconds for r in recs) / max(1, len(recs)), 3),
            "verdicts": {r.candidate.label + "@" + r.candidate.workload.family: r.ok for r in recs}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="local,process,process+b4")
    ap.add_argument("--gpus", default=None)
    ap.add_argument("--n", type=int, default=40, help="candidates per workload")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = parse_gpus(a.gpus)
    wls = workloads(device)
    rows = [run_setup(s, wls, a.n, device, gpus, a.timeout) for s in a.setups.split(",")]
    verdicts = [r.pop("verdicts") for r in rows]
    agree = all(v == verdicts[0] for v in verdicts)
    print(f"verdicts agree across setups: {agree}")
    write_json({**provenance(), "gpus": gpus, "gpu_count": torch.cuda.device_count(),
                "workloads": [w.key for w in wls], "setups": rows, "verdicts_agree": agree,
                "disagreements": [k for k in verdicts[0] if any(v.get(k) != verdicts[0][k] for v in verdicts)]},
               a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
