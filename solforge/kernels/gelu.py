"""GELU family: y = gelu(x + bias), the erf form or the tanh approximation, bias optional.

In order: reference, Triton kernels, launcher, backward kernel + launcher, custom ops (with
autograd), config triad (+ workload_for, make_inputs). The activation math (and its derivative)
is swiglu's `_act_fwd` / `_act_fwd_bwd`, shared rather than copied: one tanh that needs no libdevice
(absent from the interpreter) and stays exact in both tails. With a bias, x + bias is rounded to x's
dtype before the activation, as the model's add stores it (rounding.as_stored).

x is seen as (rows, N) after flattening the leading dims, so a bias of size N (GPT-style MLPs:
`gelu(x @ W + b)` when the bias add is its own op) broadcasts over the rows. Each program owns one
column block and walks one or several row tiles, so it loads its slice of the bias once. The
forward reads x and writes y; the backward reads dy and x and writes dx (= d(x + b)), plus, when
the bias needs a gradient, one fp32 partial row of db per program, summed by torch (as in
rmsnorm_bwd.py): the rows a program walks are summed in registers. Every kernel loads the native
dtype, computes in fp32 and casts on store (the interpreter cannot do bf16 arithmetic).

Variants (both tile (rows, N) into [ROWS, BLOCK_N] blocks, one 1-D grid, column block fastest):
  tile     one tile per program.
  persist  (SM count x programs per SM) programs spread over the column blocks, each looping
           over row tiles with a stride; the backward's choice when db is needed (few partials).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from solforge.kernels import direct
from solforge.kernels import swiglu as _swiglu
from solforge.kernels.launch import Meta, sm_count
from solforge.kernels.launch import launch as _launch
from solforge.kernels.rounding import as_stored
from solforge.kernels.swiglu import _act_fwd, _act_fwd_bwd, _block_for, _warps_for
from solforge.numerics import dtype_name, input_generator, parse_dtype
from solforge.records import Workload
from solforge.runtime.shapes import hint

FAMILY = "gelu"
APPROXIMATIONS = ("none", "tanh")  # F.gelu's `approximate`
# swiglu's activation names for the shared Triton helpers
_ACT = {"none": "gelu", "tanh": "gelu_tanh"}

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Reference


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def gelu_ref(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """The function every kernel must compute, in fp32 (fp64 for fp32/fp64 inputs), cast to x's
    dtype at the end; x + bias is rounded to x's dtype first, as the model's add stores it."""
    acc = _acc(x.dtype)
    h = x.to(acc) if bias is None else (x.to(acc) + bias.to(acc)).to(x.dtype).to(acc)
    return F.gelu(h, approximate=approximate).to(x.dtype)


def gelu_bwd_ref(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
                 approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, db) of `gelu_ref` by autograd in fp32/fp64, cast to x's and bias's dtypes."""
    acc = _acc(x.dtype)
    xf = x.detach().to(acc).requires_grad_(True)
    bf = bias.detach().to(acc).requires_grad_(True) if bias is not None else None
    with torch.enable_grad():
        y = F.gelu(xf if bf is None else xf + bf, approximate=approximate)
        grads = torch.autograd.grad(y, [xf] + ([bf] if bf is not None else []), dy.to(acc))
    db = grads[1].to(bias.dtype) if bias is not None else None
    return grads[0].to(x.dtype), db


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _rows_mask(rt, n_rows, cm, ROWS: tl.constexpr, EVEN_N: tl.constexpr):
    """Row offsets (int64, [ROWS, 1]) and mask of row tile `rt`. The column mask joins only where
    a block pokes past N: a row-only mask is constant along the row, so the compiler keeps 16-byte
    vector accesses. A tile past the last one (persist loop) is fully masked."""
    rows = rt * ROWS + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None]
    if not EVEN_N:
        m = m & cm
    # int64: rows * stride overflows int32 past 2^31 elements
    return rows.to(tl.int64)[:, None], m


