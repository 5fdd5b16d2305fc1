"""The generic reference of a generated region: its own ATen ops, run in fp64 on upcast inputs.

No hand-written reference: the region's ops (ir.RegionIR) run as they are, with every floating
input and every floating dtype argument widened to fp64, so the result is what the graph computes
without its intermediate roundings. An explicit cast to a narrower float type still rounds there
(x.to(bf16) then back to fp64), as the generated kernel does, since the graph asked for it. Each
output is cast to its dtype at the end. An index-returning reduction (argmax, max.dim) reads its
operand rounded to the operand's dtype, as the graph holds it (the kernel rounds a computed bf16
operand too): an index is compared exactly, so the ties must be the graph's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from solforge.codegen.ir import Ref, RegionIR, resolve

_ACC = torch.float64
# index-returning reductions: which element is the max depends on the operand's rounding
_ARG_OPS = {"aten.argmax.default", "aten.argmin.default", "aten.max.dim", "aten.min.dim"}


def _wide(dtype: Any) -> Any:
    return _ACC if isinstance(dtype, torch.dtype) and dtype.is_floating_point else dtype


def _round(t: torch.Tensor, dtype: Any) -> torch.Tensor:
    """A cast the graph asks for: to a float type, rounded to it and widened again; else as asked."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return t.to(dtype).to(_ACC)
    return t.to(dtype)


def reference(ir: RegionIR, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if len(inputs) != len(ir.inputs):
        raise ValueError(f"solforge codegen reference: {len(inputs)} inputs for a region of {len(ir.inputs)}")
    wide = reference_wide(ir, [x.to(_ACC) if x.is_floating_point() else x for x in inputs], consume=True)
    return tuple(v.to(ir.out_meta(r).dtype) for v, r in zip(wide, ir.outputs, strict=True))


def _last_uses(ir: RegionIR) -> dict[int, list[tuple[str, int]]]:
    """For each op index, the values ("in" or "op", index) read for the last time there (outputs
    are read at the end, so never listed)."""
    last: dict[tuple[str, int], int] = {}

    def visit(a: Any, i: int) -> None:
        if isinstance(a, Ref):
            last[(a.src, a.i)] = i
        elif isinstance(a, tuple | list):
            for x in a:
                visit(x, i)

    for i, op in enumerate(ir.ops):
        visit(op.args, i)
        visit(tuple(v for _, v in op.kwargs), i)
    kept = {(r.src, r.i) for r in ir.outputs}
    out: dict[int, list[tuple[str, int]]] = {}
    for key, i in last.items():
        if key not in kept:
            out.setdefault(i, []).append(key)
    return out


def reference_wide(ir: RegionIR, ins: Sequence[torch.Tensor], *, consume: bool = False) -> tuple[torch.Tensor, ...]:
    """`reference` on inputs already widened, its outputs left in fp64 (what the backward's
    reference differentiates: codegen/backward.py). Each intermediate is dropped after its last
    use (and, with `consume`, each entry of the list `ins`), so a long chain over a several-GB
    tensor holds a few fp64 copies at a time, not one per op."""
    vals: list[Any] = []
    drops = _last_uses(ir)

    def get(a: Any) -> Any:
        if isinstance(a, Ref):
            if a.src == "in":
                return ins[a.i]
            v = vals[a.i]
            return v[a.item] if a.item is not None else v
        if isinstance(a, tuple):
            return [get(x) for x in a]
        return a

    for op in ir.ops:
        fn = resolve(op.target)
        args = [get(a) for a in op.args]
        kwargs = {k: get(v) for k, v in op.kwargs}
        if op.target == "prims.convert_element_type.default":
            vals.append(_round(args[0], args[1]))
        elif op.target == "aten._to_copy.default" and "dtype" in kwargs:
            dtype = kwargs.pop("dtype")
            kwargs.pop("memory_format", None)
            vals.append(_round(fn(args[0], **kwargs), dtype))
        else:
            if op.target in ("aten._softmax.default", "aten._log_softmax.default"):
                args[2] = False  # half_to_float: the input is fp64 here
            if op.target in _ARG_OPS and isinstance(op.args[0], Ref) and args[0].is_floating_point():
                # the graph compares its operand rounded to its dtype: its ties, not fp64's
                args[0] = _round(args[0], ir.out_meta(op.args[0]).dtype)
            if "dtype" in kwargs:
                kwargs["dtype"] = _wide(kwargs["dtype"])
            vals.append(fn(*args, **kwargs))
        del args, kwargs
        for src, j in drops.get(len(vals) - 1, ()):
            if src == "op":
                vals[j] = None
            elif consume and isinstance(ins, list):
                ins[j] = None
    return tuple(get(r) for r in ir.outputs)


def replay(ir: RegionIR, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The region's ops run as the graph ran them (its own dtypes, no widening): what autograd
    differentiates for the first backward of a generated region (kernels/generated.py)."""
    vals: list[Any] = []

    def get(a: Any) -> Any:
        if isinstance(a, Ref):
            if a.src == "in":
                return inputs[a.i]
            v = vals[a.i]
            return v[a.item] if a.item is not None else v
        if isinstance(a, tuple):
            return [get(x) for x in a]
        return a

    for op in ir.ops:
        vals.append(resolve(op.target)(*[get(a) for a in op.args], **{k: get(v) for k, v in op.kwargs}))
    return tuple(get(r) for r in ir.outputs)
