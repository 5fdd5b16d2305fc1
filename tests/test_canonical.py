"""The attention pass: causal masks materialized by tracing become is_causal SDPA again (with GQA
instead of repeat_kv copies); masks that are not exactly causal are left alone."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE

from solforge import capture
from solforge.zoo import load_model


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [capture.op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_qwen3_attention_is_restored_and_equal() -> None:
    lm = load_model("qwen3-tiny", device=DEVICE, batch=2, seq=16, dtype="fp32")
    with torch.no_grad():
        b = capture.capture(lm.model, lm.example_inputs)
        (g,) = b.graphs
        assert g.attention_restored == 2  # one per layer
        ops = _ops(g.aten)
        assert ops.count("aten.scaled_dot_product_attention.default") == 2
        assert "aten.clone.default" not in ops  # repeat_kv's copies are gone
        ids = lm.make_inputs(3)
        out = capture.compile_with(lm.model, capture.SolforgeBackend())(*ids).logits
        ref = lm.model(*ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class Masked(nn.Module):
    """SDPA with a mask built from shapes: causal, or a sliding window (not causal)."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        S = q.shape[-2]
        i = torch.arange(S, device=q.device)
        mask = i[None, :] <= i[:, None]
        if self.window is not None:
            mask = mask & (i[:, None] - i[None, :] < self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])


def test_only_exactly_causal_masks_are_restored() -> None:
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    for window, expected in ((None, 1), (3, 0)):
        m = Masked(window)
        with torch.no_grad():
            b = capture.capture(m, (q, k, v))
            assert b.graphs[0].attention_restored == expected
            out = capture.compile_with(m, capture.SolforgeBackend())(q, k, v)
        torch.testing.assert_close(out, m(q, k, v), rtol=1e-5, atol=1e-5)


def test_mask_from_an_input_is_left_alone() -> None:
    """A padding mask comes from the inputs: it cannot be proven causal at compile time."""
    lm = load_model("qwen3-tiny", device=DEVICE, batch=2, seq=8, dtype="fp32")
    ids = lm.example_inputs[0]
    att = torch.ones_like(ids)
    att[0, :3] = 0
    with torch.no_grad():
        b = capture.capture(lm.model, (ids, att))
        assert all(g.attention_restored == 0 for g in b.graphs)
        out = capture.compile_with(lm.model, capture.SolforgeBackend())(ids, att).logits
        ref = lm.model(ids, att).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_additive_masks() -> None:
    from solforge.capture.canonical import _is_causal

    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    for blocked in (-65536.0, torch.finfo(torch.bfloat16).min, float("-inf"), -1e9):
        bias = torch.zeros(5, 5).masked_fill(~causal, blocked)[None, None]
        assert _is_causal(bias, 5, 5)
    soft = torch.zeros(5, 5).masked_fill(~causal, -5.0)  # a real bias, not a mask
    assert not _is_causal(soft, 5, 5)
    assert not _is_causal(causal.T.contiguous(), 5, 5)
    assert not _is_causal(causal, 5, 6)
