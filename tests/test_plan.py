"""Matching: every way of writing RMSNorm is found (and look-alikes are not), regions group into
workloads, and the rewritten graph computes the same function as the original."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE, FULL_SWEEPS, requires_gpu

from solforge import capture, plan
from solforge.integrate import integrate
from solforge.kernels import rmsnorm as fam
from solforge.numerics import compare

H = 48


class HFNorm(nn.Module):
    """Hugging Face Qwen3/Llama RMSNorm, as transformers writes it."""

    def __init__(self, h: int = H) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(h))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)


class MulSelf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(dim=x.dim() - 1, keepdim=True) + 1e-5) * self.w


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (H,), self.w, 1e-6)


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n = nn.RMSNorm(H, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(x)


class NoWeightSqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)


class HeadNorm(nn.Module):
    """Qwen3's q/k norm: RMSNorm over head_dim of a 4-D view of a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, 4 * 16, bias=False)
        self.q_norm = HFNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(*x.shape[:-1], 4, 16)
        return self.q_norm(q).transpose(1, 2)


SPELLINGS = {
    "hf": (HFNorm, 1),
    "x*x": (MulSelf, 1),
    "F.rms_norm": (Functional, 1),
    "nn.RMSNorm": (Module, 1),
    "x/sqrt, no weight": (NoWeightSqrt, 1),
    "head_dim 4-D": (HeadNorm, 1),
}


