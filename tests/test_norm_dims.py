"""Norms over other dims than the last one alone: over several trailing dims (KernelBench's
`nn.LayerNorm((features, dim1, dim2))`, an RMSNorm whose mean takes the last three dims), run by the
usual kernels with those dims merged into one (`plan.merged_dims`), and an RMSNorm over one middle
dim (KernelBench's over `features`, a channel norm), moved last for the kernels whose rows are
columns (`plan.moved_dim`, kernels/rmsnorm_cols.py). The outputs come back in their own shape and
layout; forward values and training gradients are compared with the model's own; other
reductions are left alone."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE, HAND_WRITTEN

from solforge import capture, plan
from solforge.integrate import integrate
from solforge.numerics import compare

BF16, FP32 = torch.bfloat16, torch.float32
SHAPE = (3, 4, 5, 6)  # (batch, features, dim1, dim2): 120 values per normalized row


class KernelBenchRMS(nn.Module):
    """KernelBench level 1's RMSNorm written over the trailing dims: x / sqrt(mean(x^2) + eps)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(torch.mean(x**2, dim=(1, 2, 3), keepdim=True) + 1e-5)


class HFStyleRMS(nn.Module):
    """Hugging Face's RMSNorm formula over the last two dims, with a weight of that shape."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(SHAPE[-2:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean((-2, -1), keepdim=True) + 1e-6)
        return self.weight * xf.to(dtype)


class TorchRMS(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(SHAPE[-3:], eps=1e-6)
        nn.init.normal_(self.norm.weight, 1.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + F.rms_norm(x + 1, SHAPE[-2:], eps=1e-5)  # (x + 1: a square of its own)


class LayerNorms(nn.Module):
    """KernelBench's LayerNorm over (features, dim1, dim2), and one without parameters over two dims."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(SHAPE[-3:], bias=bias)
        nn.init.normal_(self.ln.weight, 1.0, 0.1)
        if self.ln.bias is not None:
            nn.init.normal_(self.ln.bias, 0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x) * F.layer_norm(x, SHAPE[-2:], None, None, 1e-6)


