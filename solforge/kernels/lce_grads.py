"""linear_cross_entropy's gradient bookkeeping: dweight summed over chunks of rows (DWeight) and
the backward's scaling by the incoming gradient (scale_in_place).

dweight = sum over chunks of dlogits_c^T @ hidden_c must be rounded to the weight's dtype once, at
the end: a per-chunk rounding fails verification where chunks cancel. cuBLAS has no GEMM that adds
a half-precision product into an fp32 matrix in place, so the "fp32" variant forms each later
chunk's product in fp32 (torch.mm with out_dtype), slice by slice of dweight's rows, and adds it
into an fp32 buffer: per chunk after the first, 3 extra passes over a V x H fp32 matrix (4.7 GB at
Qwen3-4B, ~1.5 ms at 3.0 TB/s) besides the GEMM's own fp32 output, and one cast at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solforge.kernels.interp import round_bf16
from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch
from solforge.kernels.lce_model import f32_slice_rows

# ----------------------------------------------------------------------------------------------
# dweight over chunks, by variant (linear_cross_entropy's forward)

_MM_OUT_DTYPE_INTO = [True]  # torch.mm(..., out_dtype=float32, out=...) works here (checked on first use)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of half inputs as the GEMM's fp32 accumulator holds it, before any rounding. On CUDA
    cuBLAS with an fp32 output (torch.mm's out_dtype, torch >= 2.8), required: an fp32 GEMM of the
    upcast inputs would also hold their fp32 copies, which the cost model does not count. On the
    CPU (the interpreter's tests) an fp32 GEMM of the upcast inputs."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _product_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc = a @ b (first) or acc += a @ b, in fp32, without rounding the product to the inputs'
    dtype: one chunk's product rounded to bf16 carries an error of its own size, and chunks that
    cancel leave that error in a small sum (measured: 0.015 on an element of 0.078, N = 37, against
    0.0005 for one rounding). The first product is written by the GEMM itself where torch can
    (mm.dtype_out: no temporary); otherwise, and for every later product, it is formed in slices of
    lce_model.f32_slice_rows rows, one statement each so that only one slice is alive at a time
    (lce_model.peak_bytes counts exactly one)."""
    if first and not a.is_cuda:
        torch.mm(a.float(), b.float(), out=acc)
        return
    if first and _MM_OUT_DTYPE_INTO[0]:
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE_INTO[0] = False
    step = f32_slice_rows(acc.shape[1])
    for v in range(0, acc.shape[0], step):
        if first:
            acc[v : v + step].copy_(_mm_f32(a[v : v + step], b))
        else:
            acc[v : v + step].add_(_mm_f32(a[v : v + step], b))


class DWeight:
    """dweight over the chunks, by variant. The first chunk writes it (no zero-fill, no add), the
    last leaves it in the weight's dtype:
      one chunk (any variant), or fp32 inputs, or "native": cuBLAS writes the weight's dtype (one
        GEMM rounded once for one chunk: what eager computes), later chunks add with beta = 1;
      "fp32" over several chunks: an fp32 buffer the first chunk's GEMM writes, later chunks add
        their fp32 product slice by slice (_product_f32), and one cast at the end."""

    def __init__(self, variant: str, weight: torch.Tensor, chunks: int) -> None:
        V, H = weight.shape
        dt, dev = weight.dtype, weight.device
        self.fp32 = variant == "fp32" and chunks > 1 and dt != torch.float32
        self.dtype = dt
        self.acc: torch.Tensor | None = None
        if self.fp32:  # the result is cast from the buffer at the end: allocated there
            self.acc = torch.empty(V, H, dtype=torch.float32, device=dev)
        else:
            self.out = torch.empty(V, H, dtype=dt, device=dev)

    def add(self, i: int, x: torch.Tensor, hc: torch.Tensor) -> None:
        """Chunk i's dlogits (rows, V) and hidden rows (rows, H)."""
        if self.acc is not None:
            _product_f32(self.acc, x.t(), hc, first=i == 0)
        elif i == 0:
            torch.mm(x.t(), hc, out=self.out)
        else:
            self.out.addmm_(x.t(), hc)

    def result(self) -> torch.Tensor:
        if self.acc is not None:  # the buffer and the result are both alive during the cast
            self.out, self.acc = self.acc.to(self.dtype), None
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


_INTERPRETED = type(_scale_kernel).__name__ == "InterpretedFunction"
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
