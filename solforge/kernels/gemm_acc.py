"""C += A^T @ B with an fp32 running sum kept as two 16-bit planes: linear_cross_entropy's dweight
over chunks of rows (variant "rmw"), one GEMM pass per chunk.

dweight = sum over chunks of dlogits_c^T @ hidden_c must be rounded to bf16 once, at the end (a
per-chunk rounding fails verification where chunks cancel). cuBLAS has no GEMM that adds a bf16
product into an fp32 matrix in place, so the "fp32" variant writes each product to a temporary
and adds it: per chunk after the first, 3 extra passes over a V x H fp32 matrix (4.7 GB at
Qwen3-4B, ~1.5 ms at 3.0 TB/s) besides the GEMM's own fp32 output. Here the GEMM's epilogue
reads the running sum, adds its fp32 accumulator and writes it back: 8 bytes per element read and
written per middle chunk, none of them in a separate pass.

The running sum is stored split: the high 16 bits of each fp32 value in `hi` and the low 16 bits
in `lo`, two (V, H) 16-bit tensors. `hi` is the bf16 dweight itself (viewed as int16): the last
chunk rounds the fp32 sum to nearest-even bf16 and writes only `hi`, in place, element by element
(no tile reads another tile's elements, so no ordering hazard). The result needs no final cast and
no third tensor: peak is dweight + lo (2 x V x H x 2 bytes, as one fp32 matrix) + the chunk buffer,
where an fp32 accumulator plus its bf16 cast hold V x H x 6 bytes at the cast. bf16 only (its
bits are fp32's upper half; fp16's are not).

Tiles: BM x BN over (V, H), BK over the chunk's rows; the A^T tile is read from the (rows, V)
dlogits with unit stride along V (an MN-major wgmma operand on Hopper, legal for 16-bit types).
Programs go in groups of GROUP_M tile-rows so that consecutive programs share A's tile-row and
B's tile-columns in L2 (B, the chunk's hidden rows, is 5-21 MB and stays in L2 anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch

# what the epilogue does with the running sum: MODE_FIRST writes it (no read), MODE_MID reads and
# writes it, MODE_LAST reads it and writes the rounded bf16 result to hi only, MODE_ONLY (one chunk)
# writes the rounded result without reading
MODE_FIRST, MODE_MID, MODE_LAST, MODE_ONLY = 0, 1, 2, 3
GROUP_M = 8


@triton.jit
def _k_step(acc, a_ptr, b_ptr, offs_m, offs_n, k0, K, stride_ak, stride_am, stride_bk, stride_bn,
            BK: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr):
    offs_k = k0 + tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # A^T tile (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # B tile (BK, BN)
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K, other=0.0)
    if INTERP:  # the interpreter has no bf16 arithmetic: exact fp32 products of the bf16 values
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)  # bf16 x bf16 -> fp32 (wgmma on Hopper)


@triton.jit
def _acc_tn_kernel(a_ptr, b_ptr, hi_ptr, lo_ptr, M, N, K, stride_ak, stride_am, stride_bk, stride_bn, stride_c,
                   MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   GROUP: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr):
    """One (BM, BN) tile of C = A^T B (+ the running sum), A (K, M) and B (K, N) in bf16."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    size = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    # wrapped indices at the edges: loads stay in bounds without masks; the store masks them out
    offs_m = rm % M
    offs_n = rn % N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if INTERP:  # Triton 3.6's interpreter and numpy >= 2.4 (triton#9171): a while loop, see rmsnorm.py
        k0 = 0
        while k0 < K:
            acc = _k_step(acc, a_ptr, b_ptr, offs_m, offs_n, k0, K, stride_ak, stride_am, stride_bk, stride_bn,
                          BK, EVEN_K, INTERP)
            k0 += BK
    else:
        for k0 in tl.range(0, K, BK):
            acc = _k_step(acc, a_ptr, b_ptr, offs_m, offs_n, k0, K, stride_ak, stride_am, stride_bk, stride_bn,
                          BK, EVEN_K, INTERP)
    c_off = rm[:, None].to(tl.int64) * stride_c + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if MODE == 1 or MODE == 2:  # the running sum, put together from its two 16-bit halves
        hi = tl.load(hi_ptr + c_off, mask=mask, other=0).to(tl.int32) & 0xFFFF
        lo = tl.load(lo_ptr + c_off, mask=mask, other=0).to(tl.int32) & 0xFFFF
        acc += ((hi << 16) | lo).to(tl.float32, bitcast=True)
    if MODE >= 2:  # round to nearest even bf16, as a cast on the GPU does; the bits go into hi
        u = acc.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        tl.store(hi_ptr + c_off, r.to(tl.int16), mask=mask)
    else:  # the exact fp32 value, split
        bits = acc.to(tl.int32, bitcast=True)
        tl.store(hi_ptr + c_off, (bits >> 16).to(tl.int16), mask=mask)
        tl.store(lo_ptr + c_off, (bits & 0xFFFF).to(tl.int16), mask=mask)


_INTERPRETED = type(_acc_tn_kernel).__name__ == "InterpretedFunction"


def acc_tn(a: torch.Tensor, b: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, mode: int, *, bm: int = 128,
           bn: int = 256, bk: int = 64, stages: int = 3, num_warps: int = 8) -> None:
    """hi/lo (M, N) int16 halves of an fp32 running sum S; S += a^T @ b for a (K, M), b (K, N) bf16
    with a unit stride along M and N. `mode` says whether S exists yet and whether this is the
    last product (then hi, seen as bf16, holds round(S) and lo is not written)."""
    K, M = a.shape
    N = b.shape[1]
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or b.shape[0] != K:
        raise ValueError(f"acc_tn: a {a.dtype} {tuple(a.shape)}, b {b.dtype} {tuple(b.shape)}: bf16 (K, M), (K, N)")
    if hi.dtype != torch.int16 or lo.dtype != torch.int16 or tuple(hi.shape) != (M, N) or lo.shape != hi.shape \
            or hi.stride() != lo.stride() or hi.stride(1) != 1:
        raise ValueError(f"acc_tn: hi/lo must be row-major int16 ({M}, {N}) of one layout")
    if M == 0 or N == 0:
        return
    if K == 0:  # an empty product: S += 0
        if mode in (MODE_FIRST, MODE_ONLY):
            hi.zero_()
            lo.zero_()
        return
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    kw = Meta(MODE=mode, BM=bm, BN=bn, BK=bk, GROUP=GROUP_M, EVEN_K=K % bk == 0, INTERP=_INTERPRETED,
              num_warps=num_warps, num_stages=stages)
    _launch(_acc_tn_kernel, grid, (a, b, hi, lo, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                   hi.stride(0)), kw)


def smem_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """Shared memory the pipelined main loop holds: `stages` bf16 tiles of A and B."""
    return stages * (bm + bn) * bk * 2
