"""Decided rmsnorm's heuristic at the q/k-norm shape, 524288 x 128 (bench/results/2026-11-22-h100-families.md).

GPU: every rmsnorm config of the space (and a few beyond it) at the q/k-norm shape, with the
copy ceiling for the same bytes, repeated to see run-to-run spread.

    python tools/qk_sweep.py [--rows 524288] [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import EPS, bench_us, hf_rmsnorm, provenance, write_json  # noqa: E402


def main() -> int:
    from solforge.kernels import rmsnorm as fam
    from solforge.numerics import compare

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=524288)
    p.add_argument("--H", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    x = torch.randn(a.rows, a.H, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(a.H, device="cuda")).to(torch.bfloat16)
    y = torch.empty_like(x)
    wl = fam.workload_for(x, w, EPS, out_dtype=torch.bfloat16, round_before_weight=True)
    configs = fam.space(wl)
    extra = [fam.Config("rows", 128, 0, r, nw, evict=e) for r in (16, 32, 64, 128) for nw in (4, 8, 16, 32)
             for e in (0, 1)]
    extra += [fam.Config("persist", 128, 0, r, nw, p, s) for r in (32, 64) for nw in (8, 16)
              for p in (4, 8) for s in (1, 2)]
    configs += [c for c in extra if c not in configs and fam.is_valid(c, wl)]
    nbytes = 2 * x.numel() * x.element_size()
    comp = torch.compile(hf_rmsnorm, dynamic=False)
    comp(x, w)
    res: dict = {**provenance(), "shape": [a.rows, a.H], "bytes_moved": nbytes, "runs": []}
    for _ in range(a.repeat):
        run = {"copy_us": bench_us(lambda: y.copy_(x)), "compile_us": bench_us(lambda: comp(x, w)), "configs": {}}
        ref = fam.rmsnorm_ref(x, w, EPS, out_dtype=torch.bfloat16, round_before_weight=True)
        for c in configs:  # a sweep, not a tune: one check against the reference, then the clock
            try:
                fam.rmsnorm(x, w, EPS, round_before_weight=True, config=c, out=y)
                ok = compare(y, ref).ok
                run["configs"][c.encode()] = round(bench_us(
                    lambda c=c: fam.rmsnorm(x, w, EPS, round_before_weight=True, config=c, out=y)), 2) \
                    if ok else "wrong result"
            except Exception as e:
                run["configs"][c.encode()] = f"{type(e).__name__}: {str(e)[:100]}"
        best = min((v, k) for k, v in run["configs"].items() if isinstance(v, float))
        run["best"] = {"config": best[1], "us": best[0], "TBps": round(nbytes / best[0] / 1e6, 3)}
        run["copy_TBps"] = round(nbytes / run["copy_us"] / 1e6, 3)
        print(json.dumps({k: v for k, v in run.items() if k != "configs"}), flush=True)
        res["runs"].append(run)
    write_json(res, a.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
