"""linears.py: sibling linears in one op whose backward sums the input
gradients and accumulates weight gradients into .grad inside the GEMMs. Every test compares with
eager nn.Linear, and the counters show which path the backward took."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import requires_gpu

import solforge.integrate.linears
import solforge.runtime.accumulate
from solforge.integrate import IntegrationStats, integrate
from solforge.integrate.linears import COUNTERS, linears


class Block(nn.Module):
    """q/k/v-like siblings on one input, gate/up-like siblings with biases, one single linear."""

    def __init__(self, d: int = 24, bias: bool = False) -> None:
        super().__init__()
        self.d = d
        self.q, self.k, self.v = (nn.Linear(d, w, bias=False) for w in (d, d // 2, d // 2))
        self.gate, self.up = nn.Linear(d, 40, bias=bias), nn.Linear(d, 40, bias=bias)
        self.o = nn.Linear(40, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = torch.cat([q[..., : self.d // 2], k * v], -1) + x  # every weight gets a gradient
        return self.o(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _integrate(model: nn.Module, train: bool = True) -> tuple[Callable[..., Any], IntegrationStats]:
    """Only linears.py's pass: no kernel family (the Block has a SiLU·mul that swiglu would take)."""
    return integrate(model, {}, families=(), train=train)


def _pair(seed: int, **block: Any) -> tuple[Block, Block, Callable[..., Any], IntegrationStats]:
    """An eager Block, its copy, and the copy integrated with linears.py."""
    torch.manual_seed(seed)
    ref = Block(**block)
    opt_model = copy.deepcopy(ref)
    return ref, opt_model, *_integrate(opt_model)


def _counts() -> tuple[int, int]:
    return COUNTERS.in_place, COUNTERS.handed_back


def _grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def test_op_matches_linear_values_and_gradients() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(4, 7, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    bs = [torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    outs = linears(x, ws, bs)
    ref = [torch.nn.functional.linear(x, w, b) for w, b in zip(ws, bs, strict=True)]
    for o, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(o, r)
    # one output unused: its weight gets no gradient, the others are exact
    gs = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs[0], [x, ws[0], bs[0]], gs[0], retain_graph=True)
    exp = torch.autograd.grad(ref[0], [x, ws[0], bs[0]], gs[0])
    for a, b in zip(got, exp, strict=True):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda x, *w: linears(x, w), (x, *ws))


def test_integrated_block_accumulates_into_grad_like_eager() -> None:
    ref, opt_model, optimized, stats = _pair(1, bias=True)
    x = torch.randn(3, 6, 24)
    before = _counts()
    for step in range(3):  # .grad never zeroed: steps 2 and 3 accumulate
        ref(x * (step + 1)).square().mean().backward()
        optimized(x * (step + 1)).square().mean().backward()
        _close(_grads(opt_model), _grads(ref))
    assert stats.grouped == 6  # q/k/v, gate/up, o
    in_place, handed_back = (a - b for a, b in zip(_counts(), before, strict=True))
    assert (handed_back, in_place) == (6, 12)  # the first step has no .grad to add to


def test_zero_grad_set_to_none_hands_the_gradient_back() -> None:
    ref, opt_model, optimized, _ = _pair(2)
    x = torch.randn(2, 4, 24)
    before = _counts()
    for _ in range(2):
        for m, f in ((ref, ref), (opt_model, optimized)):
            m.zero_grad()
            f(x).sum().backward()
    _close(_grads(opt_model), _grads(ref))
    assert _counts()[0] == before[0]


def test_autograd_grad_and_backward_inputs_leave_grad_alone() -> None:
    ref, opt_model, optimized, _ = _pair(3)
    x = torch.randn(2, 4, 24, requires_grad=True)
    ref(x).sum().backward()
    optimized(x).sum().backward()
    held = _grads(opt_model)
    before = _counts()
    # autograd.grad returns the weight's gradient to the caller
    got = torch.autograd.grad(optimized(x).sum(), [opt_model.q.weight, opt_model.up.weight])
    exp = torch.autograd.grad(ref(x).sum(), [ref.q.weight, ref.up.weight])
    for a, b in zip(got, exp, strict=True):
        torch.testing.assert_close(a, b)
    # backward(inputs=[x]) must not touch any weight's .grad
    optimized(x).sum().backward(inputs=[x])
    _close(_grads(opt_model), held)
    assert _counts()[0] == before[0]


