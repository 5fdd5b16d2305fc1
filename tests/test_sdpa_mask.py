"""canonical_torch.contiguous_masks: an SDPA call whose mask is strided along the keys (T5's position
bias, heads innermost) reads a contiguous copy of it, one copy per mask; the values stay eager's, and
masks already contiguous along the keys (or broadcast along them) are left alone."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from solforge.capture.canonical_torch import contiguous_masks


def _dynamo_graph(fn: Any, *args: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph dynamo gives for fn(*args), and its inputs (in the graph's order)."""
    graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (got,) = graphs
    return got


def _two_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    s = q.shape[-2]
    rel = (torch.arange(s)[None, :] - torch.arange(s)[:, None]).abs().clamp(max=table.shape[0] - 1)
    bias = F.embedding(rel, table).permute(2, 0, 1).unsqueeze(0)  # (1, H, S, S), heads innermost
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return F.scaled_dot_product_attention(a, k, v, attn_mask=bias)


def _args(h: int = 3, s: int = 11, d: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, h, s, d, generator=g) for _ in range(3)] + [torch.randn(32, h, generator=g)]


def _sdpa_masks(gm: torch.fx.GraphModule) -> list[Any]:
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    return [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) for n in calls]


def test_a_permuted_mask_is_read_contiguous_by_both_calls() -> None:
    args = _args()
    gm, inputs = _dynamo_graph(_two_calls, *args)
    masks = _sdpa_masks(gm)
    assert len(masks) == 2 and masks[0] is masks[1]
    before = masks[0].meta["example_value"]
    assert before.stride(-1) == 3  # the heads
    assert contiguous_masks(gm) == 2
    after = _sdpa_masks(gm)
    assert after[0] is after[1] and after[0] is not masks[0]  # one copy for both calls
    assert after[0].op == "call_method" and after[0].target == "contiguous"
    ev = after[0].meta["example_value"]
    assert ev.is_contiguous() and ev.shape == before.shape and ev.dtype == before.dtype
    got, want = gm(*inputs), _two_calls(*args)
    torch.testing.assert_close(got[0] if isinstance(got, tuple | list) else got, want)
    assert contiguous_masks(gm) == 0  # done once


def test_contiguous_and_broadcast_masks_are_left_alone() -> None:
    q, k, v, _ = _args()

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    for m in (torch.randn(2, 3, 11, 11),  # contiguous
              torch.randn(2, 1, 1, 11).expand(2, 3, 11, 11),  # broadcast over heads and queries
              torch.randn(2, 3, 11, 1).expand(2, 3, 11, 11)):  # broadcast along the keys: stride 0
        gm, _ = _dynamo_graph(dense, q, k, v, m)
        assert contiguous_masks(gm) == 0, m.stride()
