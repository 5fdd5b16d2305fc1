"""In-place pointwise ops made functional where nothing can tell the difference.

The ATen lowering (lower.py: make_fx, no functionalization) keeps a model's in-place ops:
`nn.ReLU(inplace=True)` becomes `aten.relu_`, a ResNet's `out += identity` becomes `aten.add_`.
Region formation treats every op that writes memory as an anchor (codegen/regions.py), so these
ops cut the memory-bound chains they sit in: on timm's ResNet-50 (bf16, H100, 2026-11-27) the
ReLUs and residual adds ran as 65 ATen kernels a forward of their own (1.4 ms of 6.9), beside the
generated BatchNorm regions they could have joined, and the convolution layout pass (layout.py)
saw each convolution's result go into a write it cannot keep in channels-last, so it rewrote none.
torch.compile functionalizes the whole graph first.

This pass, run before the other passes, replaces `op_(x, ...)` by the out-of-place `op(x, ...)`
and has every later reader of `x` (and every reader of the op's result) read the new value, where
that computes the same values and nothing else can see the write:
- the op is ATen's, writes only its first argument, and has an out-of-place overload of the same
  name without the underscore that is pointwise (ATen's tag);
- `x` is a fresh tensor the graph computed: not a graph input or constant (the caller would see
  the write), not a view of another tensor, and nothing takes a view of it (a view read after
  the write would see the new values through the old memory);
- the new value has `x`'s shape, dtype and strides (an in-place op keeps them; `bf16.add_(fp32)`
  stays bf16 where `add` would promote).
Returns how many ops it rewrote.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from solforge.capture.pointwise import is_pointwise

aten = torch.ops.aten


@functools.cache
def functional_of(op: Any) -> Any:
    """The out-of-place overload of in-place ATen op `op` (`aten.relu_.default` -> `aten.relu.default`)
    when it is pointwise and `op` writes its first argument only; else None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    if not name.endswith("_") or name.startswith("_") or name.endswith("__"):
        return None
    args = op._schema.arguments
    writes = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    if writes != [0]:
        return None
    packet = getattr(aten, name[:-1], None)
    f = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(f, torch._ops.OpOverload) or f._schema.is_mutable or not is_pointwise(f):
        return None
    return f


def _fresh(x: Any) -> bool:
    """`x` is a tensor the graph computed into memory of its own (not a view, not an input)."""
    if not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    if x.target is operator.getitem:  # an item of a multi-output op (BatchNorm's output, ...)
        p, i = x.args[0], x.args[1]
        t = p.target if isinstance(p, fx.Node) and p.op == "call_function" else None
        return isinstance(t, torch._ops.OpOverload) and isinstance(i, int) and i < len(t._schema.returns) \
            and t._schema.returns[i].alias_info is None
    t = x.target
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.returns:
        return False
    return all(r.alias_info is None for r in t._schema.returns)


def _aliases_taken(x: fx.Node) -> bool:
    """Whether some reader of `x` returns a value sharing its memory (a view), other than getitem."""
    for u in x.users:
        t = u.target
        if u.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            return True  # unknown effects: assume the worst
        args = t._schema.arguments
        for i, a in enumerate(args):
            value = u.args[i] if i < len(u.args) else u.kwargs.get(a.name)
            if value is x and a.alias_info is not None and not a.alias_info.is_write:
                return True
    return False


def _run_fake(op: Any, args: Any, kwargs: Any) -> Any:
    """`op` on the nodes' fake values, under their fake mode."""
    from torch._guards import detect_fake_mode
    from torch.utils._pytree import tree_leaves

    mode = detect_fake_mode([v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)])
    if mode is None:
        return op(*args, **kwargs)
    with mode:
        return op(*args, **kwargs)


def _eq(x: Any, y: Any) -> bool:
    """Sizes equal, symbolic ones by their expressions (no guard is added on any size)."""
    return x == y if type(x) is int and type(y) is int else str(x) == str(y)


def _same_layout(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.dim() != b.dim() or not all(map(_eq, a.shape, b.shape)):
        return False
    dims = [d for d in range(a.dim()) if not _eq(a.shape[d], 1)]
    return all(_eq(a.stride(d), b.stride(d)) for d in dims)


def functionalize_pointwise(gm: fx.GraphModule) -> int:
    """Rewrite the in-place pointwise ops of `gm` that nothing can tell from out-of-place ones (see
    the module doc); returns how many."""
    graph, done = gm.graph, 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        f = functional_of(n.target)
        if f is None or not n.args:
            continue
        x = n.args[0]
        if not _fresh(x) or _aliases_taken(x):
            continue
        old = x.meta.get("val")
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        try:
            new_val = _run_fake(f, args, kwargs)
        except Exception:  # noqa: BLE001 - the fake values cannot run it: leave the write as it is
            continue
        if not _same_layout(new_val, old):
            continue
        order = {m: i for i, m in enumerate(graph.nodes)}
        with graph.inserting_before(n):
            out = graph.call_function(f, n.args, n.kwargs)
        out.meta = dict(n.meta)
        out.meta["val"] = new_val
        for u in list(x.users):
            if u is not n and u is not out and order.get(u, -1) > order[n]:
                u.replace_input_with(x, out)
        n.replace_all_uses_with(out)
        graph.erase_node(n)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
