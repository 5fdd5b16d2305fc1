"""Indexing loads in generated regions: aten.index.Tensor (one or more index tensors, adjacent or
None-separated dims), gather (dims 0 and -1 of a 3-D tensor), index_select and embedding (its
padding_idx changes only the backward), an index from a region input or computed in the region
(arange, clamp, where on integers) or by a reduction of the region (a gather at the argmax), a bf16
table. Each region's gathered values are eager's exactly (a gather
moves elements, no arithmetic), the arithmetic after them is checked against the fp64 reference
(and the reference against the graph's own values), on odd shapes, a non-contiguous source, an
index that is a transposed view, repeated and negative indices, int32 and int64 indices, and one
schedule of each kind (rows, looped, tiles, split). An index
out of range (torch raises) gives NaN for a float source, never a read outside it; a gather from a
value of a reduction is cut out of its region; the backward (a scatter-add) is eager's vjp, with
the reason recorded; optimize swaps in one generated kernel for an embedding lookup + softmax."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import schedules, trace, values

from solforge.capture import op_name
from solforge.codegen import backward as BW
from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.kernels import generated as G
from solforge.numerics import compare, tolerance

pytestmark = pytest.mark.usefixtures("on_device")

_GATHERS = {"aten.index.Tensor", "aten.gather.default", "aten.index_select.default", "aten.embedding.default"}


@pytest.fixture(autouse=True)
def _private_codegen_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SOLFORGE_CODEGEN_DIR", str(tmp_path / "codegen"))


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(*shape)


def _ids(lo: int, hi: int, *shape: int, seed: int = 0, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Indices in [lo, hi), with the first two equal (a repeated index in every case)."""
    torch.manual_seed(seed)
    t = torch.randint(lo, hi, shape)
    t.view(-1)[1] = t.view(-1)[0]
    return t.to(dtype)


