"""The derived backward of generated regions (codegen/backward.py): each region's vjp traced, formed
into one region and generated, against fp64 autograd of the region's own ops (backward.fp64_vjp,
what the generated_bwd family verifies against), in fp32 and bf16 on small odd and strided shapes;
the multi-kernel backward of a vjp of two loop spaces (norms with weights, a bias beside a row
reduction), through the op and as a verified workload; the eager fallback recorded as data."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from codegen_helpers import trace
from conftest import DEVICE
from torch.fx.experimental.proxy_tensor import make_fx

from solforge.codegen import backward as BW
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen import store
from solforge.kernels import generated as G
from solforge.kernels import generated_bwd as GB
from solforge.numerics import compare
from solforge.plan import generated as PG
from solforge.runtime.stepgraphs import step_graphs
from solforge.tune.verify import verify


@pytest.fixture(autouse=True)
def _private_codegen_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SOLFORGE_CODEGEN_DIR", str(tmp_path / "codegen"))


def _r(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


# name -> (function, its inputs given a dtype, which inputs need a gradient)
CASES: dict[str, tuple[Callable[..., Any], Callable[[torch.dtype], list[torch.Tensor]], tuple[bool, ...]]] = {
    # x read transposed (strided), b broadcast over the rows: db is dx summed over them
    "bias_gelu_strided": (lambda x, b: F.gelu(x.t() + b, approximate="tanh") * 0.5,
                          lambda d: [_r(24, 13, dtype=d), _r(24, seed=1, dtype=d)], (True, True)),
    # a per-channel scale and shift of a 3-D x: their grads summed over dims 0 and 2 (one loop space;
    # a per-row and a per-column input together would need two)
    "channel_broadcasts": (lambda x, s, c: torch.sigmoid(x * s) - c,
                           lambda d: [_r(5, 13, 7, dtype=d), _r(1, 13, 1, seed=1, dtype=d),
                                      _r(13, 1, seed=2, dtype=d)], (True, True, True)),
    "softmax": (lambda x: torch.softmax(x * 2.0, -1), lambda d: [_r(13, 37, dtype=d)], (True,)),
    "log_softmax": (lambda x: torch.log_softmax(x, 1) + 1.0, lambda d: [_r(5, 37, 3, dtype=d)], (True,)),
    # the weight's gradient is a sum over rows (another loop space): only x's here
    "rmsnorm_x": (_rms, lambda d: [_r(13, 37, dtype=d), _r(37, seed=1, dtype=d)], (True, False)),
    "mean_square_loss": (lambda a, b: ((a - b) ** 2).mean(),
                         lambda d: [_r(13, 37, dtype=d), _r(13, 37, seed=1, dtype=d)], (True, True)),
    "two_outputs": (lambda x, w: (torch.sigmoid(x) * w, torch.tanh(x * w) + x),
                    lambda d: [_r(13, 37, dtype=d), _r(37, seed=1, dtype=d)], (True, True)),
}


def _region(f: Callable[..., Any], xs: list[torch.Tensor]) -> Any:
    (fr,) = RG.form_regions(trace(f, *xs).graph)
    return fr.lowered.ir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_kernel_matches_fp64_autograd(case: str, dtype: torch.dtype) -> None:
    f, make, need_in = CASES[case]
    xs = make(dtype)
    ir = _region(f, xs)
    need_out = tuple(True for _ in ir.outputs)
    p = BW.derive(ir, need_in, need_out)
    assert p.ok and p.key is not None, p.error
    bir = store.load(p.key)
    # its inputs: saved forward inputs and output gradients, as the forward's
    assert [m.shape for m in bir.inputs] == [ir.inputs[i].shape if src == "saved" else
                                            ir.out_meta(ir.outputs[i]).shape for src, i in p.inputs]
    gs = [_r(*ir.out_meta(r).shape, seed=5 + k, dtype=ir.out_meta(r).dtype) for k, r in enumerate(ir.outputs)]
    outs = RT.run(store.lowered(p.key), None, BW.backward_inputs(p, xs, gs))
    got = BW.input_grads(p, outs, xs, gs)
    want = BW.fp64_vjp(ir, need_in, need_out, xs, gs)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None) == (not need_in[i]), i
        if g is not None:
            assert g.shape == xs[i].shape and g.dtype == xs[i].dtype
            c = compare(g, w)
            assert c.ok, f"{case} grad {i}: {c.reason}"


def _decomposed(f: Callable[..., Any], xs: list[torch.Tensor]) -> Any:
    """The region of f with LayerNorm / GroupNorm decomposed as the planner decomposes them."""
    (fr,) = RG.form_regions(make_fx(f, decomposition_table=PG._table(), tracing_mode="fake")(*xs).graph)
    return fr.lowered.ir


# a weight or bias gradient summed over the rows next to a row-wise input gradient: two loop spaces
MULTI: dict[str, tuple[Callable[..., Any], Callable[[torch.dtype], list[torch.Tensor]]]] = {
    "layernorm": (lambda x, w, b: F.layer_norm(x, (37,), w, b, 1e-5),
                  lambda d: [_r(13, 37, dtype=d), _r(37, seed=1, dtype=d), _r(37, seed=2, dtype=d)]),
    "rmsnorm": (_rms, lambda d: [_r(13, 37, dtype=d), _r(37, seed=1, dtype=d)]),
    "groupnorm": (lambda x, w, b: F.group_norm(x, 3, w, b, 1e-5),
                  lambda d: [_r(3, 6, 5, 7, dtype=d), _r(6, seed=1, dtype=d), _r(6, seed=2, dtype=d)]),
    "bias_gelu_softmax": (lambda x, b: torch.softmax(F.gelu(x + b), -1),
                          lambda d: [_r(13, 37, dtype=d), _r(37, seed=1, dtype=d)]),
}


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of the generated kernels launched from now on."""
    ran: list[str] = []
    real = RT.run

    def spy(region: Any, *a: Any, **k: Any) -> Any:
        ran.append(region.ir.key)
        return real(region, *a, **k)

    monkeypatch.setattr(RT, "run", spy)
    return ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(MULTI))
