"""Verify a candidate against its family's reference: nothing unproven enters a model.

A candidate passes only if, on fresh random inputs: `trials` (>= 3) runs at the workload's shape
agree with `<family>_ref` within the dtype's tolerance (numerics.TOLERANCES); an odd shape (a row
count that is no multiple of any block) agrees too; every output element was written (outputs are
poisoned with NaN first); no NaN/Inf appears where the reference has none; inputs are unchanged.
A family whose reference returns a tuple gets a tuple of poisoned outputs, each compared.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from solforge.kernels import registry
from solforge.numerics import compare
from solforge.records import Verdict, Workload

Launch = Callable[..., Any]


def odd_rows(rows: int) -> int:
    """A row count near `rows` that is odd and not a multiple of any power-of-two block: 2^k+1
    style counts straddle block edges. Kept small so the interpreter stays quick."""
    return max(3, min(rows, 4099) // 2 * 2 + 1) if rows > 2 else 3


def _items(x: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _snapshot(args: tuple[Any, ...]) -> list[torch.Tensor | None]:
    return [a.clone() if isinstance(a, torch.Tensor) else None for a in args]


def verify(family: ModuleType, workload: Workload, launch: Launch, *, trials: int = 3, seed: int = 1234,
           device: str | None = None) -> Verdict:
    """`launch(*args, out=out, **kwargs)` runs the candidate; the family's `make_inputs` draws inputs
    and its reference (`<name>_ref`) computes the expected outputs. The odd shape changes the row
    count that the family's `verify_rows(workload)` gives (default: the first input's first dim);
    the hooks and their defaults: kernels/registry.py."""
    ref_fn = registry.reference(family)
    # a family may widen the output dtype's tolerance where its semantics need it (documented there),
    # one for all outputs or a tuple with one per output
    tol = registry.output_tolerance(family, workload)
    rows = registry.verify_rows(family, workload)
    shapes: list[int | None] = [None] * max(3, trials) + [odd_rows(rows)]
    max_abs = max_rel = 0.0
    for i, r in enumerate(shapes):
        label = f"trial {i + 1}" if r is None else f"odd shape ({r} rows)"
        try:
            args, kwargs = registry.make_inputs(family, workload, seed=seed + 7919 * i, rows=r, device=device)
            before = _snapshot(args)
            ref = ref_fn(*args, **kwargs)
            # poison: unwritten elements fail the NaN check
            out = tuple(torch.full_like(t, float("nan")) for t in ref) if isinstance(ref, tuple) \
                else torch.full_like(ref, float("nan"))
            launch(*args, out=out, **kwargs)
            if any(o.is_cuda for o in _items(out)):
                torch.cuda.synchronize()
        except Exception as e:
            return Verdict(False, trials=i, reason=f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        for a, b in zip(args, before, strict=True):
            if b is not None and not torch.equal(a, b):
                return Verdict(False, trials=i, reason=f"{label}: an input was modified")
        outs, refs = _items(out), _items(ref)
        for j, (o, expected) in enumerate(zip(outs, refs, strict=True)):
            c = compare(o, expected, tol[j] if isinstance(tol, tuple) else tol)
            max_abs, max_rel = max(max_abs, c.max_abs_err), max(max_rel, c.max_rel_err)
            if not c.ok:
                what = f"{label}, output {j}" if len(outs) > 1 else label
                return Verdict(False, trials=i, max_abs_err=max_abs, max_rel_err=max_rel,
                               reason=f"{what}: {c.reason}")
    return Verdict(True, trials=len(shapes), max_abs_err=max_abs, max_rel_err=max_rel)
