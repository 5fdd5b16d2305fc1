"""capture/dense.py: a computed value whose pointwise readers read it across its memory order (T5's
position bias, heads innermost, read along the keys by every layer's softmax) is written contiguous
by the region that computes it; values, the readers' layouts and everything else stay as they were."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from codegen_helpers import check_region, trace, values
from conftest import DEVICE

from solforge.capture import dense as D
from solforge.codegen import regions as RG

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("on_device")  # the traced aranges on the inputs' device


def _bias(table: torch.Tensor, q: int, k: int) -> torch.Tensor:
    """An embedding of (query, key) buckets, permuted to (head, query, key): heads innermost."""
    rel = torch.arange(k)[None, :] - torch.arange(q)[:, None]
    return torch.nn.functional.embedding(rel.abs().clamp(max=table.shape[0] - 1), table).permute(2, 0, 1)


def _two_layers(table: torch.Tensor, s1: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention-like layers, a matmul between them (as in a model: the bias crosses regions)."""
    b = _bias(table, s1.shape[-2], s1.shape[-1]) * 0.5  # computed by a pointwise op, heads innermost
    p1 = torch.softmax(s1 + b, -1)
    return p1, torch.softmax(torch.bmm(p1, w) + b, -1)


@pytest.fixture(autouse=True)
def _small_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass's size floor (1 MiB) scaled down with the shapes: the interpreter runs the kernels."""
    monkeypatch.setattr(D, "MIN_BYTES", 2048)


def _args(h: int = 3, q: int = 13, k: int = 21) -> list[torch.Tensor]:  # 3 x 13 x 21 fp32: 3276 bytes
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(32, h, generator=g, device="cpu"), torch.randn(h, q, k, generator=g, device="cpu"),
          torch.randn(h, k, k, generator=g, device="cpu") / 8]
    return [x.to(DEVICE) for x in xs]


def _clones(gm: Any) -> list[Any]:
    return [n for n in gm.graph.nodes if n.target is aten.clone.default]


def test_the_bias_is_written_contiguous_and_read_so_by_both_layers() -> None:
    args = _args()
    assert 3 * 13 * 21 * 4 >= D.MIN_BYTES
    gm = trace(_two_layers, *args)
    want = _two_layers(*args)
    (v,) = [n for n in gm.graph.nodes if D.candidate(n)]
    assert v.target is aten.mul.Tensor and v.meta["val"].stride()[-1] != 1  # the scaled bias, heads innermost
    assert D.contiguous_for_readers(gm) == 1
    (c,) = _clones(gm)
    assert c.args[0] is v and list(v.users) == [c] and len(c.users) == 2
    assert c.meta["val"].is_contiguous() and c.meta["val"].shape == v.meta["val"].shape
    got = gm(*args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()
    # the copy is in the region that computes the bias: its output is the contiguous value, and each
    # softmax region reads it so
    regions = RG.form_regions(gm.graph)
    env = values(gm, *args)
    (producer,) = [fr for fr in regions if c in fr.outputs]
    assert v not in producer.outputs
    (reader,) = [fr for fr in regions if c in fr.inputs]  # the second layer's softmax
    assert env[c].is_contiguous() and any(n.target is aten._softmax.default for n in reader.nodes)
    for fr in regions:
        assert check_region(fr, env, samples=2) >= 1  # the generated kernels compute the graph's values
    assert D.contiguous_for_readers(gm) == 0  # done once: the clone's readers are the softmaxes


def test_left_alone_where_a_reader_follows_its_layout_or_is_not_pointwise_or_it_is_small() -> None:
    table, s1, s2 = _args()
    # the reader's result follows the bias's layout (no contiguous operand): the layout is visible
    gm = trace(lambda t: _bias(t, 13, 21) * 0.5 + 1.0, table)
    assert D.contiguous_for_readers(gm) == 0
    # a matmul reads it (it takes either layout as it comes)
    gm = trace(lambda t, s: (_bias(t, 13, 21) * 0.5) @ s.transpose(1, 2), table, s1)
    assert D.contiguous_for_readers(gm) == 0
    # the graph returns it
    gm = trace(lambda t, s: ((b := _bias(t, 13, 21) * 0.5), s + b), table, s1)
    assert D.contiguous_for_readers(gm) == 0
    # below MIN_BYTES
    small = _args(h=2, q=11, k=13)
    gm = trace(_two_layers, *small)
    assert D.contiguous_for_readers(gm) == 0 and not _clones(gm)
