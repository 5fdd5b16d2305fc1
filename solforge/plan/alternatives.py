"""Generated alternatives: a region a hand-written family matched, formed again as a generated region.

Issue 32: "a region the families match also gets generated candidates; the fastest verified one
wins". For every forward family group, `alternative_groups` lowers exactly the nodes the family's
example region replaces (plan/generated.py's scratch graph decomposes its composites, as for any
generated region) and, where the generator can write them, gives a WorkloadGroup of family
"generated" with `alternative_of` = the family's workload. It is tuned and verified like any
generated group; integrate/select.py's `pick_alternatives` keeps the faster verified one per
family workload (ties, failures and times that mean nothing go to the family). Where the nodes
cannot be lowered (an op the generator has no lowering for, an in-place op, an output it cannot
store), the family group's `no_alternative` says why: a recorded reason, not an error.

Alternatives are not extra regions: `plan()` is unchanged (region counts stay), the alternative
groups come from here, as backward groups come from `backward_groups`.

The generated region has the family region's nodes; its outputs are every node read outside them,
so an inner node a family keeps (plan/sharing.py) is an output here instead of a recomputed node.
`alternatives` forms them for many matches of one graph with one scratch copy: the Integrator
(integrate/__init__.py) forms them again at rewrite time for the family matches whose workload
was won by its alternative, and swaps a family match for its alternative only when the
alternative's workload is the one that was tuned.

**Absorbed producers.** A value only the family region reads, computed by fusible ops no region
claimed (each of them alone not worth a kernel: plan/generated.py's `worth`), costs eager a write
and a read the alternative does not need: the alternative takes those ops too (`_absorb`: a
producer joins when every reader of its value is in the region, repeatedly, so a chain of them
joins). The items of a split, chunk or unbind (Mixtral's expert activations, masked then split
into gate and up halves) are slices of its input there, so the split joins whole. The family's
kernel still runs without them: the selection (integrate/select.py, `generated_wins`) charges it
the absorbed ops' eager time (the alternative's region as eager ran it less the family's).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import op_name
from solforge.codegen import ir as IR
from solforge.codegen import regions as RG
from solforge.codegen.lower import LowerError, prepare
from solforge.plan.match import Match, WorkloadGroup

GENERATED = "generated"
aten = torch.ops.aten


def alternatives(graph: fx.Graph, matches: Sequence[Match],
                 claimed: Collection[fx.Node] | None = None) -> list[Match | str]:
    """Per family match (live nodes of `graph`), its generated alternative over the same nodes and
    the producers only they read (`_absorb`), or why there is none. `claimed`: every node a region
    of the graph's plan holds (those are never absorbed; None: only the matches' own)."""
    from solforge.plan import generated as G

    if not matches:
        return []
    mine: set[fx.Node] = set()
    for m in matches:
        mine.update(m.nodes)
    taken = set(claimed or ()) | mine
    # the matches' composites and the free nodes' are decomposed (the other regions' nodes count as claimed)
    sc, _ = G.scratch(graph, [n for n in taken if n not in mine])
    _split_items_as_slices(sc, taken)
    stands: dict[fx.Node, list[fx.Node]] = {}
    for s, o in sc.origin.items():
        if s.op == "call_function":
            stands.setdefault(o, []).append(s)
    free = {s for s, o in sc.origin.items() if s.op == "call_function" and o not in taken}
    sorder = {n: i for i, n in enumerate(sc.graph.nodes)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    return [_one(m, sc, stands, sorder, graph, order, free) for m in matches]


_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int")


def _split_items_as_slices(sc: Any, taken: set[fx.Node]) -> None:
    """In the scratch graph, each item of a split, split_with_sizes or unbind that no region holds
    becomes a slice (a select for unbind) of the op's input, standing for that item (`origin`), so a
    region can take the items one by one; the op goes from the scratch graph once nothing reads it."""
    g = sc.graph
    for node in list(g.nodes):
        if node.op != "call_function" or op_name(node.target) not in _SPLITS:
            continue
        orig = sc.origin.get(node)
        if orig is None or orig in taken or not all(u.target is operator.getitem for u in node.users):
            continue
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
            continue
        unbind = op_name(node.target) == "aten.unbind.int"
        dim = node.kwargs.get("dim", node.args[1 if unbind else 2] if len(node.args) > (1 if unbind else 2) else 0)
        dim = dim % val.dim()
        if not unbind:
            size = node.args[1]
            if isinstance(size, int):
                sizes = [min(size, val.shape[dim] - i) for i in range(0, val.shape[dim], size)]
            else:
                sizes = list(size)
            if not all(isinstance(k, int) for k in sizes):
                continue
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for item in list(node.users):
            o = sc.origin.get(item)
            if o is None or o in taken:
                continue
            if not item.users:  # an item nothing reads (the third piece of a split, unused) goes
                g.erase_node(item)
                del sc.origin[item]
                continue
            i = item.args[1]
            with g.inserting_before(item):
                if unbind:
                    new = g.call_function(aten.select.int, (x, dim, i))
                else:
                    new = g.call_function(aten.slice.Tensor, (x, dim, starts[i], starts[i] + sizes[i]))
            new.meta.update(item.meta)
            item.replace_all_uses_with(new)
            g.erase_node(item)
            sc.origin[new] = o
            del sc.origin[item]
        if not node.users:
            g.erase_node(node)
            del sc.origin[node]


def _absorb(nodes: list[fx.Node], free: set[fx.Node]) -> list[fx.Node]:
    """`nodes` (scratch) and the free fusible producers whose every reader is among them, repeatedly."""
    grown = set(nodes)
    todo = list(nodes)
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in grown or a not in free or a.target is operator.getitem or RG.anchor_reason(a) is not None:
                continue
            if all(u in grown for u in a.users):
                grown.add(a)
                todo.append(a)
    return list(grown)


def _one(m: Match, sc: Any, stands: dict[fx.Node, list[fx.Node]], sorder: dict[fx.Node, int],
         graph: fx.Graph, order: dict[fx.Node, int], free: set[fx.Node]) -> Match | str:
    if m.family == GENERATED:
        return "already generated"
    # (a composite's getitems are gone from the scratch graph: its pieces stand for them)
    nodes = sorted({s for n in m.nodes for s in stands.get(n, []) if s in sorder}, key=sorder.__getitem__)
    if not nodes:
        return "no node to lower"
    for s in nodes:
        if s.target is operator.getitem:
            continue
        why = RG.anchor_reason(s)
        if why is not None:
            return f"{op_name(s.target) if s.op == 'call_function' else s.name}: {why}"
    grown = sorted(_absorb(nodes, free), key=sorder.__getitem__)
    got = _formed(m, grown, sc, graph, order) if len(grown) > len(nodes) else None
    if got is None or isinstance(got, str):  # no producer to take, or they cannot join: the family's nodes alone
        got = _formed(m, nodes, sc, graph, order)
    return got


def _formed(m: Match, nodes: list[fx.Node], sc: Any, graph: fx.Graph, order: dict[fx.Node, int]) -> Match | str:
    from solforge.kernels.generated import generated_op, workload_for
    from solforge.plan import generated as G

    outs = RG.outputs_of(nodes)
    try:
        ir, ins = IR.build(nodes, outs)
        low = prepare(ir)
    except (LowerError, ValueError) as e:
        return f"the generator cannot lower it: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
    rec = RG.RegionRecord(tuple(n.name for n in nodes), tuple(a.name for a in ins), tuple(o.name for o in outs),
                          low.ir.key, low.space)
    got = G._to_match(RG.Formed(rec, nodes, ins, outs, low), sc, graph, order)  # type: ignore[arg-type]
    if isinstance(got, str):
        return got
    gnodes, inputs, outputs, _ = got
    if not set(m.nodes) <= set(gnodes):
        return "its generated form covers other nodes than the family's region"
    # a split whose every item the region takes goes with them, and its items nothing reads (nothing
    # else reads its input then)
    items = set(gnodes)
    for n in {i.args[0] for i in gnodes if i.target is operator.getitem}:
        if isinstance(n, fx.Node) and n not in items and op_name(n.target) in _SPLITS \
                and all(u in items or not u.users for u in n.users):
            gnodes += [n, *(u for u in n.users if u not in items)]
    gnodes.sort(key=order.__getitem__)
    if G.stale_reads(graph, gnodes, outputs, order):
        return "an input is written in place inside the region"
    wl = workload_for(low.ir)
    return G.GeneratedMatch(family=GENERATED, op=generated_op, output=outputs[0], args=(inputs, wl.param("key")),
                            nodes=gnodes, workload=wl, outputs=tuple(outputs))


def alternative_groups(groups: Sequence[WorkloadGroup]) -> list[WorkloadGroup]:
    """One generated group per forward family group whose example region lowers (its
    `alternative_of`: the family's workload; its region is the example's, with the producers it
    absorbed: `absorbed`); the others get `no_alternative` (why). Backward and generated groups get
    none."""
    from solforge.plan import find_matches

    out: list[WorkloadGroup] = []
    claimed: dict[int, set[fx.Node]] = {}  # per example graph: every node its plan's regions hold
    for g in groups:
        if g.forward is not None or g.alternative_of is not None or g.workload.family == GENERATED \
                or g.example is None:
            continue
        gm, m = g.example
        if id(gm.graph) not in claimed:
            claimed[id(gm.graph)] = {n for f in find_matches(gm.graph, g.families) for n in f.nodes}
        got = alternatives(gm.graph, [m], claimed[id(gm.graph)])[0]
        if isinstance(got, str):
            g.no_alternative = got
            continue
        graph_index = g.regions[0].graph if g.regions else 0
        # the ops eager launched for it (views, splits and their items move no data: not counted)
        extra = tuple(n.name for n in got.nodes if n not in set(m.nodes)
                      and not RG._is_view(n) and op_name(n.target) not in _SPLITS)
        out.append(WorkloadGroup(got.workload, [got.region(graph_index)], example=(gm, got),
                                 alternative_of=g.workload, absorbed=extra))
    return out
