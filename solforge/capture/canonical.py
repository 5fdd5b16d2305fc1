"""Undo what tracing does to attention, so the captured graph runs as fast as eager.

Under dynamo, Hugging Face models materialize the causal mask (a [B, 1, S, S] tensor built from
aranges) instead of passing `is_causal=True`, and then expand K/V to all query heads with copies
(`repeat_kv`) because SDPA's GQA path is only taken without a mask. On an H100 that made the
captured Qwen3-4B forward (B2 S8192) 617 ms against eager's 413 ms (measured 2026-11-22).

This pass finds SDPA calls whose mask is a constant (computed from nothing but shapes), evaluates
it once, and where it is exactly causal replaces the call by
`scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=...)` on the un-repeated K/V:
the call eager makes. Where it allows every key (a bool mask all true, an additive mask all zero:
an encoder called without a padding mask, whose traced graph builds the mask eager never makes)
the call is made without a mask, as eager makes it: a transformers BERT-style encoder ran at 0.22x
eager on an H100 with the materialized mask (SDPA's masked kernel). Masks that are neither
(padding masks, which come from an input, and sliding windows) are left alone.

In a graph for many sizes (shapes.py) the mask is computed from the sizes, so it has no value at
compile time:
- The graph made again for one set of sizes runs this pass with those sizes bound
  (`shapes.bound`): the mask is evaluated for them, exactly as in a static graph, and that graph
  serves only calls of those sizes. A per-call check there (below) becomes the call it would take
  for them, so that graph never waits for the GPU.
- The graph for all sizes (inference only) calls `solforge_capture::attention_if_causal` (not a
  kernel family's op) on the un-repeated K/V instead. Each call checks the mask it computed: the
  is_causal call when the mask is exactly causal, the call without a mask when it allows every
  key, the masked call otherwise. Measured before this,
  on an H100 (Qwen3-0.6B, 28 layers, torch.profiler, 2026-11-25): the masked call (cuDNN with a
  bias) spent 0.8-1.1 s of a first call at some lengths (333; 128 through this graph) and ~50 ms
  at others (400, 512).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from solforge.runtime.shapes import binding, bound_value, hint

aten = torch.ops.aten

# op -> name of its mask argument; each returns a tuple whose element 0 is the attention output,
# except the high-level op, which returns the tensor itself
_NONE: Mapping[fx.Node, Any] = {}  # no graph inputs with known values

_SDPA: dict[Any, str] = {aten.scaled_dot_product_attention.default: "attn_mask"}
for _name, _mask in (("_scaled_dot_product_cudnn_attention", "attn_bias"),
                     ("_scaled_dot_product_efficient_attention", "attn_bias"),
                     ("_scaled_dot_product_flash_attention_for_cpu", "attn_mask"),
                     ("_scaled_dot_product_flash_attention", "attn_mask")):  # CUDA's flash: never a mask
    if hasattr(aten, _name):
        _SDPA[getattr(aten, _name).default] = _mask


_LIB = torch.library.Library("solforge_capture", "DEF")
_LIB.define("attention_if_causal(Tensor query, Tensor key, Tensor value, Tensor mask, int n_rep, float? scale) "
            "-> Tensor")


def _attention_if_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         n_rep: int, scale: float | None) -> torch.Tensor:
    """SDPA of a graph for many sizes whose mask is computed from sizes: eager's is_causal call when
    this call's mask is exactly causal (a check that waits for the GPU), the call without a mask
    when it allows every key, else the traced masked call on K/V repeated as repeat_kv does."""
    kind = _mask_kind(mask, query.shape[-2], key.shape[-2])
    if kind:
        return F.scaled_dot_product_attention(query, key, value, is_causal=kind == "causal", scale=scale,
                                              enable_gqa=n_rep > 1)
    if n_rep > 1:
        key, value = (x.repeat_interleave(n_rep, dim=1) for x in (key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


_LIB.impl("attention_if_causal", _attention_if_causal, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge_capture::attention_if_causal")
def _attention_if_causal_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                              n_rep: int, scale: float | None) -> torch.Tensor:
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _kwargs(node: fx.Node) -> dict[str, Any] | None:
    pair = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return dict(pair.kwargs) if pair is not None else None


def _size(n: fx.Node) -> int | None:
    """The value of a node that is a size (a SymInt: a size input, a size read from an input, an
    expression of them) for the call whose sizes are bound; None when it has none."""
    return bound_value(n.meta.get("val"))


def _constant_ancestors(node: fx.Node, known: Mapping[fx.Node, Any] = _NONE) -> list[fx.Node] | None:
    """The nodes `node` is computed from, in graph order, or None if any is a graph input not in
    `known`. A size with a value for the bound sizes (`_size`) is where the walk stops: it is
    known."""
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        if n in known or _size(n) is not None:
            continue
        if n.op not in ("call_function", "get_attr"):
            return None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _upstream(node: fx.Node, stop: Callable[[fx.Node], bool] = lambda n: False) -> Iterator[fx.Node]:
    """`node` and every node it is computed from, each once; the walk does not go past a node for
    which `stop` is true."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        if not stop(n):
            stack.extend(n.all_input_nodes)


