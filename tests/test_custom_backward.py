"""Custom backwards inside a captured training graph: a `torch.autograd.Function` (a straight-through
estimator, a gradient reversal), a hook registered on a tensor the forward computes, and checkpointed
regions. An ATen lowering loses all three (the Function's forward becomes plain ops differentiated by
autograd, the hook is registered on a tracing tensor, the region is inlined). A Function is kept as
one call applying it as dynamo traced it, and a checkpointed region as one call running its body,
lowered and fused on its own, under torch.utils.checkpoint (capture/checkpoint.py); a graph with a
hook runs as dynamo gave it (capture's BackwardLost). Without autograd recording every such graph is
lowered and optimized. Gradients are compared with eager: before this, the
optimized model's were silently wrong (all zero behind the rounding STE, a third of eager's behind
the hook), and a checkpointed model saved more activations than the same model without
checkpointing (its regions inlined)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE
from torch.utils.checkpoint import checkpoint

from solforge.capture import capture
from solforge.integrate import integrate
from solforge.runtime import traingraphs


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
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _optimized_with_eager_gradients(m: nn.Module, x: torch.Tensor, tol: float = 1e-4) -> tuple[Any, Any]:
    """integrate(m) and a check that one backward through it gives m's parameters eager's gradients
    (within `tol`: a fused kernel rounds differently from eager's ops); (optimized model, stats)."""
    seed = torch.initial_seed()
    ref = _grads(m, m, x)
    opt, stats = integrate(m, {})
    torch.manual_seed(seed)  # dropout draws the same masks in both
    got = _grads(opt, m, x)
    assert got.keys() == ref.keys()
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, atol=tol, rtol=tol, msg=n)
    return opt, stats


@pytest.mark.parametrize("kind", ["ste", "reverse"])
def test_a_custom_function_keeps_its_backward_and_the_rest_is_fused(kind: str) -> None:
    """The Function is applied as dynamo traced it (capture/checkpoint.py's `function` op), with its
    own backward; the RMSNorm after it is fused."""
    torch.manual_seed(0)
    m = Net(kind).to(DEVICE).train()
    x = torch.randn(4, 16, device=DEVICE)
    opt, stats = _optimized_with_eager_gradients(m, x)
    assert stats.total == 1
    assert all(g.abs().max() > 0 for g in _grads(opt, m, x).values())  # zero behind the STE, before
    cap = capture(m, (x,), grad=True)
    assert len(cap.graphs) == 1 and not cap.errors, cap.errors


def test_a_tensor_hook_keeps_the_graph_as_dynamo_gave_it() -> None:
    """Dynamo leaves the hook in the graph (on the CPU): the graph runs as dynamo gave it. Or it
    traces the hook into an autograd.Function application (on a GPU, seen on an H200), which is
    kept as one call, and the norm is fused. Either way the gradients are eager's."""
    torch.manual_seed(0)
    m = Net("hook").to(DEVICE).train()
    x = torch.randn(4, 16, device=DEVICE)
    ref = _grads(m, m, x)
    opt, stats = integrate(m, {})
    got = _grads(opt, m, x)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, msg=n)
    cap = capture(m, (x,), grad=True)
    if cap.graphs:
        assert not cap.errors and stats.total == 1, cap.errors
        ops = [n.target for n in cap.graphs[0].aten.graph.nodes]
        assert torch.ops.solforge_capture.function.default in ops
    else:
        assert stats.total == 0  # the graph was not rewritten: its RMSNorm stays the model's
        assert any("BackwardLost" in e and "tensor hook" in e for e in cap.errors), cap.errors


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
    checkpointing calls it the same way, non-reentrant); dropout in the blocks where asked."""

    def __init__(self, use: bool = True, dropout: float = 0.0, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Net("none") for _ in range(4))
        self.use, self.p, self.reentrant = use, dropout, reentrant

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.blocks[i](x), self.p, self.training) if self.p else self.blocks[i](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.blocks)):
            x = checkpoint(self.block, i, x, use_reentrant=self.reentrant) if self.use else self.block(i, x)
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


@pytest.mark.parametrize("dropout,reentrant", [(0.0, False), (0.2, False), (0.0, True)])
def test_checkpointed_regions_are_fused_and_stay_checkpointed(dropout: float, reentrant: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block's RMSNorm is fused inside its checkpoint; the step saves what dynamo's own graph
    saves (the blocks' inputs), less than the model without checkpointing; gradients equal eager's,
    dropout's masks too (the recomputation draws the same numbers)."""
    torch.manual_seed(0)
    m = Checkpointed(dropout=dropout, reentrant=reentrant).to(DEVICE).train()
    plain = Checkpointed(use=False, dropout=dropout).to(DEVICE).train()
    plain.load_state_dict(m.state_dict())
    # an input that requires grad: torch's reentrant checkpoint gives no gradients without one
    x = torch.randn(32, 16, device=DEVICE, requires_grad=True)
    torch.manual_seed(1)
    opt, stats = _optimized_with_eager_gradients(m, x)
    assert stats.total == 4  # one RMSNorm per checkpointed block, fused
    cap = capture(m, (x,), grad=True)
    assert len(cap.graphs) == 5 and not cap.errors  # four bodies and the graph that calls them
    # what autograd saves, without the training replays (traingraphs.py, on a GPU): a replayed
    # step keeps its activations in its CUDA graph's pool, out of the saved-tensor hooks' sight.
    # Each block's input and parameters, nothing inside a block: what checkpointing promises (on
    # the CPU, what dynamo's own graph saves; on an H200 that one saved as much as `plain`).
    monkeypatch.setattr(traingraphs, "ENABLED", False)
    blocks = sum(x.numel() + sum(p.numel() for p in b.parameters()) for b in m.blocks)
    assert _saved(opt, x) == blocks < _saved(plain, x)


