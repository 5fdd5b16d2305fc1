"""Integrate: rewrite the model's graphs so matched regions call solforge's custom ops.

The optimized model is the original module compiled with a backend that lowers each dynamo graph
to ATen, finds the same regions the planner found, and replaces each by one call of the family's
`torch.library` op with the tuned config. The model's code is not touched; it is called exactly
like the original and returns the same structure.

Training (`train=True`): a family with a backward family (kernels/registry.py: rope, swiglu, gelu,
the norms, softmax, cross_entropy) gets the config string "FWD|BWD": FWD for its forward kernel,
BWD for the `<family>_bwd` op its autograd backward calls, each an encoded Config ("" = that
kernel's heuristic). The op decodes
the part before "|" and its `setup_context` keeps the part after it for the backward. BWD is the
winner of the backward workload (`backward_workload(match.workload)`, tuned like any other), or ""
where it was not tuned. Inference strings have no "|".

A graph dynamo compiled for many sizes (the second shape of an input: see `compile_with`) has
symbolic sizes. Its regions get config "" in both directions: each call's kernels take their
family's heuristic for that call's sizes (a plan cached per size), since a tuned config is for one
size. Those regions are counted in `stats.dynamic`. Sizes that come back get the graph made again
for them (shapes.ShapeDispatch, `stats.specialized`), with the configs above for their workloads.

A region whose workload this run did not tune (the model called with another input shape later:
dynamo compiles a new graph for it, see `compile_with`) gets, in this order: the kernel
database's verified winner for exactly that workload on this device and software (`db`), unless a
time the database holds for the region as the model ran it is faster, in which case the region is
left as it was; else the family's heuristic config (`untuned="heuristic"`), or nothing.

The optimized model's `generate` (transformers models) runs with the model's forward compiled by
the same backend (generation.py), so generation uses the kernels too, its launch-bound steps
replayed from CUDA graphs (stepgraphs.py).

After the rewrite, every graph is compacted for host time (compact.py: the decomposed nn.Linear
calls become one aten.linear each). In a training graph those linears then become
`linears.linears` calls, one per group sharing an input (linears.py): their backward sums the
input gradients and accumulates the weight gradients into `.grad` inside the GEMMs. Their
embeddings become `embeddings.embedding` calls, whose backward adds into `.grad` only the rows of
the tokens present (embeddings.py). Views nothing reads after the rewrite are dropped, and slices
that partition a tensor become one split, whose backward is one concatenation (tidy.py). Last,
the graph's calls of solforge's ops are made directly, without torch.library's dispatch and
autograd wrapper, whenever nothing traces them (kernels/direct.py): the host time of a training
forward and of a decode step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import LoweringCache, SolforgeBackend, compile_call, compile_with
from solforge.integrate.compact import recompose_linear
from solforge.integrate.embeddings import rewrite_embeddings
from solforge.integrate.linears import group_linears
from solforge.integrate.tidy import drop_unused_views, split_partitions
from solforge.kernels import registry
from solforge.kernels.direct import direct_calls
from solforge.plan import find_matches, rewrite
from solforge.records import TuningRecord, Workload
from solforge.runtime.generation import route_generate
from solforge.runtime.inplace import SolforgeCall, installed
from solforge.runtime.shapes import binding, symbolic

# family workload -> (its generated alternative's workload, that kernel's config): integrate/select.py
Swaps = Mapping[Workload, tuple[Workload, str]]


@dataclass
class IntegrationStats:
    """What the rewriting backend did, graph by graph (filled in as dynamo compiles)."""

    replaced: dict[str, int] = field(default_factory=dict)  # workload key -> regions replaced
    untuned: dict[str, int] = field(default_factory=dict)  # shapes never tuned: heuristic config
    stored: dict[str, int] = field(default_factory=dict)  # shapes this run did not tune: the database's winner
    left: dict[str, int] = field(default_factory=dict)  # ... whose stored winner is slower than the region
    # regions of dynamic-shape graphs (one graph for many sizes), keyed by the workload of the
    # sizes that compiled it: their kernels choose a config for each size at run time
    dynamic: dict[str, int] = field(default_factory=dict)
    graphs: int = 0
    specialized: int = 0  # dynamic-shape graphs made again for one set of sizes (shapes.py)
    # the backend's graphs as dynamo calls them (stepgraphs.StepGraph): CUDA-graph replays in generate
    step_graphs: list[Any] = field(default_factory=list)
    linears: int = 0  # decomposed nn.Linear calls put back as one aten.linear (compact.py)
    grouped: int = 0  # linears of training graphs turned into linears.linears calls (linears.py)
    embeddings: int = 0  # embeddings of training graphs turned into embeddings.embedding calls
    dropped_views: int = 0  # view nodes nothing read any more, erased (tidy.py)
    splits: int = 0  # sets of slices partitioning a tensor made one split_with_sizes (tidy.py)
    direct: int = 0  # solforge op calls made directly, not through torch.ops (kernels/direct.py)

    @property
    def total(self) -> int:
        return sum(self.replaced.values()) + sum(self.untuned.values()) + sum(self.stored.values()) \
            + sum(self.dynamic.values())


def _sizeless(workload: Workload) -> tuple[Any, ...]:
    """A workload without its sizes (its family, dtypes, options, device and the rank of each
    shape): what a region of a dynamic-shape graph has in common with the tuned shape's."""
    return (workload.family, workload.dtypes, workload.params, workload.device, tuple(map(len, workload.shapes)))


