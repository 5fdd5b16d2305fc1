"""Direct calls (kernels/direct.py): the integrated graph calls the ops' implementations without
torch.library's dispatch, with the same values and gradients, and goes back to torch.ops whenever
something traces the call."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import solforge.kernels.rmsnorm  # noqa: F401  (registers the ops)
import solforge.kernels.rope  # noqa: F401
import solforge.kernels.swiglu  # noqa: F401
from solforge.integrate import integrate
from solforge.kernels import direct
from solforge.zoo import load_model

RMS = direct._DIRECT[torch.ops.solforge.rmsnorm.default]
SWIGLU = direct._DIRECT[torch.ops.solforge.swiglu.default]
ROPE = direct._DIRECT[torch.ops.solforge.rope.default]


@pytest.fixture(autouse=True)
def _direct_under_the_profiler(monkeypatch) -> None:  # noqa: ANN001
    """Direct calls go through torch.ops under torch.profiler (so a profile names the ops); here the
    profiler counts dispatches, so they stay direct under it, as without it."""
    monkeypatch.setattr(direct, "_profiling", lambda: False)


def _dispatched(fn, name: str) -> int:  # noqa: ANN001
    """How many times `fn()` (forward and backward) went through the dispatcher's solforge::`name`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == f"solforge::{name}")


def _grads(call, args, wrt):  # noqa: ANN001, ANN202
    out = call(*args)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device="cpu").manual_seed(5)
    dys = [torch.randn(o.shape, generator=g).to(o) for o in outs]
    grads = torch.autograd.grad(outs, wrt, dys)
    return [o.detach() for o in outs], list(grads)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


def _rms_args(requires_grad: bool = True):  # noqa: ANN202
    torch.manual_seed(0)
    x = torch.randn(6, 40, device=DEVICE, dtype=torch.bfloat16, requires_grad=requires_grad)
    w = (1 + 0.1 * torch.randn(40, device=DEVICE)).to(torch.bfloat16).requires_grad_(requires_grad)
    return (x, w, 1e-6, torch.bfloat16, True, ""), [x, w]


def test_rmsnorm_direct_call_gives_the_ops_values_and_gradients_without_dispatch(monkeypatch) -> None:  # noqa: ANN001
    args, wrt = _rms_args()
    ref = _grads(torch.ops.solforge.rmsnorm.default, args, wrt)
    got = _grads(RMS, args, wrt)
    _same(ref[0], got[0])
    _same(ref[1], got[1])
    # the op went through the dispatcher, the direct call did not; the backward formula (the op's
    # own too) calls its kernel directly, unless direct calls are off
    assert _dispatched(lambda: _grads(torch.ops.solforge.rmsnorm.default, args, wrt), "rmsnorm") == 1
    assert _dispatched(lambda: _grads(RMS, args, wrt), "rmsnorm") == 0
    assert _dispatched(lambda: _grads(RMS, args, wrt), "rmsnorm_bwd") == 0
    monkeypatch.setattr(direct, "ENABLED", False)
    assert _dispatched(lambda: _grads(torch.ops.solforge.rmsnorm.default, args, wrt), "rmsnorm_bwd") == 1
    _same(got[1], _grads(torch.ops.solforge.rmsnorm.default, args, wrt)[1])
    # the reference formula: HF's RMSNorm in fp32
    x, w = wrt
    x32 = x.detach().float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w.detach()
    torch.testing.assert_close(got[0][0].float(), want.float(), atol=2e-2, rtol=2e-2)


