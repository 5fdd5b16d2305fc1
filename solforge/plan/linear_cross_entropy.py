"""Find an LM head's projection feeding cross-entropy, where nothing else reads the logits.

A cross_entropy region (plan/cross_entropy.py: casts and flattening views, `_log_softmax`,
`nll_loss_forward`) whose logits come straight from the projection, as F.linear reaches the graph:

    h2 = view(h, [N, H])                     (3-D inputs; the op takes h2 as it is)
    wt = t(W)                                (or permute(W, [1, 0]) / transpose(W, 0, 1))
    y  = mm(h2, wt)  |  addmm(b, h2, wt)     |  linear(h2, W, b)
    y3 = _unsafe_view(y, [B, S, V])          then the region's casts and views

The region is the projection (and the transpose, when only it uses it) plus the loss; the op reads
h2, W, b and the labels. Only where the logits have no other user and are no graph output:
otherwise they are materialized anyway and cross_entropy (which comes after this family in
`_matchers()`) is the right region. The reduction must be mean or sum (Hugging Face's
num_items_in_batch form divides a sum outside the region); class weights, label smoothing and
reused log-probs are refused by the cross_entropy matcher this one starts from.

The op also computes the gradients, so it is told which: a tensor needs one if autograd was on when
the graph was captured and it depends on an input that requires grad (capture records both on the
graph; dynamo guards on both). A guess too wide only costs time; one too narrow is caught by the
op's backward, which computes what is missing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from solforge.plan import cross_entropy as ce
from solforge.plan.match import Match
from solforge.plan.sharing import Sharing
from solforge.plan.softmax import _val

aten = torch.ops.aten

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_TRANSPOSES = (aten.t.default, aten.permute.default, aten.transpose.int)
# ops through which no gradient flows (besides integer results)
_NO_GRAD = (aten.detach.default,)


def _is_transpose(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _TRANSPOSES:
        return False
    v = _val(node.args[0])
    if v is None or v.dim() != 2:
        return False
    if node.target == aten.permute.default:
        return list(node.args[1]) == [1, 0]  # type: ignore[arg-type]
    if node.target == aten.transpose.int:
        return sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]  # type: ignore[arg-type]
    return True


def _projection(y: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, list[fx.Node]] | None:
    """(h2, W, bias, nodes) when `y` is h2 @ W.T (+ bias) in one of the forms above."""
    if y.op != "call_function":
        return None
    if y.target == aten.linear.default:
        h, w = y.args[0], y.args[1]
        b = y.args[2] if len(y.args) > 2 else y.kwargs.get("bias")
        return (h, w, b, [y]) if isinstance(h, fx.Node) and isinstance(w, fx.Node) else None  # type: ignore[return-value]
    if y.target == aten.mm.default:
        b, (h, wt) = None, y.args
    elif y.target == aten.addmm.default:
        if y.kwargs.get("beta", 1) != 1 or y.kwargs.get("alpha", 1) != 1:
            return None
        b, h, wt = y.args[:3]
    else:
        return None
    if not isinstance(h, fx.Node) or not isinstance(wt, fx.Node) or not _is_transpose(wt):
        return None
    w = wt.args[0]
    assert isinstance(w, fx.Node)
    # the transpose goes with the region when nothing else reads it
    return h, w, b, [y] + ([wt] if len(wt.users) == 1 else [])  # type: ignore[return-value]


def requires_grad(graph: fx.Graph) -> dict[fx.Node, bool]:
    """Which nodes carry a gradient when the graph runs: inputs as capture recorded them (unknown:
    yes), then any floating result of something that does, except through a detach. Nothing does
    when autograd was off. A graph that switches grad mode itself is treated as if always on."""
    gm = graph.owning_module
    enabled = bool(getattr(gm, "meta", {}).get("grad_enabled", True))
    if any(n.op == "call_function" and n.target is torch._C._set_grad_enabled for n in graph.nodes):
        enabled = True
    out: dict[fx.Node, bool] = {}
    for n in graph.nodes:
        v = n.meta.get("val")
        floating = isinstance(v, torch.Tensor) and v.dtype.is_floating_point
        if not enabled:
            out[n] = False
        elif n.op == "placeholder":
            out[n] = bool(n.meta.get("requires_grad", True))
        elif n.op == "get_attr":
            a = getattr(gm, str(n.target), None)
            out[n] = bool(getattr(a, "requires_grad", True))
        elif n.op == "call_function" and n.target in _NO_GRAD:
            out[n] = False
        else:  # tuples (getitem of a multi-output op) have no tensor val: follow the inputs
            out[n] = (floating or not isinstance(v, torch.Tensor)) and any(out.get(a, True) for a in n.all_input_nodes)
    return out


def _match_node(nll: fx.Node, order: dict[fx.Node, int], grad: dict[fx.Node, bool],
                sharing: Sharing) -> Match | None:
    from solforge.kernels import linear_cross_entropy as family

    m = ce._match_node(nll, order, sharing)
    # a loss region that keeps a node (a cast of the logits read elsewhere too) would keep the
    # projection it depends on: the logits are materialized anyway, so cross_entropy's region is right
    if m is None or m.kept:
        return None
    logits, target, ignore, red, out_dtype = m.args
    if red not in family.REDUCTIONS or not isinstance(logits, fx.Node):
        return None
    # the logits' one user is the region: no other reader, not a graph output
    if len(logits.users) != 1 or next(iter(logits.users)) not in m.nodes:
        return None
    proj = _projection(logits)
    if proj is None:
        return None
    h, w, b, taken = proj
    hv, wv, bv = _val(h), _val(w), _val(b) if b is not None else None
    lv = _val(logits)
    if hv is None or wv is None or lv is None or hv.dim() < 2 or wv.dim() != 2 or hv.dtype not in _SUPPORTED:
        return None  # (aten.linear takes (..., H); mm and addmm take (N, H))
    if wv.dtype != hv.dtype or tuple(wv.shape) != (int(lv.shape[-1]), int(hv.shape[-1])):
        return None
    if b is not None and (bv is None or bv.dtype != hv.dtype or tuple(bv.shape) != (int(wv.shape[0]),)):
        return None
    grads = (family.GRAD_HIDDEN if grad.get(h, True) else 0) | (family.GRAD_WEIGHT if grad.get(w, True) else 0) \
        | (family.GRAD_BIAS if b is not None and grad.get(b, True) else 0)
    nodes = sorted([*taken, *m.nodes], key=order.__getitem__)
    tv = _val(target)
    assert tv is not None
    workload = family.workload_for(hv, wv, bv, tv, ignore_index=ignore, reduction=red, out_dtype=out_dtype,
                                   grads=grads)
    return Match(family.FAMILY, family.linear_cross_entropy_op, m.output,
                 (h, w, b, target, ignore, red, out_dtype, workload.param("grads")), nodes, workload, results=4)


def match(graph: fx.Graph) -> list[Match]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    found: list[Match] = []
    grad: dict[fx.Node, bool] | None = None
    sharing = Sharing(graph)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == aten.nll_loss_forward.default:
            grad = grad if grad is not None else requires_grad(graph)
            m = _match_node(node, order, grad, sharing)
            if m is not None:
                found.append(m)
    return found
