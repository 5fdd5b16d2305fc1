"""`torch.compile(model, backend="solforge")`: solforge as a dynamo backend.

Each graph dynamo gives (the first call, and every new graph after it: another shape, a graph
break, the other grad mode) goes through the stages `optimize` runs on a captured model, for that
graph alone: lowered to ATen (capture/backend.py), planned, each region's workload taken from the
kernel database or tuned within the budget, the graph rewritten to call the winners (integrate),
checked against the graph as traced on (copies of) the call's own inputs, and run by solforge's
runtime (CUDA-graph replay of launch-bound calls; one graph for many sizes). A graph whose
rewrite fails the check runs as traced (recorded in `GraphRecord.error`); a graph that cannot be
lowered runs as dynamo gave it.

Options (`torch.compile(model, backend="solforge", options={...})`, or `solforge.backend(**options)`
as the backend itself): `budget` (tuning seconds per graph, default 30; 0: only the kernel
database's winners and, for a workload it does not know, the family's heuristic config, no
tuning), `db` (True: the default database, a path, or False), `families`, `max_candidates`,
`strategy`, `validate` (default True), `cuda_graphs` (default True), `mode` ("inference" or
"train"; default: "train" where the graph records a backward). torch.compile's own `mode`
argument is accepted and ignored.

What it does not do (yet), against `optimize`: no profile (the budget goes to the workloads in
plan order, not by their share of the time), no end-to-end timing of the model and no decision to
keep the original model where it is slower (each graph's kernels are kept out where slower than
the region, as in `optimize`), and no routed `generate` (transformers' generate calls the compiled
model, so it runs the graphs, but without optimize's static-cache handling). Tuning inside a
compile call makes the first call of each new graph as slow as the budget: with `budget=0` a new
graph costs only its lowering and the database lookups.

Registered under the name "solforge" when dynamo's registry is imported after `import solforge`
(registration.py; nothing of dynamo is imported for it) and through the `torch_dynamo_backends`
entry point of an installed solforge.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from solforge.errors import UserError

DEFAULTS: dict[str, Any] = {"budget": 30.0, "db": True, "families": None, "max_candidates": None,
                            "strategy": "auto", "validate": True, "cuda_graphs": True, "mode": None}

# the graphs the named backend ("solforge") compiled lately, newest last (inspection, tests)
history: collections.deque[GraphRecord] = collections.deque(maxlen=64)


@dataclass
class GraphRecord:
    """One graph dynamo gave the backend and what became of it."""

    aten: fx.GraphModule | None  # the ATen graph that runs (rewritten unless `error`); None: not lowered
    train: bool
    tuned: list[str] = field(default_factory=list)  # workload keys tuned in this compile
    from_db: list[str] = field(default_factory=list)  # workload keys whose winner came from the database
    kept: list[str] = field(default_factory=list)  # left as the model ran them (slower, or none verified)
    stats: Any = None  # integrate.IntegrationStats of this graph
    validated: bool | None = None  # None: not checked
    error: str | None = None  # why the graph runs as traced (lowering or the check failed)
    seconds: float = 0.0

    def solforge_calls(self) -> int:
        """How many calls of solforge's kernels the running graph makes."""
        return 0 if self.aten is None or self.error is not None else count_solforge_calls(self.aten)


def count_solforge_calls(gm: fx.GraphModule) -> int:
    """Nodes of `gm` calling a solforge op, through torch.ops or directly (kernels/direct.py)."""
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        op = getattr(target, "solforge_op", target)
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "solforge":
            n += 1
    return n


class Backend:
    """A torch.compile backend running solforge on every graph (see the module doc). `graphs`:
    the GraphRecord of each graph it compiled."""

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise UserError(f"unknown solforge backend option(s) {unknown}: choose from {', '.join(DEFAULTS)}")
        self.options = {**DEFAULTS, **options}
        o = self.options
        if o["mode"] not in (None, "inference", "train"):
            raise UserError(f"solforge backend: mode must be 'inference' or 'train' (got {o['mode']!r})")
        if float(o["budget"]) < 0:
            raise UserError(f"solforge backend: budget must be >= 0 (got {o['budget']})")
        from solforge.options import check_families as _check_families

        self.families = _check_families(o["families"])
        self.graphs: list[GraphRecord] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **_torch_kwargs: Any) -> Callable[..., Any]:
        record, run = compile_graph(gm, example_inputs, self.options, self.families)
        self.graphs.append(record)
        return run


def backend(**options: Any) -> Backend:
    """The solforge backend with these options, to pass as `torch.compile(model, backend=...)`
    or `model.compile(backend=...)` (the same as backend="solforge", options={...})."""
    return Backend(**options)


