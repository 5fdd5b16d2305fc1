"""Probe: one KernelBench problem's generated regions, the same schedules, two versions of the code
generator, timed back to back on the GPU.

    PYTHONPATH=DIR_A python tools/ab_codegen.py dump --problem P --sched S [--sched S2] [--spread N] --out a.json
    PYTHONPATH=DIR_B python tools/ab_codegen.py dump --problem P --sched S [--sched S2] --out b.json
    PYTHONPATH=$PWD  python tools/ab_codegen.py time --problem P a.json b.json [--out FILE.json]

`dump` captures the problem at its own sizes on the GPU (its inputs, fp32), forms the generated
regions as the planner does (the hand-written families' nodes left out) and writes, for each region
and each given schedule the region admits, the kernel source that checkout's generator writes.
`time` forms the regions again with this checkout, runs each source of each file under the same
launch (this checkout's runtime, its `generate` replaced by the stored text, so the stored source
is used as it is, with whatever stride hints its generator wrote), checks every output
against the region's reference (float64) and times them alternately (medians of do_bench, L2
flushed), several rounds, so a drift of the clocks hits each side alike.

Written for (2026-11-28): level 2 problem 60's looped GroupNorm region, 874 us on one H200 host
and 1054 us on another after the chunk loops were peeled (full chunks unmasked, the tail after
them), the same schedule; problem 85's, with the same schedule, had gone 510 -> 469.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: `dump` only (a check of the script)


def _regions(problem: str) -> list[Any]:
    from solforge.capture import capture
    from solforge.codegen import regions as RG
    from solforge.plan import find_matches
    from solforge.plan import generated as GEN
    from solforge.zoo.loaders import import_file

    module = import_file(problem)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).to(DEV).eval()
    torch.manual_seed(1)
    raw = module.get_inputs()
    raw = raw if isinstance(raw, list | tuple) else [raw]
    inputs = tuple(x.to(DEV) if isinstance(x, torch.Tensor) else x for x in raw)
    torch._dynamo.reset()
    with torch.no_grad():
        captured = capture(model, inputs)
    out = []
    for g in captured.graphs:
        graph = g.aten.graph
        family = {n for m in find_matches(graph) if m.family != "generated" for n in m.nodes}
        scratch, excluded = GEN.scratch(graph, family)
        out += [fr.lowered for fr in RG.form_regions(scratch.graph, excluded)]
    return out


def dump(a: argparse.Namespace) -> None:
    from solforge.codegen import schedule as SC
    from solforge.codegen.triton_gen import generate

    found: dict[str, dict[str, str]] = {}
    for i, low in enumerate(_regions(a.problem)):
        texts = list(a.sched or [])
        if a.spread:  # the heuristic and the first N of the space as the tuner walks it (tune/order.py)
            from solforge.tune.order import spread

            texts += [c.encode() for c in [SC.heuristic(low), *spread(SC.space(low))[:a.spread]]]
        for text in dict.fromkeys(texts):
            s = SC.Schedule.decode(text)
            if SC.is_valid(s, low):
                extra = {"aligns": _aligns(low)} if a.hints else {}
                found.setdefault(str(i), {})[text] = generate(low, s, **extra)
    Path(a.out).write_text(json.dumps(found))
    print(f"{sum(len(v) for v in found.values())} sources to {a.out}")


def _aligns(low: Any) -> tuple[int, ...]:
    """The stride hints a launch on the region's recorded strides gets (runtime.stride_aligns)."""
    from solforge.codegen import runtime as RT

    metas = [*low.ir.inputs, *(low.ir.out_meta(r) for r in low.ir.outputs)]
    return RT.stride_aligns([torch.empty_strided(m.shape, m.stride, device="meta") for m in metas])


def _inputs(low: Any) -> list[torch.Tensor]:
    xs = []
    for m in low.ir.inputs:
        t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=DEV)
        t.copy_(torch.randn(m.shape, device=DEV).to(m.dtype)) if m.dtype.is_floating_point else t.zero_()
        xs.append(t)
    return xs


def time_(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from e2e import bench_us

    from solforge.codegen import reference as REF
    from solforge.codegen import runtime as RT
    from solforge.codegen import schedule as SC

    files = [json.loads(Path(f).read_text()) for f in a.files]
    result = []
    for i, low in enumerate(_regions(a.problem)):
        common = set.intersection(*(set(f.get(str(i), {})) for f in files))
        if not common:
            continue
        xs = _inputs(low)
        ref = REF.reference(low.ir, [x.double() if x.is_floating_point() else x for x in xs])
        for text in sorted(common):
            s = SC.Schedule.decode(text)
            fns = []
            for f in files:
                src = f[str(i)][text]
                RT.generate = lambda *_a, _src=src, **_k: _src  # type: ignore[assignment]
                RT._KERNELS.clear()
                outs = RT.run(low, s, xs)  # compiles this source now; the launch keeps its kernel
                runs = tuple(RT.linear_runs(t.shape, t.stride()) for t in (*xs, *outs))
                k = RT.kernel(low, s, runs, RT.stride_aligns((*xs, *outs)))
                err = max(float((o.double() - r).abs().max() / r.abs().max().clamp_min(1e-30))
                          for o, r in zip(outs, ref, strict=True))
                fns.append((k, err))
            times: list[list[float]] = [[] for _ in files]
            for _ in range(a.rounds):
                for j, (k, _err) in enumerate(fns):
                    RT._KERNELS.clear()
                    key = (low.ir.key, s, tuple(RT.linear_runs(t.shape, t.stride()) for t in (*xs, *outs)),
                           RT.stride_aligns((*xs, *outs)))
                    RT._KERNELS[key] = k
                    times[j].append(bench_us(lambda low=low, s=s, xs=xs, outs=outs: RT.run(low, s, xs, outs)))
            row = {"region": i, "key": low.ir.key[:16], "schedule": text,
                   "us": [sorted(t)[len(t) // 2] for t in times], "all_us": times,
                   "max_rel_err": [e for _k, e in fns]}
            result.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "all_us"}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--problem", required=True)
    d.add_argument("--sched", action="append", help="a schedule's text (Schedule.encode())")
    d.add_argument("--spread", type=int, default=0,
                   help="also each region's heuristic and the first N schedules of its space, spread as the "
                        "tuner walks it (compared where both checkouts wrote the same texts)")
    d.add_argument("--out", required=True)
    d.add_argument("--hints", action="store_true", help="with the stride hints of the recorded strides (a generator "
                   "that has them: triton_gen.generate's aligns)")
    t = sub.add_parser("time")
    t.add_argument("--problem", required=True)
    t.add_argument("files", nargs="+")
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--out")
    a = ap.parse_args()
    dump(a) if a.cmd == "dump" else time_(a)


if __name__ == "__main__":
    main()
