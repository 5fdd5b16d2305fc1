"""Find LayerNorm in an ATen graph.

nn.LayerNorm and F.layer_norm (with or without weight and bias, any dtype) reach the captured ATen
graph as one op, since LayerNorm is not decomposed there (tests/test_layernorm.py looks):

    out, mean, rstd = native_layer_norm(x, [H], weight?, bias?, eps)    mean/rstd getitems dead
    out = layer_norm(x, [H], weight?, bias?, eps, cudnn_enable)          if a graph keeps the composite

Normalization over the last dim (normalized_shape of length 1: what transformers' LayerNorms
use) and over several trailing dims (KernelBench's `nn.LayerNorm((features, dim1, dim2))`: those
dims are merged into one for the kernel, `plan.merged_dims`) is matched; a graph that needs mean or
rstd (a hand-written backward) keeps the ATen op. Rows longer than the backward kernels hold (64K)
are matched only in a graph captured without autograd (the forward's split variant). A hand-written LayerNorm
(x - x.mean(-1)) / sqrt(var + eps) is not matched: none of the supported architectures writes one.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from solforge.plan.match import Match, merged_dims, static_dims, viewed

aten = torch.ops.aten

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _param(node: Any, dims: tuple[int, ...]) -> tuple[bool, torch.Tensor | None]:
    """(acceptable, value) for a weight/bias argument: absent, or a tensor of the normalized shape
    and a kernel dtype."""
    if node is None:
        return True, None
    v = _val(node)
    return (v is not None and tuple(v.shape) == dims and v.dtype in _SUPPORTED), v


def _match_node(node: fx.Node) -> Match | None:
    from solforge.kernels import layernorm as family

    names = ("input", "normalized_shape", "weight", "bias", "eps")
    args = dict(zip(names, node.args, strict=False)) | {k: v for k, v in node.kwargs.items() if k in names}
    x, shape = args.get("input"), args.get("normalized_shape")
    weight, bias, eps = args.get("weight"), args.get("bias"), args.get("eps", 1e-5)
    xv = _val(x)
    if xv is None or xv.dtype not in _SUPPORTED or shape is None or not 1 <= len(shape) <= xv.dim():
        return None
    k = len(shape)
    dims = tuple(xv.shape[-k:])
    if k > 1 and not (static_dims(dims) and static_dims(shape)):  # merged dims: plain sizes only
        return None
    if k == 1 and int(shape[0]) != int(xv.shape[-1]) or k > 1 and tuple(shape) != dims or 0 in dims:
        return None
    (wok, wv), (bok, bv) = _param(weight, dims), _param(bias, dims)
    if not (wok and bok) or not isinstance(eps, int | float):
        return None
    if node.target == aten.native_layer_norm.default:
        items = [u for u in node.users if u.target is operator.getitem]
        outs = [u for u in items if u.args[1] == 0]
        if len(items) != len(node.users) or len(outs) != 1 or any(u.users for u in items if u.args[1] != 0):
            return None
        out, nodes = outs[0], [node, *[u for u in items if u.args[1] != 0], outs[0]]
    else:
        out, nodes = node, [node]
    ov = _val(out)
    if ov is None or ov.dtype not in _SUPPORTED or tuple(ov.shape) != tuple(xv.shape):
        return None
    args = (x, weight, bias, float(eps), ov.dtype)
    views = merged_dims(args, k, dims)
    vx, vw, vb = views.get("views", (None, None, None))[:3]
    workload = family.workload_for(viewed(xv, vx), viewed(wv, vw), viewed(bv, vb), float(eps), out_dtype=ov.dtype)
    if not family.supported(workload) or _training(node) and not family.trainable(workload):
        return None  # (a row the backward kernels cannot hold would fail in the backward)
    return Match(family.FAMILY, family.layernorm_op, out, args, nodes, workload, **views)


def _training(node: fx.Node) -> bool:
    """Whether the graph was captured with autograd on (capture.lower_to_aten's meta; a graph
    without it counts as one)."""
    return bool(getattr(node.graph.owning_module, "meta", {}).get("grad_enabled", True))


def match(graph: fx.Graph) -> list[Match]:
    targets = {aten.native_layer_norm.default, aten.layer_norm.default}
    found = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in targets:
            m = _match_node(node)
            if m is not None:
                found.append(m)
    return found
