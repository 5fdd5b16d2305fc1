"""Special values come out of a generated kernel where torch's ops put them. A NaN: relu, clamp,
hardtanh, hardsigmoid, hardswish, shrinks, threshold, maximum/minimum, max pools and amax/amin
(every reduction variant that combines partial maxima: one pass, looped chunks, split programs,
tiles) keep it as eager does (Triton's max and min may drop it: PTX's max.f32 returns the other
operand, and the interpreter's tl.max is numpy's nanmax; a relu written as `x > 0 ? x : 0` gave 0).
And every lowered elementwise op of a sweep over NaN, +-inf, +-0, 1e30 and values near its
branches matches eager (asinh of 1e30 overflowed in x * x; -inf ** 2.5 is inf); floor division
and remainder of floats are torch's exact ones (1.0 // 0.1 is 9, remainder(1.0, 0.1) is 0.1)."""

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
    """Every region of fn under the heuristic and the space's first schedule of each variant named
    ("all": of every variant in the space): the outputs equal eager's, NaN for NaN (to fp32
    rounding elsewhere)."""
    gm = trace(fn, x)
    env = values(gm, x)
    checked = 0
    for fr in RG.form_regions(gm.graph):
        space = SC.space(fr.lowered)
        wanted = sorted({c.variant for c in space}) if variants == ("all",) else variants
        scheds = list(dict.fromkeys([SC.heuristic(fr.lowered)] + [next(c for c in space if c.variant == v)
                                                                 for v in wanted]))
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


_SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e30, -1e30, 88.0, -88.0, 100.0, -100.0,
            1e-30, -1e-30, 0.5, -0.5, 3.0, -3.0, 20.0, 21.0, 1.0, -1.0, 2.0, 0.25, -6.0, 6.0]
_ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "elu": F.elu, "selu": F.selu, "celu": F.celu, "softplus": F.softplus, "mish": F.mish, "leaky_relu": F.leaky_relu,
    "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish, "relu": torch.relu, "relu6": F.relu6,
    "hardtanh": F.hardtanh, "exp": torch.exp, "log": torch.log, "log1p": torch.log1p, "expm1": torch.expm1,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "abs": torch.abs, "sign": torch.sign, "reciprocal": torch.reciprocal,
    "floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc, "erf": torch.erf,
    "softsign": F.softsign, "logsigmoid": F.logsigmoid, "softshrink": F.softshrink, "hardshrink": F.hardshrink,
    "threshold": lambda x: F.threshold(x, 0.5, -2.0), "pow3": lambda x: x ** 3, "pow2.5": lambda x: x ** 2.5,
    "pow-2": lambda x: x ** -2, "pow_tensor": lambda x: torch.pow(x.abs() + 0.5, x.flip(1)),
    "clamp": lambda x: x.clamp(-1, 1), "isnan": lambda x: torch.isnan(x).float(), "nan_to_num": torch.nan_to_num,
    "frac": torch.frac, "sinh": torch.sinh, "cosh": torch.cosh, "asinh": torch.asinh,
    "xlogy": lambda x: torch.xlogy(x, x.abs()), "fmod": lambda x: torch.fmod(x, 1.5),
    "remainder": lambda x: torch.remainder(x, -1.5), "floor_divide": lambda x: torch.div(x, 1.5, rounding_mode="floor"),
    "where": lambda x: torch.where(x > 0, x, x * 2), "maximum": lambda x: torch.maximum(x, x.flip(1)),
}


@pytest.mark.parametrize("op", sorted(_ELEMENTWISE))
def test_elementwise_ops_at_special_values(op: str) -> None:
    f = _ELEMENTWISE[op]
    x = torch.tensor(_SPECIAL * 3).reshape(3, -1)
    _same(lambda x: f(x) * 1.0 + 0.0, x)


def test_floor_division_and_remainder_of_floats_are_torchs() -> None:
    """Quotients that round up to a whole number (1.0 / 0.1 is 10.0 in fp32, 1.0 // 0.1 is 9), signs
    of every kind, a zero divisor, infinities; by a tensor and by a scalar."""
    a = torch.tensor([1.0, 0.3, -1.0, 7.5, 5.0, -5.0, 0.7, -0.7, 3.0, 0.0, -0.0, float("inf"), 2.0, 1e-3, 6.0])
    d = torch.tensor([0.1, 0.1, 0.1, 2.5, -3.0, -3.0, 0.1, 0.35, 0.0, 2.0, 2.0, 1.5, float("inf"), 1e-4, 0.2])
    x = torch.stack([a, d])

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, d = x[0], x[1]
        return (torch.div(a, d, rounding_mode="floor") + 0.0, torch.remainder(a, d) * 1.0, torch.fmod(a, d) * 1.0,
                torch.div(a, 0.1, rounding_mode="floor") + 0.0, torch.remainder(a, 0.1) * 1.0)

    _same(f, x)


_ROWS = [_SPECIAL, [v for v in _SPECIAL if v == v] + [7.0], [float("-inf")] * 25, [float("inf")] * 25, [0.0] * 25,
         [1e30] * 25, [-1e30] * 25, [1e-30] * 25]
