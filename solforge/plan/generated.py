"""Generated regions: every memory-bound region no kernel family claimed, as a `solforge::generated` call.

After the family matchers (plan._matchers: this one is last), codegen.regions.form_regions runs over
the nodes they left; each region worth a kernel becomes a Match of the "generated" family, whose op
takes the region's inputs as one list and its key (the kernel comes from kernels/generated.py).

Composite ops the capture leaves whole (native_group_norm, native_batch_norm, mse_loss, ...) are
decomposed into their pointwise and reduction pieces (torch._decomp's table, traced with make_fx)
so that they form regions too, but only in a scratch copy of the graph: the real graph is not
touched unless a region is swapped in. A region may take such an op only whole (every live piece
of its decomposition inside), and then replaces the original node and its getitems; an op whose
decomposition is not all fusible (BatchNorm in training: the running statistics are updated by
copy_, a mutation, an anchor) is left whole, as the model ran it. A region that took it half would
need the other half written into the real graph as eager ops, slower than the composite if its
kernel is ever kept out.

A region must be worth a kernel (`worth`): at least one compute op; two ops eager launches or one
that reduces (a reduction or a composite, where eager's kernel is not the copy roofline) or one copy
that changes which dim is contiguous (`relayouts`: eager's copy is not the copy roofline either); and at
least MIN_BYTES read and written. Its outputs must be floating point (the verifier poisons them with
NaN) and laid out as the graph's values are; its inputs must be computable before its first output
(the op is called there), and no value its nodes read may be written in place between
where a node reads it and that call (`stale_reads`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from solforge.capture import op_name
from solforge.codegen import regions as RG
from solforge.plan import Match, late_inputs

aten = torch.ops.aten

# Below this many bytes read and written a region is scalar bookkeeping (BatchNorm's
# num_batches_tracked + 1, a loss's final scale, a (B,) mask cast): its time, eager or fused, is
# the launch (a few µs), which CUDA-graph replay (runtime/stepgraphs.py) already hides in small
# steps, while its tuning costs a build and a verification per candidate and per distinct shape.
MIN_BYTES = 4096
# A region that is one copy changing the layout (`relayouts`) and nothing else: below this many
# bytes read and written (a convolution's weight made channels-last: 0.6 MB in KernelBench level
# 2's first row, 5.1 µs in ATen against 4.6 in a kernel) the saving is not worth a workload to tune.
RELAYOUT_MIN_BYTES = 1 << 20

_COMPOSITES = (aten.native_layer_norm, aten.native_group_norm, aten.native_batch_norm,
               aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
               aten._native_batch_norm_legit_functional, aten.cudnn_batch_norm, aten.mse_loss,
               aten.smooth_l1_loss, aten.huber_loss,
               aten.binary_cross_entropy, aten.binary_cross_entropy_with_logits, aten.kl_div,
               aten.hinge_embedding_loss, aten.soft_margin_loss, aten.norm, aten.addcmul, aten.addcdiv, aten.lerp)
_CASTS = {"aten._to_copy.default", "prims.convert_element_type.default", "aten.clone.default",
          "aten.lift_fresh_copy.default"}


def _group_norm(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, n: int, c: int, hw: int,
                group: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """native_group_norm written so its pieces form one region: statistics over (N, G, C/G * HW),
    the normalized value as a reshape of that loop, the affine per channel broadcast over it
    (torch's own decomposition makes a per-(N, C) scale and shift first, which no loop stores)."""
    xg = x.reshape(n, group, -1)
    var, mean = torch.var_mean(xg, dim=-1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = ((xg - mean) * rstd).reshape(x.shape)
    shape = (1, c) + (1,) * (x.dim() - 2)
    if w is not None:
        y = y * w.reshape(shape)
    if b is not None:
        y = y + b.reshape(shape)
    return y, mean.reshape(n, group), rstd.reshape(n, group)


@functools.cache
def _table() -> dict[Any, Any]:
    table = get_decompositions(list(_COMPOSITES))
    table[aten.native_group_norm.default] = _group_norm
    return table


@dataclass
class GeneratedMatch(Match):
    """A generated region: `args` = (the input nodes as one list, the region's key); the op always
    returns a list (one item per output)."""

    @property
    def inputs(self) -> list[fx.Node]:
        return list(self.args[0])

    @property
    def multi(self) -> bool:
        return True


@dataclass
class _Scratch:
    """A copy of the graph with the unclaimed composites decomposed, and where its nodes come from."""

    graph: fx.Graph
    origin: dict[fx.Node, fx.Node]  # scratch node -> the original node it stands for
    pieces: dict[fx.Node, list[fx.Node]]  # original composite -> its live pieces in the scratch graph
    items: dict[fx.Node, fx.Node]  # a piece that is a composite's result -> the original node of that result


def _contiguous(shape: Any, stride: Any) -> bool:
    expect = 1
    for n, s in reversed(list(zip(shape, stride, strict=True))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _as_views(sub: fx.GraphModule) -> None:
    """as_strided of a contiguous value with contiguous strides (GroupNorm's decomposition) is a view."""
    for n in sub.graph.nodes:
        if n.target is aten.as_strided.default and (len(n.args) == 3 or n.args[3] in (0, None)):
            src = n.args[0].meta.get("val")
            size, stride = n.args[1], n.args[2]
            if isinstance(src, torch.Tensor) and src.is_contiguous() and _contiguous(size, stride) \
                    and src.numel() == torch.Size(size).numel():
                n.target, n.args = aten.view.default, (n.args[0], list(size))


def _decompose(graph: fx.Graph, node: fx.Node) -> fx.GraphModule | None:
    """The decomposition of one composite node, traced on its fake values (None: it cannot be)."""
    flat: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), flat.append)
    vals = [a.meta.get("val") for a in flat]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    mode = detect_fake_mode(vals)
    if mode is None:
        return None
    index = {a: i for i, a in enumerate(flat)}

    def call(*xs: Any) -> Any:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: xs[index[a]])
        return node.target(*args, **kwargs)  # type: ignore[operator]

    try:
        with mode:
            sub = make_fx(call, decomposition_table=_table(), tracing_mode="real")(*vals)
    except Exception:  # noqa: BLE001 - a decomposition that does not trace leaves the op whole
        return None
    _as_views(sub)
    return sub


