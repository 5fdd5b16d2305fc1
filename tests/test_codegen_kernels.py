"""Generated kernels under chosen schedules (looped and whole-row, tails in rows and columns,
runtime strides unlike the traced ones), the canonical key, and schedule validity."""

from __future__ import annotations

import pytest
import torch
from codegen_helpers import trace

from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.numerics import compare

pytestmark = pytest.mark.usefixtures("on_device")


def _ln(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m = x.mean(-1, keepdim=True)
    v = ((x - m) ** 2).mean(-1, keepdim=True)
    return ((x - m) * torch.rsqrt(v + 1e-5) * w).to(torch.bfloat16)


def _one(fn, *xs: torch.Tensor) -> RG.Formed:  # type: ignore[no-untyped-def]
    (r,) = RG.form_regions(trace(fn, *xs).graph)
    return r


def test_looped_and_whole_row_schedules_with_tails() -> None:
    x, w = torch.randn(7, 100) * 3 + 1, torch.randn(100)
    r = _one(_ln, x, w)
    low = r.lowered
    assert low.space.stages == 2 and low.space.rows == 7 and low.space.cols == 100
    ref = REF.reference(low.ir, [x, w])
    # rows not a multiple of ROWS (7 rows, 2 or 4 a program), columns not a multiple of BLOCK (100 by 32/64)
    chosen = [SC.Schedule("looped", 32, 2, 1, 1), SC.Schedule("looped", 64, 4, 2, 1), SC.Schedule("rows", 128, 4, 4, 1)]
    for s in chosen:
        assert SC.is_valid(s, low), s
        (got,) = RT.run(low, s, [x, w])
        c = compare(got, ref[0])
        assert c.ok, f"{s.encode()}: {c.reason}"
    # a whole-row block narrower than the row, or a looped block as wide as it, is refused
    assert not SC.is_valid(SC.Schedule("rows", 64, 1, 1, 1), low)
    assert not SC.is_valid(SC.Schedule("looped", 128, 1, 4, 1), low)


def test_runtime_strides_unlike_the_traced_ones() -> None:
    x, w = torch.randn(9, 33), torch.randn(33)
    low = _one(_ln, x, w).lowered
    xt = torch.randn(33, 9).t()  # same shape, column-major
    (got,) = RT.run(low, None, [xt, w])
    assert compare(got, REF.reference(low.ir, [xt, w])[0]).ok
    assert compare(got, _ln(xt, w)).ok


def test_reduction_over_a_middle_dim_looped() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, 1)

    x = torch.randn(3, 70, 5) * 5
    low = _one(f, x).lowered
    assert low.space.reduced == (1,) and low.space.rows == 15
    ref = REF.reference(low.ir, [x])[0]
    for s in (SC.Schedule("looped", 32, 4, 1, 1), SC.heuristic(low)):
        (got,) = RT.run(low, s, [x])
        assert compare(got, ref).ok and compare(got, torch.softmax(x, 1)).ok


def test_pointwise_block_tails() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.where(x > y, x * y, (x - y).exp())

    x, y = torch.randn(3, 5, 17), torch.randn(5, 1)
    low = _one(f, x, y).lowered
    ref = REF.reference(low.ir, [x, y])[0]
    for s in (SC.Schedule("pointwise", 128, 1, 1, 2), SC.Schedule("pointwise", 64, 1, 2, 2)):
        assert SC.is_valid(s, low)
        (got,) = RT.run(low, s, [x, y])
        assert compare(got, ref).ok, s


def test_canonical_key() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(a * 2.0 + b)

    def g(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        z = p.exp()  # other nodes first: other names and positions for the same region
        return torch.sigmoid(p * 2.0 + q) + 0 * z.sum()

    x, y = torch.randn(4, 6), torch.randn(6)
    key = _one(f, x, y).record.key
    regions = RG.form_regions(trace(g, x, y).graph)
    # g's region holds more (the exp and the sum are fused with it), so the key is not f's
    assert key not in {r.record.key for r in regions}
    assert _one(lambda a, b: torch.sigmoid(a * 2.0 + b), x, y).record.key == key
    assert _one(lambda a, b: torch.sigmoid(a * 3.0 + b), x, y).record.key != key  # constant
    assert _one(f, torch.randn(5, 6), y).record.key != key  # shape
    assert _one(f, x.bfloat16(), y.bfloat16()).record.key != key  # dtype
    assert _one(f, torch.randn(6, 4).t(), y).record.key != key  # strides
    assert _one(lambda a, b: torch.sigmoid(b + a * 2.0), x, y).record.key != key  # operand order


def test_same_region_in_two_graphs_same_key() -> None:
    def block(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def model(x: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        y = block(x, w) @ m
        return block(y, w)

    x, w, m = torch.randn(5, 8), torch.randn(8), torch.randn(8, 8)
    regions = RG.form_regions(trace(model, x, w, m).graph)
    assert len(regions) == 2
    assert regions[0].record.key == regions[1].record.key
    assert regions[0].record.nodes != regions[1].record.nodes
    assert regions[0].record.key == _one(block, x, w).record.key
