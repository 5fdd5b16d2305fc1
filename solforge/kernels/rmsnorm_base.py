"""What the rmsnorm family's forward (kernels/rmsnorm.py) and backward (kernels/rmsnorm_bwd.py)
both need besides the tile helpers (kernels/rowtile.py): the family's name, a workload's rows and
row length, and its random inputs (the backward draws the forward's x and weight, then its dy).

Here so that rmsnorm_bwd.py need not import rmsnorm.py, which imports rmsnorm_bwd.py for its
autograd formula: the dependency runs one way, rmsnorm -> rmsnorm_bwd -> rmsnorm_base. rmsnorm.py
re-exports every name.
"""

from __future__ import annotations

from typing import Any

import torch

from solforge.numerics import input_generator, parse_dtype
from solforge.records import Workload

FAMILY = "rmsnorm"


def _dims(workload: Workload) -> tuple[int, int]:
    shape = workload.shapes[0]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


def _inner(workload: Workload) -> int:
    """The `inner` of a workload whose rows are columns (rmsnorm_cols.py), else 0."""
    return int(workload.param("inner", 0))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `rmsnorm` / `rmsnorm_ref` on this workload.

    Small inputs are drawn on the CPU from `seed` (the same numbers on any device), large ones on
    the device (numerics.input_generator).
    """
    n_rows, H = _dims(workload)
    n_rows = n_rows if rows is None else rows
    device = device or workload.device
    g, where = input_generator(n_rows * H, device, seed)
    inner = _inner(workload)
    if inner:  # columns of an (outer, H, inner) array; another row count: one outer index of that many
        inner = inner if rows is None else n_rows
        x = torch.randn(n_rows // inner, H, inner, generator=g, device=where).movedim(1, -1)
        x = x.to(parse_dtype(workload.dtypes[0])).to(device)
    else:
        x = torch.randn(n_rows, H, generator=g, device=where).to(parse_dtype(workload.dtypes[0])).to(device)
    weight = None
    if len(workload.shapes) > 1:
        w = 1.0 + 0.1 * torch.randn(H, generator=g, device=where)
        weight = w.to(parse_dtype(workload.dtypes[1])).to(device)
    kwargs = {
        "out_dtype": parse_dtype(workload.param("out_dtype", workload.dtypes[0])),
        "round_before_weight": bool(workload.param("round_before_weight", False)),
    }
    return (x, weight, float(workload.param("eps", 1e-6))), kwargs
