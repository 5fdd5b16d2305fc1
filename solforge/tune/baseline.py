"""The baseline of a region: its time as the model ran it (the extracted ATen subgraph), what a
kernel must beat to be used."""

from __future__ import annotations

import torch

from solforge import plan as _plan
from solforge.kernels import registry
from solforge.records import RunResult
from solforge.tune.timing import time_kernel

OUT_OF_MEMORY = "OutOfMemoryError"  # how a baseline's error starts when the region did not fit


def region_baseline(group: _plan.WorkloadGroup, device: str) -> RunResult:
    """Time the region exactly as the model ran it (the extracted ATen subgraph); for a backward
    group, eager autograd's backward of that subgraph. A region that does not fit beside the model
    (its inputs drawn afresh, its outputs, eager's backward) gives a RunResult whose error starts
    with OUT_OF_MEMORY (`untimed`), never an exception."""
    try:
        return _baseline(group, device)
    except torch.OutOfMemoryError as e:
        err = f"{OUT_OF_MEMORY}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    if device == "cuda":
        torch.cuda.empty_cache()  # what the attempt cached goes back before the next region's
    return RunResult(error=err)


def untimed(baseline: RunResult) -> bool:
    """Whether the region could not be timed for want of memory (it is then left as it is)."""
    return (baseline.error or "").startswith(OUT_OF_MEMORY)


def _baseline(group: _plan.WorkloadGroup, device: str) -> RunResult:
    assert group.example is not None
    sub, metas = _plan.extract(group.example[1])
    gen = torch.Generator(device="cpu").manual_seed(0)
    # integer inputs (cross-entropy targets, indices) as 0/1: valid for any class count or size
    cpu = torch.device("cpu")  # the generator's device, also under a CUDA default device
    args = [torch.randn(tuple(m.shape), generator=gen, device=cpu, dtype=torch.float32).to(device=device, dtype=m.dtype)
            if m.dtype.is_floating_point else
            torch.randint(0, 2, tuple(m.shape), generator=gen, device=cpu).to(device=device, dtype=m.dtype)
            for m in metas]
    if group.forward is not None:
        return _backward_baseline(group, sub, args, gen, device)
    # a family whose kernel also computes its region's gradients (linear_cross_entropy) names the
    # inputs they are for: its region is then timed with their backward, as the kernel is
    wants = registry.baseline_grads(group.workload.family, group.workload)
    if wants:
        leaves = [args[i].requires_grad_(True) for i in wants]
        return time_kernel(lambda: torch.autograd.grad(sub(*args), leaves), device)
    with torch.no_grad():
        return time_kernel(lambda: sub(*args), device)


def _backward_baseline(group: _plan.WorkloadGroup, sub: torch.fx.GraphModule, args: list[torch.Tensor],
                       gen: torch.Generator, device: str) -> RunResult:
    """Eager's backward of the region: the subgraph run forward once with the inputs the backward
    kernel differentiates as requires_grad leaves (the bwd family's `baseline_leaves(workload)`,
    default every floating-point input), then `torch.autograd.grad` of its outputs timed alone,
    with random incoming gradients in the outputs' own layout (what the next op hands over)."""
    assert group.example is not None
    idx = registry.baseline_leaves(group.workload.family, group.workload, args)
    # a leaf the region reads only through ops left outside it (a transpose): the value it reads
    read = [bool(n.users) for n in sub.graph.nodes if n.op == "placeholder"]
    derived = _plan.derived_inputs(group.example[1])
    via = {i: [k for k, src in derived.items() if src == i and read[k]] for i in idx}
    idx = tuple(dict.fromkeys(j for i in idx if i < len(args) for j in ((i,) if read[i] else via[i])))
    leaves = [args[i].requires_grad_(True) for i in idx]
    with torch.enable_grad():
        out = sub(*args)
    outs = tuple(o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad)
    grads = tuple(torch.empty_like(o).copy_(torch.randn(tuple(o.shape), generator=gen, device="cpu")) for o in outs)
    return time_kernel(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True), device)
