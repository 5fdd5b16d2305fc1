"""(sum, sum of squared deviations) pairs in one pass (codegen/online.py's VAR_DOC, Schedule.online
= 1): GroupNorm, LayerNorm, var/std with a correction, InstanceNorm-like statistics and BatchNorm
statistics of a channels-last tensor (tiles), over rows longer than the chunk (several chunks and a
tail), split across programs, odd shapes, values far from zero (where E[x^2] - E[x]^2 would lose
three of fp32's seven digits), fp32 and bf16. Each kernel against the region's fp64 reference; the one-pass source
has one loop fewer than the two-pass one; what is not a pair is left alone."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from codegen_helpers import trace
from conftest import DEVICE

from solforge.codegen import online
from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen.lower import Lowered
from solforge.codegen.triton_gen import generate, passes
from solforge.numerics import compare
from solforge.plan.generated import _group_norm

pytestmark = pytest.mark.usefixtures("on_device")


def _low(fn: Callable[..., Any], *xs: torch.Tensor) -> Lowered:
    (r,) = RG.form_regions(trace(fn, *xs).graph)
    return r.lowered


def _check(low: Lowered, ins: list[torch.Tensor], sched: SC.Schedule) -> None:
    assert SC.is_valid(sched, low), sched.encode()
    ref = REF.reference(low.ir, ins)
    for k, (g, r) in enumerate(zip(RT.run(low, sched, ins), ref, strict=True)):
        c = compare(g, r)
        assert c.ok, f"{sched.encode()}, output {k}: {c.reason}"


def _loops(src: str) -> int:
    return len(re.findall(r"^\s*for k0 in tl\.range", src, flags=re.M))


def _one_pass_vs_two(low: Lowered, ins: list[torch.Tensor], chunked: list[SC.Schedule]) -> None:
    """Each chunked schedule with and without its pairs in one pass, against the reference; the
    one-pass source has one loop fewer per pair (a split: one launch fewer)."""
    pairs = online.var_pairs(low)
    assert pairs
    for c in chunked:
        one = dataclasses.replace(c, online=1)
        _check(low, ins, c)
        _check(low, ins, one)
        if c.splits > 1:
            assert len(passes(low, one)) == len(passes(low, c)) - len(pairs)
        else:
            assert _loops(generate(low, one)) == _loops(generate(low, c)) - len(pairs)


def _layer_norm(x: torch.Tensor, w: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm over the last dim as its decomposition computes it (var_mean, rsqrt)."""
    v, m = torch.var_mean(x, -1, correction=0, keepdim=True)
    y = (x - m) * torch.rsqrt(v + 1e-5)
    return y if w is None else y * w + b


def _r(*shape: int, seed: int = 0, offset: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)  # on the CPU whatever the default device (the fixture's)
    return (torch.randn(shape, generator=g, device="cpu") * 3.0 + offset).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_norm(dtype: torch.dtype) -> None:
    """ReLU then GroupNorm over (N, G, C/G * D*H*W) = (2, 3, 210): several 64-wide chunks and a tail,
    the statistics' mean 100 away from zero (30 standard deviations)."""
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _group_norm(torch.relu(x), w, b, 2, 6, 105, 3, 1e-5)[0]

    xs = [_r(2, 6, 3, 5, 7, offset=100.0, dtype=dtype), _r(6, seed=1, dtype=dtype), _r(6, seed=2, dtype=dtype)]
    low = _low(f, *xs)
    cd = SC.contig_dim(low)
    _one_pass_vs_two(low, xs, [SC.Schedule("looped", 64, 1, 2, cd), SC.Schedule("looped", 32, 2, 1, cd),
                               SC.Schedule("split", 64, 1, 2, cd, 1, 2), SC.Schedule("split", 32, 2, 2, cd, 1, 4)])


