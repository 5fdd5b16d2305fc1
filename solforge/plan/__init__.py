"""Plan: find kernel-family regions in ATen graphs and group them into Workloads.

One matcher per family (the registry's table, kernels/registry.py, in its order); a matcher returns
`Match`es (live graph nodes). A `Region` is the plain record of a match; regions with the same
Workload are tuned once.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import CapturedGraph, module_path
from solforge.plan.sharing import Sharing, dead_detach, kept_nodes
from solforge.records import Workload

aten = torch.ops.aten
View = tuple[Any, tuple[Any, ...]]  # (ATen op, its arguments after the tensor): see Match


@dataclass
class Match:
    """A region found in a graph: the nodes it replaces and the op call that replaces them.

    `args` are the custom op's arguments before the config string (fx Nodes for tensors,
    constants otherwise). `nodes` are the region's nodes in graph order. The outputs may have users
    outside the region, and so may pure inner nodes (a `x.float()` that other code reads too, often
    after CSE merged two copies): those stay in the graph for their readers, computed by their
    original ops with the region nodes they need (`kept`), when plan/sharing.py's rule allows it
    (pure, never written in place, cheap enough); `find_matches` drops a match it refuses.

    A family whose op returns a tuple lists every output in `outputs` (in the op's return order;
    `output` is then the first of them); a single-output family gives `output` alone. An op that
    returns more items than the region has outputs (cross_entropy's per-row logsumexp, kept only
    for its backward) says how many in `results`; its first len(outputs) items replace the outputs.

    `views` and `out_view` let a norm over other dims than the last run as one over the last:
    `views` gives, per argument, an (ATen op, its arguments after the tensor) applied to it before the
    call (None: as it is), and `out_view` one applied to each output after it. `merged_dims` makes
    those of a norm over the last k dims together (KernelBench's LayerNorm over (features, dim1,
    dim2)): merged into one, then unflattened back. `moved_dim` makes those of a norm over one
    middle dim (KernelBench's RMSNorm over `features`): moved last, then back (views both ways; the
    rmsnorm family has kernels for that layout). The family's kernels, backward and workload see
    the usual (..., H), and the workload must be the one of the arguments as viewed.
    """

    family: str
    op: Any
    output: fx.Node
    args: tuple[Any, ...]
    nodes: list[fx.Node]
    workload: Workload
    outputs: tuple[fx.Node, ...] = ()
    results: int = 0  # items the op returns, when more than the outputs (0: one per output)
    views: tuple[View | None, ...] = ()  # per argument, applied before the call (see above)
    out_view: View | None = None  # applied to each output

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = (self.output,)

    @property
    def multi(self) -> bool:
        """The op returns a tuple (one item per output, and maybe more: `results`)."""
        return len(self.outputs) > 1 or self.results > len(self.outputs)

    @property
    def inputs(self) -> list[fx.Node]:
        return [a for a in self.args if isinstance(a, fx.Node)]

    @property
    def kept(self) -> list[fx.Node]:
        """Region nodes that stay after the rewrite (shared with code outside the region)."""
        return kept_nodes(self.nodes, self.outputs)

    def region(self, graph_index: int) -> Region:
        return Region(
            family=self.family,
            graph=graph_index,
            output=self.output.name,
            outputs=tuple(n.name for n in self.outputs),
            inputs=tuple(n.name for n in self.inputs),
            nodes=tuple(n.name for n in self.nodes),
            workload=self.workload,
            module=module_path(self.outputs[-1]),  # add_rmsnorm: the norm, not the add
            kept=tuple(n.name for n in self.kept),
        )


def static_dims(sizes: Sequence[Any]) -> bool:
    """Every size a plain int (not a SymInt of a graph for many sizes): what `merged_dims` needs of
    the dims it merges (the outputs' unflatten repeats them)."""
    return all(type(d) is int for d in sizes)


def viewed(v: torch.Tensor | None, view: View | None) -> torch.Tensor | None:
    """A node's value `v` (a fake tensor) as the op sees it through `view` (a `Match.views` entry)."""
    return v if v is None or view is None else view[0](v, *view[1])


def merged_dims(args: Sequence[Any], k: int, sizes: Sequence[int]) -> dict[str, Any]:
    """Match fields for a norm over the last k dims (sizes: theirs): every tensor argument's last k
    dims merged into one, each output unflattened back. Nothing for k = 1."""
    if k <= 1:
        return {}
    return {"views": tuple((aten.flatten.using_ints, (-k, -1)) if isinstance(a, fx.Node) else None for a in args),
            "out_view": (aten.unflatten.int, (-1, list(sizes)))}


def moved_dim(args: Sequence[Any], dim: int, params: Sequence[int]) -> dict[str, Any]:
    """Match fields for a norm over dim `dim` (not the last) of its tensors: each tensor argument
    moved to the last dim, except those at `params` (a weight shaped to broadcast along `dim`:
    reshaped to 1-D), and each output moved back."""
    views = tuple(None if not isinstance(a, fx.Node) else (aten.reshape.default, ([-1],)) if i in params
                  else (aten.movedim.int, (dim, -1)) for i, a in enumerate(args))
    return {"views": views, "out_view": (aten.movedim.int, (-1, dim))}


@dataclass(frozen=True)
class Region:
    family: str
    graph: int
    output: str
    inputs: tuple[str, ...]
    nodes: tuple[str, ...]
    workload: Workload
    module: str | None = None
    outputs: tuple[str, ...] = ()  # every output's name, in the op's return order
    kept: tuple[str, ...] = ()  # region nodes that stay for readers outside it (Match.kept)


@dataclass
class WorkloadGroup:
    workload: Workload
    regions: list[Region] = field(default_factory=list)
    # one live match kept to extract the baseline subgraph that the model really runs
    example: tuple[fx.GraphModule, Match] | None = None
    # a backward group (train mode): the forward workload whose regions' backward it tunes; its
    # regions and example are the forward group's, its baseline eager autograd's backward of them
    forward: Workload | None = None

    @property
    def count(self) -> int:
        return len(self.regions)


def _matchers() -> dict[str, Callable[[fx.Graph], list[Match]]]:
    """Every forward family's matcher in first-claim-wins order: the registry's table
    (kernels/registry.py, where the order is explained)."""
    from solforge.kernels import registry

    return registry.matchers()


def find_matches(graph: fx.Graph, families: Sequence[str] | None = None) -> list[Match]:
    matches: list[Match] = []
    claimed: set[fx.Node] = set()
    sharing = Sharing(graph)
    for family, matcher in _matchers().items():
        if families is not None and family not in families:
            continue
        # the generated matcher forms its regions over the nodes the families left (plan/generated.py)
        found = matcher(graph, frozenset(claimed)) if family == "generated" else matcher(graph)
        for m in found:
            # a node belongs to one region at most (kept ones too: one region stands for its time);
            # inner nodes read outside the region must be ones it may keep (plan/sharing.py)
            if claimed.isdisjoint(m.nodes) and sharing.allows(m.nodes, m.outputs, m.inputs):
                claimed.update(m.nodes)
                matches.append(m)
    return matches


def plan(graphs: Sequence[CapturedGraph], families: Sequence[str] | None = None) -> list[WorkloadGroup]:
    """Every region in every graph, grouped by workload, in first-seen order."""
    groups: dict[Workload, WorkloadGroup] = {}
    for g in graphs:
        for m in find_matches(g.aten.graph, families):
            group = groups.setdefault(m.workload, WorkloadGroup(m.workload))
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


def late_inputs(node: fx.Node, before: fx.Node, order: Mapping[fx.Node, int]) -> list[fx.Node] | None:
    """`node` and what it depends on that sits at or after `before` (graph positions in `order`), in
    graph order, if all of it can move to just before `before`: pure call_function nodes that do not
    depend on `before`. [] if `node` already comes earlier; None if it cannot move.

    A multi-output op is called before its first output, but an argument may be computed later: Gemma's
    RMSNorm weight `1.0 + self.weight.float()` is computed inside the norm, after the residual add that
    add_rmsnorm replaces. Matchers check with this that `rewrite` can hoist such arguments."""
    pos = order[before]
    late: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or order[n] < pos:
            continue
        seen.add(n)
        if n is before or n.op != "call_function" or n.is_impure():
            return None
        late.append(n)
        stack.extend(n.all_input_nodes)
    return sorted(late, key=order.__getitem__)


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


def rewrite(gm: fx.GraphModule, matches: Sequence[Match], configs: Sequence[str]) -> int:
    """Replace each match by one call of its custom op; returns how many were replaced.

    A multi-output op is called once, before the earliest of its outputs (its matcher checks that
    every input is defined by then), and each output's users read an `operator.getitem` of it."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    # an earlier region's output may be this one's input (a residual stream through add_rmsnorm
    # after add_rmsnorm): the Match still names the node it replaced
    replaced: dict[fx.Node, fx.Node] = {}
    n = 0
    for m, config in zip(matches, configs, strict=True):
        first = min(m.outputs, key=order.__getitem__)
        args = tuple(fx.node.map_arg(tuple(m.args), lambda a: replaced.get(a, a)))
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
