"""Decided rope's `bwd_heuristic` (kernels/rope.py): one head and ~2K values a tile, 4 programs per SM.

GPU: the rope backward (kernels/rope.py `rope_bwd`, q/k RMSNorm fused, norm weights) over
`bwd_space` at Qwen3-4B's shapes, to set `bwd_heuristic` from measurements.

    python tools/rope_bwd_sweep.py [--out FILE]

The gradients have the strides of the forward's outputs ((B, H, S, D) views of token-major
memory), as SDPA's backward hands them over. Every config's dq, dk and weight gradients are
compared with the heuristic's (a config that disagrees is reported, not timed). Bytes moved: read
grad, x for q and k, write dq, dk. The first shape sweeps the whole space, the second times the
first's 16 best and the heuristic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import provenance, write_json  # noqa: E402

SHAPES = [(1, 4096, "Qwen3-4B training step B1 S4096"), (2, 8192, "Qwen3-4B B2 S8192")]


def bench_us(fn: object) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=20, rep=100, return_mode="median")) * 1e3


def qwen3_inputs(B: int, S: int, Hq: int, Hk: int, D: int, *, cos_batch: int) -> tuple[torch.Tensor, ...]:
    """Seeded bf16 q, k (B, S, H, D), cos/sin (cos_batch, S, D) and q/k norm weights (D,) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, Hq, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, S, Hk, D, device="cuda", generator=g).to(torch.bfloat16)
    theta = torch.rand(cos_batch, S, D, device="cuda", generator=g) * 6.2832
    cos, sin = theta.cos().to(torch.bfloat16), theta.sin().to(torch.bfloat16)
    qw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    kw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    return q, k, cos, sin, qw, kw


def main() -> int:
    from solforge.kernels import rope as R

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res: dict = {**provenance(), "shapes": []}
    Hq, Hk, D = 32, 8, 128
    for B, S, what in SHAPES:
        q, k, cos, sin, qw, kw = qwen3_inputs(B, S, Hq, Hk, D, cos_batch=B)
        opts = dict(norm=True, round_before_weight=True, heads_first=True)
        qo, ko = R.rope(q, k, cos, sin, qw, kw, 1e-6, **opts)
        gq, gk = torch.randn_like(qo), torch.randn_like(ko)  # the outputs' strides
        wl = R.workload_for(q, k, cos, sin, qw, kw, 1e-6, **opts)
        nbytes = 3 * (q.numel() + k.numel()) * 2
        h = R.bwd_heuristic(wl)
        ref = R.rope_bwd(gq, gk, q, k, cos, sin, qw, kw, 1e-6, **opts, config=h)
        args = (gq, gk, q, k, cos, sin, qw, kw, 1e-6)
        timed: dict[str, float | str] = {}
        configs = R.bwd_space(wl)
        if res["shapes"]:
            keep = {b["config"] for b in res["shapes"][0]["best"][:16]} | {h.encode()}
            configs = [c for c in configs if c.encode() in keep]
        for c in configs:
            try:
                out = R.rope_bwd(*args, **opts, config=c)
                bad = [i for i, (x, y) in enumerate(zip(out, ref, strict=True))
                       if not torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2)]
                if bad:
                    timed[c.encode()] = f"differs from the heuristic in outputs {bad}"
                    continue
                timed[c.encode()] = round(bench_us(lambda c=c, a=args, o=opts: R.rope_bwd(*a, **o, config=c)), 2)
            except Exception as e:  # a config that fails to compile is a result, not a crash
                timed[c.encode()] = f"{type(e).__name__}: {str(e)[:120]}"
        ok = {k_: v for k_, v in timed.items() if isinstance(v, float)}
        ranked = sorted(ok, key=ok.__getitem__)
        row = {"shape": [B, S, Hq, Hk, D], "what": what, "bytes": nbytes, "heuristic": h.encode(),
               "heuristic_us": ok.get(h.encode()),
               "best": [{"config": c, "us": ok[c], "TBps": round(nbytes / ok[c] / 1e6, 3)} for c in ranked[:16]],
               "configs": timed}
        print(json.dumps({k_: v for k_, v in row.items() if k_ != "configs"}), flush=True)
        res["shapes"].append(row)
    write_json(res, a.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