def _from_sizes(node: fx.Node) -> bool:
    """Whether `node` is computed from sizes alone: from constants and the graph's size inputs or
    the sizes of its tensor inputs (a sym_size: not its values), never from a tensor input's values."""
    for n in _upstream(node, lambda n: n.op == "call_function" and n.target in (aten.sym_size.int,
                                                                                aten.sym_size.default)):
        if n.op == "placeholder" and not isinstance(n.meta.get("val"), torch.SymInt):
            return False
        if n.op not in ("placeholder", "call_function", "get_attr"):
            return False
    return True


_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift}


def _mutates(n: fx.Node) -> bool:
    """Whether `n` writes into its first argument: an ATen op whose schema writes (`fill_`,
    `copy_`), or at the torch level (canonical_torch.py) `x.tril_()`, `x[i] = v`, `x &= m`, `out=`.
    Neither graph is functional: the lowering records in-place ops as the model makes them."""
    if n.op not in ("call_function", "call_method"):
        return False
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._schema.is_mutable
    if n.op == "call_function" and n.target in _INPLACE_OPERATORS or "out" in n.kwargs or n.kwargs.get("inplace"):
        return True
    if n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return False  # operator.and_, or_, not_: named with a trailing _ but not in place
    name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
    return name.endswith("_") and not name.startswith("__")


def _bases(node: fx.Node) -> Iterator[fx.Node]:
    """`node` and the tensors it may be a view of: in an ATen graph through the ops whose schema
    says their output aliases their input (select, slice, view, an in-place op's result); in a
    torch-level graph, where that is not written down, through every op (any may)."""
    def inputs(n: fx.Node) -> list[fx.Node]:
        if isinstance(n.target, torch._ops.OpOverload):
            returns = n.target._schema.returns
            aliased = returns and returns[0].alias_info is not None and n.args and isinstance(n.args[0], fx.Node)
            return [n.args[0]] if aliased else []  # type: ignore[list-item]
        return n.all_input_nodes if n.op in ("call_function", "call_method") else []

    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            yield n
            stack.extend(inputs(n))


def _written(graph: fx.Graph, nodes: dict[fx.Node, None]) -> bool:
    """Whether an in-place op of `graph` writes into one of `nodes` (or a view of it): its value as
    computed from them would not be the value the call reads."""
    return any(_mutates(n) and n.args and isinstance(n.args[0], fx.Node) and any(m in nodes for m in _bases(n.args[0]))
               for n in graph.nodes)


def _evaluate(gm: fx.GraphModule, node: fx.Node, known: Mapping[fx.Node, Any] = _NONE) -> torch.Tensor | None:
    nodes = _constant_ancestors(node, known)
    if nodes is None or _written(gm.graph, dict.fromkeys(nodes)):
        return None  # an in-place write (x[:, -1] = False) would make the value computed here a wrong one
    env: dict[fx.Node, Any] = {}
    try:
        for n in nodes:
            size = _size(n)
            if n in known:
                env[n] = known[n]
            elif size is not None:
                env[n] = size
            elif n.op == "get_attr":
                obj: Any = gm
                for part in str(n.target).split("."):
                    obj = getattr(obj, part)
                env[n] = obj
            else:
                args = fx.node.map_arg(n.args, env.__getitem__)
                kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
                env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:
        return None
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None


_BLOCKED = -1e4


def _is_causal(mask: torch.Tensor, L: int, S: int) -> bool:
    """True if the mask allows exactly key j <= query i (bool mask, or additive 0 / very negative)."""
    if L != S or mask.dim() < 2 or tuple(mask.shape[-2:]) != (L, S):
        return False
    allowed = mask if mask.dtype == torch.bool else (mask == 0)
    if mask.dtype != torch.bool:
        # a bias <= -1e4 gives exactly zero weight after softmax in fp32 (exp(-1e4) underflows),
        # which is why masks use it: HF wrote -65536 on an H100 (bf16), others finfo.min or -1e9
        blocked = mask <= _BLOCKED
        if not bool((allowed | blocked).all()):  # some other bias value: not a pure mask
            return False
    causal = torch.ones(L, S, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())


