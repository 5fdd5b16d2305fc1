"""What a family's matcher (plan/<family>.py) builds and the planner groups: `Match` (a region found in
a live graph, with the op call that replaces it), its plain record `Region`, `WorkloadGroup`, and
the helpers matchers use to describe views of their arguments (`static_dims`, `viewed`,
`merged_dims`, `moved_dim`) and to check that an argument can move (`late_inputs`).

Here, not in plan/__init__.py, so that the matchers (which the planner imports through the registry)
import nothing that imports them: plan -> plan.<family> -> plan.match. plan re-exports every name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import module_path
from solforge.plan.sharing import kept_nodes
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
    # a generated alternative (plan/alternatives.py): the family workload whose regions' nodes it
    # covers; it competes with that family's kernel (integrate/select.py), it is not a region of its own
    alternative_of: Workload | None = None
    # a forward family group whose nodes the generator cannot take: why (no alternative group)
    no_alternative: str | None = None
    # an alternative: the ops it took beyond the family's region that eager launched (producers only
    # the region reads; views and splits, which move no data, not counted)
    absorbed: tuple[str, ...] = ()
    # the families plan() matched with (None: every registered one): the alternatives are formed
    # beside the same regions
    families: tuple[str, ...] | None = None

    @property
    def count(self) -> int:
        return len(self.regions)


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
