"""canonical.py's attention pass, one level earlier: on the torch-level graph dynamo gives, before
it is lowered to ATen.

Why both levels: the lowering traces `scaled_dot_product_attention` (CompositeImplicit) down to
the backend it picks for the traced arguments. On a GPU, with the all-allowed mask transformers
materializes under dynamo for a BERT encoder called without a padding mask, that is the math path
(fp32 bmm, softmax, masking ops): the ATen graph has no SDPA op left for canonical.py to give
eager's maskless call back (an H100, bf16 B8 S512: about 4x eager's cuDNN flash call). Here the
call is still `F.scaled_dot_product_attention`, whatever the device, so the mask is dropped (or
made is_causal) before the lowering chooses a backend, and the lowering then picks eager's.

The decision is canonical.py's (`_mask_kind`, `_causal_kwargs`): only a mask computed from
constants and static sizes alone is evaluated; padding masks (from an input) and masks whose value
depends on symbolic sizes are left to the ATen pass (which checks the latter per call)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from solforge.capture.canonical import _causal_kwargs, _mask_kind, _mutates, _written
from solforge.runtime.shapes import hint

# dynamo records the builtin (`torch._C._nn.scaled_dot_product_attention`, which F re-exports)
_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                             "enable_gqa": False}


def _sdpa_kwargs(node: fx.Node) -> dict[str, Any] | None:
    """The call's arguments by name, defaults filled in; None for a call this pass does not read."""
    if len(node.args) > len(_PARAMS) or any(k not in _PARAMS for k in node.kwargs):
        return None
    kw = dict(_DEFAULTS)
    kw.update(zip(_PARAMS, node.args, strict=False))
    kw.update(node.kwargs)
    return kw if all(p in kw for p in ("query", "key", "value")) else None


