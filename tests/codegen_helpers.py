"""Shared helpers of the codegen tests: trace a function to an ATen graph (make_fx, as capture
does), form its regions, and check each region's generated kernels against the fp64 reference
(and the reference against the graph's own values)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.numerics import compare, tolerance

# SOLFORGE_CODEGEN_FULL=1 (meant for a GPU run) checks every schedule of the space; by default the
# heuristic and two random valid ones (the interpreter pays per program)
FULL = os.environ.get("SOLFORGE_CODEGEN_FULL", "") not in ("", "0")
SAMPLES = 2


def trace(fn: Callable[..., Any], *xs: torch.Tensor) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*xs)


def values(gm: fx.GraphModule, *xs: torch.Tensor) -> dict[fx.Node, Any]:
    """Every node's real value when the graph runs on xs."""
    env: dict[fx.Node, Any] = {}

    class Rec(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            env[n] = super().run_node(n)
            return env[n]

    Rec(gm).run(*xs)
    return env


def schedules(region: Any, seed: int = 0, samples: int = SAMPLES) -> list[SC.Schedule]:
    space = SC.space(region)
    h = SC.heuristic(region)
    assert SC.is_valid(h, region), h
    assert all(SC.is_valid(c, region) for c in space)
    if FULL:
        return [h] + [c for c in space if c != h]
    rest = [c for c in space if c != h]
    return [h] + random.Random(seed).sample(rest, min(samples, len(rest)))


def _tol(dtype: torch.dtype) -> Any:
    t = tolerance(dtype) if dtype.is_floating_point else None
    return t


def check_region(fr: RG.Formed, env: dict[fx.Node, Any], seed: int = 0, samples: int = SAMPLES) -> int:
    """Generated kernels of one region vs its reference (the heuristic and `samples` sampled
    schedules), and the reference vs the graph's values. Returns how many schedules were checked."""
    ins = [env[a] for a in fr.inputs]
    ref = REF.reference(fr.lowered.ir, ins)
    # the graph rounds every op's result to its dtype: it matches the reference to the narrowest one's tolerance
    narrow = max((m.dtype for op in fr.lowered.ir.ops for m in op.out if m.dtype.is_floating_point),
                 key=lambda d: tolerance(d).rtol, default=torch.float32)
    for o, r in zip(fr.outputs, ref, strict=True):
        eager = env[o]
        c = compare(eager, r, _scaled(narrow)) if eager.dtype.is_floating_point else None
        assert c is None or c.ok, f"reference vs graph, {o.name}: {c.reason}"
        if not eager.dtype.is_floating_point:
            assert torch.equal(eager, r), o.name
    scheds = schedules(fr.lowered, seed, samples)
    for s in scheds:
        got = RT.run(fr.lowered, s, ins)
        for k, (g, r) in enumerate(zip(got, ref, strict=True)):
            if r.dtype.is_floating_point:
                c = compare(g, r)
                assert c.ok, f"schedule {s.encode()}, output {k}: {c.reason}"
            else:
                assert torch.equal(g, r), f"schedule {s.encode()}, output {k}"
    return len(scheds)


def _scaled(dtype: torch.dtype) -> Any:
    """The graph ran in its own dtype (bf16 rounding at every op): compare it to the reference
    with twice the dtype's tolerance."""
    from solforge.numerics import Tolerance
    t = tolerance(dtype)
    return Tolerance(atol=4 * t.atol, rtol=4 * t.rtol)


def form_and_check(fn: Callable[..., Any], *xs: torch.Tensor, seed: int = 0) -> list[RG.Formed]:
    gm = trace(fn, *xs)
    regions = RG.form_regions(gm.graph)
    # the fake trace's nodes line up with a real run of the same graph module
    env = values(gm, *xs)
    for fr in regions:
        check_region(fr, env, seed)
    return regions


def ops(fr: RG.Formed) -> list[str]:
    from solforge.capture import op_name
    return [op_name(n.target).split(".")[1] for n in fr.nodes]
