"""Tune: candidates -> build -> verify -> time -> keep the fastest verified one.

The loop is small on purpose (docs/design.md, Style): the variety lives in the family's `space()`.
Every candidate ends as a TuningRecord; a failure is a record with its reason, never an exception.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from solforge.kernels import registry
from solforge.records import BuildResult, Candidate, RunResult, TuneResult, TuningRecord, Verdict, Workload
from solforge.tune.timing import confirm, time_kernel
from solforge.tune.verify import verify

if TYPE_CHECKING:
    from solforge.db import KernelDB
    from solforge.tune.runners import Runner

BACKEND = "triton"
Progress = Callable[[TuningRecord], None]
# Candidates proposed per worker at a time: enough to keep a worker and its builders busy,
# few enough that the wall budget is checked often.
BATCH_PER_WORKER = 4
# Evolutionary search stops after this many measurements in a row without a 1% improvement.
PATIENCE = 48
# Finalists timed again side by side at the end of a tune (confirm_finalists): the fastest few,
# those within FINALIST_SPREAD of the fastest. The search times candidates minutes apart, on a GPU
# whose clock, temperature and neighbours move meanwhile (and a database's records come from other
# runs): close configs are ranked only when timed together.
FINALISTS = 4
FINALIST_SPREAD = 0.10


def family_module(name: str) -> ModuleType:
    """The family's kernel module, from the registry (kernels/registry.py); a dotted name outside
    its table is a module path (fake families in tests)."""
    return registry.module(name)


def launcher_of(family: ModuleType) -> Callable[..., Any]:
    """The family's launcher (registry.launcher: the function named like the family)."""
    return registry.launcher(family)


def candidates(family: ModuleType, workload: Workload) -> list[Candidate]:
    """The heuristic config first (so even a tiny budget yields a verified default), then the space."""
    configs = [registry.heuristic(family, workload)]
    configs += [c for c in registry.space(family, workload) if c != configs[0]]
    return [Candidate(workload, BACKEND, c.variant, c.items()) for c in configs]


def _config(family: ModuleType, cand: Candidate) -> Any:
    return registry.config_class(family)(**cand.config_dict)


