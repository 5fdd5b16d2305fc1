"""Row-tile helpers of the norm kernels: masked loads and stores of [ROWS, BLOCK_H] tiles (a row that is
not a power of two as a power-of-two main block plus a tail), the weight row, and the RMS
normalization of a loaded tile.

rmsnorm, add_rmsnorm, layernorm and both norm backwards call these; they live in a module of their
own so that the forward and backward kernel files need not import each other (rmsnorm_bwd used to
import them from rmsnorm.py, which imports rmsnorm_bwd for its autograd formula). The bodies and the
globals they read are rmsnorm.py's, unchanged: the compiled kernels are the same.
"""

from __future__ import annotations

import triton
import triton.language as tl

from solforge.kernels.interp import cast_rne
from solforge.kernels.rounding import as_stored
from solforge.kernels.torch_order import row_sumsq, rstd_of


@triton.jit
def _ld(ptrs, m, cols, H, COL_MASK: tl.constexpr, EVICT: tl.constexpr):
    """Load under row mask `m`, adding a column mask only where a block pokes past H: a row-only
    mask is constant along the row, so the compiler keeps 16-byte vector accesses."""
    if COL_MASK:
        m = m & (cols < H)
    return tl.load(ptrs, mask=m, other=0.0, eviction_policy=EVICT)


@triton.jit
def _st(ptrs, v, m, cols, H, COL_MASK: tl.constexpr):
    if COL_MASK:
        m = m & (cols < H)
    tl.store(ptrs, cast_rne(v, ptrs.dtype.element_ty), mask=m)


@triton.jit
def _load_weight(w_ptr, H, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr,
                 HAS_WEIGHT: tl.constexpr):
    """Weight as fp32 [1, BLOCK_H] and [1, BLOCK_T] rows (0.0 placeholders without weight)."""
    w = 0.0
    wt = 0.0
    if HAS_WEIGHT:
        on = tl.full([1, 1], 1, tl.int1)
        cols = tl.arange(0, BLOCK_H)[None, :]
        w = _ld(w_ptr + cols, on, cols, H, BLOCK_T == 0 and not EVEN_H, "evict_last").to(tl.float32)
        if BLOCK_T > 0:
            tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
            wt = _ld(w_ptr + tcols, on, tcols, H, not EVEN_H, "evict_last").to(tl.float32)
    return w, wt


@triton.jit
def _tile_load(x_ptr, row0, n_rows, H, stride_x, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr, EVICT: tl.constexpr):
    """Rows [row0, row0 + ROWS) of x in its own dtype: main block [0, BLOCK_H) and tail block.
    EVICT is a tuning knob: evict_first cost 1-2% at 16384 x 2560 and 32768 x 4096 on an H100 but
    gained 3% at 4096 x 2560."""
    rows = row0 + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None]
    # int64 row offsets: rows * stride overflows int32 past 2^31 elements (e.g. 1M x 4096).
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    cols = tl.arange(0, BLOCK_H)[None, :]
    x = _ld(ptrs + cols, m, cols, H, BLOCK_T == 0 and not EVEN_H, EVICT)
    xt = 0.0
    if BLOCK_T > 0:
        tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
        xt = _ld(ptrs + tcols, m, tcols, H, not EVEN_H, EVICT)
    return x, xt


@triton.jit
def _tile_store(x, xt, w, wt, y_ptr, row0, n_rows, H, stride_y, eps, ROWS: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr,
                HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr, x_ptr, r_ptr, stride_x, stride_r,
                W: tl.constexpr, K: tl.constexpr, ADD: tl.constexpr):
    """Normalize a tile from `_tile_load` in fp32 and store it in y's dtype. With W > 0 the sum of
    squares is taken in torch's order (kernels/torch_order.py), from the rows at x_ptr (with ADD:
    of x + r rounded to the tile's dtype, add_rmsnorm's sum), else with tl.sum over the tile."""
    rows = row0 + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None]
    ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y
    cols = tl.arange(0, BLOCK_H)[None, :]
    xf = x.to(tl.float32)
    if BLOCK_T > 0:
        xtf = xt.to(tl.float32)
    if W > 0:
        ss = row_sumsq(x_ptr, r_ptr, row0, n_rows, H, stride_x, stride_r, ROWS, W, K, ADD, x.dtype)
    else:
        ss = tl.sum(xf * xf, axis=1)
        if BLOCK_T > 0:
            ss += tl.sum(xtf * xtf, axis=1)
    rstd = rstd_of(ss, H, eps)[:, None]
    y = xf * rstd
    if ROUND:  # Hugging Face rounds to the input dtype before the weight multiply
        y = as_stored(y, x.dtype)
    if HAS_WEIGHT:
        y = y * w
    _st(ptrs + cols, y, m, cols, H, BLOCK_T == 0 and not EVEN_H)
    if BLOCK_T > 0:
        tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
        yt = xtf * rstd
        if ROUND:
            yt = as_stored(yt, x.dtype)
        if HAS_WEIGHT:
            yt = yt * wt
        _st(ptrs + tcols, yt, m, tcols, H, not EVEN_H)
