"""The attention pass: causal masks materialized by tracing become is_causal SDPA again (with GQA
instead of repeat_kv copies); masks that are not exactly causal are left alone."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE

from solforge import capture
from solforge.capture.checkpoint import checkpoint_op
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
        # eager's call, whichever SDPA op the lowering picked for it: is_causal on K/V of the model's
        # 2 KV heads (not repeat_kv's 4)
        calls = [(kw.get("is_causal"), heads) for kw, heads in _sdpa_args(g.aten)]
        # on a GPU in fp32 the lowering may pick the math path for grouped heads (eager's pick too):
        # no SDPA op then, and no mask either
        assert calls == [(True, 2)] * 2 or (DEVICE == "cuda" and _sdpa_calls(g.aten)[0] == 0), calls
        assert "aten.clone.default" not in ops  # repeat_kv's copies are gone
        ids = lm.make_inputs(3)
        out = capture.compile_with(lm.model, capture.SolforgeBackend())(*ids).logits
        ref = lm.model(*ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class Masked(nn.Module):
    """SDPA with a mask built from shapes: causal, or a sliding window (not causal). With `groups`,
    K/V have fewer heads and are repeated as transformers' repeat_kv does."""

    def __init__(self, window: int | None, groups: int = 1) -> None:
        super().__init__()
        self.window = window
        self.groups = groups

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.groups > 1:
            B, KV, S, D = k.shape
            k, v = (x[:, :, None, :, :].expand(B, KV, self.groups, S, D).reshape(B, KV * self.groups, S, D)
                    for x in (k, v))
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


# Graphs for many sizes (shapes.py): the mask is computed from the sizes


def _attention_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [op for op in _ops(gm) if "attention" in op]


def test_a_graph_for_many_sizes_checks_the_mask_per_call_and_its_graphs_per_size_are_causal() -> None:
    """qwen3-tiny at a second length compiles a graph for every length: its attention becomes the
    per-call check on un-repeated K/V; the graph made again for one length (its second call) gets
    the is_causal call, with no repeat_kv copies. Every call equals eager."""
    lm = load_model("qwen3-tiny", device=DEVICE, batch=1, seq=16, dtype="fp32")
    b = capture.SolforgeBackend()
    m = capture.compile_with(lm.model, b)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        for n in (16, 24, 24, 33):
            ids = torch.randint(0, lm.model.config.vocab_size, (1, n), device=DEVICE, generator=gen)
            torch.testing.assert_close(m(ids).logits, lm.model(ids).logits, rtol=1e-5, atol=1e-5)
    assert [g.attention_restored for g in b.graphs] == [2, 2]
    assert _attention_ops(b.graphs[1].aten) == ["solforge_capture.attention_if_causal.default"] * 2
    made = b.step_graphs[-1].gm  # the graph made for length 24
    assert _attention_ops(made) == ["aten.scaled_dot_product_attention.default"] * 2
    assert "aten.clone.default" not in _ops(made)


def test_the_per_call_check_takes_the_masked_call_for_a_sliding_window() -> None:
    """A window mask is causal at no length here: the check takes the masked call each time, and
    the graph made for one length has the masked call in its place (on K/V as they were)."""
    m = Masked(3)
    b = capture.SolforgeBackend()
    compiled = capture.compile_with(m, b)
    with torch.no_grad():
        for n in (8, 12, 12, 12, 5):
            q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE) for _ in range(3))
            torch.testing.assert_close(compiled(q, k, v), m(q, k, v), rtol=1e-5, atol=1e-5)
    assert [g.attention_restored for g in b.graphs] == [0, 1]
    made = b.step_graphs[-1].gm  # the graph made for length 12
    assert _attention_ops(made) == ["aten.scaled_dot_product_attention.default"]
    (call,) = [n for n in made.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert "attn_mask" in call.kwargs and not call.kwargs.get("is_causal")


def test_the_per_call_check_itself() -> None:
    """The op: causal masks (bool, additive) take is_causal with GQA; any other mask the masked call
    on K/V repeated as repeat_kv does; both equal SDPA on the repeated K/V with the mask."""
    from solforge.capture.canonical import _attention_if_causal

    q = torch.randn(1, 4, 6, 8, device=DEVICE)
    k, v = (torch.randn(1, 2, 6, 8, device=DEVICE) for _ in range(2))
    causal = torch.ones(6, 6, dtype=torch.bool, device=DEVICE).tril()
    window = causal & ~torch.ones(6, 6, dtype=torch.bool, device=DEVICE).tril(-3)
    additive = torch.zeros(6, 6, device=DEVICE).masked_fill(~causal, -65536.0)
    for mask in (causal, window, additive):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=mask[None, None])
        got = torch.ops.solforge_capture.attention_if_causal(q, k, v, mask[None, None], 2, None)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, _attention_if_causal(q, k, v, mask[None, None], 2, None))