def measure(family: ModuleType, cand: Candidate, *, device: str, seed: int = 0,
            on_stage: Callable[[str], None] | None = None, build_only: bool = False) -> TuningRecord:
    """Build, verify and (if verified) time one candidate. `on_stage("build"|"verify"|"time")` is
    called as each stage starts (a worker process reports it, so a hang is blamed on its stage).
    `build_only`: stop after the build (a compile-only builder worker).

    Memory: a candidate that runs out of it (torch.OutOfMemoryError, at any stage) is a failure
    record. The build's inputs are not held while verification draws its own (the same inputs are
    drawn again for the timing), so a workload whose tensors take gigabytes needs room for one set
    of them at a time, not two."""
    stage = on_stage or (lambda _: None)
    config = _config(family, cand)
    launcher = launcher_of(family)

    def launch(*args: Any, **kwargs: Any) -> torch.Tensor:
        return launcher(*args, config=config, **kwargs)

    # build: Triton compiles on first launch, so a launch at the workload's shape is the build
    t = time.perf_counter()
    stage("build")
    try:
        args, kwargs = registry.make_inputs(family, cand.workload, seed=seed, device=device)
        launch(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        build = BuildResult(True, time.perf_counter() - t)
    except Exception as e:
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        return TuningRecord(cand, BuildResult(False, time.perf_counter() - t, msg))
    if build_only:
        return TuningRecord(cand, build)
    del args, kwargs
    stage("verify")
    try:
        verdict = verify(family, cand.workload, launch, seed=seed + 1, device=device)
    except torch.OutOfMemoryError as e:  # outside verify's trials: comparing two large outputs, say
        verdict = Verdict(False, reason=_oom(e))
    if not verdict.passed:
        return TuningRecord(cand, build, verdict)
    stage("time")
    try:
        args, kwargs = registry.make_inputs(family, cand.workload, seed=seed, device=device)  # the build's again
    except torch.OutOfMemoryError as e:
        return TuningRecord(cand, build, verdict, RunResult(error=_oom(e)))
    run = time_kernel(lambda: launch(*args, **kwargs), device)
    return TuningRecord(cand, build, verdict, run)


def _oom(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def confirm_times(cands: Sequence[Candidate], *, device: str, seed: int = 0) -> list[RunResult]:
    """Time candidates of one workload side by side (timing.confirm: rounds, each timing every
    candidate in turn, on one set of inputs). What a runner does for `Runner.confirm`; a candidate
    that cannot run gets a RunResult with its error."""
    fns: list[Callable[[], Any]] = []
    inputs: dict[Workload, tuple[Any, Any]] = {}
    for cand in cands:
        family = family_module(cand.workload.family)
        try:
            if cand.workload not in inputs:
                inputs[cand.workload] = registry.make_inputs(family, cand.workload, seed=seed, device=device)
            args, kwargs = inputs[cand.workload]
            launcher, config = launcher_of(family), _config(family, cand)
            fns.append(lambda launcher=launcher, config=config, args=args, kwargs=kwargs:
                       launcher(*args, config=config, **kwargs))
        except Exception as e:
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            fns.append(lambda msg=msg: (_ for _ in ()).throw(RuntimeError(msg)))
    return confirm(fns, device)


def finalists(pool: Sequence[TuningRecord]) -> list[TuningRecord]:
    """The verified GPU-timed records worth timing again together: up to FINALISTS, fastest first,
    within FINALIST_SPREAD of the fastest. Fewer than two: nothing to confirm."""
    ok = sorted((r for r in pool if r.ok and r.run is not None and r.run.meaningful), key=lambda r: r.time_us)
    if not ok:
        return []
    top = [r for r in ok if r.time_us <= ok[0].time_us * (1 + FINALIST_SPREAD)][:FINALISTS]
    return top if len(top) > 1 else []


def confirm_finalists(pool: Sequence[TuningRecord], run: Runner) -> list[TuningRecord]:
    """The finalists of `pool` with their runs replaced by their side-by-side times (provenance
    ("search_us", the search's time) added), those whose confirmation failed left out; [] when
    there is nothing to confirm. The winner is the fastest of these when there are any: only they
    were timed together."""
    final = finalists(pool)
    if not final:
        return []
    times = run.confirm([r.candidate for r in final])
    return [dataclasses.replace(r, run=t, provenance=(*r.provenance, ("search_us", r.time_us)))
            for r, t in zip(final, times, strict=True) if t.ok and t.meaningful]


# Build errors that repeat for the same kernel source, Triton version and device (the database key):
# Triton's compile errors (triton.compiler.errors), ptxas's, and resources a config asks for beyond
# the device's (shared memory: triton.runtime.errors.OutOfResources)
_COMPILE_ERRORS = ("CompilationError", "CompileTimeAssertionFailure", "UnsupportedLanguageConstruct",
                   "PTXASError", "OutOfResources")


def reusable(known: Sequence[TuningRecord]) -> list[TuningRecord]:
    """Earlier measurements a search may take as they are: successes, and candidates that Triton
    failed to compile (that failure repeats: each try costs a compile). Any other failure is
    measured again: it can come from the machine (out of memory next to another job, a worker that
    crashed or hung, a CPU run without Triton's interpreter), and kept, it would stop the workload
    from ever getting a kernel without --retune."""
    return [k for k in known if k.ok or (not k.build.ok and (k.build.error or "").startswith(_COMPILE_ERRORS))]


def tune(workload: Workload, baseline: RunResult, *, device: str, budget_s: float,
         max_candidates: int | None = None, progress: Progress | None = None, runner: Runner | None = None,
         strategy: str = "auto", db: KernelDB | None = None, run_id: str = "", seed: int = 0,
         retune: bool = False, resume: bool = False) -> TuneResult:
    """Search the family's space for `workload` until the strategy is done or a budget runs out;
    the fastest verified candidate wins.

    With a database: a workload it holds a winner for is not measured again (the winner comes
    back with source "database") unless `retune` (search again from the start) or, for a search
    the budget cut short, `resume` (go on where it stopped: what was measured is observed, not
    re-measured). Every record is stored as soon as it is measured, so a killed run resumes too.
    The first batch always runs, whatever the budget, so a verified kernel exists if any can."""
    from solforge.tune.runners import LocalRunner
    from solforge.tune.search import make_strategy, search

    family = family_module(workload.family)
    if db is not None and not retune:
        win = db.winner(workload)
        if win is not None and (dict(win.provenance).get("complete") or not resume):
            return TuneResult(workload, baseline, (), win, source="database", known=len(db.known(workload)))
    known = reusable(db.known(workload)) if db is not None and not retune else []
    strat = make_strategy(strategy, family, workload, seed=seed, known=known)
    own = runner is None
    run = runner or LocalRunner(device, seed=seed)
    done: list[bool] = []

    def measure(cands: Sequence[Candidate]) -> Iterator[TuningRecord]:
        for rec in run.measure(cands):
            if db is not None:
                db.add(workload, rec, run_id=run_id)
            yield rec

    def report(rec: TuningRecord) -> None:
        if progress is not None:
            progress(rec)

    try:
        records = search(strat, measure, budget_s=budget_s, max_candidates=max_candidates,
                         batch=_batch(run),
                         patience=PATIENCE if strat.name == "evolutionary" else None,
                         progress=report, on_done=done.append)
        mine = {r.candidate for r in records}
        pool = records + [k for k in known if k.candidate not in mine]
        confirmed = confirm_finalists(pool, run)
    finally:
        if own:
            run.close()
    best = _winner(family, workload, confirmed or pool)
    complete = bool(done and done[-1])
    if best is not None:
        search_us = dict(best.provenance).get("search_us")
        best = dataclasses.replace(best, provenance=(
            ("complete", complete), ("run", run_id), ("strategy", strat.name), ("measured", len(pool)),
            *((("confirmed", len(confirmed)), ("search_us", search_us)) if search_us is not None else ())))
        if db is not None:
            db.set_winner(workload, best, run_id=run_id)
    return TuneResult(workload, baseline, tuple(records), best, source="tuned", known=len(pool) - len(records))


def _batch(run: Runner) -> int:
    """Candidates proposed at a time: one for a lone in-process worker, so the wall budget is
    checked after every candidate (an interpreter candidate takes seconds); several per worker
    when workers or builders run side by side, so none of them waits for the next proposal."""
    if run.parallelism <= 1 and getattr(run, "builder", None) is None:
        return 1
    return max(1, run.parallelism) * BATCH_PER_WORKER


def _winner(family: ModuleType, workload: Workload, pool: Sequence[TuningRecord]) -> TuningRecord | None:
    """The fastest verified record. Off the GPU (the interpreter) a time says nothing about a
    kernel: the heuristic's record wins there if it verified (else the first verified one), not
    whichever config the interpreter ran fastest (a tiny tile that then costs seconds per call, as
    rope's 1-token tile did on qwen3-tiny)."""
    ok = [r for r in pool if r.ok]
    if not ok:
        return None
    if all(r.run is not None and r.run.meaningful for r in ok):
        return min(ok, key=lambda r: r.time_us)
    h = registry.heuristic(family, workload).items()
    return next((r for r in ok if r.candidate.config == h), ok[0])
