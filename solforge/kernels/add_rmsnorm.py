"""add_rmsnorm family: s = x + residual; y = rmsnorm(s) -> (s, y) in one pass.

A transformer block adds each sublayer's output to the residual stream and normalizes the sum for
the next sublayer; the sum is also the next residual. Eager runs an add (read 2, write 1) and a
norm (read 1, write 1); fused, the sum is read from registers: read 2, write 2, one launch.

The sum is rounded to x's dtype before the norm reads it, as the model's separate add does. The
kernels reuse rmsnorm's tile load/normalize/store pieces and its Config (variants row and rows);
the backward is rmsnorm's (kernels/rmsnorm_bwd.py) with the residual stream's gradient added.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton
import triton.language as tl

from solforge.kernels import direct
from solforge.kernels import rmsnorm as _rms
from solforge.kernels.interp import round_bf16
from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch
from solforge.kernels.rmsnorm import Config
from solforge.kernels.rmsnorm_bwd import rmsnorm_bwd_call, workload_from
from solforge.kernels.rowtile import _load_weight, _st, _tile_load, _tile_store
from solforge.kernels.torch_order import sum_meta
from solforge.numerics import Tolerance, input_generator
from solforge.records import Workload

FAMILY = "add_rmsnorm"
VARIANTS = ("row", "rows")


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                    out_dtype: torch.dtype | None = None, round_before_weight: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual  # in x's dtype, as the model adds
    return s, _rms.rmsnorm_ref(s, weight, eps, out_dtype=out_dtype, round_before_weight=round_before_weight)


@triton.jit
def _tile_put(v, vt, ptr, row0, n_rows, H, stride, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None]
    ptrs = ptr + rows.to(tl.int64)[:, None] * stride
    cols = tl.arange(0, BLOCK_H)[None, :]
    _st(ptrs + cols, v, m, cols, H, BLOCK_T == 0 and not EVEN_H)
    if BLOCK_T > 0:
        tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
        _st(ptrs + tcols, vt, m, tcols, H, not EVEN_H)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, n_rows, H, stride_x, stride_r, stride_s, stride_y,
                        eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                        EVEN_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr,
                        EVICT: tl.constexpr, INTERP: tl.constexpr, W: tl.constexpr = 0, K: tl.constexpr = 0):
    row0 = tl.program_id(0) * ROWS
    x, xt = _tile_load(x_ptr, row0, n_rows, H, stride_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    r, rt = _tile_load(r_ptr, row0, n_rows, H, stride_r, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    s = x.to(tl.float32) + r.to(tl.float32)
    if INTERP and s_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter's bf16 cast truncates
        s = round_bf16(s)
    s = s.to(s_ptr.dtype.element_ty)
    st = 0.0
    if BLOCK_T > 0:
        st = xt.to(tl.float32) + rt.to(tl.float32)
        if INTERP and s_ptr.dtype.element_ty == tl.bfloat16:
            st = round_bf16(st)
        st = st.to(s_ptr.dtype.element_ty)
    _tile_put(s, st, s_ptr, row0, n_rows, H, stride_s, ROWS, BLOCK_H, BLOCK_T, EVEN_H)
    w, wt = _load_weight(w_ptr, H, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT)
    _tile_store(s, st, w, wt, y_ptr, row0, n_rows, H, stride_y, eps, ROWS, BLOCK_H, BLOCK_T, EVEN_H,
                HAS_WEIGHT, ROUND, x_ptr, r_ptr, stride_x, stride_r, W, K, True)


def _rows_view(t: torch.Tensor, H: int) -> torch.Tensor:
    t2 = t if t.dim() == 2 else t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 or H == 1 else t2.contiguous()


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                out_dtype: torch.dtype | None = None, round_before_weight: bool = False,
                config: Config | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rmsnorm(x + residual)) with one kernel; `out` = (s, y) to write in place."""
    out_dtype = out_dtype or x.dtype
    if x.dtype not in _rms._SUPPORTED or out_dtype not in _rms._SUPPORTED:
        raise ValueError(f"solforge add_rmsnorm: dtypes {x.dtype} -> {out_dtype}: bf16, fp16 or fp32 only")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"solforge add_rmsnorm: residual {residual.dtype} {tuple(residual.shape)} must match "
                         f"x {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.dim() == 0:
        raise ValueError("solforge add_rmsnorm: x needs a last dimension to normalize")
    H = x.shape[-1]
    if weight is not None and (weight.shape != (H,) or weight.device != x.device):
        raise ValueError(f"solforge add_rmsnorm: weight must be ({H},) on {x.device}")
    if x.device.type != "cuda" and not _rms._INTERPRETED:
        raise ValueError(f"solforge add_rmsnorm: x is on {x.device}; the kernels need CUDA (or TRITON_INTERPRET=1)")
    if out is None:
        s = torch.empty_like(x, memory_format=torch.contiguous_format)
        y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    else:
        s, y = out
        if s.shape != x.shape or y.shape != x.shape or s.dtype != x.dtype or y.dtype != out_dtype:
            raise ValueError("solforge add_rmsnorm: out must be (s, y) shaped like x, dtypes x.dtype, out_dtype")
    if x.numel() == 0:
        return s, y
    x2, r2 = _rows_view(x, H), _rows_view(residual, H)
    s2, y2 = s.view(-1, H), y.view(-1, H)
    n_rows = x2.shape[0]
    grid, kw = _launch_plan(n_rows, H, x.dtype, weight.dtype if weight is not None else None, out_dtype,
                            float(eps), round_before_weight, config, x.device.type)
    w = weight.contiguous() if weight is not None else x2
    _launch(_add_rmsnorm_kernel, (grid,),
            (x2, r2, w, s2, y2, n_rows, H, x2.stride(0), r2.stride(0), s2.stride(0), y2.stride(0), eps), kw)
    return s, y


