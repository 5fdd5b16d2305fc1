"""Decided reduce.sum_rows for the weight-gradient partial rows: a backward launcher's device time, kernel by kernel
(kernels/reduce.py).

GPU: where a backward launcher's time goes, kernel by kernel (torch.profiler), at the Qwen3-4B shapes.

    python tools/kernel_split.py [--out FILE]

For rmsnorm_bwd (with and without the residual gradient), layernorm_bwd (with and without it) and
rope_bwd at their heuristic configs: the median of do_bench for the whole launcher call (as the
family benchmarks time it), and from 20 profiled calls the mean device time of each kernel it
launches (the main kernel, the sum of the partial weight-gradient rows). The difference between
the two is what a do_bench timing adds to the kernels (events, gaps between launches). Each case
also times a device-to-device copy moving the same bytes (nbytes / 2 read, as many written) both
ways: the ceiling for that amount of traffic, measured the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import bench_us, provenance, write_json  # noqa: E402


def split(fn: Callable[[], Any], calls: int = 20) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:90]] += e.device_time / calls
    return {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def main() -> int:
    from rope_bwd_sweep import qwen3_inputs

    from solforge.kernels import layernorm_bwd as LB
    from solforge.kernels import rmsnorm_bwd as RB
    from solforge.kernels import rope as R
    from solforge.kernels import rope_bwd as RBW

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    a = p.parse_args()
    res: dict[str, Any] = {**provenance(), "cases": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy, ds = (torch.randn(16384, 2560, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    w = (1 + 0.1 * torch.randn(2560, device="cuda", generator=g)).to(torch.bfloat16)
    cases: list[tuple[str, int, Callable[[], Any]]] = [
        ("rmsnorm_bwd ds", 4, lambda: RB.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True, ds=ds)),
        ("rmsnorm_bwd", 3, lambda: RB.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True)),
        ("layernorm_bwd ds", 4, lambda: LB.layernorm_bwd(dy, x, w, 1e-5, ds=ds, bias_grad=True)),
        ("layernorm_bwd", 3, lambda: LB.layernorm_bwd(dy, x, w, 1e-5, bias_grad=True)),
    ]
    q, k, cos, sin, qw, kw = qwen3_inputs(2, 8192, 32, 8, 128, cos_batch=2)
    opts = dict(norm=True, round_before_weight=True, heads_first=True)
    qo, ko = R.rope(q, k, cos, sin, qw, kw, 1e-6, **opts)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    rope_bytes = 3 * (q.numel() + k.numel()) * 2
    cases.append(("rope_bwd B2 S8192", 0, lambda: RBW.grads(gq, gk, q, k, cos, sin, qw, kw, 1e-6, **opts)))
    for name, tensors, fn in cases:
        nbytes = tensors * x.numel() * 2 if tensors else rope_bytes
        total = bench_us(fn)
        kernels = split(fn)
        main_us = max(kernels.values())
        src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        copy_us = bench_us(lambda dst=dst, src=src: dst.copy_(src))
        copy_dev = sum(split(lambda dst=dst, src=src: dst.copy_(src)).values())
        del src, dst
        all_us = sum(kernels.values())
        row = {"case": name, "bytes": nbytes, "do_bench_us": round(total, 2), "TBps": round(nbytes / total / 1e6, 3),
               "kernels_us": kernels, "main_kernel_TBps": round(nbytes / main_us / 1e6, 3),
               "all_kernels_us": round(all_us, 2), "all_kernels_TBps": round(nbytes / all_us / 1e6, 3),
               "copy_same_bytes": {"do_bench_us": round(copy_us, 2), "TBps": round(nbytes / copy_us / 1e6, 3),
                                   "device_us": round(copy_dev, 2), "device_TBps": round(nbytes / copy_dev / 1e6, 3)}}
        print(json.dumps(row), flush=True)
        res["cases"].append(row)
        write_json(res, a.out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
