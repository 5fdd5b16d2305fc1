"""Region formation: maximal fusible groups of memory-bound ops in an ATen fx graph, between anchors.

Fusible: an op lower.py can write (every pointwise op it has a template for, casts, where, clamp,
activations, constants, views that are index arithmetic, reductions over any dims, softmax,
_safe_softmax, log_softmax, logsumexp, var/std/var_mean, vector norms, argmax/argmin, max.dim/min.dim (values and
indices), cumsum/cumprod of floats, indexing loads: aten.index.Tensor, gather, index_select,
embedding, from a value of no reduction at int32/int64 indices; arange) whose values are static tensors of
fp32/bf16/fp16/bool/integer type. Anchors, never inside a region: anything else, in particular
matmuls, convolutions, attention, random ops (Tag.nondeterministic_seeded), mutating ops, custom
ops (not aten/prims) and ops the generator does not know.

Growth, in graph order: a fusible node joins the region(s) of its producers (merging them) when the
result still has one loop space (lower.analyze) and no cycle appears between regions (a region
runs as one kernel: it may not read, through other nodes, a value computed from itself); else the
latest producer region it can join alone; else a region that reads one of its inputs too (a
sibling: softmax and log_softmax of one x read it once); else it starts a region. A join may not
leave an output the loop cannot store for good (a sibling's at all; a producer's when an anchor
reads it): settling would cut it out again, with all it reads. Outputs are known only at the
end (values read outside the region): an output the loop cannot store (a value of another shape
than the loop's or its rows) leaves the region, with what it reads (a value of no reduction) or
what reads it (a value computed from a reduction), until every output can be stored; the nodes
that left form regions of their own in a further pass (the earlier regions frozen, so that no
cycle appears through them; a max pool of another size than its sibling's). Regions of views
alone, and regions nothing reads (dead code), are dropped. A value the capture marked to be
materialized (capture/layout.py's MATERIALIZE: the NCHW input of a reduction across the channels,
computed from a channels-last value) is no producer to join: its readers read it from memory.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import op_name
from solforge.capture.layout import MATERIALIZE
from solforge.codegen import ir as IR
from solforge.codegen.lower import LOWERINGS, LoopSpace, Lowered, LowerError, analyze, lower

_VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
          "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.flatten.using_ints",
          "aten.unflatten.int", "aten.expand.default", "aten.permute.default", "aten.transpose.int", "aten.t.default",
          "aten.slice.Tensor", "aten.select.int", "aten.alias.default", "aten.detach.default"}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64)


@dataclass(frozen=True)
class RegionRecord:
    """One formed region, as plain data (node names of its graph, its IR key and loop)."""

    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    key: str
    space: LoopSpace


@dataclass
class Formed:
    """A formed region with its live nodes (graph order), inputs and outputs, and its lowering."""

    record: RegionRecord
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    lowered: Lowered


def anchor_reason(node: fx.Node) -> str | None:
    """Why a node cannot be inside a region (None: it is fusible)."""
    if node.op != "call_function":
        return node.op
    t = node.target
    if t is operator.getitem:
        return "getitem"  # fusible only as an item of a member op (form_regions takes it with that op)
    if not isinstance(t, torch._ops.OpOverload):
        return "not an ATen op"
    if t.namespace not in ("aten", "prims"):
        return "custom op"
    if torch.Tag.nondeterministic_seeded in t.tags:
        return "random"
    if t._schema.is_mutable:
        return "mutates"
    if op_name(t) not in LOWERINGS:
        return "unknown to the generator"
    metas = IR.node_metas(node)
    if metas is None:
        return "no static tensor value"
    if any(m.dtype not in _DTYPES for m in metas) or any(m.numel == 0 for m in _read(node, metas)):
        return "dtype or empty value"
    return None


def _read(node: fx.Node, metas: tuple[Any, ...]) -> tuple[Any, ...]:
    """The metas of the results of `node` that something reads: an item of a tuple-valued op that
    nothing reads is never computed (log_sigmoid_forward's buffer for the backward, which is empty
    on CUDA), so it does not keep the op out of a region however it is shaped."""
    if not isinstance(node.meta.get("val"), (tuple, list)):
        return metas
    read = {u.args[1] for u in node.users if u.target is operator.getitem and u.users}
    if any(u.target is not operator.getitem for u in node.users):
        return metas
    return tuple(m for i, m in enumerate(metas) if i in read)


def _is_view(node: fx.Node) -> bool:
    return op_name(node.target) in _VIEWS or node.target is operator.getitem


class _Former:
    def __init__(self, graph: fx.Graph, exclude: Collection[fx.Node] = ()) -> None:
        self.exclude = exclude
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.parent: dict[int, int] = {}
        self.members: dict[int, list[fx.Node]] = {}
        self.region: dict[fx.Node, int] = {}
        self.src: dict[fx.Node, frozenset[fx.Node]] = {}  # non-region node -> nearest region nodes above it
        self.next = 0
        self.frozen: set[int] = set()  # regions of an earlier pass: no node joins them, cycles through them count

    def seed(self, nodes: list[fx.Node]) -> None:
        """An earlier pass's region, frozen."""
        r = self.next
        self.parent[r] = r
        self.members[r] = list(nodes)
        self.region.update(dict.fromkeys(nodes, r))
        self.frozen.add(r)
        self.next += 1

    def find(self, r: int) -> int:
        while self.parent[r] != r:
            self.parent[r] = self.parent[self.parent[r]]
            r = self.parent[r]
        return r

    def of(self, node: fx.Node) -> int | None:
        r = self.region.get(node)
        return None if r is None else self.find(r)

    def above(self, node: fx.Node) -> frozenset[fx.Node]:
        """The region nodes a non-region node reads, directly or through other non-region nodes."""
        got = self.src.get(node)
        if got is None:
            acc: set[fx.Node] = set()
            for a in node.all_input_nodes:
                acc |= {a} if a in self.region else self.above(a)
            got = self.src[node] = frozenset(acc)
        return got

    def direct(self, nodes: Iterable[fx.Node], inside: set[fx.Node]) -> set[int]:
        """Regions the given nodes read from outside `inside` (through non-region nodes too)."""
        out: set[int] = set()
        for n in nodes:
            for a in n.all_input_nodes:
                if a in inside:
                    continue
                for s in ({a} if a in self.region else self.above(a)):
                    out.add(self.find(self.region[s]))
        return out

    def cyclic(self, group: set[int], node: fx.Node) -> bool:
        """Would the union of regions `group` and `node` read a value computed from itself?"""
        inside = {n for r in group for n in self.members[r]} | {node}
        # through non-region nodes alone (an anchor reads a value of the group, the group reads the
        # anchor: NetVLAD's softmax feeds a bmm whose result joins its column sums)
        for n in inside:
            for a in n.all_input_nodes:
                if a not in inside and a not in self.region and not self.above(a).isdisjoint(inside):
                    return True
        todo = list(self.direct(inside, inside) - group)
        seen: set[int] = set()
        while todo:
            r = todo.pop()
            if r in group:
                return True
            if r in seen:
                continue
            seen.add(r)
            ms = set(self.members[r])
            todo += list(self.direct(ms, ms))
        return False

    def stuck(self, node: fx.Node) -> bool:
        """Is `node` read by a node that can never join it (an anchor, an excluded node, the output)?"""
        users = list(node.users)
        if isinstance(node.meta.get("val"), (tuple, list)):
            users = [u for g in users for u in g.users]
        return any(u in self.exclude or anchor_reason(u) is not None for u in users)

    def valid(self, nodes: list[fx.Node]) -> set[fx.Node] | None:
        """The outputs its loop cannot store if `nodes` lower to one loop; None if they do not."""
        try:
            outs = outputs_of(nodes)
            an = analyze(lower(IR.from_nodes(nodes, outs)))
        except (LowerError, ValueError):
            return None
        return None if an.error is not None else {outs[k] for k in an.bad_outputs}

    def join(self, node: fx.Node) -> None:
        producers = []
        for a in node.all_input_nodes:
            r = self.of(a)
            # a value the capture marked to be materialized (capture/layout.py MATERIALIZE: the NCHW
            # input of a reduction across the channels) is read from memory
            if r is not None and r not in producers and r not in self.frozen and not a.meta.get(MATERIALIZE):
                producers.append(r)
        # siblings: regions that read one of the same values (reading it once serves both)
        siblings = []
        for a in node.all_input_nodes:
            for u in a.users:
                r = self.of(u)
                if r is not None and r not in producers and r not in siblings and r not in self.frozen:
                    siblings.append(r)
        tries = ([set(producers)] if len(producers) > 1 else []) + [{r} for r in reversed(producers)]
        sib = len(tries)
        tries += [{*producers, r} for r in reversed(siblings)]
        # a multi-output op (max_pool's (values, indices)) is stored through its items, which join
        # after it: judged with them (without, the join has no output and fails: a max pool never
        # took in the pointwise ops before it)
        items = [u for u in node.users if u.target is operator.getitem] \
            if isinstance(node.meta.get("val"), (tuple, list)) else []
        for k, group in enumerate(tries):
            nodes = sorted([n for r in group for n in self.members[r]] + [node], key=self.order.__getitem__)
            if self.cyclic(group, node):
                continue
            bad = self.valid(nodes + items)
            if bad is None:
                continue
            # a join may not leave an output its loop cannot store, for good: a sibling's at all,
            # a producer's when an anchor reads it (DenseNet's cats of growing width all read the
            # first features: one region of them all would be split again by _settle, losing
            # them; a value read by an op that may join later is an output for now only)
            new = bad - (self.valid(sorted([n for r in group for n in self.members[r]], key=self.order.__getitem__))
                         or set())
            if new and (k >= sib or any(self.stuck(o) for o in new)):
                continue
            keep = min(group)
            for r in group:
                self.parent[r] = keep
                if r != keep:
                    del self.members[r]
            self.members[keep] = nodes
            self.region[node] = keep
            return
        self.parent[self.next] = self.next
        self.members[self.next] = [node]
        self.region[node] = self.next
        self.next += 1


