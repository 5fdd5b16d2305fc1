"""A row's sum of squares in the order PyTorch's CUDA reduce kernel adds it, bit for bit.

An RMSNorm in eager PyTorch takes its statistic as `x.float().pow(2).mean(-1)`. Every fused kernel
here computes the same fp32 formula, but a sum's last bit depends on the order of its additions,
and one bit of the statistic sometimes moves the bf16 output by one ulp. Over 36 layers those ulps
decided 16 to 17 of 16,384 next-token argmaxes on trained Qwen3-4B weights (2026-11-26: the
norms' statistic was all that still differed from eager). So the norms add in torch's order.

That order comes from ATen's reduce kernel (`Reduce.cuh`, `setReduceConfig`), for a contiguous
reduction over the last dim of `rows` rows of `n` fp32 values, vectorized by 4 (n % 4 == 0,
n >= 128) and with no split of a row across warps or blocks:
- `W` lanes share a row (`torch_sum_width`): 32 once there are 16 rows or more, up to 512 for one
  row;
- lane l adds the 4-vectors l, l + W, l + 2W, ... of the row, element i of each into accumulator
  i, in that order; then ((a0 + a1) + a2) + a3;
- the W lane values are folded by halves: lanes [0, W/2) add lanes [W/2, W), down to one (shared
  memory above a warp, shuffles with decreasing offsets within one: the same halving). The
  warp's offsets decrease in torch 2.11 and 2.13; older releases had them increasing;
- the mean is that sum times fl(rows) / fl(rows * n).
`tools/reduce_order_probe.py` checked this against torch 2.11 on an H100 (2026-11-26): every row
of 13 shapes, 1 to 524,288 rows of 128 to 5120, equal bit for bit. Where torch splits a row
across warps (n / W >= min(16 x block height, 256), e.g. 1024 x 8192) the kernels keep their own
order.

Adding 0.0 is exact, so masked lanes past the row's end change nothing. The squares of bf16 and
fp16 values are exact in fp32; an fp32 value's square is rounded before it is added (`square`:
not contracted into an fma), as torch's pow kernel stores it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from solforge import settings
from solforge.kernels.interp import INTERPRETED
from solforge.kernels.rounding import as_stored, mean_factor

_ASM_OK = tl.constexpr(not INTERPRETED)

_MAX_THREADS = 512  # ATen's reduce kernel's threads per block for fp32 (mnt_wrapper)
# SOLFORGE_TORCH_ORDER=0 (settings.torch_order): the row kernels sum with tl.sum over their tile
# instead (what they did before 2026-11-26): a little faster, and off eager's bits by a rounding now
# and then. Fixed at import: rope.py compiles it into its kernels as a global.
ENABLED = settings.current().torch_order


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def torch_sum_width(rows: int, n: int) -> int:
    """The lanes W that share a row in ATen's reduce kernel for `rows` contiguous fp32 rows of `n`
    reduced over the last dim, in the case the kernels follow (module doc); 0 where they do not
    (n % 4, n < 128, a row split across warps, or SOLFORGE_TORCH_ORDER=0)."""
    if not ENABLED or n % 4 or n < 128 or rows < 1:
        return 0
    dim0 = n // 4
    d0 = _last_pow2(dim0) if dim0 < _MAX_THREADS else _MAX_THREADS
    d1 = _last_pow2(rows) if rows < _MAX_THREADS else _MAX_THREADS
    width = min(d0, 32)
    height = min(d1, _MAX_THREADS // width)
    width = min(d0, _MAX_THREADS // height)
    if -(-n // width) >= min(height * 16, 256):  # split across warps: another order
        return 0
    return width


def sum_meta(rows: int, n: int) -> dict[str, int]:
    """The row kernels' constexprs for `row_sumsq`: W (`torch_sum_width`; 0: their own tl.sum) and
    K, the chunks of 4W a row is read in."""
    w = torch_sum_width(rows, n)
    return {"W": w, "K": -(-n // (4 * w)) if w else 0}


@triton.jit
def mul_rn(a, b):
    """fp32 a * b, rounded on its own: PTX's `mul.rn` is never contracted into a following add
    (an fma rounds once). torch stores each op's result: its square before the sum reads it, its
    mean before `+ eps`. The interpreter computes it in numpy, which contracts nothing."""
    if _ASM_OK:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def square(v):
    """fp32 v * v, rounded before anything adds it (`mul_rn`)."""
    return mul_rn(v, v)


@triton.jit
def rstd_of(ss, n, eps):
    """rsqrt(mean + eps) from a sum of squares over n, as eager computes it: the mean rounded
    (torch's factor, then its own op), the add rounded, then rsqrt (tl.rsqrt matched torch.rsqrt
    on an H100 for 2^20 values, 2026-11-26). Written `ss * factor + eps`, the compiler fuses an
    fma: 21% of a 4096 x 2560 RMSNorm's rows then had another rstd than eager's."""
    return tl.rsqrt(mul_rn(ss, mean_factor(n)) + eps)


@triton.jit
def fold_lanes(acc, ROWS: tl.constexpr, W: tl.constexpr):
    """[ROWS, 4W] accumulators (lane l's four at 4l .. 4l + 3) -> [ROWS] row sums: each lane's
    ((a0 + a1) + a2) + a3, then the lanes folded by halves."""
    a = tl.reshape(acc, [ROWS, W, 2, 2])
    even, odd = tl.split(a)  # elements 0, 2 and 1, 3 of each lane
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    v = ((a0 + a1) + a2) + a3
    for j in tl.static_range(10):  # W <= 512 = 2^9
        if (W >> (j + 1)) > 0:
            v = tl.permute(tl.reshape(v, [ROWS, 2, W >> (j + 1)]), (0, 2, 1))
            first, second = tl.split(v)
            v = first + second
    return tl.reshape(v, [ROWS])


@triton.jit
def row_sumsq(x_ptr, r_ptr, row0, n_rows, H, stride_x, stride_r, ROWS: tl.constexpr, W: tl.constexpr,
              K: tl.constexpr, ADD: tl.constexpr, S_DTYPE: tl.constexpr):
    """Rows [row0, row0 + ROWS) of x (with ADD: of x + r, rounded to S_DTYPE as add_rmsnorm stores
    it): each row's sum of squares in torch's order (module doc), read in K = cdiv(H, 4W) chunks
    (a kernel that holds the rows in registers reads them again, from cache)."""
    rows = row0 + tl.arange(0, ROWS)
    m = (rows < n_rows)[:, None]
    xr = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    rr = r_ptr + rows.to(tl.int64)[:, None] * stride_r
    c = tl.arange(0, 4 * W)[None, :]
    acc = tl.zeros([ROWS, 4 * W], dtype=tl.float32)
    for k in tl.static_range(K):
        cols = k * 4 * W + c
        mk = m & (cols < H)
        v = tl.load(xr + cols, mask=mk, other=0.0).to(tl.float32)
        if ADD:
            v = as_stored(v + tl.load(rr + cols, mask=mk, other=0.0).to(tl.float32), S_DTYPE)
        acc += square(v)
    return fold_lanes(acc, ROWS, W)


@triton.jit
def _lane_sums(x):
    """[T, H, 4L] fp32 -> [T, H, L]: each group of four consecutive squares, ((s0 + s1) + s2) + s3."""
    sq = square(x)
    a = tl.reshape(sq, [x.shape[0], x.shape[1], x.shape[2] // 4, 2, 2])
    even, odd = tl.split(a)
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return ((a0 + a1) + a2) + a3


@triton.jit
def head_sumsq_128(x1, x2):
    """A head of 128 held as its halves x1, x2 ([T, H, 64] fp32 each; rope's q/k norm): its sum of
    squares in torch's order for a row of 128: W = 32 whatever the row count (a row is 32
    4-vectors). Lanes 0-15 read x1, lanes 16-31 x2, so the first fold adds x2's lane sums to x1's;
    the rest fold by halves."""
    v = _lane_sums(x1) + _lane_sums(x2)  # [T, H, 16]
    for j in tl.static_range(4):
        v = tl.permute(tl.reshape(v, [x1.shape[0], x1.shape[1], 2, 8 >> j]), (0, 1, 3, 2))
        first, second = tl.split(v)
        v = first + second
    return tl.reshape(v, [x1.shape[0], x1.shape[1]])


def sumsq_ref(sq: torch.Tensor, width: int) -> torch.Tensor:
    """The row sums of `sq` ([rows, n] fp32 squares) in torch's order for `width` lanes a row
    (module doc), in plain torch: elementwise fp32 adds in that order. The tests' reference, and
    tools/reduce_order_probe.py's emulation."""
    rows, n = sq.shape
    chunk = 4 * width
    rounds = -(-n // chunk)
    v = torch.nn.functional.pad(sq, (0, rounds * chunk - n)).view(rows, rounds, width, 4)
    acc = v[:, 0].clone()
    for k in range(1, rounds):
        acc = acc + v[:, k]
    lanes = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    w = width
    while w > 1:
        w //= 2
        lanes = lanes[:, :w] + lanes[:, w:2 * w]
    return lanes[:, 0]
