"""The backward of a generated region, derived: its vjp traced to ATen and formed into one region.

For a forward region (ir.RegionIR) and which of its inputs need a gradient and which of its outputs
receive one, `trace` runs the region's own ops (reference.replay) and torch.autograd.grad under
make_fx, on fake tensors laid out as the region's inputs: an ATen graph whose inputs are the saved
forward inputs and the output gradients, and whose outputs are the input gradients (autograd has
already summed them over broadcast dims and cast them to each input's dtype). Autograd's backward
ops (`_softmax_backward_data`, `sigmoid_backward`, `native_layer_norm_backward`, ...) are
decomposed with torch's core ATen table where the generator has no lowering of its own, so the
graph holds only ops the former knows. The forward's values the backward needs are recomputed
inside it: saving the forward inputs is the schedule's default choice (recompute).

`derive` forms that graph's regions with codegen.regions.form_regions. When every op of the vjp
lands in exactly one region whose inputs are graph inputs and whose outputs are the gradients, the
backward is that region: one generated kernel, its key stored by store.save (a gradient that is an
input of the vjp unchanged, dy of a residual add, is passed through without a kernel). Anything
else (several regions: a weight's gradient reduced over the rows while the input's is reduced over
the columns; an anchor op) gives a BackwardPlan with `error` saying why, and the op falls back to
the eager vjp of the region's ops (kernels/generated.py). Failures are data: nothing here raises
for a region the generator cannot take.

A plan depends only on (forward key, masks), so every process derives the same one; each is made
once per process (`plan`).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
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

# where one input gradient comes from: ("out", j) output j of the backward kernel; ("saved", i)
# forward input i or ("grad", j) output gradient j passed through unchanged; None: no gradient
Source = tuple[str, int] | None


@dataclass(frozen=True)
class BackwardPlan:
    """The backward of one forward region for one pair of masks, as plain data."""

    fwd_key: str
    need_in: tuple[bool, ...]  # forward inputs that need a gradient
    need_out: tuple[bool, ...]  # forward outputs that receive one
    key: str | None = None  # the backward region's key (None: no kernel, every gradient passed through)
    inputs: tuple[tuple[str, int], ...] = ()  # per backward-region input: ("saved", i) or ("grad", j)
    grads: tuple[Source, ...] = ()  # per forward input
    error: str | None = None  # why there is no generated backward (the eager vjp runs)

    @property
    def ok(self) -> bool:
        return self.error is None


def full_masks(ir: RegionIR) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Every floating input needs a gradient, every floating output receives one (the tuner's case)."""
    return (tuple(m.dtype.is_floating_point for m in ir.inputs),
            tuple(ir.out_meta(r).dtype.is_floating_point for r in ir.outputs))


def _table() -> dict[object, object]:
    # decompose only what the generator cannot lower itself (it writes softmax, var_mean, gelu, ...
    # better whole than as their core pieces)
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


def whole(graph: fx.Graph) -> tuple[Lowered, list[fx.Node], list[fx.Node]] | str:
    """Every op of `graph` as one region: (its lowering, input nodes in IR order, output nodes), or
    why it cannot be one. Not the former's greedy growth, which may leave two regions of one loop
    space apart (a vjp reading dy in two places: the first reader starts its own region before the
    second joins another); the vjp should be one kernel or none."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    anchors = sorted({f"{op_name(n.target)} ({why})" for n in nodes if n.target is not operator.getitem
                      for why in (RG.anchor_reason(n),) if why is not None})
    if anchors:
        return f"the vjp holds ops no region takes: {', '.join(anchors)[:300]}"
    outs = RG.outputs_of(nodes)
    try:
        ir, ins = IRM.build(nodes, outs)
        low = prepare(ir)
    except (LowerError, ValueError) as e:
        return f"the vjp is not one region: {str(e)[:300]}"
    return low, ins, outs


def _plan_of(base: BackwardPlan, gm: fx.GraphModule, got_for: list[int], n_in: int) -> BackwardPlan:
    graph = gm.graph
    placeholders = [p for p in graph.nodes if p.op == "placeholder"]
    wanted = [k for k, w in enumerate(base.need_out) if w]
    source = {p: (("saved", i) if i < n_in else ("grad", wanted[i - n_in])) for i, p in enumerate(placeholders)}
    (out_node,) = [n for n in graph.nodes if n.op == "output"]
    results = list(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    grads: list[Source] = [None] * n_in
    key: str | None = None
    ins: tuple[tuple[str, int], ...] = ()
    outs: list[fx.Node] = []
    if any(n.op == "call_function" for n in graph.nodes):
        got = whole(graph)
        if isinstance(got, str):
            return _fail(base, f"{got} (the former makes {_count(graph)} regions of it)")
        low, in_nodes, outs = got
        if any(o not in results for o in outs):
            return _fail(base, "the vjp's region stores a value that is no gradient")
        key = store.save(low.ir)
        ins = tuple(source[a] for a in in_nodes)
    for i, r in zip(got_for, results, strict=True):
        grads[i] = source[r] if r.op == "placeholder" else ("out", outs.index(r))
    return BackwardPlan(base.fwd_key, base.need_in, base.need_out, key, ins, tuple(grads))


def _count(graph: fx.Graph) -> int | str:
    try:
        return len(RG.form_regions(graph))
    except Exception as e:  # noqa: BLE001 - only a count for the message
        return f"? ({type(e).__name__})"


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
    """The backward kernel's inputs, in its region's order, from the saved inputs and output grads."""
    return [_pick(s, saved, grads) for s in p.inputs]


def _pick(s: tuple[str, int], saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    t = saved[s[1]] if s[0] == "saved" else grads[s[1]]
    assert t is not None, f"backward plan reads {s} but it is None"
    return t


def input_grads(p: BackwardPlan, outs: Sequence[torch.Tensor], saved: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """One gradient per forward input (None where none), from the kernel's outputs and pass-throughs."""
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
