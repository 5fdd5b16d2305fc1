"""Find RMSNorm in an ATen graph, however the model wrote it.

Canonical chain (Hugging Face Qwen3/Llama, nn.RMSNorm, F.rms_norm and hand-written forms all lower
to it, or to the fused ATen op handled at the end):

    xf = x.to(float32)                      optional upcast
    s  = pow(xf, 2) | mul(xf, xf)
    m  = mean(s, [last dim], keepdim=True)  or the last k dims (merged into one for the kernels:
                                            plan.merged_dims), or one middle dim (moved last for
                                            the kernels of that layout: plan.moved_dim)
    a  = add(m, eps)                        add / add_ with a Python number
    r  = rsqrt(a)                           or reciprocal(sqrt(a)), pow(a, -0.5)
    y  = mul(xf, r)                         or div(xf, sqrt(a))
    then optionally: cast to x.dtype (rounds before the weight, as HF does), mul by a weight of
    the normalized shape (over a middle dim: H there and 1 after it, as (C, 1, 1) broadcasts over
    (B, C, H, W)), a final downcast.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from solforge.plan.match import Match, merged_dims, moved_dim, static_dims, viewed
from solforge.plan.sharing import dead_detach

aten = torch.ops.aten

_CASTS = {aten._to_copy.default}
if hasattr(torch.ops, "prims") and hasattr(torch.ops.prims, "convert_element_type"):
    _CASTS.add(torch.ops.prims.convert_element_type.default)
_ADDS = {aten.add.Tensor, aten.add.Scalar, aten.add_.Tensor, aten.add_.Scalar}
_MULS = {aten.mul.Tensor, aten.mul_.Tensor}
_FLOAT32 = torch.float32


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The target dtype if `node` is a pure dtype cast (no device/layout/memory-format change)."""
    if node.target not in _CASTS:
        return None
    if node.target == aten._to_copy.default:
        kw = node.kwargs
        src = _val(node.args[0]) if node.args else None
        # type_as() spells out layout and device; accept them when they change nothing
        same = (
            set(kw) <= {"dtype", "layout", "device", "non_blocking"}
            and kw.get("layout", torch.strided) == torch.strided
            and (kw.get("device") is None or (src is not None and torch.device(kw["device"]) == src.device))
        )
        if len(node.args) != 1 or not same or "dtype" not in kw:
            return None
        return kw["dtype"]
    return node.args[1]  # prims.convert_element_type(x, dtype)


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_square_of(node: fx.Node, xf: fx.Node) -> bool:
    if node.target == aten.pow.Tensor_Scalar:
        return node.args[0] is xf and node.args[1] in (2, 2.0)
    if node.target in _MULS:
        return node.args[0] is xf and node.args[1] is xf
    return node.target == aten.square.default and node.args[0] is xf


def _eps(node: fx.Node, mean: fx.Node) -> float | None:
    if node.target not in _ADDS or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args[0], node.args[1]
    other = b if a is mean else a if b is mean else None
    if isinstance(other, bool) or not isinstance(other, int | float):
        return None
    return float(other)


