"""softmax_bwd: the backward of the softmax family (kernels/softmax.py `softmax_bwd`) as a tunable
family: dx = y * (dy - sum(dy * y)) over the last dim, from the forward's saved output y and the
incoming gradient dy, in x's dtype.

A backward family is an ordinary family module (see kernels/rope_bwd.py for the pattern): its
workload is softmax's `backward_workload` (the forward's, renamed), and the forward op's autograd
backward runs the `softmax_bwd` op with the BWD part of the op's "FWD|BWD" config string
(solforge/integrate/__init__.py). The kernels, the Config, `bwd_space` and `bwd_heuristic` live in
kernels/softmax.py (whose source this family's template hash covers): the backward has the
forward's three kernel shapes (row, rows, online), each holding y and dy where the forward holds x.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from solforge.kernels import softmax as _softmax
from solforge.numerics import Tolerance, input_generator, parse_dtype, tolerance
from solforge.records import Workload

FAMILY = "softmax_bwd"

# the forward's Config and validity: the BWD part of the op's string is decoded by softmax.py's op
Config = _softmax.Config
is_valid = _softmax.is_valid


def space(workload: Workload) -> list[Config]:
    """The forward's configs plus, for single-pass tiles, the next warp count up (softmax.bwd_space)."""
    return _softmax.bwd_space(workload)


def heuristic(workload: Workload) -> Config:
    """What the op runs with config "": softmax.bwd_heuristic (it depends on (rows, N) and the
    device, which this workload shares with the one the launcher builds from y and dx)."""
    return _softmax.bwd_heuristic(workload)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def softmax_bwd_ref(dy: torch.Tensor, y: torch.Tensor, *, dx_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor]:
    """(dx,) in dx_dtype (default y's): the gradient autograd computes for torch.softmax, ATen's own
    `_softmax_backward_data` (what softmax's derivative formula calls), from the y given, in fp32
    (fp64 for fp32 inputs). From y, not from x: the kernel reads the saved output (rounded to the
    output dtype), and a reference from x would differ from it by that rounding, which an fp32 dx
    shows."""
    acc = _acc(y.dtype)
    dx = torch.ops.aten._softmax_backward_data(dy.to(acc), y.to(acc), -1, acc)
    return (dx.to(dx_dtype or y.dtype).contiguous(),)


def softmax_bwd(dy: torch.Tensor, y: torch.Tensor, *, dx_dtype: torch.dtype | None = None,
                config: Config | None = None, out: tuple[torch.Tensor] | None = None) -> tuple[torch.Tensor]:
    """The launcher (softmax.softmax_bwd): (dx,), into out[0] when given."""
    return (_softmax.softmax_bwd(dy, y, dx_dtype=dx_dtype, config=config, out=None if out is None else out[0]),)


def output_tolerance(workload: Workload) -> Tolerance:
    """dx's dtype's rtol (its final rounding is relative), with an absolute tolerance of 4e-5
    rather than bf16's 1e-2: dx scales with y (1/N on a flat row), so 1e-2 would pass any attention
    row's gradient. Kernel and reference compute the same fp32 formula from the same rounded y and
    dy; they differ by the order of the sum(dy * y) (a few 1e-6 at N = 4096, |dy| <= 5) times y."""
    t = tolerance(parse_dtype(workload.dtypes[0]))
    return Tolerance(min(t.atol, 4e-5), t.rtol)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `softmax_bwd` / `softmax_bwd_ref`: (dy, y) with y the
    reference softmax of the forward's inputs (softmax.make_inputs: scaled, offset rows, every third
    one masked, so y has exact zeros) in the output dtype, and dy a random contiguous tensor of that
    dtype, as the next matmul's backward (attention: grad_out @ V^T) hands it over; dx_dtype is x's."""
    fwd = dataclasses.replace(workload, family=_softmax.FAMILY)
    (x,), kw = _softmax.make_inputs(fwd, seed=seed, rows=rows, device=device)
    out_dtype = kw["out_dtype"]
    y = _softmax.softmax_ref(x, out_dtype=out_dtype).contiguous()
    g, where = input_generator(y.numel(), y.device, seed + 1)
    dy = torch.randn(y.shape, generator=g, device=where).to(out_dtype).to(y.device)
    return (dy, y), {"dx_dtype": x.dtype}
