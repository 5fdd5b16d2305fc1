"""Mixtral's forward profiled per ATen op: where the routing's time goes, eager and solforge.

    python tools/moe_prof.py [--out FILE]   (needs a GPU; run from the repository root)

Mixtral's architecture as bench/suite_archs.py builds it (4 layers, B2 S2048, bf16, random weights),
run eagerly, then optimized (budget 20, no kernel database); each profiled for one call after three
(torch.profiler, CUDA time per op and input shape). Found (H100, 2026-11-27,
bench/results/2026-11-27-h100-mixtral-op-profile-82513d5.txt): the routing around `_grouped_mm`
passes over the [8192, 28672] expert activations four times a layer in eager (masked_fill 988 us,
as a clone and an in-place fill; silu 327; mul 338), where torch.compile runs one fused kernel; with
budget 20 optimize returned the original (the end-to-end check failed: bf16 routing ties).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def table(fn: Any) -> str:
    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as pr:
            fn()
            torch.cuda.synchronize()
    return pr.key_averages(group_by_input_shape=True).table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=60, max_shapes_column_width=80)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="moe_prof.txt")
    a = p.parse_args()
    import suite_archs

    import solforge

    model, args = suite_archs.build("mixtral-8x7b", False, "cuda", "fwd")
    model.eval()
    lines = ["==== eager", table(lambda: model(*args))]
    t = time.time()
    opt, rep = solforge.optimize(model, args, budget=20, db=False, profile="off")
    lines += [f"optimize {time.time() - t:.1f} s: {rep.returned}: {rep.why}", "==== solforge"]
    lines.append(table(lambda: opt(*args)))
    Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
