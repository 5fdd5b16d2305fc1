"""Verify a candidate against its family's reference: nothing unproven enters a model.

A candidate passes only if every trial below agrees with `<family>_ref`, on fresh seeded inputs:
  - workload-shape trials through `out=`: a seeded random count of them, from `trials` to
    `trials + EXTRA_CALLS` (a kernel right for its first few calls only cannot know how many come);
  - an odd shape (a row count that differs from the workload's and is no multiple of any block),
    with strided inputs: each contiguous input of 2+ dims is passed as a view into a wider buffer
    whose padding is NaN (a kernel that assumes packed rows reads the padding or the wrong rows);
  - the family's edge inputs (`family.edge_inputs`: large magnitudes, all-zero or fully masked
    rows, ... declared by the family as data; small shapes where its configs allow);
  - the model's path: the launcher called WITHOUT `out=` (as the custom op calls it), at the
    workload shape and at the odd shape; its result must be fresh tensors shaped and typed like
    the reference, not an input.
Each `out=` trial allocates its outputs inside a larger buffer (tune/guarded.py): poisoned with NaN
(an unwritten element fails), with guard regions of random bytes on both sides (a write past
either end fails). On every trial: inputs are unchanged; every element is within the dtype's
tolerance (numerics.compare; `family.output_tolerance` may widen it); where the reference is
NaN/Inf the output is the same NaN/Inf; and, where the family declares `norm_error_bound`, the
norm-relative error ||out - ref|| / ||ref|| is within it (a family whose kernels match the
reference bit for bit or nearly is held to that, far below the element tolerance). A family with
`eager_outputs` (the region's own ops in their own dtypes: generated regions) has each output's
absolute tolerance raised to EAGER_FACTOR times the model's own error on trial 1's inputs, where
that is larger: a long fp32 reduction whose terms cancel is off by more than the dtype's element
tolerance in eager too, and a kernel is held to the model's accuracy, not to a stricter one.
A family whose reference returns a tuple gets a tuple of outputs, each checked.

Large workloads (inputs and outputs above LARGE_BYTES; KernelBench's level 1 has 6-14 GB tensors)
are verified with the same trials in less memory: the model's path at the workload shape comes
first, and the workload-shape trials after it call the candidate again on its inputs (still a
seeded random count of calls, each checked against the reference, each with a fresh poisoned
output), so the reference runs at that shape once; snapshots of large inputs are kept on the host; comparisons
work in chunks; a reference that does not fit on the device runs on the host (same function,
slower) and its outputs come back to the device.

Family hooks (all optional but make_inputs and the reference): `verify_rows(wl)` (the size the odd
shape replaces), `output_tolerance(wl)`, `norm_error_bound(wl)` (a float, or a tuple with one per
output, None for none), `edge_inputs(wl, *, seed, rows, device)` -> [(label, args, kwargs)] (`rows`:
the odd shape's, for a family whose configs are valid only near the workload's row count; `args`
may be a function returning (args, kwargs), called when its trial runs: inputs too large to hold
several sets of at once),
`VERIFY_STRIDED = False` (a family whose launcher takes contiguous inputs only).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from solforge.kernels import registry
from solforge.numerics import Tolerance, chunks, compare, tolerance
from solforge.records import Verdict, Workload
from solforge.tune.guarded import Guarded, guard_damage, guarded_like

Launch = Callable[..., Any]
Outputs = torch.Tensor | tuple[torch.Tensor, ...]

# Extra workload-shape trials beyond `trials`, drawn per verification.
EXTRA_CALLS = 3
# Padding of a strided input's last dim: its rows start 16-byte aligned for any dtype.
PAD = 8
# A family with `eager_outputs` (generated regions) gets an absolute tolerance of at least this many
# times the error of the model's own ops against the reference, on trial 1's inputs.
EAGER_FACTOR = 4.0
# Above this many bytes of a workload's inputs and outputs, trials at the workload shape share one
# set of inputs and one reference, and input snapshots are kept on the host (see the docstring).
LARGE_BYTES = 1 << 30
# the model path's poisoned blocks per output (`_prepoison`), and the size above which it is one
POISON_BLOCKS = 4
POISON_BYTES = 256 << 20


def odd_rows(rows: int) -> int:
    """A row count near `rows` that is odd, not a multiple of any power-of-two block (2^k+1 style
    counts straddle block edges) and not `rows` itself (an odd workload would get no second shape).
    Kept small so the interpreter stays quick."""
    r = max(3, min(rows, 4099) // 2 * 2 + 1) if rows > 2 else 3
    if r == rows:  # up, not down: a tile of rows valid for `rows` stays valid for more (swiglu's)
        r = rows + 2
    return r


@dataclass(frozen=True)
class _Trial:
    label: str
    seed: int
    rows: int | None = None  # None: the workload's
    model: bool = False  # the model's path: no out=, the launcher's result is checked
    strided: bool = False
    # (args, kwargs), or (a function returning them, {}): edge_inputs
    edge: tuple[Any, dict[str, Any]] | None = field(default=None, compare=False)
    reuse: bool = False  # a large workload: the inputs (and reference) of the first trial, called again


def _items(x: Outputs) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _snapshot(args: tuple[Any, ...]) -> list[torch.Tensor | None]:
    """A copy of each tensor input, on the host when it is large (the device may have no room)."""
    return [(a.to("cpu", copy=True) if a.is_cuda and a.numel() * a.element_size() > LARGE_BYTES // 4
             else a.clone()) if isinstance(a, torch.Tensor) else None for a in args]


def _unchanged(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal of an input and its snapshot, which may be on the host."""
    if a.device == b.device:
        return torch.equal(a, b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return all(torch.equal(x, y.to(x.device)) for x, y in zip(chunks(a), chunks(b), strict=True))


def _eager_tolerance(eager: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                     refs: tuple[torch.Tensor, ...], tol: Any) -> Any:
    """`tol` with each output's atol raised to EAGER_FACTOR x the eager outputs' max |error|."""
    try:
        got = _items(eager(*args, **kwargs))
    except torch.OutOfMemoryError:
        return tol
    out = []
    for j, (e, r) in enumerate(zip(got, refs, strict=True)):
        base = (tol[j] if isinstance(tol, tuple) else tol) or tolerance(r.dtype)
        if not r.dtype.is_floating_point:  # indices and masks stay exact (an index off by one is wrong)
            out.append(base)
            continue
        err = compare(e, r, base).max_abs_err
        out.append(Tolerance(max(base.atol, EAGER_FACTOR * err), base.rtol) if math.isfinite(err) else base)
    return tuple(out)


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, tuple | list):
        return sum(_nbytes(v) for v in x)
    return 0


