"""Tune: candidates -> build -> verify -> time -> keep the fastest verified one.

The loop is small on purpose (DESIGN.md, Style): the variety lives in the family's `space()`.
Every candidate ends as a TuningRecord; a failure is a record with its reason, never an exception.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from solforge.records import BuildResult, Candidate, RunResult, TuneResult, TuningRecord, Workload
from solforge.tune.timing import time_kernel
from solforge.tune.verify import verify

BACKEND = "triton"
Progress = Callable[[TuningRecord], None]


def family_module(name: str) -> ModuleType:
    """`solforge.kernels.<name>`; a dotted name is a module path (fake families in tests)."""
    return importlib.import_module(name if "." in name else f"solforge.kernels.{name}")


def launcher_of(family: ModuleType) -> Callable[..., Any]:
    """The family's launcher: the function named like the family (the last part of a dotted name)."""
    return getattr(family, family.FAMILY.rpartition(".")[2])


def candidates(family: ModuleType, workload: Workload) -> list[Candidate]:
    """The heuristic config first (so even a tiny budget yields a verified default), then the space."""
    configs = [family.heuristic(workload)]
    configs += [c for c in family.space(workload) if c != configs[0]]
    return [Candidate(workload, BACKEND, c.variant, c.items()) for c in configs]


def _config(family: ModuleType, cand: Candidate) -> Any:
    return family.Config(**cand.config_dict)


def measure(family: ModuleType, cand: Candidate, *, device: str, seed: int = 0,
            on_stage: Callable[[str], None] | None = None) -> TuningRecord:
    """Build, verify and (if verified) time one candidate. `on_stage("build"|"verify"|"time")` is
    called as each stage starts (a worker process reports it, so a hang is blamed on its stage)."""
    stage = on_stage or (lambda _: None)
    config = _config(family, cand)
    launcher = launcher_of(family)

    def launch(*args: Any, **kwargs: Any) -> torch.Tensor:
        return launcher(*args, config=config, **kwargs)

    # build: Triton compiles on first launch, so a launch at the workload's shape is the build
    t = time.perf_counter()
    stage("build")
    try:
        args, kwargs = family.make_inputs(cand.workload, seed=seed, device=device)
        launch(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        build = BuildResult(True, time.perf_counter() - t)
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        return TuningRecord(cand, BuildResult(False, time.perf_counter() - t, msg))
    stage("verify")
    verdict = verify(family, cand.workload, launch, seed=seed + 1, device=device)
    if not verdict.passed:
        return TuningRecord(cand, build, verdict)
    stage("time")
    run = time_kernel(lambda: launch(*args, **kwargs), device)
    return TuningRecord(cand, build, verdict, run)


def tune(workload: Workload, baseline: RunResult, *, device: str, budget_s: float,
         max_candidates: int | None = None, progress: Progress | None = None) -> TuneResult:
    """Measure candidates until the space or the budget runs out; the fastest verified one wins.

    The first candidate always runs, whatever the budget, so a verified kernel exists if any can."""
    family = family_module(workload.family)
    cands = candidates(family, workload)
    if max_candidates is not None:
        cands = cands[:max_candidates]
    records: list[TuningRecord] = []
    start = time.perf_counter()
    for cand in cands:
        if records and time.perf_counter() - start > budget_s:
            break
        rec = measure(family, cand, device=device)
        records.append(rec)
        if progress is not None:
            progress(rec)
    ok = [r for r in records if r.ok]
    # Off the GPU (the interpreter) a time says nothing about a kernel: keep the first verified
    # candidate, the heuristic, rather than whichever config the interpreter ran fastest (a tiny
    # tile that then costs seconds per call, as rope's 1-token tile did on qwen3-tiny).
    meaningful = all(r.run is not None and r.run.meaningful for r in ok)
    best = (min(ok, key=lambda r: r.time_us) if meaningful else ok[0]) if ok else None
    return TuneResult(workload, baseline, tuple(records), best)
