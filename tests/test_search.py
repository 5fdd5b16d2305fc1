"""Search strategies on fake runners (no kernel launches): exhaustive and evolutionary behind one
interface, the search loop's budgets and early stop, the cost model's ranking.

The main landscape is a fake family of 270 configs (3 variants x x x y x flag) whose optimum
moves with the variant, with 5 configs within 3% of the best: harder than swiglu's synthetic
landscape (tools/search_replay.py --synthetic: 58 within 3%). The real swiglu space (264 configs at
16384 x 9728) is searched too, with a synthetic time of its config."""

from __future__ import annotations

import math
import random
import statistics
import types
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from solforge.errors import UserError
from solforge.kernels import swiglu as S
from solforge.records import BuildResult, Candidate, RunResult, TuningRecord, Verdict, Workload
from solforge.tune import candidates
from solforge.tune.cost_model import CostModel
from solforge.tune.search import (
    EXHAUSTIVE_MAX,
    EvolutionarySearch,
    ExhaustiveSearch,
    make_strategy,
    search,
)

# ---------------------------------------------------------------------------------------------
# a fake family: Config / space / is_valid / heuristic, as solforge.tune.candidates needs them

XS, YS = (1, 2, 4, 8, 16, 32, 64, 128), (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class FakeConfig:
    variant: str = "a"
    x: int = 8
    y: int = 4
    flag: int = 0

    def items(self) -> tuple[tuple[str, Any], ...]:
        return (("variant", self.variant), ("x", self.x), ("y", self.y), ("flag", self.flag))


def _fake_is_valid(c: FakeConfig, wl: Workload) -> bool:
    xs, ys = _axes(wl)
    return c.variant in ("a", "b", "c") and c.x in xs and c.y in ys and c.flag in (0, 1) and c.x * c.y <= 1024


def _axes(wl: Workload) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (XS[2:5], YS[:2]) if wl.param("small") else (XS, YS)


def _fake_space(wl: Workload) -> list[FakeConfig]:
    xs, ys = _axes(wl)
    out = [FakeConfig(v, x, y, f) for v in "abc" for x in xs for y in ys for f in (0, 1)]
    # a duplicate and an invalid config, as a careless space might hold: never proposed
    return [c for c in out if _fake_is_valid(c, wl)] + [out[3], FakeConfig("a", 3, 1, 0)]


fake = types.ModuleType("fake_family")
fake.FAMILY = "fake"  # type: ignore[attr-defined]
fake.Config = FakeConfig  # type: ignore[attr-defined]
fake.space = _fake_space  # type: ignore[attr-defined]
fake.is_valid = _fake_is_valid  # type: ignore[attr-defined]
fake.heuristic = lambda wl: FakeConfig("a", 8, 1, 0)  # type: ignore[attr-defined]

BIG = Workload("fake", ((1000,),), ("fp32",))
SMALL = Workload("fake", ((1000,),), ("fp32",), (("small", True),))
SWIGLU = Workload("swiglu", ((16384, 9728),) * 2, ("bf16", "bf16"), (("act", "silu"),), "cuda")

_OPT, _SCALE = {"a": 3.0, "b": 5.5, "c": 1.5}, {"a": 1.0, "b": 0.97, "c": 1.04}


def _hash(config: dict[str, Any]) -> float:
    return zlib.crc32(repr(sorted(config.items())).encode()) / 2**32


def fake_us(c: dict[str, Any]) -> float:
    """Each variant has its own best x; x * y has a best product; flag saves 3%; ±0.5% noise."""
    lx, ly = math.log2(c["x"]), math.log2(c["y"])
    t = 100 * _SCALE[c["variant"]] * (1 + 0.08 * (lx - _OPT[c["variant"]]) ** 2) * (1 + 0.05 * (lx + ly - 6) ** 2)
    return t * (0.97 if c["flag"] else 1.0) * (1 + 0.005 * (2 * _hash(c) - 1))


def swiglu_us(c: dict[str, Any]) -> float:
    """A memory-bound landscape over swiglu's real configs (as tools/search_replay.py's synthetic)."""
    bn, r, w = c["block_n"], c["rows"], c["num_warps"]
    ept = r * bn / (32 * w)
    t = 319.0 * (1 + 0.25 * (math.ceil(9728 / bn) * bn / 9728 - 1)) * (1 + 0.03 * (math.log2(ept) - 3.5) ** 2)
    t *= 1 + 0.04 * 2048 / (r * bn)
    if c["variant"] == "persist":
        t *= (1 + 0.3 * max(0.0, 1 - c["progs"] * w * 32 * ept * 4 / 65536)) * 0.98
    return t * (0.99 if c["evict"] else 1.0) * (1 + 0.01 * (2 * _hash(c) - 1))


class FakeRunner:
    """measure(): a record per candidate from a time function (None or inf: the build failed)."""

    def __init__(self, fn: Callable[[dict[str, Any]], float | None], clock: list[float] | None = None) -> None:
        self.fn, self.clock, self.seen = fn, clock, []  # type: ignore[var-annotated]

    def __call__(self, cands: Sequence[Candidate]) -> list[TuningRecord]:
        out = []
        for c in cands:
            self.seen.append(c)
            if self.clock is not None:
                self.clock[0] += 1.0  # each measurement takes one fake second
            us = self.fn(c.config_dict)
            if us is None or not math.isfinite(us):
                out.append(TuningRecord(c, BuildResult(False, 0.0, "CompilationError: out of resources")))
            else:
                out.append(TuningRecord(c, BuildResult(True), Verdict(True, 4, 0.0, 0.0), RunResult(us, us, us)))
        return out


def _labels(recs: Sequence[TuningRecord]) -> list[str]:
    return [r.candidate.label for r in recs]


def _space_labels(family: Any, wl: Workload) -> set[str]:
    return {Candidate(wl, "triton", c.variant, c.items()).label for c in family.space(wl) if family.is_valid(c, wl)}


# ---------------------------------------------------------------------------------------------
# exhaustive, and the loop's budgets


def test_exhaustive_measures_every_config_once_heuristic_first() -> None:
    strat = make_strategy("exhaustive", fake, SMALL)
    run = FakeRunner(fake_us)
    recs = search(strat, run, budget_s=math.inf)
    labels = _labels(recs)
    assert strat.name == "exhaustive" and len(recs) == len(set(labels)) == 36  # 3 x 3 x 2 x 2, duplicate skipped
    assert recs[0].candidate.config_dict == {"variant": "a", "x": 8, "y": 1, "flag": 0}  # the heuristic
    assert set(labels) == _space_labels(fake, SMALL)
    assert strat.propose(4) == []  # done


def test_search_respects_max_candidates_batch_and_wall_budget() -> None:
    recs = search(make_strategy("exhaustive", fake, SMALL), FakeRunner(fake_us), budget_s=math.inf,
                  max_candidates=5, batch=3)
    assert len(recs) == 5  # 3 + 2, never past the cap
    clock = [0.0]
    recs = search(make_strategy("exhaustive", fake, SMALL), FakeRunner(fake_us, clock), budget_s=2.5,
                  clock=lambda: clock[0])
    assert len(recs) == 3  # checked before each batch: 0, 1, 2 s elapsed go on; 3 s > 2.5 stops
    recs = search(make_strategy("evolutionary", fake, BIG), FakeRunner(fake_us, clock), budget_s=0.0, batch=4,
                  clock=lambda: clock[0])
    assert len(recs) == 4  # the first batch always runs, whatever the budget
    seen: list[str] = []
    search(make_strategy("exhaustive", fake, SMALL), FakeRunner(fake_us), budget_s=math.inf, max_candidates=7,
           progress=lambda r: seen.append(r.candidate.label))
    assert len(seen) == 7


def test_patience_stops_when_nothing_improves_by_more_than_1pct() -> None:
    # every config 0.5% faster than the one before: no step counts as progress after the first
    step = iter(range(1000))
    recs = search(make_strategy("exhaustive", fake, SMALL), FakeRunner(lambda c: 100 * 0.995 ** next(step)),
                  budget_s=math.inf, patience=5)
    assert len(recs) == 6
    # a 2% improvement resets the count: failures and flat times do not
    times = iter([100, 101, math.inf, 98, 99, 99, 99, 100, 100, 50])
    recs = search(make_strategy("exhaustive", fake, SMALL), FakeRunner(lambda c: next(times)), budget_s=math.inf,
                  patience=5)
    assert len(recs) == 9 and min(r.time_us for r in recs) == 98


@pytest.mark.parametrize("name", ["exhaustive", "evolutionary"])
def test_known_records_are_observed_and_never_proposed(name: str) -> None:
    wl = SMALL if name == "exhaustive" else BIG
    cands = candidates(fake, wl)
    known = FakeRunner(fake_us)(cands[1:11])  # ten measured in an earlier run (not the heuristic)
    recs = search(make_strategy(name, fake, wl, known=known), FakeRunner(fake_us), budget_s=math.inf)
    labels = _labels(recs)
    assert labels[0] == cands[0].label  # heuristic first
    assert not set(labels) & set(_labels(known)) and len(labels) == len(set(labels))
    assert len(labels) + 10 == len(_space_labels(fake, wl))  # the rest of the space, each once
    # a known heuristic is not measured again either: the strategy starts elsewhere
    again = make_strategy(name, fake, wl, known=FakeRunner(fake_us)(cands[:1]))
    assert again.propose(1)[0].label != cands[0].label


# ---------------------------------------------------------------------------------------------
# evolutionary


def _evolve(family: Any, wl: Workload, fn: Callable[[dict[str, Any]], float | None], seed: int,
            frac: float = 0.3) -> tuple[list[TuningRecord], int, float]:
    space = candidates(family, wl)
    n = len({c.label for c in space if family.is_valid(family.Config(**c.config_dict), wl)})
    best = min(t for c in space if (t := fn(c.config_dict)) is not None and math.isfinite(t))
    strat = make_strategy("evolutionary", family, wl, seed=seed)
    recs = search(strat, FakeRunner(fn), budget_s=math.inf, max_candidates=int(frac * n))
    return recs, n, best


@pytest.mark.parametrize("family,wl,fn", [(fake, BIG, fake_us), (S, SWIGLU, swiglu_us)], ids=["fake", "swiglu"])
def test_evolutionary_within_3pct_of_best_measuring_30pct(family: Any, wl: Workload, fn: Any) -> None:
    gaps, rand_gaps = [], []
    for seed in range(10):
        recs, n, best = _evolve(family, wl, fn, seed)
        assert n >= 200 and len(recs) <= 0.3 * n
        gaps.append(min(r.time_us for r in recs) / best - 1)
        cands = candidates(family, wl)
        rand_gaps.append(min(fn(c.config_dict) for c in random.Random(seed).sample(cands, len(recs))) / best - 1)
    # measured over 50 seeds: fake worst 0.6% (random search with as many measurements: worst
    # 5.6%, 7 seeds past 3%, 5.1% within these 10 seeds, so random search fails this test);
    # swiglu synthetic worst 0% (random 1.4%: 58 of its configs are within 3%, an easy plateau)
    assert max(gaps) <= 0.03, gaps
    assert statistics.median(gaps) <= statistics.median(rand_gaps)


def test_evolutionary_never_proposes_invalid_or_duplicate_and_survives_failures() -> None:
    def flaky(c: dict[str, Any]) -> float | None:  # ~25% of the configs fail to build
        return None if _hash(c) < 0.25 else fake_us(c)

    valid = _space_labels(fake, BIG)
    for seed in range(3):
        strat = make_strategy("evolutionary", fake, BIG, seed=seed)
        recs = search(strat, FakeRunner(flaky), budget_s=math.inf, batch=3)  # to the end of the space
        labels = _labels(recs)
        assert len(labels) == len(set(labels)) == len(valid) and set(labels) == valid
        assert labels[0] == candidates(fake, BIG)[0].label and strat.propose(1) == []
        assert 0.15 < sum(not r.ok for r in recs) / len(recs) < 0.35
    # with failures, still near the best at 30% of the space
    recs = search(make_strategy("evolutionary", fake, BIG, seed=1), FakeRunner(flaky), budget_s=math.inf,
                  max_candidates=81)
    best = min(t for c in candidates(fake, BIG) if (t := flaky(c.config_dict)) is not None)
    assert min(r.time_us for r in recs) <= 1.03 * best


def test_evolutionary_is_deterministic_per_seed_and_all_failures_do_not_stop_it() -> None:
    def order(seed: int) -> list[str]:
        return _labels(search(make_strategy("evolutionary", fake, BIG, seed=seed), FakeRunner(fake_us),
                              budget_s=math.inf, max_candidates=40))

    assert order(3) == order(3) and order(3) != order(4)
    recs = search(make_strategy("evolutionary", fake, BIG), FakeRunner(lambda c: None), budget_s=math.inf,
                  max_candidates=30)
    assert len(recs) == 30 and not any(r.ok for r in recs)


def test_evolutionary_initial_population_spans_the_variants() -> None:
    strat = EvolutionarySearch(candidates(fake, BIG), seed=0)
    first = strat.propose(13)
    assert {c.variant for c in first} == {"a", "b", "c"}


# ---------------------------------------------------------------------------------------------
# make_strategy


def test_make_strategy_auto_picks_by_space_size_and_rejects_unknown_names() -> None:
    assert len(candidates(fake, SMALL)) <= EXHAUSTIVE_MAX < len(candidates(fake, BIG))
    assert make_strategy("auto", fake, SMALL).name == "exhaustive"
    assert make_strategy("auto", fake, BIG).name == "evolutionary"
    assert make_strategy("auto", S, SWIGLU).name == "evolutionary"  # 264 configs
    small_swiglu = Workload("swiglu", ((9, 100),) * 2, ("bf16", "bf16"), (("act", "silu"),))
    assert make_strategy("auto", S, small_swiglu).name == "exhaustive"  # 16
    assert isinstance(make_strategy("exhaustive", fake, BIG), ExhaustiveSearch)
    with pytest.raises(UserError, match="unknown search strategy 'beam'"):
        make_strategy("beam", fake, BIG)


# ---------------------------------------------------------------------------------------------
# cost model


def _spearman(a: Sequence[float], b: Sequence[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.mark.parametrize("family,wl,fn,n,rho", [(fake, BIG, fake_us, 40, 0.8), (S, SWIGLU, swiglu_us, 40, 0.5)],
                         ids=["fake", "swiglu"])
def test_cost_model_ranks_unmeasured_configs_far_better_than_random(family: Any, wl: Workload, fn: Any, n: int,
                                                                    rho: float) -> None:
    space = [c.config_dict for c in candidates(family, wl)]
    times = np.asarray([fn(c) for c in space])
    rhos, recalls = [], []
    for seed in range(5):
        train = random.Random(seed).sample(range(len(space)), n)
        rest = [i for i in range(len(space)) if i not in set(train)]
        model = CostModel(space).fit([space[i] for i in train], times[train].tolist())
        pred = model.predict([space[i] for i in rest])
        rhos.append(_spearman(pred, times[rest]))
        top = set(np.argsort(times[rest])[:20].tolist())
        recalls.append(len(top & set(np.argsort(pred)[:20].tolist())) / 20)
    # measured: Spearman median fake 0.95, swiglu 0.69 (random: 0); top-20 recall fake 0.57,
    # swiglu 0.33 (random: 0.09)
    assert statistics.median(rhos) > rho and min(rhos) > 0.2
    assert statistics.mean(recalls) > 2 * 20 / (len(space) - n)


def test_cost_model_ignores_failures() -> None:
    # (fit speed, ~2 ms for 200 points, is a benchmark's business: a timed test flaked under -n 8)
    space = [c.config_dict for c in candidates(S, SWIGLU)]
    times = [swiglu_us(c) for c in space[:200]]
    with_failures = CostModel(space).fit(space[:200], [math.inf if i % 3 == 0 else t for i, t in enumerate(times)])
    assert with_failures.n_fit == 200 - 67
    assert np.isfinite(with_failures.predict(space)).all()
    # before any fit, or with too few points, every config is predicted the same
    assert len(set(CostModel(space).predict(space[:5]).tolist())) == 1