def test_a_training_graph_for_many_sizes_keeps_its_masked_call() -> None:
    """The per-call op has no backward: with grad on, the graph for all sizes is left as traced."""
    lm = load_model("qwen3-tiny", device=DEVICE, batch=1, seq=8, dtype="fp32")
    b = capture.SolforgeBackend()
    m = capture.compile_with(lm.model, b)
    for n in (8, 12):
        ids = torch.randint(0, lm.model.config.vocab_size, (1, n), device=DEVICE)
        m(ids).logits.sum().backward()
    assert b.graphs[-1].attention_restored == 0
    assert "solforge_capture.attention_if_causal.default" not in _ops(b.graphs[-1].aten)


def test_grouped_heads_under_many_sizes_causal_and_windowed() -> None:
    """With K/V repeated for grouped heads: the graph for all sizes checks the mask on un-repeated
    K/V; the graph made for one length gets is_causal with GQA (causal) or the masked call on K/V
    repeated again (a window). Every call equals the module."""
    for window, made_kw in ((None, {"is_causal": True, "enable_gqa": True}), (3, {})):
        torch.compiler.reset()  # dynamo remembers the dims that changed per code object, not per module
        m = Masked(window, groups=2)
        b = capture.SolforgeBackend()
        compiled = capture.compile_with(m, b)
        with torch.no_grad():
            for n in (8, 12, 12, 12, 5):
                q = torch.randn(1, 4, n, 16, device=DEVICE)
                k, v = (torch.randn(1, 2, n, 16, device=DEVICE) for _ in range(2))
                torch.testing.assert_close(compiled(q, k, v), m(q, k, v), rtol=1e-5, atol=1e-5)
        assert _attention_ops(b.graphs[1].aten) == ["solforge_capture.attention_if_causal.default"]
        made = b.step_graphs[-1].gm
        (call,) = [n for n in made.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
        assert all(call.kwargs.get(key) == value for key, value in made_kw.items()), call.kwargs
        assert ("aten.repeat_interleave.self_int" in _ops(made)) == (window is not None)


class CheckpointedAttention(nn.Module):
    """Two blocks of projection + masked SDPA, each under torch.utils.checkpoint, with the mask built
    once outside them from sizes alone and passed in, as transformers does under gradient
    checkpointing; each block turns it into an additive mask first (CPU SDPA's traced form does)."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window
        self.proj = nn.ModuleList(nn.Linear(16, 48) for _ in range(2))

    def block(self, i: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj[i](x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = torch.arange(x.shape[1], device=x.device)
        mask = i[None, :] <= i[:, None]
        if self.window is not None:
            mask = mask & (i[:, None] - i[None, :] < self.window)
        for j in range(2):
            x = torch.utils.checkpoint.checkpoint(self.block, j, x, mask[None, None], use_reentrant=False)
        return x


def test_a_causal_mask_passed_into_checkpointed_blocks_is_restored_inside_them() -> None:
    """Each checkpointed body's SDPA gets is_causal back from the mask the calling graph computes
    (a sliding window stays masked), and the gradients stay eager's."""
    for window, expected in ((None, 1), (3, 0)):
        torch.manual_seed(0)
        m = CheckpointedAttention(window).to(DEVICE).train()
        x = torch.randn(2, 8, 16, device=DEVICE, requires_grad=True)
        b = capture.capture(m, (x,), grad=True)
        assert not b.errors, b.errors
        callers = [g for g in b.graphs if any(n.target is checkpoint_op
                                             for n in g.aten.graph.nodes)]
        assert len(b.graphs) == 3 and len(callers) == 1  # two bodies and the graph that calls them
        assert [g.attention_restored for g in b.graphs if g not in callers] == [expected, expected], window
        opt = capture.compile_with(m, capture.SolforgeBackend())
        out = opt(x)
        out.square().sum().backward()
        got = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        ref = m(x)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for n, p in m.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
        m.zero_grad()


def test_qwen3_with_gradient_checkpointing_gets_is_causal_in_every_layer() -> None:
    lm = load_model("qwen3-tiny", device=DEVICE, batch=1, seq=16, dtype="fp32")
    lm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.model.train()
    b = capture.capture(lm.model, lm.example_inputs, grad=True)
    assert not b.errors, b.errors
    assert sum(g.attention_restored for g in b.graphs) == 2  # one per layer, inside its checkpoint
    ops = [op for g in b.graphs for op in _ops(g.aten)]
    assert ops.count("solforge_capture.checkpoint.default") == 2


def _sdpa_calls(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """(SDPA calls with a mask, SDPA calls without one) in `gm`, whichever SDPA op the graph uses."""
    from solforge.capture.canonical import _SDPA, _kwargs

    masked = plain = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _SDPA:
            kw = _kwargs(n) or {}
            if isinstance(kw.get(_SDPA[n.target]), torch.fx.Node):
                masked += 1
            else:
                plain += 1
    return masked, plain


def _sdpa_args(gm: torch.fx.GraphModule) -> list[tuple[dict, int]]:
    """Each SDPA call of `gm` (whichever SDPA op): its arguments by name, and its key's head count."""
    from solforge.capture.canonical import _SDPA, _kwargs

    calls = [_kwargs(n) or {} for n in gm.graph.nodes if n.op == "call_function" and n.target in _SDPA]
    return [(kw, kw["key"].meta["val"].shape[1]) for kw in calls]


def _bert(layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
                     vocab_size=100, max_position_embeddings=64, attn_implementation="sdpa")
    return BertModel(cfg).to(DEVICE).eval()


def test_an_encoder_without_padding_runs_sdpa_without_a_mask_as_eager_does(monkeypatch) -> None:
    """A BERT encoder called without an attention mask: the traced graph builds an all-allowed mask
    from sizes (eager passes none). The torch-level pass drops it before the lowering picks SDPA's
    backend (on a GPU the masked call lowered to the math path, no SDPA op left: the H100 run of
    2026-11-27), so every layer's call is maskless even without the ATen-level pass, counted once
    with it, and the outputs are eager's."""
    from solforge.capture import backend
    from solforge.capture.stage import capture_notes

    m = _bert()
    ids = torch.randint(0, 100, (2, 12), device=DEVICE)
    with torch.no_grad():
        ref = m(ids).last_hidden_state
        monkeypatch.setattr(backend, "restore_causal_attention", lambda gm, known=None: 0)
        early = capture.capture(m, (ids,))
        early_out = early.compiled(ids).last_hidden_state
        monkeypatch.undo()
        torch.compiler.reset()
        b = capture.capture(m, (ids,))
        out = b.compiled(ids).last_hidden_state
    for got in (early, b):
        assert not got.errors, got.errors
        assert [_sdpa_calls(g.aten) for g in got.graphs] == [(0, 2)]
        assert [g.attention_restored for g in got.graphs] == [2]  # one per layer, not once per level
        (note,) = [n for n in capture_notes(got, None) if n.startswith("attention:")]
        assert note.startswith("attention: 2 SDPA call(s) traced with a mask computed from sizes alone"), note
    torch.testing.assert_close(early_out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_an_encoder_with_a_padding_mask_keeps_it() -> None:
    """A padding mask comes from an input: it is never dropped (nor taken for causal), and the
    padded positions are masked as eager masks them."""
    m = _bert()
    ids = torch.randint(0, 100, (2, 12), device=DEVICE)
    pad = torch.ones(2, 12, dtype=torch.long, device=DEVICE)
    pad[1, 7:] = 0
    with torch.no_grad():
        ref = m(ids, attention_mask=pad).last_hidden_state
        b = capture.capture(m, (ids, pad))
        out = b.compiled(ids, pad).last_hidden_state
    assert [_sdpa_calls(g.aten) for g in b.graphs] == [(2, 0)]
    assert sum(g.attention_restored for g in b.graphs) == 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class Unmasked(nn.Module):
    """SDPA with a mask built from sizes that allows every key: a bool mask of ones, or an additive
    mask of zeros (broadcast over batch and heads), on K/V repeated for grouped heads."""

    def __init__(self, additive: bool) -> None:
        super().__init__()
        self.additive = additive

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, KV, S, D = k.shape
        k, v = (x[:, :, None, :, :].expand(B, KV, 2, S, D).reshape(B, KV * 2, S, D) for x in (k, v))
        L = q.shape[-2]
        mask = torch.zeros(L, S, device=q.device) if self.additive else torch.ones(L, S, dtype=torch.bool,
                                                                                    device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])


def test_all_allowed_masks_are_dropped_with_grouped_heads_and_a_cross_length() -> None:
    """Bool ones and additive zeros, queries shorter than keys (no causal reading applies): the
    call is made without a mask on un-repeated K/V (enable_gqa), and equals the module."""
    for additive in (False, True):
        torch.compiler.reset()
        m = Unmasked(additive)
        q = torch.randn(1, 4, 5, 8, device=DEVICE)
        k, v = (torch.randn(1, 2, 9, 8, device=DEVICE) for _ in range(2))
        with torch.no_grad():
            b = capture.capture(m, (q, k, v))
            out = b.compiled(q, k, v)
        (g,) = b.graphs
        # on a GPU in fp32 the lowering may pick the math path for grouped heads (no SDPA op, no mask)
        sdpa = _sdpa_calls(g.aten)
        assert g.attention_restored == 1 and (sdpa == (0, 1) or (DEVICE == "cuda" and sdpa == (0, 0))), additive
        calls = [(bool(kw.get("is_causal")), heads) for kw, heads in _sdpa_args(g.aten)]
        assert calls == [(False, 2)] or (DEVICE == "cuda" and _sdpa_calls(g.aten)[0] == 0), calls  # as above
        # (the math path's lowering repeats K/V itself: its copies are not repeat_kv's)
        assert "aten.clone.default" not in _ops(g.aten) or sdpa == (0, 0)
        torch.testing.assert_close(out, m(q, k, v), rtol=1e-5, atol=1e-5)


def test_the_per_call_check_drops_a_mask_that_allows_every_key() -> None:
    """The per-call op: a bool mask of ones or an additive one of zeros takes the maskless call on
    un-repeated K/V (GQA), bit for bit that call, and equal to the masked call on repeated K/V."""
    from solforge.capture.canonical import _mask_kind

    q = torch.randn(1, 4, 3, 8, device=DEVICE)
    k, v = (torch.randn(1, 2, 7, 8, device=DEVICE) for _ in range(2))
    for mask in (torch.ones(3, 7, dtype=torch.bool, device=DEVICE), torch.zeros(3, 7, device=DEVICE)):
        assert _mask_kind(mask, 3, 7) == "none"
        got = torch.ops.solforge_capture.attention_if_causal(q, k, v, mask[None, None], 2, None)
        plain = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert torch.equal(got, plain)
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1),
                                             attn_mask=mask[None, None])
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    one_blocked = torch.ones(3, 7, dtype=torch.bool, device=DEVICE)
    one_blocked[2, 6] = False
    assert _mask_kind(one_blocked, 3, 7) == "" and _mask_kind(torch.full((3, 7), -1.0, device=DEVICE), 3, 7) == ""
    assert _mask_kind(torch.ones(4, 4, dtype=torch.bool, device=DEVICE).tril(), 4, 4) == "causal"


