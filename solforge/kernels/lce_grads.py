"""linear_cross_entropy's gradient bookkeeping: dweight summed over chunks of rows (DWeight; the
"rmw" variant's GEMM below) and the backward's scaling by the incoming gradient (scale_in_place).

The rmw GEMM: C += A^T @ B with an fp32 running sum kept as two 16-bit planes, one GEMM pass per
chunk.

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

from solforge.kernels.interp import round_bf16
from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch
from solforge.kernels.lce_model import F32_SLICE_BYTES

# what the epilogue does with the running sum: MODE_FIRST writes it (no read), MODE_MID reads and
# writes it, MODE_LAST reads it and writes the rounded bf16 result to hi only, MODE_ONLY (one chunk)
# writes the rounded result without reading
MODE_FIRST, MODE_MID, MODE_LAST, MODE_ONLY = 0, 1, 2, 3
GROUP_M = 8


@triton.jit
def _k_step(acc, a_ptr, b_ptr, offs_m, offs_n, k0, M, N, K, stride_ak, stride_am, stride_bk, stride_bn,
            BK: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr):
    offs_k = k0 + tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # A^T tile (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # B tile (BK, BN)
    if EVEN_K:
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(b_ptrs, mask=offs_n[None, :] < N, other=0.0)
    else:
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
    if INTERP:  # the interpreter has no bf16 arithmetic: exact fp32 products of the bf16 values
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:  # bf16 x bf16 -> fp32 (wgmma on Hopper). One return: an early one makes the helper a
        # call the software pipeliner cannot see into (sm_90 build: no async copies)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _load_sum(hi_ptr, lo_ptr, c_off, mask):
    """The running sum's fp32 tile, put together from its two 16-bit halves."""
    hi = tl.load(hi_ptr + c_off, mask=mask, other=0).to(tl.int32) & 0xFFFF
    lo = tl.load(lo_ptr + c_off, mask=mask, other=0).to(tl.int32) & 0xFFFF
    return ((hi << 16) | lo).to(tl.float32, bitcast=True)


@triton.jit
def _acc_tn_kernel(a_ptr, b_ptr, hi_ptr, lo_ptr, M, N, K, stride_ak, stride_am, stride_bk, stride_bn, stride_c,
                   MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   GROUP: tl.constexpr, EVEN_K: tl.constexpr, PRELOAD: tl.constexpr, INTERP: tl.constexpr):
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
    # masked at the edges rather than wrapped (rm % M): a modulo hides the unit stride along M and N
    # from the compiler, whose loads then go one element at a time, unpipelined (sm_90 build: no
    # async copies, 48 KB of shared memory for 3 stages of 128 x 256 x 64)
    offs_m = rm
    offs_n = rn
    c_off = rm[:, None].to(tl.int64) * stride_c + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if PRELOAD and (MODE == 1 or MODE == 2):  # the running sum as the dot's initial accumulator
        acc = _load_sum(hi_ptr, lo_ptr, c_off, mask)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if INTERP:  # Triton 3.6's interpreter and numpy >= 2.4 (triton#9171): a while loop, see rmsnorm.py
        k0 = 0
        while k0 < K:
            acc = _k_step(acc, a_ptr, b_ptr, offs_m, offs_n, k0, M, N, K, stride_ak, stride_am, stride_bk, stride_bn,
                          BK, EVEN_K, INTERP)
            k0 += BK
    else:
        for k0 in tl.range(0, K, BK):
            acc = _k_step(acc, a_ptr, b_ptr, offs_m, offs_n, k0, M, N, K, stride_ak, stride_am, stride_bk, stride_bn,
                          BK, EVEN_K, INTERP)
    if not PRELOAD and (MODE == 1 or MODE == 2):  # the running sum, added to the chunk's product
        acc += _load_sum(hi_ptr, lo_ptr, c_off, mask)
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
           bn: int = 128, bk: int = 64, stages: int = 4, num_warps: int = 8, preload: bool = False) -> None:
    """hi/lo (M, N) int16 halves of an fp32 running sum S; S += a^T @ b for a (K, M), b (K, N) bf16
    with a unit stride along M and N. `mode` says whether S exists yet and whether this is the
    last product (then hi, seen as bf16, holds round(S) and lo is not written). `preload`: S is read
    before the main loop as the dot's initial accumulator rather than added in the epilogue (no
    second BM x BN tile live next to the accumulator; at 128 x 256 with 8 warps the sm_90 build
    spills 408 bytes a thread reading it in the epilogue, 192 preloaded; the tuner measures both)."""
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
    kw = Meta(MODE=mode, BM=bm, BN=bn, BK=bk, GROUP=GROUP_M, EVEN_K=K % bk == 0, PRELOAD=bool(preload),
              INTERP=_INTERPRETED,
              num_warps=num_warps, num_stages=stages)
    _launch(_acc_tn_kernel, grid, (a, b, hi, lo, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                   hi.stride(0)), kw)


def smem_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """Shared memory the pipelined main loop holds: `stages` bf16 tiles of A and B."""
    return stages * (bm + bn) * bk * 2


# ----------------------------------------------------------------------------------------------
# dweight over chunks, by variant (linear_cross_entropy's forward)

