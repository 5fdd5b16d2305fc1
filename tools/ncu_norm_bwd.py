"""Found the norm backwards issue-bound, not memory-bound, under Nsight Compute, which led to tools/bwd_tail_probe.py's
widened tail (bench/results/2026-11-23-h100-session9.md).

GPU, under Nsight Compute: the kernels whose hardware counters explain the norm backwards' rate.

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        --csv --page details python tools/ncu_norm_bwd.py > ncu.csv

At 16384 x 2560 bf16, two calls each (ncu replays each kernel per section, restoring memory):
- `torch.mul(x, dy, out=dx)`: the same traffic as rmsnorm_bwd without the residual gradient (read
  two, write one), with no reduction: what streaming alone reaches with that mix (a same-dtype
  `copy_` is a cudaMemcpy, not a kernel, so ncu does not see it);
- rmsnorm_bwd and layernorm_bwd at their heuristic configs, without and with the residual gradient
  ds (add_rmsnorm's and add_layernorm's backward);
- with --tma, the TMA prototype of tools/tma_bwd_probe.py (R=1, 4 stages, 4 warps, 2 programs per
  SM, TMA store).
`python tools/ncu_norm_bwd.py --summarize ncu.csv` prints duration, DRAM throughput and the
leading warp stall reasons of each kernel.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

_KEEP = ("Duration", "DRAM Throughput", "Memory Throughput", "Achieved Occupancy", "Registers Per Thread",
         "Block Size", "Grid Size", "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block",
         "Warp Cycles Per Issued Instruction", "Issue Slots Busy", "Compute (SM) Throughput", "L2 Hit Rate",
         "Mem Busy", "Max Bandwidth", "Theoretical Occupancy")


def summarize(path: str) -> None:
    lines = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))  # after ncu's own banner
    rows = list(csv.DictReader(lines[start:]))
    per: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for r in rows:
        key = (r["ID"], r["Kernel Name"][:70])
        name = r["Metric Name"]
        if name in _KEEP or "stall" in name.lower():
            per[key][name] = f'{r["Metric Value"]} {r["Metric Unit"]}'.strip()
    for (kid, kname), m in per.items():
        print(f"== {kid} {kname}")
        for k in _KEEP:
            if k in m:
                print(f"   {k}: {m[k]}")
        for k, v in m.items():
            if k not in _KEEP:
                print(f"   {k}: {v}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--summarize", metavar="CSV")
    p.add_argument("--tma", action="store_true", help="also the TMA prototype")
    a = p.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return 0
    import triton

    from solforge.kernels import layernorm_bwd as LB
    from solforge.kernels import rmsnorm_bwd as RB

    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy, ds = (torch.randn(16384, 2560, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    w = (1 + 0.1 * torch.randn(2560, device="cuda", generator=g)).to(torch.bfloat16)
    dx = torch.empty_like(x)
    cases = [
        lambda: torch.mul(x, dy, out=dx),
        lambda: RB.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True),
        lambda: LB.layernorm_bwd(dy, x, w, 1e-5, bias_grad=True),
        lambda: RB.rmsnorm_bwd(dy, x, w, 1e-6, round_before_weight=True, ds=ds),
        lambda: LB.layernorm_bwd(dy, x, w, 1e-5, bias_grad=True, ds=ds),
    ]
    if a.tma:
        from tma_bwd_probe import prototype

        triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
        cases.append(prototype("rms", dy, x, w, 1e-6, R=1, NS=4, warps=4, progs=2, tma_store=True))
    for fn in cases:
        fn()
        fn()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
