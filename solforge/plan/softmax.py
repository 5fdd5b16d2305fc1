"""Find softmax over the last dim in an ATen graph.

F.softmax / torch.softmax / Tensor.softmax reach the captured graph as one `_softmax` node; the
form with `dtype=torch.float32` (transformers' eager attention:
`softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)`) as three:

    xf = _to_copy(x, dtype=float32)         only when x is not fp32 already
    y  = _softmax(xf, -1, False)            (half_to_float=True: fp16 in, fp32 out, no copy)
    yl = _to_copy(y, dtype=bfloat16)        the cast back, when it is y's only use

The region is the softmax with the upcast (when only it reads the upcast, or when other readers may
keep it: plan/sharing.py; the op then still reads the narrower x) and the cast back (when it is the
softmax's only reader); the op reads x in its own dtype and stores the output dtype, with fp32 math
in between, which is what the three ops compute. In a
graph captured with grad enabled, `_softmax` also has a `detach` user without users (make_fx's
record of the saved output); it is dead and goes with the region. A softmax over another dim is
left to eager.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from solforge.plan.match import Match
from solforge.plan.sharing import Sharing

aten = torch.ops.aten

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def cast_of(node: Any) -> torch.dtype | None:
    """The dtype a `_to_copy` node casts to, if it is a pure dtype cast (same device, strided, no
    memory format change) between kernel dtypes; None for anything else."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target != aten._to_copy.default:
        return None
    src, out = _val(node.args[0]), _val(node)
    if src is None or out is None or src.dtype not in _SUPPORTED or out.dtype not in _SUPPORTED:
        return None
    kw = dict(node.kwargs)
    if set(kw) - {"dtype", "layout", "device", "memory_format", "non_blocking"}:
        return None
    if kw.get("layout", torch.strided) != torch.strided or kw.get("memory_format") not in (None, torch.preserve_format):
        return None
    if out.device != src.device or tuple(out.shape) != tuple(src.shape):
        return None
    return out.dtype


def live_users(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(users, dead detaches): a `detach` without users is make_fx's trace of a saved tensor."""
    dead = [u for u in node.users if u.target == aten.detach.default and not u.users]
    return [u for u in node.users if u not in dead], dead


def _match_node(node: fx.Node, order: dict[fx.Node, int], sharing: Sharing) -> Match | None:
    from solforge.kernels import softmax as family

    x, dim = node.args[0], node.args[1]
    xv, yv = _val(x), _val(node)
    if xv is None or yv is None or xv.dim() < 1 or xv.numel() == 0 or not isinstance(dim, int):
        return None
    if dim not in (-1, xv.dim() - 1) or xv.dtype not in _SUPPORTED or yv.dtype not in _SUPPORTED:
        return None
    nodes = [node]
    src = x
    users, dead = live_users(node)
    nodes += dead
    out = node
    # the cast of an fp32 softmax (down, or to fp32 again): one rounding of the same fp32 values.
    # A cast up of a bf16 softmax is not taken: the model rounds to bf16 first.
    if len(users) == 1 and cast_of(users[0]) is not None and yv.dtype == torch.float32:
        out = users[0]
        nodes.append(out)
    if cast_of(x) == torch.float32:
        # the upcast joins when only the softmax reads it, or when the region may keep it for its
        # other readers: the cast runs for them either way, and the op reads x in its narrower dtype
        with_cast = [x, *nodes]  # type: ignore[list-item]
        if len(x.users) == 1 or sharing.allows(with_cast, [out], [x.args[0]]):  # type: ignore[union-attr]
            src, nodes = x.args[0], with_cast  # type: ignore[union-attr]
    ov, sv = _val(out), _val(src)
    assert ov is not None and sv is not None
    nodes.sort(key=order.__getitem__)
    workload = family.workload_for(sv, ov.dtype)
    return Match(family.FAMILY, family.softmax_op, out, (src, ov.dtype), nodes, workload)


def match(graph: fx.Graph) -> list[Match]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    sharing = Sharing(graph)
    found = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == aten._softmax.default:
            m = _match_node(node, order, sharing)
            if m is not None:
                found.append(m)
    return found