def scratch(graph: fx.Graph, claimed: Collection[fx.Node]) -> tuple[_Scratch, set[fx.Node]]:
    """The scratch graph, and the scratch copies of the claimed nodes."""
    g = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(graph, val_map)
    g.output(out)
    origin = {v: k for k, v in val_map.items()}
    table = _table()
    pieces: dict[fx.Node, list[fx.Node]] = {}
    items: dict[fx.Node, fx.Node] = {}
    for orig in list(graph.nodes):
        if orig.op != "call_function" or orig in claimed or orig.target not in table:
            continue
        if isinstance(orig.meta.get("val"), (tuple, list)) and any(u.target is not operator.getitem
                                                                    for u in orig.users):
            continue
        node = val_map[orig]
        sub = _decompose(g, node)
        if sub is None:
            continue
        env: dict[fx.Node, fx.Node] = {}
        placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
        flat: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), flat.append)
        env.update(zip(placeholders, flat, strict=True))
        new: list[fx.Node] = []
        result: Any = None
        with g.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op == "call_function":
                    env[n] = g.node_copy(n, env.__getitem__)
                    new.append(env[n])
                elif n.op == "output":
                    result = fx.node.map_arg(n.args[0], env.__getitem__)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        if not isinstance(orig.meta.get("val"), (tuple, list)):
            node.replace_all_uses_with(results[0])
            if results[0] in new:
                items[results[0]] = orig
        else:
            for u in list(node.users):
                if u.target is operator.getitem:
                    r = results[u.args[1]]
                    u.replace_all_uses_with(r)
                    if r in new and r not in items:
                        items[r] = origin[u]
                    g.erase_node(u)
        g.erase_node(node)
        # the pieces nothing reads (BatchNorm's empty saved statistics in eval mode) go
        erased: set[fx.Node] = set()
        for n in reversed(new):
            if not n.users and n.target is not operator.getitem and not n.target._schema.is_mutable:  # type: ignore[union-attr]
                g.erase_node(n)
                erased.add(n)
            elif not n.users and n.target is operator.getitem:
                g.erase_node(n)
                erased.add(n)
        live = [n for n in new if n not in erased]
        for n in live:
            origin[n] = orig
        pieces[orig] = live
    return _Scratch(g, origin, pieces, items), {val_map[c] for c in claimed if c in val_map}