class Residual(nn.Module):
    """A residual add feeding each norm over the last two dims, the sum read again after it."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(SHAPE[-2:])
        self.w = nn.Parameter(1 + 0.1 * torch.randn(SHAPE[-2:]))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        h = x + r
        a = self.ln(h)
        h2 = a + h
        b = h2 * torch.rsqrt(h2.pow(2).mean((-2, -1), keepdim=True) + 1e-6) * self.w
        return a + b + h2


def _families(m: nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, list]:
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, inputs).graphs, HAND_WRITTEN)
    out: dict[str, list] = {}
    for g in groups:
        out.setdefault(g.workload.family, []).extend([g.workload] * g.count)
    return out


def _inputs(dtype: torch.dtype, n: int = 1) -> tuple[torch.Tensor, ...]:
    # rows of different scales and offsets: a kernel that normalized over the last dim alone fails
    return tuple(torch.randn(SHAPE, device=DEVICE, dtype=FP32).mul(torch.rand(SHAPE[0], SHAPE[1], 1, 1,
                 device=DEVICE) * 3 + 0.5).add(0.3).to(dtype) for _ in range(n))


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("cls,families", [
    (KernelBenchRMS, {"rmsnorm": [((3, 120),)]}),
    (HFStyleRMS, {"rmsnorm": [((12, 30), (30,))]}),
    (TorchRMS, {"rmsnorm": [((3, 120), (120,)), ((12, 30),)]}),
    (LayerNorms, {"layernorm": [((3, 120), (120,), (120,)), ((12, 30),)]}),
])
def test_trailing_dims_are_one_row(cls: type[nn.Module], families: dict, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    m = cls().to(DEVICE, dtype)
    (x,) = _inputs(dtype)
    found = _families(m, (x,))
    assert {f: sorted(w.shapes for w in wls) for f, wls in found.items()} == \
        {f: sorted(s) for f, s in families.items()}
    opt, stats = integrate(m, {})
    with torch.no_grad():
        out, ref = opt(x), m(x)
    assert stats.total == sum(len(s) for s in families.values())
    assert out.shape == ref.shape and out.dtype == ref.dtype
    c = compare(out, ref)
    assert c.ok, c.reason


def test_residual_add_joins_a_norm_over_two_dims() -> None:
    torch.manual_seed(0)
    m = Residual().to(DEVICE)
    x, r = _inputs(FP32, 2)
    found = _families(m, (x, r))
    assert {f: [w.shapes[:2] for w in wls] for f, wls in found.items()} == \
        {"add_layernorm": [((12, 30), (12, 30))], "add_rmsnorm": [((12, 30), (12, 30))]}
    opt, stats = integrate(m, {})
    with torch.no_grad():
        out, ref = opt(x, r), m(x, r)
    assert stats.total == 2
    c = compare(out, ref)
    assert c.ok, c.reason


@pytest.mark.parametrize("cls", [HFStyleRMS, TorchRMS, LayerNorms, Residual])
def test_gradients_through_the_merged_dims(cls: type[nn.Module]) -> None:
    """Training: the fused ops' backward kernels see the merged rows; every parameter's gradient and
    the inputs' gradients equal eager's."""
    torch.manual_seed(0)
    m = cls().to(DEVICE).train()
    n = 2 if cls is Residual else 1
    inputs = [t.requires_grad_() for t in _inputs(FP32, n)]
    opt, stats = integrate(m, {})
    opt(*inputs).square().mean().backward()
    assert stats.total >= 1
    got = {name: p.grad.clone() for name, p in m.named_parameters()}  # type: ignore[union-attr]
    got_in = [t.grad.clone() for t in inputs]  # type: ignore[union-attr]
    m.zero_grad()
    for t in inputs:
        t.grad = None
    m(*inputs).square().mean().backward()
    for name, p in m.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    for g, t in zip(got_in, inputs, strict=True):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-4)


class KernelBenchFeatures(nn.Module):
    """KernelBench level 1's RMSNorm as it is: over dim 1 (`features`) of (batch, features, dim1, dim2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + 1e-5)


class ChannelRMS(nn.Module):
    """Hugging Face's formula over the channels of (B, C, L) or (B, C, H, W), with a weight that
    broadcasts along them: (C, 1) / (1, C, 1, 1)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-6)
        return self.weight * xf.to(dtype)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("case", ["kernelbench", "channels 3-D", "channels 4-D"])
def test_a_middle_dim_is_moved_last(case: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    if case == "kernelbench":
        m, x, shapes = KernelBenchFeatures(), _inputs(dtype)[0], ((3 * 5 * 6, 4),)
    elif case == "channels 3-D":
        m, x, shapes = ChannelRMS((4, 1)), _inputs(dtype)[0].flatten(2), ((3 * 30, 4), (4,))
    else:
        m, x, shapes = ChannelRMS((1, 4, 1, 1)), _inputs(dtype)[0], ((3 * 30, 4), (4,))
    m = m.to(DEVICE, dtype)
    (wl,) = _families(m, (x,))["rmsnorm"]
    assert wl.shapes == shapes and wl.param("inner") == x[0, 0].numel()  # rows that are columns
    opt, stats = integrate(m, {})
    with torch.no_grad():
        out, ref = opt(x), m(x)
    assert stats.total == 1
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    c = compare(out, ref)
    assert c.ok, c.reason


class ChannelTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = ChannelRMS((4, 1, 1))
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.norm(x)) + KernelBenchFeatures()(x * 2)


def test_gradients_through_a_moved_dim() -> None:
    torch.manual_seed(0)
    m = ChannelTrain().to(DEVICE).train()
    (x,) = _inputs(FP32)
    x.requires_grad_()
    opt, stats = integrate(m, {})
    opt(x).square().mean().backward()
    assert stats.total == 2
    got = {name: p.grad.clone() for name, p in m.named_parameters()}  # type: ignore[union-attr]
    gx = x.grad.clone()  # type: ignore[union-attr]
    m.zero_grad()
    x.grad = None
    m(x).square().mean().backward()
    for name, p in m.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=1e-4)


class NotOneRow(nn.Module):
    """Means over several dims that do not end at the last one: left as the model wrote them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x * torch.rsqrt(x.pow(2).mean((-3, -1), keepdim=True) + 1e-6)  # a gap
        c = x * torch.rsqrt(x.pow(2).mean((1, 2), keepdim=True) + 1e-6)  # two middle dims
        return b + c


