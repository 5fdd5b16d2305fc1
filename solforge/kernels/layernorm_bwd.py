"""Backward of LayerNorm, shared by the `layernorm` and `add_layernorm` families.

With n = (x - mean) * rstd and y = n * w + b:
    dn = dy * w
    dx = rstd * (dn - mean(dn) - n * mean(dn * n))     (+ ds, the gradient reaching x elsewhere)
    dw = sum over rows of dy * n;  db = sum over rows of dy
mean and rstd are recomputed from x (one more pass over a row already in registers; nothing kept
alive between forward and backward). Like rmsnorm_bwd.py: a few programs per SM walk row tiles in a
grid-stride loop, each keeps fp32 partial dw/db rows in registers, and one launch of
reduce.sum_rows adds up the (2, grid, H) partials of both. After the mean, the three sums a row
needs (of d^2, dn * d and dn) are taken in one reduction (reduce.sum3).

A row that is not a power of two is held as a power-of-two main block plus a tail (2560 = 2048 +
512), as in the forward: with one 4096-lane block, 37% of the lanes of x, dy, and of the w, dw and
db rows were masked, which at rmsnorm_bwd's measured best tile ([2, 4096] on 4 warps) puts 64 + 64
values of x and dy and 3 x 32 of w, dw, db in every thread, past the 255-register limit.

This module is also the tunable family `layernorm_bwd` (the pattern of kernels/rope_bwd.py): one
family for the backward of both `layernorm` and `add_layernorm`, as it is one kernel and one op; the
workload says which (`ds`: add_layernorm's residual gradient) and which parameter gradients are
summed (`weight`, `bias_grad`). The forward ops' autograd backward runs the `layernorm_bwd` op with
the BWD part of their "FWD|BWD" config string (integrate/__init__.py).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from solforge.kernels import direct
from solforge.kernels import layernorm_base as _ln
from solforge.kernels.launch import Meta, pdl, sm_count
from solforge.kernels.launch import launch as _launch
from solforge.kernels.layernorm_base import layernorm_ref
from solforge.kernels.reduce import fold, sum3, sum_rows
from solforge.kernels.rmsnorm_bwd import _vec, layout_tail, sum_tolerance
from solforge.kernels.rowtile import _ld, _load_weight, _st, _tile_load
from solforge.numerics import Tolerance, input_generator, parse_dtype, tolerance
from solforge.records import Workload

FAMILY = "layernorm_bwd"

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def layernorm_bwd_ref(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                      ds: torch.Tensor | None = None, bias_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """(dx[, dw][, db]) by autograd through the forward reference in fp32 (fp64 for fp32 inputs),
    as the launcher returns them: dx in x's dtype; dw with a weight, db with `bias_grad`, in fp32
    (db = the column sums of dy: it does not depend on the bias's value)."""
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    bias = x.new_zeros(x.shape[-1]) if bias_grad else None
    leaves = [t.detach().to(acc).requires_grad_(True) for t in (x, weight, bias) if t is not None]
    with torch.enable_grad():
        y = layernorm_ref(leaves[0], leaves[1] if weight is not None else None, leaves[-1] if bias_grad else None,
                          eps)
        grads = torch.autograd.grad(y, leaves, dy.to(acc))
    dx = (grads[0] + (ds.to(acc) if ds is not None else 0)).to(x.dtype)
    return (dx, *(g.to(torch.float32) for g in grads[1:]))


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _bwd_piece(dy, x, mean, rstd, w, c1, c2, ds_ptrs, dx_ptrs, m, cols, H, COL_MASK: tl.constexpr,
               HAS_WEIGHT: tl.constexpr, HAS_DS: tl.constexpr):
    """dx of one block of a tile, stored; returns the block's (dw, db) contributions [1, width]."""
    d = x - mean
    if COL_MASK:
        d = tl.where(cols < H, d, 0.0)
    n = d * rstd
    dn = dy * w if HAS_WEIGHT else dy
    dx = rstd * (dn - c2 - n * c1)
    if HAS_DS:  # loaded last, so that its registers are not live during the reductions (loading it
        # with the tile, as rmsnorm_bwd does, measured 157.3 us against 145.5 at 16384 x 2560 on the H100)
        dx += _ld(ds_ptrs, m, cols, H, COL_MASK, "").to(tl.float32)
    _st(dx_ptrs, dx, m, cols, H, COL_MASK)
    return tl.sum(dy * n, axis=0)[None, :], tl.sum(dy, axis=0)[None, :]


@triton.jit
def _bwd_load(dy_ptr, x_ptr, tile, n_rows, H, s_dy, s_x, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr, EVICT: tl.constexpr):
    """x and dy of one tile in their own dtypes, main block and tail (0.0 without a tail)."""
    x, xt = _tile_load(x_ptr, tile * ROWS, n_rows, H, s_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    dy, dyt = _tile_load(dy_ptr, tile * ROWS, n_rows, H, s_dy, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    return x, xt, dy, dyt


@triton.jit
def _bwd_tile(tile, x, xt, dy, dyt, ds_ptr, dx_ptr, w, wt, n_rows, H, s_ds, s_dx, eps,
              ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, HAS_DS: tl.constexpr):
    """dx for one tile of ROWS rows from its loaded x and dy; returns its contributions to dw and db
    for the main block and the tail (0.0 without a tail). Rows past the end load zeros: n = 0 and
    dy = 0 there, so they add nothing and store nothing."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_H)[None, :]
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    if BLOCK_T > 0:
        tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
        xt = xt.to(tl.float32)
        dyt = dyt.to(tl.float32)
        tot = tl.sum(fold(x, xt, ROWS, BLOCK_H, BLOCK_T), axis=1)
    else:
        tot = tl.sum(x, axis=1)
    mean = (tot / H)[:, None]
    d = x - mean
    if BLOCK_T == 0 and not EVEN_H:  # masked lanes hold -mean now; they must not count
        d = tl.where(cols < H, d, 0.0)
    # the three sums that need the mean, in one reduction: sum(d^2) for rstd, and for
    # c1 = mean(dn * n), c2 = mean(dn) over the whole row (both blocks), with n = d * rstd
    dn = dy * w if HAS_WEIGHT else dy
    if BLOCK_T > 0:
        dt = xt - mean
        if not EVEN_H:
            dt = tl.where(tcols < H, dt, 0.0)
        dnt = dyt * wt if HAS_WEIGHT else dyt
        ss, c1, c2 = sum3(fold(d * d, dt * dt, ROWS, BLOCK_H, BLOCK_T),
                          fold(dn * d, dnt * dt, ROWS, BLOCK_H, BLOCK_T), fold(dn, dnt, ROWS, BLOCK_H, BLOCK_T), 1)
    else:
        ss, c1, c2 = sum3(d * d, dn * d, dn, 1)
    rstd1 = tl.rsqrt(ss / H + eps)
    rstd = rstd1[:, None]
    c1 = (c1 * rstd1 / H)[:, None]
    c2 = (c2 / H)[:, None]
    pw, pb = _bwd_piece(dy, x, mean, rstd, w, c1, c2, ds_ptr + r64 * s_ds + cols, dx_ptr + r64 * s_dx + cols, m,
                        cols, H, BLOCK_T == 0 and not EVEN_H, HAS_WEIGHT, HAS_DS)
    pwt = 0.0
    pbt = 0.0
    if BLOCK_T > 0:
        pwt, pbt = _bwd_piece(dyt, xt, mean, rstd, wt, c1, c2, ds_ptr + r64 * s_ds + tcols,
                              dx_ptr + r64 * s_dx + tcols, m, tcols, H, not EVEN_H, HAS_WEIGHT, HAS_DS)
    return pw, pb, pwt, pbt


@triton.jit
def _bwd_step(i, pid, n_progs, cur, acc, dy_ptr, x_ptr, ds_ptr, dx_ptr, w, wt, n_rows, H, s_dy, s_x, s_ds, s_dx,
              eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr, HAS_DS: tl.constexpr,
              STAGES: tl.constexpr, EVICT: tl.constexpr):
    """Tile i of this program. STAGES == 2: `cur` holds this tile's x and dy, already loaded, and
    the next tile's loads are issued before this one's reductions (two tiles in flight)."""
    tile = pid + i * n_progs
    x, xt, dy, dyt = cur
    if STAGES > 1:
        cur = _bwd_load(dy_ptr, x_ptr, tile + n_progs, n_rows, H, s_dy, s_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    else:
        x, xt, dy, dyt = _bwd_load(dy_ptr, x_ptr, tile, n_rows, H, s_dy, s_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    pw, pb, pwt, pbt = _bwd_tile(tile, x, xt, dy, dyt, ds_ptr, dx_ptr, w, wt, n_rows, H, s_ds, s_dx, eps, ROWS,
                                 BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT, HAS_DS)
    dw, db, dwt, dbt = acc
    if WANT_DW:
        dw += pw
    if WANT_DB:
        db += pb
    if BLOCK_T > 0:
        if WANT_DW:
            dwt += pwt
        if WANT_DB:
            dbt += pbt
    return cur, (dw, db, dwt, dbt)


# n_iter and db_off vary with the row count; Triton would specialize them (== 1, multiple of 16) and
# recompile for sequence lengths that change only those.
@triton.jit(do_not_specialize=["n_iter", "db_off"])
def _layernorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, ds_ptr, dx_ptr, part_ptr, n_rows, H, s_dy, s_x, s_ds, s_dx, eps,
                          n_iter, db_off, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                          TW: tl.constexpr, EVEN_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, WANT_DW: tl.constexpr,
                          WANT_DB: tl.constexpr, HAS_DS: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr,
                          PDL: tl.constexpr):
    """A grid-stride loop over row tiles; dw and db accumulate in registers, one partial row each per
    program, stored at part_ptr + pid * H (dw) and part_ptr + db_off + pid * H (db).
    TW: the tail accumulators' width (BLOCK_T, or 1 as a placeholder without a tail). PDL: the
    partial rows' sum (reduce.sum_rows, launched with programmatic dependent launch) may start
    once every program is past its loop; it waits for this kernel's writes itself."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    w, wt = _load_weight(w_ptr, H, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT)
    acc = (tl.zeros([1, BLOCK_H], dtype=tl.float32), tl.zeros([1, BLOCK_H], dtype=tl.float32),
           tl.zeros([1, TW], dtype=tl.float32), tl.zeros([1, TW], dtype=tl.float32))
    cur = (0.0, 0.0, 0.0, 0.0)
    if STAGES > 1:
        cur = _bwd_load(dy_ptr, x_ptr, pid, n_rows, H, s_dy, s_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    for i in range(0, n_iter):
        cur, acc = _bwd_step(i, pid, n_progs, cur, acc, dy_ptr, x_ptr, ds_ptr, dx_ptr, w, wt, n_rows, H, s_dy,
                             s_x, s_ds, s_dx, eps, ROWS, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT, WANT_DW, WANT_DB,
                             HAS_DS, STAGES, EVICT)
    if PDL:
        gdc_launch_dependents()
    dw, db, dwt, dbt = acc
    on = tl.full([1, 1], 1, tl.int1)
    cols = tl.arange(0, BLOCK_H)[None, :]
    row = part_ptr + pid * H
    if WANT_DW:
        _st(row + cols, dw, on, cols, H, BLOCK_T == 0 and not EVEN_H)
    if WANT_DB:
        _st(row + db_off + cols, db, on, cols, H, BLOCK_T == 0 and not EVEN_H)
    if BLOCK_T > 0:
        tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
        if WANT_DW:
            _st(row + tcols, dwt, on, tcols, H, not EVEN_H)
        if WANT_DB:
            _st(row + db_off + tcols, dbt, on, tcols, H, not EVEN_H)


_INTERPRETED = type(_layernorm_bwd_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Config: rows per tile, programs per SM, warps, and the block split


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def blocks(H: int) -> list[tuple[int, int]]:
    """(main, tail) block pairs for a row of H: the two-piece split first where it wastes fewer
    lanes than one power of two (2560 -> 2048 + 512, 768 -> 512 + 256), then the power of two."""
    full = triton.next_power_of_2(H)
    out = [(full, 0)]
    main = full if full == H else full // 2
    if main < H:
        tail = triton.next_power_of_2(H - main)
        if main + tail < full:
            out.insert(0, (main, tail))
    return out


def blocks_ok(block_h: int, block_t: int, H: int) -> bool:
    """Whether the blocks cover a row of H: one power of two with the fewest masked lanes, or a
    main block inside the row plus a power-of-two tail (no wider than the main) that reaches its end."""
    if not _pow2(block_h):
        return False
    if block_t == 0:
        return block_h == triton.next_power_of_2(H)
    return _pow2(block_t) and block_t <= block_h < H <= block_h + block_t


_BWD_WARPS = (1, 2, 4, 8, 16, 32)
# fp32 values of one row tile (x or dy) a thread holds: rmsnorm_bwd's best H100 config held 64.
_BWD_MAX_PER_THREAD = 64
_BWD_ABBREV = {"r": "rows", "p": "progs", "w": "num_warps", "bh": "block_h", "bt": "block_t", "s": "stages",
               "e": "evict"}


@dataclass(frozen=True)
class BwdConfig:
    """rows per tile, programs per SM, warps (rmsnorm_bwd's fields, same order), and the block split:
    block_h = 0 means one power-of-two block covering the row (the only choice before the split).
    `stages` 2: the next tile's x and dy are loaded before this tile is reduced (as rmsnorm_bwd's,
    which gained 17% at 16384 x 2560 on the H100); `evict`: x and dy loaded evict_first."""

    rows: int = 1
    progs: int = 4
    num_warps: int = 4
    block_h: int = 0
    block_t: int = 0
    stages: int = 1
    evict: int = 0

    variant: ClassVar[str] = "bwd"  # one kernel: the tuner's variant name, not a field

    def encode(self) -> str:
        """e.g. "bwd:r=2:p=2:w=4:bh=2048:bt=512:s=2" (bh/bt, s and e only when set)."""
        s = f"bwd:r={self.rows}:p={self.progs}:w={self.num_warps}"
        if self.block_h:
            s += f":bh={self.block_h}:bt={self.block_t}"
        if self.stages != 1:
            s += f":s={self.stages}"
        if self.evict:
            s += f":e={self.evict}"
        return s

    @staticmethod
    def decode(text: str) -> BwdConfig:
        return _decode(text)

    def items(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    def split(self, H: int) -> tuple[int, int]:
        return (self.block_h, self.block_t) if self.block_h else (triton.next_power_of_2(H), 0)


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> BwdConfig:
    head, *parts = text.split(":")
    try:
        assert head == "bwd"
        return BwdConfig(**{_BWD_ABBREV[k]: int(v) for k, v in (p.split("=") for p in parts)})
    except (AssertionError, KeyError, ValueError) as e:
        raise ValueError(f"bad layernorm backward config {text!r} (e.g. 'bwd:r=2:p=2:w=4:bh=2048:bt=512')") from e


def bwd_is_valid(c: BwdConfig, n_rows: int, H: int) -> bool:
    """Covers the row, powers of two, and within the register budget."""
    bh, bt = c.split(H)
    if not (_pow2(c.rows) and c.progs >= 1 and c.num_warps in _BWD_WARPS and blocks_ok(bh, bt, H)
            and c.stages in (1, 2) and c.evict in (0, 1)):
        return False
    return c.rows * (bh + bt) // (32 * c.num_warps) <= _BWD_MAX_PER_THREAD


def bwd_space(n_rows: int, H: int, vec: int = 8) -> list[BwdConfig]:
    """Block split x warps x rows per tile (up to 16K elements; 4 to 64 values of x a thread) x
    programs per SM (1, 2, 3, 4, 8) x (one stage; two; two with evict_first loads): ~180 configs
    at H = 2560. A split's tail is widened to one pass of the main block's layout (`vec` values of
    the dtype x 32 lanes x warps, as rmsnorm_bwd.BwdConfig.blocks does, for the same reason); where
    that reaches the main block's width there is no split for those warps."""
    out = []
    for bh, bt in blocks(H):
        for w in (2, 4, 8, 16):
            tail = layout_tail(bh, bt, w, vec) if bt else 0
            if bt and not tail:
                continue
            width = bh + tail
            r = 1
            while r * width <= 16384 and r <= max(32 if width < 1024 else 8, 1) and r <= triton.next_power_of_2(n_rows):
                per = r * width // (32 * w)
                if 4 <= per <= _BWD_MAX_PER_THREAD:
                    out += [BwdConfig(r, p, w, bh if bt else 0, tail, st, e) for p in (1, 2, 3, 4, 8)
                            for st, e in ((1, 0), (2, 0), (2, 1))]
                r *= 2
    return [c for c in out if bwd_is_valid(c, n_rows, H)]


def bwd_heuristic(n_rows: int, H: int, device: torch.device | str, ds: bool = False) -> BwdConfig:
    """Measured on the H100 (bf16, H = 2560, 16384 rows):
    - Without the residual gradient (`ds`), rows of up to 3072 that split: two rows a tile, the
      tail widened to one pass of 4 warps' layout (2560 = 2048 + 1024), 2 programs per SM, the next
      tile loaded ahead: 100.3 us against 109.1 for the rule below (2026-11-23,
      tools/bwd_tail_probe.py, bench/results/2026-11-23-h100-session9.md).
    - Otherwise, rows of 1024+: one power-of-two block, one row a tile, 2 programs per SM, 8 warps
      (4 with ds), the next tile loaded ahead, evict_first. Without ds that was the best of
      tools/ln_sweep.py (-ln-bwd-sweep-s6.json: 113.8 / 39.7 us at 16384 / 4096 rows). With ds, 8
      warps was the best at 16384 rows once the row sums were taken in one reduction, in three runs
      of tools/pair_ab.py (-pair-ab-s7.json: 146.9 us); the 2026-11-23 sweep of the whole space
      (-ln-bwd-sweep-s9.json) put 4 warps first at both 16384 and 4096 rows (142.08 / 45.28 us
      against 144.77 / 45.34), and the split configs behind (the fourth tensor's registers).
    Shorter rows keep rmsnorm_bwd's earlier tiling (tiles of ~8K elements, 8 programs per SM), with
    the next tile loaded ahead and no split: not swept."""
    pow2 = triton.next_power_of_2(H)
    bh, bt = blocks(H)[0]
    tail = layout_tail(bh, bt, 4) if bt else 0  # one pass of 4 warps' layout (bwd_space)
    if pow2 >= 1024 and not ds and tail and bh + tail <= 3072:
        c = BwdConfig(2, 2, 4, bh, tail, 2, 0)
    elif pow2 >= 1024:  # with ds half the warps (4 at 2560): 142.08 / 45.28 us against 144.77 / 45.34 on 8
        c = BwdConfig(1, 2, max(1, min(16, pow2 // (1024 if ds else 512))), pow2, 0, 2, 1)
    else:
        rows = max(1, min(32, 8192 // pow2))
        w = 4 if rows * (bh + bt) <= 8192 else 8
        if bt and not layout_tail(bh, bt, w):  # no tail as wide as a pass of the main block's layout (bwd_space)
            bh, bt = 0, 0
        c = BwdConfig(rows, 8, w, bh, bt, 2, 0)
    while not bwd_is_valid(c, n_rows, H) and c.num_warps < 32:
        c = dataclasses.replace(c, num_warps=c.num_warps * 2)
    return c


# ----------------------------------------------------------------------------------------------
# Launcher


def _rows_view(t: torch.Tensor, H: int) -> torch.Tensor:
    """(rows, H) with a unit column stride; reshape copies only when one row stride cannot do."""
    t2 = t if t.dim() == 2 else t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 or H == 1 else t2.contiguous()


@functools.lru_cache(maxsize=4096)
def _plan(n_rows: int, H: int, device: torch.device, has_ds: bool, want_dw: bool, bias_grad: bool,
          config: Any) -> tuple[int, int, dict[str, Any]]:
    """(grid, loop trip count, constexprs) of one shape and config, checked: cached, so a call pays
    a lookup rather than the heuristic, the validity check and the kwargs building."""
    c = config or bwd_heuristic(n_rows, H, device, ds=has_ds)
    if not isinstance(c, BwdConfig):  # rmsnorm_bwd's BwdConfig (rows, progs, num_warps, ..., stages, evict)
        c = BwdConfig(c.rows, c.progs, c.num_warps, stages=c.stages, evict=c.evict)
    if not bwd_is_valid(c, n_rows, H):
        raise ValueError(f"solforge layernorm: backward config {c.encode()} is not valid for {n_rows} x {H}")
    bh, bt = c.split(H)
    n_tiles = triton.cdiv(n_rows, c.rows)
    grid = min(n_tiles, c.progs * sm_count(device))
    return grid, triton.cdiv(n_tiles, grid), Meta(
        ROWS=c.rows, BLOCK_H=bh, BLOCK_T=bt, TW=max(bt, 1), EVEN_H=H == bh + bt, HAS_WEIGHT=want_dw,
        WANT_DW=want_dw, WANT_DB=bias_grad, HAS_DS=has_ds, STAGES=c.stages, EVICT="evict_first" if c.evict else "",
        PDL=pdl(device), num_warps=c.num_warps)


def layernorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                  ds: torch.Tensor | None = None, bias_grad: bool = False, config: Any = None,
                  out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """(dx in x.dtype[, dw in fp32 with a weight][, db in fp32 with bias_grad]); see
    `layernorm_bwd_ref`. `config`: a BwdConfig (rmsnorm_bwd's also works: one block), default
    `bwd_heuristic`. `out`: tensors like those (dx contiguous), written in place."""
    if x.dtype not in _SUPPORTED or dy.shape != x.shape:
        raise ValueError(f"solforge layernorm: backward: x {x.dtype} {tuple(x.shape)}, dy {tuple(dy.shape)}: "
                         "same shapes, bf16/fp16/fp32")
    H = x.shape[-1]
    x2, dy2 = _rows_view(x, H), _rows_view(dy, H)
    ds2 = _rows_view(ds, H) if ds is not None else None
    n_rows = x2.shape[0]
    want_dw = weight is not None
    n_parts = int(want_dw) + int(bias_grad)
    if out is None:
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    else:
        if len(out) != 1 + n_parts or out[0].shape != x.shape or out[0].dtype != x.dtype \
                or not out[0].is_contiguous() or any(o.shape != (H,) or o.dtype != torch.float32 for o in out[1:]):
            raise ValueError("solforge layernorm: backward: out must be (dx[, dw][, db]): dx contiguous like x, "
                             "dw (with a weight) and db (with bias_grad) fp32 of shape (H,)")
        dx = out[0].view(n_rows, H)
    if n_rows == 0:
        zeros = [o.zero_() for o in out[1:]] if out is not None else \
            [torch.zeros(H, device=x.device) for _ in range(n_parts)]
        return (dx.view(x.shape), *zeros)
    grid, n_iter, meta = _plan(n_rows, H, x.device, ds2 is not None, want_dw, bias_grad, config)
    # dw's and db's partial rows in one buffer, so one sum reduces both
    part = torch.empty((n_parts, grid, H), dtype=torch.float32, device=x.device) if n_parts else dx
    w = weight.contiguous() if weight is not None else dx
    _launch(_layernorm_bwd_kernel, (grid,),
            (dy2, x2, w, ds2 if ds2 is not None else dx, dx, part, n_rows, H, dy2.stride(0), x2.stride(0),
             ds2.stride(0) if ds2 is not None else 0, dx.stride(0), eps, n_iter, grid * H if want_dw else 0), meta)
    if not n_parts:
        return (dx.view(x.shape),)
    outs = out[1:] if out is not None else [torch.empty(H, dtype=torch.float32, device=x.device)
                                            for _ in range(n_parts)]
    return (dx.view(x.shape), *sum_rows(part.view(n_parts * grid, H), [i * grid for i in range(n_parts + 1)], outs))


# ----------------------------------------------------------------------------------------------
# Custom op: the autograd formulas of layernorm and add_layernorm call it, so that a traced backward
# (torch.compile, export) sees one call with a fake implementation; dw/db are fp32, empty when absent.

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("layernorm_bwd(Tensor dy, Tensor x, Tensor? weight, float eps, Tensor? ds, bool bias_grad, str config) "
            "-> (Tensor, Tensor, Tensor)")


def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, ds: torch.Tensor | None,
            bias_grad: bool, config: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, *grads = layernorm_bwd(dy, x, weight, eps, ds=ds, bias_grad=bias_grad,
                               config=BwdConfig.decode(config) if config else None)
    dw = grads.pop(0) if weight is not None else x.new_empty(0, dtype=torch.float32)
    return dx, dw, (grads[0] if bias_grad else x.new_empty(0, dtype=torch.float32))


_LIB.impl("layernorm_bwd", _bwd_op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::layernorm_bwd")
def _bwd_fake(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, ds: torch.Tensor | None,
              bias_grad: bool, config: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    return (x.new_empty(x.shape), x.new_empty(H if weight is not None else 0, dtype=torch.float32),
            x.new_empty(H if bias_grad else 0, dtype=torch.float32))


layernorm_bwd_op = torch.ops.solforge.layernorm_bwd.default
layernorm_bwd_call = direct.plain(layernorm_bwd_op, _bwd_op)  # what the backward formulas call


# ----------------------------------------------------------------------------------------------
# The tunable family layernorm_bwd: config triad, workload and inputs (tune/__init__.py, tune/verify.py)

Config = BwdConfig


def _dims(workload: Workload) -> tuple[int, int]:
    return workload.shapes[0][0], workload.shapes[0][-1]


def is_valid(config: BwdConfig, workload: Workload) -> bool:
    """`bwd_is_valid`: covers the row, powers of two, within the register budget."""
    return bwd_is_valid(config, *_dims(workload))


def heuristic(workload: Workload) -> BwdConfig:
    """What the op runs with config "": `bwd_heuristic`, which depends on the residual gradient."""
    n_rows, H = _dims(workload)
    return bwd_heuristic(n_rows, H, workload.device, ds=bool(workload.param("ds", False)))


def space(workload: Workload) -> list[BwdConfig]:
    """The heuristic, then `bwd_space` (block split x rows x warps x programs per SM x stages/evict)."""
    return [c for c in dict.fromkeys([heuristic(workload), *bwd_space(*_dims(workload), _vec(workload))])
            if is_valid(c, workload)]


def workload_from(forward: Workload) -> Workload | None:
    """The backward's workload of a `layernorm` or `add_layernorm` call: x's shape and dtype, the
    weight's (if any), out_dtype (dy's), eps, and what the kernel's constexprs and heuristic depend
    on: `ds` (add_layernorm: the residual stream's gradient joins dx), `weight` (dw summed) and
    `bias_grad` (db summed: training's bias is a parameter). None where no config fits (rows past
    the register budget): nothing to tune, the op runs `bwd_heuristic` there."""
    residual = bool(forward.param("residual", False))
    has_w = bool(forward.param("weight", False))
    first = 2 if residual else 1  # (x[, residual][, weight][, bias]) -> (x[, weight])
    shapes = forward.shapes[:1] + forward.shapes[first:first + has_w]
    dtypes = forward.dtypes[:1] + forward.dtypes[first:first + has_w] + forward.dtypes[-1:]
    params = tuple(sorted({"bias_grad": bool(forward.param("bias", False)), "ds": residual,
                           "eps": forward.param("eps", 1e-5), "out_dtype": forward.param("out_dtype", dtypes[-1]),
                           "weight": has_w}.items()))
    wl = Workload(FAMILY, shapes, dtypes, params, forward.device)
    return wl if is_valid(heuristic(wl), wl) else None


def output_tolerance(workload: Workload) -> tuple[Tolerance, ...]:
    """dx: x's dtype's entry. dw and db: fp32 sums over every row of the same inputs the reference
    reads (no rounding in between): rmsnorm_bwd's `sum_tolerance`."""
    n_parts = int(bool(workload.param("weight", False))) + int(bool(workload.param("bias_grad", False)))
    return (tolerance(parse_dtype(workload.dtypes[0])), *[sum_tolerance(workload.shapes[0][0])] * n_parts)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `layernorm_bwd` / `layernorm_bwd_ref`: layernorm's x and
    weight (its `draw`: rows with different means and scales; `rows` replaces the row count), a
    random dy of out_dtype and, with `ds`, a random ds of x's dtype, both contiguous (the next op's
    backward hands over fresh tensors)."""
    has_w = bool(workload.param("weight", False))
    fwd = Workload(_ln.FAMILY, workload.shapes, workload.dtypes,
                   (("bias", False), ("eps", workload.param("eps", 1e-5)),
                    ("out_dtype", workload.param("out_dtype", workload.dtypes[-1])), ("weight", has_w)),
                   workload.device)
    (x,), weight, _bias, kw = _ln.draw(fwd, seed=seed, rows=rows, device=device)
    g, where = input_generator(2 * x.numel(), x.device, seed + 1)
    dy = torch.randn(x.shape, generator=g, device=where).to(kw["out_dtype"]).to(x.device)
    ds = torch.randn(x.shape, generator=g, device=where).to(x.dtype).to(x.device) \
        if workload.param("ds", False) else None
    return (dy, x, weight, float(workload.param("eps", 1e-5))), \
        {"ds": ds, "bias_grad": bool(workload.param("bias_grad", False))}