def _bytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _launches(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is not operator.getitem and not RG._is_view(n)


def _order(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of `t` of size > 1, outermost in memory first."""
    dims = [i for i in range(t.dim()) if t.shape[i] != 1]
    return tuple(sorted(dims, key=lambda i: -t.stride(i)))


def relayouts(n: fx.Node) -> bool:
    """A copy that changes which dim is contiguous (a clone to channels-last, a contiguous() of a
    transposed view): eager's copy kernel reads or writes one side with a stride, while a tiled
    generated kernel reads and writes both coalesced (on an H100, an NCHW -> NHWC clone of a 537 MB
    input took 0.58 ms in ATen, 0.25 ms in Inductor's tiled kernel; 2026-11-27). A copy that keeps
    the innermost dim (attention's [B, H, S, D] -> [B, S, H, D]) is a plain row copy for eager too."""
    if not (_launches(n) and op_name(n.target) in _CASTS and n.args and isinstance(n.args[0], fx.Node)):
        return False
    a, o = n.args[0].meta.get("val"), n.meta.get("val")
    if not (isinstance(a, torch.Tensor) and isinstance(o, torch.Tensor) and a.shape == o.shape):
        return False
    ia, io = _order(a), _order(o)
    return bool(ia) and bool(io) and ia[-1] != io[-1]


_MAX_POOLS = {"aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default"}


def drops_indices(nodes: Collection[fx.Node]) -> bool:
    """A max pool whose indices nothing reads: eager's kernel writes them anyway (int64, 8 bytes a
    point beside the value's 4), a generated one does not, so even alone it moves a third less.
    Views of the indices that nothing reads (a 1-D pool's squeeze of them) read nothing."""
    return any(_launches(n) and op_name(n.target) in _MAX_POOLS
               and not any(u.target is operator.getitem and u.args[1] == 1 and _read(u) for u in n.users)
               for n in nodes)


_AVG_POOLS = {"aten.avg_pool2d.default", "aten.avg_pool3d.default"}


def averages_windows(nodes: Collection[fx.Node]) -> bool:
    """An average pool: eager's kernel is not one pass at bandwidth where windows overlap (each
    point's window bounds and divisor worked out alone; level 1's 44, a 1-D pool of 8 at stride 1
    over 64 x 128 x 65536: eager 5,449 us, torch.compile 1,642, H200, 2026-11-28), so alone it is
    worth a kernel; the tuner keeps the generated one only where it measured it faster."""
    return any(_launches(n) and op_name(n.target) in _AVG_POOLS for n in nodes)


def _read(n: fx.Node) -> bool:
    """Whether anything reads `n`'s value: a user that is no view, or a view something reads."""
    return any(u.op != "call_function" or not RG._is_view(u) or _read(u) for u in n.users)


def worth(fr: RG.Formed, originals: list[fx.Node], composite: bool) -> str | None:
    """Why a region is not worth a kernel (None: it is)."""
    moves = any(relayouts(n) for n in fr.nodes)
    if not moves and not any(_launches(n) and op_name(n.target) not in _CASTS for n in fr.nodes):
        return "no compute op"
    reduces = fr.lowered.reduces
    if sum(_launches(n) for n in originals) < 2 and not (reduces or composite or moves or drops_indices(originals)
                                                       or averages_windows(originals)):
        return "one pointwise op: eager's kernel is already one pass"
    size = sum(_bytes(a.meta.get("val")) for a in fr.inputs) + sum(_bytes(o.meta.get("val")) for o in fr.outputs)
    if size < MIN_BYTES:
        return f"{size} bytes"
    lone = moves and not any(_launches(n) and op_name(n.target) not in _CASTS for n in fr.nodes)
    if lone and size < RELAYOUT_MIN_BYTES:
        return f"a copy of {size} bytes into another layout"
    return None


def stale_reads(graph: fx.Graph, nodes: list[fx.Node], outputs: list[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Would the region's op, called just before its earliest output (plan.rewrite), read a value
    other than its nodes read in the graph? So it would if a value a region node reads (an input,
    or one the region computes) is written in place between that node's position and the call's,
    on either side; or if anything of unknown effect is called within the region's span. A write
    that every reader of the value and the call sit after (T5's relative position buckets,
    `buckets += where(...)` before the embedding lookup that reads them and the attention scores
    the lookup's bias is added to) changes nothing."""
    from solforge.capture.cse import alias_analysis

    lo, hi = order[nodes[0]], order[nodes[-1]]
    between = [n for n in graph.nodes if lo < order[n] < hi and n.op == "call_function"]
    if any(not isinstance(n.target, torch._ops.OpOverload) and n.target is not operator.getitem for n in between):
        return True
    writers = [n for n in between if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
    if not writers:
        return False
    analysis = alias_analysis(graph)
    if analysis is None:
        return True
    aliases, written = analysis
    call = order[min(outputs, key=order.__getitem__)]
    for w in writers:
        roots = {aliases.find(a) for a in w.all_input_nodes if a in written}
        for n in nodes:
            if min(order[n], call) < order[w] < max(order[n], call) and \
                    any(aliases.find(a) in roots for a in n.all_input_nodes):
                return True
    return False


def match(graph: fx.Graph, claimed: Collection[fx.Node] = frozenset()) -> list[Match]:
    from solforge.integrate.embeddings import takes
    from solforge.kernels.generated import generated_op, workload_for

    # a training graph's trainable embedding stays integrate/embeddings.py's: its backward adds the
    # looked-up rows into .grad in place, where a generated region's (a gather's vjp: the eager
    # vjp) would build the dense V x H gradient
    kept = {n for n in graph.nodes if takes(graph.owning_module, n)}  # type: ignore[arg-type]
    sc, excluded = scratch(graph, {*claimed, *kept})
    order = {n: i for i, n in enumerate(graph.nodes)}
    out: list[Match] = []
    for fr in RG.form_regions(sc.graph, excluded):
        m = _to_match(fr, sc, graph, order)
        if isinstance(m, str):
            continue
        nodes, inputs, outputs, composite = m
        if worth(fr, [n for n in nodes], composite) is not None:
            continue
        if stale_reads(graph, nodes, outputs, order):
            continue
        wl = workload_for(fr.lowered.ir)
        out.append(GeneratedMatch(family="generated", op=generated_op, output=outputs[0],
                                  args=(inputs, wl.param("key")), nodes=nodes, workload=wl,
                                  outputs=tuple(outputs)))
    return out


def _to_match(fr: RG.Formed, sc: _Scratch, graph: fx.Graph,
              order: dict[fx.Node, int]) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node], bool] | str:
    """The region's original nodes, inputs and outputs (or why it has none in the real graph)."""
    inside = set(fr.nodes)
    touched = {sc.origin[n] for n in fr.nodes if sc.origin.get(n) in sc.pieces}
    for c in touched:
        if not all(p in inside for p in sc.pieces[c]):
            return f"takes part of {c.name}"
    nodes: set[fx.Node] = set()
    for n in fr.nodes:
        o = sc.origin.get(n)
        if o is None:
            return f"{n.name} has no original"
        nodes.add(o)
    for c in touched:
        nodes |= {c, *(u for u in c.users if u.target is operator.getitem)}
    inputs, outputs = [], []
    for a in fr.inputs:
        o = _original(a, sc)
        if o is None:
            return f"reads an inner value of a composite ({a.name})"
        inputs.append(o)
    for a in fr.outputs:
        o = _original(a, sc)
        if o is None:
            return f"returns an inner value of a composite ({a.name})"
        v, w = o.meta.get("val"), a.meta.get("val")
        # an integer or bool output (argmax's indices, a mask) is stored as it is: verified exactly
        if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor)) \
                or v.dtype != w.dtype or v.shape != w.shape or (v.numel() > 1 and v.stride() != w.stride()):
            return f"output {o.name} is not stored as the graph holds it"
        outputs.append(o)
    first = min(outputs, key=order.__getitem__)
    if any(late_inputs(a, first, order) is None for a in inputs):
        return "an input is computed after the region's first output"
    return sorted(nodes, key=order.__getitem__), inputs, outputs, bool(touched)


def _original(a: fx.Node, sc: _Scratch) -> fx.Node | None:
    """The original node holding scratch value `a` (None: an inner value of a decomposed op)."""
    if a in sc.items:
        return sc.items[a]
    o = sc.origin.get(a)
    return None if o is None or o in sc.pieces else o
