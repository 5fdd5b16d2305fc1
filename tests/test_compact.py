"""compact.recompose_linear: the captured graph's decomposed nn.Linear calls (t, view, mm or addmm,
view) become one aten.linear each; the graph then computes bit for bit the same outputs and, in
training, the same gradients; anything that is not exactly that pattern is left alone; the
Integrator does it after the kernel rewrite."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from conftest import DEVICE

from solforge import capture
from solforge.integrate import integrate
from solforge.integrate.compact import recompose_linear

aten = torch.ops.aten


def _count(gm: torch.fx.GraphModule, target: Any) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


class Mixed(nn.Module):
    """Linears with and without bias on 3-D and 2-D inputs, three sharing one input (q/k/v: CSE
    merges their flattening views), a plain matmul of two activations, and a weight used both
    transposed by hand and through a Linear."""

    def __init__(self, h: int = 37, f: int = 45) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(h, f, bias=False) for _ in range(3))
        self.b = nn.Linear(f, h, bias=True)
        self.two = nn.Linear(h, 11, bias=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = self.q(x), self.k(x), self.v(x)
        y = self.b(torch.relu(q + k * v))  # (B, S, h), with a bias
        flat = y.reshape(-1, y.shape[-1])
        z = self.two(flat)  # 2-D input
        attn = q.flatten(0, 1) @ k.flatten(0, 1).t()  # mm of two activations: no weight
        hand = x @ self.q.weight.t()  # matmul with a transposed weight, written by hand
        return y, z, attn, hand


def _captured(model: nn.Module, x: torch.Tensor, grad: bool) -> Any:
    backend = capture.capture(model, (x,), grad=grad)
    assert len(backend.graphs) == 1
    return backend


def test_recomposed_graph_is_bit_identical_forward_and_backward() -> None:
    torch.manual_seed(0)
    model = Mixed().to(DEVICE)
    x = torch.randn(3, 5, 37, device=DEVICE)
    want = model(x)
    (sum(o.float().sum() for o in want)).backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    backend = _captured(model, x, grad=True)
    gm = backend.graphs[0].aten
    mms_before = _count(gm, aten.mm.default) + _count(gm, aten.addmm.default)
    n = recompose_linear(gm)
    # q, k, v, b (addmm) on 3-D inputs; two (addmm) on a 2-D view; attn = a @ b.t() of two
    # activations (2-D, linear(a, b) all the same); the hand-written x @ W.t(), nn.Linear's own
    # pattern (t of a 2-D weight, view, mm, view back): every matmul, each computing the same
    assert n == mms_before == 7, gm.code
    assert _count(gm, aten.linear.default) == 7
    assert _count(gm, aten.mm.default) + _count(gm, aten.addmm.default) == 0
    got = backend.compiled(x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    (sum(o.float().sum() for o in got)).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want_grads[name]), name


def test_only_the_exact_pattern_is_recomposed() -> None:
    class NotLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(7, 9))
            self.m = nn.Parameter(torch.randn(9, 7))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            flat = x.reshape(-1, 9)
            a = flat @ self.m  # mm with no transpose: stays
            b = torch.addmm(torch.ones(7, device=x.device), flat, self.w.t(), beta=0.5)  # beta: stays
            c = flat @ self.w.t()  # a 2-D linear: recomposed (the t goes)
            return a, b, c

    model = NotLinear().to(DEVICE)
    x = torch.randn(2, 3, 9, device=DEVICE)
    backend = _captured(model, x, grad=False)
    gm = backend.graphs[0].aten
    assert recompose_linear(gm) == 1, gm.code
    assert _count(gm, aten.mm.default) == 1 and _count(gm, aten.addmm.default) == 1
    assert _count(gm, aten.linear.default) == 1
    for g, w in zip(backend.compiled(x), model(x), strict=True):
        assert torch.equal(g, w)


def test_integrator_recomposes_after_the_kernel_rewrite() -> None:
    class Block(nn.Module):
        def __init__(self, h: int = 40) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(h, eps=1e-6)
            self.up = nn.Linear(h, 2 * h, bias=False)
            self.down = nn.Linear(2 * h, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(self.norm(x))))

    torch.manual_seed(0)
    model = Block().to(DEVICE)
    x = torch.randn(2, 3, 40, device=DEVICE)
    with torch.no_grad():
        want = model(x)
        optimized, stats = integrate(model, {})  # no winners: heuristic kernels for the regions
        got = optimized(x)
    assert stats.linears == 2 and stats.total == 1  # the RMSNorm swapped in, both linears recomposed
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
