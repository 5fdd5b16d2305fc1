"""Softmax family: y = exp(x - max(x)) / sum(exp(x - max(x))) over the last dim.

In order: reference, Triton kernels, launcher, backward (kernels, launcher), custom ops, config
triad (+ workload_for, make_inputs). Every kernel loads the native dtype, computes in fp32 and casts
on store, so the upcast form transformers' eager attention writes,
`softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)`, is one call with a bf16 input and a
bf16 output (out_dtype): the fp32 softmax rounded once, exactly what the three ATen ops compute.

Variants:
  row      one row per program, the whole row in registers: one read of x, one write of y.
  rows     a [ROWS, BLOCK] tile per program, for short rows (amortizes the per-program fixed cost).
  online   one row per program in BLOCK-wide chunks: pass 1 keeps a running max and rescaled sum per
           lane (no cross-lane reduction per chunk), pass 2 re-reads x (from L2 when the row was
           just read) and writes y. For rows too long for registers (a vocabulary-sized softmax).
The backward, dx = y * (dy - sum(dy * y)), has the same three shapes of kernel. It is tuned as
its own family, softmax_bwd (kernels/softmax_bwd.py, from `bwd_space`): in training the op's config
string is "FWD|BWD" and the backward op runs BWD ("" = `bwd_heuristic`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from solforge.kernels import config_text, direct
from solforge.kernels import edges as _edges
from solforge.kernels.interp import cast_rne
from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch
from solforge.numerics import dtype_name, input_generator, parse_dtype
from solforge.records import Workload
from solforge.runtime.shapes import hint

FAMILY = "softmax"

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Reference


def softmax_ref(x: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The function every kernel must compute, in fp32 (fp64 for fp32/fp64 inputs), cast once."""
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.softmax(x.to(acc), dim=-1).to(out_dtype or x.dtype)


