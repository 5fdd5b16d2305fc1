"""torch.distributed around an optimized model: DDP and FSDP2 (`fully_shard`).

What works (tests/test_distributed.py, gloo on the CPU, 2 processes):
- DDP: optimize the module, then wrap it in `DistributedDataParallel`, or wrap it and optimize
  `ddp.module` (the module inside). The DDP wrapper itself is refused (`check_wrapper`): its
  reducer runs in its forward, and optimize would trace and validate that.
- FSDP2: `fully_shard` then optimize, or optimize then `fully_shard` (both train correctly; only
  the first lets the end-to-end check measure the sharded step: the second measured slower than
  eager FSDP2 on two H100s, so it runs as the original model from its first call after the
  shard, with a warning, runtime/inplace.py). FSDP2's hooks (all-gather
  before a sharded module's forward, reduce-scatter after its backward) are `torch._dynamo.disable`d,
  so the capture breaks its graphs around them: every collective runs eagerly, between solforge's
  graphs, never inside one. The parameters a graph reads are FSDP2's unsharded ones.

Each rank runs optimize itself, so every rank must make the same calls of the model in the same
order (each call of a sharded model all-gathers). optimize takes the parameters whose gradients
it checks from the model with every FSDP2 unit resharded (`resting`): the capture runs forwards
alone, after which a root unit keeps its unsharded tensors registered, and the check would then
clear and compare those while FSDP2's reduce-scatter set the sharded ones' `.grad`, which the
user's first step would add to. `validate` then
- compares each gradient's local shard (`local`): a DTensor's own values, no gathering; the
  norm-relative error of the worst shard bounds the whole tensor's from above;
- times a fixed number of calls (no early stop on steady samples, which each rank would reach
  after a different count);
- runs no fp32 copy of the model (each rank would decide on its own numbers whether it needs one);
- and agrees across ranks (`agree`): the check passes only where it passed on every rank, and a
  model's time is its slowest rank's, so every rank keeps or drops the same models and makes the
  same number of calls.
The profile stage (timed forwards, per rank) is skipped under torch.distributed.

CUDA-graph replay of training steps (traingraphs.py) is off while torch.distributed is
initialized (`active`, read per call): FSDP2 frees each unsharded parameter after the forward and
allocates it again before the backward, so a replayed backward could read a weight at an address
that no longer holds it; and under DDP a replayed backward hands autograd every gradient at its
end, which would take away the overlap of DDP's bucketed all-reduces with the backward. Replays of
calls without autograd (stepgraphs.py: evaluation, decode) stay on: their parameters' addresses are
checked on every call, and FSDP2's collectives run outside the graphs. The fused `.grad` adds of
linears.py and embeddings.py are off there too (accumulate.py: DDP and FSDP hook the gradients).
"""

from __future__ import annotations

from typing import Any

import torch

from solforge.errors import UserError


def active() -> bool:
    """Whether a torch.distributed process group is initialized (cheap: read on every training call)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world() -> int:
    return torch.distributed.get_world_size() if active() else 1


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own values on this rank, no communication); any other tensor as it is."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.to_local()
    return t


def check_wrapper(model: Any) -> None:
    """A DDP wrapper is refused with what to do instead (module doc)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise UserError("optimize the module inside DistributedDataParallel (ddp.module), not the DDP wrapper: "
                        "before wrapping it or after, both work")


def gathered(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (every rank must call this); [obj] outside torch.distributed."""
    n = world()
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    torch.distributed.all_gather_object(out, obj)
    return out


def _worst(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def agree(report: Any) -> Any:
    """One end-to-end result (records.E2EReport) for every rank (every rank must call this): passed
    only where every rank's passed, each error and time the largest over the ranks (a step of a
    distributed model takes its slowest rank's time), the note of the first rank that failed. The
    result as it is outside torch.distributed."""
    reports = gathered(report)
    if len(reports) == 1:
        return report
    import dataclasses

    from solforge.records import E2EReport

    assert all(isinstance(r, E2EReport) for r in reports)
    passed = all(r.passed for r in reports)
    failing = next((i for i, r in enumerate(reports) if not r.passed), None)
    note = report.note
    if failing is not None and (report.passed or report.note is None):
        note = f"on rank {failing} of {len(reports)}: {reports[failing].note or 'failed'}"
    base = _worst([r.baseline_ms for r in reports])
    opt = _worst([r.optimized_ms for r in reports])
    if any(r.baseline_ms is None for r in reports) or any(r.optimized_ms is None for r in reports):
        base = opt = None
    return dataclasses.replace(
        report, passed=passed, note=note, baseline_ms=base, optimized_ms=opt,
        speedup=base / opt if base is not None and opt else None,
        max_abs_err=max(r.max_abs_err for r in reports), max_rel_err=max(r.max_rel_err for r in reports),
        grad_max_rel_err=_worst([r.grad_max_rel_err for r in reports]),
        argmax_agree=min((r.argmax_agree for r in reports if r.argmax_agree is not None), default=None),
        argmax_agree_decisive=min((r.argmax_agree_decisive for r in reports if r.argmax_agree_decisive is not None),
                                  default=None),
        baseline_peak_gb=_worst([r.baseline_peak_gb for r in reports]),
        optimized_peak_gb=_worst([r.optimized_peak_gb for r in reports]),
        status="passed" if passed else report.status if report.status != "passed" else "failed",
    )


def resting(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every FSDP2 unit resharded: its registered parameters are then the sharded
    DTensors, whose `.grad` FSDP2's reduce-scatter sets, not the unsharded tensors a root unit
    keeps registered from its forward to its backward (the capture runs forwards alone).
    Returns `model`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return model
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return model