def _run(m: nn.Module, x: torch.Tensor) -> tuple[list[plan.WorkloadGroup], torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, (x,)).graphs)
        winners = {g.workload: fam.heuristic(g.workload).encode() for g in groups}
        opt, stats = integrate(m, winners)
        out, ref = opt(x), m(x)
    assert stats.total == sum(g.count for g in groups)
    return groups, out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_spelling_is_found_and_swapped(name: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    cls, expected = SPELLINGS[name]
    m = cls().to(DEVICE, dtype)
    x = torch.randn(2, 5, H, device=DEVICE, dtype=dtype)
    groups, out, ref = _run(m, x)
    assert sum(g.count for g in groups) == expected, [g.workload.key for g in groups]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    c = compare(out, ref)
    assert c.ok, c.reason


def test_workload_records_what_the_region_computes() -> None:
    m = HFNorm().to(DEVICE, torch.bfloat16)
    x = torch.randn(3, 7, H, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        (g,) = plan.plan(capture.capture(m, (x,)).graphs)
    wl = g.workload
    assert wl.family == "rmsnorm"
    assert wl.shapes == ((21, H), (H,))
    assert wl.param("eps") == pytest.approx(1e-6)
    assert wl.param("round_before_weight") is True  # HF rounds to bf16 before the weight
    assert wl.param("out_dtype") == "bf16"


class LookAlikes(nn.Module):
    """Reductions that are not an RMSNorm must be left alone (an RMSNorm over another dim than the
    last is one: tests/test_norm_dims.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * torch.rsqrt(x.pow(2).mean(0) + 1e-6)  # the same numbers, but no keepdim: not matched
        b = x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6)  # not a square
        c = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-6)  # layernorm
        y = x + 1
        d = y * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # scales another tensor
        return a + b + c + d


def test_look_alikes_do_not_match() -> None:
    x = torch.randn(4, H, device=DEVICE)
    with torch.no_grad():
        assert plan.plan(capture.capture(LookAlikes(), (x,)).graphs) == []


class SharedIntermediate(nn.Module):
    """The rsqrt is used twice: replacing the norm would leave it computed anyway, so no match."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * r, r


def test_region_with_escaping_intermediate_is_left_alone() -> None:
    x = torch.randn(4, H, device=DEVICE)
    with torch.no_grad():
        assert plan.plan(capture.capture(SharedIntermediate(), (x,)).graphs) == []


# Qwen3-4B's 36 layers with SOLFORGE_FULL_SWEEPS=1 (and on a GPU); the CPU suite plans 6 of them: the
# capture's trace is most of the test's time and grows with the layers (36: ~11 s on the CI machine)
LAYERS = 36 if FULL_SWEEPS else 6


def test_qwen3_counts_and_workloads_at_36_layers() -> None:
    """Qwen3-4B's structure (36 layers; 6 off the GPU, see LAYERS) with a small hidden size: 2L + 1
    hidden norms (2L of them after a residual add: add_rmsnorm), L q-norms and L k-norms, and L
    SwiGLUs, each named by its module path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    n = LAYERS
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=n,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        graphs = capture.capture(model, (ids,)).graphs
        groups = plan.plan(graphs, families=("rmsnorm",))  # alone: the q/k norms are rmsnorm regions
        fused = plan.plan(graphs)  # with every family
    counts = sorted(g.count for g in groups)
    assert counts == [n, n, 2 * n + 1]
    assert sorted((g.workload.family, g.count) for g in fused) == [
        ("add_rmsnorm", 2 * n), ("rmsnorm", 1), ("rope", n), ("swiglu", n)]
    modules = {r.module for g in groups + fused for r in g.regions}
    assert "model.layers.3.self_attn.q_norm" in modules
    assert f"model.layers.{n - 1}.post_attention_layernorm" in modules
    assert "model.norm" in modules
    assert f"model.layers.{n - 1}.mlp" in modules


@pytest.mark.parametrize("training", [False, True])
def test_fused_aten_rms_norm_is_matched(training: bool) -> None:
    """On CUDA, F.rms_norm / nn.RMSNorm lower to aten._fused_rms_norm -> (out, rstd), rstd unused,
    or in a training graph read by a detach without users (make_fx's record of what autograd saves;
    not matched before, found on an H200). (On the CPU it decomposes, so the graph is built by hand
    here.)"""
    import operator

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        xv = torch.empty(6, H, dtype=torch.bfloat16)
        wv = torch.empty(H, dtype=torch.bfloat16)
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["val"], w.meta["val"] = xv, wv
    fused = g.call_function(torch.ops.aten._fused_rms_norm.default, (x, [H], w, None))
    out = g.call_function(operator.getitem, (fused, 0))
    rstd = g.call_function(operator.getitem, (fused, 1))  # dead
    if training:
        g.call_function(torch.ops.aten.detach.default, (rstd,))
    out.meta["val"] = xv
    y = g.call_function(torch.ops.aten.mul.Tensor, (out, 2))
    g.output(y)
    gm = torch.fx.GraphModule(nn.Module(), g)
    (m,) = plan.find_matches(gm.graph)
    assert m.workload.shapes == ((6, H), (H,))
    assert m.workload.param("eps") == torch.finfo(torch.float32).eps  # eps=None: fp32's eps, as PyTorch
    plan.rewrite(gm, [m], [fam.heuristic(m.workload).encode()])
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == ["solforge.rmsnorm.default", "aten.mul.Tensor"]


# a two-output op for the multi-output rewrite: (min, max) over the last dim
_TEST_LIB = torch.library.Library("solforge_test", "FRAGMENT")
_TEST_LIB.define("minmax(Tensor x, str config) -> (Tensor, Tensor)")
_TEST_LIB.impl("minmax", lambda x, config: (x.amin(-1), x.amax(-1)), "CompositeExplicitAutograd")
torch.library.register_fake("solforge_test::minmax", lambda x, config: (x.amin(-1), x.amax(-1)))


class MinMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo = x.amin(-1)
        y = x * 3
        hi = x.amax(-1)
        return (hi - lo) * y.sum(-1)


def test_multi_output_match_rewrites_to_one_call_and_getitems() -> None:
    """A Match with two outputs becomes one op call (before its earliest output) and one getitem
    per output; extract returns both outputs; the Region records them in order."""
    import operator

    x = torch.randn(3, 5, 7)
    gm = capture.capture(MinMax(), (x,)).graphs[0].aten
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    lo, hi = nodes[torch.ops.aten.amin.default], nodes[torch.ops.aten.amax.default]
    (xin,) = lo.all_input_nodes
    wl = plan.Workload(family="minmax", shapes=((3, 5, 7),), dtypes=("fp32",))
    m = plan.Match("minmax", torch.ops.solforge_test.minmax.default, lo, (xin,), [lo, hi], wl, outputs=(lo, hi))
    assert m.multi and m.region(0).outputs == (lo.name, hi.name) and m.region(0).output == lo.name
    sub, metas = plan.extract(m)
    got = sub(x)
    assert isinstance(got, tuple) and torch.equal(got[0], x.amin(-1)) and torch.equal(got[1], x.amax(-1))
    assert [tuple(v.shape) for v in metas] == [(3, 5, 7)]
    ref = gm(x)
    assert plan.rewrite(gm, [m], ["cfg"]) == 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    targets = [n.target for n in calls]
    assert torch.ops.aten.amin.default not in targets and torch.ops.aten.amax.default not in targets
    i = targets.index(torch.ops.solforge_test.minmax.default)
    assert targets[i + 1:i + 3] == [operator.getitem, operator.getitem]
    assert [calls[i + 1].args[1], calls[i + 2].args[1]] == [0, 1]
    assert calls[i].args == (xin, "cfg")
    torch.testing.assert_close(gm(x), ref)


class PowSelf(MulSelf):
    """MulSelf's RMSNorm with pow(2) for x * x: the same workload, other ATen ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=x.dim() - 1, keepdim=True) + 1e-5) * self.w


class TwoNorms(nn.Module):
    def __init__(self, cls: type[nn.Module]) -> None:
        super().__init__()
        self.a, self.b = cls(), cls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + 1)


def test_region_signature_names_the_computation_not_the_nodes() -> None:
    """The kernel database keeps a region's original time under its signature: equal for the same
    ops anywhere in a graph, different for another spelling of the same workload."""
    x = torch.randn(2, 5, H, device=DEVICE)

    def matches(cls: type[nn.Module]) -> list[plan.Match]:
        with torch.no_grad():
            (g,) = capture.capture(TwoNorms(cls).to(DEVICE), (x,)).graphs
        return plan.find_matches(g.aten.graph, ["rmsnorm"])

    mul, pow_ = matches(MulSelf), matches(PowSelf)
    assert len(mul) == len(pow_) == 2 and {m.workload for m in mul} == {m.workload for m in pow_}
    assert mul[0].nodes[0].name != mul[1].nodes[0].name
    assert plan.region_signature(mul[0]) == plan.region_signature(mul[1])
    assert plan.region_signature(pow_[0]) == plan.region_signature(pow_[1])
    assert plan.region_signature(mul[0]) != plan.region_signature(pow_[0])


def test_a_cpu_scalar_constant_is_read_from_the_kernels_device() -> None:
    """A 0-dim CPU constant in the graph (dynamo lifts `torch.tensor(0.5)` written in forward) that
    a kernel on another device reads is handed to it as a copy there, made once; the graph's other
    readers and other inputs keep theirs ("meta" stands in for CUDA here)."""
    root = torch.nn.Module()
    root.c = torch.tensor(0.5)
    root.v = torch.ones(3)
    graph = fx.Graph()
    x = graph.placeholder("x")
    c, v = graph.get_attr("c"), graph.get_attr("v")
    out = graph.call_function(torch.ops.aten.add.Tensor, (graph.call_function(torch.ops.aten.minimum.default,
                                                                               (x, c)), v))
    graph.output(out)
    gm = fx.GraphModule(root, graph)
    c.meta["val"] = root.c
    moved: dict[fx.Node, fx.Node] = {}
    new = plan.on_device(gm, c, "meta", moved)
    assert new is not c and new.op == "get_attr" and getattr(gm, new.target).device.type == "meta"
    assert getattr(gm, new.target).shape == () and new.meta["val"].device.type == "meta"
    assert plan.on_device(gm, c, "meta", moved) is new and plan.on_device(gm, new, "meta", moved) is new
    assert plan.on_device(gm, v, "meta", moved) is v and plan.on_device(gm, x, "meta", moved) is x
    assert root.c.device.type == "cpu" and c.users  # the original constant and its reader stay
    gm.graph.lint()
    # the region's device is the GPU's although its first value is the CPU constant
    from solforge.codegen import ir

    aten, g = torch.ops.aten, fx.Graph()
    xs, cs = g.placeholder("x"), g.placeholder("c")
    lifted = g.call_function(aten.lift_fresh_copy.default, (cs,))
    low = g.call_function(aten.minimum.default, (xs, lifted))
    g.output(low)
    for n, v in ((xs, torch.empty(3, 5, device="meta")), (cs, root.c), (lifted, root.c),
                 (low, torch.empty(3, 5, device="meta"))):
        n.meta["val"] = v
    assert ir.from_nodes([lifted, low], [low]).device == "meta"


@requires_gpu
def test_a_region_reading_a_cpu_scalar_constant_runs_on_the_gpu() -> None:
    """KernelBench level 2's Conv2d_Min_Add_Multiply takes the min with `torch.tensor(c)`: the
    generated region's kernel reads it from the GPU, and the model computes eager's values."""
    from solforge import optimize

    class MinConst(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (torch.min(x, torch.tensor(0.25)) + 1.5) * 2.0

    make = lambda s: (torch.randn(33, 257, generator=torch.Generator().manual_seed(s)).cuda(),)  # noqa: E731
    m = MinConst()
    opt, report = optimize(m, make(0), budget=1, max_candidates=1, db=False, profile="off", keep_slower=True,
                           make_inputs=make)
    assert report.e2e is not None and report.e2e.passed, report.notes
    assert any(r.family == "generated" and r.integrated for r in report.regions), report.regions
    (x,) = make(5)
    torch.testing.assert_close(opt(x), m(x))
