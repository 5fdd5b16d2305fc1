"""Helpers for running the kernels under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(v):
    """fp32 -> nearest bf16 (ties to even), still as fp32. Only for Triton's interpreter, whose bf16
    cast truncates (the GPU's cast rounds already): a value one bf16 ulp off can move a result past
    its tolerance. layernorm rounds its residual sum with it; cross_entropy its logits' gradient,
    which linear_cross_entropy's reference rounds as the model does."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
