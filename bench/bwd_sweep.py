"""GPU: the RMSNorm backward kernel (kernels/rmsnorm_bwd.py) over its configs at the Qwen3-4B
hidden shapes, to set its heuristic from measurements.

    python bench/bwd_sweep.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import bench_us, provenance, write_json  # noqa: E402


def main() -> int:
    from solforge.kernels.rmsnorm_bwd import heuristic

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res: dict = {**provenance(), "shapes": []}
    for rows, H in ((16384, 2560), (4096, 2560), (524288, 128)):
        x, dy, ds = (torch.randn(rows, H, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        w = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
        nbytes = 4 * x.numel() * 2  # read x, dy, ds; write dx
        out = {"shape": [rows, H], "bytes": nbytes, "heuristic": heuristic(rows, H, x.device).encode(),
               "configs": {}}
        out["configs"] = sweep(x, dy, ds, w)
        ok = {k: v for k, v in out["configs"].items() if isinstance(v, float)}
        best = min(ok, key=ok.__getitem__)
        out["best"] = {"config": best, "us": ok[best], "TBps": round(nbytes / ok[best] / 1e6, 3)}
        out["heuristic_us"] = ok.get(out["heuristic"])
        print(json.dumps({k: v for k, v in out.items() if k != "configs"}), flush=True)
        res["shapes"].append(out)
    write_json(res, a.out, indent=1)
    return 0


def sweep(x: torch.Tensor, dy: torch.Tensor, ds: torch.Tensor, w: torch.Tensor) -> dict[str, float | str]:
    from solforge.kernels.rmsnorm_bwd import BwdConfig, rmsnorm_bwd

    found: dict[str, float | str] = {}
    for r in ((1, 2, 4, 8) if x.shape[-1] > 1024 else (8, 16, 32)):
        for p in (1, 2, 4, 8):
            for nw in (4, 8, 16):
                c = BwdConfig(r, p, nw)
                if r * triton_pow2(x.shape[-1]) // (32 * nw) > 64:
                    continue
                try:
                    us = bench_us(lambda c=c: rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True, ds=ds, config=c))
                    found[c.encode()] = round(us, 2)
                except Exception as e:
                    found[c.encode()] = f"{type(e).__name__}: {str(e)[:80]}"
    return found


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    sys.exit(main())
