"""generated_bwd: the backward of a generated region as a tunable family (codegen/backward.py).

The forward family's `backward_workload` (kernels/generated.py) derives the region's vjp for the
tuner's masks (every floating input needs a gradient, every floating output receives one:
backward.full_masks); when it forms one region or several, the backward is this family's workload:

  Workload      family "generated_bwd", the shapes and dtypes of the backward's inputs from outside
                (the saved forward inputs and the output gradients it reads: BackwardPlan.inputs),
                params (("key", the main kernel's key), ("fwd", forward key)); its outputs are the
                input gradients the kernels compute (pass-through gradients are not; a multi-kernel
                backward's intermediates stay inside the launcher)
  Config        codegen.schedule.Schedule of the main kernel (space / is_valid / heuristic on its
                region); a multi-kernel backward's other kernels run their heuristic schedule (one
                schedule per config keeps the family contract and the database's configs as they are)
  make_inputs   the backward's inputs, each laid out with its strides; saved forward inputs drawn
                positive where the forward's are (generated.positive_inputs)
  generated_bwd_ref   eager autograd of the FORWARD region's ops in fp64 (backward.fp64_vjp), not
                the traced vjp: a wrong trace, decomposition, expand rewrite or split shows up here
  generated_bwd the launcher: every kernel of the backward in order, the main one under `config`

The forward op's autograd backward runs the `solforge::generated` op once per kernel, the main one
with the BWD part of its "FWD|BWD" config (integrate/__init__.py); with a BWD config it always runs
the tuner's masks (the verified backward), zeros standing for an output gradient autograd did not
give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from solforge.codegen import backward as BW
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen import store
from solforge.codegen.lower import Lowered
from solforge.kernels import generated as G
from solforge.numerics import input_generator
from solforge.records import Workload

FAMILY = "generated_bwd"
Config = SC.Schedule
SHAPE_FIXED = True  # a region's sizes are part of its key


def region(workload: Workload) -> Lowered:
    key = workload.param("key")
    if not key:
        raise ValueError(f"solforge generated_bwd: workload {workload.key} names no region key")
    return store.lowered(key)


def plan_of(fwd: str) -> BW.BackwardPlan:
    """The backward plan the tuner's workload comes from (the forward region's full masks)."""
    return BW.plan(fwd, *BW.full_masks(store.load(fwd)))


def space(workload: Workload) -> list[SC.Schedule]:
    return SC.space(region(workload))


def is_valid(config: SC.Schedule, workload: Workload) -> bool:
    return SC.is_valid(config, region(workload))


def heuristic(workload: Workload) -> SC.Schedule:
    return SC.heuristic(region(workload))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random inputs of the backward (`rows` is ignored: its sizes are in its keys)."""
    fwd = workload.param("fwd")
    p = plan_of(fwd)
    pos, spans = G.positive_inputs(store.load(fwd)), G.index_inputs(store.load(fwd))
    device = torch.device(device or workload.device)
    g, where = input_generator(sum(m.numel for m in p.input_metas), device, seed)
    xs = tuple(G._draw(m.shape, m.stride, m.dtype, src[0] == "saved" and src[1] in pos, g, where, device,
                       spans.get(src[1]) if src[0] == "saved" else None)
               for m, src in zip(p.input_metas, p.inputs, strict=True))
    return xs, {"key": workload.param("key"), "fwd": fwd}


def generated_bwd_ref(*inputs: torch.Tensor, key: str, fwd: str) -> tuple[torch.Tensor, ...]:
    """The launcher's outputs (the input gradients the kernels compute) by fp64 autograd of the forward region.
    A forward input the backward does not read is ones (the gradients do not depend on it); an
    output gradient it does not read is zeros."""
    p = plan_of(fwd)
    if p.key != key:
        raise ValueError(f"solforge generated_bwd: {key[:16]}... is not the backward of {fwd[:16]}...")
    ir = store.load(fwd)
    dev = inputs[0].device if inputs else torch.device(ir.device)
    saved: list[torch.Tensor] = [torch.ones(m.shape, dtype=m.dtype, device=dev) for m in ir.inputs]
    wanted = [k for k, w in enumerate(p.need_out) if w]
    grads: dict[int, torch.Tensor] = {}
    for x, (src, i) in zip(inputs, p.inputs, strict=True):
        if src == "saved":
            saved[i] = x
        else:
            grads[i] = x
    gs = [grads.get(k) if k in grads else torch.zeros(ir.out_meta(ir.outputs[k]).shape,
                                                      dtype=ir.out_meta(ir.outputs[k]).dtype, device=dev)
          for k in wanted]
    ref = BW.fp64_vjp(ir, p.need_in, p.need_out, saved, gs)
    metas = BW.value_metas(p)
    at = {s[1]: i for i, s in enumerate(p.grads) if s is not None and s[0] == "out"}
    return tuple(ref[at[v]].to(metas[v].dtype) for v in p.results)  # type: ignore[union-attr]


def generated_bwd(*inputs: torch.Tensor, key: str, fwd: str, config: SC.Schedule | None = None,
                  out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Every kernel of the backward in order, the main one under `config` (None: the heuristic), the
    others under their heuristic; the input gradients they compute (`out`: written there)."""
    p = plan_of(fwd)
    if p.key != key:
        raise ValueError(f"solforge generated_bwd: {key[:16]}... is not the backward of {fwd[:16]}...")
    if len(p.kernels) == 1:  # its outputs are the gradients: written straight into `out`
        return RT.run(store.lowered(key), config, inputs, out)
    vals = BW.run_kernels(p, inputs, lambda k, kk, xs: RT.run(store.lowered(kk), config if k == p.main else None, xs))
    got = tuple(vals[v] for v in p.results)
    if out is None:
        return got
    for o, g in zip(out, got, strict=True):
        o.copy_(g)
    return tuple(out)
