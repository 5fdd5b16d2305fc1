"""Concatenations with one non-empty piece: the piece itself, without the copy.

Partial-rotary attention (Phi-3, and any model written like it) splits each head into the part
that rotates and the part that passes through, then concatenates them again:
`cat([q_embed, q[..., rotary_dim:]], -1)`. With a rotary factor of 1 (Phi-3-mini) the second piece
has no elements, but `aten.cat` still copies the first one whole: on Phi-3-mini's dimensions
(B2 S4096, 32 layers) that is a read and a write of q and of k in every layer, ~6.4 GB per forward.

This pass, run before matching, replaces such a `cat` by its one non-empty piece where that
computes the same values and nothing can tell the two apart:
- every other piece has a size of 0 (a plain int, not a symbolic size) along the joined dim, and
  the piece has the cat's dtype (cat promotes mixed dtypes, even with an empty piece) and rank;
- the cat's result does not leave the graph (the caller would get a view where it got a fresh
  tensor) and nothing in the graph writes in place into the piece's memory (cse.alias_analysis:
  the cat's copy would not have seen the write);
- the piece has the cat's strides (a contiguous piece), or every user of the cat reads any
  layout: attention (SDPA and its backends; canonical.py's per-call op). Elsewhere a `view` of
  the result, or of anything computed from it (elementwise ops keep their input's layout), may
  need the cat's contiguous layout. Phi-3's rotated q and k have eager's layout, a transposed
  token-major tensor, and go straight into SDPA.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from solforge.capture.canonical import _SDPA
from solforge.capture.cse import alias_analysis

aten = torch.ops.aten


@functools.cache
def _any_layout() -> frozenset[object]:
    """Ops that read any layout of their tensor inputs: attention."""
    return frozenset([*_SDPA, torch.ops.solforge_capture.attention_if_causal.default])


def _empty_along(node: object, dim: int) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not -val.dim() <= dim < val.dim():
        return False
    size = val.shape[dim]
    return type(size) is int and size == 0


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Equal strides, symbolic ones by their expressions (no guard is added on any size)."""
    return len(a) == len(b) and all(x == y if type(x) is int and type(y) is int else str(x) == str(y)
                                    for x, y in zip(a, b, strict=True))


def drop_empty_concats(gm: fx.GraphModule) -> int:
    """Replace each `aten.cat` whose pieces but one are empty by that piece; returns how many."""
    cats = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.cat.default]
    if not cats:
        return 0
    analysis = alias_analysis(gm.graph)
    if analysis is None:  # a node whose effects are unknown
        return 0
    aliases, written = analysis
    written_roots = {aliases.find(n) for n in written}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    done = 0
    for node in cats:
        pieces = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        out = node.meta.get("val")
        if not isinstance(pieces, list | tuple) or not isinstance(dim, int) or not isinstance(out, torch.Tensor):
            continue
        kept = [p for p in pieces if not _empty_along(p, dim)]
        if len(kept) != 1 or not isinstance(kept[0], fx.Node) or output in node.users:
            continue
        piece = kept[0]
        val = piece.meta.get("val")
        # the shapes agree by construction (the others add 0 along dim); no SymInt is compared
        if not isinstance(val, torch.Tensor) or val.dtype != out.dtype or val.dim() != out.dim():
            continue
        if aliases.find(piece) in written_roots:
            continue
        if not _same(val.stride(), out.stride()) and not all(u.target in _any_layout() for u in node.users):
            continue
        node.replace_all_uses_with(piece)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
