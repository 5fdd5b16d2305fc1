"""The "generated" family: a kernel solforge's own generator (solforge/codegen/) writes for any region.

Unlike the hand-written families, one module serves every region: the region travels as its key
(codegen.ir.RegionIR.key, sha256 of its canonical text; codegen/store.py turns a key back into the
region in any process). Everything else is the family contract:

  Config        codegen.schedule.Schedule (its text form: "rows:b=64:r=4:w=2:c=1")
  space / is_valid / heuristic   codegen/schedule.py's, on the workload's region (the space ordered
                as a spread: tune/order.py)
  make_inputs   random inputs with the region's input shapes, dtypes AND strides
  generated_ref the region's own ATen ops in fp64 (codegen/reference.py), cast to the output dtypes
  generated     the launcher: generated(*inputs, key=..., config=None, out=None) -> tuple of outputs

A Workload is family "generated", the region's input shapes and dtypes, params (("key", key),)
and the device; the key already holds the input strides, the ops, their constants and the output
dtypes, so it is all the database needs (db keys it with a hash of the codegen sources too).

One torch.library op for every region, `solforge::generated(Tensor[] inputs, str key, str config)
-> Tensor[]`: its fake implementation makes the outputs from the region's recorded output metas,
its implementation runs the kernel of `key` under `config` ("" = the heuristic; in training
"FWD|BWD").

Its backward is derived (codegen/backward.py): the region's vjp traced to ATen and generated like
any region, as one kernel when it forms one region, else as several (a norm's weight gradient, a sum
over the rows, after the row-wise input gradient: two loop spaces), each with its own key, run in
order with their intermediates as plain tensors; the op's backward calls this same op once per
kernel, the BWD schedule for the backward's main kernel and "" for the others. The forward inputs
are saved and the forward recomputed inside the backward kernels. `backward_workload` gives the
backward for the tuner's masks (every floating input needs a gradient, every floating output
receives one) as a `generated_bwd` workload (kernels/generated_bwd.py), every kernel of it tuned
(its main one) and verified together against fp64 autograd of the region's ops; with a BWD config
the op's backward runs exactly that verified backward, whatever this call needs (unneeded gradients
dropped, zeros for an output gradient autograd did not give); with "" (the op called outside
`optimize`) the heuristic kernels of this call's own masks. A region whose vjp holds an op no region
takes has no backward workload, and its backward is the vjp of the region's own ATen ops run again
under torch.autograd from the saved inputs (eager: right for any region); the plan says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from solforge.codegen import backward as BW
from solforge.codegen import reference as REF
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen import store
from solforge.codegen.ir import Ref, RegionIR
from solforge.codegen.lower import Lowered
from solforge.kernels import edges as _edges
from solforge.numerics import dtype_name, input_generator
from solforge.records import Workload

FAMILY = "generated"
Config = SC.Schedule
# the sizes are literals of a region's source (its key holds them): make_inputs ignores `rows`
SHAPE_FIXED = True


def region(workload: Workload) -> Lowered:
    key = workload.param("key")
    if not key:
        raise ValueError(f"solforge generated: workload {workload.key} names no region key")
    return store.lowered(key)


def workload_for(ir: RegionIR) -> Workload:
    """The Workload of a region (kept by key: codegen/store.py saves the region first)."""
    key = store.save(ir)
    return Workload(family=FAMILY, shapes=tuple(m.shape for m in ir.inputs),
                    dtypes=tuple(dtype_name(m.dtype) for m in ir.inputs), params=(("key", key),),
                    device=ir.device)


# the space is large (250-340 schedules at GPU shapes): it comes as a spread (tune/order.py), which the
# search's first candidates follow (registry.space_spread)
SPACE_SPREAD = True


def space(workload: Workload) -> list[SC.Schedule]:
    from solforge.tune.order import spread

    return spread(SC.space(region(workload)))


def is_valid(config: SC.Schedule, workload: Workload) -> bool:
    return SC.is_valid(config, region(workload))


def heuristic(workload: Workload) -> SC.Schedule:
    return SC.heuristic(region(workload))


def backward_workload(workload: Workload) -> Workload | None:
    """The generated_bwd workload of the region's backward for the tuner's masks (every floating
    input needs a gradient, every floating output receives one): its inputs are those the backward
    reads from outside (saved inputs, output gradients), its key the main kernel's; None when the
    vjp forms no set of regions (the op's backward is then the eager vjp: nothing to tune)."""
    fwd = workload.param("key")
    p = BW.plan(fwd, *BW.full_masks(store.load(fwd)))
    if not p.ok or p.key is None:
        return None
    return Workload(family="generated_bwd", shapes=tuple(m.shape for m in p.input_metas),
                    dtypes=tuple(dtype_name(m.dtype) for m in p.input_metas), params=(("key", p.key), ("fwd", fwd)),
                    device=workload.device)


# ----------------------------------------------------------------------------------------------
# Inputs and reference

# ops whose (first) operand must be positive for a finite result, and ops that stop the walk back
# from such an operand to the inputs it comes from (a reduction's value is not an input's sign:
# LayerNorm's rsqrt(var + eps) keeps x signed)
_DOMAIN = {"aten.sqrt.default", "aten.rsqrt.default", "aten.log.default", "aten.log2.default",
           "aten.log10.default", "aten.reciprocal.default"}
_REDUCE = ("sum", "mean", "amax", "amin", "var", "std", "var_mean", "_softmax", "_log_softmax", "logsumexp",
           "linalg_vector_norm")


def positive_inputs(ir: RegionIR) -> set[int]:
    """Inputs drawn positive: those a sqrt/rsqrt/log/reciprocal, a fractional power or a division's
    denominator reads through pointwise ops and views (BatchNorm's running variance), so the random
    trials test finite values, not NaN against NaN."""
    starts: list[Ref] = []
    for op in ir.ops:
        refs = [a for a in op.args if isinstance(a, Ref)]
        if op.target in _DOMAIN and refs:
            starts.append(refs[0])
        elif op.target == "aten.pow.Tensor_Scalar" and refs and float(op.args[1]) != int(float(op.args[1])):
            starts.append(refs[0])
        elif op.target in ("aten.div.Tensor",) and len(op.args) > 1 and isinstance(op.args[1], Ref):
            starts.append(op.args[1])
    out: set[int] = set()
    seen: set[Ref] = set()
    while starts:
        r = starts.pop()
        if r in seen:
            continue
        seen.add(r)
        if r.src == "in":
            out.add(r.i)
            continue
        op = ir.ops[r.i]
        if op.target.split(".")[1] in _REDUCE:
            continue
        starts += [a for a in (*op.args, *(v for _, v in op.kwargs)) if isinstance(a, Ref)]
    return out


# indexing ops: the source's dim each index operand (args[k]) picks from, per op
_INDEXING = ("aten.index.Tensor", "aten.gather.default", "aten.index_select.default", "aten.embedding.default")
_INDEX_VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
                "aten.squeeze.dim", "aten.squeeze.dims", "aten.expand.default", "aten.permute.default",
                "aten.transpose.int", "aten.t.default", "aten.clone.default", "aten.alias.default"}