def _val(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _evaluate(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The value of `node` when it is computed from constants alone (no graph input: not even a
    size input, whose value this graph serves many of) and nothing writes into it, else None."""
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        if n.op not in ("call_function", "call_method", "get_attr"):
            return None
        stack.extend(n.all_input_nodes)
    if any(_mutates(n) for n in seen) or _written(gm.graph, seen):
        return None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    env: dict[fx.Node, Any] = {}
    try:
        with torch.no_grad():
            for n in sorted(seen, key=order.__getitem__):
                args = fx.node.map_arg(n.args, env.__getitem__)
                kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
                if n.op == "get_attr":
                    obj: Any = gm
                    for part in str(n.target).split("."):
                        obj = getattr(obj, part)
                    env[n] = obj
                elif n.op == "call_method":
                    env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
                else:
                    env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - a mask we cannot compute is left to the ATen pass
        return None
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None


_ALL = slice(None)


def _unrepeat(node: Any) -> tuple[fx.Node, int] | None:
    """x[:, :, None, :, :].expand(B, KV, n, S, D).reshape(B, KV*n, S, D) (repeat_kv, as dynamo
    records it) -> (x, n)."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    exp = node.args[0]
    if not (isinstance(exp, fx.Node) and exp.op == "call_method" and exp.target == "expand"):
        return None
    item = exp.args[0]
    if not (isinstance(item, fx.Node) and item.op == "call_function" and item.target is operator.getitem
            and item.args[1] == (_ALL, _ALL, None, _ALL, _ALL)):
        return None
    x = item.args[0]
    xv, ev, ov = _val(x), _val(exp), _val(node)
    if not all(isinstance(t, torch.Tensor) for t in (xv, ev, ov)) or xv.dim() != 4 or ev.dim() != 5:
        return None
    n = int(ev.shape[2])
    if tuple(ev.shape) != (xv.shape[0], xv.shape[1], n, xv.shape[2], xv.shape[3]) or \
            tuple(ov.shape) != (xv.shape[0], xv.shape[1] * n, xv.shape[2], xv.shape[3]):
        return None
    return x, n  # type: ignore[return-value]


def _erase_unused(graph: fx.Graph, roots: Iterable[fx.Node]) -> None:
    """Erase the nodes among `roots` and what they are computed from that nothing uses any more
    (the mask, the repeat_kv copies), and only those: a dynamo graph may hold calls kept for their
    effects, which a whole-graph dead-code pass could drop."""
    stack = list(roots)
    erased: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or _mutates(n):
            continue
        erased.add(n)
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(inputs)


def restore_attention(gm: fx.GraphModule, *, causal: bool = False) -> int:
    """canonical.py's attention pass on a torch-level (dynamo) graph; returns how many calls it
    rewrote: made without a mask that allows every key, or (with `causal`) given is_causal, on
    un-repeated K/V with enable_gqa where repeat_kv expanded them. The calls are changed in place
    (their meta kept). The capture passes causal=False: a causal mask is left to the ATen pass, as
    before this pass existed, until the torch-level rewrite of causal decoders is measured on a GPU
    (the lowering then picks SDPA's backend at trace time instead of the generic op at run time)."""
    graph = gm.graph
    kinds: dict[fx.Node, str] = {}
    changes: list[tuple[fx.Node, tuple[Any, ...], dict[str, Any]]] = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _TARGETS:
            continue
        kw = _sdpa_kwargs(node)
        if kw is None:
            continue
        mask = kw["attn_mask"]
        if not isinstance(mask, fx.Node) or kw["is_causal"] is not False or kw["dropout_p"] != 0.0 or kw["enable_gqa"]:
            continue
        q, k, v = kw["query"], kw["key"], kw["value"]
        qv, kv = _val(q), _val(k)
        if not isinstance(qv, torch.Tensor) or not isinstance(kv, torch.Tensor):
            continue
        if mask not in kinds:
            val = _evaluate(gm, mask)
            kinds[mask] = _mask_kind(val, hint(qv.shape[-2]), hint(kv.shape[-2])) if val is not None else ""
        if not kinds[mask] or (kinds[mask] == "causal" and not causal):
            continue
        rk, rv = _unrepeat(k), _unrepeat(v)
        gqa = rk is not None and rv is not None and rk[1] == rv[1] and rk[1] > 1
        if gqa:
            k, v = rk[0], rv[0]  # type: ignore[index]
        changes.append((node, (q, k, v), _causal_kwargs(kw["scale"], gqa, kinds[mask] == "causal")))
    if not changes:
        return 0
    for node, args, kwargs in changes:
        old = node.all_input_nodes
        node.args, node.kwargs = args, kwargs
        _erase_unused(graph, old)
    graph.lint()
    gm.recompile()
    return len(changes)


def contiguous_masks(gm: fx.GraphModule) -> int:
    """SDPA calls whose mask is strided along the keys (T5's position bias, an embedding of (query,
    key, head) permuted to (head, query, key): the heads innermost) get the mask made contiguous
    first, one copy per mask however many calls read it. The lowering picks SDPA's backend for the
    traced arguments: with such a mask, the math path (fp32 bmm, softmax; on an H100, bf16, B8, 12
    heads, 512 tokens: 0.696 ms a call), with a contiguous one cuDNN's fused attention (0.058 ms,
    the same error against fp32: 0.0041 against 0.0039). Eager calls it with the mask as it is, so
    eager and torch.compile run the math path. Returns how many calls now read a copy."""
    graph = gm.graph
    copies: dict[fx.Node, fx.Node] = {}
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _TARGETS:
            continue
        kw = _sdpa_kwargs(node)
        mask = kw["attn_mask"] if kw is not None else None
        val = _val(mask)
        if not isinstance(mask, fx.Node) or not isinstance(val, torch.Tensor) or val.dim() < 2:
            continue
        stride = val.stride(-1)
        if not isinstance(stride, int) or stride <= 1 or val.shape[-1] == 1:
            continue
        if mask not in copies:
            # the copy's value first (a fake tensor computes under its own mode; the tracing
            # context's may be another): a failure leaves the graph as it was
            value = val.contiguous()
            with graph.inserting_after(mask):
                c = graph.call_method("contiguous", (mask,))
            c.meta.update({k: v for k, v in mask.meta.items() if k not in ("example_value", "val")})
            c.meta["example_value"] = value
            copies[mask] = c
        node.replace_input_with(mask, copies[mask])
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done

