"""The schedule variants beyond one row per program: `tiles` (reductions over dims that are not the
inputs' innermost, tiles along the contiguous kept dim; pointwise regions that transpose, 2-D
tiles read along the input's contiguous dim and stored along the output's) and `split` (few long
rows, partials combined across programs). Each region's kernels under a covering sample of the variant's space
(the whole of it on a GPU) against the region's fp64 reference, fp32 and bf16 inputs, odd shapes,
permuted and strided inputs; the heuristic's choice; schedule validity."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton
from codegen_helpers import check_region, trace, values
from conftest import FULL_SWEEPS, covering

from solforge.codegen import layout
from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen.lower import Lowered
from solforge.codegen.triton_gen import _arg_names, generate
from solforge.numerics import compare

pytestmark = pytest.mark.usefixtures("on_device")

DTYPES = [torch.float32, torch.bfloat16]


def _r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _region(fn: Callable[..., Any], *xs: torch.Tensor) -> tuple[Lowered, list[torch.Tensor]]:
    """The one region of fn (its reference checked against the graph's own values, its kernel
    under the heuristic against the reference) and its inputs."""
    gm = trace(fn, *xs)
    (fr,) = RG.form_regions(gm.graph)
    env = values(gm, *xs)
    check_region(fr, env, samples=0)
    return fr.lowered, [env[a] for a in fr.inputs]


def _check(low: Lowered, ins: list[torch.Tensor], scheds: list[SC.Schedule]) -> None:
    ref = REF.reference(low.ir, ins)
    for s in scheds:
        assert SC.is_valid(s, low), s.encode()
        got = RT.run(low, s, ins)
        for k, (g, r) in enumerate(zip(got, ref, strict=True)):
            c = compare(g, r)
            assert c.ok, f"schedule {s.encode()}, output {k}: {c.reason}"


def _cost(c: SC.Schedule, low: Lowered) -> int:
    """Tiles the interpreter walks under c (it pays per program and per loop step)."""
    s = low.space
    if c.variant == "tiles" and not low.reduces:
        return s.numel // (c.block * c.rblock)
    if c.variant == "tiles":
        return triton.cdiv(s.rows, c.block) * triton.cdiv(s.cols, c.rblock) + c.splits
    return triton.cdiv(s.rows, c.rows) * triton.cdiv(s.cols, c.block) + c.splits


def _sweep(low: Lowered, ins: list[torch.Tensor], variant: str) -> int:
    """The variant's configs in the region's space: a covering sample here (each field's values at
    their cheapest pairing for the interpreter; num_warps is not in the source, so the interpreter
    runs every value of it alike), all of them on a GPU."""
    configs = sorted((c for c in SC.space(low) if c.variant == variant), key=lambda c: _cost(c, low))
    assert configs, f"no {variant} schedule in the space"
    run = covering(configs, ignore=("num_warps",))
    _check(low, ins, run)
    return len(run)


# ------------------------------------------------------------------------------------------------
# tiles


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiles_sum_mean_amax_var_over_a_middle_dim(dtype: torch.dtype) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(1), x.mean(1, keepdim=True), x.amax(1), x.var(1)

    low, ins = _region(f, _r(3, 37, 5, 7, dtype=dtype))
    assert low.space.reduced == (1,) and low.space.stages == 2
    h = SC.heuristic(low)
    assert h.variant == "tiles" and h.contig == 3, h  # W, the inputs' contiguous dim, is kept
    _sweep(low, ins, "tiles")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiles_softmax_and_log_softmax_over_dim_1(dtype: torch.dtype) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.softmax(x, 1), torch.log_softmax(x.float(), 1)

    low, ins = _region(f, _r(3, 37, 5, 7, dtype=dtype) * 4)
    assert SC.heuristic(low).variant == "tiles"
    _sweep(low, ins, "tiles")


def test_tiles_layernorm_over_channels() -> None:
    # a LayerNorm over C of NCHW (ConvNeXt's channels-first norm): stats over dim 1, weight per channel
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        m = x.mean(1, keepdim=True)
        v = ((x - m) ** 2).mean(1, keepdim=True)
        return ((x - m) * torch.rsqrt(v + 1e-6) * w[None, :, None, None] + b[None, :, None, None]).to(x.dtype)

    low, ins = _region(f, _r(3, 37, 5, 7, dtype=torch.bfloat16), _r(37), _r(37))
    assert SC.heuristic(low).variant == "tiles"
    _sweep(low, ins, "tiles")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiles_batchnorm_stats_of_a_channels_last_input(dtype: torch.dtype) -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        mean = x.mean((0, 2, 3), keepdim=True)
        var = ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
        return (x - mean) * torch.rsqrt(var + 1e-5) * w.view(1, -1, 1, 1)

    x = _r(3, 5, 7, 37, dtype=dtype).permute(0, 3, 1, 2)  # NCHW, channels-last in memory
    low, ins = _region(f, x, _r(37, dtype=dtype))
    assert low.space.reduced == (0, 2, 3) and layout.inner_dim(low) == 1
    h = SC.heuristic(low)
    assert h.variant == "tiles" and h.contig == 1, h
    _sweep(low, ins, "tiles")


def test_batchnorm_stats_of_nchw_stay_rows() -> None:
    # the reduced dims hold W, the contiguous one: the row schedules read coalesced, no tiles
    def f(x: torch.Tensor) -> torch.Tensor:
        mean = x.mean((0, 2, 3), keepdim=True)
        return x - mean

    low, ins = _region(f, _r(3, 37, 5, 7))
    assert layout.inner_dim(low) == 3
    assert SC.heuristic(low).variant in ("rows", "looped")
    assert not [c for c in SC.space(low) if c.variant == "tiles"]


def test_tiles_contiguous_dim_not_the_last_kept_dim() -> None:
    # logical (5, 7, 9) laid out with dim 0 innermost: reduced dim 1, kept (0, 2), contiguous along 0.
    # The row index is decomposed with dim 0 fastest; row outputs and loop outputs land where they belong
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(1), torch.softmax(x, 1)

    x = _r(9, 7, 5).permute(2, 1, 0)
    low, ins = _region(f, x)
    assert layout.inner_dim(low) == 0
    h = SC.heuristic(low)
    assert h.variant == "tiles" and h.contig == 0, h
    _sweep(low, ins, "tiles")
    # the same region with the last kept dim walked fastest is valid too (coalesced or not, correct)
    _check(low, ins, [SC.Schedule("tiles", 8, 1, 1, 2, 4)])


def test_split_tiles_batchnorm_of_a_channels_last_input() -> None:
    # 5 channels, 3 x 37 x 37 reduced: one tile of kept elements, so the tiles split the reduction
    # across programs too (var: two stages, three launches)
    def f(x: torch.Tensor) -> torch.Tensor:
        mean = x.mean((0, 2, 3), keepdim=True)
        var = ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
        return (x - mean) * torch.rsqrt(var + 1e-5)

    x = _r(3, 37, 37, 5, dtype=torch.bfloat16).permute(0, 3, 1, 2)
    low, ins = _region(f, x)
    assert low.space.rows == 5 and low.space.cols == 3 * 37 * 37
    split = [c for c in SC.space(low) if c.variant == "tiles" and c.splits > 1]
    assert split
    # narrow chunks (the interpreter pays per loop step) run in the unsplit tiles tests
    ignore = ("num_warps",) if FULL_SWEEPS else ("num_warps", "rblock")
    run = covering(sorted(split, key=lambda c: _cost(c, low)), ignore=ignore)
    _check(low, ins, run)
    # 3 splits of 1408 (11 chunks of 128), the last one short (1291)
    _check(low, ins, [SC.Schedule("tiles", 8, 1, 2, 1, 128, 3)])


def test_tiles_mean_over_dim_0_and_a_transposed_input() -> None:
    low, ins = _region(lambda x: x.mean(0), _r(37, 13))
    assert SC.heuristic(low).variant == "tiles"
    _sweep(low, ins, "tiles")
    low, ins = _region(lambda y: (y.t() * 2).sum(-1), _r(37, 13))  # y.t(): the reduced dim is the strided one
    assert layout.inner_dim(low) == 0 and SC.heuristic(low).contig == 0
    _sweep(low, ins, "tiles")


# ------------------------------------------------------------------------------------------------
# split


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_full_reduction_to_a_scalar(dtype: torch.dtype) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(), x.amax()

    low, ins = _region(f, _r(3, 37, 5, 7, dtype=dtype))
    assert low.space.rows == 1
    _sweep(low, ins, "split")


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_mse_loss(dtype: torch.dtype) -> None:
    def f(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.mean((p - t) ** 2)

    p = _r(37, 58, dtype=dtype)[:, ::2]  # strided
    low, ins = _region(f, p, _r(37, 29, dtype=dtype))
    _sweep(low, ins, "split")


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_two_stage_reductions(dtype: torch.dtype) -> None:
    # softmax (max, then the sum of exps), log_softmax and var (mean, then squares): each phase
    # combines the partials of the stages before it
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.softmax(x, -1), torch.log_softmax(x, -1), x.var(-1)

    low, ins = _region(f, _r(3, 777, dtype=dtype) * 3)
    assert low.space.stages == 2
    _sweep(low, ins, "split")
    # two rows a program, 3 rows: a row tail in every phase; 3 splits of 256 (the last one short)
    _check(low, ins, [SC.Schedule("split", 128, 2, 2, 1, 1, 3)])


def test_split_is_the_default_for_few_long_rows() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(-1), x - x.mean(-1, keepdim=True)

    # rows of mean 1, not 0: a sum of 9000 values of mean 0 can come out near 0 (0.83 on an H100),
    # where the fp32 rounding of any order of summation (~3e-5 there, each schedule its own order)
    # exceeds the element tolerance's atol; away from 0 a sum missing a single value still fails
    low, ins = _region(f, _r(3, 9000) + 1)
    h = SC.heuristic(low)
    assert h.variant == "split" and h.splits >= 2, h
    _check(low, ins, [h])
    # many rows: the rows alone fill the GPU, no split in the space
    many = _region(lambda x: x.sum(-1), _r(2 * SC.SMS, 3))[0]
    assert not [c for c in SC.space(many) if c.variant == "split"]


# ------------------------------------------------------------------------------------------------
# tiles of a transposing pointwise region


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_tiles_of_a_transpose(dtype: torch.dtype) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(x.t()) * 2 + 1).contiguous()

    low, ins = _region(f, _r(37, 29, dtype=dtype))
    assert layout.transpose_dims(low) == (1, 0)  # stored along dim 1, read along dim 0
    h = SC.heuristic(low)
    assert h.variant == "tiles" and h.contig == 0, h
    _sweep(low, ins, "tiles")


def test_pointwise_tiles_of_a_channels_last_input() -> None:
    # channels-last NCHW in, contiguous out, a per-channel bias: C (read) and W (stored) tiled,
    # N and H from the program id
    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (F.gelu(x) + b.view(1, -1, 1, 1)).contiguous()

    x = _r(3, 5, 7, 37, dtype=torch.bfloat16).permute(0, 3, 1, 2)
    low, ins = _region(f, x, _r(37, dtype=torch.bfloat16))
    assert layout.transpose_dims(low) == (3, 1)
    assert SC.heuristic(low).variant == "tiles"
    _sweep(low, ins, "tiles")


@pytest.mark.parametrize("dims", [4, 5])
def test_pointwise_tiles_walk_the_outputs_run_as_one_dim(dims: int) -> None:
    """A channels-last input stored NCHW (NCDHW): the tile's slow side is H*W (D*H*W), one flat
    dim over which the output is one linear range (layout.store_run), addressed by the tile's own
    index (no masked tail per row of W: W = 7 in tiles of 64 wasted most lanes); odd sizes, every
    tiles schedule of the space against the reference, then the same kernel on inputs whose H and W
    are not one range (a slice of W) and on a contiguous input."""
    from solforge.codegen.triton_gen import generate

    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x) * 2.0 + b.view(1, -1, *([1] * (dims - 2)))).contiguous()

    sizes = (3, 5, 7) if dims == 5 else (5, 7)
    cl = torch.channels_last if dims == 4 else torch.channels_last_3d
    x = _r(2, 37, *sizes).contiguous(memory_format=cl)
    low, ins = _region(f, x, _r(37))
    fast, slow = SC.tile_axes(SC.heuristic(low), low)
    assert fast == 1 and slow == tuple(range(2, dims)), (fast, slow)
    assert SC.tile_extent(low, slow) == math.prod(sizes)
    src = generate(low, SC.heuristic(low))
    assert "ib * s_out0_" in src and "ib * s_in" in src  # the run addressed by ib, in and out
    _sweep(low, ins, "tiles")
    ref = REF.reference(low.ir, ins)
    wide = _r(2, 37, *sizes[:-1], sizes[-1] + 4).contiguous(memory_format=cl)[..., :sizes[-1]]
    wide.copy_(ins[0] if ins[0].dim() == dims else ins[1])
    for other in (wide, wide.contiguous()):
        args = [other if a.dim() == dims else a for a in ins]
        got = RT.run(low, SC.heuristic(low), args)
        assert compare(got[0], ref[0]).ok


@pytest.mark.parametrize(("w", "hint"), [(5, 4), (14, 8), (8, None)])
def test_stride_arguments_divisible_by_4_are_said_so(w: int, hint: int | None) -> None:
    """A transposing tile stores an NCHW output along H*W; its channel stride H*W is 20 (4 mod 16)
    for W = 5, 56 (8 mod 16) for W = 14, so the kernel is told (runtime.stride_aligns -> generate's
    `aligns`: `s // 4 * 4`, which Triton's alignment analysis reads); 32 Triton marks itself. Every
    hint matches its argument's alignment; odd sizes, the kernel against the reference."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(x) * 3.0).contiguous()

    x = _r(2, 37, 4, w).contiguous(memory_format=torch.channels_last)
    low, ins = _region(f, x)
    aligns = RT.stride_aligns((*ins, *RT.empty_outputs(low, "cpu")))
    src = generate(low, SC.heuristic(low), None, aligns)
    hints = {ln.split("=")[0].strip(): ln.strip() for ln in src.splitlines() if ln.strip().startswith("s_")}
    names = [n for n in _arg_names(low, SC.heuristic(low)) if n.startswith("s_")]
    assert hints == {n: f"{n} = {n} // {a} * {a}" for n, a in zip(names, aligns, strict=True) if a in (2, 4, 8)}
    assert hints.get("s_out0_1") == (f"s_out0_1 = s_out0_1 // {hint} * {hint}" if hint else None), hints
    _check(low, ins, [SC.heuristic(low)])


def test_eviction_policies_as_inductor_sets_them() -> None:
    """A LayerNorm over rows of 300 in chunks of 128 (three passes over memory: mean, variance,
    the stores; each a loop and its peeled tail): the first two passes' loads keep the row in L2
    (`evict_last`: a later pass reads it again), the last pass's go first, the weight broadcast
    over the rows is kept; a one-pass schedule (the row in registers) sets none but the weight's.
    Against the reference."""
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
        return (x - mean) * torch.rsqrt(v + 1e-5) * w

    low, ins = _region(f, _r(5, 300), _r(300))
    looped = SC.Schedule("looped", 128, 1, 4, 1)
    loads = [ln for ln in generate(low, looped).splitlines() if "tl.load(" in ln]
    x = [ln for ln in loads if "tl.load(in0" in ln]
    assert [("evict_last" in ln, "evict_first" in ln) for ln in x] == [(True, False)] * 4 + [(False, True)] * 2, x
    assert all("evict_last" in ln for ln in loads if "tl.load(in1" in ln)
    rows = SC.Schedule("rows", 512, 1, 4, 1)
    assert SC.is_valid(rows, low)
    one = [ln for ln in generate(low, rows).splitlines() if "tl.load(" in ln]
    assert not any("evict" in ln for ln in one if "tl.load(in0" in ln), one
    _check(low, ins, [looped, rows])


def test_a_channels_last_pointwise_region_walks_along_its_channels() -> None:
    """A per-channel scale and shift, a residual add and a ReLU between channels-last tensors (a
    ResNet block between channels-last convolutions): in and out laid out alike (no transpose), the
    flat index walks C fastest, so loads and stores are contiguous; odd sizes, the pointwise
    schedules against the reference. A contiguous region keeps walking its last dim."""
    from solforge.codegen.triton_gen import generate

    def f(x, w, b, r):  # noqa: ANN001, ANN202
        return torch.relu(x * w.view(1, -1, 1, 1) + b.view(1, -1, 1, 1) + r)

    cl = torch.channels_last
    x, r = (_r(3, 37, 5, 7).contiguous(memory_format=cl) for _ in range(2))
    low, ins = _region(f, x, _r(37), _r(37), r)
    assert layout.transpose_dims(low) is None and SC.contig_dim(low) == 1
    h = SC.heuristic(low)
    assert h.variant == "pointwise" and h.contig == 1, h
    assert "kk % 37" in generate(low, h)  # C is the flat index's fastest digit
    _sweep(low, ins, "pointwise")
    flat = _region(f, x.contiguous(), _r(37), _r(37), r.contiguous())[0]
    assert SC.contig_dim(flat) == len(flat.space.shape) - 1 and "kk % 7" in generate(flat, SC.heuristic(flat))


def test_a_view_keeps_the_index_of_a_dim_it_passes_through() -> None:
    """ConvNeXt's permuted residual, small and odd: a token-major (B*H*W, C) tensor scaled per
    channel, viewed as (B, H, W, C), permuted to NCHW and added to an NCHW one. The view reads C
    as the loop's own C index (no division of a linear index by C, which hid the contiguity from
    Triton), every schedule against the reference; `_groups` cuts the two shapes by equal
    products."""
    from solforge.codegen.triton_gen import _groups, generate

    assert _groups((2, 5, 7, 37), (70, 37)) == [([0, 1, 2], [0]), ([3], [1])]
    assert _groups((6, 4), (4, 6)) == [([0, 1], [0, 1])]
    assert _groups((2, 1, 3), (2, 3, 1)) == [([0], [0]), ([1, 2], [1]), ([], [2])]

    def f(y, g, x):  # noqa: ANN001, ANN202
        return x + (g * y).view(2, 5, 7, 37).permute(0, 3, 1, 2)

    low, ins = _region(f, _r(70, 37), _r(37), _r(2, 37, 5, 7))
    for c in [SC.heuristic(low), *(c for c in SC.space(low) if c.variant == "pointwise")][:3]:
        src = generate(low, c)
        # y's load (in1, the token-major input) indexes C with the loop's own C variable
        y = [ln for ln in src.splitlines() if "tl.load(in1 +" in ln]
        assert y and not any("//" in ln or "%" in ln for ln in y), src
        assert not any("// 37" in ln or "% 37" in ln for ln in src.splitlines() if ln.strip().startswith("ir")), src
    _sweep(low, ins, "tiles")


@pytest.mark.parametrize("pool", ["avg1d", "max2d"])
def test_a_padded_pool_is_no_transpose(pool: str) -> None:
    """A pool whose zero border puts the loop's first point outside its input (KernelBench's 1-D
    average pool padded by 4): its taps read along the same dim the output is stored along, so no
    tiles and a pointwise heuristic along W; odd sizes, the pointwise schedules against the reference."""
    def f(x: torch.Tensor) -> torch.Tensor:
        if pool == "avg1d":
            return F.avg_pool1d(x, 8, stride=1, padding=4)
        return F.max_pool2d(x, 3, stride=2, padding=1)

    x = _r(3, 5, 67) if pool == "avg1d" else _r(2, 5, 13, 37)
    low, ins = _region(f, x)
    assert layout.inner_dim(low) == len(x.shape) - 1
    assert layout.transpose_dims(low) is None, [w.strides for w in layout.walk(low)]
    h = SC.heuristic(low)
    assert h.variant == "pointwise" and h.contig == len(low.space.shape) - 1, h
    _sweep(low, ins, "pointwise")


def test_pointwise_without_a_transpose_has_no_tiles() -> None:
    low = _region(lambda x, y: x * y + 1, _r(5, 37), _r(37))[0]
    assert layout.transpose_dims(low) is None and SC.heuristic(low).variant == "pointwise"
    assert not [c for c in SC.space(low) if c.variant == "tiles"]


# ------------------------------------------------------------------------------------------------
# validity and the text form


def test_validity_of_the_new_variants() -> None:
    low = _region(lambda x: x.sum(1), _r(3, 37, 5))[0]  # kept (0, 2), reduced 1 (37)
    assert SC.is_valid(SC.Schedule("tiles", 16, 1, 1, 2, 8), low)
    assert not SC.is_valid(SC.Schedule("tiles", 16, 1, 1, 1, 8), low)  # contig: a reduced dim
    assert not SC.is_valid(SC.Schedule("tiles", 16, 1, 1, 2, 128), low)  # rblock past the reduced extent
    assert not SC.is_valid(SC.Schedule("tiles", 32, 1, 1, 2, 8), low)  # block past the rows (15)
    assert not SC.is_valid(SC.Schedule("looped", 16, 1, 1, 1, 8), low)  # rblock on another variant
    assert SC.is_valid(SC.Schedule("tiles", 16, 1, 1, 2, 8, 3), low)  # split tiles: 3 x 16 of 37
    assert not SC.is_valid(SC.Schedule("tiles", 16, 1, 1, 2, 8, 4), low)  # 4 x 16: the last split empty
    assert not SC.is_valid(SC.Schedule("tiles", 16, 1, 1, 2, 64, 2), low)  # one chunk covers the extent
    loss = _region(lambda x: x.sum(), _r(37, 29))[0]  # 1073 columns
    assert SC.is_valid(SC.Schedule("split", 64, 1, 2, 1, 1, 4), loss)
    assert not SC.is_valid(SC.Schedule("split", 64, 1, 2, 1, 1, 1), loss)  # one split: that is looped
    assert not SC.is_valid(SC.Schedule("split", 256, 1, 2, 1, 1, 4), loss)  # 4 x 512: the last split empty
    assert not SC.is_valid(SC.Schedule("rows", 2048, 1, 4, 1, 1, 2), loss)  # splits on another variant
    for s in (SC.Schedule("tiles", 16, 1, 1, 2, 8), SC.Schedule("split", 64, 2, 2, 1, 1, 5)):
        assert SC.Schedule.decode(s.encode()) == s
    assert SC.Schedule("looped", 64, 2, 2, 1).encode() == "looped:b=64:r=2:w=2:c=1"  # old texts unchanged


def test_a_huge_row_is_split_to_fill_the_sms() -> None:
    """A loss's mean over 1G values (KernelBench's MSELoss): programs of 128K values each, 8192 of
    them (as Inductor's split reduction), not two an SM (256), where only row values are stored (a
    region storing every point keeps 1024); the space goes up to 8192 for such
    rows, not for a row of 1M (each split keeps 32K columns at least), and holds no schedule whose
    combining tile would spill (8192 partials on 2 warps). A mean of squares over 131067 values
    (odd) in 8192 splits of one 16-wide chunk, the last one 11 wide, against the reference (fake traces for the shapes:
    no tensor that size is made)."""
    with torch.device("meta"):
        huge, small = torch.empty(1 << 30), torch.empty(1 << 20)
    for x, top in ((huge, 8192), (small, 128)):
        (fr,) = RG.form_regions(trace(lambda x: x.pow(2).mean(), x).graph)
        split = [c for c in SC.space(fr.lowered) if c.variant == "split"]
        assert max(c.splits for c in split) == top, sorted({c.splits for c in split})
        assert all(c.rows * c.splits // (32 * c.num_warps) <= 64 for c in split)
    (fr,) = RG.form_regions(trace(lambda x: x.pow(2).mean(), huge).graph)
    h = SC.heuristic(fr.lowered)
    assert h.variant == "split" and h.splits == 8192 and SC.is_valid(h, fr.lowered), h
    assert not SC.is_valid(dataclasses.replace(h, num_warps=2), fr.lowered)  # 128 partials a thread
    # only the row's first program of the storing phase combines the partials (none else loads them)
    assert "if sp == 0:" in generate(fr.lowered, h)
    # values stored at every point (x / ||x||: each program of the last phase reads every partial,
    # splits^2 loads) keep about eight programs an SM
    (fr,) = RG.form_regions(trace(lambda x: x / x.norm(), huge).graph)
    h = SC.heuristic(fr.lowered)
    assert h.variant == "split" and h.splits == 1024 and "if sp == 0:" not in generate(fr.lowered, h), h
    low, ins = _region(lambda x: x.pow(2).mean(), _r(131067))
    c = SC.Schedule("split", 16, 1, 4, 0, 1, 8192)
    assert SC.is_valid(c, low), c
    _check(low, ins, [c])


@pytest.mark.parametrize(("rows", "cols", "splits"), [(4, 1 << 17, (2, 4, 8, 16, 32, 64, 128)),
                                                      (1024, 1 << 16, (2, 4)), (1024, 1 << 15, ())])
def test_split_schedules_for_few_rows_and_for_long_ones(rows: int, cols: int, splits: tuple[int, ...]) -> None:
    """Few rows: splits up to 128 (the SMs would idle); many rows of 64K or more (a GroupNorm of
    1024 groups of 258K values): splits of 2 and 4 too, for the tuner to weigh; many shorter rows:
    none. The loop space alone decides (a fake trace: no tensor of that size is made)."""
    with torch.device("meta"):
        x = torch.empty(rows, cols)
    gm = trace(lambda x: x - x.mean(-1, keepdim=True), x)
    (fr,) = RG.form_regions(gm.graph)
    got = sorted({c.splits for c in SC.space(fr.lowered) if c.variant == "split"})
    assert tuple(got) == splits


def test_a_split_whose_last_program_reaches_past_the_row_is_masked() -> None:
    """5120 columns in 3 splits of 2048 (1024-wide chunks: the chunk width divides the row, the
    splits do not): the last program's second chunk lies past the row's end and reads nothing
    (it read out of bounds, an infinite sum, before the mask was kept); a split tile the same way.
    Seeded: a column sum of 5120 normal values can cancel to near 0, below the sum's rounding."""
    torch.manual_seed(0)
    x = torch.randn(3, 5120)
    gm = trace(lambda x: (x * 2).sum(-1), x)
    (fr,) = RG.form_regions(gm.graph)
    low = fr.lowered
    c = SC.Schedule("split", 1024, 1, 4, SC.contig_dim(low), 1, 3)
    assert SC.is_valid(c, low) and 3 * SC.split_chunk(c, low) > 5120
    for got, want in zip(RT.run(low, c, [x]), REF.reference(low.ir, [x]), strict=True):
        assert compare(got, want).ok
    y = torch.randn(5120, 8)
    gm = trace(lambda y: y.sum(0) * 3, y)
    (fr,) = RG.form_regions(gm.graph)
    low = fr.lowered
    t = SC.Schedule("tiles", 8, 1, 4, 1, 1024, 3)
    assert SC.is_valid(t, low) and 3 * SC.split_chunk(t, low) > 5120
    for got, want in zip(RT.run(low, t, [y]), REF.reference(low.ir, [y]), strict=True):
        assert compare(got, want).ok


def test_a_thread_unrolls_a_bounded_number_of_loads() -> None:
    """Two chained 3-D max pools read 216 taps a point: every schedule of the space, the heuristic
    too, keeps a thread's elements x loads within the cap (a 256 x 32 tile on 16 warps made 93K
    lines of PTX that ptxas had not compiled after 6 minutes); a region of two loads keeps its
    widest tiles; the kernels against the reference."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return F.max_pool3d(F.max_pool3d(torch.sigmoid(x), 3), 2)

    low, ins = _region(f, _r(2, 3, 13, 14, 15))
    assert layout.loads_per_point(low) == 216
    space = SC.space(low)
    assert space and SC.is_valid(SC.heuristic(low), low)
    for c in space:
        per_thread = max(1, SC.tile_elems(c) // (32 * c.num_warps))
        assert per_thread == 1 or per_thread * 216 <= SC._MAX_UNROLLED_LOADS, c.encode()
    _check(low, ins, [SC.heuristic(low), *space[:2]])
    # a stride-1 pool chained into a stride-2 one: taps of the two reach the same positions, but
    # the kernel loads once per chain of taps (9 x 9), and so the count
    def g(x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.max_pool2d(torch.relu(x), 3, 1, 1), 3, 2, 1)

    chained, _ = _region(g, _r(2, 5, 9, 11))
    from solforge.codegen.triton_gen import generate

    assert layout.loads_per_point(chained) == 81 == generate(chained, SC.heuristic(chained)).count("tl.load(")
    plain, _ = _region(lambda x, y: x * y + 1, _r(64, 300), _r(64, 300))
    assert layout.loads_per_point(plain) == 2
    assert any(c.block == 4096 for c in SC.space(plain))  # 16 a thread: the per-thread cap, not the loads