def index_inputs(ir: RegionIR) -> dict[int, tuple[int, int]]:
    """Integer inputs read (through views) as the index of an indexing op, each with the range
    [lo, hi) its trials are drawn from: every index of the dim it picks from, the negative ones too
    where the op wraps them (advanced indexing), so the trials read all over the source; torch
    raises on any other index (the kernel's NaN: lower.py's gather)."""
    out: dict[int, tuple[int, int]] = {}
    for op in ir.ops:
        if op.target not in _INDEXING or len(op.args) < (2 if op.target in _INDEXING[::3] else 3):
            continue  # _INDEXING[::3]: index.Tensor and embedding, whose index is args[1]
        src = ir.out_meta(op.args[0]).shape
        if op.target == "aten.index.Tensor":
            picks = [(t, src[d], True) for d, t in enumerate(op.args[1]) if isinstance(t, Ref)]
        elif op.target == "aten.embedding.default":
            picks = [(op.args[1], src[0], False)]
        else:
            picks = [(op.args[2], src[op.args[1] % len(src)], False)]
        for r, n, wrap in picks:
            while isinstance(r, Ref) and r.src == "op" and ir.ops[r.i].target in _INDEX_VIEWS:
                r = ir.ops[r.i].args[0]
            if not isinstance(r, Ref) or r.src != "in":
                continue
            lo, hi = out.get(r.i, (-n if wrap else 0, n))
            out[r.i] = (max(lo, -n if wrap else 0), min(hi, n))
    return out