def _inverse_sqrt(a: fx.Node, xf: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """From `a` (= mean + eps) to y = xf / sqrt(a): (interior nodes, y). Any of them may also be read
    outside the norm (plan/sharing.py decides whether the region may keep them): the chain
    follows the user that continues it."""
    for u in a.users:
        if u.target == aten.rsqrt.default or (u.target == aten.pow.Tensor_Scalar and u.args[1] == -0.5):
            ways = [([u], u, "mul")]
        elif u.target == aten.sqrt.default:  # 1 / sqrt(a), or y = xf / sqrt(a)
            ways = [([u, v], v, "mul") for v in u.users if v.target == aten.reciprocal.default] + [([u], u, "div")]
        else:
            continue
        for inner, r, kind in ways:
            for y in r.users:
                if kind == "mul" and y.target in _MULS and len(y.args) == 2 and {y.args[0], y.args[1]} == {xf, r}:
                    return inner, y
                if kind == "div" and y.target == aten.div.Tensor and y.args[0] is xf and y.args[1] is r:
                    return inner, y
    return None


def _match_chain(mean: fx.Node) -> Match | None:
    from solforge.kernels import rmsnorm as family

    sq = mean.args[0]
    if not isinstance(sq, fx.Node) or sq.op != "call_function" or not sq.args:
        return None
    xf = sq.args[0]
    if not isinstance(xf, fx.Node) or not _is_square_of(sq, xf):
        return None
    xv = _val(xf)
    if xv is None or not xv.dtype.is_floating_point or xv.dim() < 1 or xv.shape[-1] == 0:
        return None
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    nd = xv.dim()
    if not keepdim or not dims or mean.kwargs.get("dtype") is not None \
            or len({d % nd for d in dims}) != len(dims):
        return None
    # the mean takes the last k dims (several: merged into one row for the kernels), or one other dim
    # (moved last, a view: the rmsnorm kernels have a layout for rows that are columns)
    k, ds, moved = len(dims), sorted(d % nd for d in dims), None
    if ds == list(range(nd - k, nd)):
        if k > 1 and not (static_dims(xv.shape[-k:]) and 0 not in xv.shape[-k:]):
            return None
        norm_shape = tuple(xv.shape[-k:])
    elif k == 1:
        moved = ds[0]
        norm_shape = (xv.shape[moved],) + (1,) * (nd - 1 - moved)  # a weight's, right-aligned
    else:
        return None
    # the square, the mean, + eps and 1/sqrt may have readers outside the norm too (a model returning
    # its variance): they are inner nodes the region keeps if plan/sharing.py allows it
    for a in mean.users:
        eps = _eps(a, mean)
        found = _inverse_sqrt(a, xf) if eps is not None else None
        if found is not None:
            break
    else:
        return None
    assert eps is not None
    inv_nodes, y = found

    # x is the tensor before an upcast to fp32, when there is one
    x, nodes = xf, [sq, mean, a, *inv_nodes, y]
    src_dtype = _cast_dtype(xf)
    if src_dtype == _FLOAT32 and isinstance(xf.args[0], fx.Node) and (xv0 := _val(xf.args[0])) is not None:
        if xv0.dtype in (torch.bfloat16, torch.float16, torch.float32) and tuple(xv0.shape) == tuple(xv.shape):
            x, nodes = xf.args[0], [xf, *nodes]
    x_dtype = _val(x).dtype  # type: ignore[union-attr]

    # optional tail: cast to x.dtype (round_before_weight), weight mul, final downcast. Each joins only
    # if it is the only reader of the node before it: a tail node read elsewhere ends the region (it
    # becomes the output), which is cheaper than keeping the whole norm up to it for that reader
    tail, weight, round_before_weight = y, None, False
    nxt = _only_user(tail)
    if nxt is not None and _cast_dtype(nxt) == x_dtype and x_dtype != _val(tail).dtype:  # type: ignore[union-attr]
        tail, round_before_weight = nxt, True
        nodes.append(nxt)
        nxt = _only_user(tail)
    if nxt is not None and nxt.target in _MULS:
        w = nxt.args[1] if nxt.args[0] is tail else nxt.args[0] if nxt.args[1] is tail else None
        wv = _val(w)
        lead = wv.dim() - len(norm_shape) if wv is not None else -1  # leading 1s: a (1, C, 1, 1) weight
        if wv is not None and lead >= 0 and tuple(wv.shape[lead:]) == norm_shape and wv.dtype.is_floating_point \
                and all(d == 1 for d in wv.shape[:lead]) \
                and tuple(_val(nxt).shape) == tuple(xv.shape):  # type: ignore[union-attr]
            tail, weight = nxt, w
            nodes.append(nxt)
            nxt = _only_user(tail)
    tail_dtype = _val(tail).dtype  # type: ignore[union-attr]
    if nxt is not None and tail_dtype == _FLOAT32 and _cast_dtype(nxt) in (torch.bfloat16, torch.float16):
        tail = nxt
        nodes.append(nxt)
    if round_before_weight and weight is None:
        round_before_weight = False  # a lone cast back is just the output dtype
    out_dtype = _val(tail).dtype  # type: ignore[union-attr]
    args = (x, weight, eps, out_dtype, round_before_weight)
    views = merged_dims(args, k, norm_shape) if moved is None else moved_dim(args, moved, params=(1,))
    vs = views.get("views", (None, None))
    workload = family.workload_for(viewed(_val(x), vs[0]), viewed(_val(weight), vs[1]), eps,  # type: ignore[arg-type]
                                   out_dtype=out_dtype, round_before_weight=round_before_weight)
    return Match("rmsnorm", family.rmsnorm_op.default, tail, args, nodes, workload, **views)


def _match_fused(node: fx.Node) -> Match | None:
    """aten.rms_norm / aten._fused_rms_norm, as they appear when not decomposed (e.g. on CUDA)."""
    from solforge.kernels import rmsnorm as family

    args = list(node.args) + [None] * (4 - len(node.args))
    x, shape, weight, eps = args[:4]
    eps = node.kwargs.get("eps", eps)
    weight = node.kwargs.get("weight", weight)
    xv = _val(x)
    k = len(shape) if xv is not None else 0
    if k == 0 or k > xv.dim() or k == 1 and int(shape[0]) != int(xv.shape[-1]):  # type: ignore[union-attr]
        return None
    norm_shape = tuple(xv.shape[-k:])  # type: ignore[union-attr]
    if k > 1 and not (static_dims(norm_shape) and static_dims(shape) and tuple(shape) == norm_shape):
        return None
    if node.target == aten._fused_rms_norm.default:
        # (out, rstd): the rstd getitem may exist but must be dead, or read only by dead detaches
        # (make_fx's record of what autograd saves, in a training graph on CUDA)
        items = [u for u in node.users if u.target is operator.getitem]
        outs = [u for u in items if u.args[1] == 0]
        rest = [u for u in items if u.args[1] != 0]
        if len(items) != len(node.users) or len(outs) != 1 or not all(dead_detach(d) for u in rest for d in u.users):
            return None
        out, nodes = outs[0], [node, *rest, outs[0]]  # (the rewrite erases the dead detaches)
    else:
        out, nodes = node, [node]
    if eps is None:  # PyTorch's default: the eps of the compute dtype (fp32 for half types)
        eps = torch.finfo(torch.float32 if xv.dtype in (torch.bfloat16, torch.float16) else xv.dtype).eps
    wv = _val(weight)
    if weight is not None and (wv is None or tuple(wv.shape) != tuple(int(d) for d in norm_shape)):
        return None
    out_dtype = _val(out).dtype  # type: ignore[union-attr]
    args = (x, weight, float(eps), out_dtype, False)
    views = merged_dims(args, k, norm_shape)
    vs = views.get("views", (None, None))
    workload = family.workload_for(viewed(xv, vs[0]), viewed(wv, vs[1]), float(eps),  # type: ignore[arg-type]
                                   out_dtype=out_dtype, round_before_weight=False)
    return Match("rmsnorm", family.rmsnorm_op.default, out, args, nodes, workload, **views)


def match(graph: fx.Graph) -> list[Match]:
    found = []
    fused = {aten.rms_norm.default}
    if hasattr(aten, "_fused_rms_norm"):
        fused.add(aten._fused_rms_norm.default)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        m = None
        if node.target == aten.mean.dim:
            m = _match_chain(node)
        elif node.target in fused:
            m = _match_fused(node)
        if m is not None:
            found.append(m)
    return found
