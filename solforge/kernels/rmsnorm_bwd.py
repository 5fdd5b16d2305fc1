"""Backward of RMSNorm, shared by the `rmsnorm` and `add_rmsnorm` families.

With n = x * rstd (rstd = rsqrt(mean(x^2) + eps)) and y = n * w:
    dn = dy * w
    dx = rstd * (dn - n * mean(dn * n))      (+ ds, the gradient reaching x from its other users)
    dw = sum over rows of dy * n              (n rounded to x.dtype first with round_before_weight)
rstd is recomputed from x rather than saved: one more read of a row already being read, and no
extra tensor kept alive between forward and backward.

The row's two sums (of x^2 and of dn * x) are taken in one reduction (kernels/reduce.py sum2). One
launch writes dx and a per-program partial of dw (fp32); a second (reduce.sum_rows) adds the
partials up in order: 2.7 us at 16384 x 2560 on the H100, where torch's sum took 4.7.
The grid is a few programs per SM, each walking row tiles in a loop, so few partial rows exist.
Measured on the H100 (16384 x 2560 bf16, with the residual gradient): one tile per program cost
200 us against 635 us for 16 unrolled tiles per program (tools/bwd_sweep.py, 2026-11-22). Loading
the next tile before reducing this one (`stages` 2) took the best config from 156 to 133 us: a
program waits on HBM once per tile otherwise, and a few programs per SM cannot hide that.

This module is also the tunable family `rmsnorm_bwd` (the pattern of kernels/rope_bwd.py): one
family for the backward of both `rmsnorm` and `add_rmsnorm`, as it is one kernel and one op; the
workload says which (`ds`: add_rmsnorm's residual gradient). The forward ops' autograd backward
runs the `rmsnorm_bwd` op with the BWD part of their "FWD|BWD" config string (integrate/__init__.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from solforge.kernels import direct
from solforge.kernels import rmsnorm_base as _rms
from solforge.kernels.launch import Meta, pdl, sm_count
from solforge.kernels.launch import launch as _launch
from solforge.kernels.reduce import fold, sum2, sum_rows
from solforge.kernels.rowtile import _load_weight, _st, _tile_load
from solforge.numerics import Tolerance, input_generator, parse_dtype, tolerance
from solforge.records import Workload

FAMILY = "rmsnorm_bwd"

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def rmsnorm_bwd_ref(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                    round_before_weight: bool = False, ds: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, ...]:
    """(dx[, dw]) by autograd through the forward reference in fp32 (fp64 for fp32 inputs), as the
    launcher returns them: dx in x's dtype, dw (with a weight) in fp32."""
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    xf = x.detach().to(acc).requires_grad_(True)
    wf = weight.detach().to(acc).requires_grad_(True) if weight is not None else None
    with torch.enable_grad():
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if round_before_weight:  # rounding is a straight-through step for the gradient
            n = n + (n.detach().to(x.dtype).to(acc) - n.detach())
        y = n * wf if wf is not None else n
        grads = torch.autograd.grad(y, [xf] + ([wf] if wf is not None else []), dy.to(acc))
    dx = (grads[0] + (ds.to(acc) if ds is not None else 0)).to(x.dtype)
    return (dx,) if wf is None else (dx, grads[1].to(torch.float32))


