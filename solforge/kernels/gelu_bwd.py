"""gelu_bwd: the backward of the gelu family (kernels/gelu.py `gelu_bwd`) as a tunable family:
dx of y = gelu(x + bias) and, when the bias needs it, db (one fp32 partial row per program,
summed by torch).

A backward family is an ordinary family module (see kernels/rope_bwd.py for the pattern): its
workload is gelu's `backward_workload` (gelu's plus the `bias_grad` flag), and the forward op's
autograd backward runs the `gelu_bwd` op with the BWD part of the op's "FWD|BWD" config string
(solforge/integrate/__init__.py). The kernel, its config, space and `bwd_heuristic` live in
kernels/gelu.py (whose source this family's template hash covers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from solforge.kernels import gelu as _gelu
from solforge.numerics import Tolerance, input_generator, parse_dtype, tolerance
from solforge.records import Workload

FAMILY = "gelu_bwd"

# the forward's Config, space and validity; the op's "" runs `bwd_heuristic`
Config = _gelu.Config
space = _gelu.space
is_valid = _gelu.is_valid


def heuristic(workload: Workload) -> Config:
    """What the op runs with config "": gelu.bwd_heuristic of the workload as the kernel sees it
    (a bias counts when its gradient is summed)."""
    return _gelu.bwd_heuristic(_forward(workload))


def _forward(workload: Workload) -> Workload:
    """gelu's workload with a bias exactly when db is computed (what gelu.py's `_plan` builds)."""
    shapes = workload.shapes if workload.param("bias_grad", False) else workload.shapes[:1]
    return Workload(_gelu.FAMILY, shapes, workload.dtypes[:len(shapes)],
                    (("approximate", workload.param("approximate", "none")),), workload.device)


def gelu_bwd_ref(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none", *,
                 bias_grad: bool = True) -> tuple[torch.Tensor, ...]:
    """(dx,) or, with a bias whose gradient is wanted, (dx, db): autograd through `gelu_ref`'s math
    in fp32 (fp64 for fp32 inputs)."""
    dx, db = _gelu.gelu_bwd_ref(dy, x, bias, approximate)
    return (dx, db) if db is not None and bias_grad else (dx,)


def gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none", *,
             bias_grad: bool = True, config: Config | None = None,
             out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The launcher (gelu.gelu_bwd): the gradients as `gelu_bwd_ref` returns them, into `out`."""
    dx, db = _gelu.gelu_bwd(dy, x, bias, approximate, bias_grad=bias_grad, config=config, out=out)
    return (dx,) if db is None else (dx, db)


def output_tolerance(workload: Workload) -> tuple[Tolerance, ...]:
    """dx: its dtype's entry. db sums a column of dx over every row; the rows' errors (within the
    dtype's tolerance) have random signs, so the sum's absolute error grows like sqrt(rows)."""
    dx = tolerance(parse_dtype(workload.dtypes[0]))
    if not (workload.param("bias_grad", False) and len(workload.shapes) > 1):
        return (dx,)
    rows = workload.shapes[0][0]
    t = tolerance(parse_dtype(workload.dtypes[1]))
    return (dx, Tolerance(t.atol * math.sqrt(max(rows, 1)), t.rtol))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `gelu_bwd` / `gelu_bwd_ref`: a random contiguous dy of x's
    dtype (the next linear's backward hands over a fresh tensor), then gelu's (x, bias)."""
    fwd = dataclasses.replace(workload, family=_gelu.FAMILY,
                              params=(("approximate", workload.param("approximate", "none")),))
    (x, bias), kwargs = _gelu.make_inputs(fwd, seed=seed, rows=rows, device=device)
    g, where = input_generator(x.numel(), x.device, seed + 1)
    dy = torch.randn(x.shape, generator=g, device=where).to(x.dtype).to(x.device)
    return (dy, x, bias), {**kwargs, "bias_grad": bool(workload.param("bias_grad", False))}
