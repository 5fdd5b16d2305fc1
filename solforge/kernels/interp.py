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


@triton.jit
def _probe() -> None:
    pass


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import.
INTERPRETED = type(_probe).__name__ == "InterpretedFunction"
_RNE_BY_HAND = tl.constexpr(INTERPRETED)


@triton.jit
def cast_rne(v, dtype: tl.constexpr):
    """v cast to `dtype`, an fp32 v rounded to nearest even on the GPU and in the interpreter alike."""
    if _RNE_BY_HAND:
        if dtype == tl.bfloat16 and v.dtype == tl.float32:
            v = round_bf16(v)
    return v.to(dtype)
