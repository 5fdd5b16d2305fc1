"""Computed values that pointwise readers read across their memory order are written contiguous.

A pointwise op's result takes the memory order of its input (ATen's rule): T5's relative position
bias, an embedding lookup of (query, key, head) permuted to (head, query, key), comes out with the
heads innermost, and every layer's softmax region then read it with a stride of 12 elements along
the keys it reduces over: 191 µs a layer where the same region with a contiguous bias took 74 (t5-base
encoder, B8, seq 512, bf16, H100, 2026-11-27; torch.compile recomputes the bias in each layer's
kernel instead).

This pass, on each captured ATen graph before matching, puts `clone(v, contiguous_format)` between
such a value and its readers. The clone is pointwise, so region formation fuses it into the region
that computes `v`, which then writes `v` contiguous (its store walks the output's contiguous dim)
instead of in its input's order; nothing else changes. It applies only where the change is
invisible to the rest of the graph and no pass is added:

- `v` is computed by a pointwise op (it is written by a region anyway), at least MIN_BYTES, densely
  laid out but not contiguous;
- every reader is a pointwise op other than a copy, whose own result is contiguous (so its layout
  does not follow `v`'s, and a view after it sees the strides it saw before), none is the graph's
  output (a value a training graph saves for its backward keeps its layout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from solforge.capture.pointwise import is_pointwise

aten = torch.ops.aten
MIN_BYTES = 1 << 20


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _pointwise(n: fx.Node) -> bool:
    t = n.target
    return (n.op == "call_function" and is_pointwise(t) and not t._schema.is_mutable
            and t not in (aten.clone.default, aten._to_copy.default))


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its storage span exactly once, in some order of its dims."""
    expect = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in (*t.shape, *t.stride()))


def candidate(v: fx.Node) -> bool:
    """Whether `v`'s readers may get it contiguous (the module doc's conditions)."""
    t = _val(v)
    if not (_pointwise(v) and isinstance(t, torch.Tensor) and _static(t) and t.dim() >= 2):
        return False
    if t.numel() * t.element_size() < MIN_BYTES or t.is_contiguous() or not _dense(t):
        return False
    readers = list(v.users)
    return bool(readers) and all(
        _pointwise(u) and isinstance(_val(u), torch.Tensor) and _val(u).is_contiguous() for u in readers)


def contiguous_for_readers(gm: fx.GraphModule) -> int:
    """Put a contiguous copy between each candidate value and its readers; returns how many."""
    graph, done = gm.graph, 0
    for v in [n for n in graph.nodes if candidate(n)]:
        value = _contiguous_like(_val(v))  # first: a failure leaves the graph as it was
        with graph.inserting_after(v):
            c = graph.call_function(aten.clone.default, (v,), {"memory_format": torch.contiguous_format})
        c.meta["val"] = value
        v.replace_all_uses_with(c, delete_user_cb=lambda u, c=c: u is not c)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    """A fake value like `t`, contiguous (under `t`'s fake mode)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([t])
    if mode is None:
        return t.clone(memory_format=torch.contiguous_format)
    with mode:
        return t.clone(memory_format=torch.contiguous_format)
