"""Decided rmsnorm_bwd's heuristic for rows of 1024+ (8K-value tiles, 16 warps, one program per SM, evict_first loads)
and its register budget (kernels/rmsnorm_bwd.py).

GPU: the RMSNorm backward kernel (kernels/rmsnorm_bwd.py) over its configs at the Qwen3-4B
hidden shapes, to set its heuristic from measurements.

    python tools/bwd_sweep.py [--out FILE] [--quick]

Each shape is swept with the residual gradient (add_rmsnorm's backward: read x, dy, ds, write dx)
and, at 16384 x 2560, without it (rmsnorm's: read x, dy, write dx). First rows x programs per SM x
warps x block split x stages with plain loads, then evict_first loads on the best ten. A
device-to-device copy of the same tensors is timed in the same process, for the share of the
copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import bench_us, provenance, write_json  # noqa: E402


def main() -> int:
    from solforge.kernels.rmsnorm_bwd import bwd_heuristic

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="16384 x 2560 with the residual gradient only")
    a = p.parse_args()
    res: dict = {**provenance(), "shapes": []}
    cases = [(16384, 2560, True)] if a.quick else \
        [(16384, 2560, True), (16384, 2560, False), (4096, 2560, True), (524288, 128, True)]
    for rows, H, with_ds in cases:
        x, dy, ds = (torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        w = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
        nbytes = (4 if with_ds else 3) * x.numel() * 2  # read x, dy (, ds); write dx
        dst = torch.empty_like(x)
        copy_us = bench_us(lambda dst=dst, x=x: dst.copy_(x))
        out = {"shape": [rows, H], "ds": with_ds, "bytes": nbytes,
               "heuristic": bwd_heuristic(rows, H, x.device).encode(),
               "copy_TBps": round(2 * x.numel() * 2 / copy_us / 1e6, 3), "configs": {}}
        out["configs"] = sweep(x, dy, ds if with_ds else None, w)
        ok = {k: v for k, v in out["configs"].items() if isinstance(v, float)}
        best = min(ok, key=ok.__getitem__)
        out["best"] = {"config": best, "us": ok[best], "TBps": round(nbytes / ok[best] / 1e6, 3)}
        out["best_of_copy"] = round(out["best"]["TBps"] / out["copy_TBps"], 3)
        out["heuristic_us"] = ok.get(out["heuristic"])
        out["top10"] = sorted(ok.items(), key=lambda kv: kv[1])[:10]
        print(json.dumps({k: v for k, v in out.items() if k != "configs"}), flush=True)
        res["shapes"].append(out)
        write_json(res, a.out, indent=1)  # after every shape: a run cut short keeps what it measured
    return 0


def sweep(x: torch.Tensor, dy: torch.Tensor, ds: torch.Tensor | None, w: torch.Tensor) -> dict[str, float | str]:
    from solforge.kernels.rmsnorm_bwd import BwdConfig, rmsnorm_bwd, rmsnorm_bwd_ref
    from solforge.numerics import compare

    rdx, rdw = rmsnorm_bwd_ref(dy, x, w, 1e-6, round_before_weight=True, ds=ds)
    found: dict[str, float | str] = {}

    def run(c: BwdConfig) -> None:
        bh, bt = c.blocks(x.shape[-1])
        if c.rows * (bh + bt) // (32 * c.num_warps) * c.stages > 64 or c.rows * (bh + bt) > 16384:
            return
        try:
            dx, dw = rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True, ds=ds, config=c)
            if not compare(dx, rdx).ok or (dw - rdw).abs().max() > 1e-2 * rdw.abs().max():
                found[c.encode()] = "WRONG"
                return
            found[c.encode()] = round(bench_us(lambda: rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True,
                                                                   ds=ds, config=c)), 2)
        except Exception as e:
            found[c.encode()] = f"{type(e).__name__}: {str(e)[:80]}"

    long_rows = x.shape[-1] > 1024
    for r in ((1, 2, 4) if long_rows else (8, 16, 32)):
        for nw in ((2, 4, 8, 16) if long_rows else (2, 4, 8)):
            for t in ((0, 1) if long_rows else (0,)):
                for st in (1, 2):
                    for p in (1, 2, 4, 8):
                        run(BwdConfig(r, p, nw, t, st))
    ok = sorted((v, k) for k, v in found.items() if isinstance(v, float))
    for _, k in ok[:10]:
        run(dataclasses.replace(BwdConfig.decode(k), evict=1))
    return found


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    sys.exit(main())
