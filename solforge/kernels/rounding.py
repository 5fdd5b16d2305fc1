"""Rounding an fp32 value to the half dtype a model's op would store it in, and back to fp32.

Fused kernels compute in fp32 and round where the model's own ops round (every op of a half-dtype
model stores its result in that dtype): then a fused region is eager's arithmetic, not an
approximation of it. The spelling matters on the GPU. `(a * c).to(bf16).to(fp32) - (b * s)...`
compiles to one bf16 fma of a, c and the rounded b * s: the compiler narrows the round trip into
the next op and contracts the multiply into it, dropping the product's rounding. On an H200 that
left 24.2% of `round(a*c) - round(b*s)` outputs unlike eager's (bf16 inputs, 2^20 elements), where
the rounding done in integer arithmetic matched at every one (`tools/round_probe.py`, 2026-11-26).
So bf16 is rounded by integer arithmetic on the fp32 bits, and fp16 by PTX conversions the
compiler cannot look through (by a plain cast in Triton's interpreter, which compiles nothing).
"""

from __future__ import annotations

import triton
import triton.language as tl

from solforge.kernels.interp import INTERPRETED, round_bf16

_ASM_OK = tl.constexpr(not INTERPRETED)


@triton.jit
def as_stored(v, dtype: tl.constexpr):
    """fp32 `v` rounded to `dtype` (to nearest, ties to even), as fp32; fp32 `dtype` returns `v`."""
    if dtype == tl.bfloat16:  # a NaN stays NaN: low payload bits could carry it into inf's
        return tl.where(v == v, round_bf16(v), v)
    elif dtype == tl.float16:
        if _ASM_OK:
            return tl.inline_asm_elementwise("{ .reg .f16 t; cvt.rn.f16.f32 t, $1; cvt.f32.f16 $0, t; }",
                                             "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
        else:
            return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def mean_factor(n):
    """fl(1 / n), correctly rounded. torch's mean multiplies the sum by this factor instead of
    dividing by n, and Triton's `/` is an approximate division: `sum * mean_factor(n)` is the
    statistic eager computes from the same sum."""
    return tl.math.div_rn(1.0, n * 1.0)
