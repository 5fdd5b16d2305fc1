"""Shared inner nodes: a region may keep a pure inner node that code outside it also reads.

A model can read a value from inside a region elsewhere: `h = x.float()` feeds an RMSNorm and also
`h * 2`; the norm's variance is returned too; `torch.sigmoid(g)` of a written-out silu is reused.
CSE (capture/cse.py) makes this more common: two copies of one pure op, one in a norm and one
outside, become one node with users on both sides. Refusing such a region would lose it; instead
the custom op replaces the region's outputs and the shared node stays in the graph, computed by
its original ops (and so do the region nodes it needs): the "kept" nodes. `plan.rewrite` erases
only the region nodes left without users, so the kept ones survive by construction.

A region may keep nodes only when:

1. Every kept node is pure: a getitem or a functional, deterministic ATen op (capture.cse's
   `mergeable`: no in-place or out= op, no seeded-random op, nothing fx calls impure), and no
   tensor it may share memory with is written in place anywhere in the graph (cse's alias
   analysis). Then its value does not depend on whether the rest of the region still runs: an
   in-place write inside the region (nn.RMSNorm's `add_(mean, eps)`) that the rewrite removes
   would otherwise change what the outside reader sees, and an outside write could change what
   the op reads. A kept node that is a graph output is fine: it is computed exactly as before.
   A graph with calls of unknown effect (not ATen) keeps nothing.
2. It pays, in both regimes a region can be in (all the families here are memory-bound):
   - large rows, bandwidth-bound: in a roofline model of what each eager op moves (a view moves
     nothing), with R the bytes the region's ops move, F what the fused op moves (its inputs once,
     its outputs once) and K what the kept ops move, we take the region when 2F + K <= R: the
     fused op plus the kept ops still move less than the region even if the kernel reaches only
     half the bandwidth efficiency of the eager ops it replaces. Why that margin and not just
     F + K < R: the tuner swaps a kernel in when it beats the region's own time, timing the region
     against the kernel alone (`extract` does not know what stays), so without a margin a kernel
     that wins that comparison narrowly could lose once the kept ops are added back;
   - small rows (decode), launch-bound: kept compute ops + the op must be fewer launches than the
     region's compute ops.
   Examples (bf16 x, N elements): Qwen3's norm with a shared `x.float()`: 8N + 6N <= 36N, taken;
   the same norm whose variance (`mean`) is also returned: 8N + 18N <= 36N, taken; an fp32 norm
   whose `rsqrt` is also returned keeps 4 of its 5 ops: no launch saved, left alone; a silu whose
   `silu(g)` is read elsewhere: 12N + 4N > 10N and kept silu + op = silu + mul, left alone; a
   written-out gelu_new whose `pow(x, 3)` is read elsewhere: 4N + 4N against ~36N, taken.

Boundary nodes are a matcher's choice, not this rule's: a node at the edge of a region that others
read (a norm's output feeding a rope and something else, a cast after the norm) ends the region
there and becomes its output or input, which never costs more than keeping it. Likewise a region
built of smaller ones (rope with its q/k norms) leaves a part out rather than keep it unfused: the
part is then a region of its own (plan/rope.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from solforge.capture.cse import alias_analysis, mergeable
from solforge.runtime.shapes import hint

aten = torch.ops.aten



def dead_detach(node: fx.Node) -> bool:
    """A detach() nothing reads: make_fx's record of a tensor autograd saves (grad-mode captures hang
    one off an RMSNorm's rsqrt, a softmax, a sigmoid). It reads no value anyone needs, so it is no
    reader outside a region: the rewrite erases it with the node it hangs off."""
    return node.op == "call_function" and node.target == aten.detach.default and not node.users


def kept_nodes(nodes: Sequence[fx.Node], outputs: Iterable[fx.Node]) -> list[fx.Node]:
    """The region nodes that stay after the rewrite, in the region's order: every non-output node
    with a user outside the region (dead detaches aside), and the region nodes it depends on.
    Outputs never stay: the op provides them, and a kept node that reads one reads the op's result
    instead."""
    inside, outs = set(nodes), set(outputs)
    stack = [n for n in nodes if n not in outs and any(u not in inside and not dead_detach(u) for u in n.users)]
    kept: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in kept or n in outs or n not in inside:
            continue
        kept.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in nodes if n in kept]


def _bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        try:
            return hint(v.numel()) * v.element_size()
        except Exception:  # a size with no hint: count it as one element
            return v.element_size()
    if isinstance(v, list | tuple):
        return sum(_bytes(x) for x in v)
    return 0


def _kind(n: fx.Node) -> str:
    from solforge.profile.kinds import node_kind  # (profile imports plan: imported when used)

    return node_kind(n)


def _launches(n: fx.Node) -> bool:
    from solforge.profile.kinds import VIEW

    return _kind(n) != VIEW


def _op_bytes(n: fx.Node) -> int:
    """What the eager op moves: it reads its tensor inputs and writes its result."""
    return sum(_bytes(a.meta.get("val")) for a in n.all_input_nodes) + _bytes(n.meta.get("val"))


class Sharing:
    """The rule above for the regions of one graph (the alias analysis runs once, on first need)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self._tainted: tuple[Any, set[fx.Node]] | None = None
        self._unknown = False

    def _written(self, n: fx.Node) -> bool:
        """`n` may share memory with a tensor written in place somewhere in the graph."""
        if self._tainted is None and not self._unknown:
            analysis = alias_analysis(self.graph)
            if analysis is None:
                self._unknown = True
            else:
                aliases, written = analysis
                self._tainted = (aliases, {aliases.find(w) for w in written})
        if self._unknown:
            return True
        assert self._tainted is not None
        aliases, roots = self._tainted
        return aliases.find(n) in roots

    def refusal(self, nodes: Sequence[fx.Node], outputs: Sequence[fx.Node], inputs: Sequence[fx.Node]) -> str | None:
        """Why the region may not keep its shared nodes, or None if it keeps none or may keep them."""
        kept = kept_nodes(nodes, outputs)
        if not kept:
            return None
        for n in kept:
            if not mergeable(n):
                return f"{n.name} is kept for readers outside the region and is not a pure op"
        for n in kept:
            if self._written(n):
                return f"{n.name} is kept for readers outside the region and may be written in place"
        if any(_kind(n) in ("gemm", "attention") for n in kept):
            return "a kept node is a matmul: compute-bound, never cheap to keep (the model below is for bandwidth)"
        compute = [n for n in nodes if _launches(n)]
        kept_compute = [n for n in kept if _launches(n)]
        if kept_compute and len(kept_compute) + 1 >= len(compute):
            return f"keeping {[n.name for n in kept_compute]} saves no launch"
        region = sum(_op_bytes(n) for n in compute)
        fused = sum(_bytes(a.meta.get("val")) for a in dict.fromkeys(inputs)) \
            + sum(_bytes(o.meta.get("val")) for o in outputs)
        kept_bytes = sum(_op_bytes(n) for n in kept_compute)
        if 2 * fused + kept_bytes > region:
            return f"keeping {[n.name for n in kept]} costs too much: 2 x {fused} B + {kept_bytes} B > {region} B"
        return None

    def allows(self, nodes: Sequence[fx.Node], outputs: Sequence[fx.Node], inputs: Sequence[fx.Node]) -> bool:
        return self.refusal(nodes, outputs, inputs) is None