def solforge_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                     options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The backend dynamo finds under the name "solforge" (`options` are torch.compile's;
    its `mode` is ignored). Each graph it compiles is appended to `history`."""
    be = Backend(**(options or {}))
    run = be(gm, example_inputs)
    history.extend(be.graphs)
    return run


def _device(example_inputs: Sequence[Any]) -> str:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def _dtype(example_inputs: Sequence[Any]) -> torch.dtype:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            return x.dtype
    return torch.float32


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any],
                  families: tuple[str, ...] | None) -> tuple[GraphRecord, Callable[..., Any]]:
    """One dynamo graph through solforge: (its record, what dynamo runs for it)."""
    from solforge import api
    from solforge import plan as _plan
    from solforge.capture import SolforgeBackend
    from solforge.capture.checkpoint import training
    from solforge.capture.stage import lowering_cache
    from solforge.integrate import Integrator
    from solforge.runtime.shapes import copy_graph, symbolic_inputs

    started = time.perf_counter()
    train = options["mode"] == "train" if options["mode"] is not None else training(example_inputs)
    sb = SolforgeBackend(cache=lowering_cache(options["db"]), auto_replay=bool(options["cuda_graphs"]))
    run = sb(gm, example_inputs)
    if not sb.graphs:  # not lowered: runs as dynamo gave it
        return GraphRecord(None, train, error="; ".join(sb.errors) or "not lowered"), run
    record = GraphRecord(sb.graphs[-1].aten, train)
    aten = record.aten
    assert aten is not None
    device = api.check_device(_device(example_inputs))
    dynamic = bool(symbolic_inputs(aten))
    groups = [] if dynamic else _plan.plan(sb.graphs, families)  # a dynamic graph: heuristic configs per size
    if train:
        groups += _plan.backward_groups(groups)
    winners, keep, db_path = _tune(groups, record, options, device)
    integrator = Integrator(winners, families, train=train, keep=frozenset(keep), db=db_path)
    record.stats = integrator.stats
    integrator.stats.step_graphs = sb.step_graphs
    pristine = copy_graph(aten)  # the graph as traced: the check's reference, and the fallback
    try:
        integrator(aten, 0)  # in place: the graph `run` calls
    except Exception as e:  # a bug in a rewrite: the graph as traced
        record.error = f"rewrite failed: {type(e).__name__}: {e}"
        record.aten = pristine
        record.seconds = round(time.perf_counter() - started, 3)
        return record, pristine
    sb.rewrite = integrator  # graphs made again for one call's sizes (shapes.py) are rewritten too
    if options["validate"] and count_solforge_calls(aten):
        problem = _check(pristine, aten, example_inputs, device)
        record.validated = problem is None
        if problem is not None:
            record.error = f"the rewritten graph failed the check against the graph as traced: {problem}"
            sb.rewrite = None
            record.aten = pristine
            run = pristine
    record.seconds = round(time.perf_counter() - started, 3)
    return record, run


def _tune(groups: list[Any], record: GraphRecord, options: dict[str, Any],
          device: str) -> tuple[dict[Any, str], set[Any], Path | None]:
    """Each group's winner: the database's, else tuned within the budget (none with budget 0:
    the integrator then takes the family's heuristic config). (winners, kept out, database path)"""
    from solforge import api
    from solforge.integrate.select import kept_out, winner_configs
    from solforge.tune import tune
    from solforge.tune.baseline import region_baseline
    from solforge.tune.stage import budget_share, known

    kdb = api._open_db(options["db"])
    results = []
    try:
        in_db = [g for g in groups if kdb is not None and known(kdb, g.workload, False)]
        todo = [g for g in groups if g not in in_db] if float(options["budget"]) > 0 else []
        t0 = time.perf_counter()
        for group in [*in_db, *todo]:
            baseline = region_baseline(group, device)
            if group in in_db:
                res = tune(group.workload, baseline, device=device, budget_s=0, db=kdb)
                record.from_db.append(group.workload.key)
            else:
                left = max(0.0, float(options["budget"]) - (time.perf_counter() - t0))
                res = tune(group.workload, baseline, device=device, budget_s=budget_share(left, group, todo),
                           max_candidates=options["max_candidates"], strategy=options["strategy"], db=kdb)
                record.tuned.append(group.workload.key)
            results.append((group, res))
        path = kdb.path if kdb is not None else None
    finally:
        if kdb is not None:
            kdb.close()
    keep, _notes = kept_out([g for g, _ in results], [r for _, r in results], meaningful=device == "cuda")
    record.kept = [w.key for w in keep]
    winners = winner_configs([r for _, r in results], keep)
    return winners, keep, path


def _check(original: fx.GraphModule, rewritten: fx.GraphModule, example_inputs: Sequence[Any],
           device: str) -> str | None:
    """The rewritten graph against the graph as traced, on copies of the call's own inputs (a
    graph that writes into an input, a buffer, writes into its copy); None when it passes."""
    from solforge.validate import validate

    def copies() -> tuple[Any, ...]:
        return tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs)

    try:
        e2e = validate(original, lambda *a: rewritten(*copies()), copies(), dtype=_dtype(example_inputs),
                       device=device, is_language_model=False, time_it=False)
    except Exception as e:  # noqa: BLE001 - a graph that cannot run here fails its check
        return f"{type(e).__name__}: {e}"
    return None if e2e.passed else (e2e.note or "outputs differ")
