"""Profile: where one forward's device time goes, by region, against the device's ceilings.

    compile the model with a backend that lowers each graph to ATen (as capture does), cuts it into
    regions (regions.py) and wraps them in profiler ranges -> warm up -> time one forward ->
    profile one forward (trace.py) -> attribute kernels to regions -> roofline + Amdahl ranking.

`profile_model` returns a `Profile` record; it raises UserError only for what the user must fix
(a model that does not run, a profile without device kernels).
"""

from __future__ import annotations

import math
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import LoweringCache, Rewrite, SolforgeBackend, compile_with, static_shapes
from solforge.errors import UserError
from solforge.profile import roofline
from solforge.profile.ceilings import get_ceilings
from solforge.profile.kinds import KINDS, VIEW
from solforge.profile.regions import Region, annotate, fold_layers, partition
from solforge.profile.trace import Attribution, attribute, run_profiled
from solforge.records import Ceilings, Profile, RegionProfile
from solforge.tune.timing import time_model

__all__ = ["Profile", "RegionProfile", "profile_model", "summarize"]

COMPLETE_FRACTION = 0.95  # of the device's busy time that must land in regions


class _Annotator:
    """The rewrite given to SolforgeBackend: optionally another rewrite first (the integrator,
    to profile an optimized model), then regions + profiler ranges."""

    def __init__(self, before: Rewrite | None, families: Sequence[str] | None) -> None:
        self.before, self.families = before, families
        self.regions: list[Region] = []
        self.graphs = 0

    def __call__(self, gm: fx.GraphModule, index: int) -> fx.GraphModule:
        if self.before is not None:
            gm = self.before(gm, index)
        regions = partition(gm.graph, index, first_id=len(self.regions), families=self.families)
        self.regions += regions
        self.graphs += 1
        return annotate(gm, regions)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def profile_model(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    device: str,
    name: str = "",
    rewrite: Rewrite | None = None,
    families: Sequence[str] | None = None,
    ceilings: Ceilings | None = None,
    ceilings_cache: str | Path | None = None,
    trace_path: str | Path | None = None,
    lowering_cache: LoweringCache | None = None,
) -> Profile:
    """Profile one forward of `model` (inference). With `rewrite`, each captured graph is passed
    through it first (how the optimized model is profiled). With `trace_path`, the Chrome trace
    is kept there. With `lowering_cache`, a graph the capture lowered is read back, not traced
    through make_fx again."""
    annotator = _Annotator(rewrite, families)
    backend = SolforgeBackend(rewrite=annotator, cache=lowering_cache)
    compiled = compile_with(model, backend)
    inputs = tuple(example_inputs)

    def forward() -> Any:
        with torch.no_grad():
            return compiled(*inputs)

    try:
        with static_shapes():  # the graph of these inputs' shapes, as the capture's
            forward()  # compiles
    except Exception as e:
        raise UserError(f"the model failed to run on its example inputs: {_one_line(e)}") from e
    notes = list(backend.errors)
    ceil = ceilings or get_ceilings(device, cache=ceilings_cache)
    timed = None
    if device == "cuda":  # on the CPU the profiled forward's own span is the measurement (below)
        timed = time_model(forward, device)
        if not timed.ok:
            raise UserError(f"the model failed to run on its example inputs: {timed.error}")

    keep = trace_path is not None
    path = Path(trace_path) if keep else Path(tempfile.mkstemp(prefix="solforge-trace-", suffix=".json")[1])
    try:
        events = run_profiled(forward, device=device, trace_path=path)
    except OSError as e:
        raise UserError(f"cannot write the trace to {path}: {e.strerror or e}") from e
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    att = attribute(events, gpu=device == "cuda")
    if att.kernels == 0:
        what = "GPU kernels" if device == "cuda" else "ATen ops"
        raise UserError(f"the profile of {name or 'the model'} holds no {what}: nothing ran on the device "
                        "during the profiled forward (is the model on the device it was asked to run on?)")
    # On the CPU one wall-clock run says little (the first calls of an op are slow): the profiled
    # forward's own span is the measurement there. On a GPU, CUDA events around unprofiled runs.
    forward_us = timed.p50_us if timed is not None else att.span_us
    return summarize(annotator.regions, att, ceil, name=name, device=device, forward_us=forward_us,
                     graphs=annotator.graphs, notes=notes, trace=str(path) if keep else None)


