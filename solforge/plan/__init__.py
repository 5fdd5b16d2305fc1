"""Plan: find kernel-family regions in ATen graphs and group them into Workloads.

One matcher per family (the registry's table, kernels/registry.py, in its order); a matcher returns
`Match`es (live graph nodes). A `Region` is the plain record of a match; regions with the same
Workload are tuned once.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import CapturedGraph
from solforge.capture.pointwise import is_pointwise
from solforge.plan.match import (  # noqa: F401  (re-exported: the planner's records and the matchers' helpers)
    Match,
    Region,
    View,
    WorkloadGroup,
    late_inputs,
    merged_dims,
    moved_dim,
    static_dims,
    viewed,
)
from solforge.plan.sharing import Sharing, dead_detach
from solforge.records import Workload


def _matchers() -> dict[str, Callable[[fx.Graph], list[Match]]]:
    """Every forward family's matcher in first-claim-wins order: the registry's table
    (kernels/registry.py, where the order is explained)."""
    from solforge.kernels import registry

    return registry.matchers()


def find_matches(graph: fx.Graph, families: Sequence[str] | None = None) -> list[Match]:
    matches = _claim(graph, families, frozenset())
    # a region of a family that joins generated regions (registry `joins`: a lone GELU, a LayerNorm
    # read by pointwise ops) next to a generated region, or to a pointwise op no region holds, gives
    # way: the generated regions form again through its nodes. It stays its family's where no
    # generated region took it with other ops then. Again while one gives way (a GELU that joined
    # makes the LayerNorm before it next to a generated region)
    skip: frozenset[fx.Node] = frozenset()
    for _ in range(_JOIN_ROUNDS):
        joining = [m for m in matches if m.output not in skip and _joins(m, matches)]
        if not joining:
            break
        again = _claim(graph, families, skip | {m.output for m in joining})
        kept = frozenset(m.output for m in joining if _fused(m, again))
        if not kept:
            break
        matches = again if len(kept) == len(joining) else _claim(graph, families, skip | kept)
        skip |= kept
    return matches


_JOIN_ROUNDS = 3


def _claim(graph: fx.Graph, families: Sequence[str] | None, skip: frozenset[fx.Node]) -> list[Match]:
    """Every family's matches in the registry's order, first claim wins; family matches whose
    output is in `skip` are left to the generated regions."""
    matches: list[Match] = []
    claimed: set[fx.Node] = set()
    sharing = Sharing(graph)
    for family, matcher in _matchers().items():
        if families is not None and family not in families:
            continue
        # the generated matcher forms its regions over the nodes the families left (plan/generated.py)
        found = matcher(graph, frozenset(claimed)) if family == "generated" else matcher(graph)
        for m in found:
            if family != "generated" and m.output in skip:
                continue
            # a node belongs to one region at most (kept ones too: one region stands for its time);
            # inner nodes read outside the region must be ones it may keep (plan/sharing.py)
            if claimed.isdisjoint(m.nodes) and sharing.allows(m.nodes, m.outputs, m.inputs):
                claimed.update(m.nodes)
                matches.append(m)
    return matches


def _fused(m: Match, matches: Sequence[Match]) -> bool:
    """A generated region of `matches` holds `m`'s output and an op outside `m`'s nodes (not a view,
    not an item of a multi-output op)."""
    from solforge.codegen.regions import _is_view

    mine = set(m.nodes)
    return any(g.family == "generated" and m.output in g.nodes and any(
        n not in mine and n.target is not operator.getitem and not _is_view(n) for n in g.nodes) for g in matches)


def _elementwise_of(u: fx.Node, outs: Sequence[fx.Node]) -> bool:
    """A pointwise op of one of `outs` and of smaller operands alone (a GELU, a scale, a per-channel
    bias): not a residual add of another tensor as large, which a model's next norm takes."""
    def numel(a: fx.Node) -> int:
        v = a.meta.get("val")
        return v.numel() if isinstance(v, torch.Tensor) else 0

    mine = [a for a in u.all_input_nodes if a in outs]
    return is_pointwise(u.target) and bool(mine) and all(
        numel(a) < numel(mine[0]) for a in u.all_input_nodes if a not in outs)


def _joins(m: Match, matches: Sequence[Match]) -> bool:
    """`m`'s family joins generated regions (registry `joins`), and a generated region reads one of
    its outputs or, "neighbors", computes an input of `m`, or a pointwise op no region holds does
    (KernelBench level 2's LayerNorm -> GELU -> `* scale`: the lone multiply, not a region alone,
    and the GELU form one)."""
    from solforge.kernels import registry

    mode = registry.joins_generated(m.family)
    if not mode:
        return False
    readers = {u for o in m.outputs for u in o.users}
    if mode == "readers" and not (readers and all(_elementwise_of(u, m.outputs) for u in readers)):
        return False
    near = {*m.inputs, *readers} if mode == "neighbors" else readers
    if any(g.family == "generated" and not near.isdisjoint(g.nodes) for g in matches):
        return True
    held = {n for g in matches for n in g.nodes}
    return any(n.op == "call_function" and n not in held and is_pointwise(n.target) for n in near)


