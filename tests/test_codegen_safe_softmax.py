"""Attention probabilities as one generated region: fp32 scores from a bmm, plus a broadcast bias
masked with -inf, through `_safe_softmax` (softmax, 0 on a row of -inf only: every key masked) or
its written-out form (softmax, isneginf, all, where), cast back to the model's dtype, into the next
bmm. Each region's kernels against the fp64 reference and the graph's own values, on rows of 33
with fully masked rows, fp32 and bf16; a value written in place before the region reads it (T5's
relative position buckets) keeps nothing out of it, a value written between two reads does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from codegen_helpers import check_region, ops, trace, values
from conftest import DEVICE

from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.kernels import generated as G
from solforge.plan import generated as PG

pytestmark = pytest.mark.usefixtures("on_device")

B, H, S, D = 2, 3, 33, 8


def _r(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(DEVICE, dtype)


def _keep() -> torch.Tensor:
    """A key mask with some keys masked per row and two query rows with every key masked."""
    keep = (torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(5), device="cpu") > 0.3).to(DEVICE)
    keep[0, 0, 5, :] = False
    keep[1, 0, S - 1, :] = False
    return keep


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
               keep: torch.Tensor) -> torch.Tensor:
    """SDPA's math path as a GPU lowers it for a model with a float mask (T5): fp32 scores."""
    scores = q.float() @ k.float().transpose(-2, -1)
    p = torch.ops.aten._safe_softmax(scores + torch.where(keep, bias, float("-inf")), -1)
    return (p @ v.float()).to(q.dtype)


def _formed(fn: Any, *xs: torch.Tensor) -> tuple[dict[Any, Any], list[RG.Formed]]:
    """The graph's values and its regions, each region's kernels checked (codegen_helpers)."""
    gm = trace(fn, *xs)
    env = values(gm, *xs)
    regions = RG.form_regions(gm.graph)
    for fr in regions:
        check_region(fr, env)
    return env, regions


def _probabilities(regions: list[RG.Formed]) -> RG.Formed:
    (r,) = [r for r in regions if "_safe_softmax" in ops(r) or "_softmax" in ops(r)]
    return r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_bias_mask_safe_softmax_is_one_region(dtype: torch.dtype) -> None:
    xs = (_r(B, H, S, D, seed=1, dtype=dtype), _r(B, H, S, D, seed=2, dtype=dtype), _r(B, H, S, D, seed=3, dtype=dtype),
          _r(1, H, S, S, seed=4, dtype=dtype), _keep())
    env, regions = _formed(_attention, *xs)
    r = _probabilities(regions)
    # the bias's mask, the add to the bmm's scores, the softmax with its all-masked rows, and the
    # views into the next bmm: one loop over the rows of the last dim
    assert {"where", "add", "_safe_softmax"} <= set(ops(r)), ops(r)
    assert r.record.space.shape == (B, H, S, S) and r.record.space.reduced == (3,)
    assert len(r.inputs) == 3 and len(r.outputs) == 1  # scores, bias, mask -> probabilities
    # the kernel's rows of -inf are zeros, like eager's
    (got,) = RT.run(r.lowered, None, [env[a] for a in r.inputs])
    want = env[r.outputs[0]]
    assert torch.equal(got.view(B, H, S, S)[0, :, 5], torch.zeros(H, S)) and torch.equal(
        got.view(B, H, S, S)[1, :, S - 1], torch.zeros(H, S))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safe_softmax_written_out_is_one_region(dtype: torch.dtype) -> None:
    """transformers' own spelling of it (isneginf, all over bool, where with a bool condition)."""
    def f(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        s = x.float() + bias
        p = torch.softmax(s, -1)
        return torch.where(torch.isneginf(s).all(-1, keepdim=True), 0.0, p).to(x.dtype)

    x = _r(B, H, S, S, seed=6, dtype=dtype)
    bias = torch.where(_keep(), 0.0, float("-inf"))
    env, (r,) = _formed(f, x, bias)
    assert {"add", "_softmax", "isneginf", "all", "where"} <= set(ops(r)), ops(r)
    assert r.record.space.reduced == (3,) and r.record.space.stages == 2
    (got,) = RT.run(r.lowered, None, [env[a] for a in r.inputs])
    assert not got.isnan().any() and torch.equal(got[0, :, 5], torch.zeros(H, S, dtype=dtype))


def test_isinf_ops_lower() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.isinf(x).float() + torch.isposinf(x).float() * 2 + torch.isneginf(x).float() * 4) * x.abs()

    x = _r(5, 17)
    x[1, 3], x[2, 4], x[4, 16] = float("inf"), float("-inf"), float("nan")
    _, (r,) = _formed(f, x)
    assert {"isinf", "isposinf", "isneginf"} <= set(ops(r))


