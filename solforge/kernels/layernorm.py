"""LayerNorm family: y = (x - mean) * rstd [* weight] [+ bias] over the last dim, rstd = 1/sqrt(var + eps).

In order: reference, Triton kernels, launcher, backward (kernel, launcher), custom ops, config triad
(+ workload_for, make_inputs). Every kernel loads the native dtype, computes in fp32 and casts on
store (the interpreter cannot do bf16 arithmetic; it is what a memory-bound kernel should do).

The kernels take an optional residual (HAS_RES): s = x + residual is rounded to x's dtype (as the
model's own add), stored, and normalized. The `add_layernorm` family (kernels/add_layernorm.py) is
that form with its own reference, workload and op; the kernels, config and backward live here.

Variants (both read x once and write y once; the row is held in registers, so the variance is the
exact two-pass one, sum((x - mean)^2), with no E[x^2] - mean^2 cancellation):
  row      one row per program.
  rows     a [ROWS, BLOCK_H] tile per program: amortizes the weight/bias loads and the per-program
           fixed cost over several short rows (GPT-2 small: H = 768).
Rows longer than the register budget (64K elements; 32K with a residual) are refused: `supported`
says so and the matcher leaves them to eager.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from solforge.kernels import config_text
from solforge.kernels.rmsnorm_bwd import BwdConfig
from solforge.kernels.rmsnorm_bwd import heuristic as bwd_heuristic
from solforge.numerics import dtype_name, input_generator, parse_dtype
from solforge.records import Workload

FAMILY = "layernorm"

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Reference


def layernorm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The function every kernel must compute, in fp32 (fp64 for fp32/fp64 inputs), cast once."""
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    xf = x.to(acc)
    mean = xf.mean(dim=-1, keepdim=True)
    d = xf - mean
    y = d * torch.rsqrt((d * d).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(out_dtype or x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _round_bf16(v):
    """fp32 -> nearest bf16 (ties to even), still as fp32. Only for Triton's interpreter, whose bf16
    cast truncates: a sum one bf16 ulp off (0.03 at |s| ~ 6) moves a LayerNorm output by that much
    times rstd, past bf16 tolerance wherever the row mean is large. The GPU's cast rounds already."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _layernorm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, s_ptr, y_ptr, n_rows, H, stride_x, stride_r, stride_s,
                      stride_y, eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr,
                      HAS_RES: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      EVICT: tl.constexpr, INTERP: tl.constexpr):
    """Variants `row` (ROWS == 1) and `rows`: one [ROWS, BLOCK_H] tile per program."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)[None, :]
    cm = cols < H
    # A row-only mask is constant along the row, so loads stay 16-byte vectors when H == BLOCK_H.
    m = (rows < n_rows)[:, None]
    if not EVEN_H:
        m = m & cm
    # int64 row offsets: rows * stride overflows int32 past 2^31 elements.
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols, mask=m, other=0.0, eviction_policy=EVICT)
    if HAS_RES:
        r = tl.load(r_ptr + r64 * stride_r + cols, mask=m, other=0.0, eviction_policy=EVICT)
        s = x.to(tl.float32) + r.to(tl.float32)
        if INTERP and s_ptr.dtype.element_ty == tl.bfloat16:
            s = _round_bf16(s)
        s = s.to(s_ptr.dtype.element_ty)  # rounded as the model's own add rounds
        tl.store(s_ptr + r64 * stride_s + cols, s, mask=m)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / H
    d = xf - mean[:, None]
    if not EVEN_H:  # masked lanes hold -mean now; they must not count in the variance
        d = tl.where(cm, d, 0.0)
    rstd = tl.rsqrt(tl.sum(d * d, axis=1) / H + eps)
    y = d * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(y_ptr + r64 * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=m)


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import;
# only then can CPU tensors be launched.
_INTERPRETED = type(_layernorm_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Launcher


def _bad(msg: str, family: str = FAMILY) -> ValueError:
    return ValueError(f"solforge {family}: {msg}")


def _rows_view(t: torch.Tensor, H: int) -> torch.Tensor:
    """(rows, H) with a unit column stride; reshape copies only when one row stride cannot do."""
    t2 = t.reshape(-1, H)
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
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    elif y.shape != x.shape or y.dtype != out_dtype or y.device != x.device:
        raise _bad(f"out must be {out_dtype} {tuple(x.shape)} on {x.device}", family)
    if residual is not None:
        if s is None:
            s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
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
    # absent tensors are never read (HAS_* constexprs): any pointer will do
    _layernorm_kernel[(grid,)](x2, r2, weight if weight is not None else x2, bias if bias is not None else x2,
                               s2, y2, n_rows, H, x2.stride(0), r2.stride(0), s2.stride(0), y2.stride(0), eps, **kw)
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
    return triton.cdiv(n_rows, c.rows), dict(
        ROWS=c.rows, BLOCK_H=c.block_h, EVEN_H=H == c.block_h, HAS_RES=has_res, HAS_WEIGHT=wdtype is not None,
        HAS_BIAS=bdtype is not None, EVICT="evict_first" if c.evict else "", INTERP=_INTERPRETED,
        num_warps=c.num_warps)


def layernorm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
              out_dtype: torch.dtype | None = None, config: Config | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm over the last dim of `x` with the Triton kernels (see `layernorm_ref` for the math).
    `config` picks the kernel (default: `heuristic`); `out` (shaped like x, out_dtype) is written in place."""
    return launch(x, None, weight, bias, eps, out_dtype, config, (None, out))[1]


# ----------------------------------------------------------------------------------------------
# Backward. With n = (x - mean) * rstd and y = n * w + b:
#     dn = dy * w
#     dx = rstd * (dn - mean(dn) - n * mean(dn * n))     (+ ds, the gradient reaching x elsewhere)
#     dw = sum over rows of dy * n;  db = sum over rows of dy
# mean and rstd are recomputed from x (one more pass over a row already in registers; nothing kept
# alive between forward and backward). Like rmsnorm_bwd.py: a few programs per SM walk row tiles,
# each keeps fp32 partial dw/db rows, and torch sums the (grid, H) partials.


def layernorm_bwd_ref(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      eps: float, *, ds: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dw, db) in fp32/fp64, by autograd through the forward reference."""
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    leaves = [t.detach().to(acc).requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
    y = layernorm_ref(leaves[0], leaves[1], leaves[2], eps)  # type: ignore[arg-type]
    live = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, live, dy.to(acc)))
    dx, dw, db = (next(grads) if t is not None else None for t in leaves)
    assert dx is not None
    return dx + (ds.to(acc) if ds is not None else 0), dw, db


@triton.jit
def _bwd_tile(tile, dy_ptr, x_ptr, w, ds_ptr, dx_ptr, n_rows, H, s_dy, s_x, s_ds, s_dx, eps, cols, cm,
              ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DS: tl.constexpr):
    """dx for one [ROWS, BLOCK_H] tile; returns its contributions to dw and db ([1, BLOCK_H], fp32).
    Rows past the end load zeros: n = 0 and dy = 0 there, so they add nothing."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None] & cm
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * s_x + cols, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r64 * s_dy + cols, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / H
    d = tl.where(cm, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(d * d, axis=1) / H + eps)[:, None]
    n = d * rstd
    dn = dy * w if HAS_WEIGHT else dy
    c1 = (tl.sum(dn * n, axis=1) / H)[:, None]
    c2 = (tl.sum(dn, axis=1) / H)[:, None]
    dx = rstd * (dn - c2 - n * c1)
    if HAS_DS:
        dx += tl.load(ds_ptr + r64 * s_ds + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(dx_ptr + r64 * s_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
    return tl.sum(dy * n, axis=0)[None, :], tl.sum(dy, axis=0)[None, :]


@triton.jit
def _layernorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, ds_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, H, s_dy, s_x, s_ds, s_dx,
                          eps, n_iter, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                          WANT_DW: tl.constexpr, WANT_DB: tl.constexpr, HAS_DS: tl.constexpr,
                          INTERP: tl.constexpr):
    """A grid-stride loop over row tiles; dw and db accumulate in registers, one partial row each per program."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)[None, :]
    cm = cols < H
    w = 1.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    dw = tl.zeros([1, BLOCK_H], dtype=tl.float32)
    db = tl.zeros([1, BLOCK_H], dtype=tl.float32)
    if INTERP:
        # Triton 3.6's interpreter cannot run a for loop with a runtime bound under numpy >= 2.4
        # (triton-lang/triton#9171, see kernels/rmsnorm.py); a while loop works there.
        i = 0
        while i < n_iter:
            pw, pb = _bwd_tile(pid + i * n_progs, dy_ptr, x_ptr, w, ds_ptr, dx_ptr, n_rows, H, s_dy, s_x, s_ds,
                               s_dx, eps, cols, cm, ROWS, HAS_WEIGHT, HAS_DS)
            dw += pw
            db += pb
            i += 1
    else:
        for i in range(0, n_iter):
            pw, pb = _bwd_tile(pid + i * n_progs, dy_ptr, x_ptr, w, ds_ptr, dx_ptr, n_rows, H, s_dy, s_x, s_ds,
                               s_dx, eps, cols, cm, ROWS, HAS_WEIGHT, HAS_DS)
            dw += pw
            db += pb
    if WANT_DW:
        tl.store(dw_ptr + pid * H + cols, dw, mask=cm)
    if WANT_DB:
        tl.store(db_ptr + pid * H + cols, db, mask=cm)


@functools.cache
def _sm_count(device: torch.device) -> int:
    # Interpreter: a small fake SM count so the grid-stride loop really strides in CPU tests.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def layernorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                  ds: torch.Tensor | None = None, bias_grad: bool = False, config: BwdConfig | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx in x.dtype, dw in fp32 or None without a weight, db in fp32 or None unless bias_grad);
    see `layernorm_bwd_ref`. The config is rmsnorm_bwd's (rows per tile, programs per SM, warps)."""
    if x.dtype not in _SUPPORTED or dy.shape != x.shape:
        raise _bad(f"backward: x {x.dtype} {tuple(x.shape)}, dy {tuple(dy.shape)}: same shapes, bf16/fp16/fp32")
    H = x.shape[-1]
    x2, dy2 = _rows_view(x, H), _rows_view(dy, H)
    ds2 = _rows_view(ds, H) if ds is not None else None
    n_rows = x2.shape[0]
    dx = torch.empty((n_rows, H), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        zero = torch.zeros(H, device=x.device)
        return dx.view(x.shape), (zero if weight is not None else None), (zero.clone() if bias_grad else None)
    c = config or bwd_heuristic(n_rows, H, x.device)
    n_tiles = triton.cdiv(n_rows, c.rows)
    grid = min(n_tiles, c.progs * _sm_count(x.device))
    dw = torch.empty((grid, H), dtype=torch.float32, device=x.device) if weight is not None else dx
    db = torch.empty((grid, H), dtype=torch.float32, device=x.device) if bias_grad else dx
    w = weight.contiguous() if weight is not None else dx
    _layernorm_bwd_kernel[(grid,)](
        dy2, x2, w, ds2 if ds2 is not None else dx, dx, dw, db, n_rows, H, dy2.stride(0), x2.stride(0),
        ds2.stride(0) if ds2 is not None else 0, dx.stride(0), eps, triton.cdiv(n_tiles, grid), ROWS=c.rows,
        BLOCK_H=triton.next_power_of_2(H), HAS_WEIGHT=weight is not None, WANT_DW=weight is not None,
        WANT_DB=bias_grad, HAS_DS=ds2 is not None, INTERP=_INTERPRETED, num_warps=c.num_warps)
    return (dx.view(x.shape), dw.sum(0) if weight is not None else None, db.sum(0) if bias_grad else None)


# ----------------------------------------------------------------------------------------------
# Custom ops: what the graph rewrite calls. The config travels as its encoded string ("" for the
# heuristic). Registered with the Library API, not @custom_op: 3.6 us a call against 9.3 us
# (kernels/rmsnorm.py has the measurement). The backward is its own op so that a traced backward
# (torch.compile, export) sees one call with a fake implementation; dw/db are fp32, empty when absent.

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("layernorm(Tensor x, Tensor? weight, Tensor? bias, float eps, ScalarType out_dtype, str config) -> Tensor")
_LIB.define("layernorm_bwd(Tensor dy, Tensor x, Tensor? weight, float eps, Tensor? ds, bool bias_grad, str config) "
            "-> (Tensor, Tensor, Tensor)")


def _op(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
        out_dtype: torch.dtype, config: str) -> torch.Tensor:
    return layernorm(x, weight, bias, eps, out_dtype=out_dtype, config=Config.decode(config) if config else None)


def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, ds: torch.Tensor | None,
            bias_grad: bool, config: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = layernorm_bwd(dy, x, weight, eps, ds=ds, bias_grad=bias_grad,
                               config=BwdConfig.decode(config) if config else None)
    empty = x.new_empty(0, dtype=torch.float32)
    return dx, (dw if dw is not None else empty), (db if db is not None else empty.clone())


_LIB.impl("layernorm", _op, "CompositeExplicitAutograd")
_LIB.impl("layernorm_bwd", _bwd_op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::layernorm")
def _fake(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
          out_dtype: torch.dtype, config: str) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.register_fake("solforge::layernorm_bwd")
def _bwd_fake(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, ds: torch.Tensor | None,
              bias_grad: bool, config: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    return (x.new_empty(x.shape), x.new_empty(H if weight is not None else 0, dtype=torch.float32),
            x.new_empty(H if bias_grad else 0, dtype=torch.float32))


layernorm_op = torch.ops.solforge.layernorm.default
layernorm_bwd_op = torch.ops.solforge.layernorm_bwd.default


def param_grads(dw: torch.Tensor, db: torch.Tensor, weight: torch.Tensor | None, bias_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The fp32 dw/db of the backward op in the parameters' dtypes (None where absent)."""
    return (dw.to(weight.dtype) if weight is not None else None, db.to(bias_dtype) if bias_dtype else None)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, bias, eps, _out_dtype, _config = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None  # the bias itself is not needed


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    dx, dw, db = layernorm_bwd_op(dy, x, weight, ctx.eps, None, ctx.bias_dtype is not None, "")
    return (dx, *param_grads(dw, db, weight, ctx.bias_dtype), None, None, None)


torch.library.register_autograd("solforge::layernorm", _backward, setup_context=_setup)


# ----------------------------------------------------------------------------------------------
# Config triad

VARIANTS = ("row", "rows")
_WARPS = (1, 2, 4, 8, 16, 32)
# Register budget: fp32 values of a row tile a thread holds at once (rmsnorm.py's measured limit;
# past it the compiler spills and the kernel falls off the bandwidth roof). A residual doubles it.
_MAX_PER_THREAD = 64
_ABBREV = {"block_h": "bh", "rows": "r", "num_warps": "w", "evict": "e"}


@dataclass(frozen=True)
class Config:
    """One kernel choice: a [rows, block_h] tile per program (block_h: H rounded up to a power of two)."""

    variant: str = "row"
    block_h: int = 1024
    rows: int = 1
    num_warps: int = 4
    evict: int = 0  # 1: load x (and the residual) with evict_first

    def items(self) -> tuple[tuple[str, Any], ...]:
        return config_text.items(self)

    def encode(self) -> str:
        """Compact text, e.g. "rows:bh=1024:r=4:w=8"."""
        return config_text.encode(self, _ABBREV, always=("block_h", "num_warps"))

    @staticmethod
    def decode(text: str) -> Config:
        return _decode_config(text)


@functools.lru_cache(maxsize=4096)
def _decode_config(text: str) -> Config:
    return config_text.decode(Config, text, family=FAMILY, variants=VARIANTS, abbrev=_ABBREV)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _dims(workload: Workload) -> tuple[int, int]:
    rows = 1
    for d in workload.shapes[0][:-1]:
        rows *= d
    return rows, workload.shapes[0][-1]


def _live(workload: Workload) -> int:
    """Row tiles held in registers at once: x, and the residual in the fused form."""
    return 2 if workload.param("residual", False) else 1


def is_valid(config: Config, workload: Workload) -> bool:
    """Can this config compute this workload correctly without spilling registers?"""
    c = config
    _rows, H = _dims(workload)
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or c.evict not in (0, 1):
        return False
    if not (_pow2(c.block_h) and _pow2(c.rows)) or (c.variant == "row") != (c.rows == 1):
        return False
    if c.block_h != triton.next_power_of_2(H):  # one block covers the row, with the fewest masked lanes
        return False
    return _live(workload) * c.rows * c.block_h // (32 * c.num_warps) <= _MAX_PER_THREAD


def _warps_for(elems: int, per_thread: int) -> int:
    """Warps (a power of two, 1..32) that give each thread about `per_thread` elements."""
    return max(1, min(32, triton.next_power_of_2(elems // (32 * per_thread) + 1) // 2))


def space(workload: Workload) -> list[Config]:
    """Rows per tile x warps x eviction hint: ~10-25 configs at transformer widths."""
    rows, H = _dims(workload)
    width = triton.next_power_of_2(H)
    cands = [Config("row", width, 1, _warps_for(width, ept)) for ept in (4, 8, 16, 32)]
    cands.append(Config("row", width, 1, _warps_for(width, 16), evict=1))
    r = 2
    while r * width <= 16384 and r <= triton.next_power_of_2(max(rows, 1)):
        for ept in (8, 16, 32):
            cands.append(Config("rows", width, r, _warps_for(r * width, ept)))
        cands.append(Config("rows", width, r, _warps_for(r * width, 16), evict=1))
        r *= 2
    seen: set[Config] = set()
    out = []
    for c in cands:
        # a config over the register budget gets more warps rather than vanishing from the space
        while not is_valid(c, workload) and c.num_warps < 32:
            c = Config(c.variant, c.block_h, c.rows, c.num_warps * 2, c.evict)
        if c not in seen and is_valid(c, workload):
            seen.add(c)
            out.append(c)
    return out


def heuristic(workload: Workload) -> Config:
    """Untuned default: rmsnorm's measured choice (kernels/rmsnorm.py: a whole row per program with
    ~16 values per thread for rows of 1024+, several short rows per program keeping >= 264 tiles),
    which LayerNorm (one more reduction over registers, one more parameter row) is assumed to share
    until bench/families.py tunes it on the H100. Invalid only where no config fits (`supported`)."""
    rows, H = _dims(workload)
    width = triton.next_power_of_2(H)
    if width >= 1024:
        c = Config("row", width, 1, _warps_for(width, 16))
    else:
        r = min(4096 // width, max(1, triton.next_power_of_2(rows // 264 + 1) // 2))
        if workload.device != "cuda":  # the interpreter pays per program, not per SM: fewest programs
            r = min(4096 // width, triton.next_power_of_2(max(rows, 1)))
        c = Config("rows" if r > 1 else "row", width, r, _warps_for(r * width, 8))
    while not is_valid(c, workload) and c.num_warps < 32:
        c = Config(c.variant, c.block_h, c.rows, c.num_warps * 2, c.evict)
    return c


def supported(workload: Workload) -> bool:
    """Whether any config can run this workload (rows of up to 64K elements, 32K with a residual)."""
    return is_valid(heuristic(workload), workload)


def _workload(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
              out_dtype: torch.dtype | None, device: str, residual: bool) -> Workload:
    # int(): under dynamic shapes these may be SymInts; a Workload holds plain numbers.
    H = int(x.shape[-1]) if x.dim() else 1
    rows = 1
    for d in x.shape[:-1]:
        rows *= int(d)
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


def draw(workload: Workload, *, seed: int, rows: int | None, device: str | torch.device | None
         ) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
    """Fresh random inputs of either family: (x [, residual]), weight, bias, kwargs.

    Rows get different means and scales (x = a * randn + b per row), so a kernel that skips the
    centering or mixes up rows fails. Small inputs are drawn on the CPU from `seed` (the same
    numbers on any device), large ones on the device (numerics.input_generator)."""
    n_rows, H = _dims(workload)
    n_rows = n_rows if rows is None else rows
    device = device or workload.device
    n_x = _live(workload)
    g, where = input_generator(n_x * n_rows * H, device, seed)
    dtype = parse_dtype(workload.dtypes[0])
    xs = []
    for _ in range(n_x):
        t = torch.randn(n_rows, H, generator=g, device=where) * (0.5 + torch.rand(n_rows, 1, generator=g, device=where))
        xs.append((t + 2 * torch.randn(n_rows, 1, generator=g, device=where)).to(dtype).to(device))
    i = n_x
    params = []
    for name, scale, offset in (("weight", 0.1, 1.0), ("bias", 0.1, 0.0)):
        p = None
        if workload.param(name, False):
            p = (offset + scale * torch.randn(H, generator=g, device=where)).to(parse_dtype(workload.dtypes[i]))
            p = p.to(device)
            i += 1
        params.append(p)
    return xs, params[0], params[1], {"out_dtype": parse_dtype(workload.param("out_dtype", workload.dtypes[0]))}


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `layernorm` / `layernorm_ref` on this workload."""
    (x,), weight, bias, kwargs = draw(workload, seed=seed, rows=rows, device=device)
    return (x, weight, bias, float(workload.param("eps", 1e-5))), kwargs
