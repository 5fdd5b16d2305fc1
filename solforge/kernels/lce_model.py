"""Cost model of linear_cross_entropy's configs: peak memory (exact bookkeeping of what forward()
allocates) and H100 time (flops and bytes at measured ceilings). The heuristic ranks configs with
it; the tuner measures them. Numbers at Qwen3-4B's head (bf16, H 2560, V 151936, dhidden and
dweight), N = 4096 rows:

  each of the three GEMMs is 2 N H V = 3.19 TFLOP: 4.7 ms at 680 TFLOP/s (745 measured at 8192^3,
  BASELINES.md; these shapes assumed ~9% slower)
  the row kernel reads a chunk's logits twice and writes their gradient: 3 x 1.24 GB = 1.2 ms
  one pass over dweight's V x H = 389 M elements: 0.78 GB in bf16, 1.56 GB in fp32 (0.52 ms)

  one chunk: 3 x 4.7 + 1.2 = 15.4 ms, peak = logits 1.24 + dweight 0.78 + dhidden 0.02 = 2.04 GB,
  what the unchunked graph holds (torch.compile measured 15.0 ms, 2.05 GB)
  "fp32", C chunks: each chunk after the first adds a product (fp32 write of 1.56 GB inside its
  GEMM) and a pass reading it and the buffer and writing the buffer (4.7 GB, 1.55 ms), plus a
  final cast (2.3 GB, 0.77 ms); peak holds the fp32 buffer (1.56 GB), one chunk and one product
  slice in the loop, the buffer and the result at the cast
  "native": cuBLAS adds into dweight (beta = 1): no extra pass, one rounding per chunk

A GEMM's time is max(flops / rate, bytes / bandwidth) (its epilogue overlapped with other tiles'
main loops) plus 5 us of launch and tail, and the dhidden GEMM (rows x H outputs, K = V) is charged
for wave quantization: 128 x 128 tiles over 132 SMs, no worse than 60% (split-K's floor).
"""

from __future__ import annotations

import math

GRAD_HIDDEN, GRAD_WEIGHT, GRAD_BIAS = 1, 2, 4  # as linear_cross_entropy's
F32_SLICE_BYTES = 256 << 20  # "fp32": later chunks' products are formed in slices at most this big
TFLOPS_HALF = 680.0  # cuBLAS bf16/fp16 at these shapes (745 measured at 8192^3)
TFLOPS_FP32 = 50.0  # fp32 GEMM without TF32 (ranking only)
COPY_TBPS = 3.02  # device-to-device copy ceiling, BASELINES.md
SMS = 132
# torch.compile's measured peaks exceed logits + gradients by a few MB (2.05 GB against 2.043 at
# 4096 rows, 3.31 against 3.309 at 8192): the budget allows the same
COMPILE_SLACK_BYTES = 8 << 20


def f32_slice_rows(H: int) -> int:
    """Rows of dweight per fp32 product slice (lce_grads._product_f32): at most F32_SLICE_BYTES."""
    return max(1, F32_SLICE_BYTES // (4 * H))


def _gemm_ms(flops: float, nbytes: float, rate_tflops: float) -> float:
    return max(flops / (rate_tflops * 1e9), nbytes / (COPY_TBPS * 1e9)) + 0.005


def _fill(rows: int, H: int) -> float:
    tiles = math.ceil(rows / 128) * math.ceil(H / 128)
    return max(0.6, tiles / (math.ceil(tiles / SMS) * SMS))


def _chunks(N: int, rows: int) -> list[int]:
    rows = max(1, min(rows, N))
    return [min(rows, N - s) for s in range(0, N, rows)]


def _dw_mode(variant: str, n_chunks: int, itemsize: int) -> str:
    return "mm" if n_chunks == 1 or itemsize == 4 or variant == "native" else variant


def time_ms(*, N: int, H: int, V: int, itemsize: int, grads: int, has_bias: bool, variant: str, rows: int) -> float:
    s = itemsize
    rate = TFLOPS_FP32 if s == 4 else TFLOPS_HALF
    bw = COPY_TBPS * 1e9  # bytes per ms
    chunks = _chunks(N, rows)
    mode = _dw_mode(variant, len(chunks), s)
    vh = V * H
    t = 0.0
    for i, r in enumerate(chunks):
        fl = 2.0 * r * H * V
        first = i == 0
        t += _gemm_ms(fl, r * H * s + vh * s + r * V * s, rate)  # logits
        t += r * V * s * (3 if grads else 1) / bw  # row kernel: read, (read, write the gradient)
        if grads & GRAD_HIDDEN:
            t += _gemm_ms(fl, r * V * s + vh * s + r * H * s, rate * _fill(r, H))
        if grads & GRAD_WEIGHT:
            ab = r * V * s + r * H * s
            if mode == "mm":
                t += _gemm_ms(fl, ab + vh * s * (1 if first else 2), rate)
            else:  # "fp32"
                t += _gemm_ms(fl, ab + vh * 4, rate) + (0.0 if first else 3 * vh * 4 / bw)
        if grads & GRAD_BIAS:
            t += r * V * s / bw
    if grads & GRAD_WEIGHT and mode == "fp32":
        t += vh * (4 + s) / bw  # the final cast
    return t


def peak_bytes(*, N: int, H: int, V: int, itemsize: int, grads: int, has_bias: bool, variant: str,
               rows: int) -> int:
    """What forward() holds at its peak above its inputs: dhidden, dbias (fp32, and its cast), the
    loss rows and the larger of (chunk buffer + dweight's storage during the loop) and (dweight's
    storage at the end, the buffer freed). "fp32" over several chunks holds in the loop its fp32
    buffer and one product slice (the first chunk's product written into the buffer by the GEMM, or
    formed in slices too: the same peak), at the end the buffer and its cast.

    The backward adds nothing run eagerly (it scales the saved gradients in place); traced
    (torch.compile) it scales them out of place, a second copy of the gradients next to the saved
    ones, as any graph's backward holds its gradients: not counted here (the forward's peak is what
    the chunking changes)."""
    s = itemsize
    chunks = _chunks(N, rows)
    mode = _dw_mode(variant, len(chunks), s)
    vh = V * H
    buf = (chunks[0] if chunks else 0) * V * s
    dh = N * H * s if grads & GRAD_HIDDEN else 0
    db = V * (4 + s) if grads & GRAD_BIAS and has_bias else 0
    loop = end = 0
    if grads & GRAD_WEIGHT and N:
        if mode == "mm":
            loop = end = vh * s
        else:  # "fp32"
            loop, end = vh * 4 + min(f32_slice_rows(H), V) * H * 4, vh * (4 + s)
    return dh + db + N * 4 + max(buf + loop, end)


def unchunked_bytes(N: int, H: int, V: int, itemsize: int, grads: int, has_bias: bool) -> int:
    """The unchunked graph's peak: its (N, V) logits in the input dtype, held until the gradient
    GEMMs, and the gradients, plus COMPILE_SLACK_BYTES."""
    s = itemsize
    return (N * V * s + (V * H * s if grads & GRAD_WEIGHT else 0) + (N * H * s if grads & GRAD_HIDDEN else 0)
            + (V * s if grads & GRAD_BIAS and has_bias else 0) + COMPILE_SLACK_BYTES)