def _save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class Selective(Checkpointed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        for i in range(len(self.blocks)):
            x = checkpoint(self.block, i, x, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, _save_mm))
        return x


def test_a_selective_checkpoint_keeps_its_policy() -> None:
    """A selective checkpointing policy (context_fn: save the matmuls' outputs, recompute the rest)
    reaches torch.utils.checkpoint with the fused body."""
    torch.manual_seed(0)
    m = Selective().to(DEVICE).train()
    x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    opt, stats = _optimized_with_eager_gradients(m, x)
    assert stats.total == 4
    assert _saved(opt, x) == _saved(torch.compile(m, backend="eager"), x)


def test_an_unsupported_checkpoint_keeps_the_graph_as_dynamo_gave_it() -> None:
    """A checkpointed region called with something other than tensors is not kept: the graph is not
    lowered, and its checkpoint runs as torch runs it."""

    class Scaled(Checkpointed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]  # a graph for many sizes passes sizes to the body: made dynamic below
            return checkpoint(lambda t: self.block(0, t) * n, x, use_reentrant=False)

    torch.manual_seed(0)
    m = Scaled().to(DEVICE).train()
    x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0)
    opt, stats = _optimized_with_eager_gradients(m, x)
    assert stats.total == 0
    cap = capture(m, (x,), grad=True)
    assert cap.graphs == [] and any("not kept" in e for e in cap.errors) and \
        any("BackwardLost" in e and "checkpointed region" in e for e in cap.errors), cap.errors


def test_transformers_gradient_checkpointing_gets_fused_kernels() -> None:
    """qwen3-tiny with `gradient_checkpointing_enable()`: every decoder layer is a checkpointed region;
    their norms, rope and SwiGLU are fused inside (they ran unfused, the graph as dynamo gave it,
    before checkpoint.py), the gradients equal eager's, and the step saves no more than dynamo's
    own graph of the checkpointed model."""
    from solforge.zoo import load_model

    loaded = load_model("qwen3-tiny", device=DEVICE, dtype="fp32", batch=2, seq=16)  # short: the interpreter
    m = loaded.model.train()
    m.gradient_checkpointing_enable()
    ids = loaded.example_inputs

    def grads(call: Any) -> dict[str, torch.Tensor]:
        m.zero_grad()
        call(*ids).logits.float().square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref = grads(m)
    opt, stats = integrate(m, {})
    got = grads(opt)
    assert got.keys() == ref.keys()
    for n, g in ref.items():
        assert ((got[n] - g).abs().max() / g.abs().max()).item() < 1e-4, n
    families = {k.partition("[")[0] for k in stats.untuned}
    assert {"rope", "add_rmsnorm", "swiglu"} <= families, stats.untuned

    def saved(call: Any) -> int:
        n = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            n[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call(*ids)
        out.logits.sum().backward()
        return n[0]

    compiled = torch.compile(m, backend="eager")
    saved(compiled)  # its first call compiles
    assert saved(opt) <= saved(compiled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_checkpointed_training_steps_on_the_gpu() -> None:
    """qwen3-tiny with gradient checkpointing, ten AdamW steps: with the training replays on (the
    default: the checkpoint ops' recomputation then runs inside the captured backward, or the capture
    is declined) and off, and eager, give the same losses and parameters."""
    import copy

    import torch.nn.functional as F

    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device="cuda", dtype=torch.float32, batch=2, seq=8, weights=None, seed=0)
    lm.model.gradient_checkpointing_enable()
    models = {"on": lm.model.train(), "off": copy.deepcopy(lm.model).train(),
              "eager": copy.deepcopy(lm.model).train()}
    calls = {"on": integrate(models["on"], {})[0], "off": integrate(models["off"], {}, cuda_graphs=False)[0],
             "eager": models["eager"]}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, lm.model.config.vocab_size, (2, 9), generator=g).cuda() for _ in range(2)]
    losses: dict[str, list[float]] = {name: [] for name in models}
    for name, model in models.items():
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(10):
            ids = batches[i % 2]
            loss = F.cross_entropy(calls[name](ids[:, :-1]).logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            losses[name].append(float(loss))
    for other, tol in (("off", 1e-4), ("eager", 1e-3)):
        for a, b in zip(losses["on"], losses[other], strict=True):
            assert abs(a - b) <= tol * max(1.0, abs(a)), (other, losses)
        worst = max(float((q - p).norm() / p.norm())
                    for p, q in zip(models[other].parameters(), models["on"].parameters(), strict=True))
        assert worst < tol, (other, worst)
