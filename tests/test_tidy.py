"""tidy.py: unused views dropped and slices partitioning a tensor made one split, with the same
values and gradients; on Phi-3's fused q/k/v projection the backward then has no slice gradients
(zero fills and adds), one concatenation instead."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
from conftest import DEVICE
from torch.fx.experimental.proxy_tensor import make_fx

from solforge import settings
from solforge.integrate import integrate, tidy

aten = torch.ops.aten
transformers = pytest.importorskip("transformers")


def _traced(fn, *args) -> fx.GraphModule:  # noqa: ANN001
    return make_fx(fn, tracing_mode="fake")(*args)


def _slices(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target == aten.slice.Tensor]


def test_slices_covering_a_dim_become_one_split_with_the_same_values_and_gradients() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a, b, c = x[..., :5], x[..., 5:8], x[..., 8:]  # Phi-3's spelling: q, k, v of one projection
        return (a * 2).sum(-1) + (b * b).sum(-1) - c.sum(-1)

    x = torch.randn(3, 4, 12)
    gm = _traced(f, x)
    assert len(_slices(gm)) == 3
    assert tidy.split_partitions(gm) == 1
    assert not _slices(gm)
    (split,) = [n for n in gm.graph.nodes if n.target == aten.split_with_sizes.default]
    assert split.args[1:] == ([5, 3, 4], 2)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = f(xa), gm(xb)
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    assert torch.equal(xa.grad, xb.grad)


@pytest.mark.parametrize("cuts", [
    [(0, 5), (6, 12)],  # a gap: a piece of the gradient is zero, not the pieces concatenated
    [(0, 6), (5, 12)],  # an overlap
    [(0, 12)],  # one slice: nothing to gain
    [(0, 5), (5, 10)],  # does not reach the end
])
def test_slices_that_do_not_partition_are_left(cuts: list[tuple[int, int]]) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return sum(x[:, a:b].sum() for a, b in cuts)  # type: ignore[return-value]

    gm = _traced(f, torch.randn(2, 12))
    before = len(_slices(gm))
    assert tidy.split_partitions(gm) == 0 and len(_slices(gm)) == before


def test_slices_around_an_in_place_write_are_left() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        a = y[:, :4]
        y.mul_(2)
        return a.sum() + y[:, 4:].sum()

    gm = _traced(f, torch.randn(2, 12))
    assert tidy.split_partitions(gm) == 0 and len(_slices(gm)) == 2


def test_steps_other_dims_and_negative_bounds() -> None:
    def stepped(x: torch.Tensor) -> torch.Tensor:
        return x[:, 0:12:2].sum() + x[:, 1:12:2].sum()  # interleaved, not pieces

    gm = _traced(stepped, torch.randn(2, 12))
    assert tidy.split_partitions(gm) == 0

    def mixed(x: torch.Tensor) -> torch.Tensor:
        return x[:1].sum() + x[:, -4:].sum() + x[:, :-4].sum()  # dim 1 covered by [0, 8) and [8, 12)

    x = torch.randn(2, 12)
    gm = _traced(mixed, x)
    assert tidy.split_partitions(gm) == 1
    assert [n.args[1:] for n in gm.graph.nodes if n.target == aten.split_with_sizes.default] == [([8, 4], 1)]
    assert torch.equal(gm(x), mixed(x))


def test_unused_views_are_dropped_and_nothing_else() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x[:, 2:].unsqueeze(0)  # a view chain nothing reads
        y.add_(1)  # an in-place write nothing reads: kept
        torch.rand(3)  # a random draw nothing reads: kept (it advances the generator)
        return x.view(-1) * 2

    gm = _traced(f, torch.randn(2, 4), torch.randn(3))
    targets = [n.target for n in gm.graph.nodes]
    assert aten.slice.Tensor in targets and aten.unsqueeze.default in targets
    assert tidy.drop_unused_views(gm) == 2
    targets = [n.target for n in gm.graph.nodes]
    assert aten.slice.Tensor not in targets and aten.unsqueeze.default not in targets
    assert aten.add_.Tensor in targets and aten.rand.default in targets and aten.view.default in targets
    x, y = torch.randn(2, 4), torch.zeros(3)
    assert torch.equal(gm(x, y), x.view(-1) * 2) and torch.equal(y, torch.ones(3))


def _phi3(dtype: torch.dtype) -> torch.nn.Module:
    cfg = transformers.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def test_phi3_training_step_has_one_concatenation_for_the_qkv_gradient() -> None:
    """Phi-3 slices its fused q/k/v projection; with the pass its backward has no SliceBackward
    (a zero fill and a copy per piece, then adds), and every parameter's gradient is the original
    model's."""
    m = _phi3(torch.float32).train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = copy.deepcopy(m)
    ref(ids).logits.float().square().mean().backward()
    want = dict(ref.named_parameters())

    def step(enabled: bool) -> tuple[dict[str, torch.Tensor], set[str], int]:
        model = copy.deepcopy(m)
        with settings.override(tidy=enabled):  # the backend runs the passes at the first call
            opt, stats = integrate(model, {}, train=True)
            out = opt(ids).logits
        nodes: set[str] = set()
        # the autograd nodes' Python objects, held: an id is unique only while its object lives
        seen: dict[int, object] = {}
        todo = [out.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or id(fn) in seen:
                continue
            seen[id(fn)] = fn
            nodes.add(fn.name())
            todo += [f for f, _ in fn.next_functions]
        out.float().square().mean().backward()
        return dict(model.named_parameters()), nodes, stats.splits

    off, on = step(False), step(True)
    assert off[2] == 0 and on[2] == 2  # one q/k/v split per layer
    for name, p in on[0].items():
        assert p.grad is not None, f"{name}: no gradient (autograd nodes: {sorted(on[1])})"
        torch.testing.assert_close(p.grad, want[name].grad, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(p.grad, off[0][name].grad, atol=1e-6, rtol=1e-5, msg=name)
    assert "SliceBackward0" in off[1], sorted(off[1])
    assert "SliceBackward0" not in on[1] and "SplitWithSizesBackward0" in on[1], sorted(on[1])


def test_getitem_of_a_split_keeps_the_slices_meta() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :3], x[:, 3:]

    gm = _traced(f, torch.randn(2, 5))
    assert tidy.split_partitions(gm) == 1
    items = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert [tuple(n.meta["val"].shape) for n in items] == [(2, 3), (2, 2)]