def _is_gather(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and op_name(n.target) in _GATHERS


def _check(fr: RG.Formed, env: dict[torch.fx.Node, Any]) -> None:
    """The region's kernels under the heuristic and sampled schedules: a gathered value it stores
    equal to eager's exactly, any other output within tolerance of the fp64 reference (which is
    itself checked against the graph's values)."""
    ins = [env[a] for a in fr.inputs]
    ref = REF.reference(fr.lowered.ir, ins)
    for o, r in zip(fr.outputs, ref, strict=True):
        if r.is_floating_point():
            c = compare(env[o], r, tolerance(torch.float32))
            assert c.ok, f"reference vs graph, {o.name}: {c.reason}"
        else:
            assert torch.equal(env[o], r), o.name
    for s in schedules(fr.lowered):
        got = RT.run(fr.lowered, s, ins)
        for k, (o, g, r) in enumerate(zip(fr.outputs, got, ref, strict=True)):
            if _is_gather(o) or not r.is_floating_point():
                assert torch.equal(g, env[o]), f"schedule {s.encode()}, output {k} ({o.name}): not eager's exactly"
            else:
                c = compare(g, r)
                assert c.ok, f"schedule {s.encode()}, output {k}: {c.reason}"


def _fused(fn: Callable[..., Any], *xs: torch.Tensor) -> RG.Formed:
    """fn's graph as one region holding every indexing op (and every op that moves data), checked."""
    gm = trace(fn, *xs)
    regions = RG.form_regions(gm.graph)
    assert len(regions) == 1, RG.describe(regions)
    (fr,) = regions
    gathers = [n for n in gm.graph.nodes if _is_gather(n)]
    assert gathers and set(gathers) <= set(fr.nodes), RG.describe(regions)
    _check(fr, values(gm, *xs))
    return fr


def _one_index(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g = x[i]
    return g, (g * 2.0).exp().sum(-1)


def _adjacent(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g = x[:, i, j]  # (3, 2, 3, 4): the broadcast index shape in place of dims 1-2
    return g, torch.sigmoid(g) + 1.0


def _separated(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g = x[:, i, :, j]  # (2, 3, 3, 5): dims 1 and 3 apart, the index shape first
    return g, g.sum(-1)


CASES: dict[str, tuple[Callable[..., Any], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "one_index_repeated_negative": (_one_index, lambda: (_randn(7, 5), _ids(-7, 7, 4))),
    "adjacent_two_indices": (_adjacent, lambda: (_randn(3, 6, 5, 4), _ids(-6, 6, 2, 3), _ids(-5, 5, 3, seed=1))),
    "none_separated": (_separated, lambda: (_randn(3, 6, 5, 4), _ids(-6, 6, 2, 3), _ids(-4, 4, 3, seed=1))),
    # a transposed source (strides (1, 7)) and a transposed int32 index tensor
    "strided_source_transposed_int32_index": (
        _one_index, lambda: (_randn(5, 7).t(), _ids(-7, 7, 3, 4, dtype=torch.int32).t())),
}


@pytest.mark.parametrize("case", list(CASES))
def test_advanced_indexing(case: str) -> None:
    fn, make = CASES[case]
    xs = make()
    if case.startswith("strided"):
        assert not xs[0].is_contiguous() and not xs[1].is_contiguous()
    fr = _fused(fn, *xs)
    if case.startswith("strided"):
        assert fr.lowered.ir.inputs[0].stride == (1, 7), fr.lowered.ir.inputs


@pytest.mark.parametrize("dim", [0, -1])
def test_gather_along_a_dim_of_a_3d_tensor(dim: int) -> None:
    """torch.gather along dim 0 and dim -1, the index smaller than the source in the other dims
    and longer in the gathered one; a softmax over the gathered values in the same region."""
    def f(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = torch.gather(x, dim, i)
        return g, torch.softmax(g * 0.5, -1)

    x = _randn(5, 6, 7)
    i = _ids(0, 5, 4, 6, 3) if dim == 0 else _ids(0, 7, 5, 4, 9)
    _fused(f, x, i)


@pytest.mark.parametrize("dim", [0, 1])
def test_index_select(dim: int) -> None:
    def f(x: torch.Tensor, i: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = torch.index_select(x, dim, i)
        return g, g * w.unsqueeze(1 - dim) + 1.0

    x = _randn(6, 9)
    i = _ids(0, x.shape[dim], 5, dtype=torch.int32)
    _fused(f, x, i, _randn(5, seed=2))


def test_embedding_with_padding_idx() -> None:
    """F.embedding with padding_idx: the forward is weight[ids] (padding_idx only keeps the padding
    row's gradient zero), the padding id included."""
    def f(w: torch.Tensor, ids: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        e = F.embedding(ids, w, padding_idx=0)
        return e, (e * s).sum(-1)

    w, ids = _randn(11, 7), _ids(0, 11, 3, 5)
    ids[0, 2] = 0
    gm = trace(f, w, ids, _randn(7, seed=1))
    assert any(op_name(n.target) == "aten.embedding.default" for n in gm.graph.nodes if n.op == "call_function")
    _fused(f, w, ids, _randn(7, seed=1))
    assert torch.equal(f(w, ids, _randn(7, seed=1))[0], w[ids])


def test_index_computed_in_the_region() -> None:
    """Position ids from arange, clamped, and ids with negatives mapped by a where: every op in the
    one region (no index tensor from outside)."""
    def f(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).clamp(max=table.shape[0] - 1)
        tok = torch.where(ids < 0, 0, ids)
        return x + table[pos] * 2.0 + table[tok]

    _fused(f, _randn(2, 9, 6), _randn(7, 6, seed=1), _ids(-3, 7, 2, 9, seed=2))


def test_gather_at_the_argmax_in_the_region() -> None:
    """An index computed by a reduction of the same region (a routing pick: the value of w at each
    row's argmax of x): the gather is a per-row value of the region's loop."""
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.gather(w, 1, torch.argmax(x, 1, keepdim=True)) * 2.0

    fr = _fused(f, _randn(6, 37), _randn(6, 37, seed=1))
    assert fr.lowered.reduces


def test_every_schedule_kind() -> None:
    """A gather feeding a softmax under one schedule of each kind of its space (rows, looped,
    tiles, split): the gathered values exact, the softmax within tolerance of the reference."""
    def f(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.gather(x, 1, i)
        return y, torch.softmax(y, -1)

    x, i = _randn(5, 300), _ids(0, 300, 5, 290)
    gm = trace(f, x, i)
    (fr,) = RG.form_regions(gm.graph)
    env = values(gm, x, i)
    space = SC.space(fr.lowered)
    picked = {}
    for sch in space:
        picked.setdefault((sch.variant, sch.splits > 1), sch)
    assert {v for v, _ in picked} >= {"rows", "looped", "tiles", "split"}, picked
    ref = REF.reference(fr.lowered.ir, [x, i])
    for sch in picked.values():
        y, p = RT.run(fr.lowered, sch, [x, i])
        assert torch.equal(y, env[fr.outputs[0]]), sch.encode()
        c = compare(p, ref[1])
        assert c.ok, f"{sch.encode()}: {c.reason}"


def test_int64_index_math(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel built for int64 index math (a source past 2^31 elements' extent: forced here on a
    small one) takes the gathered index in int64 too; the values are eager's exactly."""
    from solforge.codegen import triton_gen as TG

    monkeypatch.setattr(TG, "needs_index64", lambda region: True)
    monkeypatch.setattr(RT, "_KERNELS", {})
    x, i = _randn(11, 6), _ids(-11, 11, 5, 3, dtype=torch.int32)
    (fr,) = RG.form_regions(trace(lambda x, i: x[i] * 3.0, x, i).graph)
    src = TG.generate(fr.lowered, SC.heuristic(fr.lowered))
    assert ".to(tl.int64)" in src and "tl.program_id(0).to(tl.int64)" in src, src
    (got,) = RT.run(fr.lowered, SC.heuristic(fr.lowered), [x, i])
    assert torch.equal(got, x[i] * 3.0)


def test_bf16_table_lookup_is_exact() -> None:
    """A bf16 table: the looked-up rows stored bf16, bit for bit eager's; the fp32 sum after them
    against the reference."""
    def f(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        e = F.embedding(ids, w)
        return e, e.float().sum(-1)

    _fused(f, _randn(13, 10).bfloat16(), _ids(0, 13, 3, 7))


def test_out_of_range_index_gives_nan_not_a_stray_read() -> None:
    """torch raises on an index out of range; the kernel cannot: it reads a clamped address and
    gives NaN for that element. Advanced indexing wraps -7..-1 into a dim of 7 (-8 is out of
    range); gather's negative index is out of range, as in torch."""
    x = _randn(7, 5)

    def take(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return x[i] * 1.5

    def pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.gather(x, 0, i) * 1.5

    i = torch.tensor([0, 9, -7, -8, 3])
    (fr,) = RG.form_regions(trace(take, x, i.clamp(0, 6)).graph)
    (got,) = RT.run(fr.lowered, SC.heuristic(fr.lowered), [x, i])
    assert got.isnan().all(-1).tolist() == [False, True, False, True, False], got
    assert not got[[0, 2, 4]].isnan().any() and torch.equal(got[[0, 2, 4]], take(x, i[[0, 2, 4]]))
    j = torch.tensor([[0, 6, -1, 2, 7]])
    (fr,) = RG.form_regions(trace(pick, x, j.clamp(0, 6)).graph)
    (got,) = RT.run(fr.lowered, SC.heuristic(fr.lowered), [x, j])
    assert got.isnan()[0].tolist() == [False, False, True, False, True], got
    ok = [0, 1, 3]
    assert torch.equal(got[:, ok], pick(x, j.clamp(0, 6))[:, ok])


def test_gather_from_a_reduction_is_cut() -> None:
    """softmax(x)[i] reads the softmax's row at data-dependent points: the gather is not in the
    softmax's region (its source is a stored value there)."""
    def f(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, -1)[i] * 2.0

    x, i = _randn(6, 9), _ids(0, 6, 4)
    gm = trace(f, x, i)
    regions = RG.form_regions(gm.graph)
    env = values(gm, x, i)
    soft = [r for r in regions if any("softmax" in op_name(n.target) for n in r.nodes)]
    assert soft and not any(_is_gather(n) for r in soft for n in r.nodes), RG.describe(regions)
    for r in regions:
        _check(r, env)


def test_tuner_draws_indices_in_range() -> None:
    """The generated family's trial inputs: an index input drawn over its source dim's whole range
    (advanced indexing: negatives too), not the {0, 1} of other integer inputs."""
    def f(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return (x[i.t()] + torch.gather(x, 1, j)).sum(-1)

    x, i, j = _randn(40, 30), _ids(-40, 40, 9, 7), _ids(0, 30, 9, 30, seed=1)
    (fr,) = RG.form_regions(trace(f, x, i, j).graph)
    ir = fr.lowered.ir
    spans = G.index_inputs(ir)
    order = [m.shape for m in ir.inputs]
    assert spans == {order.index((9, 7)): (-40, 40), order.index((9, 30)): (0, 30)}, (spans, order)
    xs, kw = G.make_inputs(G.workload_for(ir), seed=1)
    k = order.index((9, 7))
    assert xs[k].min() < -20 and xs[k].max() > 20
    (got,) = G.generated(*xs, **kw)
    (ref,) = G.generated_ref(*xs, **kw)
    c = compare(got, ref)
    assert c.ok, c.reason


def test_training_gradients_through_the_eager_vjp() -> None:
    """A gather's vjp scatter-adds into its source (no lowering): the op's backward is the eager vjp,
    the plan saying why; every gradient, the gathered source's included, is fp64 autograd's. With
    only the scale needing a gradient the vjp gathers but does not scatter: one generated kernel."""
    def f(table: torch.Tensor, ids: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.sin(table[ids] * s).sum(-1)

    xs = (_randn(9, 13), _ids(-9, 9, 4, 5), _randn(13, seed=1))
    gm = trace(f, *xs)
    (fr,) = RG.form_regions(gm.graph)
    env = values(gm, *xs)
    ins = [env[a] for a in fr.inputs]
    ir = fr.lowered.ir
    key = G.workload_for(ir).param("key")
    need = tuple(t.is_floating_point() for t in ins)
    p = BW.plan(key, need, (True,))
    assert not p.ok and "scatter" in (p.error or ""), p.error
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in ins]
    (out,) = G.generated_op(leaves, key, "")
    dy = _randn(*out.shape, seed=3)
    out.backward(dy)
    want = BW.fp64_vjp(ir, need, (True,), ins, [dy])
    assert sum(w is not None for w in want) == 2
    for k, (x, w) in enumerate(zip(leaves, want, strict=True)):
        if w is not None:
            assert x.grad is not None
            c = compare(x.grad, w)
            assert c.ok, f"grad {k}: {c.reason}"
    only_s = tuple(tuple(t.shape) == (13,) for t in ins)
    q = BW.plan(key, only_s, (True,))
    assert q.ok and len(q.kernels) == 1, q.error


class _Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(50, 24))
        self.scale = torch.nn.Parameter(1.0 + 0.1 * torch.randn(24))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(24))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.table[ids] * self.scale + self.bias).softmax(-1)


def test_optimize_swaps_in_the_lookup_region(monkeypatch: pytest.MonkeyPatch) -> None:
    """optimize (inference): the lookup, scale, bias and softmax are one generated region, tuned and
    verified, whose kernel runs in the model; the outputs are eager's."""
    from solforge import optimize, step_graphs

    net = _Lookup()

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        return (_ids(-50, 50, 5, 9, seed=seed),)

    opt, report = optimize(net, make(3), mode="inference", budget=1, max_candidates=1, db=False, profile="off",
                           families=("generated",), keep_slower=True, make_inputs=make)
    assert report.e2e is not None and report.e2e.passed, (report.e2e, report.notes)
    stats = opt.solforge_stats  # type: ignore[attr-defined]
    swapped = {k: n for k, n in {**stats.replaced, **stats.untuned, **stats.stored}.items()
               if k.startswith("generated[")}
    assert sum(swapped.values()) == 1, (stats, report.notes)
    (region,) = [r for r in report.regions if r.family == "generated"]  # type: ignore[attr-defined]
    assert region.verified and region.integrated, region
    ran: list[Any] = []
    real = RT.run
    monkeypatch.setattr(RT, "run", lambda low, *a, **k: ran.append(low) or real(low, *a, **k))
    (fresh,) = make(7)
    with step_graphs(False), torch.no_grad():  # run as it is: a replayed CUDA graph calls no launcher
        got = opt(fresh)
    assert len(ran) == 1 and any(op.target == "aten.index.Tensor" for op in ran[0].ir.ops), ran
    with torch.no_grad():
        c = compare(got, net(fresh))
    assert c.ok, c.reason


class _EmbeddingSoftmax(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 24)
        self.scale = torch.nn.Parameter(1.0 + 0.1 * torch.randn(24))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.emb(ids) * self.scale).softmax(-1)


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_optimize_leaves_a_trainable_embedding_to_embeddings_py(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference: the embedding lookup is inside the generated region. Train: a trainable
    embedding stays integrate/embeddings.py's (its backward adds the rows into .grad in place; a
    generated region's backward would be the eager vjp's dense table gradient); the scale and
    softmax still form a generated region. Outputs and gradients are eager's."""
    from solforge import optimize, step_graphs

    net = _EmbeddingSoftmax()

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        return (_ids(0, 50, 5, 9, seed=seed),)

    opt, report = optimize(net, make(3), mode=mode, budget=1, max_candidates=1, db=False, profile="off",
                           families=("generated",), keep_slower=True, make_inputs=make)
    assert report.e2e is not None and report.e2e.passed, (report.e2e, report.notes)
    assert (mode == "train") == any("embeddings.py" in n for n in report.notes), report.notes
    ran: list[Any] = []
    real = RT.run
    monkeypatch.setattr(RT, "run", lambda low, *a, **k: ran.append(low) or real(low, *a, **k))
    (fresh,) = make(7)
    dy = _randn(5, 9, 24, seed=8)
    with step_graphs(False), torch.set_grad_enabled(mode == "train"):
        got = opt(fresh)
        if mode == "train":
            got.backward(dy)
    assert ran, "no generated kernel ran"
    targets = {op.target for op in ran[0].ir.ops}
    assert "aten._softmax.default" in targets, targets
    assert ("aten.embedding.default" in targets) == (mode == "inference"), targets
    grads = [p.grad.clone() for p in net.parameters()] if mode == "train" else []
    net.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(mode == "train"):
        want = net(fresh)
        if mode == "train":
            want.backward(dy)
    c = compare(got.detach(), want.detach())
    assert c.ok, c.reason
    for g, p in zip(grads, net.parameters() if grads else (), strict=True):
        c = compare(g, p.grad)
        assert c.ok, c.reason
