"""Backward of RMSNorm, shared by the `rmsnorm` and `add_rmsnorm` families.

With n = x * rstd (rstd = rsqrt(mean(x^2) + eps)) and y = n * w:
    dn = dy * w
    dx = rstd * (dn - n * mean(dn * n))      (+ ds, the gradient reaching x from its other users)
    dw = sum over rows of dy * n              (n rounded to x.dtype first with round_before_weight)
rstd is recomputed from x rather than saved: one more read of a row already being read, and no
extra tensor kept alive between forward and backward.

One launch writes dx and a per-program partial of dw (fp32); the partials are summed by torch.
The grid is a few programs per SM, each walking row tiles in a loop, so few partial rows exist.
Measured on the H100 (16384 x 2560 bf16, with the residual gradient): one tile per program cost
200 us against 635 us for 16 unrolled tiles per program (bench/bwd_sweep.py, 2026-11-22).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from solforge.kernels.launch import Meta, sm_count
from solforge.kernels.launch import launch as _launch

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def rmsnorm_bwd_ref(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                    round_before_weight: bool = False, ds: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dw) in fp32/fp64, by autograd through the forward reference."""
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    xf = x.detach().to(acc).requires_grad_(True)
    wf = weight.detach().to(acc).requires_grad_(True) if weight is not None else None
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if round_before_weight:  # rounding is a straight-through step for the gradient
        n = n + (n.detach().to(x.dtype).to(acc) - n.detach())
    y = n * wf if wf is not None else n
    grads = torch.autograd.grad(y, [xf] + ([wf] if wf is not None else []), dy.to(acc))
    dx = grads[0] + (ds.to(acc) if ds is not None else 0)
    return dx, (grads[1] if wf is not None else None)


@triton.jit
def _bwd_tile(tile, dy_ptr, x_ptr, w, ds_ptr, dx_ptr, n_rows, H, s_dy, s_x, s_ds, s_dx, eps, cols, cm,
              ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr, HAS_DS: tl.constexpr):
    """dx for one [ROWS, BLOCK_H] tile; returns the tile's contribution to dw ([1, BLOCK_H], fp32)."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None] & cm
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * s_x + cols, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r64 * s_dy + cols, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)[:, None]
    n = x * rstd
    if HAS_WEIGHT:
        if ROUND:
            dw = tl.sum(dy * n.to(x_ptr.dtype.element_ty).to(tl.float32), axis=0)[None, :]
        else:
            dw = tl.sum(dy * n, axis=0)[None, :]
        dn = dy * w
    else:
        dw = tl.zeros_like(cols).to(tl.float32)
        dn = dy
    dx = rstd * (dn - n * (tl.sum(dn * n, axis=1) / H)[:, None])
    if HAS_DS:
        dx += tl.load(ds_ptr + r64 * s_ds + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(dx_ptr + r64 * s_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
    return dw


@triton.jit
def _rmsnorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, ds_ptr, dx_ptr, dw_ptr, n_rows, H, s_dy, s_x, s_ds, s_dx, eps,
                        n_iter, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                        ROUND: tl.constexpr, HAS_DS: tl.constexpr, INTERP: tl.constexpr):
    """A grid-stride loop over row tiles; dw accumulates in registers, one partial row per program."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)[None, :]
    cm = cols < H
    w = 1.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    dw = tl.zeros([1, BLOCK_H], dtype=tl.float32)
    if INTERP:  # Triton 3.6's interpreter and runtime-bound for loops: see kernels/rmsnorm.py (#9171)
        i = 0
        while i < n_iter:
            dw += _bwd_tile(pid + i * n_progs, dy_ptr, x_ptr, w, ds_ptr, dx_ptr, n_rows, H, s_dy, s_x, s_ds, s_dx,
                            eps, cols, cm, ROWS, HAS_WEIGHT, ROUND, HAS_DS)
            i += 1
    else:
        for i in range(0, n_iter):
            dw += _bwd_tile(pid + i * n_progs, dy_ptr, x_ptr, w, ds_ptr, dx_ptr, n_rows, H, s_dy, s_x, s_ds, s_dx,
                            eps, cols, cm, ROWS, HAS_WEIGHT, ROUND, HAS_DS)
    if HAS_WEIGHT:
        tl.store(dw_ptr + pid * H + cols, dw, mask=cm)


