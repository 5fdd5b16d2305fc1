"""The model-level guarantee: what `optimize` returns.

On a GPU, `optimize` returns a model that passed the end-to-end check and is not slower end to end
than the original, or the original itself. When the model with every verified kernel fails the
check or is slower, subsets are tried: the forward workloads whose kernels save the least (their
measured region time less the kernel's, times the regions' count; in training with their
backward's) are left as the model ran them, first the one that saves least, then half of them,
then all but the one that saves most, each subset integrated and validated again (at most
MAX_SUBSETS runs more). The first subset that passes and is not slower is returned ("subset");
if none does, the original model object is returned, unchanged ("original"). A model slower end to
end although every kernel beat its region is mostly host-bound (launches) or a kernel slower in
the model than alone; leaving the smallest savings out first takes out the launches that buy
least.

Off the GPU (Triton's interpreter) times mean nothing, so the speed rule does not apply and no
subset is tried (each would cost interpreter minutes): a model that fails the check gives the
original back. `keep_slower` returns the full model whatever the check or the clock said (for
analysis), the report saying what was wrong with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from solforge.records import Attempt, E2EReport, TuneResult, Workload

# validate runs spent on subsets after the full model, at most
MAX_SUBSETS = 3

OPTIMIZED, SUBSET, ORIGINAL = "optimized", "subset", "original"

Run = tuple[Any, E2EReport]  # a model and its end-to-end result


@dataclass
class Choice:
    """What optimize returns and why. `e2e`: the returned model's check (the full model's when the
    original comes back: what was wrong with it); `dropped`: the forward workloads the returned
    model leaves as the model ran them, beyond those the tune kept out (every one for the original)."""

    model: Any
    returned: str
    why: str
    e2e: E2EReport | None
    dropped: frozenset[Workload] = frozenset()
    attempts: list[Attempt] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)  # every model validated (the caller releases the others)


def acceptable(e2e: E2EReport, meaningful: bool) -> bool:
    """Passed the check and, where times mean something, not slower end to end (timed at all)."""
    return e2e.passed and (not meaningful or (e2e.speedup is not None and e2e.speedup >= 1.0))


def problem(e2e: E2EReport, meaningful: bool) -> str:
    """What is wrong with a model that is not `acceptable`, with the numbers."""
    if not e2e.passed:
        return f"the end-to-end check failed ({e2e.note or 'no reason given'})"
    if e2e.speedup is None:
        return "the optimized model could not be timed end to end"
    return (f"the optimized model is slower end to end than the original ({e2e.speedup:.2f}x: "
            f"{e2e.optimized_ms:,.2f} ms against {e2e.baseline_ms:,.2f} ms)")


def failed_run(e: BaseException) -> E2EReport:
    """The end-to-end result of a model that raised while being checked (out of memory, say)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return E2EReport(None, None, None, math.inf, math.inf, None, False,
                     note=f"running it raised {type(e).__name__}: {text}"[:300])


def gains(groups: Sequence[Any], results: Sequence[TuneResult], integrated: set[Workload]) -> dict[Workload, float]:
    """Per integrated forward workload, the µs its kernels save per call of the model as the tune
    measured them: (region time - kernel time) x the regions' count, its backward's added (a
    backward group names its forward). A time not measured counts as no saving."""
    out = {w: 0.0 for w in integrated}
    for g, r in zip(groups, results, strict=True):
        fwd = g.forward or g.workload
        if fwd in out and r.speedup is not None and r.best is not None:
            out[fwd] += (r.baseline.p50_us - r.best.time_us) * g.count
    return out


def subsets(saved: Mapping[Workload, float], limit: int = MAX_SUBSETS) -> list[frozenset[Workload]]:
    """The sets of workloads to leave out, in the order tried: the smallest saving alone, then the
    smaller half, then all but the largest saving (fewer for few workloads; never all of them)."""
    order = sorted(saved, key=lambda w: (saved[w], w.key))  # smallest saving first
    n = len(order)
    out: list[frozenset[Workload]] = []
    for k in (1, n // 2, n - 1):  # how many to leave out
        s = frozenset(order[:k])
        if 0 < k < n and s not in out:
            out.append(s)
    return out[:limit]


def _attempt(dropped: frozenset[Workload], regions: int, e2e: E2EReport) -> Attempt:
    return Attempt(dropped=tuple(sorted(w.key for w in dropped)), regions=regions, passed=e2e.passed,
                   speedup=e2e.speedup, baseline_ms=e2e.baseline_ms, optimized_ms=e2e.optimized_ms, note=e2e.note)


def choose(original: Any, full: Run, retry: Callable[[frozenset[Workload]], Run], saved: Mapping[Workload, float],
           *, meaningful: bool, keep_slower: bool = False, hint: str = "") -> Choice:
    """The module doc's rule. `full`: the model with every winner and its check; `retry(dropped)`:
    a model without the kernels of `dropped`, and its check; `saved`: each integrated forward
    workload's saving (`gains`); `hint`: what the caller knows of a slow result (host time)."""
    model, e2e = full
    n = len(saved)
    choice = Choice(model, OPTIMIZED, "", e2e, attempts=[_attempt(frozenset(), n, e2e)], runs=[full])
    if acceptable(e2e, meaningful):
        choice.why = (f"verified and faster end to end ({e2e.speedup:.2f}x)" if meaningful and e2e.speedup
                      else "verified end to end (off the GPU: its timings mean nothing, so speed is not judged)")
        return choice
    wrong = problem(e2e, meaningful) + (f"; {hint}" if hint and e2e.passed else "")
    if keep_slower:
        choice.why = f"{wrong}; returned all the same (keep_slower)"
        return choice
    if meaningful:
        for dropped in subsets(saved):
            run = retry(dropped)
            choice.runs.append(run)
            choice.attempts.append(_attempt(dropped, n - len(dropped), run[1]))
            if acceptable(run[1], meaningful):
                names = ", ".join(sorted(w.key for w in dropped))
                choice.model, choice.returned, choice.e2e, choice.dropped = run[0], SUBSET, run[1], dropped
                choice.why = (f"{wrong}; without the kernels of {len(dropped)} of its {n} workloads ({names}) it "
                              f"passed and ran at {run[1].speedup:.2f}x")
                return choice
    tried = len(choice.attempts) - 1
    choice.model, choice.returned, choice.dropped = original, ORIGINAL, frozenset(saved)
    choice.why = wrong + (f"; none of {tried} subsets tried was verified and not slower" if tried else "")
    return choice


def release(stats: Any) -> None:
    """A model `optimize` does not return (an IntegrationStats' graphs): its CUDA-graph captures and
    their memory go now, and its graphs capture no more (dynamo's cache keeps the graphs themselves
    as long as the model's code lives, but nothing calls them)."""
    from solforge.runtime.traingraphs import give_back_pool

    for step in stats.step_graphs:
        step.auto = False
        step.release()
    give_back_pool()
