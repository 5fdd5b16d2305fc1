"""Generated kernels' schedule variants on a GPU: for regions each new variant is meant for, the time
of eager, of torch.compile (default mode), of the heuristic's schedule, of the best schedule of the
variants that existed before (pointwise / rows / looped) and of the best of the new ones (tiles,
split, split tiles), each verified against the region's fp64 reference before it is timed.

    python bench/codegen_schedules.py [--cases sum_dim1,bn_nhwc,...] [--limit 60] [--out FILE.json]

Effective bandwidth counts each input and output once (the copy ceiling on an H100 is ~2.7 TB/s).
What to look for: on each case the heuristic close to the best of all, and the new variants ahead of
the old ones by the factor the uncoalesced reads or idle SMs cost (several x on sum_dim1, bn_nhwc,
mean_dim0, transpose; loss and softmax_16x1m against looped's handful of programs).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import bench_us  # noqa: E402

from solforge.codegen import reference as REF  # noqa: E402
from solforge.codegen import regions as RG  # noqa: E402
from solforge.codegen import runtime as RT  # noqa: E402
from solforge.codegen import schedule as SC  # noqa: E402
from solforge.numerics import compare  # noqa: E402

DEVICE = "cuda"
OLD = ("pointwise", "rows", "looped")


def _bn(x: torch.Tensor) -> torch.Tensor:
    mean = x.mean((0, 2, 3), keepdim=True)
    var = ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
    return ((x - mean) * torch.rsqrt(var + 1e-5)).to(x.dtype)


def _ln(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    m = xf.mean(-1, keepdim=True)
    v = ((xf - m) ** 2).mean(-1, keepdim=True)
    return ((xf - m) * torch.rsqrt(v + 1e-5)).to(x.dtype)


def _ln_w(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
    return (x - mean) * torch.rsqrt(var + 1e-5) * w + b


def _cases() -> dict[str, tuple[Callable[..., Any], Callable[[], list[torch.Tensor]]]]:
    bf = torch.bfloat16

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=DEVICE, dtype=bf)

    def f32(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=DEVICE)

    return {
        # tiles: a reduction over a non-contiguous dim
        "sum_dim1": (lambda x: x.float().sum(1).to(bf), lambda: [r(32, 512, 4096)]),
        "softmax_dim1": (lambda x: torch.softmax(x.float(), 1).to(bf), lambda: [r(32, 64, 8192)]),
        "bn_nhwc": (_bn, lambda: [r(32, 56, 56, 256).permute(0, 3, 1, 2)]),  # split tiles on few channels
        "mean_dim0": (lambda x: x.float().mean(0).to(bf), lambda: [r(262144, 64)]),
        # split: few long rows
        "mse_loss": (lambda p, t: ((p.float() - t.float()) ** 2).mean(), lambda: [r(4096, 4096), r(4096, 4096)]),
        "softmax_16x1m": (lambda x: torch.softmax(x.float(), -1).to(bf), lambda: [r(16, 1 << 20)]),
        "sum_all": (lambda x: x.float().sum(), lambda: [r(64, 1 << 20)]),
        # unchanged default (a control): rows reductions over the contiguous dim, NCHW BatchNorm
        "bn_nchw": (_bn, lambda: [r(32, 256, 56, 56)]),
        "layernorm": (_ln, lambda: [r(8192, 4096)]),
        # pointwise tiles: a transposing copy, a channels-last input into a contiguous output
        "transpose": (lambda x: (x.t() * 2).contiguous(), lambda: [r(8192, 8192)]),
        "nhwc_to_nchw": (lambda x: F.gelu(x).contiguous(), lambda: [r(32, 56, 56, 256).permute(0, 3, 1, 2)]),
        # ConvNeXt's residual (timm convnext_tiny, B64: the MLP's token-major output scaled per
        # channel, permuted back, added to the NCHW shortcut): ATen 149 µs, the tuner's best 489
        # (H200, 2026-11-27)
        "convnext_residual": (lambda y, g, x: x + (g * y).view(64, 56, 56, 96).permute(0, 3, 1, 2),
                              lambda: [r(200704, 96), r(96), r(64, 96, 56, 56)]),
        # eval BatchNorm + residual add + ReLU between channels-last convolutions (timm ResNet-50,
        # B64): the flat walk along C (schedule.contig_dim), not along W
        "bn_relu_nhwc": (lambda x, m, v, w, b, s: torch.relu((x - m.view(1, -1, 1, 1)) * torch.rsqrt(
            v.view(1, -1, 1, 1) + 1e-5) * w.view(1, -1, 1, 1) + b.view(1, -1, 1, 1) + s),
            lambda: [r(64, 56, 56, 256).permute(0, 3, 1, 2), r(256), r(256).abs(), r(256), r(256),
                     r(64, 56, 56, 256).permute(0, 3, 1, 2)]),
        # T5's attention softmax (t5-base encoder, B8, seq 512): fp32 scores plus the bf16 position
        # bias, a softmax over 512 keys, bf16 out: solforge 192 µs a layer against compile's 105
        # (which recomputes the bias in the kernel; H100, 2026-11-27)
        "t5_softmax": (lambda s, p: torch.softmax(s.view(8, 12, 512, 512) + p, -1).to(bf),
                       lambda: [torch.randn(96, 512, 512, device=DEVICE), r(8, 12, 512, 512)]),
        # KernelBench level 2's ConvTranspose3d_LayerNorm_GELU_Scaling: a LayerNorm over W (64) of the
        # channels-last convolution's fp32 output, stored NCDHW (a reduction whose input and output
        # are laid out differently): solforge's region 1477 µs, compile's copy + LayerNorm 576 + 562
        # (H200, 2026-11-28); against the same LayerNorm of an NCDHW input and the copy alone
        "ln_w_ndhwc": (lambda x, w, b: F.gelu(_ln_w(x.contiguous(), w, b)),
                       lambda: [f32(32, 32, 64, 64, 64).permute(0, 4, 1, 2, 3), f32(64), f32(64)]),
        "ln_w_ncdhw": (lambda x, w, b: F.gelu(_ln_w(x, w, b)), lambda: [f32(32, 64, 32, 64, 64), f32(64), f32(64)]),
        "ndhwc_to_ncdhw": (lambda x: x.contiguous(), lambda: [f32(32, 32, 64, 64, 64).permute(0, 4, 1, 2, 3)]),
    }


def _row(name: str, fn: Callable[..., Any], make: Callable[[], list[torch.Tensor]], limit: int) -> dict[str, Any]:
    torch.manual_seed(0)
    xs = make()
    gm = make_fx(fn, tracing_mode="fake")(*xs)
    regions = RG.form_regions(gm.graph)
    if len(regions) != 1:
        return {"case": name, "error": f"{len(regions)} regions"}
    fr = regions[0]
    low = fr.lowered
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if any(a not in places for a in fr.inputs):
        return {"case": name, "error": "the region reads a value computed outside it"}
    ins = [xs[places.index(a)] for a in fr.inputs]
    ref = REF.reference(low.ir, ins)
    nbytes = sum(x.numel() * x.element_size() for x in ins) + sum(o.numel() * o.element_size() for o in ref)

    def timed(c: SC.Schedule) -> float | None:
        try:
            got = RT.run(low, c, ins)
        except Exception as e:  # noqa: BLE001 - a failing schedule is a row, the sweep goes on
            print(f"  {c.encode()}: {type(e).__name__}: {e}", file=sys.stderr)
            return None
        if not all(compare(g, r).ok for g, r in zip(got, ref, strict=True)):
            print(f"  {c.encode()}: wrong result", file=sys.stderr)
            return None
        return bench_us(lambda: RT.run(low, c, ins))

    space = SC.space(low)
    h = SC.heuristic(low)
    rng = random.Random(0)
    out: dict[str, Any] = {"case": name, "loop": str(low.space), "heuristic": h.encode(), "bytes": nbytes,
                           "eager_us": bench_us(lambda: fn(*xs)), "space": len(space)}
    try:
        comp = torch.compile(fn)
        comp(*xs)
        out["compile_us"] = bench_us(lambda: comp(*xs))
    except Exception as e:  # noqa: BLE001
        out["compile_error"] = f"{type(e).__name__}: {e}"[:200]
    out["heuristic_us"] = timed(h)
    for label, pick in (("old", lambda c: c.variant in OLD), ("new", lambda c: c.variant not in OLD)):
        cs = [c for c in space if pick(c)]
        cs = cs if len(cs) <= limit else rng.sample(cs, limit)
        times = {c.encode(): t for c in cs if (t := timed(c)) is not None}
        out[f"{label}_times"] = dict(sorted(times.items(), key=lambda kv: kv[1])[:12])
        if times:
            best = min(times, key=times.__getitem__)
            out[f"best_{label}"], out[f"best_{label}_us"] = best, times[best]
    if out.get("best_new"):  # split phases combine partials in a fixed order: bitwise equal run to run
        c = SC.Schedule.decode(out["best_new"])
        a, b = RT.run(low, c, ins), RT.run(low, c, ins)
        out["best_new_bitwise_repeatable"] = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for k in [k for k in out if k.endswith("_us") and isinstance(out[k], float)]:
        out[k.replace("_us", "_tbs")] = round(nbytes / out[k] / 1e6, 3) if math.isfinite(out[k]) else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--limit", type=int, default=60, help="schedules timed per side (old / new), sampled")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    a = ap.parse_args()
    cases = _cases()
    names = [n for n in a.cases.split(",") if n] or list(cases)
    rows = []
    for n in names:
        fn, make = cases[n]
        row = _row(n, fn, make, a.limit)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
