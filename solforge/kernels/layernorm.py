"""LayerNorm family: y = (x - mean) * rstd [* weight] [+ bias] over the last dim, rstd = 1/sqrt(var + eps).

In order: Triton kernels, launcher, backward (kernels/layernorm_bwd.py, re-exported), custom ops,
config triad (+ workload_for, make_inputs); the reference and the random inputs are in
kernels/layernorm_base.py, the tile helpers in kernels/rowtile.py (both re-exported). Every kernel
loads the native dtype, computes in fp32 and casts on store (the interpreter cannot do bf16
arithmetic; it is what a memory-bound kernel should do).

The kernels take an optional residual (HAS_RES): s = x + residual is rounded to x's dtype (as the
model's own add), stored, and normalized. The `add_layernorm` family (kernels/add_layernorm.py) is
that form with its own reference, workload and op; the kernels, config and backward live here.

Variants (both read x once and write y once; the row is held in registers, so the variance is the
exact two-pass one, sum((x - mean)^2), with no E[x^2] - mean^2 cancellation):
  row      one row per program.
  rows     a [ROWS, BLOCK_H] tile per program: amortizes the weight/bias loads and the per-program
           fixed cost over several short rows (GPT-2 small: H = 768).
Both can hold a row that is not a power of two as a power-of-two main block plus a tail (2560 =
2048 + 512, 768 = 512 + 256) instead of one block with masked lanes, as rmsnorm's kernels do.
  split    a row cut into chunks, one program a chunk, in two kernels (statistics, then the
           normalization: kernels/layernorm_split.py): for rows longer than the register budget
           (64K elements) or too few rows to fill the GPU. Reads x twice. Forward only and
           without a residual.
With a residual, rows longer than 32K elements are refused: `supported` says so and the matcher
leaves them to eager.
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
from solforge.kernels import layernorm_split as _split
from solforge.kernels.interp import round_bf16
from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch
from solforge.kernels.layernorm_base import FAMILY, _dims, _live, draw, layernorm_ref  # noqa: F401  (re-exported)
from solforge.kernels.rowtile import _ld, _load_weight, _st
from solforge.numerics import dtype_name, parse_dtype
from solforge.records import Workload
from solforge.runtime.shapes import hint

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Reference: layernorm_ref, in kernels/layernorm_base.py (the backward differentiates it too)


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _add_store(x, r, s_ptrs, m, cols, H, COL_MASK: tl.constexpr, INTERP: tl.constexpr):
    """s = x + r rounded to s's dtype (as the model's own add rounds), stored; returned as fp32."""
    s = x.to(tl.float32) + r.to(tl.float32)
    if INTERP and s_ptrs.dtype.element_ty == tl.bfloat16:
        s = round_bf16(s)
    s = s.to(s_ptrs.dtype.element_ty)
    _st(s_ptrs, s, m, cols, H, COL_MASK)
    return s.to(tl.float32)


@triton.jit
def _layernorm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, s_ptr, y_ptr, n_rows, H, stride_x, stride_r, stride_s,
                      stride_y, eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                      EVEN_H: tl.constexpr, HAS_RES: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, EVICT: tl.constexpr, INTERP: tl.constexpr):
    """Variants `row` (ROWS == 1) and `rows`: one tile of ROWS rows per program, each row held as a
    main block [0, BLOCK_H) and, when BLOCK_T > 0, a tail block [BLOCK_H, BLOCK_H + BLOCK_T).

    Column masks only where a block pokes past H (the main block with no tail and H below it, or
    the tail): a row-only mask is constant along the row, so loads stay 16-byte vectors."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None]
    r64 = rows.to(tl.int64)[:, None]  # rows * stride overflows int32 past 2^31 elements
    cols = tl.arange(0, BLOCK_H)[None, :]
    # x first (its HBM latency is the long pole), then the L2-resident weight and bias, which then
    # arrive during the reductions instead of after them (kernels/rmsnorm.py does the same).
    x = _ld(x_ptr + r64 * stride_x + cols, m, cols, H, BLOCK_T == 0 and not EVEN_H, EVICT)
    if BLOCK_T > 0:
        tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
        xt = _ld(x_ptr + r64 * stride_x + tcols, m, tcols, H, not EVEN_H, EVICT)
    if HAS_RES:
        r = _ld(r_ptr + r64 * stride_r + cols, m, cols, H, BLOCK_T == 0 and not EVEN_H, EVICT)
        if BLOCK_T > 0:
            rt = _ld(r_ptr + r64 * stride_r + tcols, m, tcols, H, not EVEN_H, EVICT)
    w, wt = _load_weight(w_ptr, H, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT)
    b, bt = _load_weight(b_ptr, H, BLOCK_H, BLOCK_T, EVEN_H, HAS_BIAS)
    if HAS_RES:
        xf = _add_store(x, r, s_ptr + r64 * stride_s + cols, m, cols, H, BLOCK_T == 0 and not EVEN_H, INTERP)
        if BLOCK_T > 0:
            xtf = _add_store(xt, rt, s_ptr + r64 * stride_s + tcols, m, tcols, H, not EVEN_H, INTERP)
    else:
        xf = x.to(tl.float32)
        if BLOCK_T > 0:
            xtf = xt.to(tl.float32)
    # Two-pass variance from registers: sum((x - mean)^2), no E[x^2] - mean^2 cancellation.
    tot = tl.sum(xf, axis=1)
    if BLOCK_T > 0:
        tot += tl.sum(xtf, axis=1)
    mean = (tot / H)[:, None]
    d = xf - mean
    if BLOCK_T == 0 and not EVEN_H:  # masked lanes hold -mean now; they must not count
        d = tl.where(cols < H, d, 0.0)
    ss = tl.sum(d * d, axis=1)
    if BLOCK_T > 0:
        dt = xtf - mean
        if not EVEN_H:
            dt = tl.where(tcols < H, dt, 0.0)
        ss += tl.sum(dt * dt, axis=1)
    rstd = tl.rsqrt(ss / H + eps)[:, None]
    y = d * rstd
    if HAS_WEIGHT:
        y = y * w
    if HAS_BIAS:
        y = y + b
    y_ptrs = y_ptr + r64 * stride_y
    _st(y_ptrs + cols, y, m, cols, H, BLOCK_T == 0 and not EVEN_H)
    if BLOCK_T > 0:
        yt = dt * rstd
        if HAS_WEIGHT:
            yt = yt * wt
        if HAS_BIAS:
            yt = yt + bt
        _st(y_ptrs + tcols, yt, m, tcols, H, not EVEN_H)


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import;
# only then can CPU tensors be launched.
_INTERPRETED = type(_layernorm_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Launcher


def _bad(msg: str, family: str = FAMILY) -> ValueError:
    return ValueError(f"solforge {family}: {msg}")


def _rows_view(t: torch.Tensor, H: int) -> torch.Tensor:
    """(rows, H) with a unit column stride; reshape copies only when one row stride cannot do."""
    t2 = t if t.dim() == 2 else t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 or H == 1 else t2.contiguous()


def _check_param(p: torch.Tensor | None, name: str, H: int, device: torch.device, family: str) -> torch.Tensor | None:
    if p is None:
        return None
    if p.dtype not in _SUPPORTED or p.shape != (H,) or p.device != device:
        raise _bad(f"{name} must be ({H},) bf16/fp16/fp32 on {device}; got {p.dtype} {tuple(p.shape)} on "
                   f"{p.device}", family)
    return p.contiguous()


def launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
           eps: float, out_dtype: torch.dtype | None, config: Config | None,
           out: tuple[torch.Tensor | None, torch.Tensor | None], family: str = FAMILY
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Check inputs, allocate what `out` lacks, launch; returns (s or None, y). Shared by both families."""
    out_dtype = out_dtype or x.dtype
    if x.dtype not in _SUPPORTED or out_dtype not in _SUPPORTED:
        raise _bad(f"dtypes {x.dtype} -> {out_dtype}: bf16, fp16 or fp32 only (use the _ref for others)", family)
    if x.dim() == 0:
        raise _bad("x needs a last dimension to normalize", family)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise _bad(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)} "
                   f"on {x.device}", family)
    H = x.shape[-1]
    weight = _check_param(weight, "weight", H, x.device, family)
    bias = _check_param(bias, "bias", H, x.device, family)
    if x.device.type != "cuda" and not _INTERPRETED:
        raise _bad(f"x is on {x.device}; the kernels need CUDA (or TRITON_INTERPRET=1 set before triton is "
                   "imported)", family)
    s, y = out
    if y is None:
        y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    elif y.shape != x.shape or y.dtype != out_dtype or y.device != x.device:
        raise _bad(f"out must be {out_dtype} {tuple(x.shape)} on {x.device}", family)
    if residual is not None:
        if s is None:
            s = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif s.shape != x.shape or s.dtype != x.dtype or s.device != x.device:
            raise _bad(f"the sum's out must be {x.dtype} {tuple(x.shape)} on {x.device}", family)
    if x.numel() == 0:
        return s, y
    x2 = _rows_view(x, H)
    r2 = _rows_view(residual, H) if residual is not None else x2
    try:
        y2 = y.view(-1, H)
        s2 = s.view(-1, H) if s is not None else y2
    except RuntimeError as e:
        raise _bad("out must be viewable as (rows, H); pass contiguous tensors", family) from e
    if (y2.stride(-1) != 1 or s2.stride(-1) != 1) and H > 1:
        raise _bad("out's last dim must be contiguous", family)
    n_rows = x2.shape[0]
    grid, kw = _launch_plan(n_rows, H, x.dtype, weight.dtype if weight is not None else None,
                            bias.dtype if bias is not None else None, out_dtype, float(eps), residual is not None,
                            config, x.device.type)
    if "CHUNK" in kw:  # the split variant: two kernels of their own
        _split.launch(x2, weight, bias, y2, eps, kw["CHUNK"], kw["num_warps"])
        return s, y
    # absent tensors are never read (HAS_* constexprs): any pointer will do
    _launch(_layernorm_kernel, (grid,),
            (x2, r2, weight if weight is not None else x2, bias if bias is not None else x2, s2, y2, n_rows, H,
             x2.stride(0), r2.stride(0), s2.stride(0), y2.stride(0), eps), kw)
    return s, y


@functools.lru_cache(maxsize=1024)
def _launch_plan(n_rows: int, H: int, dtype: torch.dtype, wdtype: torch.dtype | None, bdtype: torch.dtype | None,
                 out_dtype: torch.dtype, eps: float, has_res: bool, config: Config | None,
                 device: str) -> tuple[int, dict[str, Any]]:
    """Grid and kernel options for one shape and config: cached, so a call pays a lookup, not the
    Workload/heuristic/validity work (tens of microseconds of Python on the GPU hosts)."""
    meta = functools.partial(torch.empty, device="meta")
    wl = _workload(meta((n_rows, H), dtype=dtype), meta((H,), dtype=wdtype) if wdtype else None,
                   meta((H,), dtype=bdtype) if bdtype else None, eps, out_dtype, device, has_res)
    c = config or heuristic(wl)
    if not is_valid(c, wl):  # a bad config could silently skip columns: refuse it
        raise _bad(f"config {c.encode()} is not valid for {wl.key}", wl.family)
    if c.variant == "split":
        return 0, {"CHUNK": c.block_h, "num_warps": c.num_warps}
    return triton.cdiv(n_rows, c.rows), Meta(
        ROWS=c.rows, BLOCK_H=c.block_h, BLOCK_T=c.block_t, EVEN_H=H == c.block_h + c.block_t, HAS_RES=has_res,
        HAS_WEIGHT=wdtype is not None, HAS_BIAS=bdtype is not None, EVICT="evict_first" if c.evict else "",
        INTERP=_INTERPRETED, num_warps=c.num_warps)


def layernorm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
              out_dtype: torch.dtype | None = None, config: Config | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm over the last dim of `x` with the Triton kernels (see `layernorm_ref` for the math).
    `config` picks the kernel (default: `heuristic`); `out` (shaped like x, out_dtype) is written in place."""
    return launch(x, None, weight, bias, eps, out_dtype, config, (None, out))[1]


# ----------------------------------------------------------------------------------------------
# Backward: kernels/layernorm_bwd.py (kernel, launcher, its config space and the solforge::layernorm_bwd op)

from solforge.kernels.layernorm_bwd import (  # noqa: E402, F401  (re-exported; its op registered next to ours)
    BwdConfig,
    blocks,
    blocks_ok,
    bwd_heuristic,
    bwd_is_valid,
    bwd_space,
    layernorm_bwd,
    layernorm_bwd_call,
    layernorm_bwd_op,
    layernorm_bwd_ref,
)
from solforge.kernels.layernorm_bwd import workload_from as _bwd_workload  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Custom ops: what the graph rewrite calls. The config travels as its encoded string ("" for the
# heuristic). Registered with the Library API, not @custom_op: 3.6 us a call against 9.3 us
# (kernels/rmsnorm.py has the measurement). The backward is its own op so that a traced backward
# (torch.compile, export) sees one call with a fake implementation; dw/db are fp32, empty when absent.

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("layernorm(Tensor x, Tensor? weight, Tensor? bias, float eps, ScalarType out_dtype, str config) -> Tensor")


def _op(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
        out_dtype: torch.dtype, config: str) -> torch.Tensor:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return layernorm(x, weight, bias, eps, out_dtype=out_dtype, config=Config.decode(fwd) if fwd else None)


_LIB.impl("layernorm", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::layernorm")
def _fake(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
          out_dtype: torch.dtype, config: str) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=out_dtype)


layernorm_op = torch.ops.solforge.layernorm.default


def param_grads(dw: torch.Tensor, db: torch.Tensor, weight: torch.Tensor | None, bias_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The fp32 dw/db of the backward op in the parameters' dtypes (None where absent)."""
    return (dw.to(weight.dtype) if weight is not None else None, db.to(bias_dtype) if bias_dtype else None)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, bias, eps, _out_dtype, config = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None  # the bias itself is not needed
    ctx.bwd_config = config.partition("|")[2]  # tuned as family layernorm_bwd; "" = its heuristic


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    dx, dw, db = layernorm_bwd_call(dy, x, weight, ctx.eps, None, ctx.bias_dtype is not None, ctx.bwd_config)
    return (dx, *param_grads(dw, db, weight, ctx.bias_dtype), None, None, None)


torch.library.register_autograd("solforge::layernorm", _backward, setup_context=_setup)
direct.register(torch.ops.solforge.layernorm.default, _op, _setup, _backward)


def backward_workload(workload: Workload) -> Workload | None:
    """The backward's workload, of layernorm's and add_layernorm's calls alike: family layernorm_bwd
    (kernels/layernorm_bwd.py `workload_from`)."""
    return _bwd_workload(workload)


# ----------------------------------------------------------------------------------------------
# Config triad

VARIANTS = ("row", "rows", "split")
_WARPS = (1, 2, 4, 8, 16, 32)
# Register budget: fp32 values of a row tile a thread holds at once (rmsnorm.py's measured limit;
# past it the compiler spills and the kernel falls off the bandwidth roof). A residual doubles it.
_MAX_PER_THREAD = 64
_ABBREV = {"block_h": "bh", "block_t": "bt", "rows": "r", "num_warps": "w", "evict": "e"}


@dataclass(frozen=True)
class Config(config_text.Text):
    """One kernel choice: a [rows, block_h (+ block_t)] tile per program. block_t > 0 splits a row
    that is not a power of two into a power-of-two main block and tail (2560 = 2048 + 512) so that
    no lanes (registers, and a third of the threads' work at 2560 against 4096) go to masked columns.
    Variant `split`: block_h is the chunk of a row each program takes (rows 1, no tail)."""

    variant: str = "row"
    block_h: int = 1024
    block_t: int = 0
    rows: int = 1
    num_warps: int = 4
    evict: int = 0  # 1: load x (and the residual) with evict_first

    _family, _variants, _abbrev = FAMILY, VARIANTS, _ABBREV
    _always = ("block_h", "num_warps")  # text form, e.g. "rows:bh=512:bt=256:r=4:w=8"


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def is_valid(config: Config, workload: Workload) -> bool:
    """Can this config compute this workload correctly without spilling registers?"""
    c = config
    _rows, H = _dims(workload)
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or c.evict not in (0, 1):
        return False
    if c.variant == "split":
        return (_live(workload) == 1 and c.rows == 1 and c.block_t == 0 and c.evict == 0 and _pow2(c.block_h)
                and c.block_h >= 32 * c.num_warps and c.block_h // (32 * c.num_warps) <= _MAX_PER_THREAD
                and _split.n_chunks(H, c.block_h) <= _split.MAX_CHUNKS)
    if not _pow2(c.rows) or (c.variant == "row") != (c.rows == 1) or not blocks_ok(c.block_h, c.block_t, H):
        return False
    return _live(workload) * c.rows * (c.block_h + c.block_t) // (32 * c.num_warps) <= _MAX_PER_THREAD


def _warps_for(elems: int, per_thread: int) -> int:
    """Warps (a power of two, 1..32) that give each thread about `per_thread` elements."""
    return max(1, min(32, triton.next_power_of_2(elems // (32 * per_thread) + 1) // 2))


def _fit(c: Config, workload: Workload) -> Config:
    """More warps until the tile fits the register budget (or 32 warps)."""
    while not is_valid(c, workload) and c.num_warps < 32:
        c = dataclasses.replace(c, num_warps=c.num_warps * 2)
    return c


def space(workload: Workload) -> list[Config]:
    """Block split x rows per tile x warps x eviction hint: ~15-45 configs at transformer widths."""
    rows, H = _dims(workload)
    cands = []
    for bh, bt in blocks(H):
        width = bh + bt
        cands += [Config("row", bh, bt, 1, _warps_for(width, ept)) for ept in (4, 8, 16, 32)]
        cands.append(Config("row", bh, bt, 1, _warps_for(width, 16), evict=1))
        r = 2
        while r * width <= 16384 and r <= triton.next_power_of_2(max(rows, 1)):
            cands += [Config("rows", bh, bt, r, _warps_for(r * width, ept)) for ept in (8, 16, 32)]
            cands.append(Config("rows", bh, bt, r, _warps_for(r * width, 16), evict=1))
            r *= 2
    if H >= 16384 and not workload.param("residual", False):  # few long rows: chunks of a row
        cands += [Config("split", chunk, 0, 1, w) for chunk in (4096, 8192, 16384) if 2 * chunk <= H
                  for w in (4, 8, 16)]
    seen: set[Config] = set()
    out = []
    for c in cands:
        c = _fit(c, workload)  # a config over the register budget gets more warps rather than vanishing
        if c not in seen and is_valid(c, workload):
            seen.add(c)
            out.append(c)
    return out


def heuristic(workload: Workload) -> Config:
    """The fewest-lanes block split and a whole row per program for rows of 1024+, several short
    rows per program keeping >= 264 tiles (two per SM of an H100) below that. Values a thread for
    long rows: ~32 without a residual: swept on the H100 at 2560 (bench/results/2026-11-22-h100-
    ln-sweep.json), 2 warps (40 values) were best at 16384 rows (61.5 us, 2.73 TB/s, against 66.4
    with 4 warps) and within 2% of the best at 4096; with a residual (add_layernorm, two more
    tensors a row) ~16: 4 warps measured 118.1 us at 16384 x 2560, 1.7% from the best (8 warps, no
    split). Rows past the register budget (64K) without a residual: the split variant with what
    the tuner picked at KernelBench's 16 x 4M fp32 on an H200 (15 s budget; 215.4 us, against
    torch.compile's 322.5 us a call): 4K-value chunks, 4 warps. Invalid only where no config fits
    (`supported`)."""
    rows, H = _dims(workload)
    if H > 65536 and not workload.param("residual", False):
        return Config("split", 4096, 0, 1, 4)
    bh, bt = blocks(H)[0]
    width, pow2 = bh + bt, triton.next_power_of_2(H)
    if width >= 1024:
        c = Config("row", bh, bt, 1, _warps_for(width, 16 if workload.param("residual", False) else 32))
    else:
        r = min(4096 // pow2, max(1, triton.next_power_of_2(rows // 264 + 1) // 2))
        if workload.device != "cuda":  # the interpreter pays per program, not per SM: fewest programs
            r = min(4096 // pow2, triton.next_power_of_2(max(rows, 1)))
        c = Config("rows" if r > 1 else "row", bh, bt, r, _warps_for(r * width, 8))
    return _fit(c, workload)


def supported(workload: Workload) -> bool:
    """Whether any config can run this workload's forward (rows of up to 32K elements with a
    residual; without, rows of up to 4096 chunks of the split variant: 512M elements)."""
    return is_valid(heuristic(workload), workload)


def trainable(workload: Workload) -> bool:
    """Whether the backward kernels can take this workload's rows too (layernorm_bwd.py: a row in
    registers, up to 64K elements)."""
    rows, H = _dims(workload)
    return bwd_is_valid(bwd_heuristic(rows, H, workload.device, ds=bool(workload.param("residual", False))), rows, H)


def _workload(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
              out_dtype: torch.dtype | None, device: str, residual: bool) -> Workload:
    # hint(): under dynamic shapes these may be SymInts; a Workload holds plain numbers (no guard).
    H = hint(x.shape[-1]) if x.dim() else 1
    rows = 1
    for d in x.shape[:-1]:
        rows *= hint(d)
    out_dtype = out_dtype or x.dtype
    shapes: tuple[tuple[int, ...], ...] = ((rows, H),) * (2 if residual else 1)
    dtypes: tuple[str, ...] = (dtype_name(x.dtype),) * (2 if residual else 1)
    for p in (weight, bias):
        if p is not None:
            shapes += ((H,),)
            dtypes += (dtype_name(p.dtype),)
    dtypes += (dtype_name(out_dtype),)
    params = (("bias", bias is not None), ("eps", float(eps)), ("out_dtype", dtype_name(out_dtype)),
              ("weight", weight is not None))
    if residual:
        params += (("residual", True),)
    return Workload(family="add_layernorm" if residual else FAMILY, shapes=shapes, dtypes=dtypes,
                    params=params, device=device)


def workload_for(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                 out_dtype: torch.dtype | None = None) -> Workload:
    """The Workload record of one layernorm call (x seen as (rows, H))."""
    return _workload(x, weight, bias, eps, out_dtype, x.device.type, residual=False)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `layernorm` / `layernorm_ref` on this workload."""
    (x,), weight, bias, kwargs = draw(workload, seed=seed, rows=rows, device=device)
    return (x, weight, bias, float(workload.param("eps", 1e-5))), kwargs


def edge_inputs(workload: Workload, *, seed: int, rows: int | None = None, device: str | torch.device | None = None
                ) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Rows the verifier adds to its random ones (tune/verify.py; kernels/edges.py)."""
    args, kwargs = make_inputs(workload, seed=seed, rows=_edges.EDGE_DRAW_ROWS, device=device)
    return _edges.edge_rows(args, kwargs, {
        "large magnitudes": lambda r: r * 1000,  # a clamp; a half-precision sum overflows
        # variance 0: y = bias, NaN where eps is dropped. Zero, not another constant: its mean is exact
        # whatever the kernel's 1/H rounds to; a row of 3.0 put the real fp32 kernel on an H100
        # 3.5e-5 off (x - mean not 0, times 1/sqrt(eps)), past fp32's element tolerance (2026-11-27)
        "zero row": lambda r: torch.zeros_like(r),
        "large mean, unit spread": lambda r: 100 + (r - r.mean()),  # E[x^2] - E[x]^2 cancels in fp32
        "single spike": _edges.spike,  # normalized to ~sqrt(H): an output clamp
    })


def norm_error_bound(workload: Workload) -> float:
    """The verifier's norm-relative error bound (tune/verify.py), from what the kernels reach on the
    interpreter (the measurement: the comment on _NORM_COMPUTE_ULPS)."""
    return _edges.norm_bound(parse_dtype(workload.param("out_dtype", workload.dtypes[0])),
                             compute_ulps=_NORM_COMPUTE_ULPS, round_ulps=_NORM_ROUND_ULPS)


# Norm-relative error bound of the verifier, in ulps (kernels/edges.py norm_bound). Measured on the
# interpreter (2026-11-27), heuristic + 6 configs each of 13 x 96 with weight and bias (bf16, fp16,
# fp32), with the edge rows: 0 for bf16 and fp16 outputs, 2.1e-7 for fp32 (1.75 fp32 ulps; the
# edge row of mean 100 and unit spread is the worst). Bounds: bf16 3.9e-4, fp16 5.0e-5, fp32
# 9.6e-7 (4.6x over fp32's); an unbiased variance at H = 96 gives 5.8e-3. On an H100 (2026-11-27,
# bench/results/2026-11-27-h100-pytest-fixes-a.txt) the real fp32 kernel reached 2.74e-6 on that
# row (23 ulps: its sums in another order than the reference's), so fp32 gets 64 ulps, 7.6e-6.
_NORM_COMPUTE_ULPS, _NORM_ROUND_ULPS = 64, 0.05