def _draw(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, positive: bool,
          g: torch.Generator, where: torch.device, device: torch.device,
          span: tuple[int, int] | None = None) -> torch.Tensor:
    """A tensor of `shape` laid out with `stride` over a storage drawn whole (on `where`, then moved);
    an integer one in {0, 1}, or in [lo, hi) for `span` (an index: `index_inputs`)."""
    size = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
    if dtype.is_floating_point:
        flat = torch.randn(size, generator=g, device=where)
        flat = flat.abs() + 0.5 if positive else flat
    else:
        lo, hi = span or (0, 2)
        flat = torch.randint(lo, hi, (size,), generator=g, device=where)
    return flat.to(device=device, dtype=dtype).as_strided(tuple(shape), tuple(stride))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random inputs for `generated` / `generated_ref`, laid out with the region's strides
    (a permuted or sliced input is read as the model hands it over). `rows` (verify's odd shape) is
    ignored: a region's shapes are part of its key, and every tail of its kernels is masked."""
    ir = region(workload).ir
    device = torch.device(device or workload.device)
    pos, spans = positive_inputs(ir), index_inputs(ir)
    g, where = input_generator(sum(m.numel for m in ir.inputs), device, seed)
    xs = tuple(_draw(m.shape, m.stride, m.dtype, i in pos, g, where, device, spans.get(i))
               for i, m in enumerate(ir.inputs))
    return xs, {"key": workload.param("key")}


# Edge rows of a generated region's verification (tune/verify.py, kernels/edges.py): one row of its
# largest floating input (an index input keeps its draw) rewritten per case. Magnitudes stay where
# fp32 holds what fp64 holds (a spike of 30: exp(30) is 1e13, where exp(100) would be inf in the
# kernel and finite in the fp64 reference), and no NaN or infinity (torch's own fp32 and fp64 ops
# differ there: gelu(inf)).
_EDGE_CASES: dict[str, Any] = {
    "all-zero row": torch.zeros_like,  # 0 / norm, rsqrt(var + eps): eps dropped is NaN
    "constant row": lambda r: torch.full_like(r, 3.0),  # a variance of exactly 0, a softmax of 1/N each
    "spike row": lambda r: _edges.spike(r, 30.0),  # past a clamp at a few units; a max far from the rest
}


def edge_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> list[tuple[str, Any, dict[str, Any]]]:
    """The verifier's edge cases (`_EDGE_CASES`), each drawn when its trial runs (a region's inputs
    are its full size: several sets at once may not fit beside the model); past the verifier's
    LARGE_BYTES of inputs the all-zero row alone (each case is a full fp64 reference there)."""
    from solforge.tune.verify import LARGE_BYTES

    ir = region(workload).ir
    spans = index_inputs(ir)
    # a row along the last dim must be distinct memory to write (not an expanded input's)
    floats = [i for i, m in enumerate(ir.inputs) if m.dtype.is_floating_point and i not in spans and m.numel > 1
              and m.shape and (m.stride[-1] != 0 or m.shape[-1] == 1)]
    if not floats:
        return []
    arg = max(floats, key=lambda i: (ir.inputs[i].numel, -i))

    def case(edit: Any) -> Any:
        def draw() -> tuple[tuple[Any, ...], dict[str, Any]]:
            args, kwargs = make_inputs(workload, seed=seed, device=device)
            t = args[arg]
            row = t[(0,) * (t.dim() - 1)] if t.dim() else t  # the first row along the last dim (a view)
            row.copy_(edit(row.float()).to(t.dtype))
            return args, kwargs
        return draw

    cases = list(_EDGE_CASES.items())
    if sum(m.numel * m.dtype.itemsize for m in ir.inputs) > LARGE_BYTES:
        cases = cases[:1]
    return [(label, case(edit), {}) for label, edit in cases]


def generated_ref(*inputs: torch.Tensor, key: str) -> tuple[torch.Tensor, ...]:
    return REF.reference(store.load(key), inputs)


def eager_outputs(*inputs: torch.Tensor, key: str) -> tuple[torch.Tensor, ...]:
    """The region's ops as the model ran them, in their own dtypes: the verifier allows a generated
    kernel a few times the error this has against the fp64 reference (an fp32 sum over 8192
    cancelling terms is off by more than fp32's element tolerance, in eager as in any kernel)."""
    return REF.replay(store.load(key), inputs)


def generated(*inputs: torch.Tensor, key: str, config: SC.Schedule | None = None,
              out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """The kernel of region `key` under `config` (None: the heuristic) on `inputs`."""
    return RT.run(store.lowered(key), config, inputs, out)


# ----------------------------------------------------------------------------------------------
# The custom op (Library API, as the other families: cheaper per call than @custom_op)

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("generated(Tensor[] inputs, str key, str config) -> Tensor[]")


def _op(inputs: list[torch.Tensor], key: str, config: str) -> list[torch.Tensor]:
    fwd = config.partition("|")[0]
    return list(RT.run(store.lowered(key), SC.Schedule.decode(fwd) if fwd else None, inputs))


_LIB.impl("generated", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::generated")
def _fake(inputs: list[torch.Tensor], key: str, config: str) -> list[torch.Tensor]:
    low = store.lowered(key)
    device = inputs[0].device if inputs else torch.device(low.ir.device)
    return list(RT.empty_outputs(low, device))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ins, key, config = inputs
    ctx.key, ctx.bwd_config = key, config.partition("|")[2]
    ctx.need = tuple(bool(x.requires_grad) for x in ins)
    ctx.set_materialize_grads(False)  # an output nothing differentiates: None, not zeros (less work)
    ctx.save_for_backward(*ins)  # the schedule's default: recompute the forward from its inputs


def _backward(ctx: Any, grads: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
    """The generated backward kernels of the region (codegen/backward.py) when its vjp forms regions;
    else the eager vjp of the region's own ATen ops, recomputed from the saved inputs.
    With a BWD config (tuned and verified as generated_bwd for the full masks) the full masks' kernel
    runs whatever this call needs, so the kernel that runs is the verified one; without one ("" =
    the heuristic), the kernel of this call's masks."""
    ins = ctx.saved_tensors
    ir = store.load(ctx.key)
    grads = list(grads)
    if ctx.bwd_config:
        need_in, need_out = BW.full_masks(ir)
        grads = [g if g is not None or not w else _zeros(ir, k, ins) for k, (g, w) in enumerate(
            zip(grads, need_out, strict=True))]
    else:
        need_in, need_out = ctx.need, tuple(g is not None for g in grads)
    plan = BW.plan(ctx.key, need_in, need_out)
    if not plan.ok:
        return eager_vjp(ir, ins, grads), None, None
    cfg = ctx.bwd_config
    # each kernel through the op (a profile sees them); the BWD schedule is the main kernel's
    outs = BW.run_kernels(plan, BW.backward_inputs(plan, ins, grads),
                          lambda k, key, xs: generated_op(xs, key, cfg if k == plan.main else ""))
    dx = BW.input_grads(plan, outs, ins, grads)
    return [d if need else None for d, need in zip(dx, ctx.need, strict=True)], None, None


def _zeros(ir: RegionIR, k: int, ins: Sequence[torch.Tensor]) -> torch.Tensor:
    m = ir.out_meta(ir.outputs[k])
    return torch.zeros(m.shape, dtype=m.dtype, device=ins[0].device if ins else torch.device(ir.device))


def eager_vjp(ir: RegionIR, ins: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> list[Any]:
    """The vjp of the region's own ATen ops run again under torch.autograd (the fallback backward)."""
    with torch.enable_grad():
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in ins]
        outs = REF.replay(ir, xs)
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
    wrt = [x for x in xs if x.requires_grad]
    got: tuple[torch.Tensor | None, ...] = ()
    if pairs and wrt:
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    it = iter(got)
    return [next(it, None) if x.requires_grad else None for x in xs]


torch.library.register_autograd("solforge::generated", _backward, setup_context=_setup)
generated_op = torch.ops.solforge.generated.default
