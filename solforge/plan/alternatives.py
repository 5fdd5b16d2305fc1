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
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch.fx as fx

from solforge.capture import op_name
from solforge.codegen import ir as IR
from solforge.codegen import regions as RG
from solforge.codegen.lower import LowerError, prepare
from solforge.plan.match import Match, WorkloadGroup

GENERATED = "generated"


def alternatives(graph: fx.Graph, matches: Sequence[Match]) -> list[Match | str]:
    """Per family match (live nodes of `graph`), its generated alternative over the same nodes, or
    why there is none."""
    from solforge.plan import generated as G

    if not matches:
        return []
    mine: set[fx.Node] = set()
    for m in matches:
        mine.update(m.nodes)
    # only the matches' composites are decomposed (every other node counts as claimed)
    sc, _ = G.scratch(graph, [n for n in graph.nodes if n not in mine])
    stands: dict[fx.Node, list[fx.Node]] = {}
    for s, o in sc.origin.items():
        if s.op == "call_function":
            stands.setdefault(o, []).append(s)
    sorder = {n: i for i, n in enumerate(sc.graph.nodes)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    return [_one(m, sc, stands, sorder, graph, order) for m in matches]


def _one(m: Match, sc: object, stands: dict[fx.Node, list[fx.Node]], sorder: dict[fx.Node, int],
         graph: fx.Graph, order: dict[fx.Node, int]) -> Match | str:
    from solforge.kernels.generated import generated_op, workload_for
    from solforge.plan import generated as G

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
    if set(gnodes) != set(m.nodes):
        return "its generated form covers other nodes than the family's region"
    if G.stale_reads(graph, gnodes, outputs, order):
        return "an input is written in place inside the region"
    wl = workload_for(low.ir)
    return G.GeneratedMatch(family=GENERATED, op=generated_op, output=outputs[0], args=(inputs, wl.param("key")),
                            nodes=gnodes, workload=wl, outputs=tuple(outputs))


def alternative_groups(groups: Sequence[WorkloadGroup]) -> list[WorkloadGroup]:
    """One generated group per forward family group whose example region lowers (its
    `alternative_of`: the family's workload; its region is the example's); the others get
    `no_alternative` (why). Backward and generated groups get none."""
    out: list[WorkloadGroup] = []
    for g in groups:
        if g.forward is not None or g.alternative_of is not None or g.workload.family == GENERATED \
                or g.example is None:
            continue
        gm, m = g.example
        got = alternatives(gm.graph, [m])[0]
        if isinstance(got, str):
            g.no_alternative = got
            continue
        graph_index = g.regions[0].graph if g.regions else 0
        out.append(WorkloadGroup(got.workload, [got.region(graph_index)], example=(gm, got),
                                 alternative_of=g.workload))
    return out