def config_text(record: TuningRecord) -> str:
    """A tuning record's config as the custom ops take it (the family's encoded Config)."""
    cls = registry.config_class(record.candidate.workload.family)
    return cls(**record.candidate.config_dict).encode()


@dataclass
class Integrator:
    """The rewrite function given to SolforgeBackend. `winners` maps a workload to its tuned
    config string. A region whose workload was never tuned (a new input shape after
    optimization) gets the family's heuristic config if `untuned="heuristic"`, or is left as
    it was if `untuned="skip"`. A workload in `keep` (tuned, but its kernel was slower than the
    region or none verified) is always left as it was. `train`: compose "FWD|BWD" strings (see the
    module's docstring). `db`: the kernel database consulted for workloads not in `winners`
    (see the module's docstring; None: not consulted)."""

    winners: Mapping[Workload, str]
    families: tuple[str, ...] | None = None
    untuned: str = "heuristic"
    train: bool = False
    keep: frozenset[Workload] = frozenset()
    stats: IntegrationStats = field(default_factory=IntegrationStats)
    db: Path | None = None
    # family workload -> (its generated alternative's workload, config): the regions whose
    # alternative won (integrate/select.py); a region whose alternative forms another workload
    # than the one tuned keeps the family's kernel
    swaps: Swaps = field(default_factory=dict)
    # database answers, one lookup per workload: (config, faster than every stored region time)
    _looked_up: dict[Workload, tuple[str, bool] | None] = field(default_factory=dict, repr=False)

    def __call__(self, gm: fx.GraphModule, index: int) -> fx.GraphModule:
        # inside shapes.bound: a dynamic-shape graph made again for one call's sizes, whose
        # workloads (shapes.hint) are those sizes'
        per_size = binding()
        if per_size:
            self.stats.specialized += 1
        else:
            self.stats.graphs += 1
        chosen, configs = [], []
        matches = find_matches(gm.graph, self.families)
        alts = self._alternatives(gm.graph, matches) if self.swaps and not per_size else {}
        for m in matches:
            if not per_size and any(symbolic(a.meta.get("val")) for a in m.args if isinstance(a, fx.Node)):
                # sizes that vary from call to call: "" is the family's heuristic for each call's
                # sizes (a tuned config is for one size; the kernels check a config's fit per size).
                # A region like one left as the model wrote it at the tuned shape (its kernel slower
                # or unverified there) is left here too: its sizes are not known to differ
                if _sizeless(m.workload) in self._kept_kinds:
                    continue
                self.stats.dynamic[m.workload.key] = self.stats.dynamic.get(m.workload.key, 0) + 1
                chosen.append(m)
                configs.append("")
                continue
            if m.workload in self.keep:
                continue
            if m.workload in self.swaps:
                alt = alts.get(id(m))
                if alt is not None:
                    self.stats.replaced[alt.workload.key] = self.stats.replaced.get(alt.workload.key, 0) + 1
                    chosen.append(alt)
                    configs.append(self.swaps[m.workload][1])
                    continue
                if m.workload not in self.winners:  # no verified kernel of the family's own
                    continue
            config = self.winners.get(m.workload)
            bucket = self.stats.replaced
            stored = self._stored(m.workload) if config is None else None
            if stored is not None:
                config, faster = stored
                if not faster:
                    self.stats.left[m.workload.key] = self.stats.left.get(m.workload.key, 0) + 1
                    continue
                bucket = self.stats.stored
            elif config is None:
                # a generated region never tuned is a kernel never verified (a family's heuristic
                # config is one its tests proved): it stays as the model ran it
                if self.untuned != "heuristic" or m.family == "generated":
                    continue
                config = registry.heuristic(m.family, m.workload).encode()
                bucket = self.stats.untuned
            bucket[m.workload.key] = bucket.get(m.workload.key, 0) + 1
            chosen.append(m)
            configs.append(self._with_backward(m.workload, config) if self.train else config)
        rewrite(gm, chosen, configs)
        # fewer ops for the host to dispatch (the training forward was host-bound): compact.py
        self.stats.linears += recompose_linear(gm)
        # training graphs: gradient sums and accumulation inside the GEMMs (linears.py)
        self.stats.grouped += group_linears(gm)
        # and their embeddings: the gradient added into .grad row by row (embeddings.py)
        self.stats.embeddings += rewrite_embeddings(gm)
        # views the rewrite left unread, and slices partitioning a tensor as one split (tidy.py)
        self.stats.dropped_views += drop_unused_views(gm)
        self.stats.splits += split_partitions(gm)
        # last: the kernels' ops called without torch.library's dispatch when nothing traces them
        self.stats.direct += direct_calls(gm)
        return gm

    def _alternatives(self, graph: fx.Graph, matches: list[Any]) -> dict[int, Any]:
        """The generated alternatives of the matches whose family workload's alternative won, by
        id(match), where they form the tuned workload (plan/alternatives.py)."""
        from solforge.plan.alternatives import alternatives

        todo = [m for m in matches if m.workload in self.swaps and m.workload not in self.keep]
        claimed = {n for m in matches for n in m.nodes}
        out = {}
        for m, alt in zip(todo, alternatives(graph, todo, claimed), strict=True):
            if not isinstance(alt, str) and alt.workload == self.swaps[m.workload][0]:
                out[id(m)] = alt
        return out

    @functools.cached_property
    def _kept_kinds(self) -> frozenset[tuple[Any, ...]]:
        return frozenset(_sizeless(w) for w in self.keep)

    def _with_backward(self, workload: Workload, config: str) -> str:
        """"FWD|BWD" for a family that tunes its backward; `config` unchanged for any other."""
        bwl = registry.backward_workload(workload.family, workload)
        if bwl is None:
            return config
        bwd = self.winners.get(bwl)
        if bwd is None:
            # a backward slower than eager's is used all the same (the fused forward runs its own)
            stored = self._stored(bwl)
            bwd = stored[0] if stored is not None else ""
        return f"{config}|{bwd}"

    def _stored(self, workload: Workload) -> tuple[str, bool] | None:
        """The database's verified winner for `workload` as (config, whether it beats every time
        the database holds for the region as the model ran it), else None (also when the database
        cannot be read: the region then gets what it would get without one)."""
        if self.db is None:
            return None
        if workload not in self._looked_up:
            from solforge.db import KernelDB

            found = None
            try:
                with KernelDB(self.db, create=False) as kdb:
                    rec = kdb.winner(workload)
                    if rec is not None and rec.ok:
                        t = rec.time_us
                        beaten = [b for b in kdb.baselines(workload) if b.ok and b.meaningful and b.p50_us <= t]
                        found = (config_text(rec), not (rec.run is not None and rec.run.meaningful and beaten))
            except Exception:  # noqa: BLE001 - a missing or unreadable database: as if there were none
                found = None
            self._looked_up[workload] = found
        return self._looked_up[workload]