def test_reductions_that_are_not_one_row_are_left_alone() -> None:
    (x,) = _inputs(FP32)
    assert _families(NotOneRow(), (x,)) == {}


def test_a_residual_add_before_a_moved_dim_stays_outside() -> None:
    """add_rmsnorm has no kernels whose rows are columns: the norm is an rmsnorm, the add stays."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            h = x + r
            return h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6) + h

    x, r = _inputs(FP32, 2)
    assert list(_families(M(), (x, r))) == ["rmsnorm"]


def test_fused_rms_norm_over_two_dims_is_rewritten_with_views() -> None:
    """aten._fused_rms_norm (CUDA's lowering of F.rms_norm) over two dims: the op gets the merged
    rows and its output is unflattened back (a graph built by hand: on the CPU it decomposes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from solforge.kernels import rmsnorm as fam

    with FakeTensorMode():
        xv = torch.empty(2, 7, 4, 6, dtype=BF16)
        wv = torch.empty(4, 6, dtype=BF16)
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = xv, wv
    fused = g.call_function(torch.ops.aten._fused_rms_norm.default, (x, [4, 6], w, 1e-6))
    out = g.call_function(operator.getitem, (fused, 0))
    g.call_function(operator.getitem, (fused, 1))  # rstd, dead
    out.meta["val"] = xv
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (out, 2)))
    gm = torch.fx.GraphModule(nn.Module(), g)
    (m,) = plan.find_matches(gm.graph)
    assert m.out_view is not None and m.out_view[0] is torch.ops.aten.unflatten.int
    assert m.workload.shapes == ((14, 24), (24,))
    plan.rewrite(gm, [m], [fam.heuristic(m.workload).encode()])
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == ["aten.flatten.using_ints", "aten.flatten.using_ints", "solforge.rmsnorm.default",
                   "aten.unflatten.int", "aten.mul.Tensor"]
    xr = torch.randn(2, 7, 4, 6, dtype=BF16, device=DEVICE)
    wr = (1 + 0.1 * torch.randn(4, 6)).to(BF16).to(DEVICE)
    c = compare(gm(xr, wr), 2 * F.rms_norm(xr.float(), (4, 6), wr.float(), 1e-6).to(BF16))
    assert c.ok, c.reason


class LongLayerNorm(nn.Module):
    """KernelBench's LayerNorm form with rows of 72,000 values: past the row kernels' 64K."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm((3, 200, 120))
        nn.init.normal_(self.ln.weight, 1.0, 0.1)
        nn.init.normal_(self.ln.bias, 0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


def test_rows_past_64k_use_the_split_variant_in_inference_only() -> None:
    """Without autograd the norm runs as chunks of its rows (kernels/layernorm_split.py); in a
    training graph the backward kernels could not take such a row, so the norm stays eager's and
    the gradients are eager's."""
    torch.manual_seed(0)
    m = LongLayerNorm().to(DEVICE)
    x = (torch.randn(2, 3, 200, 120, device=DEVICE) * 2 + 1).to(FP32)
    found = _families(m, (x,))
    assert {f: [w.shapes[0] for w in wls] for f, wls in found.items()} == {"layernorm": [(2, 72000)]}
    opt, stats = integrate(m, {})
    with torch.no_grad():
        out, ref = opt(x), m(x)
    assert stats.total == 1
    c = compare(out, ref)
    assert c.ok, c.reason
    m.train()
    xg = x.clone().requires_grad_()
    opt, stats = integrate(m, {})
    opt(xg).square().mean().backward()
    assert stats.total == 0
    got = {n: p.grad.clone() for n, p in m.named_parameters()}  # type: ignore[union-attr]
    m.zero_grad()
    m(x).square().mean().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)
