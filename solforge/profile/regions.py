"""Cut an ATen graph into profile regions, cost them (bytes, FLOPs), and mark them for the profiler.

Every call node belongs to exactly one region: a kernel family's match (plan.find_matches), a
pseudo-family (kinds.py), or the group of the remaining nodes with the same module path and kind.
View nodes launch nothing and join a region of their module path. `annotate` wraps each run of
consecutive nodes of one region in a profiler range named `solforge:<id>|...`, so every kernel
launched inside it is attributed to the region (trace.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import module_path
from solforge.numerics import dtype_name
from solforge.plan import find_matches
from solforge.profile.kinds import PSEUDO_KIND, VIEW, family_kind, node_kind, pseudo_matches

PREFIX = "solforge:"
STEP = PREFIX + "step"


@dataclass
class Region:
    """One region instance in one graph (live nodes; not a record)."""

    id: int
    graph: int
    family: str
    kind: str
    module: str
    nodes: list[fx.Node]
    workload: str | None = None
    bytes: int = 0
    flops: int = 0
    dtype: str = ""
    label: str = ""
    key: str = ""
    compute: list[fx.Node] = field(default_factory=list)  # the nodes that launch kernels


_LAYER = re.compile(r"\.\d+(?=\.|$)")


def fold_layers(path: str) -> str:
    """model.layers.3.self_attn.q_norm -> model.layers.*.self_attn.q_norm (repeats share a row)."""
    return _LAYER.sub(".*", path)


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def nbytes(node: fx.Node) -> int:
    """Bytes a kernel must touch to read or write this value: its elements, but no more than its
    storage (an expanded/broadcast view reads its small storage once)."""
    v = _val(node)
    if v is None:
        return 0
    n = v.numel() * v.element_size()
    try:
        n = min(n, int(v.untyped_storage().nbytes()))
    except Exception:  # fake tensors without a storage size: the element count stands
        pass
    return int(n)


def _arg(node: fx.Node, name: str, default: Any) -> Any:
    """An argument by its schema name, passed by keyword or by position."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    for i, a in enumerate(getattr(schema, "arguments", ())):
        if a.name == name and i < len(node.args):
            return node.args[i]
    return default


def node_flops(node: fx.Node) -> int:
    """FLOPs of a node from its shapes: matmuls and attention exactly (multiply-add = 2), the
    elementwise rest as one per element, copies none."""
    t, args = node.target, node.args
    out = _val(node)
    name = getattr(getattr(t, "_overloadpacket", None), "__name__", "")
    if name in ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_scaled_mm", "_int_mm"):
        a = _val(args[1] if name in ("addmm", "baddbmm") else args[0])
        if a is None or out is None:
            return 0
        k = int(a.shape[-1])
        return 2 * out.numel() * k + (out.numel() if name in ("addmm", "baddbmm") else 0)
    if "attention" in name and len(args) >= 3:
        q, k = _val(args[0]), _val(args[1])
        if q is None or k is None or q.dim() < 2:
            return 0
        sq, d, sk = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2])
        heads = math.prod(int(s) for s in q.shape[:-2])
        dv = int(_val(args[2]).shape[-1]) if _val(args[2]) is not None else d  # type: ignore[union-attr]
        causal = bool(_arg(node, "is_causal", False))
        f = 2 * heads * sq * sk * (d + dv)  # QK^T and PV
        return f // 2 if causal and sq == sk else f
    # elementwise arithmetic, roughly one FLOP per element (what puts memory-bound work at the
    # far left of a roofline instead of off the chart)
    kind = node_kind(node)
    if kind == "pointwise" and out is not None:
        return out.numel()
    if kind == "reduction" and (src := _val(args[0]) if args else None) is not None:
        return src.numel()
    if kind == "normalization" and out is not None:
        return 4 * out.numel()
    return 0


def _consumers(node: fx.Node) -> list[fx.Node]:
    """Users of a value, looking through views (a view's users read the same memory)."""
    out: list[fx.Node] = []
    for u in node.users:
        if u.op == "call_function" and node_kind(u) == VIEW:
            out += _consumers(u) or [u]
        else:
            out.append(u)
    return out


def _producer(node: fx.Node) -> fx.Node:
    """The value behind a chain of views (what a kernel really reads)."""
    while node.op == "call_function" and node_kind(node) == VIEW and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def cost(nodes: Sequence[fx.Node]) -> tuple[int, int, list[fx.Node], list[fx.Node]]:
    """(bytes, flops, inputs, outputs) of a region: inputs from outside are read once, values used
    outside (or returned) are written once; views count as the memory they alias."""
    compute = [n for n in nodes if node_kind(n) != VIEW]
    inside = set(compute)
    inputs: dict[fx.Node, None] = {}
    for n in compute:
        for a in n.all_input_nodes:
            if a not in inside and _producer(a) not in inside:
                inputs[a] = None
    outputs = [n for n in compute if any(u not in inside for u in _consumers(n)) or not n.users]
    flops = sum(node_flops(n) for n in compute)
    return sum(nbytes(a) for a in inputs) + sum(nbytes(o) for o in outputs), flops, list(inputs), outputs


