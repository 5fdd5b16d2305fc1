"""One candidate's measurement, and what it needs: a family's module and launcher (through the
registry), the candidates of a workload, `measure` (build -> verify -> time one candidate) and
`confirm_times` (time candidates side by side).

Here, not in tune/__init__.py, because the runners (tune/runners.py, the worker processes) and the
search (tune/search.py) call these while tune/__init__.py's `tune` drives both: tune -> runners,
search -> tune.measuring runs one way. solforge.tune re-exports every name. (Not "measure.py": the
package re-exports the function `measure`, which a submodule of that name would shadow.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from solforge.kernels import registry
from solforge.records import BuildResult, Candidate, RunResult, TuningRecord, Verdict, Workload
from solforge.tune.timing import confirm, time_kernel
from solforge.tune.verify import verify

BACKEND = "triton"


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