def summarize(regions: Sequence[Region], att: Attribution, ceil: Ceilings, *, name: str, device: str,
              forward_us: float, graphs: int = 0, notes: Sequence[str] = (), trace: str | None = None) -> Profile:
    """Group region instances by key, put each group against the roofline, rank by Amdahl saving."""
    notes = list(notes)
    groups: dict[str, list[Region]] = defaultdict(list)
    for r in regions:
        groups[r.key].append(r)
    rows: list[RegionProfile] = []
    for key, members in groups.items():
        r0 = members[0]
        t = sum(att.region_us.get(r.id, 0.0) for r in members)
        k = sum(att.region_kernels.get(r.id, 0) for r in members)
        if r0.family == VIEW and k == 0:
            continue  # views only: nothing ran
        n = len(members)
        sol = roofline.sol_us(r0.bytes, r0.flops, ceil, r0.dtype)
        gbs, tflops = roofline.achieved(r0.bytes, r0.flops, n, t)
        rows.append(RegionProfile(
            key=key, family=r0.family, kind=r0.kind, label=r0.label, count=n,
            # one workload can serve several modules (input and post-attention norms, the final norm)
            module=", ".join(dict.fromkeys(fold_layers(r.module) for r in members)),
            kernels=k, time_us=t, bytes=r0.bytes, flops=r0.flops, sol_us=sol, achieved_gbs=gbs,
            achieved_tflops=tflops, pct_of_sol=roofline.pct_of_sol(sol, n, t),
            bound=roofline.bound(r0.bytes, r0.flops, t / k if k else 0.0, ceil, r0.dtype) if k else "-",
            saving_us=roofline.saving_us(t, n, sol), workload=r0.workload,
            modules=tuple(dict.fromkeys(r.module for r in members if r.module))[:4],
        ))
    rows.sort(key=lambda p: (-p.saving_us, -p.time_us, p.key))
    rows = [RegionProfile(**{**p.__dict__, "rank": i + 1}) for i, p in enumerate(rows)]

    by_kind = {k: 0.0 for k in KINDS}
    by_family: dict[str, list[float]] = {}
    for p in rows:
        by_kind[p.kind] = by_kind.get(p.kind, 0.0) + p.time_us
        f = by_family.setdefault(p.family, [0, 0.0])
        f[0] += p.count
        f[1] += p.time_us
    attributed = att.attributed_us
    complete = att.unlinked == 0 and att.busy_us > 0 and attributed >= COMPLETE_FRACTION * att.busy_us
    if att.unlinked:
        notes.append(f"{att.unlinked} kernel(s) could not be linked to their launch: the profile is partial")
    if att.outside_us > 0:
        notes.append(f"{att.outside_us:,.1f} us in {att.outside_kernels} kernel(s) launched outside every graph "
                     "region (dynamo's wrapper or a graph that was not lowered)")
    meaningful = device == "cuda" and ceil.meaningful
    if not meaningful:
        notes.append("no GPU: CPU ops stand in for kernels and the ceilings are a CPU's; these times mean nothing "
                     "for a GPU")
    elif math.isfinite(forward_us) and forward_us > 0 and abs(attributed - forward_us) > 0.05 * forward_us:
        notes.append(f"regions add up to {attributed / forward_us:.1%} of the measured forward: the GPU was idle "
                     f"{max(0.0, att.span_us - att.busy_us):,.0f} us of the {att.span_us:,.0f} us it was profiled "
                     "(launch/host bound)")
    return Profile(
        model=name, device=ceil.device, meaningful=meaningful, forward_us=forward_us, span_us=att.span_us,
        busy_us=att.busy_us, attributed_us=attributed, outside_us=att.outside_us,
        idle_us=max(0.0, att.span_us - att.busy_us), kernels=att.kernels, complete=complete, ceilings=ceil,
        regions=tuple(rows), by_kind=tuple(by_kind.items()),
        by_family=tuple((f, int(v[0]), v[1]) for f, v in sorted(by_family.items(), key=lambda kv: -kv[1][1])),
        graphs=graphs, trace=trace, notes=tuple(notes),
    )


def ranking(profile: Profile) -> Callable[[str], float]:
    """Workload key -> Amdahl saving in this profile (0 for a workload it did not see)."""
    saving: dict[str, float] = {}
    for p in profile.regions:
        if p.workload is not None:
            saving[p.workload] = saving.get(p.workload, 0.0) + p.saving_us
    return lambda key: saving.get(key, 0.0)