def _reference(ref_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The reference's outputs; on the host when it runs out of device memory (wide fp64 copies of a
    several-GB input), then moved back to the inputs' device."""
    try:
        return ref_fn(*args, **kwargs)
    except torch.cuda.OutOfMemoryError:
        pass
    torch.cuda.empty_cache()
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    host = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    ref = ref_fn(*host, **{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    del host
    return tuple(r.to(dev) for r in ref) if isinstance(ref, tuple) else ref.to(dev)


def _strided(a: Any) -> Any:
    """A contiguous tensor of 2+ dims as a view of its values into rows PAD elements wider, the
    padding NaN (floating point) so a kernel that reads it shows it."""
    if not isinstance(a, torch.Tensor) or a.dim() < 2 or not a.is_contiguous() or a.numel() == 0:
        return a
    wide = torch.empty(*a.shape[:-1], a.shape[-1] + PAD, dtype=a.dtype, device=a.device)
    if a.is_floating_point():
        wide.fill_(float("nan"))
    else:
        wide.zero_()
    view = wide[..., :a.shape[-1]]
    view.copy_(a)
    return view


def _plan(family: ModuleType, workload: Workload, trials: int, seed: int, device: str | None,
          large: bool = False) -> list[_Trial]:
    rows = registry.verify_rows(family, workload)
    odd = odd_rows(rows)
    # seeded per workload too, so two workloads verified with the same seed differ in their count
    k = random.Random(f"{seed}:{workload.key}").randint(max(3, trials), max(3, trials) + EXTRA_CALLS)
    plan = [_Trial(f"trial {i + 1}", seed + 7919 * i, reuse=large) for i in range(k)]
    model = _Trial("model path (no out=, workload shape)", seed + 7919 * (k + 2), model=True)
    if large:
        # first, its inputs the ones the workload-shape trials reuse: no earlier call has left the
        # right answer for them in freed memory, where a launcher's unwritten element would find it
        # (a softmax skipping its last row on the model's path passed about one CPU run in three
        # when it came after them)
        plan.insert(0, model)
    strided = registry.verify_strided(family)
    plan.append(_Trial(f"odd shape ({odd} rows{', strided inputs' if strided else ''})", seed + 7919 * k, odd,
                       strided=strided))
    for label, args, kwargs in registry.edge_inputs(family, workload, seed=seed + 7919 * (k + 1), rows=odd,
                                                     device=device):
        plan.append(_Trial(f"edge '{label}'", 0, edge=(args if callable(args) else tuple(args), dict(kwargs))))
    if not large:
        plan.append(model)
    # the odd shape again, contiguous, as the model passes it
    plan.append(_Trial(f"model path (no out=, {odd} rows)", seed + 7919 * (k + 3), odd, model=True))
    return plan


def _shares_storage(t: torch.Tensor, args: tuple[Any, ...]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.numel() and a.untyped_storage().data_ptr() == ptr for a in args)


def _model_result(got: Any, refs: tuple[torch.Tensor, ...], args: tuple[Any, ...]) -> str | None:
    """Why the launcher's own result (no out=) cannot be the op's output, or None."""
    outs = got if isinstance(got, tuple) else (got,)
    if len(outs) != len(refs) or not all(isinstance(o, torch.Tensor) for o in outs):
        return f"returned {type(got).__name__} of {len(outs)}, expected {len(refs)} tensor(s)"
    for j, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"output {j} is {o.dtype} {tuple(o.shape)}, expected {r.dtype} {tuple(r.shape)}"
        if o.numel() and _shares_storage(o, args):
            return f"output {j} shares memory with an input (an op's output must be a new tensor)"
    return None


def _nonfinite_mismatch(o: torch.Tensor, r: torch.Tensor) -> str | None:
    """Where the reference is NaN/+Inf/-Inf, the output must be the same (compare checks only that
    the output is finite where the reference is)."""
    n = 0
    for oc, rc in zip(chunks(o), chunks(r), strict=True):
        bad = ~torch.isfinite(rc)
        if not bool(bad.any()):
            continue
        of, rf = oc[bad].double(), rc[bad].double()
        n += int((~((of.isnan() & rf.isnan()) | (of == rf))).sum())
    return f"{n} element(s) differ from the reference's NaN/Inf" if n else None


def _norm_err(o: torch.Tensor, r: torch.Tensor) -> float:
    """||o - r|| / ||r|| over the reference's finite elements (0/0 = 0)."""
    num2, den2 = 0.0, 0.0
    for oc, rc in zip(chunks(o), chunks(r), strict=True):
        fin = torch.isfinite(rc)
        od, rd = oc.double()[fin], rc.double()[fin]
        num2 += float(torch.linalg.vector_norm(od - rd)) ** 2
        den2 += float(torch.linalg.vector_norm(rd)) ** 2
    num, den = math.sqrt(num2), math.sqrt(den2)
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def _prepoison(refs: tuple[torch.Tensor, ...]) -> None:
    """Fill and free blocks of the outputs' sizes, so the allocations the launcher then makes likely
    reuse NaN (best effort: an element it leaves unwritten then fails rather than holding whatever
    the allocator had, which could be an earlier call's right answer). POISON_BLOCKS of each (one
    above POISON_BYTES): a launcher that allocates its result, then a second tensor of that size to
    return, got the poisoned block for the first and, for the second, an older one: with a large
    workload's reused inputs, an earlier trial's right output (a softmax skipping its last row
    passed about one CPU run in three)."""
    blocks = []
    for r in refs:
        fill = float("nan") if r.dtype.is_floating_point else -1
        n = POISON_BLOCKS if r.numel() * r.element_size() <= POISON_BYTES else 1
        blocks += [torch.empty_like(r).fill_(fill) for _ in range(n)]
    del blocks  # freed together: each allocation of the outputs' size then finds a poisoned one


@dataclass
class _Worst:
    """The largest errors seen so far (the Verdict's)."""

    abs: float = 0.0
    rel: float = 0.0
    norm: float = 0.0


def _check(t: _Trial, args: tuple[Any, ...], before: list[torch.Tensor | None], refs: tuple[torch.Tensor, ...],
           got: Any, guards: list[Guarded], tol: Any, bound: Any, worst: _Worst) -> str | None:
    """Why trial `t` failed, or None: `got` is the launcher's result on the model's path, `guards`
    the outputs it was given otherwise."""
    for a, b in zip(args, before, strict=True):
        if b is not None and not _unchanged(a, b):
            return f"{t.label}: an input was modified"
    if t.model:
        why = _model_result(got, refs, args)
        if why is not None:
            return f"{t.label}: {why}"
        outs = _items(got)
    else:
        for j, g in enumerate(guards):
            damage = guard_damage(g)
            if damage is not None:
                return f"{t.label}{f', output {j}' if len(guards) > 1 else ''}: {damage}"
        outs = tuple(g.out for g in guards)
    for j, (o, expected) in enumerate(zip(outs, refs, strict=True)):
        what = f"{t.label}, output {j}" if len(outs) > 1 else t.label
        c = compare(o, expected, tol[j] if isinstance(tol, tuple) else tol)
        worst.abs, worst.rel = max(worst.abs, c.max_abs_err), max(worst.rel, c.max_rel_err)
        if not c.ok:
            return f"{what}: {c.reason}"
        why = _nonfinite_mismatch(o, expected)
        if why is not None:
            return f"{what}: {why}"
        b = bound[j] if isinstance(bound, tuple) else bound
        norm = _norm_err(o, expected)
        worst.norm = max(worst.norm, norm)
        if b is not None and norm > b:
            return f"{what}: norm-relative error {norm:.3g} > the family's bound {b:.3g}"
    return None


def verify(family: ModuleType, workload: Workload, launch: Launch, *, trials: int = 3, seed: int = 1234,
           device: str | None = None) -> Verdict:
    """`launch(*args, out=out, **kwargs)` runs the candidate (and `launch(*args, **kwargs)` returns its
    outputs); the family's `make_inputs` draws inputs and its reference computes the expected
    outputs; the hooks and their defaults: kernels/registry.py."""
    ref_fn = registry.reference(family)
    # a family may widen the output dtype's tolerance where its semantics need it (documented there),
    # one for all outputs or a tuple with one per output
    tol = registry.output_tolerance(family, workload)
    bound = registry.norm_error_bound(family, workload)
    eager = registry.eager_outputs(family)
    worst = _Worst()
    try:
        plan = _plan(family, workload, trials, seed, device)
    except Exception as e:
        return Verdict(False, reason=f"edge inputs: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    try:
        probe: Any = registry.make_inputs(family, workload, seed=plan[0].seed, rows=plan[0].rows, device=device)
    except Exception as e:
        return Verdict(False, reason=f"{plan[0].label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    large = _nbytes(probe[0]) * 2 > LARGE_BYTES  # the outputs are about the inputs' size
    if large:
        plan = _plan(family, workload, trials, seed, device, large=True)
    # trial 1's inputs, their snapshot and reference, kept for the trials that reuse them
    shared: tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor | None], Any] | None = None
    for i, t in enumerate(plan):
        guards: list[Guarded] = []
        got: Any = None
        try:
            if t.reuse and shared is not None:
                args, kwargs, before, ref = shared
            else:
                # free the previous trial's tensors (kept while shared) before drawing new ones
                shared = args = kwargs = before = ref = None
                if t.edge is not None:
                    args, kwargs = t.edge[0]() if callable(t.edge[0]) else t.edge
                elif probe is not None:
                    (args, kwargs), probe = probe, None
                else:
                    args, kwargs = registry.make_inputs(family, workload, seed=t.seed, rows=t.rows, device=device)
                if t.strided:
                    args = tuple(_strided(a) for a in args)
                before = _snapshot(args)
                ref = _reference(ref_fn, args, kwargs)
                if i == 0 and eager is not None:
                    tol = _eager_tolerance(eager, args, kwargs, _items(ref), tol)
                if large and i == 0:
                    shared = (args, kwargs, before, ref)
            refs = _items(ref)
            if t.model:
                _prepoison(refs)
                got = launch(*args, **kwargs)
            else:
                guards = [guarded_like(r, t.seed + 31 * j) for j, r in enumerate(refs)]
                out = tuple(g.out for g in guards) if isinstance(ref, tuple) else guards[0].out
                launch(*args, out=out, **kwargs)
            if any(r.is_cuda for r in refs):
                torch.cuda.synchronize()
        except Exception as e:
            return Verdict(False, trials=i, reason=f"{t.label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                           if str(e) else f"{t.label}: {type(e).__name__}")

        why = _check(t, args, before, refs, got, guards, tol, bound, worst)
        if why is not None:
            return Verdict(False, trials=i, max_abs_err=worst.abs, max_rel_err=worst.rel, reason=why,
                           max_norm_err=worst.norm)
        del guards, got, refs
        if shared is None:
            del args, kwargs, before, ref
    return Verdict(True, trials=len(plan), max_abs_err=worst.abs, max_rel_err=worst.rel, max_norm_err=worst.norm)