@functools.lru_cache(maxsize=1024)
def _launch_plan(n_rows: int, H: int, dtype: torch.dtype, wdtype: torch.dtype | None, out_dtype: torch.dtype,
                 eps: float, rbw: bool, config: Config | None, device: str) -> tuple[int, dict[str, Any]]:
    """Grid and kernel options for one shape and config: cached, so a call pays a lookup, not the
    Workload/heuristic/validity work (tens of microseconds of Python on the GPU hosts)."""
    x = torch.empty((n_rows, H), dtype=dtype, device="meta")
    w = torch.empty((H,), dtype=wdtype, device="meta") if wdtype is not None else None
    wl = dataclasses.replace(workload_for(x, x, w, eps, out_dtype, rbw), device=device)
    c = config or heuristic(wl)
    if not is_valid(c, wl):
        raise ValueError(f"solforge add_rmsnorm: config {c.encode()} is not valid for {wl.key}")
    return triton.cdiv(n_rows, c.rows), Meta(
        **sum_meta(n_rows, H),  # the statistic in torch's order (kernels/torch_order.py)
        ROWS=c.rows, BLOCK_H=c.block_h, BLOCK_T=c.block_t, EVEN_H=H == c.block_h + c.block_t,
        HAS_WEIGHT=wdtype is not None, ROUND=rbw, EVICT="evict_first" if c.evict else "", INTERP=_rms._INTERPRETED,
        num_warps=c.num_warps)


# ----------------------------------------------------------------------------------------------
# Config triad: rmsnorm's tile configs, with two input tiles live instead of one.


def _as_rmsnorm(workload: Workload) -> Workload:
    return Workload("rmsnorm", (workload.shapes[0],) + workload.shapes[2:], (workload.dtypes[0],)
                    + workload.dtypes[2:], workload.params, workload.device)


def is_valid(config: Config, workload: Workload) -> bool:
    c = config
    if c.variant not in VARIANTS or not _rms.is_valid(c, _as_rmsnorm(workload)):
        return False
    return 2 * c.rows * (c.block_h + c.block_t) // (32 * c.num_warps) <= _rms._MAX_PER_THREAD


