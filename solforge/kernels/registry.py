"""The kernel families: one table (`FAMILIES`), one record per family, and the family contract.

Everything that lists or inspects families reads this file: the planner (which matchers run, in
which order), the tuner and verifier (a family's module and hooks), training (a forward family's
backward family), api/integrate, the CLI's help, the profiler's kinds and the kernel database's
source hash (a family's module). A new family is its own files (kernels/<name>.py, plan/<name>.py,
kernels/<name>_bwd.py for a tuned backward, tests) plus one row here; tests/test_family_contract.py
runs every row through the contract below.

Importing this module is cheap: no torch, no kernel. A family's module and matcher are imported
when first asked for (`module`, `matcher`). No kernel module imports this one: the kernel
database's template hash covers the solforge.kernels modules a family imports, so a new row would
otherwise re-tune every family.

The record (`Family`)
---------------------
name       the family's name: its Workload.family, its custom op `torch.ops.solforge.<name>`, its
           database key's family
module     the kernel module implementing the contract (solforge.kernels.<name>)
kind       what the profiler counts its regions as (profile/kinds.py's KINDS)
matcher    "module:function" finding its regions in an ATen graph (plan.Match list); None for a
           backward family, which has no region of its own (it runs inside its forward op's backward)
backward   the backward family that tunes the kernel the forward op's autograd backward calls
           (None: none is tuned; the forward may still have a backward, e.g. linear_cross_entropy
           computes its gradients in the forward)
is_backward  a backward family (its workloads come from a forward's `backward_workload`)
joins      where a family's region gives way to generated regions next to it, so that they form
           through it as one kernel (plan.find_matches); it stays the family's where no generated
           region then takes it together with other ops. "neighbors": a generated region (or a
           pointwise op no region holds) reads its result or computes its input (gelu, a one-op
           pointwise family: KernelBench level 2's ReLU -> LeakyReLU -> GELU -> Sigmoid -> bias add
           ran as three kernels and ATen's GELU); "readers": only one that reads its result
           (layernorm: KernelBench level 2's LayerNorm -> GELU -> scale ran as the family's kernel
           and a generated one, two passes where torch.compile makes one; a LayerNorm before a
           matmul, or fed by a residual add, keeps its family); "" never

The table's order of forward families is the planner's first-claim-wins order (see `FAMILIES`).
A dotted name that is not in the table (tests' fake families: "fakes.broken") is a module path: `get`
gives an ad-hoc record for it (kind "other", no matcher, no backward).

The contract: what a family module defines
------------------------------------------
Required (tune/__init__.py and tune/verify.py call these on every family):
  FAMILY                  the family's name, the record's `name`
  Config                  a frozen dataclass of one kernel configuration: `variant`, `items()` (its
                          fields as (name, value) pairs, the Candidate's config), `encode()` (the
                          config string the op takes; "" is the heuristic) and `decode(text)`;
                          `Config(**dict(items))` rebuilds it
  space(wl)               the configs worth trying on a workload (each passes is_valid)
  is_valid(config, wl)    whether a config can run that workload
  heuristic(wl)           the config used untuned (it passes is_valid; the op runs it for "")
  make_inputs(wl, *, seed, rows=None, device=None) -> (args, kwargs)
                          fresh random inputs of the workload; `rows` replaces the size that
                          `verify_rows` names (the verifier's odd shape)
  <name>(*args, config=, out=None, **kwargs)
                          the launcher (`launcher`): runs the kernel, writing into `out` when given
                          (a tuple for a family with several outputs)
  <name>_ref(*args, **kwargs)
                          the reference (`reference`), in fp32 or wider where the model's own
                          rounding allows; a backward family's is autograd through its forward's
Optional (the accessors below give the default when a module leaves one out):
  backward_workload(wl) -> Workload | None
                          a forward family's backward workload (family `backward`); default None:
                          nothing to tune for its backward (train mode leaves it alone)
  output_tolerance(wl) -> Tolerance | tuple[Tolerance | None, ...] | None
                          a wider tolerance than the output dtype's (one, or one per output);
                          default None: numerics.TOLERANCES for the output's dtype
  verify_rows(wl) -> int  the size the verifier's odd shape replaces; default the first input's
                          first dimension (wl.shapes[0][0])
  baseline_grads(wl) -> tuple[int, ...]
                          a forward family whose kernel computes gradients too (linear_cross_entropy):
                          the region inputs its baseline is differentiated for; default (): the
                          baseline is the region's forward alone
  baseline_leaves(wl) -> tuple[int, ...]
                          a backward family: the region inputs eager's backward is timed for;
                          default every floating-point input
  norm_error_bound(wl) -> float | tuple[float | None, ...] | None
                          the verifier's bound on the norm-relative error (kernels that match the
                          reference nearly bit for bit are held to it); default None: none
  edge_inputs(wl, *, seed, rows, device) -> [(label, args, kwargs), ...]
                          the family's edge cases (large magnitudes, zero rows, masked rows: the
                          helpers are in kernels/edges.py; `args` may be a function returning
                          (args, kwargs), drawn when its trial runs); default none
  VERIFY_STRIDED          False: the odd-shape trial passes contiguous inputs only; default True
  SPACE_SPREAD            True: `space` is ordered so that any prefix is a spread of it (tune/order.py):
                          the evolutionary search's first population follows that order instead of
                          random draws; default False
  SHAPE_FIXED             True: kernels built for the workload's exact sizes (make_inputs ignores
                          `rows`); default False
Conventions, not called through here: `workload_for(...)` (builds the Workload of one call; the
matcher and tests use it), the `torch.ops.solforge.<name>` op with its fake and autograd formula.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.fx as fx

    from solforge.plan.match import Match
    from solforge.records import Workload


@dataclass(frozen=True)
class Family:
    """One row of the table (see the module's docstring for each field)."""

    name: str
    module: str
    kind: str
    matcher: str | None = None
    backward: str | None = None
    is_backward: bool = False
    joins: str = ""  # "", "neighbors" or "readers" (the docstring)

    @property
    def is_forward(self) -> bool:
        """A family the planner matches (it has a matcher)."""
        return self.matcher is not None

    @property
    def short(self) -> str:
        """The last part of the name: what the launcher and reference are named after."""
        return self.name.rpartition(".")[2]


def _fwd(name: str, kind: str, backward: str | None, joins: str = "") -> Family:
    return Family(name, f"solforge.kernels.{name}", kind, f"solforge.plan.{name}:match", backward, joins=joins)


def _bwd(name: str, kind: str) -> Family:
    return Family(name, f"solforge.kernels.{name}", kind, is_backward=True)


# Forward families in matching order: first claim wins. rope takes the q/k RMSNorms it fuses, and
# a residual add + norm is one add_rmsnorm (add_layernorm), before the rmsnorm (layernorm) matcher
# sees them. The LayerNorm families share no node with the others (their norm is one ATen op), so
# their place among them changes nothing; they come after the RMSNorm families, before swiglu.
# cross_entropy (a _log_softmax + nll_loss_forward, with the casts and views feeding them) and
# softmax (a _softmax and its casts) share no node with the others or each other; softmax is last,
# so a future family that fuses a softmax into something larger (attention) claims it first. gelu
# comes after swiglu, which claims the aten.gelu of a gated gelu(gate) * up; a bare gelu (GPT-2's
# MLP) is gelu's. linear_cross_entropy is a cross_entropy region plus the projection feeding it
# (where the logits have no other use): it comes just before cross_entropy, which takes the loss
# alone otherwise. Backward families follow (they match nothing).
FAMILIES: tuple[Family, ...] = (
    _fwd("rope", "pointwise", "rope_bwd"),
    _fwd("add_rmsnorm", "normalization", "rmsnorm_bwd"),
    _fwd("rmsnorm", "normalization", "rmsnorm_bwd"),
    _fwd("add_layernorm", "normalization", "layernorm_bwd"),
    _fwd("layernorm", "normalization", "layernorm_bwd", joins="readers"),
    _fwd("swiglu", "pointwise", "swiglu_bwd"),
    _fwd("gelu", "pointwise", "gelu_bwd", joins="neighbors"),
    # the LM head's projection (and its gradients' GEMMs) dominate; gradients come from its forward
    _fwd("linear_cross_entropy", "gemm", None),
    _fwd("cross_entropy", "reduction", "cross_entropy_bwd"),
    _fwd("softmax", "reduction", "softmax_bwd"),
    # last: solforge's own generator takes every memory-bound region no family claimed (its matcher
    # also gets the nodes the families claimed: plan.find_matches); its backward is generated too,
    # from the region's vjp (codegen/backward.py), where that forms one region
    _fwd("generated", "pointwise", "generated_bwd"),
    _bwd("rope_bwd", "pointwise"),
    _bwd("rmsnorm_bwd", "normalization"),
    _bwd("layernorm_bwd", "normalization"),
    _bwd("swiglu_bwd", "pointwise"),
    _bwd("gelu_bwd", "pointwise"),
    _bwd("cross_entropy_bwd", "reduction"),
    _bwd("softmax_bwd", "reduction"),
    _bwd("generated_bwd", "pointwise"),
)

_BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}

