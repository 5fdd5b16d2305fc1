"""The tune stage of `optimize`: every workload group in turn, its baseline (from the kernel
database where an earlier run timed it), then a search on the runner within its share of the
budget, or the database's winner."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from solforge import plan as _plan
from solforge.kernels import registry
from solforge.options import Options
from solforge.records import TuneResult
from solforge.report.progress import Reporter
from solforge.tune import candidates, tune
from solforge.tune.baseline import region_baseline, untimed

if TYPE_CHECKING:
    from solforge.db import KernelDB
    from solforge.tune.runners import Runner


@dataclass
class TuneStage:
    """What the tune stage produced: one TuneResult per group (in the groups' order), notes, and
    the most memory torch allocated on the GPU during it (bytes; None off the GPU; a process or
    Ray runner's workers allocate in their own processes, not counted here)."""

    results: list[TuneResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    peak_bytes: int | None = None


def known(kdb: KernelDB, workload: Any, resume: bool) -> bool:
    """The database holds a winner for this workload (with `resume`: of a search that finished)."""
    win = kdb.winner(workload)
    return win is not None and (bool(dict(win.provenance).get("complete")) or not resume)


def side_by_side(family: TuneResult, alternative: TuneResult, run: Runner) -> tuple[TuneResult, TuneResult]:
    """The two winners of one region, the family's and its generated alternative's, timed again
    together (the tune's confirmation: rounds timing each in turn), so the comparison that picks
    one (integrate/select.py) is between times taken side by side, not minutes apart. Only where
    both verified with times that mean something (the GPU); a confirmation that fails keeps the
    search's time. The search's time is kept in the record's provenance ("search_us")."""
    a, b = family.best, alternative.best
    if a is None or b is None or not (a.ok and b.ok and a.run is not None and b.run is not None
                                      and a.run.meaningful and b.run.meaningful):
        return family, alternative
    times = run.confirm([a.candidate, b.candidate])
    out = []
    for res, rec, t in zip((family, alternative), (a, b), times, strict=True):
        if t.ok and t.meaningful:
            rec = dataclasses.replace(rec, run=t, provenance=(*rec.provenance, ("search_us", rec.time_us)))
            res = dataclasses.replace(res, best=rec)
        out.append(res)
    return out[0], out[1]


def _itemsize(dtype: str) -> int:
    named = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}.get(dtype)
    t = getattr(torch, dtype, None)
    return named or (t.itemsize if isinstance(t, torch.dtype) else 4)


def weight(group: _plan.WorkloadGroup) -> int:
    """How much of the tuning budget a group's search gets against the others': the bytes its
    workload's inputs hold times the regions it serves, what a memory-bound region's time goes
    with (KernelBench level 2's ConvTranspose2d_Add_Min_GELU_Multiply: regions of 3.7 ms, 147 µs
    and 6 µs each searched with an equal part of what was left of 20 s, H200 2026-11-28)."""
    w = group.workload
    size = sum(math.prod(s) * _itemsize(d) for s, d in zip(w.shapes, w.dtypes, strict=False))
    return max(1, size) * max(1, len(group.regions))


def budget_share(left: float, group: _plan.WorkloadGroup, todo: Sequence[_plan.WorkloadGroup]) -> float:
    """`group`'s part of the `left` seconds shared by it and the groups after it in `todo`, by
    `weight` (each search still measures its first batch however small its part)."""
    rest = todo[todo.index(group):]
    return left * weight(group) / sum(weight(g) for g in rest)


def tune_groups(groups: Sequence[_plan.WorkloadGroup], *, device: str, opts: Options, kdb: KernelDB | None,
                cached: set[Any], run_id: str, reporter: Reporter) -> TuneStage:
    """Tune each group's workload (`cached`: those the database answers without a search); the
    budget left is shared among the groups still to search. A region that cannot be timed for
    want of memory is not tuned: it stays as the model ran it (source "untimed", with a note)."""
    from solforge.tune.runners import make_runner

    out = TuneStage()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    todo = [g for g in groups if g.workload not in cached]
    run = make_runner(opts.runner, device=device, gpus=opts.gpus, timeout_s=opts.timeout,
                      build_workers=opts.build_workers) if todo else None
    stored_baselines = 0
    # per workload, its result so far: a generated alternative (plan/alternatives.py) takes its
    # family's baseline (the same nodes as the model ran them; one that absorbed producers is timed
    # on its own nodes) and is timed beside its family's winner
    done: dict[Any, TuneResult] = {}
    try:
        for group in groups:
            reporter.stage("tune", group.workload.key)
            assert group.example is not None
            rival = done.get(group.alternative_of) if group.alternative_of is not None else None
            sig = _plan.region_signature(group.example[1])
            # a known kernel's region was timed by an earlier run on this device and software: a
            # warm run reuses that time rather than timing every region again
            baseline = kdb.baseline(group.workload, sig) if kdb is not None and group.workload in cached else None
            if baseline is None and rival is not None and not group.absorbed and not untimed(rival.baseline):
                baseline = rival.baseline
            elif baseline is not None:
                stored_baselines += 1
            else:
                baseline = region_baseline(group, device)
                if kdb is not None and baseline.ok:
                    kdb.set_baseline(group.workload, sig, baseline)
            if untimed(baseline):
                res = TuneResult(group.workload, baseline, (), None, source="untimed")
                out.notes.append(f"{group.workload.key}: the region as the model ran it could not be timed "
                                 f"({baseline.error}): left as it is, not tuned")
            elif group.workload in cached:
                res = tune(group.workload, baseline, device=device, budget_s=0, db=kdb)
            else:
                left = max(0.0, opts.budget - (time.perf_counter() - t0))
                n = len(candidates(registry.module(group.workload.family), group.workload))
                reporter.tune_start(group.workload.key, min(n, opts.max_candidates or n))
                res = tune(group.workload, baseline, device=device, budget_s=budget_share(left, group, todo),
                           max_candidates=opts.max_candidates, progress=reporter.tune_step, runner=run,
                           strategy=opts.strategy, db=kdb, run_id=run_id, retune=opts.retune, resume=opts.resume)
            if rival is not None and run is not None:
                rival, res = side_by_side(rival, res, run)
                out.results[out.results.index(done[group.alternative_of])] = rival
                done[group.alternative_of] = rival
            reporter.tune_end(res)
            out.results.append(res)
            done[group.workload] = res
            if res.source == "database" and res.best is not None and not dict(res.best.provenance).get("complete"):
                out.notes.append(f"{group.workload.key}: the database's search was cut short by its budget "
                                 f"({res.known} candidates measured); --resume goes on with it")
    finally:
        if run is not None:
            run.close()
    if device == "cuda":
        out.peak_bytes = torch.cuda.max_memory_allocated()
    if stored_baselines:
        out.notes.append(f"the original time of {stored_baselines} region(s) came from the kernel database "
                         "(measured by an earlier run on this device; --retune measures everything again)")
    return out
