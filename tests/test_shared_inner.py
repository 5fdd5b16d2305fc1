"""Regions with shared inner nodes (plan/sharing.py): an RMSNorm whose `x.float()` or variance, a
written-out gelu whose `pow(x, 3)`, a silu whose sigmoid, a softmax whose upcast is also read
elsewhere keeps that node (and the region nodes it needs) for its other readers, and the optimized
model computes what the original does, gradients included. A shared node that is written in place,
or whose keeping costs more than the fusion saves, still makes the matcher refuse."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE

from solforge import capture, plan
from solforge.integrate import integrate
from solforge.numerics import compare
from solforge.plan.sharing import Sharing
from solforge.tune import family_module

# the hand-written families: these tests are about what they keep; the generator (plan/generated.py)
# would take the outside readers as regions of their own
FAMILIES = tuple(f for f in plan._matchers() if f != "generated")

aten = torch.ops.aten
H, FF = 37, 53  # odd sizes everywhere
BF16, FP16 = torch.bfloat16, torch.float16


class SharedCastNorm(nn.Module):
    """HF RMSNorm whose upcast is also read after it (the brief's example)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        y = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return y + (h * 2.0).to(x.dtype)


class TwiceCastElsewhere(SharedCastNorm):
    """`x.float()` written three times, once outside the norm: CSE makes it one node read by both."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        y = self.weight * (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)
        return y * torch.sigmoid(x.float()).to(x.dtype)


class SharedVarianceNorm(SharedCastNorm):
    """The variance (square and mean) is read after the norm too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        v = h.pow(2).mean(-1, keepdim=True)
        y = self.weight * (h * torch.rsqrt(v + 1e-6)).to(x.dtype)
        return y * v.to(x.dtype)  # (a product: no cancellation to magnify one rounding)


class SharedCubeGelu(nn.Module):
    """GPT-2's gelu_new written out after a linear, with its x^3 read elsewhere too (no projection
    after it: its sums would only blur the comparison)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, FF)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.fc(x)
        cube = torch.pow(u, 3.0)
        g = 0.5 * u * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * cube)))
        return g + cube.mean(-1, keepdim=True)


class SharedSigmoidMLP(nn.Module):
    """silu written out, g * sigmoid(g) * up, with the sigmoid read elsewhere too."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(H, FF, bias=False), nn.Linear(H, FF, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        s = torch.sigmoid(g)
        return g * s * self.up(x) + s.mean(-1, keepdim=True)


class SharedUpcastSoftmax(nn.Module):
    """transformers' eager-attention softmax (fp32 between casts), the upcast also read elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        p = torch.softmax(xf, dim=-1).to(x.dtype)
        return p + xf.amax(-1, keepdim=True).to(x.dtype)


# module, family, op targets of the nodes the region keeps
CASES: dict[str, tuple[Callable[[], nn.Module], str, list[object]]] = {
    "rmsnorm shared cast": (SharedCastNorm, "rmsnorm", [aten._to_copy.default]),
    "rmsnorm cast merged by cse": (TwiceCastElsewhere, "rmsnorm", [aten._to_copy.default]),
    "rmsnorm shared variance": (SharedVarianceNorm, "rmsnorm",
                                [aten._to_copy.default, aten.pow.Tensor_Scalar, aten.mean.dim]),
    "gelu shared cube": (SharedCubeGelu, "gelu", [aten.pow.Tensor_Scalar]),
    "swiglu shared sigmoid": (SharedSigmoidMLP, "swiglu", [aten.sigmoid.default]),
    "softmax shared upcast": (SharedUpcastSoftmax, "softmax", [aten._to_copy.default]),
}


def _x(seed: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, H, generator=g).to(DEVICE, dtype)


def _winners(groups: list[plan.WorkloadGroup]) -> dict[plan.Workload, str]:
    return {g.workload: family_module(g.workload.family).heuristic(g.workload).encode() for g in groups}


@pytest.mark.parametrize("name", list(CASES))
def test_region_keeps_the_shared_node_and_the_graph_computes_the_same(name: str) -> None:
    """The region is found, the shared node (and what it needs) is kept, and after the rewrite the
    graph still computes it, next to the op, with the same result as before."""
    make, family, kept_ops = CASES[name]
    torch.manual_seed(0)
    m = make().to(DEVICE, FP16)  # half, not bf16: the same casts, and 8x finer rounding to compare through
    x = _x(0, FP16)
    with torch.no_grad():
        (g,) = capture.capture(m, (x,)).graphs
        gm = g.aten
        inputs = _inputs(gm)
        ref = gm(*inputs)
    (match,) = plan.find_matches(gm.graph, FAMILIES)
    assert match.family == family
    assert [n.target for n in match.kept] == kept_ops
    assert match.region(0).kept == tuple(n.name for n in match.kept)
    kept = set(match.kept)
    plan.rewrite(gm, [match], [family_module(family).heuristic(match.workload).encode()])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert all(n.graph is gm.graph for n in kept)  # still in the graph, read by the outside code
    assert sum(getattr(t, "namespace", "") == "solforge" for t in targets) == 1
    with torch.no_grad():
        got = gm(*inputs)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        c = compare(a, b)
        assert c.ok, c.reason


def _inputs(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Fresh random values for the captured graph's placeholders (the parameters dynamo lifted and x):
    the graph is compared with itself before and after the rewrite, so any values do."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for v in [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]:
        t = torch.randn(tuple(v.shape), generator=gen)
        t = 1 + 0.1 * t if t.dim() == 1 else t / math.sqrt(t.shape[-1]) if t.dim() == 2 else t  # weight, matrix, x
        out.append(t.to(DEVICE, v.dtype))
    return out


@pytest.mark.parametrize("name", ["rmsnorm shared cast", "rmsnorm shared variance", "gelu shared cube",
                                  "softmax shared upcast"])
def test_optimize_swaps_the_region_in_and_matches_the_original(name: str) -> None:
    """Through solforge.optimize (inference): one region tuned, swapped in, validated end to end."""
    from solforge import optimize

    make, family, _ = CASES[name]
    torch.manual_seed(0)
    m = make().to(DEVICE, BF16)
    opt, report = optimize(m, (_x(0),), budget=1, max_candidates=1, make_inputs=lambda s: (_x(s),), db=False,
                           families=FAMILIES)
    assert [(r.family, r.count) for r in report.regions] == [(family, 1)]
    assert report.e2e is not None and report.e2e.passed
    x = _x(9)
    with torch.no_grad():
        out, ref = opt(x), copy.deepcopy(m)(x)  # a copy of the model optimized in place is plain
    c = compare(out, ref)
    assert c.ok, c.reason


@pytest.mark.parametrize("name", ["rmsnorm shared cast", "rmsnorm shared variance", "gelu shared cube",
                                  "swiglu shared sigmoid"])
def test_training_gradients_flow_through_both_paths(name: str) -> None:
    """Train mode: the op's backward and the kept ops' autograd both reach the shared node's inputs;
    parameter and input gradients equal the original model's (fp16: it has the casts, and rounds
    finely enough to compare gradients element by element)."""
    make, family, kept_ops = CASES[name]
    torch.manual_seed(0)
    m = make().to(DEVICE, FP16)
    x = _x(1, FP16).requires_grad_(True)
    (graph,) = capture.capture(m, (x,), grad=True).graphs
    (match,) = plan.find_matches(graph.aten.graph, FAMILIES)  # a dead detach (grad mode) is no outside reader
    assert match.family == family and [n.target for n in match.kept] == kept_ops
    groups = plan.plan([graph], FAMILIES)
    opt, stats = integrate(m, _winners(groups), train=True, families=FAMILIES)

    def grads(model: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter],
              inp: torch.Tensor) -> list[torch.Tensor]:
        inp = inp.detach().requires_grad_(True)
        return [g.double() for g in torch.autograd.grad(model(inp).float().pow(2).sum(), [*params, inp])]

    got = grads(opt, list(m.parameters()), x)
    want = grads(m, list(m.parameters()), x)
    # ground truth: the same model in fp32 (no casts to round through)
    m32 = copy.deepcopy(m).float()
    truth = grads(m32, list(m32.parameters()), x.float())
    assert stats.total == 1
    for a, b, t in zip(got, want, truth, strict=True):
        scale = float(t.abs().max())
        err, base = float((a - t).abs().max()) / scale, float((b - t).abs().max()) / scale
        # as close to the truth as the original's own fp16 gradients (a missing path is off by O(1))
        assert err <= 2 * base + 1e-3, (err, base)


class InPlaceEps(nn.Module):
    """`v.add_(eps)` in the norm, and v (the in-place op's result) returned: an impure shared node."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(v.add_(1e-6)), v


class WrittenVariance(nn.Module):
    """A pure shared mean, written in place by the code outside after the norm read it."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = x.pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(v + 1e-6) * 2.0
        return y, v.mul_(3.0)


class SharedSilu(nn.Module):
    """silu(g) read elsewhere: kept, it would cost as much as the mul it saves."""

    def forward(self, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = F.silu(g)
        return s * u, s + 1


def _refusals(m: nn.Module, *xs: torch.Tensor) -> tuple[list[plan.Match], list[str]]:
    """(matches found, why the raw matches that share nodes were refused)."""
    from solforge.plan import _matchers

    with torch.no_grad():
        (g,) = capture.capture(m, xs).graphs
    graph = g.aten.graph
    sharing = Sharing(graph)
    raw = [mt for f, matcher in _matchers().items() if f in FAMILIES for mt in matcher(graph)]
    why = [r for mt in raw if (r := sharing.refusal(mt.nodes, mt.outputs, mt.inputs)) is not None]
    return plan.find_matches(graph, FAMILIES), why


def test_impure_or_written_shared_nodes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # the writes as the lowering records them: capture/inplace.py would make these two out-of-place
    # (fresh tensors, no views), and the refusals are for writes it leaves (into inputs, views)
    from solforge.capture import backend

    monkeypatch.setattr(backend, "functionalize_pointwise", lambda gm: 0)
    x = torch.randn(4, H, device=DEVICE)
    found, why = _refusals(InPlaceEps(), x)
    assert found == [] and len(why) == 1 and "not a pure op" in why[0]
    found, why = _refusals(WrittenVariance(), x)
    assert found == [] and len(why) == 1 and "written in place" in why[0]


def test_sharing_that_does_not_pay_is_refused() -> None:
    g, u = torch.randn(6, FF, device=DEVICE), torch.randn(6, FF, device=DEVICE)
    found, why = _refusals(SharedSilu(), g, u)
    assert found == [] and len(why) == 1 and "saves no launch" in why[0]


def test_kept_nodes_stop_at_outputs_and_follow_inputs() -> None:
    """kept_nodes: a shared node and the region nodes it reads, never an output."""
    from solforge.plan.sharing import kept_nodes

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(aten.neg.default, (x,))
    b = graph.call_function(aten.exp.default, (a,))
    c = graph.call_function(aten.mul.Tensor, (b, a))
    d = graph.call_function(aten.sin.default, (c,))
    outside = graph.call_function(aten.cos.default, (b,))
    after_out = graph.call_function(aten.tan.default, (d,))
    graph.output((d, outside, after_out))
    assert kept_nodes([a, b, c, d], [d]) == [a, b]
    assert kept_nodes([a, b, c], [c]) == [a, b]  # c (an output) read by d outside: the op provides it
    assert kept_nodes([a, c, d], [d]) == [a]  # a read by b, outside this region
    assert kept_nodes([b, c, d], [d]) == [b]  # stops at the region's edge (a is an input)