def plan(graphs: Sequence[CapturedGraph], families: Sequence[str] | None = None) -> list[WorkloadGroup]:
    """Every region in every graph, grouped by workload, in first-seen order."""
    groups: dict[Workload, WorkloadGroup] = {}
    for g in graphs:
        for m in find_matches(g.aten.graph, families):
            group = groups.setdefault(m.workload, WorkloadGroup(
                m.workload, families=None if families is None else tuple(families)))
            group.regions.append(m.region(g.index))
            if group.example is None:
                group.example = (g.aten, m)
    return list(groups.values())


def backward_groups(groups: Sequence[WorkloadGroup]) -> list[WorkloadGroup]:
    """Training: one group per forward group whose family tunes its backward, i.e. whose
    `backward_workload(workload)` (kernels/registry.py) is a Workload (None: nothing to tune there). The
    backward workload is an ordinary one of family `<family>_bwd` (kernels/<family>_bwd.py; the
    add_ forms share their norm's: rmsnorm_bwd, layernorm_bwd, with `ds` set); its regions are the
    forward's, so the count is the same. Forward workloads that share a backward
    workload share one group."""
    from solforge.kernels import registry

    out: dict[Workload, WorkloadGroup] = {}
    for g in groups:
        bwl = registry.backward_workload(g.workload.family, g.workload)
        if bwl is None:
            continue
        group = out.setdefault(bwl, WorkloadGroup(bwl, example=g.example, forward=g.workload))
        group.regions.extend(g.regions)
    return list(out.values())


def extract(match: Match) -> tuple[fx.GraphModule, list[Any]]:
    """The region as a standalone GraphModule (inputs: the match's tensor inputs) and the fake
    values of those inputs, so the original computation can be timed on the device."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    metas = []
    for i, node in enumerate(match.inputs):
        env[node] = graph.placeholder(f"in{i}")
        metas.append(node.meta["val"])
    region_nodes = set(match.nodes)
    for node in match.nodes:
        for a in node.all_input_nodes:
            if a not in env and a not in region_nodes:
                # an input reached only through a cast we left outside (e.g. x before .float())
                env[a] = graph.placeholder(f"in{len(metas)}")
                metas.append(a.meta["val"])
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] for o in match.outputs) if match.multi else env[match.output])
    return fx.GraphModule(torch.nn.Module(), graph), metas


def derived_inputs(match: Match) -> dict[int, int]:
    """For each input `extract` adds past the match's own (a value the region reads through ops
    left outside it: Phi-3's q is its fused projection's slice, transposed), the index of the match
    input it is computed from, found by walking back through ops of one tensor input. The backward
    baseline differentiates with respect to that value when the match input itself is not read."""
    pos = {node: i for i, node in enumerate(match.inputs)}
    seen, region = set(match.inputs), set(match.nodes)
    out: dict[int, int] = {}
    n = len(match.inputs)
    for node in match.nodes:
        for a in node.all_input_nodes:
            if a in seen or a in region:
                continue
            seen.add(a)
            src = a
            while src not in pos and len(src.all_input_nodes) == 1:
                src = src.all_input_nodes[0]
            if src in pos:
                out[n] = pos[src]
            n += 1
    return out


def region_signature(match: Match) -> str:
    """A short hash of the computation a region runs: its ops, how they connect, their constants
    and its inputs' shapes and dtypes, but not node names (which depend on where in which graph
    the region sits). Two regions with equal signatures run the same ATen code on the same shapes."""
    sub, metas = extract(match)
    index: dict[fx.Node, int] = {}
    parts = [";".join(f"{tuple(m.shape)}/{m.dtype}" for m in metas)]

    def arg(a: Any) -> Any:
        return f"%{index[a]}" if isinstance(a, fx.Node) else a

    for i, node in enumerate(sub.graph.nodes):
        index[node] = i
        if node.op == "call_function":
            args = fx.node.map_aggregate(node.args, arg)
            kwargs = fx.node.map_aggregate(node.kwargs, arg)
            parts.append(f"{node.target}{args}{sorted(kwargs.items())}")
        elif node.op == "output":
            parts.append(f"out{fx.node.map_aggregate(node.args, arg)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


_META = ("val", "nn_module_stack", "stack_trace")


def _hoist(graph: fx.Graph, args: Sequence[Any], first: fx.Node, order: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Move the nodes that `args` need to before `first` (see `late_inputs`); returns the graph order,
    recomputed when anything moved."""
    nodes: list[fx.Node] = []
    fx.node.map_arg(tuple(args), nodes.append)  # (the generated op's inputs are one list argument)
    if all(order.get(a, -1) < order[first] for a in nodes):  # new nodes (earlier rewrites) sit early
        return order
    order = {n: i for i, n in enumerate(graph.nodes)}
    for a in nodes:
        late = late_inputs(a, first, order)
        if late is None:  # the matcher should have refused this region
            raise RuntimeError(f"solforge rewrite: {a.name} cannot be computed before {first.name}")
        for n in late:
            first.prepend(n)
        if late:
            order = {n: i for i, n in enumerate(graph.nodes)}
    return order


