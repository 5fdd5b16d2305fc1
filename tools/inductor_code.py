"""Probe: the code torch.compile (Inductor, default mode) writes for one KernelBench problem at its
own sizes, beside solforge's generated kernels for the same problem, to read where solforge's
kernel loses (level 1's 41, a 1-D max pool: 3438 µs against Inductor's 2850 on an H200,
2026-11-28, the same taps; no ncu there).

    PYTHONPATH=$PWD python tools/inductor_code.py --problem .kb/level1/41_Max_Pooling_1D.py --out $OUT/41.txt

Writes Inductor's output code (torch._inductor.utils.run_and_get_code: every module it compiled,
its Triton kernels with their launch configs on a GPU, C++ on the CPU) and, after it, the source
of each generated region of the problem under its heuristic schedule (tools/ab_codegen.py forms the
regions as the planner does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", required=True, help="a KernelBench problem file")
    ap.add_argument("--out", required=True, help="the text file to write")
    a = ap.parse_args()

    from ab_codegen import DEV, _regions  # tools/ is a folder of scripts
    from torch._inductor.utils import run_and_get_code

    from solforge.codegen import schedule as SC
    from solforge.codegen.triton_gen import generate
    from solforge.zoo.loaders import import_file

    module = import_file(a.problem)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).to(DEV).eval()
    torch.manual_seed(1)
    raw = module.get_inputs()
    raw = raw if isinstance(raw, list | tuple) else [raw]
    inputs = tuple(x.to(DEV) if isinstance(x, torch.Tensor) else x for x in raw)
    torch._dynamo.reset()
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(model), *inputs)
    parts = [f"# {a.problem} on {DEV}: torch {torch.__version__}", ""]
    for k, code in enumerate(codes):
        parts += [f"# ---- Inductor output code {k + 1} of {len(codes)}", code, ""]
    del model
    for k, low in enumerate(_regions(a.problem)):
        sched = SC.heuristic(low)
        parts += [f"# ---- solforge generated region {k} ({low.space}), heuristic {sched.encode()}",
                  generate(low, sched), ""]
    Path(a.out).write_text("\n".join(parts))
    print(f"{len(codes)} Inductor module(s) and the generated regions to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