_REDUCTIONS: dict[str, Callable[[torch.Tensor], Any]] = {
    "softmax": lambda x: x.softmax(-1), "log_softmax": lambda x: x.log_softmax(-1),
    "safe_softmax": lambda x: torch.ops.aten._safe_softmax(x, -1), "logsumexp": lambda x: x.logsumexp(-1),
    "norm": lambda x: x.norm(dim=-1), "norm1": lambda x: x.norm(p=1, dim=-1), "var": lambda x: x.var(-1),
    "std": lambda x: x.std(-1), "mean": lambda x: x.mean(-1), "sum": lambda x: x.sum(-1),
    "amax": lambda x: x.amax(-1), "cumsum": lambda x: x.cumsum(-1), "cumprod": lambda x: x.cumprod(-1),
    "argmax": lambda x: x.argmax(-1), "argmin": lambda x: x.argmin(-1), "max_dim": lambda x: x.max(-1),
    "rmsnorm": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "normalize": lambda x: F.normalize(x, dim=-1), "mse": lambda x: F.mse_loss(x, x.flip(1)),
    "cross_entropy": lambda x: F.cross_entropy(x, torch.zeros(x.shape[0], dtype=torch.long)),
}


@pytest.mark.parametrize("op", sorted(_REDUCTIONS))
def test_reductions_at_special_values(op: str) -> None:
    """Rows holding NaN, +-inf, only -inf, only +inf, zeros, 1e30 (a max of +inf: logsumexp is inf,
    as torch's, where shifting by it gave NaN), under every variant of the space. torch's var_mean
    is left out: its mean of a row of infinities is NaN (Welford), its own mean's is inf."""
    f = _REDUCTIONS[op]
    _same(f, torch.tensor(_ROWS), ("all",))


@pytest.mark.parametrize("op", ["logsumexp", "log_softmax", "cross_entropy"])
def test_online_schedules_at_special_values(op: str) -> None:
    """The online max / sum-of-exp pairs (looped and split, the lanes' own max or the row's) on rows
    of 3000 holding NaN, +-inf, only -inf, only +inf: a running max that reaches +inf rescales to
    logsumexp's shift of 0, as the graph."""
    f = _REDUCTIONS[op]
    x = torch.tensor(_ROWS).repeat(1, 120)
    gm = trace(f, x)
    env = values(gm, x)
    (fr,) = RG.form_regions(gm.graph)
    picks = {(c.variant, c.online): c for c in reversed(SC.space(fr.lowered)) if c.online}
    assert {k[0] for k in picks} == {"looped", "split"}, sorted(picks)
    ins = [env[a] for a in fr.inputs]
    for c in picks.values():
        (got,) = RT.run(fr.lowered, c, ins)
        want = env[fr.outputs[0]]
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (c.encode(), got, want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, msg=c.encode())


def test_integer_floor_division_and_remainder_are_exact() -> None:
    """int64 values past 2^24 (fp32 division rounds them), signs of every kind: floor and trunc
    division, remainder and fmod, by a tensor and by a scalar, in integer arithmetic."""
    a = torch.tensor([2**40 + 7, -(2**40) - 7, 16777217, -16777217, 7, -7, 7, -7, 0, 123456789012])
    d = torch.tensor([3, 3, 2, 2, -2, -2, 2, 2, 5, -1000003])
    x = torch.stack([a, d])

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, d = x[0], x[1]
        return (torch.div(a, d, rounding_mode="floor") + 1, torch.div(a, d, rounding_mode="trunc") + 1,
                torch.remainder(a, d) + 1, torch.fmod(a, d) + 1, a // 3 + 1, a % -3 + 1)

    gm = trace(f, x)
    env = values(gm, x)
    (fr,) = RG.form_regions(gm.graph)
    got = RT.run(fr.lowered, SC.heuristic(fr.lowered), [env[i] for i in fr.inputs])
    for o, g in zip(fr.outputs, got, strict=True):
        assert torch.equal(g, env[o]), (o.name, g, env[o])


def test_integer_sums_are_exact() -> None:
    """A sum, max and min of int64 values past 2^24 and a count of booleans accumulate in int64 (in
    fp32 they rounded): exact under every variant of the space, none of which splits (the
    workspace holds fp32 partials)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**40), 2**40, (3, 5000), generator=g).to(torch.get_default_device())

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(-1), x.amax(-1), x.amin(-1, keepdim=True), (x > 0).sum(-1), (x % 7 == 0).sum(-1).float() / 5000

    gm = trace(f, x)
    env = values(gm, x)
    (fr,) = RG.form_regions(gm.graph)
    space = SC.space(fr.lowered)
    assert space and all(c.splits == 1 for c in space)
    picks = list(dict.fromkeys([SC.heuristic(fr.lowered)] + [next(c for c in space if c.variant == v)
                                                             for v in sorted({c.variant for c in space})]))
    for c in picks:
        got = RT.run(fr.lowered, c, [env[a] for a in fr.inputs])
        for o, g_ in zip(fr.outputs, got, strict=True):
            assert torch.equal(g_, env[o]), (c.encode(), o.name, g_, env[o])