def _allows_all(mask: torch.Tensor) -> bool:
    """True if the mask allows every key: a bool mask all true, or an additive mask all zero (what
    SDPA computes without a mask, whatever the mask's broadcast shape)."""
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return mask.is_floating_point() and bool((mask == 0).all())


def _mask_kind(mask: torch.Tensor, L: int, S: int) -> str:
    """"causal" (exactly causal: eager's is_causal call), "none" (allows every key: eager's call
    without a mask) or "" (a mask SDPA must apply). Causal first: a 1 x 1 mask is both, and was
    given is_causal before masks that allow every key were dropped."""
    if _is_causal(mask, L, S):
        return "causal"
    return "none" if _allows_all(mask) else ""


def _whole_slice(node: fx.Node) -> bool:
    """x[..., 0:<end or past it>:1]: a slice that keeps every element (a no-op view)."""
    if node.target != aten.slice.Tensor:
        return False
    args = (*node.args, *[None] * (5 - len(node.args)))
    start, end, step = (args[2] if args[2] is not None else node.kwargs.get("start", 0),
                        args[3] if args[3] is not None else node.kwargs.get("end"),
                        args[4] if args[4] is not None else node.kwargs.get("step", 1))
    return start in (0, None) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62))


def _unrepeat(node: fx.Node) -> tuple[fx.Node, int] | None:
    """x[:, :, None].expand(B, KV, n, S, D).reshape(B, KV*n, S, D) (repeat_kv) -> (x, n)."""
    view = node
    if view.target not in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return None
    src = view.args[0]
    if isinstance(src, fx.Node) and src.target == aten.clone.default:
        src = src.args[0]
    if not (isinstance(src, fx.Node) and src.target == aten.expand.default):
        return None
    uns = src.args[0]
    while isinstance(uns, fx.Node) and _whole_slice(uns):  # a graph for many sizes keeps x[:, :, None, :]'s
        uns = uns.args[0]
    if not (isinstance(uns, fx.Node) and uns.target == aten.unsqueeze.default and uns.args[1] == 2):
        return None
    x = uns.args[0]
    xv, ev = x.meta.get("val"), src.meta.get("val")  # type: ignore[union-attr]
    if xv is None or ev is None or xv.dim() != 4 or ev.dim() != 5:
        return None
    n = int(ev.shape[2])
    if tuple(ev.shape) != (xv.shape[0], xv.shape[1], n, xv.shape[2], xv.shape[3]):
        return None
    return x, n  # type: ignore[return-value]


_LAYOUT_OPS = {aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
               aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim}


def _views_to_reshapes(node: fx.Node) -> None:
    """The traced graph assumed the old kernel's output strides (HF's `.contiguous()` after the
    transpose vanished in tracing because the fake strides made it a no-op). The restored call may
    pick another backend with another layout, so views downstream become reshapes: free when the
    layout allows a view, a copy when it does not."""
    stack = list(node.users)
    while stack:
        u = stack.pop()
        if u.op != "call_function" or u.target not in _LAYOUT_OPS:
            continue
        if u.target in (aten.view.default, aten._unsafe_view.default):
            u.target = aten.reshape.default
        stack.extend(u.users)


def _causal_kwargs(scale: float | None, gqa: bool, causal: bool = True) -> dict[str, Any]:
    """SDPA's keyword arguments for eager's call: is_causal (or, for a mask that allows every key,
    no mask at all), with GQA on un-repeated K/V."""
    return {**({"is_causal": True} if causal else {}), "scale": scale, **({"enable_gqa": True} if gqa else {})}


def _settle(gm: fx.GraphModule, node: fx.Node) -> int:
    """A per-call check in a graph made for one set of sizes (bound): the call the check would take
    for them, so the graph never waits for the GPU (it may be replayed from a CUDA graph). Returns
    1 for the is_causal call or the call without a mask; 0 where the mask is neither, or has no
    value, and the masked call on repeated K/V takes the check's place."""
    q, k, v, mask, n_rep, scale = node.args
    val = _evaluate(gm, mask)  # type: ignore[arg-type]
    qv, kv = q.meta.get("val"), k.meta.get("val")  # type: ignore[union-attr]
    kind = _mask_kind(val, hint(qv.shape[-2]), hint(kv.shape[-2])) \
        if val is not None and qv is not None and kv is not None else ""
    node.target = aten.scaled_dot_product_attention.default
    if kind:
        node.args = (q, k, v)
        node.kwargs = _causal_kwargs(scale, n_rep > 1, kind == "causal")  # type: ignore[operator,arg-type]
        return 1
    if n_rep > 1:  # type: ignore[operator]
        with gm.graph.inserting_before(node):
            k, v = (_repeat_heads(x, n_rep) for x in (k, v))  # type: ignore[arg-type]
    node.args, node.kwargs = (q, k, v), {"attn_mask": mask, "scale": scale}
    return 0