FamilyLike = Family | ModuleType | str


# ----------------------------------------------------------------------------------------------
# The table


def names() -> tuple[str, ...]:
    """Every registered family, forward ones first in matching order."""
    return tuple(_BY_NAME)


def forward_names() -> tuple[str, ...]:
    """The families the planner matches, in its first-claim-wins order."""
    return tuple(f.name for f in FAMILIES if f.is_forward)


def backward_names() -> tuple[str, ...]:
    """The backward families (tuned in train mode), in the table's order."""
    return tuple(f.name for f in FAMILIES if f.is_backward)


def known(name: str) -> bool:
    return name in _BY_NAME


def get(name: str) -> Family:
    """The family's record; a dotted name outside the table is a module path (an ad-hoc record)."""
    fam = _BY_NAME.get(name)
    if fam is not None:
        return fam
    if "." in name:
        return Family(name, name, "other")
    raise LookupError(f"unknown kernel family {name!r}: choose from {', '.join(names())}")


def joins_generated(name: str) -> str:
    """How the family's regions give way to generated regions next to them (field `joins`: "" never)."""
    fam = _BY_NAME.get(name)
    return fam.joins if fam is not None else ""


def kind(name: str) -> str | None:
    """The profile kind of a registered family (None for a name outside the table)."""
    fam = _BY_NAME.get(name)
    return None if fam is None else fam.kind


