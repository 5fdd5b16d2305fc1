"""Probe: every generated region of KernelBench (levels 1-3 at shrunk sizes) compiles for sm_90
without a GPU.

    PYTHONPATH=$PWD python tools/compile_sweep.py [--levels 1,2,3] [--kernelbench PATH] [--samples 2]
        [--official] [--problems GLOB] [--vectors]

For each problem (tools/codegen_coverage.py's shrunk sizes and capture; `--official`: its own sizes
on the meta device), each region the generated
matcher forms (worth a kernel or not), the heuristic schedule and `--samples` sampled ones are
compiled through Triton's own pipeline for GPUTarget("cuda", 90, 32) with its bundled ptxas
(tests/test_codegen_sm90_compile.py's helpers: a process without the interpreter), 10 at a time.
Prints each compiler error and the count; with `--vectors`, per kernel how many of its global
loads and stores are 8- or 16-byte vectors (found with it: stride arguments 4 mod 16 left rows of
4100 values and NCHW stores along H*W = 20 scalar, hence codegen's stride hints).

Decided (2026-11-28): the code cap of codegen/schedule.py (`_code_ok`: a thread unrolls at most
128 loads): a chained-pools kernel of an Inception block (90 loads a point, 8192-wide tiles) and
one of two chained 3-D max pools (216 loads, 256 x 32 tiles) kept ptxas busy for more than 6
minutes each; and `layout.loads_per_point` counting loads as the generator writes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tools"), str(ROOT)]

import codegen_coverage as CC  # noqa: E402
from test_codegen_sm90_compile import _as_launched, _item, sm90_compile  # noqa: E402

from solforge.capture import capture  # noqa: E402
from solforge.codegen import regions as RG  # noqa: E402
from solforge.codegen import runtime as RT  # noqa: E402
from solforge.codegen import schedule as SC  # noqa: E402
from solforge.plan import find_matches  # noqa: E402
from solforge.plan import generated as GEN  # noqa: E402


def _official(path: Path) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The problem's model and inputs at its own sizes on the meta device (eval, as the suite)."""
    from solforge.zoo.loaders import import_file

    module = import_file(str(path))
    with torch.device("meta"):
        model = module.Model(*module.get_init_inputs()).eval()
        raw = module.get_inputs()
    raw = raw if isinstance(raw, list | tuple) else [raw]
    return model, tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,2,3")
    ap.add_argument("--kernelbench", default=str(ROOT.parent / "shared" / "kernelbench"))
    ap.add_argument("--samples", type=int, default=2, help="sampled schedules per region beside the heuristic")
    ap.add_argument("--official", action="store_true",
                    help="the problems at their official sizes, captured on the meta device (no memory, no run)")
    ap.add_argument("--problems", default="*", help="a glob over the problem files' stems")
    ap.add_argument("--vectors", action="store_true",
                    help="compile each as launched on the region's recorded strides (Triton's specializations, "
                         "solforge's stride hints) and print its global loads and stores: vector / all")
    a = ap.parse_args()
    rng = random.Random(0)
    items, names = [], []
    t0 = time.time()
    for level in (int(x) for x in a.levels.split(",")):
        files = sorted((Path(a.kernelbench) / f"level{level}").glob(f"{a.problems}.py"),
                       key=lambda p: int(p.stem.split("_")[0]))
        for path in files:
            try:
                model, inputs = _official(path) if a.official else CC.load_small(path, level)[:2]
                torch._dynamo.reset()
                with torch.no_grad():
                    captured = capture(model, inputs)
                for g in captured.graphs:
                    graph = g.aten.graph
                    family = {n for m in find_matches(graph) if m.family != "generated" for n in m.nodes}
                    scratch, excluded = GEN.scratch(graph, family)
                    for fr in RG.form_regions(scratch.graph, excluded):
                        low = fr.lowered
                        if a.official:  # captured on the meta device: the heuristic as on a GPU
                            low = dataclasses.replace(low, ir=dataclasses.replace(low.ir, device="cuda"))
                        space = SC.space(low)
                        picks = [SC.heuristic(low), *rng.sample(space, min(a.samples, len(space)))]
                        metas = [*low.ir.inputs, *(low.ir.out_meta(r) for r in low.ir.outputs)]
                        ts = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta") for m in metas]
                        for c in dict.fromkeys(picks):
                            items.append(_as_launched(low, c, ts, RT.stride_aligns(ts)) if a.vectors else _item(low, c))
                            names.append(f"{level}/{path.stem}: {c.encode()}")
            except Exception as e:  # noqa: BLE001 - a problem that does not load or capture is a line
                print(f"skip {level}/{path.stem}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    print(f"{len(items)} kernels ({time.time() - t0:.0f} s to form)", flush=True)
    errors = 0
    for i in range(0, len(items), 10):
        for n, e in zip(names[i:i + 10], sm90_compile(items[i:i + 10]), strict=True):
            if isinstance(e, dict):  # --vectors: compiled, its PTX (every launch of a split)
                ptx = "\n".join(e["ptx"])
                ld, st = re.findall(r"ld\.global\S*", ptx), re.findall(r"st\.global\S*", ptx)
                vec = [sum(".v2" in x or ".v4" in x for x in xs) for xs in (ld, st)]
                print(f"{n}: loads {vec[0]}/{len(ld)} vector, stores {vec[1]}/{len(st)}", flush=True)
            elif e is not None:
                errors += 1
                print(f"ERROR {n}: {e[:800]}", flush=True)
        print(f"{min(i + 10, len(items))} compiled, {errors} errors ({time.time() - t0:.0f} s)", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
