"""A NaN in a generated kernel's input comes out where torch's ops put it: relu, clamp, hardtanh,
hardsigmoid, hardswish, maximum/minimum, max pools and amax/amin (every reduction variant that
combines partial maxima: one pass, looped chunks, split programs, tiles) keep the NaN as eager
does. Triton's max and min may drop it on the GPU (PTX's max.f32 returns the other operand), where
the interpreter's numpy keeps it, so the CPU run checks the source's own logic (a relu written as
`x > 0 ? x : 0` gave 0) and the GPU run the instructions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import trace, values

from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC

pytestmark = pytest.mark.usefixtures("on_device")


def _with_nans(*shape: int) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.get_default_device())
    flat = x.view(-1)
    flat[3] = float("nan")
    flat[flat.numel() // 2] = float("nan")
    flat[-1] = float("inf")
    flat[5] = float("-inf")
    return x


def _same(fn: Callable[..., Any], x: torch.Tensor, variants: tuple[str, ...] = ()) -> int:
    """Every region of fn under the heuristic and the space's first schedule of each variant named:
    the outputs equal eager's, NaN for NaN (to fp32 rounding elsewhere)."""
    gm = trace(fn, x)
    env = values(gm, x)
    checked = 0
    for fr in RG.form_regions(gm.graph):
        space = SC.space(fr.lowered)
        scheds = [SC.heuristic(fr.lowered)] + [next(c for c in space if c.variant == v) for v in variants]
        ins = [env[a] for a in fr.inputs]
        for s in scheds:
            got = RT.run(fr.lowered, s, ins)
            for o, g in zip(fr.outputs, got, strict=True):
                want = env[o]
                assert torch.equal(torch.isnan(g), torch.isnan(want)), (s.encode(), o.name, g, want)
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, equal_nan=True)
            checked += 1
    assert checked, "no region"
    return checked


@pytest.mark.parametrize("op", ["relu", "clamp", "hardtanh", "hardsigmoid", "hardswish", "maximum", "relu6"])
def test_pointwise_ops_keep_a_nan(op: str) -> None:
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "relu": torch.relu, "clamp": lambda x: x.clamp(-0.5, 0.5), "hardtanh": F.hardtanh,
        "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish, "relu6": F.relu6,
        "maximum": lambda x: torch.minimum(torch.maximum(x, x.flip(0)), x.flip(1)),
    }
    f = fns[op]
    _same(lambda x: f(x) * 2.0 + 1.0, _with_nans(5, 37))


def test_a_max_pool_keeps_a_nan() -> None:
    _same(lambda x: F.max_pool2d(torch.sigmoid(x), 3, stride=2, padding=1), _with_nans(2, 3, 9, 11))


@pytest.mark.parametrize(("shape", "dim", "variants"), [
    ((6, 37), -1, ()),                   # one pass a row
    ((3, 5000), -1, ("looped",)),        # chunks (and the heuristic's choice)
    ((1, 70001), -1, ("split",)),        # split programs and their combining pass
    ((4, 37, 9), 1, ("tiles",)),         # tiles of neighbouring rows
])
def test_amax_and_amin_keep_a_nan(shape: tuple[int, ...], dim: int, variants: tuple[str, ...]) -> None:
    _same(lambda x: (x.amax(dim), x.amin(dim, keepdim=True) * 2.0), _with_nans(*shape), variants)
