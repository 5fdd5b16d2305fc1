"""Common-subexpression elimination on a lowered ATen graph: an op repeated with the same inputs runs once.

A model that writes `x.float()` twice (or `cos.unsqueeze(1)` in every layer, `gate.float()` in
two places) traces to two identical ATen nodes, and the matchers, which follow one cast feeding
both the square and the multiply of an RMSNorm, see two unrelated chains. Merging the copies
gives every spelling the same canonical graph (docs/design.md, Capture and integration: every way
of writing an op becomes the same canonical ops), and the graph that runs computes each such value once.

Two nodes merge when they call the same ATen op with the same arguments (the same nodes, the same
constants of the same type, lists compared item by item) and the same keyword arguments; the
first one stays, with its metadata (module path, stack trace). The first is earlier in the graph,
so it is defined wherever the second was used. Conservative on purpose, a node is never merged if:

- its op is not a functional ATen op (a mutable schema: in-place, `out=`), returns nothing, is
  seeded-random (`torch.Tag.nondeterministic_seeded`: rand, dropout, bernoulli...: two draws must
  stay two draws) or is impure by fx's own rules;
- its output, or any tensor it reads, may share memory with a tensor that is written in place
  anywhere in the graph (an input read before and after a write differs; a result written through
  one name would change under the other), or that leaves the graph (the caller may write to one
  output and expect another, once a separate tensor, unchanged). Memory sharing is followed through
  the ops' alias annotations (views, `Tensor(a)`), the few ops whose schema hides that they return
  a view (`_UNANNOTATED_VIEWS`), tuple items, and graph inputs (which may alias each other).

A graph holding anything but ATen ops and `getitem` (a call of some other callable, a submodule
or a method, whose effects are unknown) is left alone.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

# ops whose schema declares a fresh result although they return a view of their first argument
_UNANNOTATED_VIEWS = {aten._unsafe_view.default, aten.unsafe_chunk.default, aten.unsafe_split.Tensor,
                      aten.unsafe_split_with_sizes.default, aten.lift.default}


class _Unkeyable(Exception):
    """An argument CSE cannot compare exactly (a SymInt, a tensor, an unknown object)."""


_PLAIN = (bool, int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key(a: Any) -> Any:
    """A hashable value equal for two arguments exactly when they mean the same: 1, 1.0 and True are
    equal in Python but promote differently, and 0.0 == -0.0 although they multiply differently."""
    if isinstance(a, fx.Node):
        return ("node", a)
    if type(a) is float:
        return (float, a.hex())  # bit-exact: -0.0 and 0.0 differ, nan equals nan
    if type(a) in _PLAIN:
        return (type(a), a)
    if isinstance(a, list | tuple):
        return ("list" if isinstance(a, list) else "tuple", tuple(_key(x) for x in a))
    raise _Unkeyable(type(a).__name__)


@functools.cache
def _annotated_args(op: torch._ops.OpOverload) -> tuple[tuple[int, str, bool, bool, bool], ...]:
    """(position, name, keyword-only, written, may be returned) of each argument of `op` with an alias
    annotation (per op, not per node: a graph calls the same few ops thousands of times)."""
    schema = op._schema
    returned = {s for r in schema.returns if r.alias_info is not None for s in r.alias_info.before_set}
    return tuple((i, a.name, a.kwarg_only, a.alias_info.is_write, bool(returned & set(a.alias_info.before_set)))
                 for i, a in enumerate(schema.arguments) if a.alias_info is not None)


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


class _Aliases:
    """Union-find over nodes: two nodes in one set may share memory."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}

    def find(self, n: fx.Node) -> fx.Node:
        root = n
        while (p := self.parent.get(root, root)) is not root:
            root = p
        while n is not root:  # path compression
            self.parent[n], n = root, self.parent.get(n, n)
        return root

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra


def alias_analysis(graph: fx.Graph) -> tuple[_Aliases, set[fx.Node]] | None:
    """(alias sets, nodes written in place), or None if some node's effects are unknown."""
    aliases = _Aliases()
    written: set[fx.Node] = set()
    sources: list[fx.Node] = []  # graph inputs and constants: they may alias each other
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            sources.append(node)
            continue
        if node.op == "output":
            continue
        if node.op != "call_function":
            return None
        if node.target is operator.getitem:
            if not isinstance(node.args[0], fx.Node):
                return None
            aliases.union(node, node.args[0])  # an item shares memory with the tuple's producer
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            return None
        for i, name, kwarg_only, is_write, is_returned in _annotated_args(node.target):
            value = node.args[i] if i < len(node.args) and not kwarg_only else node.kwargs.get(name)
            nodes = _nodes_in(value)
            if is_write:
                written.update(nodes)
            if is_returned:
                for n in nodes:
                    aliases.union(node, n)
        if node.target in _UNANNOTATED_VIEWS and node.args and isinstance(node.args[0], fx.Node):
            aliases.union(node, node.args[0])
    roots = {aliases.find(n) for n in written}
    if sources and roots & {aliases.find(s) for s in sources}:
        for s in sources[1:]:
            aliases.union(sources[0], s)
    return aliases, written


@functools.cache
def _mergeable_op(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    # fx's impurity test of an ATen call looks at the op alone (side-effectful ops, effect tokens)
    probe = fx.Graph().call_function(op)
    return op.namespace == "aten" and not schema.is_mutable and bool(schema.returns) \
        and torch.Tag.nondeterministic_seeded not in op.tags and not probe.is_impure()


def mergeable(node: fx.Node) -> bool:
    """A pure node: a getitem, or a functional, deterministic ATen op (plan.sharing keeps such nodes too)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and _mergeable_op(node.target)


def eliminate_common_subexpressions(gm: fx.GraphModule) -> int:
    """The pass described in the module docstring; returns how many nodes it removed."""
    graph = gm.graph
    analysis = alias_analysis(graph)
    if analysis is None:
        return 0
    aliases, written = analysis
    tainted = {aliases.find(n) for n in written}
    for node in graph.nodes:
        if node.op == "output":
            tainted.update(aliases.find(n) for n in node.all_input_nodes)

    seen: dict[Any, fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if not mergeable(node):
            continue
        if aliases.find(node) in tainted or any(aliases.find(n) in tainted for n in node.all_input_nodes):
            continue
        try:
            key = (node.target, _key(node.args), tuple(sorted((k, _key(v)) for k, v in node.kwargs.items())))
        except _Unkeyable:
            continue
        first = seen.setdefault(key, node)
        if first is node:
            continue
        # the inputs of later nodes now name `first`, so their own copies get equal keys in turn
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        removed += 1
    if removed:
        graph.lint()
        gm.recompile()
    return removed