def outputs_of(nodes: list[fx.Node]) -> list[fx.Node]:
    """Nodes read outside the group (items of a multi-output op stand for it), in graph order."""
    inside = set(nodes)
    outs = []
    for n in nodes:
        if isinstance(n.meta.get("val"), (tuple, list)):
            continue  # read through its getitems
        if any(u not in inside for u in n.users):
            outs.append(n)
    return outs


def _closure(start: fx.Node, inside: set[fx.Node], up: bool) -> set[fx.Node]:
    out, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n in out or n not in inside:
            continue
        out.add(n)
        todo += list(n.all_input_nodes) if up else list(n.users)
        if not up and isinstance(n.meta.get("val"), (tuple, list)):
            todo += list(n.users)
    return out


def _settle(nodes: list[fx.Node]) -> tuple[list[fx.Node], Lowered] | None:
    """Shrink a grown region until its loop can store every output; None if nothing is left."""
    while nodes:
        outs = outputs_of(nodes)
        try:
            ir = IR.from_nodes(nodes, outs)
            kg = lower(ir)
        except (LowerError, ValueError):
            return None
        an = analyze(kg)
        if an.error is not None:
            return None
        if not an.bad_outputs:
            return nodes, Lowered(ir, kg, an)
        inside = set(nodes)
        drop: set[fx.Node] = set()
        for k in an.bad_outputs:
            o = outs[k]
            o_node = o.args[0] if o.target is operator.getitem else o
            dep = an.kinds[kg.outputs[k]] != "pre"
            drop |= _closure(o_node, inside, up=not dep)  # type: ignore[arg-type]
        # a getitem goes with its op
        drop |= {n for n in nodes if n.target is operator.getitem and n.args[0] in drop}
        nodes = [n for n in nodes if n not in drop]
    return None