def _view_node(graph: fx.Graph, a: Any, view: View) -> fx.Node:
    """A `Match.views` entry applied to argument `a` in the graph, with its value in meta["val"]."""
    node = graph.call_function(view[0], (a, *view[1]))
    node.meta["val"] = viewed(a.meta.get("val") if isinstance(a, fx.Node) else None, view)
    return node


def on_device(gm: fx.GraphModule, a: fx.Node, device: str, moved: dict[fx.Node, fx.Node]) -> fx.Node:
    """`a` as a kernel on `device` reads it: a 0-dim CPU constant of the graph (`torch.tensor(0.5)`
    written in forward, which dynamo lifts into a get_attr; ATen's CUDA ops take it as a scalar, a
    Triton kernel cannot read host memory: KernelBench level 2's Conv2d_Min_Add_Multiply) becomes a
    get_attr of a copy of it on `device`, made once (`moved`); the original's other readers keep it."""
    if a.op != "get_attr" or a in moved.values():
        return a
    if a in moved:
        return moved[a]
    t = gm
    for part in str(a.target).split("."):
        t = getattr(t, part, None)
    if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0):
        return a
    name = base = f"{str(a.target).replace('.', '_')}_{torch.device(device).type}"
    k = 0
    while hasattr(gm, name):  # never over an attribute the module has
        k += 1
        name = f"{base}_{k}"
    setattr(gm, name, t.detach().to(device))
    with gm.graph.inserting_after(a):
        node = gm.graph.get_attr(name)
    val = a.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.to(device)
    moved[a] = node
    return node


def rewrite(gm: fx.GraphModule, matches: Sequence[Match], configs: Sequence[str]) -> int:
    """Replace each match by one call of its custom op; returns how many were replaced.

    A multi-output op is called once, before the earliest of its outputs (its matcher checks that
    every input is defined by then), and each output's users read an `operator.getitem` of it."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    # an earlier region's output may be this one's input (a residual stream through add_rmsnorm
    # after add_rmsnorm): the Match still names the node it replaced
    replaced: dict[fx.Node, fx.Node] = {}
    moved: dict[fx.Node, fx.Node] = {}
    n = 0
    for m, config in zip(matches, configs, strict=True):
        first = min(m.outputs, key=order.__getitem__)
        args = tuple(fx.node.map_arg(tuple(m.args), lambda a: replaced.get(a, a)))
        if m.workload.device != "cpu":
            args = tuple(fx.node.map_arg(args, lambda a, d=m.workload.device: on_device(gm, a, d, moved)))
        order = _hoist(graph, args, first, order)
        with graph.inserting_before(first):
            if m.views:
                args = tuple(a if v is None else _view_node(graph, a, v) for a, v in zip(args, m.views, strict=False))
            new = graph.call_function(m.op, (*args, config))
            items = [graph.call_function(operator.getitem, (new, i)) for i in range(len(m.outputs))] \
                if m.multi else [new]
            # what the op returns: each output as its first argument's view makes it (the normalized
            # tensor and the sum have that argument's shape)
            returned = [viewed(o.meta.get("val"), m.views[0] if m.views else None) for o in m.outputs]
            if m.out_view is not None:
                for item, v in zip(items, returned, strict=True):
                    item.meta["val"] = v
                op, rest = m.out_view
                items = [graph.call_function(op, (item, *rest)) for item in items]
        for item, old in zip(items, m.outputs, strict=True):
            item.meta.update({k: v for k, v in old.meta.items() if k in _META})
            old.replace_all_uses_with(item)
            replaced[old] = item
        if m.multi:
            new.meta["val"] = tuple(returned)
            new.meta.update({k: v for k, v in m.output.meta.items() if k in _META and k != "val"})
        # erase explicitly (not eliminate_dead_code): in-place ops such as nn.RMSNorm's add_
        # count as impure there and would stay behind, still computing. Only nodes left without
        # users go, latest first, so a kept node (Match.kept: read outside the region) stays, and
        # so does every region node it reads; in training autograd records their ops as before,
        # and the gradients of their inputs sum over both paths, the op's and the kept ops'.
        for node in sorted(m.nodes, key=order.__getitem__, reverse=True):  # (region nodes are not new)
            if all(dead_detach(u) for u in node.users):
                for u in list(node.users):
                    graph.erase_node(u)
                graph.erase_node(node)
        n += 1
    graph.lint()
    gm.recompile()
    return n
