"""Common-subexpression elimination on the lowered graph: repeated pure ops are computed once, so a
model that writes `x.float()` twice matches like one that writes it once; the merged graph computes
bit for bit what the traced one computes; random ops, ops around in-place writes and tensors that
leave the graph are never merged."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE

from solforge import capture, plan
from solforge.capture.cse import eliminate_common_subexpressions
from solforge.zoo import load_model

aten = torch.ops.aten
H = 37  # odd hidden size everywhere


class TwiceCastNorm(nn.Module):
    """RMSNorm that upcasts x twice (the spelling that found this gap)."""

    def __init__(self, h: int = H) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)


class TwiceCastSwiGLU(nn.Module):
    """silu written out in fp32 with the gate upcast twice: g.float() * sigmoid(g.float()) * up."""

    def __init__(self, h: int = H, f: int = 2 * H + 1) -> None:
        super().__init__()
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate(x), self.up(x)
        return (g.float() * torch.sigmoid(g.float()) * u.float()).to(x.dtype)


class Dropouts(nn.Module):
    """Two dropouts and two rand_likes of one input: four independent draws."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, self.training) + F.dropout(x, 0.5, self.training) \
            + torch.rand_like(x) * torch.rand_like(x)


class InPlace(nn.Module):
    """nn.RMSNorm (its graph holds an in-place add_) next to repeated casts elsewhere, plus a tensor
    read before and after an in-place write."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H, eps=1e-5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x.exp()
        before = a.double().sum(-1)
        # `a` changes through a view: the same call a.double() before and after reads other values
        # (written through `a` itself, the trace would name the mul_'s result instead)
        a.view(-1).mul_(2)
        after = a.double().sum(-1)
        return self.norm(x).sum(-1) + before + after, x.double() * x.double()


def _lowered(model: nn.Module, inputs: tuple[Any, ...]) -> list[tuple[fx.GraphModule, fx.GraphModule, list[Any]]]:
    """(as traced, after CSE, dynamo's example inputs) for every graph dynamo makes of `model`."""
    seen: list[tuple[fx.GraphModule, list[Any]]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=backend, dynamic=False)(*inputs)
    return [(capture.lower_to_aten(gm, ex), capture.lower_to_aten(gm, ex), ex) for gm, ex in seen]


def _fresh(ex: list[Any], seed: int) -> list[Any]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(x.shape, generator=g, device=x.device).to(x.dtype) if isinstance(x, torch.Tensor)
            and x.is_floating_point() else x.clone() if isinstance(x, torch.Tensor) else x for x in ex]


def _ops(gm: fx.GraphModule, op: Any) -> int:
    return sum(n.target == op for n in gm.graph.nodes)