def test_hooks_see_the_gradient() -> None:
    ref, opt_model, optimized, _ = _pair(4)
    x = torch.randn(2, 4, 24)
    seen: list[torch.Tensor] = []
    opt_model.q.weight.register_hook(lambda g: seen.append(g.clone()))
    after_acc: list[torch.Tensor] = []
    opt_model.k.weight.register_post_accumulate_grad_hook(lambda p: after_acc.append(p.grad.clone()))
    for _ in range(2):
        ref(x).sum().backward()
        optimized(x).sum().backward()
    _close(_grads(opt_model), _grads(ref))
    # the tensor hook got each step's gradient (its weight is never accumulated in place)
    assert len(seen) == 2 and all(g is not None for g in seen)
    torch.testing.assert_close(seen[0] + seen[1], opt_model.q.weight.grad)
    # the post-accumulate hook saw .grad after each step's accumulation
    assert len(after_acc) == 2
    torch.testing.assert_close(after_acc[1], ref.k.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after_acc[0] * 2, ref.k.weight.grad, rtol=1e-5, atol=1e-5)


def test_switch_off_hands_every_gradient_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(solforge.runtime.accumulate, "IN_PLACE", False)
    ref, opt_model, optimized, _ = _pair(5)
    x = torch.randn(2, 4, 24)
    before = _counts()
    for _ in range(2):
        ref(x).sum().backward()
        optimized(x).sum().backward()
    _close(_grads(opt_model), _grads(ref))
    assert _counts()[0] == before[0]


def test_inference_graphs_are_not_rewritten() -> None:
    ref = Block()
    optimized, stats = _integrate(copy.deepcopy(ref), train=False)
    x = torch.randn(2, 4, 24)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), ref(x))
    assert stats.grouped == 0 and stats.linears > 0


def test_frozen_weights_are_left_to_aten() -> None:
    ref = Block()
    for p in ref.q.parameters():
        p.requires_grad_(False)
    opt_model = copy.deepcopy(ref)
    optimized, stats = _integrate(opt_model)
    x = torch.randn(2, 4, 24)
    ref(x).sum().backward()
    optimized(x).sum().backward()
    _close(_grads(opt_model), _grads(ref))
    assert stats.grouped == 5


@requires_gpu
def test_bf16_accumulation_on_gpu() -> None:
    """Two bf16 steps without zeroing: .grad accumulated by the GEMM against eager's mm + add,
    both against an fp32 reference of the same sum."""
    torch.manual_seed(6)
    ref = Block(d=256).cuda().to(torch.bfloat16)
    opt_model = copy.deepcopy(ref)
    exact = copy.deepcopy(ref).float()
    optimized, _ = _integrate(opt_model)
    x = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16)
    before = _counts()
    for _ in range(2):
        ref(x).float().square().mean().backward()
        optimized(x).float().square().mean().backward()
        exact(x.float()).square().mean().backward()
    assert _counts()[0] - before[0] == 6
    for (k, p), q, e in zip(opt_model.named_parameters(), ref.parameters(), exact.parameters(), strict=True):
        scale = e.grad.abs().max().item()
        err_ours = (p.grad.float() - e.grad).abs().max().item() / scale
        err_eager = (q.grad.float() - e.grad).abs().max().item() / scale
        assert err_ours <= max(2 * err_eager, 1e-2), (k, err_ours, err_eager)



class Adapted(nn.Module):
    """LoRA's shape: frozen base linears, each with a trainable A then B on the same input, so that
    a trainable linear (B) reads another's output (A's), and the As are siblings on x."""

    def __init__(self, d: int = 24, r: int = 4) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(d, d, bias=False).requires_grad_(False) for _ in range(2))
        self.a = nn.ModuleList(nn.Linear(d, r, bias=False) for _ in range(2))
        self.b = nn.ModuleList(nn.Linear(r, d, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, v = (base(x) + b(a(x)) for base, a, b in zip(self.base, self.a, self.b, strict=True))
        return q * v


def test_linear_reading_a_rewritten_linear() -> None:
    """B reads A's output, which the rewrite of A's group replaces: B's group reads the
    replacement (it read the erased node, and the graph failed its lint: a LoRA model's step)."""
    torch.manual_seed(0)
    ref = Adapted()
    opt_model = copy.deepcopy(ref)
    optimized, stats = _integrate(opt_model)
    x = torch.randn(2, 5, 24)
    in_place = COUNTERS.in_place
    for _ in range(2):  # the second backward adds into .grad
        torch.testing.assert_close(optimized(x), ref(x))
        optimized(x).sum().backward()
        ref(x).sum().backward()
    _close(_grads(opt_model), _grads(ref))
    assert stats.grouped == 4  # the As in one group on x, each B alone (the bases are frozen)
    assert COUNTERS.in_place > in_place