def softmax_bwd_ref(dy: torch.Tensor, y: torch.Tensor, *, dx_dtype: torch.dtype | None = None) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) in fp32/fp64 from the y given (the kernel's saved output)."""
    acc = torch.float64 if y.dtype in (torch.float32, torch.float64) else torch.float32
    yf, dyf = y.to(acc), dy.to(acc)
    return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(dx_dtype or y.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _softmax_tile_kernel(x_ptr, y_ptr, n_rows, N, stride_x, stride_y, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         EVEN: tl.constexpr):
    """Variants `row` (ROWS == 1) and `rows`: one [ROWS, BLOCK] tile per program."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)[None, :]
    rm = (rows < n_rows)[:, None]
    m = rm  # a row-only mask keeps 16-byte vector accesses
    if not EVEN:
        m = rm & (cols < N)
    r64 = rows.to(tl.int64)[:, None]  # rows * stride overflows int32 past 2^31 elements
    x = tl.load(x_ptr + r64 * stride_x + cols, mask=m, other=-float("inf")).to(tl.float32)
    # rows past the end are all -inf: give them a max of 0 so they compute 0/0 quietly, unstored
    mx = tl.where(rm, tl.max(x, axis=1)[:, None], 0.0)
    e = tl.exp(x - mx)
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(y_ptr + r64 * stride_y + cols, cast_rne(y, y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ld(ptrs, cols, N, other, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """A chunk load, masked only where the chunks do not tile the row (an unmasked load stays a
    full-width vector access)."""
    if EVEN:
        v = tl.load(ptrs, eviction_policy=EVICT)
    else:
        v = tl.load(ptrs, mask=cols < N, other=other, eviction_policy=EVICT)
    return v.to(tl.float32)


@triton.jit
def _st(ptrs, v, cols, N, EVEN: tl.constexpr):
    # cast_rne: the interpreter's bf16 cast truncates (interp.py); on the GPU it is the plain cast
    if EVEN:
        tl.store(ptrs, cast_rne(v, ptrs.dtype.element_ty))
    else:
        tl.store(ptrs, cast_rne(v, ptrs.dtype.element_ty), mask=cols < N)


@triton.jit
def _online_step(x_row, off, N, mv, sv, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Fold one chunk into the per-lane running (max, sum of exp(x - max))."""
    cols = off + tl.arange(0, BLOCK)
    # evict_last: pass 2 reads the same bytes again, from L2 rather than HBM when they are still there
    x = _ld(x_row + cols, cols, N, -float("inf"), EVEN, "evict_last")
    new = tl.maximum(mv, x)
    # a lane that has seen only -inf (masked tail lanes, or -inf scores) keeps a sum of 0, not NaN
    safe = tl.where(new == -float("inf"), 0.0, new)
    sv = sv * tl.exp(mv - safe) + tl.exp(x - safe)
    return new, sv


@triton.jit
def _online_store(x_row, y_row, off, N, mx, inv, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    cols = off + tl.arange(0, BLOCK)
    x = _ld(x_row + cols, cols, N, 0.0, EVEN, "evict_first")
    _st(y_row + cols, tl.exp(x - mx) * inv, cols, N, EVEN)


@triton.jit
def _softmax_online_kernel(x_ptr, y_ptr, N, stride_x, stride_y, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Variant `online`: one row per program, two passes over BLOCK-wide chunks."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    mv = tl.full([BLOCK], -float("inf"), tl.float32)
    sv = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(0, N, BLOCK):
        mv, sv = _online_step(x_row, off, N, mv, sv, BLOCK, EVEN)
    mx = tl.max(mv, axis=0)
    safe = tl.where(mx == -float("inf"), 0.0, mx)
    inv = 1.0 / tl.sum(tl.where(mv == -float("inf"), 0.0, sv * tl.exp(mv - safe)), axis=0)
    for off in tl.range(0, N, BLOCK):
        _online_store(x_row, y_row, off, N, mx, inv, BLOCK, EVEN)


@triton.jit
def _softmax_bwd_tile_kernel(dy_ptr, y_ptr, dx_ptr, n_rows, N, s_dy, s_y, s_dx, ROWS: tl.constexpr,
                             BLOCK: tl.constexpr, EVEN: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)[None, :]
    m = (rows < n_rows)[:, None]
    if not EVEN:
        m = m & (cols < N)
    r64 = rows.to(tl.int64)[:, None]
    y = tl.load(y_ptr + r64 * s_y + cols, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r64 * s_dy + cols, mask=m, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + r64 * s_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dot_chunk(dy_row, y_row, off, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    cols = off + tl.arange(0, BLOCK)
    return _ld(dy_row + cols, cols, N, 0.0, EVEN, "evict_last") * _ld(y_row + cols, cols, N, 0.0, EVEN, "evict_last")


@triton.jit
def _dx_chunk(dy_row, y_row, dx_row, off, N, dot, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    cols = off + tl.arange(0, BLOCK)
    y = _ld(y_row + cols, cols, N, 0.0, EVEN, "evict_first")
    dy = _ld(dy_row + cols, cols, N, 0.0, EVEN, "evict_first")
    _st(dx_row + cols, y * (dy - dot), cols, N, EVEN)


@triton.jit
def _softmax_bwd_online_kernel(dy_ptr, y_ptr, dx_ptr, N, s_dy, s_y, s_dx, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dy_row, y_row, dx_row = dy_ptr + row * s_dy, y_ptr + row * s_y, dx_ptr + row * s_dx
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(0, N, BLOCK):
        acc += _dot_chunk(dy_row, y_row, off, N, BLOCK, EVEN)
    dot = tl.sum(acc, axis=0)
    for off in tl.range(0, N, BLOCK):
        _dx_chunk(dy_row, y_row, dx_row, off, N, dot, BLOCK, EVEN)


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import;
# only then can CPU tensors be launched.
_INTERPRETED = type(_softmax_tile_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Launchers


def _bad(msg: str) -> ValueError:
    return ValueError(f"solforge softmax: {msg}")


def _rows_view(t: torch.Tensor, N: int) -> torch.Tensor:
    """(rows, N) with a unit column stride; reshape copies only when one row stride cannot do."""
    t2 = t if t.dim() == 2 else t.reshape(-1, N)
    return t2 if t2.stride(-1) == 1 or N == 1 else t2.contiguous()


def _out_rows(out: torch.Tensor, N: int) -> torch.Tensor:
    try:
        o2 = out.view(-1, N)
    except RuntimeError as e:
        raise _bad("out must be viewable as (rows, N); pass a contiguous tensor") from e
    if o2.stride(-1) != 1 and N > 1:
        raise _bad("out's last dim must be contiguous")
    return o2


@functools.lru_cache(maxsize=1024)
def _launch_plan(n_rows: int, N: int, dtype: torch.dtype, out_dtype: torch.dtype, config: Config | None,
                 device: str, bwd: bool = False) -> tuple[Any, int, dict[str, Any]]:
    """(kernel variant, grid, kernel options) for one shape and config (None: the forward's or, with
    `bwd`, the backward's heuristic): cached, so a call pays a lookup rather than the
    Workload/heuristic/validity work."""
    wl = _workload(n_rows, N, dtype, out_dtype, device)
    c = config or (bwd_heuristic(wl) if bwd else heuristic(wl))
    if not is_valid(c, wl):  # a bad config could silently skip columns: refuse it
        raise _bad(f"config {c.encode()} is not valid for {wl.key}")
    if c.variant == "online":
        return "online", n_rows, Meta(BLOCK=c.block, EVEN=N % c.block == 0, num_warps=c.num_warps)
    return "tile", triton.cdiv(n_rows, c.rows), Meta(ROWS=c.rows, BLOCK=c.block, EVEN=N == c.block,
                                                     num_warps=c.num_warps)


def _check(x: torch.Tensor, out_dtype: torch.dtype) -> None:
    if x.dtype not in _SUPPORTED or out_dtype not in _SUPPORTED:
        raise _bad(f"dtypes {x.dtype} -> {out_dtype}: bf16, fp16 or fp32 only (use softmax_ref for others)")
    if x.dim() == 0:
        raise _bad("x needs a last dimension to take the softmax over")
    if x.device.type != "cuda" and not _INTERPRETED:
        raise _bad(f"x is on {x.device}; the kernels need CUDA (or TRITON_INTERPRET=1 set before triton is "
                   "imported)")


def softmax(x: torch.Tensor, *, out_dtype: torch.dtype | None = None, config: Config | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim of `x` (fp32 math), stored in `out_dtype` (default x.dtype).
    `config` picks the kernel (default: `heuristic`); `out` (shaped like x) is written in place."""
    out_dtype = out_dtype or x.dtype
    _check(x, out_dtype)
    if out is None:
        out = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != out_dtype or out.device != x.device:
        raise _bad(f"out must be {out_dtype} {tuple(x.shape)} on {x.device}")
    if x.numel() == 0:
        return out
    N = x.shape[-1]
    x2, y2 = _rows_view(x, N), _out_rows(out, N)
    n_rows = x2.shape[0]
    kind, grid, kw = _launch_plan(n_rows, N, x.dtype, out_dtype, config, x.device.type)
    if kind == "online":
        _launch(_softmax_online_kernel, (grid,), (x2, y2, N, x2.stride(0), y2.stride(0)), kw)
    else:
        _launch(_softmax_tile_kernel, (grid,), (x2, y2, n_rows, N, x2.stride(0), y2.stride(0)), kw)
    return out


def softmax_bwd(dy: torch.Tensor, y: torch.Tensor, *, dx_dtype: torch.dtype | None = None,
                config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) over the last dim (see `softmax_bwd_ref`), in dx_dtype (default
    y.dtype). The config is a forward Config evaluated on y's shape, from `bwd_space` (default:
    `bwd_heuristic`). `out` (shaped like y, dx_dtype) is written in place when given (the
    softmax_bwd family, kernels/softmax_bwd.py, tunes this)."""
    dx_dtype = dx_dtype or y.dtype
    _check(y, dx_dtype)
    if dy.shape != y.shape or dy.dtype not in _SUPPORTED:
        raise _bad(f"backward: dy {dy.dtype} {tuple(dy.shape)} must be shaped like y {tuple(y.shape)}")
    if out is None:
        dx = torch.empty_like(y, dtype=dx_dtype, memory_format=torch.contiguous_format)
    elif out.shape != y.shape or out.dtype != dx_dtype or out.device != y.device:
        raise _bad(f"backward: out must be {dx_dtype} {tuple(y.shape)} on {y.device}")
    else:
        dx = out
    if y.numel() == 0:
        return dx
    N = y.shape[-1]
    y2, dy2, dx2 = _rows_view(y, N), _rows_view(dy, N), _out_rows(dx, N)
    n_rows = y2.shape[0]
    kind, grid, kw = _launch_plan(n_rows, N, y.dtype, dx_dtype, config, y.device.type, True)
    if kind == "online":
        _launch(_softmax_bwd_online_kernel, (grid,), (dy2, y2, dx2, N, dy2.stride(0), y2.stride(0), dx2.stride(0)),
                kw)
    else:
        _launch(_softmax_bwd_tile_kernel, (grid,),
                (dy2, y2, dx2, n_rows, N, dy2.stride(0), y2.stride(0), dx2.stride(0)), kw)
    return dx


# ----------------------------------------------------------------------------------------------
# Custom ops: what the graph rewrite calls. The config travels as its encoded string ("" for the
# heuristic). Registered with the Library API, not @custom_op: 3.6 us a call against 9.3 us
# (kernels/rmsnorm.py has the measurement). The backward is its own op so a traced backward sees
# one call with a fake implementation.
#
# The backward reads the saved output y, not x: in attention, y is kept alive anyway (the next
# matmul saves it for its own backward), while saving x would hold another [B, H, S, S] tensor.
# For the upcast form y is the bf16 output rather than eager's fp32 intermediate, so dx carries one
# more bf16 rounding of y (relative 2^-9); eager holds an fp32 and a bf16 copy of the same values.

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("softmax(Tensor x, ScalarType out_dtype, str config) -> Tensor")
_LIB.define("softmax_bwd(Tensor dy, Tensor y, ScalarType dx_dtype, str config) -> Tensor")


def _op(x: torch.Tensor, out_dtype: torch.dtype, config: str) -> torch.Tensor:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return softmax(x, out_dtype=out_dtype, config=Config.decode(fwd) if fwd else None)


def _bwd_op(dy: torch.Tensor, y: torch.Tensor, dx_dtype: torch.dtype, config: str) -> torch.Tensor:
    return softmax_bwd(dy, y, dx_dtype=dx_dtype, config=Config.decode(config) if config else None)


_LIB.impl("softmax", _op, "CompositeExplicitAutograd")
_LIB.impl("softmax_bwd", _bwd_op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::softmax")
def _fake(x: torch.Tensor, out_dtype: torch.dtype, config: str) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.register_fake("solforge::softmax_bwd")
def _bwd_fake(dy: torch.Tensor, y: torch.Tensor, dx_dtype: torch.dtype, config: str) -> torch.Tensor:
    return y.new_empty(y.shape, dtype=dx_dtype)


softmax_op = torch.ops.solforge.softmax.default
softmax_bwd_op = torch.ops.solforge.softmax_bwd.default
softmax_bwd_call = direct.plain(softmax_bwd_op, _bwd_op)  # what _backward calls


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.x_dtype = inputs[0].dtype
    # the backward's config: the part after "|" (tuned as family softmax_bwd, kernels/softmax_bwd.py;
    # "" = bwd_heuristic, also for a plain "FWD" string of inference or an older database)
    ctx.bwd_config = inputs[2].partition("|")[2]


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    (y,) = ctx.saved_tensors
    return softmax_bwd_call(dy, y, ctx.x_dtype, ctx.bwd_config), None, None


torch.library.register_autograd("solforge::softmax", _backward, setup_context=_setup)
direct.register(torch.ops.solforge.softmax.default, _op, _setup, _backward)


# ----------------------------------------------------------------------------------------------
# Config triad

VARIANTS = ("row", "rows", "online")
_WARPS = (1, 2, 4, 8, 16, 32)
# Register budget: fp32 values of a tile a thread holds at once (rmsnorm.py's measured limit; past
# it the compiler spills and the kernel falls off the bandwidth roof).
_MAX_PER_THREAD = 64
# Rows up to this width run single-pass (32 values a thread at 32 warps); longer ones go online.
_SINGLE_PASS_MAX = 32768
_ABBREV = {"block": "b", "rows": "r", "num_warps": "w"}


@dataclass(frozen=True)
class Config(config_text.Text):
    """One kernel choice: a [rows, block] tile per program (row/rows: block = N rounded up to a
    power of two), or chunks of `block` columns (online)."""

    variant: str = "row"
    block: int = 1024
    rows: int = 1
    num_warps: int = 4

    _family, _variants, _abbrev = FAMILY, VARIANTS, _ABBREV
    _always = ("block", "num_warps")  # text form, e.g. "rows:b=1024:r=4:w=8"



def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _dims(workload: Workload) -> tuple[int, int]:
    rows = 1
    for d in workload.shapes[0][:-1]:
        rows *= d
    return rows, workload.shapes[0][-1]


def is_valid(config: Config, workload: Workload) -> bool:
    """Can this config compute this workload correctly without spilling registers?"""
    c = config
    _rows, N = _dims(workload)
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or not (_pow2(c.block) and _pow2(c.rows)):
        return False
    if c.variant == "online":  # at least two chunks, else it is the row variant done twice
        return c.rows == 1 and c.block < N and c.block // (32 * c.num_warps) <= _MAX_PER_THREAD
    if (c.variant == "row") != (c.rows == 1) or c.block != triton.next_power_of_2(N):
        return False
    return c.rows * c.block // (32 * c.num_warps) <= _MAX_PER_THREAD


def _warps_for(elems: int, per_thread: int) -> int:
    """Warps (a power of two, 1..32) that give each thread about `per_thread` elements."""
    return max(1, min(32, triton.next_power_of_2(elems // (32 * per_thread) + 1) // 2))


def _fit(c: Config, workload: Workload) -> Config:
    """More warps until the tile fits the register budget (or 32 warps)."""
    while not is_valid(c, workload) and c.num_warps < 32:
        c = Config(c.variant, c.block, c.rows, c.num_warps * 2)
    return c


def space(workload: Workload) -> list[Config]:
    """Single-pass tiles (rows per tile x warps) for rows that fit registers, online chunks x warps for
    rows past 1024: ~10-25 configs at attention and vocabulary widths."""
    rows, N = _dims(workload)
    width = triton.next_power_of_2(N)
    cands: list[Config] = []
    if width <= _SINGLE_PASS_MAX * 2:
        cands += [Config("row", width, 1, _warps_for(width, ept)) for ept in (4, 8, 16, 32)]
        r = 2
        while r * width <= 16384 and r <= triton.next_power_of_2(max(rows, 1)):
            cands += [Config("rows", width, r, _warps_for(r * width, ept)) for ept in (8, 16, 32)]
            r *= 2
    if N > 1024:
        for block in (1024, 2048, 4096, 8192, 16384):
            cands += [Config("online", block, 1, w) for w in (4, 8, 16) if block // (32 * w) >= 2]
    seen: set[Config] = set()
    out = []
    for c in cands:
        c = _fit(c, workload)
        if c not in seen and is_valid(c, workload):
            seen.add(c)
            out.append(c)
    return out


def heuristic(workload: Workload) -> Config:
    """Untuned default: layernorm's choice for rows that fit registers (a whole row per program,
    ~16 values a thread, for rows of 1024+; several short rows per program keeping >= 264 tiles), and
    4096-wide online chunks at 8 warps past 32K columns. Not yet measured on the H100: bench/
    family_softmax.py tunes it there."""
    rows, N = _dims(workload)
    width = triton.next_power_of_2(N)
    if width > _SINGLE_PASS_MAX:
        return Config("online", 4096, 1, 8)
    if width >= 1024:
        return _fit(Config("row", width, 1, _warps_for(width, 16)), workload)
    r = min(4096 // width, max(1, triton.next_power_of_2(rows // 264 + 1) // 2))
    if workload.device != "cuda":  # the interpreter pays per program, not per SM: fewest programs
        r = min(4096 // width, triton.next_power_of_2(max(rows, 1)))
    return _fit(Config("rows" if r > 1 else "row", width, r, _warps_for(r * width, 8)), workload)


def bwd_space(workload: Workload) -> list[Config]:
    """The backward's search space: the forward's configs (the same three kernel shapes, each
    holding y and dy where the forward holds x), plus for single-pass tiles the next warp count up
    (two tiles live per thread instead of one: fewer values a thread at the same tile)."""
    out = space(workload)
    seen = set(out)
    for c in list(out):
        if c.variant != "online" and c.num_warps < 32:
            more = Config(c.variant, c.block, c.rows, c.num_warps * 2)
            if more not in seen and is_valid(more, workload):
                seen.add(more)
                out.append(more)
    return out


def bwd_heuristic(workload: Workload) -> Config:
    """Untuned backward default. Rows of 1024+: the forward's row-per-program tile (at 4096 wide its
    fwd+bwd matched Liger's on the H100, 1761.63 against 1770.14 us). Short rows: tiles of 2048
    elements rather than 4096, since y and dy are both held. Past 32K columns: online chunks.
    Not yet swept on the H100: tools/ln_sweep.py times `bwd_space`."""
    rows, N = _dims(workload)
    width = triton.next_power_of_2(N)
    if width >= 1024 or width > _SINGLE_PASS_MAX:
        return heuristic(workload)
    r = min(max(1, 2048 // width), max(1, triton.next_power_of_2(rows // 264 + 1) // 2))
    if workload.device != "cuda":  # the interpreter pays per program, not per SM: fewest programs
        r = min(max(1, 2048 // width), triton.next_power_of_2(max(rows, 1)))
    return _fit(Config("rows" if r > 1 else "row", width, r, _warps_for(r * width, 8)), workload)


def backward_workload(workload: Workload) -> Workload:
    """The workload of this call's backward (family softmax_bwd, kernels/softmax_bwd.py): the same
    (rows, N), x's dtype (dx's) and the output's (y's and dy's), which are what the backward kernel
    depends on."""
    return dataclasses.replace(workload, family=f"{FAMILY}_bwd")


def _workload(rows: int, N: int, dtype: torch.dtype, out_dtype: torch.dtype, device: str) -> Workload:
    return Workload(family=FAMILY, shapes=((rows, N),), dtypes=(dtype_name(dtype), dtype_name(out_dtype)),
                    params=(("out_dtype", dtype_name(out_dtype)),), device=device)


def workload_for(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> Workload:
    """The Workload record of one softmax call (x seen as (rows, N))."""
    # hint(): under dynamic shapes these may be SymInts; a Workload holds plain numbers (no guard).
    N = hint(x.shape[-1]) if x.dim() else 1
    rows = 1
    for d in x.shape[:-1]:
        rows *= hint(d)
    return _workload(rows, N, x.dtype, out_dtype or x.dtype, x.device.type)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `softmax` / `softmax_ref` on this workload.

    Rows get different scales and offsets (attention scores are not unit normal, and a kernel that
    skips the max subtraction overflows on the offsets), and every third row is masked past a random
    column with the dtype's most negative value, as Hugging Face's additive causal mask does."""
    n_rows, N = _dims(workload)
    n_rows = n_rows if rows is None else rows
    device = device or workload.device
    dtype = parse_dtype(workload.dtypes[0])
    g, where = input_generator(n_rows * N, device, seed)
    x = torch.randn(n_rows, N, generator=g, device=where) * (0.5 + 4 * torch.rand(n_rows, 1, generator=g, device=where))
    x = x + 60 * torch.randn(n_rows, 1, generator=g, device=where)
    keep = torch.randint(1, N + 1, (n_rows, 1), generator=g, device=where)
    masked = (torch.arange(N, device=where)[None, :] >= keep) & (torch.arange(n_rows, device=where)[:, None] % 3 == 0)
    x = x.to(dtype).masked_fill(masked, torch.finfo(dtype).min)
    return (x.to(device),), {"out_dtype": parse_dtype(workload.param("out_dtype", workload.dtypes[0]))}


def edge_inputs(workload: Workload, *, seed: int, rows: int | None = None, device: str | torch.device | None = None
                ) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Rows the verifier adds to its random ones (tune/verify.py; kernels/edges.py). A fully masked
    row is NaN in the reference, as in eager (torch.softmax of all -inf): the kernel must give NaN
    there too, not 0 or 1/N, or a model would change what it computes."""
    args, kwargs = make_inputs(workload, seed=seed, rows=_edges.EDGE_DRAW_ROWS, device=device)
    big = min(1e4, torch.finfo(args[0].dtype).max / 8)
    return _edges.edge_rows(args, kwargs, {
        "fully masked row": lambda r: torch.full_like(r, -float("inf")),
        "row at the dtype's minimum": lambda r: torch.full_like(r, torch.finfo(args[0].dtype).min),  # 1/N each
        "one unmasked element": lambda r: torch.where(torch.arange(r.numel(), device=r.device) == 0, r,
                                                      -float("inf")),
        "large magnitudes": lambda r: r * (big / r.abs().max()),  # exp overflows without the max; a clamp
        "constant row": lambda r: torch.full_like(r, 3.0),  # 1/N each: a sum over N - 1 or N + 1 elements
    })


def norm_error_bound(workload: Workload) -> float:
    """The verifier's norm-relative error bound (tune/verify.py), from what the kernels reach on the
    interpreter (the measurement: the comment on _NORM_COMPUTE_ULPS)."""
    return _edges.norm_bound(parse_dtype(workload.param("out_dtype", workload.dtypes[0])),
                             compute_ulps=_NORM_COMPUTE_ULPS, round_ulps=_NORM_ROUND_ULPS)


# Norm-relative error bound of the verifier, in ulps (kernels/edges.py norm_bound). Measured on the
# interpreter (2026-11-27), heuristic + 6 configs each of 11 x 80 (bf16, fp32 -> bf16, fp16, fp32)
# and 11 x 2100 bf16, with the edge rows: 0 for bf16 outputs (the stores round to nearest, cast_rne;
# with the interpreter's truncating cast they were 3.7e-3 off), 9.9e-7 for fp16 (0.001 ulp) and
# 8.6e-8 for fp32 (0.7 fp32 ulps). Bounds: bf16 3.9e-4, fp16 5.0e-5, fp32 9.6e-7: 10x over fp32's,
# and a rounding flip in ~1 element of 400 for half outputs, where a sum one element short at
# N = 80 gives 2.6e-3 and a bf16 accumulator 7e-3.
_NORM_COMPUTE_ULPS, _NORM_ROUND_ULPS = 8, 0.05