_INTERPRETED = type(_rmsnorm_bwd_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class BwdConfig:
    rows: int = 1  # rows per tile
    progs: int = 4  # programs per SM (the grid-stride loop's grid)
    num_warps: int = 4

    def encode(self) -> str:
        return f"bwd:r={self.rows}:p={self.progs}:w={self.num_warps}"

    @staticmethod
    def decode(text: str) -> BwdConfig:
        return _decode(text)

    def items(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> BwdConfig:
    head, *parts = text.split(":")
    names = {"r": "rows", "p": "progs", "w": "num_warps"}
    try:
        assert head == "bwd"
        return BwdConfig(**{names[k]: int(v) for k, v in (p.split("=") for p in parts)})
    except (AssertionError, KeyError, ValueError) as e:
        raise ValueError(f"bad rmsnorm backward config {text!r} (e.g. 'bwd:r=4:p=4:w=8')") from e


def heuristic(n_rows: int, H: int, device: torch.device) -> BwdConfig:
    """Tiles of ~8K elements, 4 warps. From bench/bwd_sweep.py on the H100 (bf16 with the residual
    gradient, 2026-11-22): 16384 x 2560 best r=2 p=2 w=4 at 156 us (2.15 TB/s; r=1 p=4 w=8: 194),
    4096 x 2560 the same at 55 us, 524288 x 128 best r=32 p=8 w=4 at 227 us (2.36 TB/s)."""
    block = triton.next_power_of_2(H)
    rows = max(1, min(32, 8192 // block))
    warps = 4 if rows * block <= 8192 else 8
    return BwdConfig(rows, 2 if block >= 1024 else 8, warps)


@functools.lru_cache(maxsize=4096)
def _plan(n_rows: int, H: int, device: torch.device, has_weight: bool, rbw: bool, has_ds: bool,
          config: BwdConfig | None) -> tuple[int, int, dict[str, Any]]:
    """Grid, loop trip count and constexprs of one shape and config: cached, so a call pays a
    lookup rather than the heuristic and the Config and kwargs building."""
    c = config or heuristic(n_rows, H, device)
    n_tiles = triton.cdiv(n_rows, c.rows)
    grid = min(n_tiles, c.progs * sm_count(device))
    meta = Meta(ROWS=c.rows, BLOCK_H=triton.next_power_of_2(H), HAS_WEIGHT=has_weight, ROUND=rbw, HAS_DS=has_ds,
                INTERP=_INTERPRETED, num_warps=c.num_warps)
    return grid, triton.cdiv(n_tiles, grid), meta


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                round_before_weight: bool = False, ds: torch.Tensor | None = None,
                config: BwdConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x.dtype, dw in fp32 or None) with the Triton kernel; see `rmsnorm_bwd_ref`."""
    if x.dtype not in _SUPPORTED or dy.shape != x.shape:
        raise ValueError(f"solforge rmsnorm_bwd: x {x.dtype} {tuple(x.shape)}, dy {tuple(dy.shape)}: "
                         "same shapes, bf16/fp16/fp32")
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    dy2 = dy.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    ds2 = None
    if ds is not None:
        ds2 = ds.reshape(-1, H)
        if ds2.stride(-1) != 1:
            ds2 = ds2.contiguous()
    n_rows = x2.shape[0]
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    if n_rows == 0:
        return dx.view(x.shape), (torch.zeros(H, device=x.device) if weight is not None else None)
    has_w = weight is not None
    grid, n_iter, meta = _plan(n_rows, H, x.device, has_w, round_before_weight, ds2 is not None, config)
    dw = torch.empty((grid, H), dtype=torch.float32, device=x.device) if has_w else dx
    w = weight.contiguous() if has_w else dx  # type: ignore[union-attr]
    _launch(_rmsnorm_bwd_kernel, (grid,),
            (dy2, x2, w, ds2 if ds2 is not None else dx, dx, dw, n_rows, H, dy2.stride(0), x2.stride(0),
             ds2.stride(0) if ds2 is not None else 0, dx.stride(0), eps, n_iter), meta)
    return dx.view(x.shape), (dw.sum(0) if weight is not None else None)


# The op the autograd formulas call, so that a traced backward (torch.compile, export) sees one
# call with a fake implementation rather than Python. dw is fp32, empty without a weight.
_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("rmsnorm_bwd(Tensor dy, Tensor x, Tensor? weight, float eps, bool round_before_weight, "
            "Tensor? ds, str config) -> (Tensor, Tensor)")


def _op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, round_before_weight: bool,
        ds: torch.Tensor | None, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = rmsnorm_bwd(dy, x, weight, eps, round_before_weight=round_before_weight, ds=ds,
                         config=BwdConfig.decode(config) if config else None)
    return dx, (dw if dw is not None else x.new_empty(0, dtype=torch.float32))


_LIB.impl("rmsnorm_bwd", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::rmsnorm_bwd")
def _fake(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, round_before_weight: bool,
          ds: torch.Tensor | None, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1] if weight is not None else 0
    return x.new_empty(x.shape), x.new_empty(n, dtype=torch.float32)


rmsnorm_bwd_op = torch.ops.solforge.rmsnorm_bwd.default