def test_multi_kernel_backward_matches_fp64_autograd(case: str, dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the op and autograd: the vjp is several regions, each its own kernel, all launched
    (not the eager fallback), the weight's sum over the rows on a schedule for a non-contiguous
    reduction where it is one; every gradient against fp64 autograd of the forward's ops."""
    f, make = MULTI[case]
    xs = make(dtype)
    ir = _decomposed(f, xs)
    key = G.workload_for(ir).param("key")
    need = tuple(True for _ in xs)
    p = BW.plan(key, need, (True,))
    assert p.ok and len(p.kernels) >= 2, p.error
    # the weight's gradient: a sum over the rows of a (rows, 37) value, read along its contiguous dim
    if case != "groupnorm":
        last = store.lowered(p.kernels[-1].key)
        assert last.space.reduced == (0,) and SC.heuristic(last).variant == "tiles"
    ran = _spy(monkeypatch)
    leaves = [x.clone().requires_grad_() for x in xs]
    (out,) = G.generated_op(leaves, key, "")
    dy = _r(*out.shape, seed=5, dtype=dtype)
    out.backward(dy)
    assert ran == [key, *(k.key for k in p.kernels)], ran
    want = BW.fp64_vjp(ir, need, (True,), xs, [dy])
    for i, (x, w) in enumerate(zip(leaves, want, strict=True)):
        assert x.grad is not None and x.grad.dtype == dtype and w is not None
        c = compare(x.grad, w)
        assert c.ok, f"{case} grad {i}: {c.reason}"


def test_multi_kernel_backward_verifies_as_a_workload() -> None:
    """The tuner's view: the backward workload of a norm with weight exists, its inputs are the
    saved inputs and dy only (no intermediate), and the verifier, whose reference is fp64 autograd
    of the forward's ops, catches a wrong gradient of the second kernel (that the right one passes
    is test_training_layernorm_runs_the_multi_kernel_backward's: optimize verifies it)."""
    f, make = MULTI["layernorm"]
    ir = _decomposed(f, make(torch.float32))
    wl = G.workload_for(ir)
    bwl = G.backward_workload(wl)
    assert bwl is not None and bwl.family == "generated_bwd"
    p = GB.plan_of(wl.param("key"))
    assert len(p.kernels) == 2 and bwl.param("key") == p.kernels[p.main].key and p.main == 0
    assert all(src != "out" for src, _ in p.inputs) and len(bwl.shapes) == len(p.inputs) == 3
    assert GB.is_valid(GB.heuristic(bwl), bwl)

    def wrong(*a: Any, **k: Any) -> Any:
        got = GB.generated_bwd(*a, **k)
        got[-1].mul_(1.01)  # the bias gradient, the second kernel's output
        return got

    v = verify(GB, bwl, wrong, trials=1)
    assert not v.passed and v.max_abs_err < 1, v  # failed on the numbers, not by crashing


def test_fallback_is_recorded_and_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vjp that forms no set of regions (here: forced) is a plan with why, and the op's backward
    is the eager vjp of the region's ops: still eager's numbers."""
    monkeypatch.setattr(BW, "several", lambda graph: "forced")
    x, w = _r(13, 37), _r(37, seed=1)
    ir = _region(_rms, [x, w])
    p = BW.derive(ir, (True, True), (True,))
    assert not p.ok and "two loop spaces" in (p.error or "") and "forced" in (p.error or "")
    key = G.workload_for(ir).param("key")
    BW._PLANS.clear()
    assert G.backward_workload(G.workload_for(ir)) is None
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    (out,) = G.generated_op([xa, wa], key, "")
    dy = _r(13, 37, seed=2)
    out.backward(dy)
    BW._PLANS.clear()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    _rms(xe, we).backward(dy)
    for a, b in ((xa.grad, xe.grad), (wa.grad, we.grad)):
        c = compare(a, b)
        assert c.ok, c.reason


def test_op_backward_runs_the_backward_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the op and autograd: the backward key's kernel runs (not only the same numbers), for
    the call's own masks with config "" and for the full masks with a BWD config; an output whose
    gradient autograd does not give is passed zeros there."""
    ran = _spy(monkeypatch)
    f, make, _ = CASES["two_outputs"]
    x, w = make(torch.float32)
    ir = _region(f, [x, w])
    key = G.workload_for(ir).param("key")
    bwl = G.backward_workload(G.workload_for(ir))
    assert bwl is not None and bwl.family == "generated_bwd"
    dy = _r(13, 37, seed=3)
    for config, need_w in (("", False), ("", True), (f"|{G.heuristic(bwl).encode()}", False)):
        ran.clear()
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_(need_w)
        out0, _ = G.generated_op([xa, wa], key, config)
        out0.backward(dy)  # the second output's gradient is not given
        full = bool(config)
        p = BW.plan(key, (True, need_w or full), (True, full))
        assert p.ok and ran == [key, p.key], (config, need_w, ran)
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_(need_w)
        f(xe, we)[0].backward(dy)
        assert compare(xa.grad, xe.grad).ok
        assert (wa.grad is None) == (not need_w)
        if need_w:
            assert compare(wa.grad, we.grad).ok


def test_op_backward_takes_an_expanded_gradient() -> None:
    """out.sum().backward() hands the op a stride-0 gradient: the backward kernel reads it through
    its strides (its key was traced with a dense one)."""
    f = CASES["softmax"][0]
    x = _r(13, 37)
    key = G.workload_for(_region(lambda t: f(t) * t, [x])).param("key")
    xa = x.clone().requires_grad_()
    (out,) = G.generated_op([xa], key, "")
    out.sum().backward()
    xe = x.clone().requires_grad_()
    (f(xe) * xe).sum().backward()
    c = compare(xa.grad, xe.grad)
    assert c.ok, c.reason


def test_training_layernorm_runs_the_multi_kernel_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """optimize(mode="train") with the hand-written norm families left out: the LayerNorm is a
    generated region, its backward (dx row-wise, then the weight and bias sums over the rows) a
    verified two-kernel generated_bwd workload that the op's backward launches, and every gradient
    is eager's."""
    from solforge import optimize

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(24, 40)
            self.norm = nn.LayerNorm(40)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x))

    torch.manual_seed(0)
    net = Net().to(DEVICE)
    with torch.no_grad():  # not the default ones and zeros: a wrong weight or bias use shows
        net.norm.weight.copy_(_r(40, seed=1))
        net.norm.bias.copy_(_r(40, seed=2))
    x = _r(19, 24)
    # keep_slower: the kernels enter the model on a GPU too, where at this size they may not beat eager
    opt, report = optimize(net, (x,), mode="train", budget=1, max_candidates=1, db=False, profile="off",
                           families=("generated",), keep_slower=True, make_inputs=lambda s: (_r(19, 24, seed=s),))
    assert report.e2e is not None and report.e2e.passed, (report.e2e, report.notes)
    (bwd,) = [r for r in report.regions if r.family == "generated_bwd"]  # type: ignore[attr-defined]
    assert bwd.verified and bwd.integrated, bwd
    ran = _spy(monkeypatch)
    dy = _r(19, 40, seed=5)
    with step_graphs(False):  # run as it is: a step replayed from a CUDA graph (a GPU) calls no launcher
        opt(x).backward(dy)  # type: ignore[operator]
    p = GB.plan_of(ran[0])
    assert len(p.kernels) == 2 and ran == [ran[0], *(k.key for k in p.kernels)], ran
    got = [t.grad.clone() for t in net.parameters()]  # type: ignore[union-attr]
    net.zero_grad()
    net(x).backward(dy)
    for g, t in zip(got, net.parameters(), strict=True):
        c = compare(g, t.grad)
        assert c.ok, c.reason
