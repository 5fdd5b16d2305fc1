"""What the layernorm family's forward (kernels/layernorm.py) and backward (kernels/layernorm_bwd.py)
both need besides the tile helpers (kernels/rowtile.py): the family's name, the reference the
backward differentiates, a workload's rows and row length, and its random inputs (the backward
draws the forward's x and weight, then its dy).

Here so that layernorm_bwd.py need not import layernorm.py, which imports layernorm_bwd.py for its
autograd formula: the dependency runs one way, layernorm -> layernorm_bwd -> layernorm_base.
layernorm.py re-exports every name.
"""

from __future__ import annotations

from typing import Any

import torch

from solforge.numerics import input_generator, parse_dtype
from solforge.records import Workload

FAMILY = "layernorm"


def layernorm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The function every kernel must compute, in fp32 (fp64 for fp32/fp64 inputs), cast once."""
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    xf = x.to(acc)
    mean = xf.mean(dim=-1, keepdim=True)
    d = xf - mean
    y = d * torch.rsqrt((d * d).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(out_dtype or x.dtype)


def _dims(workload: Workload) -> tuple[int, int]:
    rows = 1
    for d in workload.shapes[0][:-1]:
        rows *= d
    return rows, workload.shapes[0][-1]


def _live(workload: Workload) -> int:
    """Row tiles held in registers at once: x, and the residual in the fused form."""
    return 2 if workload.param("residual", False) else 1


def draw(workload: Workload, *, seed: int, rows: int | None, device: str | torch.device | None
         ) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
    """Fresh random inputs of either family: (x [, residual]), weight, bias, kwargs.

    Rows get different means and scales (x = a * randn + b per row), so a kernel that skips the
    centering or mixes up rows fails. Small inputs are drawn on the CPU from `seed` (the same
    numbers on any device), large ones on the device (numerics.input_generator)."""
    n_rows, H = _dims(workload)
    n_rows = n_rows if rows is None else rows
    device = device or workload.device
    n_x = _live(workload)
    g, where = input_generator(n_x * n_rows * H, device, seed)
    dtype = parse_dtype(workload.dtypes[0])
    xs = []
    for _ in range(n_x):
        t = torch.randn(n_rows, H, generator=g, device=where) * (0.5 + torch.rand(n_rows, 1, generator=g, device=where))
        xs.append((t + 2 * torch.randn(n_rows, 1, generator=g, device=where)).to(dtype).to(device))
    i = n_x
    params = []
    for name, scale, offset in (("weight", 0.1, 1.0), ("bias", 0.1, 0.0)):
        p = None
        if workload.param(name, False):
            p = (offset + scale * torch.randn(H, generator=g, device=where)).to(parse_dtype(workload.dtypes[i]))
            p = p.to(device)
            i += 1
        params.append(p)
    return xs, params[0], params[1], {"out_dtype": parse_dtype(workload.param("out_dtype", workload.dtypes[0]))}
