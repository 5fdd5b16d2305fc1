"""Search strategies: which candidates to measure next, behind one small interface.

    strategy = make_strategy("auto", family, workload, seed=0, known=db.known(workload))
    records = search(strategy, runner.measure, budget_s=120, patience=40)

A strategy proposes candidates and observes their records; `search` is the loop (propose ->
measure -> observe) with the budgets and the early stop. Both strategies propose the heuristic
first and never propose a candidate twice (nor one in `known`, the database's records).

  exhaustive    the space in order (heuristic, then `family.space`): small spaces.
  evolutionary  large spaces: the heuristic, a random initial population drawn across variants
                (a family whose space comes as a spread, tune/order.py: taken in that order),
                then children of the best measured configs by mutation and crossover, of which a
                cost model (cost_model.py) fitted on the times so far picks the one predicted
                fastest. Every 4th proposal is a random unmeasured config instead, so a wrong model
                cannot trap the search. Children slow by the model are never compiled.

Variants (and backends, when a space holds several) are knobs like any other, so the search picks
across them. Children are members of the family's space (the space is where `is_valid` and the
family's judgement meet; it is also what a replay of exhaustive measurements can answer): a
mutation sets one knob to another value the space uses and takes the nearest unproposed member
with that value; a crossover takes each knob from either parent and then the nearest unproposed
member. Everything is deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from solforge.errors import UserError
from solforge.kernels import registry
from solforge.records import Candidate, TuningRecord, Workload
from solforge.tune import measuring
from solforge.tune.cost_model import CostModel

# Above this many configs "auto" searches evolutionarily. 64 configs at ~1-2 s each (compile,
# verify, time at a Qwen3-4B shape on the H100) is 1-2 minutes a workload, affordable; and below
# ~64 the evolutionary search would measure most of the space anyway (its initial population and
# a few generations are ~20 configs).
EXHAUSTIVE_MAX = 64
IMPROVEMENT = 0.01  # early stop: `patience` measurements in a row none faster by more than 1%
STRATEGIES = ("auto", "exhaustive", "evolutionary")

Key = tuple[str, tuple[tuple[str, Any], ...]]


def _key(c: Candidate) -> Key:
    return c.backend, c.config


class SearchStrategy(Protocol):
    name: str

    def propose(self, k: int) -> list[Candidate]:
        """Up to k candidates never proposed (nor observed) before; [] when the strategy is done."""
        ...

    def observe(self, records: Sequence[TuningRecord]) -> None:
        """Results of proposed or database-known candidates; a failure counts as infinitely slow."""
        ...


class ExhaustiveSearch:
    """Every candidate in order, each once (those `valid` rejects, never)."""

    name = "exhaustive"

    def __init__(self, cands: Sequence[Candidate], *, valid: Callable[[Candidate], bool] | None = None) -> None:
        self._todo = [c for c in cands if valid is None or valid(c)]
        self._next = 0
        self._seen: set[Key] = set()

    def propose(self, k: int) -> list[Candidate]:
        out: list[Candidate] = []
        while len(out) < k and self._next < len(self._todo):
            c = self._todo[self._next]
            self._next += 1
            if _key(c) not in self._seen:
                self._seen.add(_key(c))
                out.append(c)
        return out

    def observe(self, records: Sequence[TuningRecord]) -> None:
        self._seen.update(_key(r.candidate) for r in records)


class EvolutionarySearch:
    """Mutation and crossover of the best measured configs, ranked by a cost model (module doc)."""

    name = "evolutionary"

    def __init__(self, cands: Sequence[Candidate], *, seed: int = 0,
                 valid: Callable[[Candidate], bool] | None = None, init: int | None = None,
                 parents: int = 6, children: int = 32, explore_every: int = 4, ordered: bool = False) -> None:
        """`cands`: the space, heuristic first. `valid`: a last check on every proposal (the
        family's is_valid). `init`: size of the random initial population (default 5% of the
        space, 8..24: 13 of swiglu's 264; 10 and 16 did as well on the synthetic landscapes).
        `children`: mutation/crossover attempts per proposal. `ordered`: `cands` come as a spread
        (tune/order.py): the initial population takes each variant's members in that order, not
        at random."""
        pool: list[Candidate] = []
        seen: set[Key] = set()
        for c in cands:
            if _key(c) not in seen and (valid is None or valid(c)):
                seen.add(_key(c))
                pool.append(c)
        self._pool = pool
        self._index = {_key(c): i for i, c in enumerate(pool)}
        multi_backend = len({c.backend for c in pool}) > 1
        self._genes = [{**({"backend": c.backend} if multi_backend else {}), **c.config_dict} for c in pool]
        knobs = sorted({k for g in self._genes for k in g})
        self._values = {k: sorted({g.get(k) for g in self._genes}, key=lambda v: (str(type(v)), v)) for k in knobs}
        self._knobs = [k for k in knobs if len(self._values[k]) > 1]  # the ones a mutation can change
        # each member as the indices of its knob values: distances are one numpy comparison
        self._codes = np.asarray([[self._values[k].index(g.get(k)) for k in self._knobs] for g in self._genes],
                                 dtype=np.int64).reshape(len(pool), len(self._knobs))
        self._rng = random.Random(seed)
        self._init = init if init is not None else max(8, min(24, round(0.05 * len(pool))))
        self._n_parents, self._n_children, self._explore_every = parents, children, explore_every
        self._ordered = ordered
        self._proposed: set[int] = set()
        self._times: dict[int, float] = {}  # observed pool members -> µs (inf: failed)
        self._steps = 0  # proposals after the initial population
        self._model = CostModel(self._genes)
        self._model_n = -1  # observations the model was fitted on

    # -- the interface

    def propose(self, k: int) -> list[Candidate]:
        out: list[Candidate] = []
        while len(out) < k and len(self._proposed) < len(self._pool):
            i = self._choose()
            self._proposed.add(i)
            out.append(self._pool[i])
        return out

    def observe(self, records: Sequence[TuningRecord]) -> None:
        for r in records:
            i = self._index.get(_key(r.candidate))
            if i is not None:  # a known record outside the space is not ours to search around
                self._proposed.add(i)
                self._times[i] = r.time_us

    # -- choosing

    def _unproposed(self) -> list[int]:
        return [i for i in range(len(self._pool)) if i not in self._proposed]

    def _choose(self) -> int:
        if 0 not in self._proposed:
            return 0  # the heuristic
        if len(self._proposed) < self._init:
            return self._initial()
        self._steps += 1
        ok = sorted((t, i) for i, t in self._times.items() if math.isfinite(t))
        if not ok or self._steps % self._explore_every == 0:
            return self._rng.choice(self._unproposed())
        kids = self._children([i for _, i in ok[:self._n_parents]])
        return self._best_predicted(kids or self._unproposed())

    def _initial(self) -> int:
        """A random unproposed config, the variants taken in turn (a diverse first population)."""
        free = self._unproposed()
        variants = self._values.get("variant", [None])
        for j in range(len(variants)):
            v = variants[(len(self._proposed) + j) % len(variants)]
            of_v = [i for i in free if self._genes[i].get("variant") == v]
            if of_v:
                return of_v[0] if self._ordered else self._rng.choice(of_v)
        return self._rng.choice(free)

    def _children(self, parents: list[int]) -> list[int]:
        """Unproposed space members made from `parents` (best first) by mutation and crossover."""
        free = np.asarray(self._unproposed(), dtype=np.int64)
        codes = self._codes[free]
        weights = [1.0 / (r + 1) for r in range(len(parents))]  # the best parent breeds most
        kids: list[int] = []
        for _ in range(self._n_children):
            a = self._rng.choices(parents, weights)[0]
            if len(parents) > 1 and self._rng.random() < 0.5:
                b = self._rng.choice([p for p in parents if p != a])
                pick = [self._rng.random() < 0.5 for _ in self._knobs]
                target = np.where(pick, self._codes[a], self._codes[b])
                among = np.ones(len(free), dtype=bool)
            else:
                j = self._rng.randrange(len(self._knobs))
                value = self._rng.choice([v for v in range(len(self._values[self._knobs[j]]))
                                          if v != self._codes[a, j]])
                target = self._codes[a]
                among = codes[:, j] == value
            kid = self._nearest(target, free[among], codes[among])
            if kid is not None and kid not in kids:
                kids.append(kid)
        return kids

    def _nearest(self, target: np.ndarray, among: np.ndarray, codes: np.ndarray) -> int | None:
        """The member of `among` that differs from `target` in the fewest knobs (ties: random)."""
        if len(among) == 0:
            return None
        dist = (codes != target).sum(axis=1)
        return int(self._rng.choice(among[dist == dist.min()].tolist()))

    def _best_predicted(self, among: list[int]) -> int:
        if len(self._times) != self._model_n:  # refit only when something new was observed
            obs = sorted(self._times.items())
            self._model.fit([self._genes[i] for i, _ in obs], [t for _, t in obs])
            self._model_n = len(self._times)
        pred = self._model.predict([self._genes[i] for i in among])
        return among[int(pred.argmin())]


def make_strategy(name: str, family: ModuleType, workload: Workload, *, seed: int = 0,
                  known: Sequence[TuningRecord] = ()) -> SearchStrategy:
    """"auto" (exhaustive up to EXHAUSTIVE_MAX configs, else evolutionary), "exhaustive" or
    "evolutionary" over `solforge.tune.candidates(family, workload)`; `known` records are observed
    first and never proposed again."""
    if name not in STRATEGIES:
        raise UserError(f"unknown search strategy {name!r}; use one of {', '.join(STRATEGIES)}")
    cands = measuring.candidates(family, workload)
    if name == "auto":
        name = "exhaustive" if len(cands) <= EXHAUSTIVE_MAX else "evolutionary"

    def valid(c: Candidate) -> bool:
        return registry.is_valid(family, registry.config_class(family)(**c.config_dict), workload)

    strategy: ExhaustiveSearch | EvolutionarySearch
    if name == "exhaustive":
        strategy = ExhaustiveSearch(cands, valid=valid)
    else:
        strategy = EvolutionarySearch(cands, seed=seed, valid=valid, ordered=registry.space_spread(family))
    strategy.observe(list(known))
    return strategy


def search(strategy: SearchStrategy, measure: Callable[[Sequence[Candidate]], Iterable[TuningRecord]], *,
           budget_s: float, max_candidates: int | None = None, batch: int = 1, patience: int | None = None,
           progress: Callable[[TuningRecord], None] | None = None,
           clock: Callable[[], float] = time.perf_counter,
           on_done: Callable[[bool], None] | None = None) -> list[TuningRecord]:
    """propose(batch) -> measure -> observe until the strategy is done, `budget_s` seconds or
    `max_candidates` measurements are spent, or `patience` measurements in a row brought no
    improvement over 1%. The first batch always runs. Returns the records in measured order;
    `progress` sees each record as it arrives. `on_done(complete)` says how it ended: True when
    the strategy ran out of candidates, converged (patience) or reached `max_candidates`; False
    when the wall budget cut it short (a later run with the database resumes such a search)."""
    records: list[TuningRecord] = []
    start, best, stale = clock(), math.inf, 0
    complete = False
    while True:
        if records and clock() - start > budget_s:
            break
        if patience is not None and stale >= patience:
            complete = True
            break
        k = batch if max_candidates is None else min(batch, max_candidates - len(records))
        if k <= 0:  # the caller's cap is a decision, not a cut: --retune searches again
            complete = True
            break
        cands = strategy.propose(k)
        if not cands:
            complete = True
            break
        got = []
        for rec in measure(cands):
            got.append(rec)
            records.append(rec)
            if rec.time_us < best * (1 - IMPROVEMENT):
                stale = 0
            else:
                stale += 1
            best = min(best, rec.time_us)
            if progress is not None:
                progress(rec)
        strategy.observe(got)
    if on_done is not None:
        on_done(complete)
    return records