def _buckets_then_bias(x: torch.Tensor, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """T5's shape of it: a mask from arange before an in-place add into the bucket indices, the
    lookup of those after it, then the bias added to the scores and the softmax."""
    keep = (torch.arange(x.shape[-1]) - 4).abs() > 1  # computed before the write, from nothing
    j = idx * 2
    j += 1
    bias = torch.nn.functional.embedding(j, table).view(-1)
    return torch.softmax(x + torch.where(keep, bias, float("-inf")), -1)


def test_a_write_before_every_read_keeps_the_region() -> None:
    idx = torch.randint(0, 8, (33,), generator=torch.Generator().manual_seed(9), device="cpu").to(DEVICE)
    xs = (_r(31, 33, seed=8), idx, _r(17, 1, seed=10))
    gm = trace(_buckets_then_bias, *xs)
    assert any(n.target is torch.ops.aten.add_.Tensor for n in gm.graph.nodes)
    matches = [m for m in PG.match(gm.graph) if any("softmax" in str(n.target) for n in m.nodes)]
    (m,) = matches
    names = {str(n.target) for n in m.nodes}
    assert {"aten.arange.default", "aten.embedding.default", "aten.where.self", "aten._softmax.default"} <= names \
        or {"aten.arange.start", "aten.embedding.default", "aten._softmax.default"} <= names, names
    env = values(gm, *xs)
    (got,) = G.generated(*[env[a] for a in m.inputs], key=m.workload.param("key"))
    torch.testing.assert_close(got, env[m.outputs[0]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, _buckets_then_bias(*xs), rtol=1e-5, atol=1e-6)


def test_a_write_between_two_reads_cuts_the_region() -> None:
    """x read before its in-place update and after it: one op called once would read one of them."""
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = x * 2
        x.add_(y)
        return (a + x.exp()).sum(-1)

    xs = (_r(5, 33, seed=11), _r(5, 33, seed=12))
    gm = trace(f, *[t.clone() for t in xs])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    exp = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.exp.default)
    (fr,) = [fr for fr in RG.form_regions(gm.graph) if mul in fr.nodes]
    assert exp in fr.nodes  # formation alone would take both
    assert PG.stale_reads(gm.graph, fr.nodes, fr.outputs, order)
    assert not any(mul in m.nodes for m in PG.match(gm.graph))
    # the graph's own value, for the record: the read after the write sees x + y
    x, y = (t.clone() for t in xs)
    torch.testing.assert_close(gm(x.clone(), y), (xs[0] * 2 + (xs[0] + xs[1]).exp()).sum(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_encoder_attention_probabilities_are_one_generated_region(dtype: torch.dtype) -> None:
    """A tiny transformers T5 encoder captured as solforge captures it, SDPA on its math path (as a
    GPU lowers it with T5's float position-bias mask): each layer's scores + bias -> _safe_softmax
    -> probabilities is one generated region (the first layer's with the bias lookup and the
    padding mask), each verified against its fp64 reference by the tuner's verifier."""
    transformers = pytest.importorskip("transformers")
    import functools

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from solforge import capture
    from solforge.plan import find_matches
    from solforge.tune.verify import verify

    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=2,
                                relative_attention_num_buckets=32, dropout_rate=0.0, feed_forward_proj="relu",
                                is_encoder_decoder=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.T5EncoderModel._from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 64, (2, S), generator=torch.Generator().manual_seed(1), device="cpu").to(DEVICE)
    torch.compiler.reset()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        (g,) = capture.capture(model, (ids,)).graphs
    softmaxes = [n for n in g.aten.graph.nodes if n.target is torch.ops.aten._safe_softmax.default]
    assert len(softmaxes) == 2
    matches = [m for m in find_matches(g.aten.graph) if any(n in m.nodes for n in softmaxes)]
    assert len(matches) == 2
    for m in matches:
        (sm,) = [n for n in softmaxes if n in m.nodes]
        (scores,) = sm.all_input_nodes
        assert scores in m.nodes and scores.target is torch.ops.aten.add.Tensor
        assert any(a.target is torch.ops.aten.bmm.default for a in m.inputs)
        assert any(u.target is torch.ops.aten.bmm.default for o in m.outputs for u in o.users) or any(
            u.target is torch.ops.aten.bmm.default for n in m.nodes for u in n.users if u not in m.nodes)
        wl = m.workload
        v = verify(G, wl, functools.partial(G.generated, config=G.heuristic(wl)), device=DEVICE)
        assert v.passed, v.reason
    assert any(n.target is torch.ops.aten.embedding.default for n in matches[0].nodes)  # the bias's lookup


def test_safe_softmax_of_long_rows_online() -> None:
    """Rows longer than one chunk: each chunked schedule that computes the sum in the max's pass
    (online 1 and 2, looped and split) gives softmax's values, zeros on a row of -inf, NaN on a
    row holding a NaN, as ATen's _safe_softmax."""
    from solforge.codegen import reference as REF
    from solforge.codegen import schedule as SC
    from solforge.numerics import compare

    x = _r(5, 2051, seed=13)
    x[1] = float("-inf")
    x[3, ::2] = float("-inf")
    x[4, 7] = float("nan")
    _, (r,) = _formed(lambda t: torch.ops.aten._safe_softmax(t, -1), x)
    (ref,) = REF.reference(r.lowered.ir, [x])
    want = torch.ops.aten._safe_softmax(x, -1)
    picked: dict[tuple[str, str], SC.Schedule] = {}
    for c in SC.space(r.lowered):
        parts = dict(p.split("=") for p in c.encode().split(":")[1:])
        if parts.get("o") in ("1", "2"):
            key = (c.encode().split(":")[0], parts["o"])
            if key not in picked or int(parts.get("b", 0)) > int(dict(
                    p.split("=") for p in picked[key].encode().split(":")[1:]).get("b", 0)):
                picked[key] = c
    assert {v for v, _ in picked} >= {"looped"} and {o for _, o in picked} == {"1", "2"}, picked
    for c in picked.values():
        (got,) = RT.run(r.lowered, c, [x])
        assert compare(got, ref).ok, c.encode()
        assert torch.equal(got[1], torch.zeros_like(got[1])) and got[4].isnan().all(), c.encode()
        torch.testing.assert_close(got[[0, 2, 3]], want[[0, 2, 3]], rtol=1e-5, atol=1e-6)
