"""RMSNorm family: y = x * rsqrt(mean(x^2 over the last dim) + eps) [* weight].

In order: reference, Triton kernels, launcher, config triad (+ workload_for), custom op; the tile
helpers are in kernels/rowtile.py, make_inputs in kernels/rmsnorm_base.py (both re-exported).
Every kernel loads the native dtype, computes in fp32 and casts on store (the interpreter cannot do
bf16 arithmetic, and it is what a memory-bound kernel should do anyway).

Variants (all read x once and write y once; RMSNorm is purely memory bound):
  row      one row per program, the whole row in registers.
  rows     a [ROWS, BLOCK_H] tile per program: amortizes the weight load and the per-program
           fixed cost (launch, reduction, rstd) over several short rows.
  persist  grid of (SM count x programs per SM) looping over row tiles: for very many short rows
           (1M x 128 q/k norm) where one program per tile would mean ~10^5 tiny programs.
  loop     one row per program in chunks, two passes (the second re-reads x from L2): for rows too
           long to keep in registers without spilling.
  cols, colsloop  (kernels/rmsnorm_cols.py) rows that are columns of an (outer, H, inner) array: a
           norm over a middle dim (KernelBench's over `features`) moved last with a view. Their
           workloads carry `inner`, and only these two variants are valid for them.
The tile variants can split a row that is not a power of two into a power-of-two main block plus a
power-of-two tail (2560 = 2048 + 512) so no lanes are wasted on masked columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from solforge.kernels import config_text, direct
from solforge.kernels import edges as _edges
from solforge.kernels import rmsnorm_cols as _cols
from solforge.kernels.launch import Meta, sm_count
from solforge.kernels.launch import bind as _bind
from solforge.kernels.launch import empty_strided as _empty_strided
from solforge.kernels.launch import launch as _launch
from solforge.kernels.rmsnorm_base import FAMILY, _dims, _inner, make_inputs  # noqa: F401  (re-exported)
from solforge.kernels.rounding import as_stored
from solforge.kernels.rowtile import _ld, _load_weight, _st, _tile_load, _tile_store  # noqa: F401  (re-exported)
from solforge.kernels.torch_order import rstd_of, sum_meta
from solforge.numerics import Tolerance, dtype_name, parse_dtype, tolerance
from solforge.records import Workload
from solforge.runtime.shapes import hint

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Reference


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                out_dtype: torch.dtype | None = None, round_before_weight: bool = False) -> torch.Tensor:
    """The function every kernel must compute, in fp32 (fp64 for fp32/fp64 inputs).

    `round_before_weight` rounds the normalized value to x.dtype before the weight multiply, as
    Hugging Face's Llama/Qwen3 RMSNorm does (`weight * hidden.to(input_dtype)`).
    """
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if round_before_weight:
        y = y.to(x.dtype).to(acc)
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(out_dtype or x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _rmsnorm_tile_kernel(x_ptr, w_ptr, y_ptr, n_rows, H, stride_x, stride_y, eps,
                         ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                         EVEN_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr,
                         EVICT: tl.constexpr, W: tl.constexpr = 0, K: tl.constexpr = 0):
    """Variants `row` (ROWS == 1) and `rows`: one tile per program."""
    row0 = tl.program_id(0) * ROWS
    # x first: its HBM latency is the long pole; the weight (L2-resident) arrives meanwhile.
    x, xt = _tile_load(x_ptr, row0, n_rows, H, stride_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    w, wt = _load_weight(w_ptr, H, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT)
    _tile_store(x, xt, w, wt, y_ptr, row0, n_rows, H, stride_y, eps, ROWS, BLOCK_H, BLOCK_T, EVEN_H,
                HAS_WEIGHT, ROUND, x_ptr, x_ptr, stride_x, stride_x, W, K, False)


@triton.jit
def _persist_step(x, xt, w, wt, i, pid, n_progs, x_ptr, y_ptr, n_rows, H, stride_x, stride_y, eps,
                  ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr,
                  HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr,
                  W: tl.constexpr, K: tl.constexpr):
    """Tile i of this program. STAGES == 2: (x, xt) holds this tile, already loaded; the next
    tile's load is issued before this one's reduction, so a program keeps two tiles in flight."""
    row0 = (pid + i * n_progs) * ROWS
    if STAGES > 1:
        cur, cur_t = x, xt
        x, xt = _tile_load(x_ptr, row0 + n_progs * ROWS, n_rows, H, stride_x, ROWS, BLOCK_H, BLOCK_T,
                           EVEN_H, EVICT)
    else:
        cur, cur_t = _tile_load(x_ptr, row0, n_rows, H, stride_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    _tile_store(cur, cur_t, w, wt, y_ptr, row0, n_rows, H, stride_y, eps, ROWS, BLOCK_H, BLOCK_T, EVEN_H,
                HAS_WEIGHT, ROUND, x_ptr, x_ptr, stride_x, stride_x, W, K, False)
    return x, xt


@triton.jit
def _rmsnorm_persistent_kernel(x_ptr, w_ptr, y_ptr, n_rows, H, stride_x, stride_y, eps, n_iter, n_progs,
                               ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                               EVEN_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr,
                               STAGES: tl.constexpr, EVICT: tl.constexpr,
                               W: tl.constexpr = 0, K: tl.constexpr = 0):
    """Variant `persist`: a grid-stride loop over row tiles; the weight is loaded once per program.

    Every program runs the same trip count (cdiv(tiles, programs)); a tile past the end is all
    masked rows, which touch no memory.
    """
    pid = tl.program_id(0)
    w, wt = _load_weight(w_ptr, H, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT)
    x = 0.0
    xt = 0.0
    if STAGES > 1:
        x, xt = _tile_load(x_ptr, pid * ROWS, n_rows, H, stride_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    for i in range(0, n_iter):
        x, xt = _persist_step(x, xt, w, wt, i, pid, n_progs, x_ptr, y_ptr, n_rows, H, stride_x,
                              stride_y, eps, ROWS, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT, ROUND, STAGES,
                              EVICT, W, K)


@triton.jit
def _norm_chunk(x_row, w_ptr, y_row, off, H, rstd, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr,
                HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr):
    cols = off + tl.arange(0, BLOCK_H)
    on = tl.full([1], 1, tl.int1)
    y = _ld(x_row + cols, on, cols, H, not EVEN_H, "evict_first").to(tl.float32) * rstd
    if ROUND:
        y = as_stored(y, x_row.dtype.element_ty)
    if HAS_WEIGHT:
        y = y * _ld(w_ptr + cols, on, cols, H, not EVEN_H, "evict_last").to(tl.float32)
    _st(y_row + cols, y, on, cols, H, not EVEN_H)


@triton.jit
def _sq_chunk(x_row, off, H, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr):
    cols = off + tl.arange(0, BLOCK_H)
    # evict_last: the second pass reads these bytes again, from L2 rather than HBM.
    x = _ld(x_row + cols, tl.full([1], 1, tl.int1), cols, H, not EVEN_H, "evict_last").to(tl.float32)
    return x * x


@triton.jit
def _rmsnorm_loop_kernel(x_ptr, w_ptr, y_ptr, n_rows, H, stride_x, stride_y, eps,
                         BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                         ROUND: tl.constexpr):
    """Variant `loop`: one long row per program in BLOCK_H chunks, two passes over x."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for off in tl.range(0, H, BLOCK_H):
        acc += _sq_chunk(x_row, off, H, BLOCK_H, EVEN_H)
    rstd = rstd_of(tl.sum(acc, axis=0), H, eps)
    for off in tl.range(0, H, BLOCK_H):
        _norm_chunk(x_row, w_ptr, y_row, off, H, rstd, BLOCK_H, EVEN_H, HAS_WEIGHT, ROUND)


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import;
# only then can CPU tensors be launched.
_INTERPRETED = type(_rmsnorm_tile_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Launcher


# A plan is everything about a launch that depends only on (shape, dtypes, config): the kernel,
# its grid, the runtime args after eps, and its constexpr/launch kwargs. Cached so a decode step
# pays for a dict lookup, not for Workload/heuristic/Config work.
_Plan = tuple[Any, int, tuple[int, ...], dict[str, Any]]
_PLANS: dict[tuple[Any, ...], _Plan] = {}


def _make_plan(n_rows: int, H: int, config: Config, device: torch.device, has_weight: bool,
               rnd: bool) -> _Plan:
    c = config
    even = (H == c.block_h + c.block_t) if c.variant != "loop" else (H % c.block_h == 0)
    kw: dict[str, Any] = dict(BLOCK_H=c.block_h, EVEN_H=even, HAS_WEIGHT=has_weight, ROUND=rnd,
                              num_warps=c.num_warps)
    if c.variant == "loop":
        return _rmsnorm_loop_kernel, n_rows, (), Meta(kw)
    kw.update(ROWS=c.rows, BLOCK_T=c.block_t, EVICT="evict_first" if c.evict else "", **sum_meta(n_rows, H))
    n_tiles = triton.cdiv(n_rows, c.rows)
    if c.variant == "persist":
        grid = min(n_tiles, sm_count(device) * c.progs)
        kw.update(STAGES=c.stages)
        return _rmsnorm_persistent_kernel, grid, (triton.cdiv(n_tiles, grid), grid), Meta(kw)
    return _rmsnorm_tile_kernel, n_tiles, (), Meta(kw)


def _bad(msg: str) -> ValueError:
    return ValueError(f"solforge rmsnorm: {msg}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, out_dtype: torch.dtype | None = None,
            round_before_weight: bool = False, config: Config | None = None,
            out: torch.Tensor | None = None, _record: list[Any] | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of `x` with the Triton kernels (see `rmsnorm_ref` for the math).

    `config` picks the kernel (default: `heuristic` for this workload); `out` is written in place
    when given (shape of x, dtype out_dtype, rows addressable with one stride, last dim contiguous).
    `_record` (internal, `_Site`) gets the row kernels' launch: (kernel, grid, args, constexprs).
    """
    dtype = x.dtype
    if out_dtype is None:
        out_dtype = dtype
    if dtype not in _SUPPORTED or out_dtype not in _SUPPORTED:
        raise _bad(f"x has dtype {dtype} and out_dtype is {out_dtype}; both must be bf16, fp16 or fp32 "
                   "(use rmsnorm_ref for others)")
    shape = x.shape
    nd = len(shape)
    if nd == 0:
        raise _bad("x must have at least one dimension (the normalized one)")
    H = shape[-1]
    device = x.device
    wdtype = None
    if weight is not None:
        wdtype = weight.dtype
        if wdtype not in _SUPPORTED:
            raise _bad(f"weight has dtype {wdtype}; supported: bf16, fp16, fp32")
        if weight.shape != (H,):
            raise _bad(f"weight must be 1-D of size {H} (x.shape[-1]); got shape {tuple(weight.shape)}")
        if weight.device != device:
            raise _bad(f"weight is on {weight.device} but x is on {device}; move them to one device")
        if weight.stride(0) != 1:
            weight = weight.contiguous()
    if device.type != "cuda" and not _INTERPRETED:
        raise _bad(f"x is on {device}; the Triton kernels need a CUDA tensor "
                   "(or TRITON_INTERPRET=1 set before triton is imported, for CPU tests)")
    if out is not None and (out.shape != shape or out.dtype != out_dtype or out.device != device):
        raise _bad(f"out must have shape {tuple(shape)}, dtype {out_dtype} and device {device}; got "
                   f"{tuple(out.shape)}, {out.dtype}, {out.device}")
    if x.numel() == 0:
        return torch.empty(shape, dtype=out_dtype, device=device) if out is None else out
    if x.stride(-1) != 1 and nd > 1:
        inner = _cols.cols_inner(x)
        if inner:
            return _rmsnorm_cols(x, weight, eps, out_dtype, round_before_weight, config, out, inner)

    # Reshape only copies when the rows cannot be addressed through one row stride; a 2-D slice of
    # a wider tensor stays a view.
    x2 = x if nd == 2 else x.reshape(-1, H)
    sx, s1 = x2.stride()
    if s1 != 1 and H > 1:
        x2 = x2.contiguous()
        sx = H
    n_rows = x2.shape[0]
    if out is None:
        y2 = torch.empty_like(x2, dtype=out_dtype, memory_format=torch.contiguous_format)
        out = y2 if nd == 2 else y2.view(shape)
        sy = H
    else:
        try:
            y2 = out if nd == 2 else out.view(n_rows, H)
        except RuntimeError as e:
            raise _bad("out must be viewable as (rows, H); pass a contiguous tensor") from e
        sy, s1 = y2.stride()
        if s1 != 1 and H > 1:
            raise _bad("out's last dim must be contiguous")
    w = x2 if weight is None else weight  # never read without HAS_WEIGHT; any pointer will do

    pkey = (n_rows, H, sx, sy, dtype, wdtype, out_dtype, round_before_weight, config, device)
    plan = _PLANS.get(pkey)
    if plan is None:
        wl = workload_for(x2, weight, eps, out_dtype, round_before_weight)
        cfg = heuristic(wl) if config is None else config
        if not is_valid(cfg, wl):  # a bad config could silently skip columns: refuse it
            raise _bad(f"config {cfg.encode()} is not valid for {wl.key}")
        if len(_PLANS) > 4096:  # many distinct row counts (varying sequence lengths): start over
            _PLANS.clear()
        plan = _PLANS[pkey] = _make_plan(n_rows, H, cfg, device, weight is not None, round_before_weight)
    kernel, grid, extra, kw = plan
    args = (x2, w, y2, n_rows, H, sx, sy, eps, *extra)
    _launch(kernel, (grid,), args, kw)
    if _record is not None:
        _record.append((kernel, (grid,), args, kw))
    return out


def _rmsnorm_cols(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
                  rnd: bool, config: Config | None, out: torch.Tensor | None, inner: int) -> torch.Tensor:
    """`rmsnorm` of rows that are columns of an (outer, H, inner) array (rmsnorm_cols.py): y gets x's
    strides, so it is that array's layout too; an `out` of other strides is written with a copy."""
    H = x.shape[-1]
    n_rows = x.numel() // H
    y = out if out is not None and out.stride() == x.stride() else torch.empty_like(x, dtype=out_dtype)
    pkey = ("cols", n_rows, H, inner, x.dtype, None if weight is None else weight.dtype, out_dtype, rnd, config,
            x.device)
    plan = _PLANS.get(pkey)
    if plan is None:
        wl = workload_for(x, weight, eps, out_dtype, rnd)
        cfg = heuristic(wl) if config is None else config
        if not is_valid(cfg, wl):
            raise _bad(f"config {cfg.encode()} is not valid for {wl.key}")
        programs, n_blocks = _cols.grid(n_rows, inner, cfg.rows)
        meta = Meta(ROWS=cfg.rows, BLOCK_H=cfg.block_h, LOOP=cfg.variant == "colsloop", HAS_WEIGHT=weight is not None,
                    ROUND=rnd, num_warps=cfg.num_warps)
        if len(_PLANS) > 4096:
            _PLANS.clear()
        plan = _PLANS[pkey] = (_cols._rmsnorm_cols_kernel, programs, (n_blocks,), meta)
    kernel, programs, extra, kw = plan
    _launch(kernel, (programs,), (x, x if weight is None else weight, y, H, inner, *extra, eps), kw)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


# ----------------------------------------------------------------------------------------------
# Config triad

VARIANTS = ("row", "rows", "persist", "loop", "cols", "colsloop")
_COLS = ("cols", "colsloop")
_WARPS = (1, 2, 4, 8, 16, 32)
# Register budget: fp32 values of x a thread holds at once. 64 is where Liger stops (64K block, 32
# warps); past it the compiler spills and the kernel falls off the bandwidth roof.
_MAX_PER_THREAD = 64
_ABBREV = {"block_h": "bh", "block_t": "bt", "rows": "r", "num_warps": "w", "progs": "p", "stages": "s",
           "evict": "e"}


@dataclass(frozen=True)
class Config(config_text.Text):
    """One kernel choice. block_t > 0 splits a row into a power-of-two main block and tail."""

    variant: str = "row"
    block_h: int = 1024  # main block (loop: chunk) width, a power of two
    block_t: int = 0  # tail block width, a power of two, or 0
    rows: int = 1  # rows per tile
    num_warps: int = 4
    progs: int = 0  # persist: programs per SM
    stages: int = 1  # persist: tiles in flight per program (2: the next tile's load is issued early)
    evict: int = 0  # 1: load x with evict_first (tile variants)

    _family, _variants, _abbrev = FAMILY, VARIANTS, _ABBREV
    _always = ("block_h", "num_warps")  # text form, e.g. "rows:bh=2048:bt=512:r=4:w=8"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _blocks(H: int) -> list[tuple[int, int]]:
    """(main, tail) block pairs covering H: one power of two, and a two-piece split when that
    wastes fewer lanes (2560 -> 2048 + 512 instead of 4096)."""
    full = triton.next_power_of_2(H)
    out = [(full, 0)]
    main = full if full == H else full // 2
    if main < H:
        tail = triton.next_power_of_2(H - main)
        if main + tail < full:
            out.insert(0, (main, tail))
    return out


def is_valid(config: Config, workload: Workload) -> bool:
    """Can this config compute this workload correctly without spilling registers?"""
    c = config
    rows, H = _dims(workload)
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or c.stages not in (1, 2) or c.evict not in (0, 1):
        return False
    if (c.variant in _COLS) != (_inner(workload) > 0):  # each layout has its own kernels
        return False
    if c.variant in _COLS:  # a [block_h, rows] tile: the whole row (cols) or a chunk of it (colsloop)
        if c.block_t or c.progs or c.stages != 1 or c.evict or not (_pow2(c.block_h) and _pow2(c.rows)):
            return False
        if c.block_h < H if c.variant == "cols" else c.block_h >= H:
            return False
        return c.rows * c.block_h // (32 * c.num_warps) <= _MAX_PER_THREAD
    if c.stages == 2 and c.variant != "persist":
        return False
    if not (_pow2(c.block_h) and _pow2(c.rows) and (c.block_t == 0 or _pow2(c.block_t))):
        return False
    threads = 32 * c.num_warps
    if c.variant == "loop":
        return (c.rows == 1 and c.block_t == 0 and c.progs == 0 and c.evict == 0
                and c.block_h // threads <= _MAX_PER_THREAD)
    if c.variant == "row" and c.rows != 1:
        return False
    if (c.variant == "persist") != (c.progs > 0):
        return False
    if c.block_t:  # the main block must lie inside the row and the tail must reach its end
        if not (c.block_h < H <= c.block_h + c.block_t and c.block_t <= c.block_h):
            return False
    elif c.block_h < H:
        return False
    return c.rows * (c.block_h + c.block_t) // threads <= _MAX_PER_THREAD


def _warps_for(elems: int, per_thread: int) -> int:
    """Warps (a power of two, 1..32) that give each thread about `per_thread` elements."""
    return max(1, min(32, triton.next_power_of_2(elems // (32 * per_thread) + 1) // 2))


def space(workload: Workload) -> list[Config]:
    """The search space: variant x block split x rows per tile x warps (x programs/SM, stages,
    eviction hint), 15-50 configs for the BASELINES.md shapes."""
    rows, H = _dims(workload)
    if _inner(workload):
        return _cols_space(workload)
    max_rows = triton.next_power_of_2(max(rows, 1))
    cands: list[Config] = []
    for bh, bt in _blocks(H):
        width = bh + bt
        # row: 4..32 elements per thread; fewer warps means more bytes in flight per thread.
        for ept in (4, 8, 16, 32):
            cands.append(Config("row", bh, bt, 1, _warps_for(width, ept)))
        cands.append(Config("row", bh, bt, 1, _warps_for(width, 16), evict=1))
        # rows / persist: 2+ rows and up to 16K elements per tile (32 KB of bf16 in flight).
        r = 2
        while r * width <= 16384 and r <= max_rows:
            for ept in (8, 16, 32):
                w = _warps_for(r * width, ept)
                cands.append(Config("rows", bh, bt, r, w))
                if ept == 16:
                    cands.append(Config("rows", bh, bt, r, w, evict=1))
                    for progs, stages in ((4, 1), (8, 1), (8, 2)):
                        cands.append(Config("persist", bh, bt, r, w, progs, stages))
            r *= 2
    if H > 4096:  # long rows: chunked two-pass
        for chunk in (1024, 2048, 4096):
            if chunk < H:
                for w in (4, 8):
                    cands.append(Config("loop", chunk, 0, 1, w))
    seen: set[Config] = set()
    out = []
    for c in cands:
        if c not in seen and is_valid(c, workload):
            seen.add(c)
            out.append(c)
    return out


def heuristic(workload: Workload) -> Config:
    """Untuned default (always valid), from sweeps of `space` and ~300 more configs on H100s (bf16,
    weight; do_bench medians, L2 flushed; ranges over 4 machines). The best configs of each shape
    were within 1-2% of each other, i.e. within run-to-run noise:
      16384 x 2560  row, 4096 lanes, 8 warps (16/thread)  61.1-61.8 us, 2.73 TB/s (Liger 63.2;
                    torch's own copy_ of the same bytes: 60.4 us)
      32768 x 4096  row, 8 warps                          182.0-187.1 us (Liger 184)
      1M x 128      rows, 32-row tiles, 16 warps (8/thr)  181.3-184.6 us, 2.93 TB/s
      524288 x 128  same                                  93.7-95.4 us (Liger 94.7)
    The persistent variant lost by 3-5% on every shape (with or without prefetch), and the
    2048 + 512 split gained nothing over masked 4096 lanes at H = 2560, so neither is a default;
    both stay in `space` for tuning on other devices.
    """
    rows, H = _dims(workload)
    if _inner(workload):
        return _cols_heuristic(workload)
    width = triton.next_power_of_2(H)
    if width > _MAX_PER_THREAD * 32 * 32:  # more than 64 values per thread even at 32 warps
        return Config("loop", 4096, 0, 1, 8)
    if width >= 1024:
        return Config("row", width, 0, 1, _warps_for(width, 16))
    # Short rows: several per program (up to 4096 elements), but keep >= 264 tiles (two per SM of
    # an H100) so small batches still spread over the chip.
    r = min(4096 // width, max(1, triton.next_power_of_2(rows // 264 + 1) // 2))
    if workload.device != "cuda":  # Triton's interpreter pays per program, not per SM: fewest programs
        r = min(4096 // width, triton.next_power_of_2(max(rows, 1)))
    return Config("rows" if r > 1 else "row", width, 0, r, _warps_for(r * width, 8))


def _cols_space(workload: Workload) -> list[Config]:
    """cols: the whole row and 16-256 rows a tile (a load spans rows x the element size: 64 bytes and
    up), 8-32 values a thread; colsloop, for rows past 1024: chunks of 16-64 elements of 64-256 rows."""
    rows, H = _dims(workload)
    most = triton.next_power_of_2(_inner(workload))
    width = triton.next_power_of_2(H)
    cands = []
    r = 16
    while r <= min(256, max(most, 16)):
        for ept in (8, 16, 32):
            cands.append(Config("cols", width, 0, r, _warps_for(r * width, ept)))
        r *= 2
    if H > 64:
        for chunk in (16, 32, 64):
            for r in (64, 128, 256):
                for w in (4, 8):
                    cands.append(Config("colsloop", chunk, 0, r, w))
    return [c for c in dict.fromkeys(cands) if is_valid(c, workload)]


def _cols_heuristic(workload: Workload) -> Config:
    """From the whole space measured on an H200 (fp32, 2026-11-26, bench/results/
    2026-11-26-h200-session20.md): tiles of ~4K values and at least 16 rows, 32 values a thread,
    came within 3% of the best at H=64 (inner 65,536: 132.6 us against the 184.0 us of the 8K-value
    tiles with 16 a thread chosen before) and H=512 (inner 4,096: 40.7 against 39.5). Past 512-long
    rows (not measured), the chunked form that was best at 512: 64-element chunks, 128 rows, 4 warps."""
    rows, H = _dims(workload)
    most = max(triton.next_power_of_2(_inner(workload)), 16)
    width = triton.next_power_of_2(H)
    if width <= 512:
        r = max(16, min(256, 4096 // width, most))
        return Config("cols", width, 0, r, _warps_for(r * width, 32))
    return Config("colsloop", 64, 0, min(128, most), 4)


def workload_for(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None,
                 round_before_weight: bool = False) -> Workload:
    """The Workload record of one rmsnorm call (x seen as (rows, H)); `inner` too where x's rows
    are columns of an (outer, H, inner) array (rmsnorm_cols.py)."""
    # hint(): under dynamic shapes these may be SymInts; a Workload holds plain numbers (no guard).
    H = hint(x.shape[-1]) if x.dim() else 1
    rows = 1
    for d in x.shape[:-1]:
        rows *= hint(d)
    out_dtype = out_dtype or x.dtype
    shapes: tuple[tuple[int, ...], ...] = ((rows, H),)
    dtypes: tuple[str, ...] = (dtype_name(x.dtype),)
    if weight is not None:
        shapes += ((H,),)
        dtypes += (dtype_name(weight.dtype),)
    dtypes += (dtype_name(out_dtype),)
    params: tuple[tuple[str, Any], ...] = (("eps", float(eps)),)
    inner = _cols.cols_inner(x) if x.dim() > 1 and x.stride(-1) != 1 else 0
    if inner:  # (sorted names: a record hashes by them)
        params += (("inner", hint(inner)),)
    params += (("out_dtype", dtype_name(out_dtype)), ("round_before_weight", bool(round_before_weight)))
    return Workload(family=FAMILY, shapes=shapes, dtypes=dtypes, params=params, device=x.device.type)


def output_tolerance(workload: Workload) -> Tolerance:
    """Tolerance for comparing an output with `rmsnorm_ref`: the table's entry for the output
    dtype, loosened to x's dtype with round_before_weight. That rounding happens inside the kernel
    and inside the reference on values that differ in the last fp32 bits, so near a rounding edge
    the two land one x-dtype ulp apart, which an fp32 output then shows unmasked (bf16 x, fp32
    weight and output: 2e-2 absolute, seen in tests). The verifier should use this, not the plain
    output-dtype entry, or such workloads can never verify."""
    tol = tolerance(parse_dtype(workload.param("out_dtype", workload.dtypes[0])))
    if workload.param("round_before_weight", False):
        tx = tolerance(parse_dtype(workload.dtypes[0]))
        tol = Tolerance(max(tol.atol, tx.atol), max(tol.rtol, tx.rtol))
    return tol


def edge_inputs(workload: Workload, *, seed: int, rows: int | None = None, device: str | torch.device | None = None
                ) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Rows the verifier adds to its random ones (tune/verify.py; kernels/edges.py)."""
    args, kwargs = make_inputs(workload, seed=seed, rows=_edges.EDGE_DRAW_ROWS, device=device)
    return _edges.edge_rows(args, kwargs, {
        "large magnitudes": lambda r: r * 1000,  # a clamp; a half-precision sum of squares overflows
        "all-zero row": lambda r: r * 0,  # 0 * rsqrt(0 + eps) = 0: NaN where eps is dropped
        "tiny magnitudes": lambda r: r * 1e-4,  # mean square 1e-8, under eps: eps must be where it belongs
        "single spike": _edges.spike,  # normalized to ~sqrt(H): an output clamp
    })


def norm_error_bound(workload: Workload) -> float | None:
    """The verifier's norm-relative error bound (tune/verify.py). The kernels sum squares in torch's
    order (torch_order.py), so they match the reference bit for bit in half precision: measured on
    the interpreter (2026-11-27) over the heuristic and six configs each of 13 x 96 workloads (bf16,
    fp16, fp32; with and without weight and round_before_weight; bf16 -> fp32), with the edge
    rows: 0 for bf16 outputs, 5.5e-8 for fp16 (tiny-magnitude rows), 8.1e-8 for fp32 (0.7 fp32
    ulps). Bounds: bf16 1.6e-4, fp16 2.0e-5, fp32 4.8e-7 (6x over fp32's, for the GPU's
    approximate rsqrt), and for half outputs a rounding flip in ~1 element of 2500; a mean over
    H + 1 at H = 96 gives 5.7e-3, a bf16 accumulator 6.6e-3, squares rounded to fp16 5.4e-4.
    None for rows that are columns (`inner`: kernels/rmsnorm_cols.py): those kernels do not sum in
    torch's order, and a 2 x 40 x 17 bf16 workload measured 4.0e-3 (rounding flips in half the
    elements), so only the element tolerance applies there."""
    if workload.param("inner") is not None:
        return None
    return _edges.norm_bound(parse_dtype(workload.param("out_dtype", workload.dtypes[0])),
                             compute_ulps=4, round_ulps=0.02)


# ----------------------------------------------------------------------------------------------
# Custom op: what the graph rewrite calls. The config travels as its encoded string ("" for the
# heuristic) so the schema stays plain and torch.compile / export see a constant.
# The backward kernel (kernels/rmsnorm_bwd.py) is wired in with torch.library.register_autograd.


# Registered with torch.library's Library API rather than the @custom_op decorator: the decorator's
# Python wrappers cost 9.3 us a call against 3.6 us here (2-core CPU, measured 2026-11-22), and
# several times that on the GPU hosts, which a decode token (1 x 2560) cannot afford.
_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("rmsnorm(Tensor x, Tensor? weight, float eps, ScalarType out_dtype, bool round_before_weight, "
            "str config) -> Tensor")


def _fwd_config(config: str) -> Config | None:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return Config.decode(fwd) if fwd else None


def _rmsnorm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
                round_before_weight: bool, config: str) -> torch.Tensor:
    return rmsnorm(x, weight, eps, out_dtype=out_dtype, round_before_weight=round_before_weight,
                   config=_fwd_config(config))


_LIB.impl("rmsnorm", _rmsnorm_op, "CompositeExplicitAutograd")


class _Site:
    """`_rmsnorm_op` at one node of an optimized graph, called there without autograd (direct.py's
    `site`). Its first call takes `rmsnorm`'s whole path (checks, reshapes, plan lookup, launch
    key); where x is contiguous and the weight a contiguous vector, it records what that derived
    from the call's layout: the output's shape and strides, the launch's arguments after the
    tensors, and the launch itself (launch.bind). A later call whose x and weight have the recorded
    shape, strides, dtypes and device, with the same constants, on that device, only allocates the
    output and launches: 2.6 us against 5.1 us a call on a 2-core CPU with the launch left out.
    Any other call takes the whole path again, and records it in place of the last. The record is
    one tuple, replaced whole: a call in another thread sees the old one or the new one."""

    __slots__ = ("sig",)

    def __init__(self) -> None:
        # (x's shape, strides, dtype, device index, eps, out_dtype, rnd, config, weight's dtype or
        # None, weight's shape or None, the allocator, the current-device getter, the output's
        # shape and strides, the launch, the launch's arguments after the tensors)
        self.sig: tuple[Any, ...] | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
                 rnd: bool, config: str) -> torch.Tensor:
        sig = self.sig
        if (sig is not None and x.shape == sig[0] and x.stride() == sig[1] and x.dtype is sig[2]
                and x.get_device() == sig[3] and sig[11]() == sig[3] and eps == sig[4] and out_dtype is sig[5]
                and rnd is sig[6] and config == sig[7]
                and (weight is None if sig[8] is None else (
                    weight is not None and weight.dtype is sig[8] and weight.shape == sig[9]
                    and weight.stride() == (1,) and weight.get_device() == sig[3]))):
            y = sig[10](sig[12], sig[13], out_dtype)
            sig[14](x, x if weight is None else weight, y, *sig[15])
            return y
        return self._fill(x, weight, eps, out_dtype, rnd, config)

    def _fill(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
              rnd: bool, config: str) -> torch.Tensor:
        self.sig = None
        rec: list[Any] = []
        y = rmsnorm(x, weight, eps, out_dtype=out_dtype, round_before_weight=rnd, config=_fwd_config(config),
                    _record=rec)
        if len(rec) != 1 or not x.is_contiguous() or not y.is_contiguous() or y.shape != x.shape:
            return y
        if weight is not None and (weight.dim() != 1 or weight.stride() != (1,)):
            return y
        kernel, grid, args, kw = rec[0]
        x2, w, y2 = args[:3]
        if x2.data_ptr() != x.data_ptr() or y2.data_ptr() != y.data_ptr() or (weight is not None and w is not weight):
            return y
        bound = _bind(kernel, grid, args, kw)
        go = bound if bound is not None else (lambda *a: _launch(kernel, grid, a, kw))
        empty, now = _empty_strided(x.device)
        self.sig = (x.shape, x.stride(), x.dtype, x.get_device(), eps, out_dtype, rnd, config,
                    None if weight is None else weight.dtype, None if weight is None else weight.shape,
                    empty, now, tuple(y.shape), y.stride(), go, args[3:])
        return y


@torch.library.register_fake("solforge::rmsnorm")
def _rmsnorm_fake(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
                  round_before_weight: bool, config: str) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=out_dtype)


rmsnorm_op = torch.ops.solforge.rmsnorm


# the backward (kernels/rmsnorm_bwd.py), imported here where its op is wired in; it does not import
# this file (what both use is in rowtile.py and rmsnorm_base.py), so the dependency runs one way
from solforge.kernels import rmsnorm_bwd as _bwd  # noqa: E402


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, eps, _out_dtype, rbw, config = inputs
    ctx.save_for_backward(x, weight)
    # the backward's config: the part after "|" (tuned as family rmsnorm_bwd; "" = its heuristic)
    ctx.eps, ctx.rbw, ctx.bwd_config = eps, rbw, config.partition("|")[2]


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    dx, dw = _bwd.rmsnorm_bwd_call(dy, x, weight, ctx.eps, ctx.rbw, None, ctx.bwd_config)
    return dx, (dw.to(weight.dtype) if weight is not None else None), None, None, None, None


torch.library.register_autograd("solforge::rmsnorm", _backward, setup_context=_setup)
direct.register(torch.ops.solforge.rmsnorm.default, _rmsnorm_op, _setup, _backward, site=_Site)


def backward_workload(workload: Workload) -> Workload | None:
    """The backward's workload (family rmsnorm_bwd, kernels/rmsnorm_bwd.py `workload_from`)."""
    return _bwd.workload_from(workload)