def test_swiglu_and_rope_direct_calls_match_their_ops() -> None:
    torch.manual_seed(1)
    gate = torch.randn(5, 24, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(5, 24, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    args = (gate, up, "silu", "")
    ref, got = _grads(torch.ops.solforge.swiglu.default, args, [gate, up]), _grads(SWIGLU, args, [gate, up])
    _same(ref[0], got[0])
    _same(ref[1], got[1])
    torch.testing.assert_close(got[0][0].float(), (torch.nn.functional.silu(gate.float()) * up.float()).to(
        torch.bfloat16).float(), atol=2e-2, rtol=2e-2)

    B, H, Hk, T, D = 1, 4, 2, 6, 16  # noqa: N806
    q = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)  # as the graph passes them
    k = torch.randn(B, T, Hk, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    ang = torch.randn(B, T, D, device=DEVICE)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    rargs = (q, k, cos, sin, None, None, 1e-6, False, False, True, torch.bfloat16, "")
    ref, got = _grads(torch.ops.solforge.rope.default, rargs, [q, k]), _grads(ROPE, rargs, [q, k])
    _same(ref[0], got[0])
    _same(ref[1], got[1])


def test_without_autograd_recording_the_implementation_runs_alone() -> None:
    args, _ = _rms_args(requires_grad=False)
    assert _dispatched(lambda: RMS(*args), "rmsnorm") == 0
    out = RMS(*args)
    assert out.grad_fn is None and torch.equal(out, torch.ops.solforge.rmsnorm.default(*args))
    args, _ = _rms_args()
    with torch.no_grad():
        assert _dispatched(lambda: RMS(*args), "rmsnorm") == 0
        assert RMS(*args).grad_fn is None


def test_traced_calls_go_through_torch_ops() -> None:
    args, _ = _rms_args(requires_grad=False)
    with FakeTensorMode() as mode:
        fx_ = mode.from_tensor(args[0])
        fw = mode.from_tensor(args[1])
        out = RMS(fx_, fw, *args[2:])  # the fake implementation, not a Triton launch on fake memory
    assert isinstance(out, FakeTensor) and out.shape == args[0].shape
    gm = make_fx(lambda x, w: RMS(x, w, *args[2:]))(*args[:2])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.solforge.rmsnorm.default]
    # a TorchDispatchMode sees the op (and under it the call is the op's)
    seen: list[str] = []

    class Log(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):  # noqa: ANN001, ANN204
            seen.append(str(func))
            return func(*a, **(kw or {}))

    with Log():
        got = RMS(*args)
    assert "solforge.rmsnorm.default" in seen and torch.equal(got, torch.ops.solforge.rmsnorm.default(*args))


def test_double_backward_goes_through_torch_ops() -> None:
    """With create_graph=True autograd records the backward: the backward kernel is called through
    torch.ops, as without direct calls, whose missing formula autograd reports."""
    args, wrt = _rms_args()
    out = RMS(*args)
    (gx,) = torch.autograd.grad(out.float().square().sum(), [wrt[0]], create_graph=True)
    assert gx.grad_fn is not None and gx.grad_fn.name() == "torch::autograd::WarnNotImplemented"
    with pytest.warns(UserWarning, match="solforge::rmsnorm_bwd: an autograd kernel was not registered"):
        torch.autograd.grad(gx.float().sum(), [wrt[0]])


def test_under_the_profiler_the_ops_are_named(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.undo()  # the real profiler check
    args, wrt = _rms_args()
    assert _dispatched(lambda: _grads(RMS, args, wrt), "rmsnorm") == 1
    assert not direct._traced()


def test_register_refuses_an_op_that_writes_its_inputs() -> None:
    with pytest.raises(ValueError, match="functional"):
        direct.register(torch.ops.aten.add_.Tensor, lambda *a: None)


def test_optimized_training_model_is_the_same_with_and_without_direct_calls(monkeypatch) -> None:  # noqa: ANN001
    lm = load_model("qwen3-tiny", device=DEVICE, dtype=torch.bfloat16, batch=2, seq=8, weights=None, seed=0)
    ids = lm.example_inputs[0]

    def run(enabled: bool) -> tuple[torch.Tensor, list[torch.Tensor], int, int]:
        monkeypatch.setattr(direct, "ENABLED", enabled)
        model = copy.deepcopy(lm.model).train()
        opt, stats = integrate(model, {}, train=True)
        opt(ids)  # compiled and rewritten
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logits = opt(ids).logits
            logits.float().square().mean().backward()
        dispatched = sum(e.count for e in prof.key_averages() if e.key.startswith("solforge::"))
        return logits.detach(), [p.grad.clone() for p in model.parameters()], stats.direct, dispatched

    off, on = run(False), run(True)
    assert off[2] == 0 and on[2] > 0
    # without direct calls every solforge op (forward and backward kernels) went through the
    # dispatcher; with them, none did
    assert off[3] >= 2 * on[2] and on[3] == 0
    torch.testing.assert_close(on[0], off[0], atol=0, rtol=0)
    assert len(on[1]) == len(off[1])
    for a, b in zip(on[1], off[1], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_each_rmsnorm_node_gets_a_site_of_its_own_with_the_values_of_the_whole_path(monkeypatch) -> None:  # noqa: ANN001
    """Without autograd recording an rmsnorm node calls a site of its own (rmsnorm's `_Site`),
    which after its first call skips the launcher's checks; the logits are those of the model with
    direct calls off, bit for bit, on every call."""
    lm = load_model("qwen3-tiny", device=DEVICE, dtype=torch.bfloat16, batch=2, seq=8, weights=None, seed=0)
    ids = lm.example_inputs[0]

    def run(enabled: bool) -> tuple[list[torch.Tensor], list[object]]:
        monkeypatch.setattr(direct, "ENABLED", enabled)
        opt, stats = integrate(copy.deepcopy(lm.model).eval(), {})
        with torch.no_grad():
            logits = [opt(ids).logits for _ in range(3)]
        sites = [n.target.site for s in stats.step_graphs for n in s.gm.graph.nodes
                 if n.op == "call_function" and hasattr(n.target, "site")]
        return logits, sites

    (off, no_sites), (on, sites) = run(False), run(True)
    # qwen3-tiny's norms merge with the residual adds (add_rmsnorm) and RoPE (the q/k norms),
    # which have no sites: the final norm is the one rmsnorm node
    assert no_sites == [] and len(sites) == 1 and sites[0].sig is not None
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)

    class TwoNorms(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.RMSNorm(32, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).view(-1, 16))

    m = TwoNorms().to(DEVICE)
    x = torch.randn(4, 32, device=DEVICE)
    opt, stats = integrate(m, {})
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(opt(x), m(x))
    two = [n.target.site for s in stats.step_graphs for n in s.gm.graph.nodes
           if n.op == "call_function" and hasattr(n.target, "site")]
    assert len(two) == 2 and two[0] is not two[1]
    assert {s.sig[0] for s in two} == {torch.Size([4, 32]), torch.Size([8, 16])}  # each its node's layout
