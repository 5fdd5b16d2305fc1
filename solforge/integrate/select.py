"""What enters the model: the workloads whose regions stay as the model ran them (`kept_out`),
the winners' config strings, and the notes on what the integration did."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from solforge import plan as _plan
from solforge.integrate import IntegrationStats, config_text
from solforge.kernels import registry
from solforge.records import TuneResult, Workload


def not_faster(results: Sequence[TuneResult], *, meaningful: bool) -> set[Any]:
    """Workloads whose verified best kernel is slower than the region as the model ran it (only
    where times mean something: on the interpreter every kernel is "slower")."""
    return {r.workload for r in results
            if meaningful and r.best is not None and r.speedup is not None and r.speedup < 1.0}


def kept_out(groups: Sequence[_plan.WorkloadGroup], results: Sequence[TuneResult], *,
             meaningful: bool, keep_slower: bool = False) -> tuple[set[Any], list[str]]:
    """The forward workloads whose regions stay as the model ran them, and notes:
    - a kernel that is not faster than the region as the model ran it (on the GPU, where times
      mean something): never trade the original for a slower kernel, unless `keep_slower` (the
      model with every verified kernel, for analysis: api.optimize's keep_slower), which notes it;
    - a workload with no verified kernel, and in training one whose backward has none: nothing
      unproven enters a model (the heuristic config is not used in their place).
    A backward that is merely slower is used (the fused forward op always runs its own backward
    kernel, so the best backward config is used whatever eager's backward would cost): noted."""
    backward = {g.workload for g in groups if g.forward is not None}
    slower = not_faster([r for r in results if r.workload not in backward], meaningful=meaningful)
    used_slower = slower if keep_slower else set()
    slower = set() if keep_slower else slower
    slow_bwd = not_faster([r for r in results if r.workload in backward], meaningful=meaningful)
    unverified = {r.workload for r in results if r.best is None}
    keep = set(slower) | (unverified - backward)
    notes = []
    for r in results:
        if r.source == "untimed":  # the tune stage said why (its baseline did not fit)
            continue
        if r.workload in unverified:
            what = "its backward" if r.workload in backward else "it"
            notes.append(f"{r.workload.key}: no kernel verified, so {what} stays as the model ran it")
        elif r.workload in slower:
            notes.append(f"kept the original {r.workload.key}: its best kernel ({r.best.time_us:,.1f} µs) is "
                         f"not faster than the region as the model ran it ({r.baseline.p50_us:,.1f} µs)")
        elif r.workload in used_slower:
            notes.append(f"{r.workload.key}: its best kernel ({r.best.time_us:,.1f} µs) is not faster than the "
                         f"region as the model ran it ({r.baseline.p50_us:,.1f} µs); used all the same (keep_slower)")
        elif r.workload in slow_bwd:
            notes.append(f"{r.workload.key}: its best kernel ({r.best.time_us:,.1f} µs) is slower than eager's "
                         f"backward of the region ({r.baseline.p50_us:,.1f} µs); used anyway: the fused forward "
                         "op runs its own backward")
    # a forward whose backward has no verified kernel stays out too: its op would run that backward
    for g in groups:
        if g.forward is not None:
            continue
        bwl = registry.backward_workload(g.workload.family, g.workload)
        if bwl is not None and bwl in unverified:
            keep.add(g.workload)
    return keep, notes


def winner_configs(results: Sequence[TuneResult], keep: set[Any]) -> dict[Workload, str]:
    """Each verified winner's config string (as the custom ops take it), except those in `keep`."""
    return {r.workload: config_text(r.best) for r in results if r.best is not None and r.workload not in keep}


def integration_notes(stats: IntegrationStats, groups: Sequence[_plan.WorkloadGroup],
                      winners: dict[Workload, str]) -> list[str]:
    """What the integration did beyond the planned swaps, and what it did not do."""
    notes = []
    planned = sum(g.count for g in groups if g.workload in winners and g.forward is None)
    if stats.total < planned:
        notes.append(f"integration replaced {stats.total} of {planned} planned regions")
    if stats.grouped:
        notes.append(f"{stats.grouped} linear layers run through linears.py: their backward sums sibling "
                     "input gradients and adds weight gradients to an existing .grad inside the GEMMs "
                     "(SOLFORGE_LINEARS=0 turns this off)")
    if stats.embeddings:
        notes.append(f"{stats.embeddings} embedding(s) run through embeddings.py: their backward adds the gradient "
                     "to an existing .grad only in the rows of the tokens present, with eager's values "
                     "(SOLFORGE_EMBEDDING=0 turns this off)")
    return notes


# ----------------------------------------------------------------------------------------------
# Generated alternatives (plan/alternatives.py): per family region, its kernel or the generator's


@dataclass(frozen=True)
class Pick:
    """The choice between a family's kernel and its region's generated alternative: `won` says the
    generated kernel is integrated; `why` in words; both winners' times (None: no verified one)."""

    family: Workload
    generated: Workload
    won: bool
    why: str
    family_us: float | None
    generated_us: float | None


def _time(r: TuneResult) -> float | None:
    return r.best.time_us if r.best is not None and r.best.ok else None


def generated_wins(family: TuneResult, alternative: TuneResult, *, meaningful: bool,
                   absorbed: bool | Sequence[str] = False) -> tuple[bool, str]:
    """The selection rule: the generated kernel wins only when it verified and, where times mean
    something, was measured faster than the family's verified kernel (a tie goes to the family);
    or when the family has no verified kernel at all. Off the GPU the interpreter's times rank
    nothing: the family keeps its region. An alternative that `absorbed` producers
    (plan/alternatives.py) replaces the family's kernel and those ops as eager ran them: the family
    is charged their time, its alternative's region's eager time less its own (at least 0); the
    note names them where `absorbed` holds their names (the graph's)."""
    g, f = _time(alternative), _time(family)
    if g is None:
        return False, "the generated alternative has no verified kernel"
    if f is None:
        return True, "the family has no verified kernel; the generated one verified"
    assert family.best is not None and alternative.best is not None
    timed = all(r.best is not None and r.best.run is not None and r.best.run.meaningful for r in (family, alternative))
    if not (meaningful and timed):
        return False, "both verified; times mean nothing here (interpreter): the family's kernel is kept"
    name = family.workload.family
    if absorbed:
        if not (family.baseline.ok and alternative.baseline.ok):
            return False, "the absorbed ops' eager time is not known: the family's kernel is kept"
        extra = max(0.0, alternative.baseline.p50_us - family.baseline.p50_us)
        names = list(absorbed) if not isinstance(absorbed, bool) else []
        which = f" ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else ""
        name = f"{name} {f:,.1f} µs + the absorbed ops as eager ran them {extra:,.1f} µs{which} ="
        f += extra
    if g < f:
        return True, f"generated {g:,.1f} µs < {name} {f:,.1f} µs"
    return False, f"{name} {f:,.1f} µs <= generated {g:,.1f} µs"


def pick_alternatives(groups: Sequence[_plan.WorkloadGroup], results: Sequence[TuneResult], *,
                      meaningful: bool) -> tuple[list[_plan.WorkloadGroup], list[TuneResult], list[TuneResult],
                                                 dict[Workload, Pick]]:
    """Split the alternative groups out of the tune's groups and pick per family workload
    (`generated_wins`). Returns the other groups, their results as tuned, their results as judged
    (a family workload whose alternative won carries the alternative's result, re-keyed to the
    family workload, so kept_out and the guarantee judge the kernel that runs), and the picks."""
    by_wl = {g.workload: r for g, r in zip(groups, results, strict=True) if g.alternative_of is None}
    picks: dict[Workload, Pick] = {}
    won: dict[Workload, TuneResult] = {}
    for g, r in zip(groups, results, strict=True):
        if g.alternative_of is None or g.alternative_of not in by_wl:
            continue
        fam = by_wl[g.alternative_of]
        wins, why = generated_wins(fam, r, meaningful=meaningful, absorbed=g.absorbed)
        picks[g.alternative_of] = Pick(g.alternative_of, g.workload, wins, why, _time(fam), _time(r))
        if wins:
            won[g.alternative_of] = dataclasses.replace(r, workload=g.alternative_of)
    rest = [(g, r) for g, r in zip(groups, results, strict=True) if g.alternative_of is None]
    tuned = [r for _, r in rest]
    judged = [won.get(r.workload, r) for r in tuned]
    return [g for g, _ in rest], tuned, judged, picks


def swaps(picks: dict[Workload, Pick], results: Sequence[TuneResult],
          keep: set[Any]) -> dict[Workload, tuple[Workload, str]]:
    """Per family workload whose generated alternative won (and that is not kept out): the
    alternative's workload and config string, for the Integrator."""
    by_wl = {r.workload: r for r in results}
    out = {}
    for f, p in picks.items():
        r = by_wl.get(p.generated)
        if p.won and f not in keep and r is not None and r.best is not None:
            out[f] = (p.generated, config_text(r.best))
    return out


@dataclass
class Selection:
    """What enters the model after tuning (`select`): the groups without their generated
    alternatives, their results as tuned and as judged, the alternatives' picks, the workloads kept
    out, the family workloads swapped for their alternative, the winners' configs, and notes."""

    groups: list[_plan.WorkloadGroup]
    results: list[TuneResult]
    judged: list[TuneResult]
    picks: dict[Workload, Pick]
    keep: set[Any]
    swapped: dict[Workload, tuple[Workload, str]]
    winners: dict[Workload, str]
    notes: list[str]


def select(groups: Sequence[_plan.WorkloadGroup], results: Sequence[TuneResult], *, meaningful: bool,
           keep_slower: bool) -> Selection:
    """The tune stage's results -> what enters the model: each family workload keeps its kernel or
    takes its generated alternative's (`pick_alternatives`); a region whose kernel is unverified,
    or not faster (unless `keep_slower`: every verified kernel enters, a slower one noted), stays as
    the model ran it (`kept_out`); a family's own kernel still serves the regions whose alternative
    forms another workload, unless it is slower than the region as the model ran it."""
    rest, tuned, judged, picks = pick_alternatives(groups, results, meaningful=meaningful)
    keep, notes = kept_out(rest, judged, meaningful=meaningful, keep_slower=keep_slower)
    swapped = swaps(picks, results, keep)
    own_slower = set() if keep_slower else not_faster([r for r in tuned if r.workload in swapped],
                                                        meaningful=meaningful)
    return Selection(rest, tuned, judged, picks, keep, swapped, winner_configs(tuned, keep | own_slower), notes)