def space(workload: Workload) -> list[Config]:
    return [c for c in _rms.space(_as_rmsnorm(workload)) if is_valid(c, workload)]


def heuristic(workload: Workload) -> Config:
    """rmsnorm's default with twice the warps when both tiles would not fit the register budget."""
    c = _rms.heuristic(_as_rmsnorm(workload))
    if c.variant not in VARIANTS:  # persist/loop: rows too long for one tile per program here
        c = Config("row", triton.next_power_of_2(workload.shapes[0][-1]), 0, 1, 32)
    while not is_valid(c, workload) and c.num_warps < 32:
        c = Config(c.variant, c.block_h, c.block_t, c.rows, c.num_warps * 2, evict=c.evict)
    return c


def supported(workload: Workload) -> bool:
    """Whether any config can run this workload (rows of up to 32K elements)."""
    return is_valid(heuristic(workload), workload)


def workload_for(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 out_dtype: torch.dtype | None = None, round_before_weight: bool = False) -> Workload:
    base = _rms.workload_for(x, weight, eps, out_dtype, round_before_weight)
    shapes = (base.shapes[0], base.shapes[0]) + base.shapes[1:]
    dtypes = (base.dtypes[0],) + base.dtypes
    return Workload(FAMILY, shapes, dtypes, base.params, base.device)


def output_tolerance(workload: Workload) -> Tolerance:
    return _rms.output_tolerance(_as_rmsnorm(workload))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x, weight, eps), kwargs = _rms.make_inputs(_as_rmsnorm(workload), seed=seed, rows=rows, device=device)
    g, where = input_generator(x.numel(), x.device, seed + 1)
    residual = torch.randn(x.shape, generator=g, device=where).to(x.dtype).to(x.device)
    return (x, residual, weight, eps), kwargs


# ----------------------------------------------------------------------------------------------
# Custom op and autograd (the residual stream's gradient joins the norm's in the backward kernel)

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("add_rmsnorm(Tensor x, Tensor residual, Tensor? weight, float eps, ScalarType out_dtype, "
            "bool round_before_weight, str config) -> (Tensor, Tensor)")


def _op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
        round_before_weight: bool, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return add_rmsnorm(x, residual, weight, eps, out_dtype=out_dtype, round_before_weight=round_before_weight,
                       config=Config.decode(fwd) if fwd else None)


_LIB.impl("add_rmsnorm", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::add_rmsnorm")
def _fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype,
          round_before_weight: bool, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=out_dtype)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    _x, _r, weight, eps, _out_dtype, rbw, config = inputs
    ctx.save_for_backward(output[0], weight)
    # the backward's config: the part after "|" (tuned as family rmsnorm_bwd with ds; "" = its heuristic)
    ctx.eps, ctx.rbw, ctx.bwd_config = eps, rbw, config.partition("|")[2]


def _backward(ctx: Any, ds: torch.Tensor | None, dy: torch.Tensor | None) -> tuple[Any, ...]:
    s, weight = ctx.saved_tensors
    dw = None
    if dy is None:
        dsum = ds if ds is not None else torch.zeros_like(s)
    else:
        dsum, dw32 = rmsnorm_bwd_call(dy, s, weight, ctx.eps, ctx.rbw, ds, ctx.bwd_config)
        dw = dw32.to(weight.dtype) if weight is not None else None
    return dsum, dsum, dw, None, None, None, None


torch.library.register_autograd("solforge::add_rmsnorm", _backward, setup_context=_setup)
direct.register(torch.ops.solforge.add_rmsnorm.default, _op, _setup, _backward)
add_rmsnorm_op = torch.ops.solforge.add_rmsnorm.default


def backward_workload(workload: Workload) -> Workload | None:
    """The backward's workload: family rmsnorm_bwd (kernels/rmsnorm_bwd.py) with `ds`, the residual
    stream's gradient, which the kernel adds to dx."""
    return workload_from(workload)