@triton.jit
def _bwd_load(dy_ptr, x_ptr, ds_ptr, row0, n_rows, H, s_dy, s_x, s_ds, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr, HAS_DS: tl.constexpr, EVICT: tl.constexpr):
    """Rows [row0, row0 + ROWS) of x, dy (and ds) in their own dtypes, main block and tail."""
    x, xt = _tile_load(x_ptr, row0, n_rows, H, s_x, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    dy, dyt = _tile_load(dy_ptr, row0, n_rows, H, s_dy, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    ds = 0.0
    dst = 0.0
    if HAS_DS:
        ds, dst = _tile_load(ds_ptr, row0, n_rows, H, s_ds, ROWS, BLOCK_H, BLOCK_T, EVEN_H, EVICT)
    return x, xt, dy, dyt, ds, dst


@triton.jit
def _bwd_compute(x, xt, dy, dyt, ds, dst, w, wt, dx_ptr, row0, n_rows, H, s_dx, eps, ROWS: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                 ROUND: tl.constexpr, HAS_DS: tl.constexpr):
    """dx of one tile from `_bwd_load`, stored; returns the tile's dw contributions (main, tail),
    each [1, block] fp32 (0.0 where there is no weight or no tail)."""
    rows = row0 + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None]
    ptrs = dx_ptr + rows.to(tl.int64)[:, None] * s_dx
    cols = tl.arange(0, BLOCK_H)[None, :]
    xf = x.to(tl.float32)
    dyf = dy.to(tl.float32)
    dn = dyf * w if HAS_WEIGHT else dyf
    # mean(dn * n) = rstd * mean(dn * x): both sums of the row in one reduction. With a tail, the
    # main block's products are first folded onto the tail's width (BwdConfig.blocks makes the tail
    # one pass of the main block's layout, so the fold adds values a thread already holds), and one
    # reduction covers the row: one round of shared memory and barriers a tile, not two.
    if BLOCK_T > 0:
        xtf = xt.to(tl.float32)
        dytf = dyt.to(tl.float32)
        dnt = dytf * wt if HAS_WEIGHT else dytf
        ss, dot = sum2(fold(xf * xf, xtf * xtf, ROWS, BLOCK_H, BLOCK_T),
                       fold(dn * xf, dnt * xtf, ROWS, BLOCK_H, BLOCK_T), 1)
    else:
        ss, dot = sum2(xf * xf, dn * xf, 1)
    rstd1 = tl.rsqrt(ss / H + eps)
    rstd = rstd1[:, None]
    # dx = rstd * (dn - n * mean(dn * n)) = rstd * dn - k * x, k = rstd^3 * mean(dn * x): two
    # operations a value (n is formed only for dw)
    k = (dot * (rstd1 * rstd1 * rstd1) / H)[:, None]
    dx = rstd * dn - k * xf
    if HAS_DS:
        dx += ds.to(tl.float32)
    _st(ptrs + cols, dx, m, cols, H, BLOCK_T == 0 and not EVEN_H)
    dw = 0.0
    dwt = 0.0
    if HAS_WEIGHT:
        # Hugging Face rounds n to x's dtype before the weight multiply: the weight sees that value
        n = xf * rstd
        dw = tl.sum(dyf * (n.to(x.dtype).to(tl.float32) if ROUND else n), axis=0)[None, :]
    if BLOCK_T > 0:
        tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
        dxt = rstd * dnt - k * xtf
        if HAS_DS:
            dxt += dst.to(tl.float32)
        _st(ptrs + tcols, dxt, m, tcols, H, not EVEN_H)
        if HAS_WEIGHT:
            nt = xtf * rstd
            dwt = tl.sum(dytf * (nt.to(x.dtype).to(tl.float32) if ROUND else nt), axis=0)[None, :]
    return dw, dwt


@triton.jit
def _bwd_step(i, pid, n_progs, cur, dw, dwt, w, wt, dy_ptr, x_ptr, ds_ptr, dx_ptr, n_rows, H, s_dy, s_x, s_ds,
              s_dx, eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_H: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr, HAS_DS: tl.constexpr, STAGES: tl.constexpr,
              EVICT: tl.constexpr):
    """Tile i of this program. STAGES == 2: `cur` holds this tile, already loaded, and the next
    tile's loads are issued before this one's reductions, so a program keeps two tiles in flight."""
    row0 = (pid + i * n_progs) * ROWS
    x, xt, dy, dyt, ds, dst = cur
    if STAGES > 1:
        cur = _bwd_load(dy_ptr, x_ptr, ds_ptr, row0 + n_progs * ROWS, n_rows, H, s_dy, s_x, s_ds, ROWS, BLOCK_H,
                        BLOCK_T, EVEN_H, HAS_DS, EVICT)
    else:
        x, xt, dy, dyt, ds, dst = _bwd_load(dy_ptr, x_ptr, ds_ptr, row0, n_rows, H, s_dy, s_x, s_ds, ROWS, BLOCK_H,
                                            BLOCK_T, EVEN_H, HAS_DS, EVICT)
    a, at = _bwd_compute(x, xt, dy, dyt, ds, dst, w, wt, dx_ptr, row0, n_rows, H, s_dx, eps, ROWS, BLOCK_H,
                         BLOCK_T, EVEN_H, HAS_WEIGHT, ROUND, HAS_DS)
    if HAS_WEIGHT:
        dw += a
        if BLOCK_T > 0:
            dwt += at
    return cur, dw, dwt


@triton.jit
def _rmsnorm_bwd_kernel(dy_ptr, x_ptr, w_ptr, ds_ptr, dx_ptr, dw_ptr, n_rows, H, s_dy, s_x, s_ds, s_dx, eps,
                        n_iter, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                        TW: tl.constexpr, EVEN_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr,
                        HAS_DS: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr):
    """A grid-stride loop over row tiles; dw accumulates in registers, one partial row per program.
    TW: the tail accumulator's width (BLOCK_T, or 1 as a placeholder without a tail). PDL: the
    partial rows' sum (reduce.sum_rows, launched with programmatic dependent launch) may start
    once every program is past its loop; it waits for this kernel's writes itself."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    w, wt = _load_weight(w_ptr, H, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT)
    dw = tl.zeros([1, BLOCK_H], dtype=tl.float32)
    dwt = tl.zeros([1, TW], dtype=tl.float32)
    cur = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if STAGES > 1:
        cur = _bwd_load(dy_ptr, x_ptr, ds_ptr, pid * ROWS, n_rows, H, s_dy, s_x, s_ds, ROWS, BLOCK_H, BLOCK_T,
                        EVEN_H, HAS_DS, EVICT)
    for i in range(0, n_iter):
        cur, dw, dwt = _bwd_step(i, pid, n_progs, cur, dw, dwt, w, wt, dy_ptr, x_ptr, ds_ptr, dx_ptr, n_rows, H,
                                 s_dy, s_x, s_ds, s_dx, eps, ROWS, BLOCK_H, BLOCK_T, EVEN_H, HAS_WEIGHT, ROUND,
                                 HAS_DS, STAGES, EVICT)
    if PDL:
        gdc_launch_dependents()
    if HAS_WEIGHT:
        on = tl.full([1, 1], 1, tl.int1)
        cols = tl.arange(0, BLOCK_H)[None, :]
        _st(dw_ptr + pid * H + cols, dw, on, cols, H, BLOCK_T == 0 and not EVEN_H)
        if BLOCK_T > 0:
            tcols = BLOCK_H + tl.arange(0, BLOCK_T)[None, :]
            _st(dw_ptr + pid * H + tcols, dwt, on, tcols, H, not EVEN_H)


_INTERPRETED = type(_rmsnorm_bwd_kernel).__name__ == "InterpretedFunction"

_ABBREV = {"r": "rows", "p": "progs", "w": "num_warps", "t": "split", "s": "stages", "e": "evict"}


@dataclass(frozen=True)
class BwdConfig:
    """rows per tile, programs per SM, warps; `split`: a row that is no power of two is held as a
    power-of-two main block and a tail (2560 = 2048 + 512) rather than one 4096-lane block, 37% of
    it masked; `stages` 2: the next tile's loads are issued before this one is reduced; `evict`:
    x, dy and ds are loaded evict_first. The last three are written only when set, so the strings
    of the first configs ("bwd:r=2:p=2:w=4") still decode to the same kernel."""

    rows: int = 1
    progs: int = 4
    num_warps: int = 4
    split: int = 0
    stages: int = 1
    evict: int = 0

    variant: ClassVar[str] = "bwd"  # one kernel: the tuner's variant name, not a field

    def encode(self) -> str:
        s = f"bwd:r={self.rows}:p={self.progs}:w={self.num_warps}"
        for k in ("t", "s", "e"):
            v = getattr(self, _ABBREV[k])
            if v != (1 if k == "s" else 0):
                s += f":{k}={v}"
        return s

    @staticmethod
    def decode(text: str) -> BwdConfig:
        return _decode(text)

    def items(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    def blocks(self, H: int, vec: int = 8) -> tuple[int, int]:
        """(main block, tail block) for rows of H; `vec`: values of the dtype in a 16-byte load (8
        for bf16/fp16, 4 for fp32). The tail is at least one pass of the main block's layout (vec
        values x 32 lanes x warps: 1024 on 4 warps in bf16), not only the power of two past the
        main block: a narrower tail gets a layout of its own, and Triton converted the whole main
        tile to it through shared memory (SASS at 2560 = 2048 + 512 on 8 warps: 19 barriers a tile
        against 3), which is why the split never paid before. Where that tail would be as wide as
        the main block, there is no split."""
        pow2 = triton.next_power_of_2(H)
        if not self.split or pow2 == H or H < 64:
            return pow2, 0
        main = pow2 // 2
        tail = layout_tail(main, triton.next_power_of_2(H - main), self.num_warps, vec)
        return (main, tail) if tail else (pow2, 0)


def layout_tail(main: int, tail: int, num_warps: int, vec: int = 8) -> int:
    """A split row's tail widened to at least one pass of the main block's layout (`vec` values of
    the dtype a thread x 32 lanes x warps: BwdConfig.blocks says why), or 0 where that reaches the
    main block's width (no split then). Shared with layernorm_bwd's space and heuristic."""
    tail = max(tail, vec * 32 * num_warps)
    return tail if tail < main else 0


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> BwdConfig:
    head, *parts = text.split(":")
    try:
        assert head == "bwd"
        return BwdConfig(**{_ABBREV[k]: int(v) for k, v in (p.split("=") for p in parts)})
    except (AssertionError, KeyError, ValueError) as e:
        raise ValueError(f"bad rmsnorm backward config {text!r} (e.g. 'bwd:r=4:p=4:w=8')") from e


def bwd_heuristic(n_rows: int, H: int, device: torch.device | str, ds: bool = False) -> BwdConfig:
    """What the op runs with config "" (`heuristic` is this for a workload). The next tile loaded
    ahead (stages 2). On the H100 (bf16, 16384 x 2560, bench/results/2026-11-23-h100-session9.md):
    - without the residual gradient (`ds`), rows of up to 3072 that split (2560 = 2048 + a 1024
      tail on 4 warps, BwdConfig.blocks): two rows a tile, 2 programs per SM, 97.3 us with the
      weight-gradient sum launched early (reduce.sum_rows, programmatic dependent launch), against
      105.8 for the rule below; one row on 3 programs per SM measured 98.3, and 4096 rows 32.8 us
      against 33.0 (tools/bwd_tail_probe.py);
    - otherwise, rows of 1024+: 8K-value tiles on 16 warps, one program per SM, evict_first loads
      (tools/bwd_sweep.py, -rmsnorm-bwd-sweep-s6.json): with ds 133.7 us at 16384 x 2560 (best of
      that sweep 133.2), and 129.6 on 2026-11-23, where the split configs measured 131.4-148.6 (the
      fourth tensor's registers); 4096 rows 42.9 (best);
    - short rows: 1K-value tiles on 2 warps, 8 programs per SM: 524288 x 128 196.8 us (best)."""
    block = triton.next_power_of_2(H)
    if block >= 1024:
        split = BwdConfig(2, 2, 4, 1, 2, 0)
        bh, bt = split.blocks(H)
        if not ds and bt and bh + bt <= 3072:
            return split
        rows = max(1, 8192 // block)
        return BwdConfig(rows, 1, max(4, min(16, rows * block // 512)), 0, 2, 1)
    return BwdConfig(max(1, min(32, 1024 // block)), 8, 2, 0, 2, 0)


@functools.lru_cache(maxsize=4096)
def _plan(n_rows: int, H: int, device: torch.device, has_weight: bool, rbw: bool, has_ds: bool,
          config: BwdConfig | None, vec: int = 8) -> tuple[int, int, dict[str, Any]]:
    """Grid, loop trip count and constexprs of one shape and config: cached, so a call pays a
    lookup rather than the heuristic and the Config and kwargs building."""
    c = config or bwd_heuristic(n_rows, H, device, has_ds)
    n_tiles = triton.cdiv(n_rows, c.rows)
    grid = min(n_tiles, c.progs * sm_count(device))
    bh, bt = c.blocks(H, vec)
    meta = Meta(ROWS=c.rows, BLOCK_H=bh, BLOCK_T=bt, TW=max(bt, 1), EVEN_H=(bh + bt == H), HAS_WEIGHT=has_weight,
                ROUND=rbw, HAS_DS=has_ds, STAGES=c.stages, EVICT="evict_first" if c.evict else "",
                PDL=has_weight and pdl(device), num_warps=c.num_warps)
    return grid, triton.cdiv(n_tiles, grid), meta


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                round_before_weight: bool = False, ds: torch.Tensor | None = None, config: BwdConfig | None = None,
                out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """(dx in x.dtype[, dw in fp32 with a weight]) with the Triton kernel; see `rmsnorm_bwd_ref`.
    `config` defaults to `bwd_heuristic`; `out`: tensors like those (dx contiguous), written in place."""
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
    has_w = weight is not None
    if out is None:
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    else:
        if len(out) != 1 + has_w or out[0].shape != x.shape or out[0].dtype != x.dtype \
                or not out[0].is_contiguous() or (has_w and (out[1].shape != (H,) or out[1].dtype != torch.float32)):
            raise ValueError("solforge rmsnorm_bwd: out must be (dx,) or, with a weight, (dx, dw): dx contiguous "
                             "like x, dw fp32 of the weight's shape")
        dx = out[0].view(n_rows, H)
    if n_rows == 0:
        if not has_w:
            return (dx.view(x.shape),)
        return dx.view(x.shape), (out[1].zero_() if out is not None else torch.zeros(H, device=x.device))
    grid, n_iter, meta = _plan(n_rows, H, x.device, has_w, round_before_weight, ds2 is not None, config,
                               16 // x.element_size())
    dw = torch.empty((grid, H), dtype=torch.float32, device=x.device) if has_w else dx
    w = weight.contiguous() if has_w else dx  # type: ignore[union-attr]
    _launch(_rmsnorm_bwd_kernel, (grid,),
            (dy2, x2, w, ds2 if ds2 is not None else dx, dx, dw, n_rows, H, dy2.stride(0), x2.stride(0),
             ds2.stride(0) if ds2 is not None else 0, dx.stride(0), eps, n_iter), meta)
    if not has_w:
        return (dx.view(x.shape),)
    return dx.view(x.shape), *sum_rows(dw, (0, grid), (torch.empty(H, dtype=torch.float32, device=x.device)
                                                       if out is None else out[1],))


# The op the autograd formulas call, so that a traced backward (torch.compile, export) sees one
# call with a fake implementation rather than Python. dw is fp32, empty without a weight.
_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("rmsnorm_bwd(Tensor dy, Tensor x, Tensor? weight, float eps, bool round_before_weight, "
            "Tensor? ds, str config) -> (Tensor, Tensor)")


def _op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, round_before_weight: bool,
        ds: torch.Tensor | None, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    res = rmsnorm_bwd(dy, x, weight, eps, round_before_weight=round_before_weight, ds=ds,
                      config=BwdConfig.decode(config) if config else None)
    return res[0], (res[1] if weight is not None else x.new_empty(0, dtype=torch.float32))


_LIB.impl("rmsnorm_bwd", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::rmsnorm_bwd")
def _fake(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, round_before_weight: bool,
          ds: torch.Tensor | None, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1] if weight is not None else 0
    return x.new_empty(x.shape), x.new_empty(n, dtype=torch.float32)


rmsnorm_bwd_op = torch.ops.solforge.rmsnorm_bwd.default
rmsnorm_bwd_call = direct.plain(rmsnorm_bwd_op, _op)  # what the backward formulas call


# ----------------------------------------------------------------------------------------------
# The tunable family rmsnorm_bwd: config triad, workload and inputs (tune/__init__.py, tune/verify.py)

Config = BwdConfig
_WARPS = (1, 2, 4, 8, 16, 32)
# The register budget: values of one row tile a thread holds, times the tiles in flight (stages),
# at most 96; tiles of at most 16K elements. tools/bwd_sweep.py's sweeps set 64; 2026-11-23's best
# config at 2560 (two rows of 2048 + 1024 on 4 warps, two stages: 96) compiled to 255 registers
# with no spills.
_MAX_PER_THREAD = 96
_MAX_TILE = 16384


def _dims(workload: Workload) -> tuple[int, int]:
    return workload.shapes[0][0], workload.shapes[0][-1]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _vec(workload: Workload) -> int:
    """Values of the workload's dtype in a 16-byte load (BwdConfig.blocks)."""
    return 16 // parse_dtype(workload.dtypes[0]).itemsize


def is_valid(config: BwdConfig, workload: Workload) -> bool:
    """Known knob values, and the tile within the register budget (tools/bwd_sweep.py's filter). A
    block split is only valid where it changes the blocks (H not a power of two, 64+, and a tail
    narrower than the main block)."""
    c = config
    _n, H = _dims(workload)
    if not (_pow2(c.rows) and c.progs >= 1 and c.num_warps in _WARPS and c.split in (0, 1) and c.stages in (1, 2)
            and c.evict in (0, 1)):
        return False
    blocks = c.blocks(H, _vec(workload))
    if c.split and blocks[1] == 0:
        return False
    tile = c.rows * sum(blocks)
    return tile <= _MAX_TILE and tile // (32 * c.num_warps) * c.stages <= _MAX_PER_THREAD


def heuristic(workload: Workload) -> BwdConfig:
    """What the op runs with config "": `bwd_heuristic` of the workload's shape."""
    n_rows, H = _dims(workload)
    return bwd_heuristic(n_rows, H, workload.device, bool(workload.param("ds", False)))


def space(workload: Workload) -> list[BwdConfig]:
    """The heuristic, then block split x warps x rows per tile (up to 8 for rows of 1024+, 32 below;
    no more than the workload has; 4+ values of a tile a thread) x stages x programs per SM
    (1, 2, 3, 4, 8) x evict_first, within the register budget: 230 configs at H = 2560 in bf16."""
    n_rows, H = _dims(workload)
    vec = _vec(workload)
    out = [heuristic(workload)]
    for split in (0, 1):
        for w in (2, 4, 8, 16):
            width = sum(BwdConfig(split=split, num_warps=w).blocks(H, vec))
            r = 1
            while r * width <= _MAX_TILE and r <= (32 if width < 1024 else 8) and r <= triton.next_power_of_2(n_rows):
                if r * width // (32 * w) >= 4:
                    out += [BwdConfig(r, p, w, split, st, e) for st in (1, 2) for p in (1, 2, 3, 4, 8) for e in (0, 1)]
                r *= 2
    return [c for c in dict.fromkeys(out) if is_valid(c, workload)]  # unique, in order


def workload_from(forward: Workload) -> Workload | None:
    """The backward's workload of an `rmsnorm` or `add_rmsnorm` call: rmsnorm's shapes, dtypes
    (the last, out_dtype, is dy's) and options, and `ds` (add_rmsnorm: the residual stream's
    gradient joins dx). None where no config fits the register budget (rows past 16K elements):
    nothing to tune, the op runs `bwd_heuristic` there."""
    if forward.family == "add_rmsnorm":  # (x, residual[, weight]) -> rmsnorm's (x[, weight])
        shapes, dtypes, ds = (forward.shapes[0],) + forward.shapes[2:], (forward.dtypes[0],) + forward.dtypes[2:], True
    else:
        shapes, dtypes, ds = forward.shapes, forward.dtypes, False
    # `inner` (rows that are columns, rmsnorm_cols.py) stays out: the backward reads copies of x and
    # dy in the rows layout (rmsnorm_bwd reshapes them), so it is the plain (rows, H) problem
    params = tuple(sorted({**{k: v for k, v in forward.params if k != "inner"}, "ds": ds}.items()))
    wl = Workload(FAMILY, shapes, dtypes, params, forward.device)
    return wl if is_valid(heuristic(wl), wl) else None


def sum_tolerance(rows: int) -> Tolerance:
    """For a parameter gradient in fp32 summed over `rows` from the same inputs the reference reads
    (layernorm_bwd's dw and db too): only fp32 rounding and the summation order differ, ~1e-7
    relative per term, and the errors' random signs grow like sqrt(rows). rtol 1e-3 and atol
    1e-4 * sqrt(rows) leave ~10x room over that estimate at 16384 rows (sums of ~128) and still
    fail a gradient 1% off."""
    return Tolerance(1e-4 * math.sqrt(max(rows, 1)), 1e-3)


def output_tolerance(workload: Workload) -> tuple[Tolerance, ...]:
    """dx: x's dtype's entry. dw: `sum_tolerance`, except with round_before_weight in a half dtype:
    n is rounded to x's dtype before the product, from fp32 values that differ in their last bits in
    kernel and reference, so some products land an ulp of n apart (most of them under Triton's
    interpreter, which truncates): there the dtype's entry, atol scaled by sqrt(rows) (as gelu_bwd's db)."""
    t = tolerance(parse_dtype(workload.dtypes[0]))
    if len(workload.shapes) == 1:
        return (t,)
    rows = workload.shapes[0][0]
    if workload.param("round_before_weight", False) and workload.dtypes[0] in ("bf16", "fp16"):
        return (t, Tolerance(t.atol * math.sqrt(max(rows, 1)), t.rtol))
    return (t, sum_tolerance(rows))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `rmsnorm_bwd` / `rmsnorm_bwd_ref`: rmsnorm's (x, weight, eps)
    (its make_inputs; `rows` replaces the row count), a random dy of out_dtype and, with `ds`, a
    random ds of x's dtype, both contiguous (a linear's backward hands over fresh tensors)."""
    params = tuple(kv for kv in workload.params if kv[0] != "ds")
    fwd = Workload(_rms.FAMILY, workload.shapes, workload.dtypes, params, workload.device)
    (x, weight, eps), kw = _rms.make_inputs(fwd, seed=seed, rows=rows, device=device)
    g, where = input_generator(2 * x.numel(), x.device, seed + 1)
    dy = torch.randn(x.shape, generator=g, device=where).to(kw["out_dtype"]).to(x.device)
    ds = torch.randn(x.shape, generator=g, device=where).to(x.dtype).to(x.device) \
        if workload.param("ds", False) else None
    return (dy, x, weight, eps), {"round_before_weight": kw["round_before_weight"], "ds": ds}