@triton.jit
def _fwd_tile(x_ptr, y_ptr, b, rt, cols, cm, n_rows, sx, sy, ACT: tl.constexpr, ROWS: tl.constexpr,
              EVEN_N: tl.constexpr, EVICT: tl.constexpr, HAS_BIAS: tl.constexpr):
    r, m = _rows_mask(rt, n_rows, cm, ROWS, EVEN_N)
    x = tl.load(x_ptr + r * sx + cols, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    if HAS_BIAS:  # the model's bias add stores x + b in x's dtype before its gelu reads it
        x = as_stored(x + b, dt)
    y = _act_fwd(x, ACT)
    tl.store(y_ptr + r * sy + cols, as_stored(y, dt).to(dt), mask=m)


@triton.jit
def _gelu_fwd_kernel(x_ptr, b_ptr, y_ptr, n_rows, N, sx, sy, n_col_tiles, n_iter, n_rprogs, ACT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
                     EVICT: tl.constexpr, LOOP: tl.constexpr):
    """Program pid owns column block pid % n_col_tiles and row tiles pid // n_col_tiles (+ i *
    n_rprogs for i < n_iter when LOOP)."""
    pid = tl.program_id(0)
    pc = pid % n_col_tiles
    pr = pid // n_col_tiles
    cols = (pc * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    cm = cols < N
    b = 0.0
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    if not LOOP:
        _fwd_tile(x_ptr, y_ptr, b, pr, cols, cm, n_rows, sx, sy, ACT, ROWS, EVEN_N, EVICT, HAS_BIAS)
    else:
        for i in range(0, n_iter):
            _fwd_tile(x_ptr, y_ptr, b, pr + i * n_rprogs, cols, cm, n_rows, sx, sy, ACT, ROWS, EVEN_N, EVICT,
                      HAS_BIAS)


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import;
# only then can CPU tensors be launched.
_INTERPRETED = type(_gelu_fwd_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Launcher


def _bad(msg: str) -> ValueError:
    return ValueError(f"solforge gelu: {msg}")


def _rows(t: torch.Tensor, N: int) -> tuple[torch.Tensor, int]:
    """`t` as (rows, N) with a row stride and a contiguous last dim: a view when the leading dims
    merge into one stride, else a contiguous copy (a transposed input, say)."""
    t2 = t if t.dim() == 2 else t.reshape(-1, N)
    s0, s1 = t2.stride()
    if s1 != 1 and N > 1:
        t2 = t2.contiguous()
        s0 = N
    return t2, s0


def _check(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise _bad(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if x.dtype not in _SUPPORTED:
        raise _bad(f"x has dtype {x.dtype}; supported: bf16, fp16, fp32 (use gelu_ref for others)")
    if x.dim() == 0:
        raise _bad("x must have at least one dimension (the bias broadcasts over the last)")
    if bias is not None:
        if bias.shape != (x.shape[-1],):
            raise _bad(f"bias must be 1-D of size {x.shape[-1]} (x.shape[-1]); got shape {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise _bad(f"bias is {bias.dtype} but x is {x.dtype}; pass one dtype (eager would promote)")
        if bias.device != x.device:
            raise _bad(f"bias is on {bias.device} but x is on {x.device}; move them to one device")
    if x.device.type != "cuda" and not _INTERPRETED:
        raise _bad(f"x is on {x.device}; the Triton kernels need CUDA tensors "
                   "(or TRITON_INTERPRET=1 set before triton is imported, for CPU tests)")


_Plan = tuple[int, tuple[int, ...], dict[str, Any]]


def _launch_args(n_rows: int, N: int, c: Config, device: torch.device) -> _Plan:
    """(grid, (n_col_tiles, n_iter, n_rprogs), constexpr/launch kwargs) of a config."""
    n_col_tiles = triton.cdiv(N, c.block_n)
    row_tiles = triton.cdiv(n_rows, c.rows)
    n_rprogs, n_iter = row_tiles, 1
    if c.variant == "persist":
        n_rprogs = max(1, min(row_tiles, triton.cdiv(sm_count(device) * c.progs, n_col_tiles)))
        n_iter = triton.cdiv(row_tiles, n_rprogs)
    kw = dict(ROWS=c.rows, BLOCK_N=c.block_n, EVEN_N=N % c.block_n == 0,
              EVICT="evict_first" if c.evict else "", LOOP=c.variant == "persist", num_warps=c.num_warps)
    return n_col_tiles * n_rprogs, (n_col_tiles, n_iter, n_rprogs), kw


# Everything about a launch that depends only on (shape, dtype, bias, approximation, config,
# device), cached so a decode step pays for a dict lookup, not for Workload/heuristic work.
_PLANS: dict[tuple[Any, ...], _Plan] = {}


def _plan(n_rows: int, N: int, dtype: torch.dtype, has_bias: bool, approximate: str, config: Config | None,
          device: torch.device, backward: bool = False, bias_grad: bool = False) -> _Plan:
    """(grid, runtime args after the strides, every constexpr and launch kwarg). The workload (and
    so the heuristic) sees a bias when the forward has one, or when the backward sums its gradient."""
    key = (n_rows, N, dtype, has_bias, approximate, config, device, backward, bias_grad)
    plan = _PLANS.get(key)
    if plan is None:
        wl = _workload(n_rows, N, dtype, bias_grad if backward else has_bias, approximate, device.type)
        cfg = config if config is not None else bwd_heuristic(wl) if backward else heuristic(wl)
        if not is_valid(cfg, wl):  # a bad config could silently skip columns: refuse it
            raise _bad(f"config {cfg.encode()} is not valid for {wl.key}")
        if len(_PLANS) > 4096:  # many distinct row counts (varying sequence lengths): start over
            _PLANS.clear()
        grid, extra, kw = _launch_args(n_rows, N, cfg, device)
        kw.update(ACT=_ACT[approximate], HAS_BIAS=has_bias)
        if backward:
            kw["BIAS_GRAD"] = bias_grad
        plan = _PLANS[key] = grid, extra, Meta(kw)
    return plan


def gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none", *,
         config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x + bias) with the Triton kernel (see `gelu_ref`): a fresh contiguous tensor of x's
    dtype, or `out` written in place (x's shape and dtype, last dim contiguous). `config` picks
    the kernel (default: `heuristic` for this workload)."""
    _check(x, bias, approximate)
    shape, device = x.shape, x.device
    if out is not None and (out.shape != shape or out.dtype != x.dtype or out.device != device):
        raise _bad(f"out must have shape {tuple(shape)}, dtype {x.dtype} and device {device}; got "
                   f"{tuple(out.shape)}, {out.dtype}, {out.device}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    N = int(shape[-1])
    x2, sx = _rows(x, N)
    try:
        y2 = out if out.dim() == 2 else out.view(-1, N)
    except RuntimeError as e:
        raise _bad("out must be viewable as (rows, N); pass a contiguous tensor") from e
    sy, s1 = y2.stride()
    if s1 != 1 and N > 1:
        raise _bad("out's last dim must be contiguous")
    b = bias.contiguous() if bias is not None else x2  # never read without HAS_BIAS
    n_rows = x2.shape[0]
    grid, extra, kw = _plan(n_rows, N, x.dtype, bias is not None, approximate, config, device)
    _launch(_gelu_fwd_kernel, (grid,), (x2, b, y2, n_rows, N, sx, sy, *extra), kw)
    return out


# ----------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _bwd_tile(dy_ptr, x_ptr, dx_ptr, b, rt, cols, cm, n_rows, sdy, sx, N, ACT: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, EVICT: tl.constexpr, BIAS_GRAD: tl.constexpr):
    """dx of one tile; returns its column sums ([1, BLOCK_N], fp32) when the bias needs a gradient.
    Masked elements load dy = 0, so they add nothing."""
    r, m = _rows_mask(rt, n_rows, cm, ROWS, EVEN_N)
    dy = tl.load(dy_ptr + r * sdy + cols, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    x = tl.load(x_ptr + r * sx + cols, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    _, da = _act_fwd_bwd(x + b, ACT)
    dx = dy * da
    tl.store(dx_ptr + r * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)  # dx: fresh, contiguous
    if BIAS_GRAD:
        s = tl.sum(dx, axis=0)[None, :]
    else:
        s = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    return s


@triton.jit
def _gelu_bwd_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, N, sdy, sx, n_col_tiles, n_iter, n_rprogs,
                     ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, EVICT: tl.constexpr, LOOP: tl.constexpr):
    """Grid as in `_gelu_fwd_kernel`; with BIAS_GRAD program (pc, pr) writes row pr of the
    (n_rprogs, N) fp32 partials of db, columns of block pc."""
    pid = tl.program_id(0)
    pc = pid % n_col_tiles
    pr = pid // n_col_tiles
    cols = (pc * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    cm = cols < N
    b = 0.0
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    if not LOOP:
        db = _bwd_tile(dy_ptr, x_ptr, dx_ptr, b, pr, cols, cm, n_rows, sdy, sx, N, ACT, ROWS, BLOCK_N, EVEN_N,
                       EVICT, BIAS_GRAD)
    else:
        db = tl.zeros([1, BLOCK_N], dtype=tl.float32)
        for i in range(0, n_iter):
            db += _bwd_tile(dy_ptr, x_ptr, dx_ptr, b, pr + i * n_rprogs, cols, cm, n_rows, sdy, sx, N, ACT,
                            ROWS, BLOCK_N, EVEN_N, EVICT, BIAS_GRAD)
    if BIAS_GRAD:
        tl.store(db_ptr + pr.to(tl.int64) * N + cols, db, mask=cm)


def gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none", *,
             bias_grad: bool | None = None, config: Config | None = None,
             out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, db) of y = gelu(x + bias) for the incoming gradient dy, in one launch (plus torch's sum
    of db's fp32 partial rows): dx fresh and contiguous in x's dtype, db in bias's dtype, or None
    without a bias or with `bias_grad=False` (default: computed whenever there is a bias).
    dy may be strided (even expanded: autograd hands `y.sum()`'s gradient over with stride 0,
    copied first). `config` defaults to `bwd_heuristic`. `out`: (dx,) or, with db, (dx, db),
    dx contiguous, written in place (kernels/gelu_bwd.py tunes this)."""
    _check(x, bias, approximate)
    if dy.shape != x.shape or dy.dtype not in _SUPPORTED or dy.device != x.device:
        raise _bad(f"dy must match x ({tuple(x.shape)}, on {x.device}); got {tuple(dy.shape)} {dy.dtype} "
                   f"on {dy.device}")
    want_db = bias is not None and (bias_grad is None or bias_grad)
    shape, device = x.shape, x.device
    if out is not None:
        if len(out) != 1 + want_db or out[0].shape != x.shape or out[0].dtype != x.dtype \
                or not out[0].is_contiguous() or (want_db and out[1].shape != bias.shape):  # type: ignore[union-attr]
            raise _bad("out must be (dx,) or, with a bias gradient, (dx, db): dx contiguous like x, db like bias")
        dx = out[0]
    else:
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    N = int(shape[-1])
    if x.numel() == 0:
        db0 = (out[1].zero_() if out is not None else torch.zeros(N, dtype=bias.dtype, device=device)) \
            if want_db else None  # type: ignore[union-attr]
        return dx, db0
    dy2, sdy = _rows(dy, N)
    x2, sx = _rows(x, N)
    n_rows = x2.shape[0]
    grid, extra, kw = _plan(n_rows, N, x.dtype, bias is not None, approximate, config, device, backward=True,
                            bias_grad=want_db)
    n_rprogs = extra[2]
    # few partial rows with persist (a few hundred at GPT-2 shapes: ~2 MB against ~150 MB of dy/x/dx)
    part = torch.empty((n_rprogs, N), dtype=torch.float32, device=device) if want_db else dx
    b = bias.contiguous() if bias is not None else x2
    _launch(_gelu_bwd_kernel, (grid,), (dy2, x2, b, dx, part, n_rows, N, sdy, sx, *extra), kw)
    if not want_db:
        return dx, None
    db = part.sum(0).to(bias.dtype)  # type: ignore[union-attr]
    return dx, (out[1].copy_(db) if out is not None else db)


# ----------------------------------------------------------------------------------------------
# Custom ops: what the graph rewrite calls. The config travels as its encoded string ("" for the
# heuristic) so the schema stays plain and torch.compile / export see a constant. Registered with
# torch.library's Library API rather than the @custom_op decorator: the decorator's Python
# wrappers cost 9.3 us a call against 3.6 us here (see rmsnorm.py).

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("gelu(Tensor x, Tensor? bias, str approximate, str config) -> Tensor")
# db is empty (size 0) when not asked for: a schema cannot return an optional tensor in a tuple
_LIB.define("gelu_bwd(Tensor dy, Tensor x, Tensor? bias, str approximate, bool bias_grad, str config) "
            "-> (Tensor, Tensor)")


def _gelu_op(x: torch.Tensor, bias: torch.Tensor | None, approximate: str, config: str) -> torch.Tensor:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return gelu(x, bias, approximate, config=Config.decode(fwd) if fwd else None)


def _gelu_bwd_op(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str, bias_grad: bool,
                 config: str) -> tuple[torch.Tensor, torch.Tensor]:
    dx, db = gelu_bwd(dy, x, bias, approximate, bias_grad=bias_grad,
                      config=Config.decode(config) if config else None)
    return dx, (db if db is not None else x.new_empty(0))


_LIB.impl("gelu", _gelu_op, "CompositeExplicitAutograd")
_LIB.impl("gelu_bwd", _gelu_bwd_op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::gelu")
def _gelu_fake(x: torch.Tensor, bias: torch.Tensor | None, approximate: str, config: str) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous, like the real output


@torch.library.register_fake("solforge::gelu_bwd")
def _gelu_bwd_fake(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str,
                   bias_grad: bool, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    db = bias.new_empty(bias.shape) if bias is not None and bias_grad else x.new_empty(0)
    return x.new_empty(x.shape), db


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, bias, approximate, config = inputs
    # Save the inputs, not x + b: the backward recomputes it while reading x anyway.
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate
    # the backward's config: the part after "|" (tuned as family gelu_bwd; "" = bwd_heuristic)
    ctx.bwd_config = config.partition("|")[2]


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
    x, bias = ctx.saved_tensors
    need_x, need_b = ctx.needs_input_grad[:2]
    # The forward's tuned config was chosen for 1 read + 1 write; the backward has its own.
    dx, db = _gelu_bwd_call(dy, x, bias, ctx.approximate, bool(bias is not None and need_b),
                                         ctx.bwd_config)
    return (dx if need_x else None), (db if bias is not None and need_b else None), None, None


torch.library.register_autograd("solforge::gelu", _backward, setup_context=_setup_context)
direct.register(torch.ops.solforge.gelu.default, _gelu_op, _setup_context, _backward)
_gelu_bwd_call = direct.plain(torch.ops.solforge.gelu_bwd.default, _gelu_bwd_op)  # what _backward calls

gelu_op = torch.ops.solforge.gelu
gelu_bwd_op = torch.ops.solforge.gelu_bwd


# ----------------------------------------------------------------------------------------------
# Config triad

# The same tiles as swiglu's kernels (one elementwise pass over [rows, block_n] tiles): its space's
# knobs, validity rule and register budget, under this family's name.
VARIANTS = _swiglu.VARIANTS
_MIN_BLOCK = _swiglu._MIN_BLOCK
_dims = _swiglu._dims
is_valid = _swiglu.is_valid
_unique_valid = _swiglu._unique_valid


@dataclass(frozen=True)
class Config(_swiglu.Config):
    """swiglu's config (one kernel choice: [rows, block_n] tiles, warps, and for `persist` programs
    per SM), decoded under this family's name."""

    _family = FAMILY


def _tile_rows(elems: int, bn: int, rows: int) -> int:
    return max(1, min(elems // bn, triton.next_power_of_2(max(rows, 1))))


def space(workload: Workload) -> list[Config]:
    """The search space, hand-picked configs first (a budget-limited walk in order tries them
    first): column block (blocks dividing N first) x tile size (2K..16K elements) x warps (8 or 16
    elements a thread), then evict_first and persistent (2/4/8 programs per SM) versions of each;
    valid configs only. 264 configs at GPT-2's (8192, 3072), 16 at (9, 100); the search strategies walk it
    evolutionarily, not exhaustively."""
    rows, N = _dims(workload)
    full = max(_MIN_BLOCK, triton.next_power_of_2(N))
    blocks = [b for b in (256, 512, 1024, 2048, 4096) if b <= full] or [full]
    blocks.sort(key=lambda b: N % b != 0)  # stable: even blocks first, each group ascending
    tiles = [Config("tile", bn, _tile_rows(elems, bn, rows), _warps_for(_tile_rows(elems, bn, rows) * bn, ept))
             for bn in blocks for elems in (2048, 4096, 8192, 16384) for ept in (8, 16)]
    h = heuristic(workload)
    cands = [h, *tiles, dataclasses.replace(h, evict=1)]
    cands += [dataclasses.replace(h, variant="persist", progs=p) for p in (2, 4, 8)]
    for t in tiles:
        cands.append(dataclasses.replace(t, evict=1))
        cands += [dataclasses.replace(t, variant="persist", progs=p, evict=e) for p in (2, 4, 8) for e in (0, 1)]
    return _unique_valid(cands, workload)


def heuristic(workload: Workload) -> Config:
    """Untuned default (always valid), swiglu's: ~4096 elements a tile, 16 elements (two 16-byte
    bf16 vectors) a thread, the column block from swiglu's `_block_for` (the largest power of two
    <= 1024 dividing N: 3072 -> 1024, 10240 -> 1024). Not yet measured on a GPU for gelu
    (bench/families.py --families gelu does)."""
    rows, N = _dims(workload)
    bn = _block_for(N)
    r = _tile_rows(4096, bn, rows)
    c = Config("tile", bn, r, _warps_for(r * bn, 16))
    return c if is_valid(c, workload) else Config("tile", bn, 1, _warps_for(bn, 16))


def bwd_heuristic(workload: Workload) -> Config:
    """The backward's default. With a bias gradient: persistent (2 programs per SM, so db comes
    from a few hundred partial rows rather than one per tile), ~8K-element tiles up to 4096 columns
    wide, 16 elements a thread, evict_first loads. From the H100 sweep of the bias case
    (bench/families.py --families gelu, 2026-11-22): 73.3 us at 8192x3072 (best 72.7) and 380.0 us
    at 16384x10240 (best 379.9, 2.65 TB/s), against 90.8 and 633.8 for the earlier r=4:w=8:p=4
    guess. Without a bias the forward's tile (not swept)."""
    h = heuristic(workload)
    if len(workload.shapes) == 1:
        return h
    rows, N = _dims(workload)
    bn = min(4096, max(_MIN_BLOCK, triton.next_power_of_2(N)))
    r = _tile_rows(8192, bn, rows)
    c = Config("persist", bn, r, _warps_for(r * bn, 16), progs=2, evict=1)
    return c if is_valid(c, workload) else dataclasses.replace(h, variant="persist", progs=4)


def _workload(n_rows: int, N: int, dtype: torch.dtype, has_bias: bool, approximate: str, device: str) -> Workload:
    d = dtype_name(dtype)
    shapes = ((n_rows, N), (N,)) if has_bias else ((n_rows, N),)
    return Workload(family=FAMILY, shapes=shapes, dtypes=(d,) * len(shapes),
                    params=(("approximate", approximate),), device=device)


def workload_for(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> Workload:
    """The Workload record of one gelu call (x seen as (rows, N); the bias, if any, as (N,))."""
    # hint(): under dynamic shapes these may be SymInts; a Workload holds plain numbers (no guard).
    N = hint(x.shape[-1]) if x.dim() else 1
    rows = math.prod(hint(d) for d in x.shape[:-1])
    return _workload(rows, N, x.dtype, bias is not None, approximate, x.device.type)


def backward_workload(workload: Workload) -> Workload:
    """The workload of this call's backward (family gelu_bwd, kernels/gelu_bwd.py): the same
    shapes, dtypes and approximation, and whether the bias's gradient is summed (a constexpr of the
    kernel, and what picks `bwd_heuristic`'s persistent grid). Training's bias is a parameter, so
    its gradient is assumed wanted; a frozen bias still runs with the tuned config (valid alike)."""
    return dataclasses.replace(workload, family=f"{FAMILY}_bwd",
                               params=tuple(sorted({**dict(workload.params),
                                                    "bias_grad": len(workload.shapes) > 1}.items())))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `gelu` / `gelu_ref` on this workload: (x, bias or None).

    Drawn from `seed` on the CPU for small inputs (the same numbers on any device), on the device
    past 2^24 elements (numerics.input_generator). x is spread over [-6, 6]-ish (randn x 2) so both
    tails of the activation are exercised; the bias is randn x 0.5."""
    n_rows, N = _dims(workload)
    n_rows = n_rows if rows is None else rows
    device = torch.device(device or workload.device)
    dtype = parse_dtype(workload.dtypes[0])
    g, where = input_generator(n_rows * N, device, seed)
    x = (2 * torch.randn(n_rows, N, generator=g, device=where)).to(dtype).to(device)
    bias = None
    if len(workload.shapes) > 1:
        bias = (0.5 * torch.randn(N, generator=g, device=where)).to(dtype).to(device)
    return (x, bias), {"approximate": workload.param("approximate", "none")}