def _repeat_heads(x: fx.Node, n_rep: int) -> fx.Node:
    """x.repeat_interleave(n_rep, dim=1) as a node (what repeat_kv computes), with its meta value."""
    out = x.graph.call_function(aten.repeat_interleave.self_int, (x, n_rep), {"dim": 1})
    val = x.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            out.meta["val"] = val.repeat_interleave(n_rep, dim=1)
        except Exception:  # noqa: BLE001 - a missing meta value only hides the node from size reads
            pass
    return out


def mask_inputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph inputs that the masks of `gm`'s SDPA calls are computed from: a checkpointed
    region's body gets the model's mask as an argument, computed outside it, and may convert it
    (a bool mask to an additive one) before its calls (see `restore_causal_attention`'s `known`)."""
    found: dict[fx.Node, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        kw = _kwargs(node)
        mask = None if kw is None else kw.get(_SDPA[node.target])
        if isinstance(mask, fx.Node):
            found.update((n, None) for n in _upstream(mask) if n.op == "placeholder")
    return list(found)


def constant_value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The value of `node` when `gm` computes it from constants and sizes alone (a causal mask),
    else None."""
    return _evaluate(gm, node)


def restore_causal_attention(gm: fx.GraphModule, known: dict[fx.Node, torch.Tensor] | None = None) -> int:
    """The pass described in the module docstring; returns how many calls it rewrote (given back
    is_causal, made without a mask that allows every key, or checked per call in a graph for many
    sizes). `known` gives the values of graph inputs that are masks computed from sizes alone by
    the graph that calls this one (a checkpointed body's, `mask_inputs`)."""
    graph = gm.graph
    grad = bool(gm.meta.get("grad_enabled", True))  # the per-call op has no backward
    causal_masks: dict[fx.Node, str] = {}  # "causal", "none" (allows every key), "per call" or "" (left alone)
    restored = 0
    settled = False
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.solforge_capture.attention_if_causal.default:
            if binding():  # a graph for many sizes, made again for bound sizes
                restored += _settle(gm, node)
                settled = True
            continue
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        kw = _kwargs(node)
        if kw is None:
            continue
        mask = kw.get(_SDPA[node.target])
        if not isinstance(mask, fx.Node) or kw.get("is_causal") or kw.get("dropout_p", 0.0):
            continue
        q, k, v = kw["query"], kw["key"], kw["value"]
        qv, kv = q.meta.get("val"), k.meta.get("val")
        if qv is None or kv is None:
            continue
        if mask not in causal_masks:
            val = _evaluate(gm, mask, known or _NONE)
            if val is not None:
                causal_masks[mask] = _mask_kind(val, hint(qv.shape[-2]), hint(kv.shape[-2]))
            else:  # no value now: checked per call where it comes from sizes alone (module doc)
                causal_masks[mask] = "per call" if not grad and _from_sizes(mask) else ""
        if not causal_masks[mask]:
            continue
        if node.target == aten.scaled_dot_product_attention.default:
            out = node
        else:
            items = [u for u in node.users if u.target is operator.getitem]
            outs = [u for u in items if u.args[1] == 0]
            if len(items) != len(node.users) or len(outs) != 1 or any(u.users for u in items if u.args[1] != 0):
                continue
            out = outs[0]
        rk, rv = _unrepeat(k), _unrepeat(v)
        gqa = rk is not None and rv is not None and rk[1] == rv[1] and rk[1] > 1
        if gqa:
            k, v = rk[0], rv[0]  # type: ignore[index]
        with graph.inserting_before(node):
            if causal_masks[mask] == "per call":
                n_rep = rk[1] if gqa else 1  # type: ignore[index]
                new = graph.call_function(torch.ops.solforge_capture.attention_if_causal.default,
                                          (q, k, v, mask, n_rep, kw.get("scale")))
            else:
                new = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v),
                                          _causal_kwargs(kw.get("scale"), gqa, causal_masks[mask] == "causal"))
        new.meta.update({key: out.meta[key] for key in ("val", "nn_module_stack", "stack_trace") if key in out.meta})
        out.replace_all_uses_with(new)
        _views_to_reshapes(new)
        if node is not out:  # the backend ops take a dropout seed, so DCE keeps them as impure
            for item in list(node.users):
                graph.erase_node(item)
            graph.erase_node(node)
        restored += 1
    if restored or settled:
        graph.eliminate_dead_code()  # the old calls, the repeat_kv copies, the mask (not checked per call)
        graph.lint()
        gm.recompile()
    return restored