def _assert_bit_identical(traced: fx.GraphModule, merged: fx.GraphModule, ex: list[Any]) -> None:
    for seed in (1, 2):
        inputs = _fresh(ex, seed)
        torch.manual_seed(seed)
        a = traced(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        torch.manual_seed(seed)
        b = merged(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(DEVICE).eval()


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def test_qwen3_and_gpt2_graphs_compute_the_same_bits() -> None:
    lm = load_model("qwen3-tiny", device=DEVICE, dtype="fp32", batch=3, seq=11)
    with torch.no_grad():
        for model, inputs, min_removed in ((lm.model, lm.example_inputs, 8), (_gpt2(), (_ids(97),), 1)):
            torch.compiler.reset()
            graphs = _lowered(model, inputs)
            removed = 0
            for traced, merged, ex in graphs:
                removed += eliminate_common_subexpressions(merged)
                assert len(merged.graph.nodes) == len(traced.graph.nodes) - removed
                _assert_bit_identical(traced, merged, ex)
            # qwen3: per layer, cos/sin unsqueezes repeat; q/k/v projections view their input alike
            assert removed >= min_removed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twice_cast_norm_is_one_cast_and_same_bits(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    m = TwiceCastNorm().to(DEVICE, dtype)
    x = torch.randn(3, 5, H, device=DEVICE, dtype=dtype)
    (traced, merged, ex), = _lowered(m, (x,))
    removed = eliminate_common_subexpressions(merged)
    casts = _ops(traced, aten._to_copy.default)
    assert removed == (1 if dtype == torch.bfloat16 else 0)  # fp32: .float() traces to nothing
    assert _ops(merged, aten._to_copy.default) == casts - removed
    _assert_bit_identical(traced, merged, ex)


def test_random_ops_never_merge() -> None:
    m = Dropouts().train()
    x = torch.randn(4, H, device=DEVICE)
    (traced, merged, ex), = _lowered(m, (x,))
    # on CPU a dropout traces to empty_like + bernoulli_ + div_ (native_dropout on CUDA): the two
    # empty_like(x) are identical calls, kept apart because each is then written in place
    assert eliminate_common_subexpressions(merged) == 0
    assert len(merged.graph.nodes) == len(traced.graph.nodes)
    assert sum(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and torch.Tag.nondeterministic_seeded in n.target.tags for n in merged.graph.nodes) == 4
    _assert_bit_identical(traced, merged, ex)
    # and the merged graph's dropouts really draw twice: on ones, each keeps an element as 2.0, so
    # d1 + d2 is 0, 2 or 4 (one mask drawn once gives only 0 or 4), plus a product in [0, 1)
    (y,) = merged(torch.ones(64, 64, device=DEVICE))
    assert bool(((y >= 2) & (y < 3)).any())


def test_in_place_writes_and_outputs_block_merging() -> None:
    torch.manual_seed(0)
    m = InPlace().to(DEVICE)
    x = torch.randn(2, 3, H, device=DEVICE)
    with torch.no_grad():
        (traced, merged, ex), = _lowered(m, (x,))
        removed = eliminate_common_subexpressions(merged)
        # the casts of `a` around a.mul_ stay two; x.double() twice feeding the output merges (the
        # product is returned, not the casts); nothing else repeats
        assert removed == 1
        assert _ops(merged, aten._to_copy.default) == _ops(traced, aten._to_copy.default) - 1
        _assert_bit_identical(traced, merged, ex)
        ref = m(x)
        out = capture.compile_with(m, capture.SolforgeBackend())(x)
    for a, b in zip(out, ref, strict=True):
        assert torch.equal(a, b)


def test_returned_tensors_stay_distinct() -> None:
    """Two equal results that leave the graph: the caller may write to one of them."""

    def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.float(), x.float()

    x = torch.randn(3, H, device=DEVICE, dtype=torch.bfloat16)
    b = capture.capture(two, (x,))  # type: ignore[arg-type]
    assert b.graphs[0].cse_removed == 0
    p, q = b.compiled(x)  # type: ignore[misc]
    p.add_(1)
    assert torch.equal(q, x.float())


def _graph(build: Callable[[fx.Graph, fx.Node], Any]) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    return fx.GraphModule(nn.Module(), g)


def test_hidden_views_and_input_writes_block_merging() -> None:
    """_unsafe_view's schema declares a fresh result, yet it is a view: a write through it changes
    the tensor it views. A write to a graph input changes every read after it (and inputs may alias)."""

    def hidden(g: fx.Graph, x: fx.Node) -> Any:
        c = g.call_function(aten.exp.default, (x,))
        e1 = g.call_function(aten.neg.default, (c,))
        u = g.call_function(aten._unsafe_view.default, (c, [-1]))
        g.call_function(aten.add_.Scalar, (u, 1.0))
        e2 = g.call_function(aten.neg.default, (c,))
        return (g.call_function(aten.sub.Tensor, (e1, e2)),)

    def input_write(g: fx.Graph, x: fx.Node) -> Any:
        e1 = g.call_function(aten.neg.default, (x,))
        g.call_function(aten.mul_.Scalar, (x, 3.0))
        e2 = g.call_function(aten.neg.default, (x,))
        return (g.call_function(aten.sub.Tensor, (e1, e2)),)

    def pure(g: fx.Graph, x: fx.Node) -> Any:  # the control: the same shape of graph, no write
        e1 = g.call_function(aten.neg.default, (x,))
        e2 = g.call_function(aten.neg.default, (x,))
        t1 = g.call_function(aten.add.Tensor, (e1, 1))
        t2 = g.call_function(aten.add.Tensor, (e2, 1.0))  # 1.0 is not 1: kept (promotion differs)
        t3 = g.call_function(aten.mul.Tensor, (e2, -0.0))
        t4 = g.call_function(aten.mul.Tensor, (e1, 0.0))  # -0.0 is not 0.0
        s = g.call_function(aten.split.Tensor, (x, 2))
        i1 = g.call_function(operator.getitem, (s, 0))
        i2 = g.call_function(operator.getitem, (s, 0))
        return (g.call_function(aten.sub.Tensor, (t1, t2)), t3, t4, g.call_function(aten.add.Tensor, (i1, i2)))

    x = torch.randn(3, 4, device=DEVICE)
    for build, removed in ((hidden, 0), (input_write, 0), (pure, 2)):  # pure: one neg, one getitem
        traced, merged = _graph(build), _graph(build)
        assert eliminate_common_subexpressions(merged) == removed, build.__name__
        _assert_bit_identical(traced, merged, [x])
    out = _graph(input_write)(x.clone())[0]
    torch.testing.assert_close(out, 2 * x)  # -x - (-3x): the write happened between the reads


@pytest.mark.parametrize(("cls", "family"), [(TwiceCastNorm, "rmsnorm"), (TwiceCastSwiGLU, "swiglu")])
def test_twice_cast_regions_are_optimized(cls: type[nn.Module], family: str) -> None:
    """Through solforge.optimize: the region is found once, tuned, swapped in and validated."""
    from solforge import optimize

    torch.manual_seed(0)
    m = cls().to(DEVICE, torch.bfloat16)

    def inputs(seed: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(3, 5, H, generator=g).to(DEVICE, torch.bfloat16),)

    opt, report = optimize(m, inputs(0), budget=1, max_candidates=1, make_inputs=inputs, db=False)
    assert [(r.family, r.count) for r in report.regions] == [(family, 1)]
    assert report.e2e is not None and report.e2e.passed
    x = inputs(9)
    with torch.no_grad():
        out, ref = opt(*x), copy.deepcopy(m)(*x)  # a copy of the model optimized in place is plain
    # the kernel computes in fp32 as the module does, and rounds once to bf16 where the module does
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_plan_sees_one_cast() -> None:
    """The capture itself runs the pass: the planner finds the norm with one upcast feeding both the
    square and the multiply."""
    m = TwiceCastNorm().to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 3, H, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        b = capture.capture(m, (x,))
    assert [g.cse_removed for g in b.graphs] == [1]
    (group,) = plan.plan(b.graphs)
    assert group.workload.family == "rmsnorm" and group.count == 1
    assert dict(group.workload.params)["round_before_weight"] is True
