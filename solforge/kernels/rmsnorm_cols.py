"""RMSNorm over a dim that is not the innermost one in memory: the `cols` variants of the rmsnorm
family (kernels/rmsnorm.py holds the family's reference, config triad and custom op).

KernelBench's RMSNorm normalizes a (batch, features, dim1, dim2) tensor over `features`, and
channel norms in convolutional nets do the same over dim 1. plan/rmsnorm.py moves that dim last
with a view (`movedim(1, -1)`), so the op sees the usual (..., H) tensor, but its rows are columns
of an (outer, H, inner) array: element h of a row sits `inner` elements after element h - 1, and
neighbouring rows are neighbours in memory. Reading such rows one by one would touch one element
per 32-byte sector, and copying them to the last dim first would cost a read and a write of the
whole tensor more than the norm itself. These kernels instead take a [BLOCK_H, ROWS] tile, where
ROWS consecutive rows make each of the BLOCK_H loads one contiguous span, reduce over axis 0 and
store the tile back in the same layout (y has x's strides), so x is read once and y written once:

  cols      the whole row (BLOCK_H >= H) in registers, one tile per program;
  colsloop  rows too long for that: BLOCK_H-sized chunks, two passes (the second re-reads x, from L2
            where the tile's bytes stayed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solforge.kernels.torch_order import rstd_of


def cols_inner(x: torch.Tensor) -> int:
    """`inner` when x's rows are columns of a dense (outer, H, inner) array (x is the `movedim(d, -1)`
    view of a contiguous tensor, d not last), else 0 (the row kernels' layout or any other)."""
    if x.dim() < 2 or x.stride(-1) in (0, 1) or x.shape[-1] < 2:
        return 0
    for j in range(x.dim() - 1):  # H's place in memory order: where moving it back is contiguous
        if x.movedim(-1, j).is_contiguous():
            return int(x.stride(-1))
    return 0


@triton.jit
def _tile(x_ptr, base, h0, i, inner, H, BLOCK_H: tl.constexpr, EVICT: tl.constexpr):
    """Rows `i` (a [1, ROWS] block of inner positions) of elements [h0, h0 + BLOCK_H) as fp32,
    with their offsets and mask."""
    h = h0 + tl.arange(0, BLOCK_H)[:, None]
    m = (h < H) & (i < inner)
    offs = base + h.to(tl.int64) * inner + i
    return tl.load(x_ptr + offs, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32), offs, m, h


@triton.jit
def _normalize(xf, rstd, w_ptr, h, H, x_ptr, y_ptr, offs, m, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr):
    y = xf * rstd
    if ROUND:  # Hugging Face rounds to the input dtype before the weight multiply
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rmsnorm_cols_kernel(x_ptr, w_ptr, y_ptr, H, inner, n_blocks, eps, ROWS: tl.constexpr,
                         BLOCK_H: tl.constexpr, LOOP: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                         ROUND: tl.constexpr):
    """One [H, ROWS] tile per program: program p takes rows [j * ROWS, (j + 1) * ROWS) of outer
    index o, where (o, j) = divmod(p, n_blocks)."""
    pid = tl.program_id(0)
    o = (pid // n_blocks).to(tl.int64)
    i = ((pid % n_blocks) * ROWS + tl.arange(0, ROWS))[None, :]
    base = o * H * inner
    if not LOOP:
        xf, offs, m, h = _tile(x_ptr, base, 0, i, inner, H, BLOCK_H, "")
        rstd = rstd_of(tl.sum(xf * xf, axis=0), H, eps)[None, :]
        _normalize(xf, rstd, w_ptr, h, H, x_ptr, y_ptr, offs, m, HAS_WEIGHT, ROUND)
    else:
        acc = tl.zeros([ROWS], dtype=tl.float32)
        for h0 in tl.range(0, H, BLOCK_H):
            xf, offs, m, h = _tile(x_ptr, base, h0, i, inner, H, BLOCK_H, "evict_last")
            acc += tl.sum(xf * xf, axis=0)
        rstd = rstd_of(acc, H, eps)[None, :]
        for h0 in tl.range(0, H, BLOCK_H):
            xf, offs, m, h = _tile(x_ptr, base, h0, i, inner, H, BLOCK_H, "evict_first")
            _normalize(xf, rstd, w_ptr, h, H, x_ptr, y_ptr, offs, m, HAS_WEIGHT, ROUND)


def grid(n_rows: int, inner: int, rows: int) -> tuple[int, int]:
    """(programs, tiles per outer index) for `rows` rows per tile."""
    n_blocks = triton.cdiv(inner, rows)
    return (n_rows // inner) * n_blocks, n_blocks