def module_path(name: str) -> str | None:
    """The module path of a family by name, without importing it (None for an unknown name)."""
    try:
        return get(name).module
    except LookupError:
        return None


def module(fam: FamilyLike) -> ModuleType:
    """The family's kernel module (imported on first use)."""
    if isinstance(fam, ModuleType):
        return fam
    rec = fam if isinstance(fam, Family) else get(fam)
    return importlib.import_module(rec.module)


def matcher(fam: Family) -> Callable[[fx.Graph], list[Match]]:
    """The family's matcher function (imported on first use)."""
    if fam.matcher is None:
        raise ValueError(f"{fam.name} has no matcher (a backward family)")
    mod, _, fn = fam.matcher.partition(":")
    return getattr(importlib.import_module(mod), fn)


def matchers() -> dict[str, Callable[[fx.Graph], list[Match]]]:
    """Every forward family's matcher, in matching order (first claim wins)."""
    return {f.name: matcher(f) for f in FAMILIES if f.is_forward}


# ----------------------------------------------------------------------------------------------
# The contract's hooks, with their defaults


def _name(mod: ModuleType) -> str:
    return str(mod.FAMILY).rpartition(".")[2]


def launcher(fam: FamilyLike) -> Callable[..., Any]:
    """The launcher: the function named like the family (the last part of a dotted name)."""
    mod = module(fam)
    return getattr(mod, _name(mod))


def reference(fam: FamilyLike) -> Callable[..., Any]:
    """The reference: `<name>_ref`."""
    mod = module(fam)
    return getattr(mod, f"{_name(mod)}_ref")


def config_class(fam: FamilyLike) -> Any:
    return module(fam).Config


def space(fam: FamilyLike, wl: Workload) -> list[Any]:
    return list(module(fam).space(wl))


def is_valid(fam: FamilyLike, config: Any, wl: Workload) -> bool:
    return bool(module(fam).is_valid(config, wl))


def heuristic(fam: FamilyLike, wl: Workload) -> Any:
    return module(fam).heuristic(wl)