def _label(inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> tuple[str, str]:
    vals = [v for v in (_val(n) for n in [*outputs, *inputs]) if v is not None]
    if not vals:
        return "", ""
    big = max(vals[: len(outputs)] or vals, key=lambda v: v.numel())
    return "x".join(str(int(d)) for d in big.shape) + f" {dtype_name(big.dtype)}", dtype_name(big.dtype)


def partition(graph: fx.Graph, graph_index: int, first_id: int = 0,
              families: Sequence[str] | None = None) -> list[Region]:
    """Every call node of `graph` in exactly one Region (ids from `first_id`, in graph order)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    regions: list[Region] = []
    claimed: set[fx.Node] = set()
    for m in find_matches(graph, families):
        claimed.update(m.nodes)
        regions.append(Region(0, graph_index, m.family, family_kind(m.family) or "other",
                              module_path(m.output) or "", list(m.nodes), workload=m.workload.key))
    merged: dict[tuple[str, str], Region] = {}
    for pm in pseudo_matches(graph, claimed):
        mod = module_path(pm.nodes[-1]) or ""
        # RoPE on q and on k in one attention module is one application (36 in a 36-layer model)
        if pm.family == "rope" and (pm.family, mod) in merged:
            merged[(pm.family, mod)].nodes += pm.nodes
            continue
        r = Region(0, graph_index, pm.family, PSEUDO_KIND[pm.family], mod, list(pm.nodes))
        regions.append(r)
        merged.setdefault((pm.family, mod), r)
    groups: dict[tuple[str, str], Region] = {}  # (module, kind)
    views: list[fx.Node] = []
    for n in graph.nodes:
        if n.op != "call_function" or n in claimed:
            continue
        kind = node_kind(n)
        if kind == VIEW:
            views.append(n)
            continue
        mod = module_path(n) or ""
        target = getattr(n.target, "solforge_op", n.target)  # the op a direct call stands for (kernels/direct.py)
        if getattr(target, "namespace", "") == "solforge":
            # a swapped-in op (an optimized model) is one region of its family on its own: one
            # module can hold two (add_rmsnorm after attention and after the MLP)
            family = getattr(getattr(target, "_overloadpacket", None), "__name__", kind)
            regions.append(Region(0, graph_index, family, kind, mod, [n]))
            continue
        r = groups.get((mod, kind))
        if r is None:
            r = groups[(mod, kind)] = Region(0, graph_index, kind, kind, mod, [])
            regions.append(r)
        r.nodes.append(n)
    by_module: dict[str, Region] = {}
    for r in regions:
        by_module.setdefault(r.module, r)
    for n in views:  # a view launches nothing: it rides with any region of its module
        mod = module_path(n) or ""
        r = by_module.get(mod)
        if r is None:
            r = by_module[mod] = Region(0, graph_index, VIEW, "other", mod, [])
            regions.append(r)
        r.nodes.append(n)
    regions.sort(key=lambda r: min((order[n] for n in r.nodes), default=0))
    for i, r in enumerate(regions):
        r.id = first_id + i
        r.nodes.sort(key=order.__getitem__)
        r.bytes, r.flops, ins, outs = cost(r.nodes)
        r.compute = [n for n in r.nodes if node_kind(n) != VIEW]
        r.label, r.dtype = _label(ins, outs)
        r.key = r.workload or f"{r.family}|{fold_layers(r.module)}|{r.label}|{r.bytes}|{r.flops}"
    return regions


# ----------------------------------------------------------------------------------------------
# profiler ranges in the graph


def range_enter(name: str) -> Any:
    rf = torch.autograd.profiler.record_function(name)
    rf.__enter__()
    return rf


def range_exit(rf: Any) -> None:
    rf.__exit__(None, None, None)


def range_name(r: Region) -> str:
    return f"{PREFIX}{r.id}|{r.family}|{r.module}"


def annotate(gm: fx.GraphModule, regions: Sequence[Region]) -> fx.GraphModule:
    """Wrap each run of consecutive nodes of one region in a profiler range (in place). The graph
    runs in node order, so a range encloses exactly the ops of its run (and the kernels they launch)."""
    owner = {n: r for r in regions for n in r.nodes}
    runs: list[tuple[Region, fx.Node, fx.Node]] = []
    for n in gm.graph.nodes:
        r = owner.get(n)
        if r is None:
            continue
        if runs and runs[-1][0] is r and runs[-1][2].next is n:
            runs[-1] = (r, runs[-1][1], n)
        else:
            runs.append((r, n, n))
    for r, first, last in runs:
        with gm.graph.inserting_before(first):
            handle = gm.graph.call_function(range_enter, (range_name(r),))
        with gm.graph.inserting_after(last):
            gm.graph.call_function(range_exit, (handle,))
    gm.recompile()
    return gm
