"""Find cross-entropy in an ATen graph.

F.cross_entropy (and nn.CrossEntropyLoss) without class weights or label smoothing reach the
captured graph as log-softmax then NLL. Hugging Face's causal-LM loss (transformers 5.x
ForCausalLMLoss: `logits.float()`, labels padded with -100 and shifted, flattened,
`F.cross_entropy(..., ignore_index=-100, reduction="mean")`, or "sum" divided by
num_items_in_batch outside) becomes:

    xf   = _to_copy(logits, dtype=float32)           absent when the logits are fp32 already
    x2   = view(xf, [-1, V])
    lsm  = _log_softmax(x2, 1, False)                 (+ a dead detach with grad enabled)
    nll  = nll_loss_forward(lsm, target, None, reduction, ignore_index)
    loss = getitem(nll, 0);  getitem(nll, 1)          the total weight, unused

The region is all of these; the op reads the logits in their own dtype (bf16: the fp32 copy of a
4096 x 151936 tensor, 2.5 GB, is never made) with any leading shape. Casts and flattening views are
taken in either order, when the region is their sole user or may keep them for their other readers
(plan/sharing.py: a shared upcast still runs for those, but the op reads the bf16 logits, half the
bytes). Class weights, a log-softmax used elsewhere (a model returning log-probs: keeping it would
keep the whole region), a class dim other than the last (nll_loss2d), and label smoothing (other ops)
are left to eager.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from solforge.plan.match import Match
from solforge.plan.sharing import Sharing
from solforge.plan.softmax import _val, cast_of, live_users

aten = torch.ops.aten

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _source(x: fx.Node, V: int, shared: bool = False) -> tuple[fx.Node, list[fx.Node]]:
    """Walk back from the log-softmax's input through flattening views and upcasts to fp32 that
    only this region uses (`shared`: that others may read too): (the tensor the op reads, the nodes
    walked through)."""
    taken: list[fx.Node] = []
    while (shared or len(x.users) == 1) and x.op == "call_function":
        src = x.args[0] if x.args else None
        sv = _val(src)
        if sv is None:
            break
        is_flatten = x.target in _VIEWS and sv.dim() >= 1 and int(sv.shape[-1]) == V
        if not (is_flatten or cast_of(x) == torch.float32):
            break
        taken.append(x)
        x = src  # type: ignore[assignment]
    return x, taken


def _match_node(nll: fx.Node, order: dict[fx.Node, int], sharing: Sharing) -> Match | None:
    from solforge.kernels import cross_entropy as family

    names = ("self", "target", "weight", "reduction", "ignore_index")
    args = dict(zip(names, nll.args, strict=False)) | {k: v for k, v in nll.kwargs.items() if k in names}
    lsm, target, reduction, ignore = args.get("self"), args.get("target"), args.get("reduction", 1), \
        args.get("ignore_index", -100)
    if args.get("weight") is not None or not isinstance(lsm, fx.Node) or not isinstance(target, fx.Node):
        return None
    if lsm.op != "call_function" or lsm.target != aten._log_softmax.default:
        return None
    if not isinstance(reduction, int) or not 0 <= reduction < 3 or not isinstance(ignore, int):
        return None
    xv, tv = _val(lsm.args[0]), _val(target)
    dim = lsm.args[1]
    if xv is None or tv is None or xv.dim() != 2 or dim not in (1, -1) or xv.dtype not in _SUPPORTED:
        return None
    if tv.dtype not in (torch.int64, torch.int32) or tuple(tv.shape) != (xv.shape[0],) or xv.shape[1] == 0:
        return None
    users, dead = live_users(lsm)
    if users != [nll]:
        return None
    items = [u for u in nll.users if u.target is operator.getitem]
    outs = [u for u in items if u.args[1] == 0]
    if len(items) != len(nll.users) or len(outs) != 1 or any(u.users for u in items if u.args[1] != 0):
        return None
    out = outs[0]
    ov = _val(out)
    if ov is None or ov.dtype not in _SUPPORTED:
        return None
    V = int(xv.shape[1])
    src, taken = _source(lsm.args[0], V, shared=True)  # type: ignore[arg-type]
    nodes = sorted([*taken, lsm, *dead, nll, *items], key=order.__getitem__)
    if not sharing.allows(nodes, [out], [src, target]):  # walk back only through what this region alone reads
        src, taken = _source(lsm.args[0], V)  # type: ignore[arg-type]
        nodes = sorted([*taken, lsm, *dead, nll, *items], key=order.__getitem__)
    sv = _val(src)
    assert sv is not None
    red = family.REDUCTIONS[reduction]
    workload = family.workload_for(sv, tv, ignore_index=ignore, reduction=red, out_dtype=ov.dtype)
    return Match(family.FAMILY, family.cross_entropy_op, out, (src, target, ignore, red, ov.dtype), nodes, workload,
                 results=2)


def match(graph: fx.Graph) -> list[Match]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    sharing = Sharing(graph)
    found = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == aten.nll_loss_forward.default:
            m = _match_node(node, order, sharing)
            if m is not None:
                found.append(m)
    return found
