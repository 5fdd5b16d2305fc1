"""Sums of several values of one tile in a single reduction.

`tl.sum(a) ... tl.sum(b)` costs one cross-warp round trip (shared memory and barriers) each; a
`tl.reduce` over a tuple exchanges all of them in one. The norm backwards need two or three sums
of each row, so they take these (sum2, sum3). Against separate sums on the H100 at 16384 x 2560
(tools/pair_ab.py, bench/results/2026-11-22-h100-pair-ab-s7-reductions.json): rmsnorm_bwd with the
residual gradient 132.8 -> 131.0 us, add_layernorm_bwd's best 159.2 -> 149.8; the others within 1%.

`sum_rows` adds up the per-program partial rows those kernels leave for the weight gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from solforge.kernels.interp import round_bf16
from solforge.kernels.launch import Meta, pdl
from solforge.kernels.launch import launch as _launch


@triton.jit
def _add2(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _add3(a1, b1, c1, a2, b2, c2):
    return a1 + a2, b1 + b2, c1 + c2


@triton.jit
def sum2(a, b, axis: tl.constexpr):
    """(sum of a, sum of b) over `axis`, in one reduction."""
    return tl.reduce((a, b), axis, _add2)


@triton.jit
def sum3(a, b, c, axis: tl.constexpr):
    """(sum of a, sum of b, sum of c) over `axis`, in one reduction."""
    return tl.reduce((a, b, c), axis, _add3)


@triton.jit
def fold(a, at, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """A row tile's main block a [ROWS, BLOCK_H] folded onto its tail's width and added to the
    tail's at [ROWS, BLOCK_T] (BLOCK_H a multiple of BLOCK_T): the same row sums as a and at
    summed apart, from one reduction instead of two. Where the tail is one pass of the main
    block's layout (rmsnorm_bwd.BwdConfig.blocks), the fold adds values a thread already holds."""
    return tl.sum(tl.reshape(a, [ROWS, BLOCK_H // BLOCK_T, BLOCK_T]), 1) + at


# ----------------------------------------------------------------------------------------------
# Summing the per-program partial rows of a weight gradient


@triton.jit
def _sum_rows_kernel(part_ptr, out0_ptr, out1_ptr, M, r0, r1, r2, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                     PDL: tl.constexpr, INTERP: tl.constexpr):
    """out0 = the sum of part's rows [r0, r1), out1 = of rows [r1, r2) (grid axis 1: which), rows in
    order (deterministic), cast to each output's dtype on store. Grid (column blocks, segments).
    PDL: launched with programmatic dependent launch, so it waits here for the kernel that wrote
    `part` (all of it, its writes visible) instead of at the launch."""
    if PDL:
        gdc_wait()
    seg = tl.program_id(1)
    lo = tl.where(seg == 0, r0, r1)
    hi = tl.where(seg == 0, r1, r2)
    cols = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cm = cols < M
    acc = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
    n_iter = tl.cdiv(hi - lo, BLOCK_R)
    for i in range(0, n_iter):
        rows = lo + i * BLOCK_R + tl.arange(0, BLOCK_R)
        m = (rows < hi)[:, None] & cm[None, :]
        acc += tl.load(part_ptr + rows.to(tl.int64)[:, None] * M + cols[None, :], mask=m, other=0.0)
    total = tl.sum(acc, axis=0)
    if seg == 0:
        _store_sum(out0_ptr + cols, total, cm, INTERP)
    else:
        _store_sum(out1_ptr + cols, total, cm, INTERP)


@triton.jit
def _store_sum(ptrs, total, mask, INTERP: tl.constexpr):
    if INTERP and ptrs.dtype.element_ty == tl.bfloat16:
        total = round_bf16(total)  # the interpreter's cast truncates; the GPU's rounds
    tl.store(ptrs, total.to(ptrs.dtype.element_ty), mask=mask)


def sum_rows(part: torch.Tensor, bounds: Sequence[int], outs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """outs[s] = part[bounds[s]:bounds[s + 1]].sum(0), each in its own dtype, in one launch: the
    last step of the norm backwards, whose programs each leave one fp32 partial row of a weight
    gradient. Returns `outs`.

    part: (R, M) fp32, contiguous; bounds: 2 or 3 row offsets (one or two segments, e.g. rope's q
    and k weights, layernorm's dw and db); outs: one (M,) contiguous tensor per segment, any float
    dtype (the weight's: no cast follows). Separate tensors, not views of one: a custom op's outputs
    must not alias. The rows are summed in order, so the result is the same on every run, unlike
    atomics. On the H100 (tools/kernel_split.py, -kernel-split-s7-torch-sum.json against
    -kernel-split-s7.json): 2.7 us for rmsnorm_bwd's 132 x 2560 where torch's sum took 4.7, 4.0 for
    layernorm_bwd's two segments where torch took 7.1, and 4.2 for rope's q and k weights at B2 S8192
    where two sums and two casts took 14.4."""
    if part.dtype != torch.float32 or part.dim() != 2 or not part.is_contiguous():
        raise ValueError(f"sum_rows: part must be 2-D contiguous fp32, got {part.dtype} {tuple(part.shape)}")
    n_seg = len(bounds) - 1
    R, M = part.shape
    if n_seg not in (1, 2) or len(outs) != n_seg or list(bounds) != sorted(bounds) or bounds[0] < 0 \
            or bounds[-1] > R or any(o.shape != (M,) or not o.is_contiguous() for o in outs):
        raise ValueError(f"sum_rows: bounds {list(bounds)} for {R} rows, outs {[tuple(o.shape) for o in outs]} "
                         f"for M = {M}: one contiguous (M,) tensor per segment")
    if M == 0:
        return tuple(outs)
    r2 = bounds[2] if n_seg == 2 else bounds[1]
    meta = _meta(triton.next_power_of_2(max(b - a for a, b in zip(bounds, bounds[1:], strict=False))),
                 pdl(part.device))
    _launch(_sum_rows_kernel, (triton.cdiv(M, meta["BLOCK_M"]), n_seg),
            (part, outs[0], outs[-1], M, bounds[0], bounds[1], r2), meta)
    return tuple(outs)


_INTERPRETED = type(_sum_rows_kernel).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=64)
def _meta(seg_rows: int, use_pdl: bool) -> Meta:
    """A tile of up to 512 rows x 8-64 columns (4K values on 4 warps): a segment of up to 512 rows
    (the norms' 132-528 partial rows: 1 to 4 programs per SM) is loaded at once, one memory latency
    per program, and the columns are spread over many programs; longer segments loop. (With 256
    rows a tile, 396 partial rows took two loads a program: 4.9 us on the H100.) `use_pdl`: launched with
    programmatic dependent launch (launch.pdl), so its launch overlaps the end of the kernel that
    writes the partial rows (which calls gdc_launch_dependents when its loop is done)."""
    block_r = max(16, min(512, seg_rows))
    extra = {"launch_pdl": True} if use_pdl else {}
    return Meta(BLOCK_R=block_r, BLOCK_M=max(8, min(64, 4096 // block_r)), PDL=use_pdl, INTERP=_INTERPRETED,
                num_warps=4, **extra)


def _vectorized_sums() -> None:
    """Under Triton's interpreter, sum2's and sum3's reductions run as the interpreter's own tl.sum of
    each value (CPU speed only; the GPU compiles the tuple reduction as written).

    Triton 3.6's interpreter reduces with a combine function it does not know (any but its own
    sum/min/max/argmin/argmax) one element at a time: a Python call of the combine, through the
    interpreter's op wrappers, per element of the tile. A norm backward's [rows, H] tile took ~1000
    such calls, and sum2 was the larger part of every CPU training test's time (measured: 23 of 41 s
    of a LoRA model's optimize by cProfile). _add2 and _add3 add each value of the tuple to its own
    accumulator and nothing else, so the result is each value's sum: numpy's sum, in its order
    rather than one after another (fp32 either way, as a GPU's tree order differs too).
    tests/test_reduce.py runs the kernels both ways against torch's sums."""
    from triton.runtime import interpreter

    ops = getattr(interpreter, "ReduceOps", None)
    real = getattr(ops, "generic_reduce", None)
    if real is None or getattr(real, "solforge_sums", False) or not hasattr(ops, "sum"):
        return
    sums = {_add2.fn, _add3.fn}

    def generic_reduce(self, input):  # noqa: ANN001, ANN202  (the interpreter's signature)
        if getattr(self.combine_fn, "fn", None) in sums:
            return [self.sum(x) for x in input]
        return real(self, input)

    generic_reduce.solforge_sums = True  # type: ignore[attr-defined]
    generic_reduce.solforge_real = real  # type: ignore[attr-defined]  (tests run the element-wise path too)
    ops.generic_reduce = generic_reduce


if _INTERPRETED:
    _vectorized_sums()
