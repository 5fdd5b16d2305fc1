"""The backward of a generated region, derived: its vjp traced to ATen and formed into regions.

For a forward region (ir.RegionIR) and which of its inputs need a gradient and which of its outputs
receive one, `trace` runs the region's own ops (reference.replay) and torch.autograd.grad under
make_fx, on fake tensors laid out as the region's inputs: an ATen graph whose inputs are the saved
forward inputs and the output gradients, and whose outputs are the input gradients (autograd has
already summed them over broadcast dims and cast them to each input's dtype). Autograd's backward
ops (`_softmax_backward_data`, `sigmoid_backward`, `native_layer_norm_backward`, ...) are
decomposed with torch's core ATen table where the generator has no lowering of its own, so the
graph holds only ops the former knows. The forward's values the backward needs are recomputed
inside it: saving the forward inputs is the schedule's default choice (recompute).

`derive` forms that graph's regions. When every op of the vjp is one region whose inputs are graph
inputs and whose outputs are the gradients, the backward is that region: one generated kernel, its
key stored by store.save (a gradient that is an input of the vjp unchanged, dy of a residual add, is
passed through without a kernel). Otherwise (the common case in training: a norm's weight gradient
sums over the rows while the input's is a row-wise computation, a bias next to a row reduction:
two loop spaces) the graph is formed into several regions by codegen.regions.form_regions, regions
of one loop space that do not depend on each other merged (LayerNorm's weight and bias gradients,
both sums over the rows, are one kernel), and each region is a kernel with its own key, run in
topological order with its intermediates (LayerNorm's dy * x_hat, read by the weight gradient's
sum) as plain tensors between them, a bf16/fp16 one held in fp32 (`_widen`). A vjp holding an op
no region takes (an anchor), or a value outside every region, gives a BackwardPlan with `error`
saying why, and the op falls back to the eager vjp of the region's ops (kernels/generated.py): in
particular a gather's vjp (x[idx], gather, index_select, embedding), a scatter-add into the source
that is not generated (the plan's error says so); a vjp that only gathers (the gradient of what
multiplies a looked-up row) is generated like any.
Failures are data: nothing here raises for a region the generator cannot take.

Tuning: one config per backward, a schedule of its `main` kernel (the one with the largest loop,
the first of those: a norm's row-wise dx kernel); the others run their heuristic schedule. The
contract's Config and the database's configs stay one codegen.schedule.Schedule, and the main
kernel carries most of the time; verification (kernels/generated_bwd.py) covers every kernel of the
backward together against fp64 autograd of the forward region's ops.

A plan depends only on (forward key, masks), so every process derives the same one; each is made
once per process (`plan`).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._decomp import core_aten_decompositions
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from solforge.capture import op_name
from solforge.codegen import ir as IRM
from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import store
from solforge.codegen.ir import RegionIR, TensorMeta
from solforge.codegen.lower import LOWERINGS, Lowered, LowerError, prepare

# where a value comes from: ("saved", i) forward input i; ("grad", j) the gradient of forward output j;
# ("out", v) value v of the backward kernels' outputs, numbered over the kernels in order (kernel 0's
# outputs first); None: no gradient
Source = tuple[str, int] | None


@dataclass(frozen=True)
class Kernel:
    """One kernel of a backward: its region's key and where each of its inputs comes from."""

    key: str
    inputs: tuple[tuple[str, int], ...]  # per region input: ("saved", i), ("grad", j) or ("out", v)


@dataclass(frozen=True)
class BackwardPlan:
    """The backward of one forward region for one pair of masks, as plain data."""

    fwd_key: str
    need_in: tuple[bool, ...]  # forward inputs that need a gradient
    need_out: tuple[bool, ...]  # forward outputs that receive one
    kernels: tuple[Kernel, ...] = ()  # in the order they run (none: every gradient passed through)
    grads: tuple[Source, ...] = ()  # per forward input
    inputs: tuple[tuple[str, int], ...] = ()  # the backward's inputs from outside: ("saved", i) / ("grad", j)
    input_metas: tuple[TensorMeta, ...] = ()  # their shapes, strides and dtypes as traced
    results: tuple[int, ...] = ()  # the kernels' output values that are gradients (the tuned workload's outputs)
    main: int = 0  # the kernel a tuned (BWD) schedule is for; the others run their heuristic
    error: str | None = None  # why there is no generated backward (the eager vjp runs)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def key(self) -> str | None:
        """The main kernel's key (the tuned workload's region); None: no kernel."""
        return self.kernels[self.main].key if self.kernels else None