def test_layer_norm_and_var_std_with_a_correction() -> None:
    """LayerNorm over 300 (var_mean, the variance biased), torch.var / torch.std unbiased
    (S2 / (K - 1)): the pair is the same, only its divisor differs."""
    x = _r(5, 300, offset=-100.0)
    w, b = _r(300, seed=1), _r(300, seed=2)
    for fn, ins in ((_layer_norm, [x, w, b]),
                    (lambda x: torch.var(x, -1, keepdim=True) * 2.0, [x]),
                    (lambda x: x / torch.std(x, -1, keepdim=True), [x])):
        low = _low(fn, *ins)
        _one_pass_vs_two(low, ins, [SC.Schedule("looped", 64, 1, 2, 1), SC.Schedule("split", 128, 1, 4, 1, 1, 3)])


def test_welford_counts_are_known_without_counting() -> None:
    """Rows of 256 in chunks of 64, and in 2 splits of 128 (no lane masked): every lane's count is
    the number of chunks; rows of 250 and 300 (a masked tail; 300 in 2 splits of 192: the second
    program's last chunk partly past the row; and 5 rows in programs of 2: a masked row) have
    each lane's count from its index after the loop. No `wn` update in the loop either way; values
    as the reference's, with an offset (the cancellation a two-pass variance avoids)."""
    for cols in (256, 250, 300):
        x = _r(5 if cols == 300 else 4, cols, offset=10.0)
        w, b = _r(cols, seed=1), _r(cols, seed=2)
        low = _low(_layer_norm, x, w, b)
        for c in (SC.Schedule("looped", 64, 1, 2, 1, online=1), SC.Schedule("looped", 64, 2, 2, 1, online=1),
                  SC.Schedule("split", 64, 1, 2, 1, 1, 2, online=1)):
            _check(low, [x, w, b], c)
            counted = re.search(r"wn\d+ = wn\d+ \+", generate(low, c)) is not None
            assert not counted, (cols, c.encode())
            lanes = re.search(r"wl\d+ = tl\.minimum\(", generate(low, c)) is not None  # the lanes' counts
            assert lanes == (cols != 256), (cols, c.encode())


def test_batch_norm_statistics_of_a_channels_last_tensor_in_tiles() -> None:
    """The mean and variance per channel of an (N, H, W, C) tensor read as (N, C, H, W): a reduction
    over dims that are not the input's innermost, in `tiles` (chunks of the reduced extent, split
    too)."""
    x = _r(4, 9, 11, 6, offset=50.0).permute(0, 3, 1, 2)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = x.mean((0, 2, 3), keepdim=True)
        v = ((x - m) * (x - m)).mean((0, 2, 3), keepdim=True)
        return (x - m) * torch.rsqrt(v + 1e-5), v

    low = _low(f, x)
    tiles = [c for c in SC.space(low) if c.variant == "tiles" and not c.online and c.rblock < 256]
    assert tiles
    split = [c for c in tiles if c.splits > 1][:2]
    _one_pass_vs_two(low, [x], tiles[:3] + split)


def test_what_is_not_a_pair_is_left_alone() -> None:
    """A deviation from another value than the sum's mean (S1 / (K + 1), a second input), or a
    sum of |d| rather than d * d, is no pair: the region has none and keeps its passes."""
    x, y = _r(3, 200), _r(3, 200, seed=1)
    for fn, ins in ((lambda x: ((x - x.sum(-1, keepdim=True) / 201.0) ** 2).sum(-1), [x]),
                    (lambda x, y: ((x - y.mean(-1, keepdim=True)) * (x - y.mean(-1, keepdim=True))).sum(-1), [x, y]),
                    (lambda x: (x - x.mean(-1, keepdim=True)).abs().sum(-1), [x])):
        low = _low(fn, *ins)
        assert online.var_pairs(low) == []
        _check(low, ins, SC.Schedule("looped", 64, 1, 2, 1))


def test_the_heuristic_takes_one_pass_where_it_chunks() -> None:
    """A GroupNorm whose rows are too long for registers: the heuristic's chunked schedule runs the
    mean and variance in one pass."""
    n = 9000  # past the 8K-wide rows held whole

    low = _low(lambda x: _layer_norm(x), _r(2, n))
    h = SC.heuristic(low)
    assert h.variant in ("looped", "split") and h.online == 1, h
    assert any(c.online == 1 and c.variant == "split" for c in SC.space(low))
