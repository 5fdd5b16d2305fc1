"""LayerNorm's `split` variant: rows too long for one program's registers (KernelBench's
`nn.LayerNorm((64, 256, 256))`: 16 rows of 4M values), or too few to fill the GPU one per program.

Each row is cut into chunks of CHUNK values, one program a (chunk, row) pair, in two kernels:
  stats  each program loads its chunk once and stores the chunk's mean and its sum of squared
         deviations from that mean (exact two-pass, from registers);
  norm   each program combines its row's chunk statistics into the row's mean and variance
         (Chan et al.'s pairwise formula: M2 = sum(M2_c) + sum(n_c (mean_c - mean)^2), no
         E[x^2] - mean^2 cancellation), then loads its chunk again and writes y.
x is read twice and y written once. Programs are numbered chunk-major (all rows of chunk 0, then
chunk 1, ...), so the rows that need the same slice of weight and bias run together and read it
from L2, not HBM. The statistics sit in an fp32 workspace of rows x chunks x 2.

Forward only: the backward kernels (layernorm_bwd.py) hold a row in registers, so the planner
matches such a row only where no gradient is taken (plan/layernorm.py). No residual
(add_layernorm): its rows stay within the row kernels' budget or are not matched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solforge.kernels.interp import round_bf16
from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch

# the norm kernel loads all of a row's chunk statistics in one block: at most this many chunks
MAX_CHUNKS = 4096


@triton.jit
def _stats_kernel(x_ptr, part_ptr, n_rows, H, stride_x, n_chunks, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    chunk = pid // n_rows
    row = pid % n_rows
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ptrs = x_ptr + row.to(tl.int64) * stride_x + cols
    if EVEN:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=cols < H, other=0.0).to(tl.float32)
    n = tl.minimum(H - chunk * CHUNK, CHUNK).to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    d = x - mean
    if not EVEN:  # masked lanes hold -mean now; they must not count
        d = tl.where(cols < H, d, 0.0)
    out = part_ptr + (row.to(tl.int64) * n_chunks + chunk) * 2
    tl.store(out, mean)
    tl.store(out + 1, tl.sum(d * d, axis=0))


@triton.jit
def _norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, n_rows, H, stride_x, stride_y, eps, n_chunks,
                 CHUNK: tl.constexpr, NC: tl.constexpr, EVEN: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, INTERP: tl.constexpr):
    pid = tl.program_id(0)
    chunk = pid // n_rows
    row = pid % n_rows
    # the row's statistics from its chunks'
    c = tl.arange(0, NC)
    cm = c < n_chunks
    stats = part_ptr + (row.to(tl.int64) * n_chunks + c) * 2
    means = tl.load(stats, mask=cm, other=0.0)
    m2s = tl.load(stats + 1, mask=cm, other=0.0)
    counts = tl.where(cm, tl.minimum(H - c * CHUNK, CHUNK).to(tl.float32), 0.0)
    mean = tl.sum(counts * means, axis=0) / H
    dm = means - mean
    m2 = tl.sum(m2s, axis=0) + tl.sum(counts * dm * dm, axis=0)
    rstd = tl.rsqrt(m2 / H + eps)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ptrs = x_ptr + row.to(tl.int64) * stride_x + cols
    m = cols < H
    if EVEN:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    y = (x - mean) * rstd
    if HAS_WEIGHT:
        if EVEN:
            y = y * tl.load(w_ptr + cols).to(tl.float32)
        else:
            y = y * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        if EVEN:
            y = y + tl.load(b_ptr + cols).to(tl.float32)
        else:
            y = y + tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if INTERP and y_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter's bf16 cast truncates
        y = round_bf16(y)
    y_ptrs = y_ptr + row.to(tl.int64) * stride_y + cols
    if EVEN:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m)


_INTERPRETED = type(_norm_kernel).__name__ == "InterpretedFunction"


def n_chunks(H: int, chunk: int) -> int:
    return triton.cdiv(H, chunk)


def launch(x2: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, y2: torch.Tensor, eps: float,
           chunk: int, num_warps: int) -> None:
    """y2 = layernorm of x2's rows (both (rows, H), unit column stride), with chunks of `chunk`."""
    n_rows, H = x2.shape
    nc = n_chunks(H, chunk)
    part = torch.empty((n_rows, nc, 2), dtype=torch.float32, device=x2.device)
    grid = (n_rows * nc,)
    even = H % chunk == 0
    _launch(_stats_kernel, grid, (x2, part, n_rows, H, x2.stride(0), nc),
            Meta(CHUNK=chunk, EVEN=even, num_warps=num_warps))
    _launch(_norm_kernel, grid,
            (x2, weight if weight is not None else x2, bias if bias is not None else x2, y2, part, n_rows, H,
             x2.stride(0), y2.stride(0), eps, nc),
            Meta(CHUNK=chunk, NC=triton.next_power_of_2(nc), EVEN=even, HAS_WEIGHT=weight is not None,
                 HAS_BIAS=bias is not None, INTERP=_INTERPRETED, num_warps=num_warps))