def full_masks(ir: RegionIR) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Every floating input needs a gradient, every floating output receives one (the tuner's case)."""
    return (tuple(m.dtype.is_floating_point for m in ir.inputs),
            tuple(ir.out_meta(r).dtype.is_floating_point for r in ir.outputs))


def _table() -> dict[object, object]:
    # a copy: make_fx is handed a dict of its own
    return dict(_core_table())


@functools.cache
def _core_table() -> dict[object, object]:
    # decompose only what the generator cannot lower itself (it writes softmax, var_mean, gelu, ...
    # better whole than as their core pieces). Made once: torch's table materializes every
    # CompositeImplicit op of every namespace on each call (0.2 s)
    return {op: fn for op, fn in core_aten_decompositions().items() if op_name(op) not in LOWERINGS}


def _dense_stride(m: TensorMeta) -> tuple[int, ...] | None:
    dims = sorted((s, n) for n, s in zip(m.shape, m.stride, strict=True) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return None
        expect *= n
    return m.stride


def trace(ir: RegionIR, need_in: Sequence[bool], need_out: Sequence[bool]) -> tuple[fx.GraphModule, list[int]]:
    """The vjp of `ir` as an ATen graph: placeholders (every forward input, then the gradient of
    each output in `need_out`), outputs the non-None input gradients; and the forward inputs those
    gradients are for (autograd gives None for an input the outputs do not depend on)."""
    n = len(ir.inputs)
    wanted = [k for k, w in enumerate(need_out) if w]
    got_for: list[int] = []

    def vjp(*args: torch.Tensor) -> list[torch.Tensor]:
        xs = list(args[:n])
        gs = list(args[n:])
        with torch.enable_grad():
            outs = REF.replay(ir, xs)
        wrt = [x for x, need in zip(xs, need_in, strict=True) if need]
        pairs = [(outs[k], g) for k, g in zip(wanted, gs, strict=True) if outs[k].requires_grad]
        if not pairs:
            return []
        dx = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        need_idx = [i for i, need in enumerate(need_in) if need]
        got_for[:] = [i for i, d in zip(need_idx, dx, strict=True) if d is not None]
        return [d for d in dx if d is not None]

    device = torch.device(ir.device)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        xs = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=device).requires_grad_(need)
              for m, need in zip(ir.inputs, need_in, strict=True)]
        gs = []
        for k in wanted:
            m = ir.out_meta(ir.outputs[k])
            gs.append(torch.empty_strided(m.shape, _dense_stride(m) or _contiguous(m.shape), dtype=m.dtype,
                                          device=device))
        with mode:
            gm = make_fx(vjp, decomposition_table=_table(), tracing_mode="real")(*xs, *gs)
    gm.graph.eliminate_dead_code()
    sink_expands(gm.graph)
    gm.recompile()
    return gm, got_for


# pointwise ops that broadcast their tensor operands: an explicit expand feeding them is redundant
_ELEMENTWISE = {f"aten.{n}.{o}" for n in ("add", "sub", "mul", "div", "rsub", "eq", "ne", "lt", "le", "gt", "ge")
                for o in ("Tensor", "Scalar")} | {
    "aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.maximum.default",
    "aten.minimum.default", "aten.pow.Tensor_Scalar", "aten.neg.default", "aten.exp.default",
    "aten.sqrt.default", "aten.rsqrt.default", "aten.reciprocal.default", "aten.sigmoid.default",
    "aten.tanh.default", "aten.abs.default", "aten.sign.default", "prims.convert_element_type.default",
    "aten._to_copy.default",
    "aten.masked_fill.Scalar", "aten.clamp_min.default", "aten.clamp_max.default", "aten.clamp.default"}