# fp32 products are formed in slices of dweight's rows: the temporary stays at most this big
_F32_SLICE_BYTES = F32_SLICE_BYTES
_MM_OUT_DTYPE = [True]  # torch.mm(..., out_dtype=float32) works here (checked on first use)
_MM_OUT_DTYPE_INTO = [True]  # and with out= (mm.dtype_out)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of half inputs as the GEMM's fp32 accumulator holds it, before any rounding: cuBLAS
    with an fp32 output (torch >= 2.8, CUDA); elsewhere (the interpreter's CPU tensors) in fp32."""
    if a.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[0] = False
    return torch.mm(a.float(), b.float())


def _mm_f32_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b in fp32 (as _mm_f32), written by the GEMM itself where torch can (no temporary,
    no copy: the first chunk's 1.56 GB at Qwen3-4B); else products in slices, copied in."""
    if a.is_cuda and _MM_OUT_DTYPE_INTO[0]:
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE_INTO[0] = False
    if not a.is_cuda:
        torch.mm(a.float(), b.float(), out=out)
        return
    step = max(1, _F32_SLICE_BYTES // (4 * out.shape[1]))
    for v in range(0, out.shape[0], step):
        out[v : v + step].copy_(_mm_f32(a[v : v + step], b))


def _add_product_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in fp32 without rounding the product to the inputs' dtype: one chunk's product
    rounded to bf16 carries an error of its own size, and chunks that cancel leave that error in a
    small sum (measured: 0.015 on an element of 0.078, N = 37, against 0.0005 for one rounding)."""
    step = max(1, _F32_SLICE_BYTES // (4 * acc.shape[1]))
    for v in range(0, acc.shape[0], step):
        acc[v : v + step].add_(_mm_f32(a[v : v + step], b))


class DWeight:
    """dweight over the chunks, by variant. The first chunk writes it (no zero-fill, no add), the
    last leaves it in the weight's dtype:
      one chunk (any variant), or fp32 inputs, or "native": cuBLAS writes the weight's dtype (one
        GEMM rounded once for one chunk: what eager computes), later chunks add with beta = 1;
      "fp32": an fp32 buffer the first chunk's GEMM writes directly (mm out_dtype with out=), later
        chunks add a product formed in 256 MB slices, and one cast at the end;
      "rmw": acc_tn (above) adds each chunk's fp32 product into the running sum in its epilogue
        (bf16 only); the sum's high half is the result itself, rounded in place by the last chunk."""

    def __init__(self, variant: str, weight: torch.Tensor, chunks: int, gemm: dict[str, int]) -> None:
        V, H = weight.shape
        dt, dev = weight.dtype, weight.device
        self.mode = "mm" if chunks == 1 or dt == torch.float32 or variant == "native" else variant
        self.gemm, self.last, self.dtype = gemm, chunks - 1, dt
        if self.mode == "fp32":  # the result is cast from the buffer at the end: allocated there
            self.acc: torch.Tensor | None = torch.empty(V, H, dtype=torch.float32, device=dev)
        else:
            self.out = torch.empty(V, H, dtype=dt, device=dev)
        self.lo = torch.empty(V, H, dtype=torch.int16, device=dev) if self.mode == "rmw" else None

    def add(self, i: int, x: torch.Tensor, hc: torch.Tensor) -> None:
        """Chunk i's dlogits (rows, V) and hidden rows (rows, H)."""
        if self.mode == "mm":
            if i == 0:
                torch.mm(x.t(), hc, out=self.out)
            else:
                self.out.addmm_(x.t(), hc)
        elif self.mode == "fp32":
            if i == 0:
                assert self.acc is not None
                _mm_f32_into(self.acc, x.t(), hc)
            else:
                assert self.acc is not None
                _add_product_f32(self.acc, x.t(), hc)
        else:
            mode = MODE_FIRST if i == 0 else MODE_LAST if i == self.last else MODE_MID
            assert self.lo is not None
            acc_tn(x, hc, self.out.view(torch.int16), self.lo, mode, **self.gemm)

    def result(self) -> torch.Tensor:
        if self.mode == "fp32":
            assert self.acc is not None
            self.out, self.acc = self.acc.to(self.dtype), None
        self.lo = None  # (rmw: the running sum's low half, no longer needed)
        return self.out


# ----------------------------------------------------------------------------------------------
# the backward: saved gradients times the incoming one

@triton.jit
def _scale_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    """x *= g in place, in fp32, rounded to x's dtype; nothing read or written when g == 1."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * g
        if ROUND:  # the interpreter's bf16 cast truncates
            v = round_bf16(v)
        tl.store(x_ptr + offs, v.to(x_ptr.dtype.element_ty), mask=mask)


_SCALE_META = {True: Meta(BLOCK=8192, ROUND=True, num_warps=8), False: Meta(BLOCK=8192, ROUND=False, num_warps=8)}


def scale_in_place(ts: list[torch.Tensor], g: torch.Tensor) -> bool:
    """Scale the saved gradients by the incoming one in place, if they are plain tensors run
    eagerly (not traced by torch.compile / make_fx, not functorch-wrapped); False otherwise.

    Why: `dweight * g` is a pass over V x H (0.78 GB read + 0.78 GB written at Qwen3-4B: 0.52 ms,
    3% of the whole fwd+bwd) and a second dweight (0.78 GB) alive next to the saved one, for a
    factor that is exactly 1 whenever the loss is backpropagated as is (loss.backward()); the
    kernel reads g on the device (no host sync) and its programs return at once then (~10 us).
    The op's gradient outputs are its backward's scratch: their values after a backward with
    g != 1 are scaled."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for t in (*ts, g):
        if type(t) is not torch.Tensor or torch._C._functorch.is_functorch_wrapped_tensor(t) \
                or torch._is_functional_tensor(t) or (t.device.type != "cuda" and not _INTERPRETED):
            return False
    if g.numel() != 1 or not all(t.is_contiguous() for t in ts):
        return False
    g = g.reshape(1)
    for t in ts:
        if t.numel():
            rnd = _INTERPRETED and t.dtype == torch.bfloat16
            _launch(_scale_kernel, (triton.cdiv(t.numel(), 8192),), (t, g, t.numel()), _SCALE_META[rnd])
    return True
