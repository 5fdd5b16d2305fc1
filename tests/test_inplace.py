"""capture/inplace.py: in-place pointwise ops (nn.ReLU(inplace=True), `out += identity`) become
out-of-place where nothing can tell, so they join the generated regions around them; writes into
graph inputs, into views and through views stay as the model wrote them."""

from __future__ import annotations

import collections

import torch
import torch.nn as nn
from codegen_helpers import trace
from conftest import DEVICE

from solforge import capture
from solforge.capture import inplace as IP
from solforge.capture import layout as L
from solforge.codegen import regions as RG

aten = torch.ops.aten


def _r(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _ops(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    return collections.Counter(capture.op_name(n.target) for n in gm.graph.nodes if n.op == "call_function")


class Block(nn.Module):
    """A ResNet basic block as torchvision and timm write it: in-place ReLUs, `out += identity`."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        for b in (self.b1, self.b2):
            b.running_mean.normal_()
            b.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        out += identity
        return self.relu(out)


def test_a_resnet_block_loses_its_writes_and_computes_eager_values() -> None:
    torch.manual_seed(0)
    m = Block(6).to(DEVICE).eval()
    x = _r(2, 6, 9, 7)
    with torch.no_grad():
        b = capture.capture(m, (x,))
        (g,) = b.graphs
        ops = _ops(g.aten)
        assert g.functionalized == 3 and ops["aten.relu.default"] == 2 and ops["aten.add.Tensor"] >= 1, ops
        assert not any(op.endswith("_.default") or op.endswith("_.Tensor") for op in ops), ops
        x_before = x.clone()
        out = b.compiled(x)
        torch.testing.assert_close(x, x_before, rtol=0, atol=0)  # the input is not written
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    # the first convolution's result reaches the second through ops that keep the memory order:
    # a channels-last island can hold it (capture/layout.py; the write had cut it)
    first = next(n for n in g.aten.graph.nodes if n.target is aten.convolution.default)
    assert L.copy_back_cancels(first)
    # the first ReLU now shares a region with the BatchNorm before it, and the residual add and the
    # last ReLU with the second BatchNorm: no write cuts them apart
    regions = RG.form_regions(g.aten.graph)
    names = [{capture.op_name(n.target) for n in r.nodes} for r in regions]
    assert any({"aten.relu.default", "aten.add.Tensor"} <= s for s in names), names
    assert sum("aten.relu.default" in s for s in names) == 2, names


def test_writes_a_caller_or_a_view_can_see_stay() -> None:
    """A write into a graph input (the caller sees it), into a view (its base sees it) and into a
    tensor a view was taken of (the view sees it) all stay in place; a fresh chain of writes does
    not, and the values are eager's (inputs included)."""
    def f(a, b):  # noqa: ANN001, ANN202
        a.relu_()  # an input: stays
        t = b * 2
        v = t[:, :3]
        v.mul_(3)  # a view: stays
        u = b + 1
        w = u.view(-1)
        u.add_(1)  # u has a view read later: stays
        s = (b - 1).relu_().mul_(0.5)  # fresh: both go
        return t, w, s

    xs = [_r(4, 5), _r(4, 5, seed=1)]
    gm = trace(f, *[x.clone() for x in xs])
    assert IP.functionalize_pointwise(gm) == 2
    ops = _ops(gm)
    assert ops["aten.relu_.default"] == 1 and ops["aten.mul_.Tensor"] == 1 and ops["aten.add_.Tensor"] == 1, ops
    got_in, want_in = [x.clone() for x in xs], [x.clone() for x in xs]
    got, want = gm(*got_in), f(*want_in)
    for g, w in zip([*got, *got_in], [*want, *want_in], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_write_that_would_promote_or_broadcast_stays() -> None:
    """`bf16.add_(fp32)` stays bf16 where `add` would give fp32: left in place, values eager's."""
    def f(a, b):  # noqa: ANN001, ANN202
        t = a * 1
        t.add_(b)
        return t

    xs = [_r(3, 4).to(torch.bfloat16), _r(3, 4, seed=1)]
    gm = trace(f, *xs)
    assert IP.functionalize_pointwise(gm) == 0
    torch.testing.assert_close(gm(*xs), f(*xs), rtol=0, atol=0)


def test_functional_of() -> None:
    assert IP.functional_of(aten.relu_.default) is aten.relu.default
    assert IP.functional_of(aten.add_.Tensor) is aten.add.Tensor
    assert IP.functional_of(aten.relu.default) is None  # not in place
    assert IP.functional_of(aten.copy_.default) is None  # `copy` is not a pointwise op of its input
    assert IP.functional_of(aten.index_put_.default) is None  # not pointwise