_aten = torch.ops.aten


def _val(a: object) -> object:
    return a.meta["val"] if isinstance(a, fx.Node) else a


def _fake_call(target: object, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    vals = [_val(a) for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        return target(*vals, **{k: _val(v) for k, v in kwargs.items()})  # type: ignore[operator]


def sink_expands(graph: fx.Graph) -> int:
    """Drop the explicit broadcasts autograd writes (mean's backward: grad.expand(sizes) / n) where
    the pointwise op reading them broadcasts anyway, moving an expand past the ops of one tensor
    operand first. The generator reads a per-row value at every point of its row through a
    pointwise op's broadcast, never through an expand view (lower.analyze), so without this a
    normalization's backward splits in two. Returns how many uses were rewritten."""
    done, changed = 0, True
    while changed:
        changed = False
        for e in list(graph.nodes):
            if e.op != "call_function" or e.target is not _aten.expand.default or not e.users:
                continue
            src, ev = e.args[0], e.meta.get("val")
            sv = _val(src)
            if not (isinstance(sv, torch.Tensor) and isinstance(ev, torch.Tensor)) or sv.dim() != ev.dim():
                continue
            for u in list(e.users):
                if u.op != "call_function" or op_name(u.target) not in _ELEMENTWISE or e in u.kwargs.values():
                    continue
                others = [_val(a).shape for a in u.args if isinstance(a, fx.Node) and a is not e]
                if others:
                    if torch.broadcast_shapes(sv.shape, *others) != ev.shape:
                        continue
                    u.args = tuple(src if a is e else a for a in u.args)
                else:  # one tensor operand: the op on the small value, then the expand
                    args = tuple(src if a is e else a for a in u.args)
                    with graph.inserting_after(u):
                        nu = graph.call_function(u.target, args, dict(u.kwargs))
                        nu.meta["val"] = _fake_call(u.target, args, dict(u.kwargs))
                    with graph.inserting_after(nu):
                        ne = graph.call_function(_aten.expand.default, (nu, list(ev.shape)))
                        ne.meta["val"] = _fake_call(_aten.expand.default, (nu, list(ev.shape)), {})
                    u.replace_all_uses_with(ne)
                    graph.erase_node(u)
                done += 1
                changed = True
    graph.eliminate_dead_code()
    return done


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def derive(ir: RegionIR, need_in: Sequence[bool], need_out: Sequence[bool]) -> BackwardPlan:
    """The backward plan of `ir` for these masks (module docstring); the region is stored by key."""
    need_in, need_out = tuple(bool(x) for x in need_in), tuple(bool(x) for x in need_out)
    base = BackwardPlan(ir.key, need_in, need_out)
    if len(need_in) != len(ir.inputs) or len(need_out) != len(ir.outputs):
        raise ValueError(f"solforge codegen backward: masks of {len(need_in)}/{len(need_out)} for a region of "
                         f"{len(ir.inputs)} inputs / {len(ir.outputs)} outputs")
    need_in = tuple(a and m.dtype.is_floating_point for a, m in zip(need_in, ir.inputs, strict=True))
    try:
        gm, got_for = trace(ir, need_in, need_out)
    except Exception as e:  # noqa: BLE001 - a vjp that does not trace is a fallback, not a crash
        return _fail(base, f"the vjp does not trace: {type(e).__name__}: {str(e)[:200]}")
    return _plan_of(base, gm, got_for, len(ir.inputs))


def _fail(base: BackwardPlan, why: str) -> BackwardPlan:
    return BackwardPlan(base.fwd_key, base.need_in, base.need_out, error=why)


def _region(nodes: list[fx.Node]) -> tuple[Lowered, list[fx.Node], list[fx.Node]] | str:
    """`nodes` (graph order) as one region: (its lowering, input nodes in IR order, output nodes), or why not."""
    outs = RG.outputs_of(nodes)
    try:
        ir, ins = IRM.build(nodes, outs)
        low = prepare(ir)
    except (LowerError, ValueError) as e:
        return f"the vjp is not one region: {str(e)[:300]}"
    return low, ins, outs


def whole(graph: fx.Graph) -> tuple[Lowered, list[fx.Node], list[fx.Node]] | str:
    """Every op of `graph` as one region: (its lowering, input nodes in IR order, output nodes), or
    why it cannot be one. Tried before the former, whose greedy growth may leave two regions of one
    loop space apart (a vjp reading dy in two places: the first reader starts its own region before
    the second joins another)."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    anchors = sorted({f"{op_name(n.target)} ({why})" for n in nodes if n.target is not operator.getitem
                      for why in (RG.anchor_reason(n),) if why is not None})
    if anchors:
        why = f"the vjp holds ops no region takes: {', '.join(anchors)[:300]}"
        if any(a.split(" ")[0] in _SCATTERS for a in anchors):
            # a gather's (index, embedding, max.dim's) vjp adds each gradient into its source row:
            # a scatter with repeated indices, which would need atomics or a sort; the eager vjp runs
            return f"the vjp scatter-adds into a gathered source (no generated scatter); {why}"
        return why
    return _region(nodes)


# autograd's scatters: the vjps of gathers (x[idx], gather, index_select, embedding, max.dim)
_SCATTERS = {"aten.index_put.default", "aten.index_put_.default", "aten._unsafe_index_put.default",
             "aten.scatter_add.default", "aten.scatter.src", "aten.scatter.value", "aten.index_add.default",
             "aten.embedding_dense_backward.default", "aten._index_put_impl_.default"}


Region = tuple[Lowered, list[fx.Node], list[fx.Node]]


def several(graph: fx.Graph) -> list[Region] | str:
    """The vjp as several regions in an order they can run in (each reads graph inputs and earlier
    regions' outputs), or why it cannot be: form_regions' regions, then any two of one loop space
    that do not depend on each other merged (one launch, not two), then sorted topologically."""
    try:
        formed = RG.form_regions(graph)
    except Exception as e:  # noqa: BLE001 - a former failure is a fallback, not a crash
        return f"the former fails on the vjp: {type(e).__name__}: {str(e)[:200]}"
    inside = {n for fr in formed for n in fr.nodes}
    left = [n for n in graph.nodes if n.op == "call_function" and n not in inside]
    if left:
        return f"the vjp's ops {', '.join(sorted({op_name(n.target) for n in left}))[:300]} are in no region"
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups = [list(fr.nodes) for fr in formed]
    regions: list[Region] = [(fr.lowered, list(fr.inputs), list(fr.outputs)) for fr in formed]
    merged = True
    while merged:  # merge one pair at a time until none merges
        merged = False
        pairs = [(a, b) for a in range(len(groups)) for b in range(a + 1, len(groups))
                 if regions[a][0].space == regions[b][0].space and not _depends(groups, a, b)
                 and not _depends(groups, b, a)]
        for a, b in pairs:
            nodes = sorted(groups[a] + groups[b], key=order.__getitem__)
            got = _region(nodes)
            if not isinstance(got, str):
                groups[a], regions[a] = nodes, got
                del groups[b], regions[b]
                merged = True
                break
    order_ = _topological(groups)
    if isinstance(order_, str):
        return order_
    groups = [groups[k] for k in order_]
    if _widen(groups):  # the regions again, with their fp32 intermediates
        rebuilt = [_region(g) for g in groups]
        bad = [r for r in rebuilt if isinstance(r, str)]
        return bad[0] if bad else rebuilt  # type: ignore[return-value]
    return [regions[k] for k in order_]


_NARROW = (torch.bfloat16, torch.float16)


def _widen(groups: list[list[fx.Node]]) -> int:
    """Hold a bf16/fp16 value one region stores for another in fp32 (its node's value made fp32):
    inside one kernel such a value is never rounded (the generator computes in fp32 and rounds at
    explicit casts and stores only), so splitting the vjp must not add a rounding; a LayerNorm
    weight's gradient sums dy * x_hat over all the rows. Returns how many values were widened."""
    owner = {n: k for k, g in enumerate(groups) for n in g}
    done = 0
    for k, g in enumerate(groups):
        for n in g:
            v = n.meta.get("val")
            if n.target is operator.getitem or not isinstance(v, torch.Tensor) or v.dtype not in _NARROW:
                continue
            # a gradient keeps its dtype; only a value read by another region alone is widened
            if any(u.op == "output" for u in n.users) or not any(owner.get(u, k) != k for u in n.users):
                continue
            mode = detect_fake_mode([v])
            with mode if mode is not None else contextlib.nullcontext():
                n.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=torch.float32, device=v.device)
            done += 1
    return done


def _reads(groups: list[list[fx.Node]], a: int) -> set[int]:
    """The groups group `a` reads a value of."""
    owner = {n: k for k, g in enumerate(groups) for n in g}
    return {owner[x] for n in groups[a] for x in n.all_input_nodes if x in owner and owner[x] != a}


def _depends(groups: list[list[fx.Node]], a: int, b: int) -> bool:
    """Does group `a` read, directly or through other groups, a value of group `b`?"""
    todo, seen = [a], set()
    while todo:
        k = todo.pop()
        for r in _reads(groups, k):
            if r == b:
                return True
            if r not in seen:
                seen.add(r)
                todo.append(r)
    return False


def _topological(groups: list[list[fx.Node]]) -> list[int] | str:
    """The groups' indices in an order each runs after those it reads (the first ready one first)."""
    deps = [_reads(groups, k) for k in range(len(groups))]
    done: list[int] = []
    while len(done) < len(groups):
        ready = [k for k in range(len(groups)) if k not in done and deps[k] <= set(done)]
        if not ready:
            return "the vjp's regions read each other"
        done.append(ready[0])
    return done


def _plan_of(base: BackwardPlan, gm: fx.GraphModule, got_for: list[int], n_in: int) -> BackwardPlan:
    graph = gm.graph
    placeholders = [p for p in graph.nodes if p.op == "placeholder"]
    wanted = [k for k, w in enumerate(base.need_out) if w]
    source: dict[fx.Node, tuple[str, int]] = {
        p: (("saved", i) if i < n_in else ("grad", wanted[i - n_in])) for i, p in enumerate(placeholders)}
    (out_node,) = [n for n in graph.nodes if n.op == "output"]
    results = list(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    regions: list[Region] = []
    if any(n.op == "call_function" for n in graph.nodes):
        got = whole(graph)
        if isinstance(got, str) and "no region takes" not in got:
            many = several(graph)
            got = many if not isinstance(many, str) else f"{got}; as several regions: {many}"
        elif not isinstance(got, str):
            got = [got]
        if isinstance(got, str):
            return _fail(base, got)
        regions = got
    kernels: list[Kernel] = []
    ext: dict[tuple[str, int], TensorMeta] = {}  # in order of first use: a single kernel's are its own
    n_out = 0
    for low, in_nodes, outs in regions:
        ins = []
        for a, meta in zip(in_nodes, low.ir.inputs, strict=True):
            if a not in source:
                return _fail(base, f"a backward region reads {a.name}, a value no earlier region stores")
            ins.append(source[a])
            if source[a][0] != "out":
                ext.setdefault(source[a], meta)
        for o in outs:
            source[o] = ("out", n_out)
            n_out += 1
        kernels.append(Kernel(store.save(low.ir), tuple(ins)))
    grads: list[Source] = [None] * n_in
    for i, r in zip(got_for, results, strict=True):
        grads[i] = source.get(r)
        if grads[i] is None:
            return _fail(base, f"the gradient of input {i} is no region's output")
    res = tuple(sorted({s[1] for s in grads if s is not None and s[0] == "out"}))
    if len(kernels) == 1 and res != tuple(range(len(regions[0][2]))):
        return _fail(base, "the vjp's region stores a value that is no gradient")
    sizes = [regions[k][0].space.numel for k in range(len(regions))]
    main = sizes.index(max(sizes)) if sizes else 0
    return BackwardPlan(base.fwd_key, base.need_in, base.need_out, tuple(kernels), tuple(grads), tuple(ext),
                        tuple(ext.values()), res, main)


_PLANS: dict[tuple[str, tuple[bool, ...], tuple[bool, ...]], BackwardPlan] = {}


def plan(fwd_key: str, need_in: Sequence[bool], need_out: Sequence[bool]) -> BackwardPlan:
    """`derive` for the region of `fwd_key`, once per process and masks."""
    k = (fwd_key, tuple(bool(x) for x in need_in), tuple(bool(x) for x in need_out))
    got = _PLANS.get(k)
    if got is None:
        got = _PLANS[k] = derive(store.load(fwd_key), k[1], k[2])
    return got


def backward_inputs(p: BackwardPlan, saved: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The backward's inputs from outside (`p.inputs`: a single kernel's in its region's order), from
    the saved inputs and output grads."""
    return [_pick(s, saved, grads) for s in p.inputs]


def value_metas(p: BackwardPlan) -> list[TensorMeta]:
    """The metas of the kernels' output values, numbered as ("out", v)."""
    return [ir.out_meta(r) for k in p.kernels for ir in (store.load(k.key),) for r in ir.outputs]


Launch = Callable[[int, str, list[torch.Tensor]], Sequence[torch.Tensor]]


def run_kernels(p: BackwardPlan, inputs: Sequence[torch.Tensor], launch: Launch) -> list[torch.Tensor]:
    """Every kernel of the plan in order on the backward's inputs (`backward_inputs`), through
    `launch(index, key, its inputs) -> its outputs`; the values of all their outputs, in order
    (what ("out", v) numbers). Intermediates are plain tensors, dropped with the list."""
    ext = dict(zip(p.inputs, inputs, strict=True))
    vals: list[torch.Tensor] = []
    for k, kern in enumerate(p.kernels):
        vals += launch(k, kern.key, [vals[s[1]] if s[0] == "out" else ext[s] for s in kern.inputs])
    return vals


def _pick(s: tuple[str, int], saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    t = saved[s[1]] if s[0] == "saved" else grads[s[1]]
    assert t is not None, f"backward plan reads {s} but it is None"
    return t


def input_grads(p: BackwardPlan, outs: Sequence[torch.Tensor], saved: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """One gradient per forward input (None where none), from the kernels' outputs (`run_kernels`)
    and pass-throughs."""
    return [None if s is None else outs[s[1]] if s[0] == "out" else _pick(s, saved, grads) for s in p.grads]


def fp64_vjp(ir: RegionIR, need_in: Sequence[bool], need_out: Sequence[bool], saved: Sequence[torch.Tensor],
             grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The reference: eager autograd of the region's ops in fp64 (reference.reference: floating
    inputs widened, explicit casts rounded as the graph asks), gradients cast to the input dtypes.
    `grads`: one per output in `need_out`."""
    with torch.enable_grad():
        xs = [x.detach().to(torch.float64).requires_grad_(need) if x.is_floating_point() else x
              for x, need in zip(saved, need_in, strict=True)]
        outs = REF.reference_wide(ir, xs)
        wanted = [k for k, w in enumerate(need_out) if w]
        pairs = [(outs[k], g.to(torch.float64)) for k, g in zip(wanted, grads, strict=True) if outs[k].requires_grad]
        wrt = [x for x, need in zip(xs, need_in, strict=True) if need and x.is_floating_point()]
        dx = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
            if pairs and wrt else [None] * len(wrt)
    it = iter(dx)
    out: list[torch.Tensor | None] = []
    for x, need in zip(saved, need_in, strict=True):
        d = next(it) if need and x.is_floating_point() else None
        out.append(None if d is None else d.to(x.dtype))
    return out
