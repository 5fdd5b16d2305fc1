"""The tune stage of `optimize`: every workload group in turn, its baseline (from the kernel
database where an earlier run timed it), then a search on the runner within its share of the
budget, or the database's winner."""

from __future__ import annotations

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
    try:
        for group in groups:
            reporter.stage("tune", group.workload.key)
            assert group.example is not None
            sig = _plan.region_signature(group.example[1])
            # a known kernel's region was timed by an earlier run on this device and software: a
            # warm run reuses that time rather than timing every region again
            baseline = kdb.baseline(group.workload, sig) if kdb is not None and group.workload in cached else None
            if baseline is not None:
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
                res = tune(group.workload, baseline, device=device, budget_s=left / (len(todo) - todo.index(group)),
                           max_candidates=opts.max_candidates, progress=reporter.tune_step, runner=run,
                           strategy=opts.strategy, db=kdb, run_id=run_id, retune=opts.retune, resume=opts.resume)
            reporter.tune_end(res)
            out.results.append(res)
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
