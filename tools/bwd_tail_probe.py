"""Decided the norm backwards' heuristic without the residual gradient: two rows a tile, the tail widened to 4 warps'
layout, 2 programs per SM (kernels/rmsnorm_bwd.py, kernels/layernorm_bwd.py).

GPU probe: norm backward configs whose row tail is widened to the main block's layout.

    python tools/bwd_tail_probe.py [--out FILE] [--rms CFG ...] [--ln CFG ...]

Nsight Compute (tools/ncu_norm_bwd.py) found rmsnorm_bwd and layernorm_bwd at 16384 x 2560 bf16
issue-bound, not memory-bound: DRAM at 72-74% of peak, warps mostly stalled on barriers or on
other warps' issue, while a plain `torch.mul` with the same traffic ran at 90%. The SASS of the
block split (2560 = 2048 + 512) shows why the split never paid: a 512-lane tail on 4+ warps gets
a layout of fewer values a thread than the main block, and Triton converts the whole main tile to
it through shared memory (18-19 barriers a row tile instead of 3). A tail as wide as one pass of
the main block's layout (8 values x 32 lanes x warps: 1024 on 4 warps) keeps one layout.

This times, at 16384 (--rows) x 2560 bf16 without the residual gradient (with it: --ds), each given config (checked
against the reference first) against the shipped heuristic and a copy of the same bytes.
rmsnorm_bwd configs: its config string, optionally with `:tail=N` to force the tail block (the
kernel takes any power-of-two tail; the config class picks it, BwdConfig.blocks).
layernorm_bwd configs: its own strings (bh/bt already free).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import bench_us, provenance, write_json  # noqa: E402

from solforge.kernels import layernorm_bwd as LB  # noqa: E402
from solforge.kernels import rmsnorm_bwd as RB  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Tail(RB.BwdConfig):
    """rmsnorm_bwd's config with the tail block given."""

    tail: int = 0

    def blocks(self, H: int, vec: int = 8) -> tuple[int, int]:
        main = triton.next_power_of_2(H) // 2
        return (main, self.tail) if self.tail else super().blocks(H, vec)


def rms_config(text: str) -> RB.BwdConfig:
    parts = text.split(":")
    tail = [p for p in parts if p.startswith("tail=")]
    base = RB.BwdConfig.decode(":".join(p for p in parts if not p.startswith("tail=")))
    if not tail:
        return base
    return _Tail(**dict(base.items()), tail=int(tail[0].split("=")[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    p.add_argument("--rms", nargs="*", default=[])
    p.add_argument("--ln", nargs="*", default=[])
    p.add_argument("--repeat", type=int, default=2, help="time each config this many times (interleaved)")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--ds", action="store_true", help="with the residual gradient (add_rmsnorm's, add_layernorm's)")
    a = p.parse_args()
    res: dict[str, Any] = {**provenance(), "shape": [a.rows, 2560], "results": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy, ds = (torch.randn(a.rows, 2560, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    w = (1 + 0.1 * torch.randn(2560, device="cuda", generator=g)).to(torch.bfloat16)
    res["ds"] = a.ds
    kd: dict[str, Any] = {"ds": ds} if a.ds else {}
    nbytes = (4 if a.ds else 3) * x.numel() * 2
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    cases: dict[str, Any] = {"copy": lambda: dst.copy_(src),
                             "rms heuristic": lambda: RB.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True, **kd),
                             "ln heuristic": lambda: LB.layernorm_bwd(dy, x, w, 1e-5, bias_grad=True, **kd)}
    rms_ref = RB.rmsnorm_bwd_ref(dy, x, w, 1e-6, round_before_weight=True, **kd)
    ln_ref = LB.layernorm_bwd_ref(dy, x, w, 1e-5, bias_grad=True, **kd)

    def check(name: str, got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> bool:
        errs = [((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                for o, r in zip(got, ref, strict=True)]
        ok = max(errs) < 2e-2
        if not ok:
            res["results"][name] = {"error": f"mismatch {errs}"}
            print(name, "MISMATCH", errs, flush=True)
        return ok

    for text in a.rms:
        c = rms_config(text)
        name = f"rms {text}"
        try:
            if check(name, RB.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True, config=c, **kd), rms_ref):
                cases[name] = lambda c=c: RB.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True, config=c, **kd)
        except Exception as e:  # noqa: BLE001  a config that does not build is data
            res["results"][name] = {"error": str(e)[:300]}
            print(name, "ERROR", str(e)[:200], flush=True)
    for text in a.ln:
        c = LB.BwdConfig.decode(text)
        name = f"ln {text}"
        try:
            if check(name, LB.layernorm_bwd(dy, x, w, 1e-5, bias_grad=True, config=c, **kd), ln_ref):
                cases[name] = lambda c=c: LB.layernorm_bwd(dy, x, w, 1e-5, bias_grad=True, config=c, **kd)
        except Exception as e:  # noqa: BLE001
            res["results"][name] = {"error": str(e)[:300]}
            print(name, "ERROR", str(e)[:200], flush=True)
    bench_us(cases["copy"])  # a discarded first timing (the first after idle reads slow)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.repeat):
        for name, fn in cases.items():
            times[name].append(round(bench_us(fn), 2))
    for name, ts in times.items():
        best = min(ts)
        res["results"][name] = {"us": ts, "TBps_best": round(nbytes / best / 1e6, 3),
                                "of_3.02": round(nbytes / best / 1e6 / 3.02, 3)}
        print(f"{name:48s} {ts} us  {nbytes / best / 1e6:.3f} TB/s  {nbytes / best / 1e6 / 3.02:.1%} of 3.02",
              flush=True)
    if a.out:
        write_json(res, a.out)
    else:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
