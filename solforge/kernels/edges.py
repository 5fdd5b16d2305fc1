"""What a family declares for the verifier (tune/verify.py) beyond its random inputs: edge rows and
a norm-relative error bound. Helpers only; each family states its own cases as data.

Edge rows: random draws (randn) never give a large magnitude, an all-zero row or a fully masked
one, so a kernel that clamps, drops eps or overflows a half-precision sum passes them. A family's
`edge_inputs(wl, *, seed, device)` takes a small draw of its own inputs and rewrites one row of one
input per case (`edge_rows`), each case a trial of its own so a failure names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

# The middle row of a 3-row draw is rewritten: rows above and below stay random, so a case that
# leaks into its neighbours (a NaN spreading through a shared tile) shows too.
EDGE_DRAW_ROWS = 3
_ROW = 1

Edit = Callable[[torch.Tensor], torch.Tensor]


def edge_rows(args: tuple[Any, ...], kwargs: dict[str, Any], cases: Mapping[str, Edit], *,
              arg: int = 0) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """One (label, args, kwargs) per case: a copy of `args` whose input `arg` has its middle row
    replaced by `case(row in fp32)`, cast to its dtype. Rows are the leading dims flattened, in the
    tensor's own layout (a column view stays one)."""
    out = []
    for label, edit in cases.items():
        t = args[arg].clone()
        row = t[(0,) * (t.dim() - 2) + (_ROW,)] if t.dim() > 1 else t
        row.copy_(edit(row.float()).to(t.dtype))
        out.append((label, (*args[:arg], t, *args[arg + 1:]), dict(kwargs)))
    return out


def spike(row: torch.Tensor, height: float = 100.0) -> torch.Tensor:
    """A row of small values (1% of the random ones) with one `height` at its start: normalized,
    the spike reaches ~sqrt(H), past any output clamp at a few units."""
    out = 0.01 * row
    out[0] = height
    return out


FP32_EPS = torch.finfo(torch.float32).eps


def norm_bound(out_dtype: torch.dtype, *, compute_ulps: float, round_ulps: float) -> float:
    """A norm-relative error bound ||out - ref|| / ||ref|| for kernels that compute in fp32 and store
    `out_dtype`: `compute_ulps` fp32 ulps for the fp32 arithmetic (what an fp32 output shows against
    an fp64 reference) plus `round_ulps` ulps of `out_dtype` for rounding flips (an fp32 value on
    the other side of a half-precision rounding edge: one ulp of the output, in a few elements)."""
    return compute_ulps * FP32_EPS + round_ulps * torch.finfo(out_dtype).eps