def form_regions(graph: fx.Graph, exclude: Collection[fx.Node] = ()) -> list[Formed]:
    """Every region of fusible nodes in `graph` (see the module docstring), in graph order.
    `exclude`: nodes taken as anchors whatever they are (those a kernel family claimed)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    out: list[Formed] = []
    allowed: set[fx.Node] | None = None
    # the nodes a region's settling dropped (an output of another shape than its loop: a sibling max
    # pool of another size) form regions of their own in a further pass, beside the earlier ones
    for _ in range(_PASSES):
        formed, dropped = _form_pass(graph, exclude, allowed, out)
        out += formed
        if not any(not _is_view(n) for n in dropped):
            break
        allowed = dropped
    out.sort(key=lambda fr: order[fr.nodes[0]])
    return out


_PASSES = 3


def _form_pass(graph: fx.Graph, exclude: Collection[fx.Node], allowed: set[fx.Node] | None,
               earlier: list[Formed]) -> tuple[list[Formed], set[fx.Node]]:
    """One pass of region formation over the fusible nodes (of `allowed` only, when given), the
    `earlier` regions frozen; the regions, and the nodes their settling dropped."""
    f = _Former(graph, exclude)
    for fr in earlier:
        f.seed(fr.nodes)
    for node in graph.nodes:
        if node.op != "call_function" or node in f.region:
            continue
        if node.target is operator.getitem:
            r = f.of(node.args[0])  # type: ignore[arg-type]
            if r is not None and r not in f.frozen and IR.node_metas(node) is not None:
                f.members[r].append(node)
                f.region[node] = r
            continue
        if node not in exclude and anchor_reason(node) is None and (allowed is None or node in allowed):
            f.join(node)
    out: list[Formed] = []
    dropped: set[fx.Node] = set()
    for r, nodes in f.members.items():
        if r in f.frozen or all(_is_view(n) for n in nodes):
            continue
        settled = _settle(nodes)
        if settled is None:
            continue
        dropped |= set(nodes) - set(settled[0])
        nodes, low = settled
        if all(_is_view(n) for n in nodes):
            continue
        outs = outputs_of(nodes)
        if not outs:
            continue  # dead code: nothing reads it (a graph may keep an unused mean); no kernel to write
        _, ins = IR.build(nodes, outs)
        rec = RegionRecord(tuple(n.name for n in nodes), tuple(a.name for a in ins), tuple(o.name for o in outs),
                           low.ir.key, low.space)
        out.append(Formed(rec, nodes, ins, outs, low))
    return out, dropped


def describe(regions: list[Formed]) -> list[dict[str, Any]]:
    """A short plain summary per region (for logs and tests)."""
    return [{"ops": [op_name(n.target) for n in fr.nodes], "outputs": fr.record.outputs,
             "space": (fr.record.space.shape, fr.record.space.reduced)} for fr in regions]
