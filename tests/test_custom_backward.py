"""Custom backwards inside a captured training graph: a `torch.autograd.Function` (a straight-through
estimator, a gradient reversal), a hook registered on a tensor the forward computes, and a
checkpointed region. An ATen lowering loses all three (the Function's forward becomes plain ops
differentiated by autograd, the hook is registered on a tracing tensor, the checkpointed region is
inlined and its activations kept), so such a graph runs as dynamo gave it (capture's
BackwardLost); without autograd recording the same graph is lowered and optimized. Gradients are
compared with eager: before this, the optimized model's were silently wrong (all zero behind the
rounding STE, a third of eager's behind the hook), and a checkpointed model saved more
activations than the same model without checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE
from torch.utils.checkpoint import checkpoint

from solforge.capture import capture
from solforge.integrate import integrate


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.round(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g  # straight through: round's own derivative is zero


class Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return -0.5 * g


class Net(nn.Module):
    """A linear, a custom backward (`kind`), then an RMSNorm solforge fuses."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(16, 16)
        self.w = nn.Parameter(1 + 0.1 * torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.kind == "ste":
            h = RoundSTE.apply(h * 4) / 4
        elif self.kind == "reverse":
            h = Reverse.apply(h)
        elif self.kind == "hook":
            h.register_hook(lambda g: g * 3)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def _grads(call: nn.Module, m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of m's parameters after a backward through `call` (m itself, or its optimized model)."""
    m.zero_grad()
    call(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["ste", "reverse", "hook"])
def test_training_graph_with_a_custom_backward_runs_as_dynamo_gave_it(kind: str) -> None:
    torch.manual_seed(0)
    m = Net(kind).to(DEVICE).train()
    x = torch.randn(4, 16, device=DEVICE)
    ref = _grads(m, m, x)
    opt, stats = integrate(m, {})
    got = _grads(opt, m, x)
    for n, g in ref.items():
        assert g.abs().max() > 0, n  # the check means something: eager's gradients are not zero
        torch.testing.assert_close(got[n], g, msg=n)
    assert stats.total == 0  # the graph was not rewritten: its RMSNorm stays the model's
    cap = capture(m, (x,), grad=True)
    what = {"ste": "autograd.Function", "reverse": "autograd.Function", "hook": "tensor hook"}[kind]
    assert cap.graphs == [] and any("BackwardLost" in e and what in e for e in cap.errors), cap.errors


def test_without_autograd_the_same_graph_is_optimized() -> None:
    """Inference: only the Function's forward counts, so the graph is lowered and its norm fused."""
    torch.manual_seed(0)
    m = Net("ste").to(DEVICE).eval()
    x = torch.randn(4, 16, device=DEVICE)
    opt, stats = integrate(m, {})
    with torch.no_grad():
        out, ref = opt(x), m(x)
    assert stats.total == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


class Checkpointed(nn.Module):
    """Four linear + RMSNorm blocks, each under torch.utils.checkpoint (transformers' gradient
    checkpointing calls it the same way, non-reentrant)."""

    def __init__(self, use: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Net("none") for _ in range(4))
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.use else b(x)
        return x


def _saved(call: nn.Module, x: torch.Tensor) -> int:
    """Elements autograd saves for the backward during one forward (and run that backward)."""
    n = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        n[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = call(x)
    y.square().sum().backward()
    return n[0]


def test_a_checkpointed_region_keeps_its_recomputation() -> None:
    torch.manual_seed(0)
    m = Checkpointed().to(DEVICE).train()
    plain = Checkpointed(use=False).to(DEVICE).train()
    plain.load_state_dict(m.state_dict())
    x = torch.randn(32, 16, device=DEVICE)
    ref = _grads(m, m, x)
    opt, stats = integrate(m, {})
    got = _grads(opt, m, x)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, msg=n)
    assert stats.total == 0
    compiled = _saved(torch.compile(m, backend="eager"), x)  # dynamo's graph run as it is
    assert _saved(opt, x) == compiled < _saved(plain, x)
