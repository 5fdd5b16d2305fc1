"""Integrated graphs, tidied after the kernel rewrite: unused views dropped, and slices that
partition a tensor taken as one split, whose backward is one concatenation.

- `drop_unused_views`: the rewrite replaces a region's output, and view nodes the region's code
  made for itself but nothing reads any more stay in the graph (Phi-3's partial-rotary slices
  `q[..., rotary_dim:]`, the unsqueezed cos/sin of apply_rotary_pos_emb): no kernel, but each is an
  op the host dispatches on every call (integrate/__init__.py runs the graph op by op). Only aten view ops
  (their schema says the result aliases the input, nothing is written) without users are erased.

- `split_partitions`: a model that slices one tensor into pieces that cover it exactly, as Phi-3
  slices its fused q/k/v projection (`qkv[..., :q_pos]`, `qkv[..., q_pos:k_end]`,
  `qkv[..., k_end:]`), gets from autograd one full-size gradient per slice: a zero-filled tensor
  with the piece's gradient copied in (SliceBackward0), then added together. For Phi-3-mini's
  training step (B1 S4096, 32 layers) that is 3 fills, 3 copies and 2 adds of a 4096 x 9216 tensor
  per layer. The slices become one `aten.split_with_sizes` (the same views: same offsets, sizes and
  strides), whose gradient is the pieces' gradients concatenated: one kernel. Forward values are
  unchanged; only the backward's kernels differ, and they compute the same sums (each element of
  the gradient is one piece's gradient, plus zeros).
  Conditions: `aten.slice.Tensor` nodes of one tensor, on one dim, step 1, static bounds, that
  together cover the dim with no gap or overlap, at least two of them, and no call between the
  first and the last of them that may write in place (the views are all made at the first).

SOLFORGE_TIDY=0 in the environment (settings.tidy) turns both passes off.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from solforge import settings

aten = torch.ops.aten


def _is_view_op(target: object) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    schema = target._schema
    if schema.is_mutable or len(schema.returns) != 1:
        return False
    ret = schema.returns[0].alias_info
    return ret is not None and not ret.is_write and bool(schema.arguments) and \
        schema.arguments[0].alias_info is not None and not schema.arguments[0].alias_info.is_write


def drop_unused_views(gm: fx.GraphModule) -> int:
    """Erase view nodes nothing reads (latest first, so a chain of them goes); returns how many."""
    if not settings.current().tidy:
        return 0
    n = 0
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and not node.users and _is_view_op(node.target):
            gm.graph.erase_node(node)
            n += 1
    if n:
        gm.recompile()
    return n


def _writes(target: object) -> bool:
    """Whether a call may write a tensor in place (an op whose schema says so, or anything that
    is not an op: its effects are unknown)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    return target is not operator.getitem


def _static_slice(node: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """(base, dim, start, end) of a step-1 aten.slice.Tensor with static bounds, clamped to the
    base's size; None for anything else."""
    if node.op != "call_function" or node.target != aten.slice.Tensor or node.kwargs:
        return None
    base, *rest = node.args
    val = base.meta.get("val") if isinstance(base, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    dim, start, end, step = (list(rest) + [0, None, None, 1][len(rest):])[:4]
    if step != 1 or not isinstance(dim, int):
        return None
    dim = dim % val.dim()
    size = val.shape[dim]
    if not isinstance(size, int):
        return None  # a symbolic size: the partition would hold for one size only
    start = 0 if start is None else start
    end = size if end is None else end
    if not (isinstance(start, int) and isinstance(end, int)):
        return None
    start = max(0, min(size, start + size if start < 0 else start))
    end = max(0, min(size, end + size if end < 0 else end))
    return base, dim, start, end


def split_partitions(gm: fx.GraphModule) -> int:
    """Replace each set of slices that partitions a tensor along one dim by one split_with_sizes
    (module docstring); returns how many sets."""
    if not settings.current().tidy:
        return 0
    groups: dict[tuple[fx.Node, int], list[tuple[int, int, fx.Node]]] = defaultdict(list)
    for node in gm.graph.nodes:
        s = _static_slice(node)
        if s is not None:
            base, dim, start, end = s
            groups[(base, dim)].append((start, end, node))
    done = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # in-place writes: a split made at the first slice must not move a view across one
    writes = [order[n] for n in gm.graph.nodes if n.op == "call_function" and _writes(n.target)]
    for (base, dim), pieces in groups.items():
        if len(pieces) < 2:
            continue
        pieces.sort(key=lambda p: (p[0], p[1]))
        size = base.meta["val"].shape[dim]
        bounds = [(a, b) for a, b, _ in pieces]
        gapless = all(b0 == a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:], strict=False))
        if bounds[0][0] != 0 or bounds[-1][1] != size or not gapless or any(a >= b for a, b in bounds):
            continue
        first = min((p[2] for p in pieces), key=order.__getitem__)
        last = max(order[p[2]] for p in pieces)
        if any(order[first] < w < last for w in writes):
            continue
        with gm.graph.inserting_before(first):
            split = gm.graph.call_function(aten.split_with_sizes.default, (base, [b - a for a, b in bounds], dim))
            split.meta["val"] = tuple(p[2].meta.get("val") for p in pieces)
            for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if k in first.meta:
                    split.meta[k] = first.meta[k]
            for i, (_, _, node) in enumerate(pieces):
                item = gm.graph.call_function(operator.getitem, (split, i))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
        for _, _, node in pieces:
            gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
