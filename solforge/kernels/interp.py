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
# Triton 3.6's interpreter casts fp32 to bf16 by truncation (1.0 + 2^-8 + 2^-12 -> 1.0), while the
# GPU rounds to nearest even like torch: off the GPU the kernels round by hand, so CPU tests
# compare the same function the GPU computes (bf16 results then match the reference bit for bit
# except at rare rounding ties), not one with a systematic one-ulp bias.
_RNE_BY_HAND = tl.constexpr(INTERPRETED)


@triton.jit
def cast_rne(v, dtype: tl.constexpr):
    """v cast to `dtype`, an fp32 v rounded to nearest even on the GPU and in the interpreter alike."""
    if _RNE_BY_HAND:
        if dtype == tl.bfloat16 and v.dtype == tl.float32:
            v = round_bf16(v)
    return v.to(dtype)