def test_a_causal_decoder_gets_is_causal_at_the_torch_level() -> None:
    """A tiny Llama (grouped heads) traced by dynamo: the torch-level pass turns its materialized
    causal mask into is_causal, on the un-repeated K/V (enable_gqa), in the graph dynamo gives, and
    that graph still computes eager's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from solforge.capture.canonical_torch import _TARGETS, restore_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).to(DEVICE).eval()
    ids = torch.randint(0, 64, (2, 11), device=DEVICE)
    seen: list[tuple[int, list[dict]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        before = sum(isinstance(n.kwargs.get("attn_mask"), torch.fx.Node) for n in gm.graph.nodes
                     if n.target in _TARGETS)
        assert restore_attention(gm) == 0  # what the capture calls: a causal mask is the ATen pass's
        restored = restore_attention(gm, causal=True)
        seen.append((before, restored, [dict(n.kwargs, heads=n.args[1].meta["example_value"].shape[1])
                                        for n in gm.graph.nodes if n.target in _TARGETS]))
        return gm.forward

    torch.compiler.reset()
    with torch.no_grad():
        out = torch.compile(m, backend=backend)(ids).logits
        ref = m(ids).logits
    ((before, restored, calls),) = seen
    assert before == restored == 2  # the mask as traced, in both layers
    assert [(kw.get("is_causal"), kw.get("enable_gqa"), "attn_mask" in kw, kw["heads"]) for kw in calls] == \
        [(True, True, False, 2)] * 2
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_aten_pass_alone_still_drops_the_mask(monkeypatch) -> None:
    """Without the torch-level pass (a mask that reaches the ATen graph), the ATen-level pass
    makes the encoder's calls maskless as before."""
    from solforge.capture import backend

    m = _bert()
    ids = torch.randint(0, 100, (2, 12), device=DEVICE)
    monkeypatch.setattr(backend, "restore_attention", lambda gm: 0)
    torch.compiler.reset()
    with torch.no_grad():
        b = capture.capture(m, (ids,))
        out = b.compiled(ids).last_hidden_state
        ref = m(ids).last_hidden_state
    calls = [_sdpa_calls(g.aten) for g in b.graphs]
    # on a GPU the masked call lowers to the math path, with no SDPA op for the ATen pass to find
    if DEVICE != "cuda":
        assert calls == [(0, 2)] and [g.attention_restored for g in b.graphs] == [2], calls
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class WrittenMask(nn.Module):
    """A mask built from sizes alone, then written in place (a torch-level graph is not functional):
    ones, with the last key blocked, or tril_'d into a causal mask."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        if self.causal:
            mask.tril_()
        else:
            mask[:, -1] = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_mask_written_in_place_is_read_as_written(monkeypatch) -> None:
    """Neither pass reads a mask's value from before an in-place write (neither graph is
    functional): the torch-level pass leaves such a mask alone, and with the ATen pass too the
    outputs are the module's (the ATen pass once dropped the blocked key's mask: 0.5 off)."""
    from solforge.capture import backend

    q, k, v = (torch.randn(1, 2, 6, 8, device=DEVICE) for _ in range(3))
    for causal in (False, True):
        m = WrittenMask(causal)
        ref = m(q, k, v)
        for aten_pass in (False, True):
            if not aten_pass:
                monkeypatch.setattr(backend, "restore_causal_attention", lambda gm, known=None: 0)
            torch.compiler.reset()
            with torch.no_grad():
                b = capture.capture(m, (q, k, v))
                out = b.compiled(q, k, v)
            monkeypatch.undo()
            assert not b.errors, b.errors
            if not aten_pass:
                assert [g.attention_restored for g in b.graphs] == [0], causal
                if DEVICE != "cuda":  # on a GPU the masked call may lower to no SDPA op
                    assert [_sdpa_calls(g.aten) for g in b.graphs] == [(1, 0)], causal
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"causal={causal} aten={aten_pass}")