def integrate(model: torch.nn.Module, winners: Mapping[Workload, str], *, families: tuple[str, ...] | None = None,
              train: bool = False, keep: Collection[Workload] = (),
              db: str | Path | None = None, cuda_graphs: bool = True,
              cache: LoweringCache | None = None,
              swaps: Swaps | None = None, skip_logits: bool = False) -> tuple[Callable[..., Any], IntegrationStats]:
    """The optimized model (called like `model`) and the live stats of what it replaced.
    `cuda_graphs`: the optimized model replays launch-bound calls from CUDA graphs: calls made
    without autograd recording (its `generate`'s decode steps, a small model's forward under
    no_grad; stepgraphs.py), and a small model's training calls, forward and backward
    (traingraphs.py). `cache`: the ATen lowering cache its graphs are lowered through. `skip_logits`:
    a training call's logits are dropped (runtime/logits.py); the model is then the module's own
    call compiled, as integrate_captured's (a SolforgeCall)."""
    integrator = Integrator(dict(winners), families, train=train, keep=frozenset(keep),
                            db=Path(db) if db is not None else None, swaps=dict(swaps or {}))
    backend = SolforgeBackend(rewrite=integrator, auto_replay=cuda_graphs, cache=cache)
    integrator.stats.step_graphs = backend.step_graphs
    if skip_logits:
        backend.module = model
        call = SolforgeCall(compile_call(model, backend, skip_logits=True), model, integrator.stats)
        route_generate(call, model, backend, cuda_graphs=cuda_graphs, swap_forward=lambda: installed(model) is not call)
        return call, integrator.stats
    optimized = compile_with(model, backend)
    route_generate(optimized, model, backend, cuda_graphs=cuda_graphs)
    _expose(optimized, integrator.stats)
    return optimized, integrator.stats


