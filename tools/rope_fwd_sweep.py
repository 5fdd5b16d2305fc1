"""Decided rope's forward space and `heuristic` (kernels/rope.py): the persistent kernel, 4 programs per SM, the next
token block loaded ahead.

GPU: the rope forward (kernels/rope.py `rope`, q/k RMSNorm fused, norm weights, HF layout) at
Qwen3-4B's shapes: every tile of `space` with one program per tile, then the best eight tiles as
the persistent kernel (programs per SM x stages), to choose the space and `heuristic`.

    python tools/rope_fwd_sweep.py [--out FILE]

Every config's outputs are compared with the heuristic's (a config that disagrees is reported,
not timed). Bytes moved: read q, k, write q_out, k_out (cos/sin, per token, left out). A
device-to-device copy of q's size is timed in the same process, for the share of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rope_bwd_sweep, beside this file
from e2e import provenance, write_json  # noqa: E402
from rope_bwd_sweep import SHAPES, bench_us, qwen3_inputs  # noqa: E402


def main() -> int:
    from solforge.kernels import rope as R

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res: dict = {**provenance(), "shapes": []}
    Hq, Hk, D = 32, 8, 128
    for B, S, what in reversed(SHAPES):  # the inference shape first
        q, k, cos, sin, qw, kw = qwen3_inputs(B, S, Hq, Hk, D, cos_batch=1)
        opts = dict(norm=True, round_before_weight=True, heads_first=True)
        wl = R.workload_for(q, k, cos, sin, qw, kw, 1e-6, **opts)
        nbytes = 2 * (q.numel() + k.numel()) * 2
        dst = torch.empty_like(q)
        copy_us = bench_us(lambda dst=dst, q=q: dst.copy_(q))
        h = R.heuristic(wl)
        args = (q, k, cos, sin, qw, kw, 1e-6)
        ref = R.rope(*args, **opts, config=h)
        timed: dict[str, float | str] = {}
        for c in [h, *[c for c in R.space(wl) if c != h]]:
            run(c, args, opts, ref, timed)
        tiles = sorted((v, k_) for k_, v in timed.items() if isinstance(v, float))[:8]
        for _, enc in tiles:
            for progs in (1, 2, 4, 8):
                for st in (1, 2):
                    run(dataclasses.replace(R.Config.decode(enc), progs=progs, stages=st), args, opts, ref, timed)
        ok = {k_: v for k_, v in timed.items() if isinstance(v, float)}
        ranked = sorted(ok, key=ok.__getitem__)
        row = {"shape": [B, S, Hq, Hk, D], "what": what, "bytes": nbytes, "heuristic": h.encode(),
               "heuristic_us": ok.get(h.encode()), "copy_TBps": round(2 * q.numel() * 2 / copy_us / 1e6, 3),
               "best": [{"config": c, "us": ok[c], "TBps": round(nbytes / ok[c] / 1e6, 3)} for c in ranked[:12]],
               "configs": timed}
        print(json.dumps({k_: v for k_, v in row.items() if k_ != "configs"}), flush=True)
        res["shapes"].append(row)
        write_json(res, a.out, indent=1)
    return 0


def run(c: Any, args: tuple[Any, ...], opts: dict[str, Any], ref: Any, timed: dict[str, float | str]) -> None:
    from solforge.kernels import rope as R

    try:
        out = R.rope(*args, **opts, config=c)
        if not all(torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2) for x, y in zip(out, ref, strict=True)):
            timed[c.encode()] = "differs from the heuristic"
            return
        timed[c.encode()] = round(bench_us(lambda: R.rope(*args, **opts, config=c)), 2)
    except Exception as e:  # a config that fails to compile is a result, not a crash
        timed[c.encode()] = f"{type(e).__name__}: {str(e)[:120]}"


if __name__ == "__main__":
    sys.exit(main())
