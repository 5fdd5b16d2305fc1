"""A torch.no_grad() / enable_grad() block inside a captured graph: the ATen lowering keeps no
trace of grad mode, so a graph whose switch matters must run as dynamo gave it (capture's
GradModeLost), and one whose switch changes nothing (a rotary embedding's no_grad over buffers)
is still lowered and optimized. Gradients are compared with eager."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from solforge.capture import capture
from solforge.integrate import integrate


class PartlyFrozen(nn.Module):
    """Two linears on one input, one of them under torch.no_grad() inside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = self.b(x)
        return self.a(x) * y


class BufferOnlyNoGrad(nn.Module):
    """no_grad over a buffer (as transformers' rotary embeddings are written) and a comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16, bias=False)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            c = torch.cos(self.freq * 3.0)
            keep = x > -10.0  # a comparison on x: no floating result, nothing for autograd either
        return self.a(x) * c * keep


def test_a_switch_that_matters_keeps_the_graph_as_traced() -> None:
    torch.manual_seed(0)
    ref = PartlyFrozen()
    model = copy.deepcopy(ref)
    optimized, stats = integrate(model, {}, families=(), train=True)
    x = torch.randn(2, 3, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    for _ in range(2):
        ref(x).square().sum().backward()
        optimized(x2).square().sum().backward()
    assert ref.b.weight.grad is None and model.b.weight.grad is None  # b only ever ran without grad
    torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad)
    torch.testing.assert_close(x2.grad, x.grad)
    assert stats.graphs == 0  # not lowered: dynamo's graph ran, with its switches
    cap = capture(PartlyFrozen(), (torch.randn(2, 3, 16),), grad=True)
    assert not cap.graphs and any("GradModeLost" in e for e in cap.errors)


def test_a_switch_over_buffers_only_is_still_lowered() -> None:
    torch.manual_seed(1)
    ref = BufferOnlyNoGrad()
    model = copy.deepcopy(ref)
    optimized, stats = integrate(model, {}, families=(), train=True)
    x = torch.randn(2, 3, 16, requires_grad=True)  # the no_grad block compares it
    x2 = x.detach().clone().requires_grad_()
    ref(x).square().sum().backward()
    optimized(x2).square().sum().backward()
    torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad)
    torch.testing.assert_close(x2.grad, x.grad)
    assert stats.graphs == 1 and stats.grouped == 1