def _expose(optimized: Any, stats: IntegrationStats) -> None:
    """`optimized.solforge_stats`: what the rewrite did so far, graph by graph (live)."""
    # on the compiled module itself: its __setattr__ would set the attribute on the original module
    object.__setattr__(optimized, "solforge_stats", stats)


def integrate_captured(captured: SolforgeBackend, winners: Mapping[Workload, str], *,
                       families: tuple[str, ...] | None = None, train: bool = False,
                       keep: Collection[Workload] = (),
                       db: str | Path | None = None,
                       cuda_graphs: bool = True,
                       swaps: Swaps | None = None) -> tuple[SolforgeCall, IntegrationStats]:
    """The optimized call from the capture's own compiled call, without tracing it again: its
    ATen graphs are rewritten in place (dynamo calls the same GraphModules), and the backend is
    armed so any graph dynamo compiles later (a new shape, the other grad mode) is rewritten too.
    A second trace of Qwen3-4B costs ~15 s, half of a warm run. The model itself is not changed:
    `runtime.inplace.install(model, call)` makes the call the model's own (optimize does, once it
    validated the call against the model as it was)."""
    assert captured.compiled is not None, "integrate_captured needs capture()'s backend"
    integrator = Integrator(dict(winners), families, train=train, keep=frozenset(keep),
                            db=Path(db) if db is not None else None, swaps=dict(swaps or {}))
    for g in captured.graphs:
        integrator(g.aten, g.index)
    captured.rewrite = integrator
    captured.auto_replay = cuda_graphs  # from now on the optimized model's graphs (stepgraphs.py)
    for step in captured.step_graphs:
        step.auto = cuda_graphs
    integrator.stats.step_graphs = captured.step_graphs
    model = captured.module
    assert model is not None, "integrate_captured needs capture()'s backend"
    call = SolforgeCall(captured.compiled, model, integrator.stats)
    # once installed (runtime/inplace.py) the compiled call is the module's own, which transformers'
    # generate calls: its forward is then not swapped
    route_generate(call, model, captured, cuda_graphs=cuda_graphs,
                   swap_forward=lambda: installed(model) is not call)
    return call, integrator.stats
