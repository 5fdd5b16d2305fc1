"""Decided kernels/torch_order.py: the order in which ATen's CUDA reduce adds a row, emulated and matched bit for bit
(bench/results/2026-11-26-h100-session23.md).

GPU: the order in which torch's CUDA reduce kernel sums a row, checked bit for bit.

    python tools/reduce_order_probe.py [--out FILE]

An RMSNorm's statistic in eager PyTorch is `x.float().pow(2).mean(-1)`. Its fp32 sum is taken in
the order of ATen's reduce kernel (Reduce.cuh, setReduceConfig), which this script emulates with
elementwise fp32 ops in that order (each is exact IEEE arithmetic, so the order alone decides the
bits), for the case it covers: a contiguous last-dim reduction, vectorized by 4 (N % 4 == 0,
N >= 128), one row per group of `width` lanes, no split across warps or blocks:
- lane l of a row sums the 4-vectors l, l + width, l + 2 width, ... into four accumulators, one per
  vector element, in that order; then ((a0 + a1) + a2) + a3;
- lanes past the warp are folded in shared memory, halving from width / 2 down to 32;
- the warp's 32 values are folded by shuffles: offsets 16, 8, 4, 2, 1 ("down") or 1, 2, 4, 8, 16
  ("up"); the header torch ships says which, and both are checked;
- the sum times torch's factor, fl(outputs) / fl(numel).
For each shape it reports the share of rows whose emulated mean equals torch's bit for bit, per
warp order, and the block width torch's configuration gives. solforge/kernels/torch_order.py
carries the same rule (torch_sum_width, sumsq_ref) for the kernels; this script stays as it ran on
2026-11-26. The lines of the installed
Reduce.cuh that set the warp order are printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import provenance, write_json  # noqa: E402


def last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def block_width(rows: int, n: int) -> tuple[int, int, bool]:
    """setReduceConfig for a vectorized last-dim reduction of `rows` rows of `n` fp32: (width,
    height, whether the input is split across warps, which the emulation does not cover)."""
    dim0, dim1 = n // 4, rows
    mnt = 512
    d0 = last_pow2(dim0) if dim0 < mnt else mnt
    d1 = last_pow2(dim1) if dim1 < mnt else mnt
    width = min(d0, 32)
    height = min(d1, mnt // width)
    width = min(d0, mnt // height)
    values_per_thread = -(-n // width)
    split = values_per_thread >= min(height * 16, 256)
    return width, height, split


def emulate(sq: torch.Tensor, width: int, warp: str) -> torch.Tensor:
    """The row sums of `sq` (rows x n fp32) in the reduce kernel's order."""
    rows, n = sq.shape
    vecs = n // 4
    rounds = -(-vecs // width)
    pad = rounds * width * 4 - n
    v = torch.nn.functional.pad(sq, (0, pad)).view(rows, rounds, width, 4)  # adding 0.0 is exact
    acc = v[:, 0].clone()
    for k in range(1, rounds):
        acc = acc + v[:, k]
    lane = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]  # rows x width
    w = width
    while w > 32:  # shared memory: lanes [0, w/2) += lanes [w/2, w)
        w //= 2
        lane = lane[:, :w] + lane[:, w:2 * w]
    if warp == "down":
        while w > 1:
            w //= 2
            lane = lane[:, :w] + lane[:, w:2 * w]
        return lane[:, 0]
    # offsets 1, 2, 4, ...: lane 0 ends with the tree of adjacent pairs
    while lane.shape[1] > 1:
        lane = lane[:, 0::2] + lane[:, 1::2]
    return lane[:, 0]


def probe(rows: int, n: int, seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    sq = x.float().pow(2)
    ref = sq.mean(-1)
    width, height, split = block_width(rows, n)
    out: dict[str, Any] = {"rows": rows, "n": n, "width": width, "height": height, "split_across_warps": split}
    factor = torch.tensor(float(rows), dtype=torch.float32) / torch.tensor(float(rows * n), dtype=torch.float32)
    for warp in ("down", "up"):
        mean = emulate(sq, width, warp) * factor.to("cuda")
        out[f"match_{warp}"] = round(float((mean.view(torch.int32) == ref.view(torch.int32)).float().mean()), 6)
    # torch's own sum then the factor: the same reduce kernel, so the same order as the mean's
    out["match_torch_sum_then_factor"] = round(float(((sq.sum(-1) * factor.to("cuda")).view(torch.int32)
                                                       == ref.view(torch.int32)).float().mean()), 6)
    return out


def header_lines() -> list[str]:
    root = Path(torch.__file__).parent / "include" / "ATen" / "native" / "cuda" / "Reduce.cuh"
    if not root.exists():
        return [f"{root}: not installed"]
    lines = root.read_text().splitlines()
    return [f"{i + 1}: {s.strip()}" for i, s in enumerate(lines) if "for (int offset" in s or "Intra-warp" in s]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    shapes = [(4096, 2560), (16384, 2560), (524288, 128), (65536, 128), (1, 2560), (2, 2560), (7, 2560),
              (16, 2560), (4096, 2048), (4096, 4096), (2048, 5120), (1024, 8192), (4096, 1536), (300, 896)]
    rows = [probe(r, n, seed=i) for i, (r, n) in enumerate(shapes)]
    for r in rows:
        print(r)
    result = {**provenance(), "header": header_lines(), "rows": rows}
    print("\n".join(result["header"]))
    if a.out:
        write_json(result, a.out)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