def make_inputs(fam: FamilyLike, wl: Workload, *, seed: int, rows: int | None = None,
                device: Any = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return module(fam).make_inputs(wl, seed=seed, rows=rows, device=device)


def _hook(fam: FamilyLike, name: str) -> Callable[..., Any] | None:
    return getattr(module(fam), name, None)


def backward_workload(fam: FamilyLike, wl: Workload) -> Workload | None:
    """The forward workload's backward workload; None: nothing to tune for its backward."""
    hook = _hook(fam, "backward_workload")
    return None if hook is None else hook(wl)


def output_tolerance(fam: FamilyLike, wl: Workload) -> Any:
    """A family's own tolerance (one, or one per output); None: the output dtype's."""
    hook = _hook(fam, "output_tolerance")
    return None if hook is None else hook(wl)


def eager_outputs(fam: FamilyLike) -> Any:
    """A family's `eager_outputs(*args, **kwargs)`: the outputs as the model's own ops compute them
    in their own dtypes (generated regions), which the verifier measures the element tolerance
    against (tune/verify.py); None where the family has none."""
    return _hook(fam, "eager_outputs")


def verify_rows(fam: FamilyLike, wl: Workload) -> int:
    """The size the verifier's odd shape replaces (default: the first input's first dimension; 1
    for a workload without inputs or whose first input is a scalar)."""
    hook = _hook(fam, "verify_rows")
    if hook is not None:
        return int(hook(wl))
    return int(wl.shapes[0][0]) if wl.shapes and wl.shapes[0] else 1


def norm_error_bound(fam: FamilyLike, wl: Workload) -> Any:
    """The largest norm-relative error the verifier accepts (one, or one per output); None: no
    bound beyond the element tolerance. A family whose kernels match the reference (nearly) bit for
    bit declares one, so an off-by-one reduction inside the dtype's element tolerance still fails."""
    hook = _hook(fam, "norm_error_bound")
    return None if hook is None else hook(wl)


def edge_inputs(fam: FamilyLike, wl: Workload, *, seed: int, rows: int, device: Any) -> list[Any]:
    """The family's edge cases for the verifier: (label, args, kwargs) triples (default none)."""
    hook = _hook(fam, "edge_inputs")
    return [] if hook is None else list(hook(wl, seed=seed, rows=rows, device=device))


def verify_strided(fam: FamilyLike) -> bool:
    """Whether the verifier's odd-shape trial may pass strided inputs (default yes)."""
    return bool(getattr(module(fam), "VERIFY_STRIDED", True))


def shape_fixed(fam: FamilyLike) -> bool:
    """A family whose kernels are built for the workload's exact shapes (the generated family: the
    sizes are literals of its source): `make_inputs(rows=)` keeps the workload's sizes, and the
    verifier's odd shape is one more trial at them. Default False."""
    return bool(getattr(module(fam), "SHAPE_FIXED", False))


def space_spread(fam: FamilyLike) -> bool:
    """A family whose `space` comes ordered as a spread (tune/order.py): the search's first
    candidates take it in that order. Default False."""
    return bool(getattr(module(fam), "SPACE_SPREAD", False))


def baseline_grads(fam: FamilyLike, wl: Workload) -> tuple[int, ...]:
    """The region inputs a forward family's baseline is differentiated for (default none)."""
    hook = _hook(fam, "baseline_grads")
    return tuple(hook(wl)) if hook is not None else ()


def baseline_leaves(fam: FamilyLike, wl: Workload, args: Sequence[Any]) -> tuple[int, ...]:
    """The region inputs (of `args`) eager's backward is timed for (default: every floating one)."""
    hook = _hook(fam, "baseline_leaves")
    if hook is not None:
        return tuple(hook(wl))
    return tuple(i for i, a in enumerate(args) if a.dtype.is_floating_point)


REQUIRED = ("FAMILY", "Config", "space", "is_valid", "heuristic", "make_inputs")
OPTIONAL = ("backward_workload", "output_tolerance", "verify_rows", "baseline_grads", "baseline_leaves",
            "norm_error_bound", "edge_inputs", "VERIFY_STRIDED", "SHAPE_FIXED", "SPACE_SPREAD")


def missing_hooks(fam: FamilyLike) -> list[str]:
    """The required hooks (launcher and reference included) a family's module lacks: [] when it
    conforms."""
    mod = module(fam)
    if not hasattr(mod, "FAMILY"):
        return ["FAMILY"]
    n = _name(mod)
    return [h for h in (*REQUIRED, n, f"{n}_ref") if not hasattr(mod, h)]
