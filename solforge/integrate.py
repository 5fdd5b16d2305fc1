"""Integrate: rewrite the model's graphs so matched regions call solforge's custom ops.

The optimized model is the original module compiled with a backend that lowers each dynamo graph
to ATen, finds the same regions the planner found, and replaces each by one call of the family's
`torch.library` op with the tuned config. The model's code is not touched; it is called exactly
like the original and returns the same structure.

Training (`train=True`): a family whose kernel module has `backward_workload` (rope, swiglu, gelu,
the norms, softmax, cross_entropy) gets the config string "FWD|BWD": FWD for its forward kernel,
BWD for the `<family>_bwd` op its autograd backward calls, each an encoded Config ("" = that
kernel's heuristic). The op decodes
the part before "|" and its `setup_context` keeps the part after it for the backward. BWD is the
winner of the backward workload (`backward_workload(match.workload)`, tuned like any other), or ""
where it was not tuned. Inference strings have no "|".

After the rewrite, every graph is compacted for host time (compact.py: the decomposed nn.Linear
calls become one aten.linear each). In a training graph those linears then become
`linears.linears` calls, one per group sharing an input (linears.py): their backward sums the
input gradients and accumulates the weight gradients into `.grad` inside the GEMMs. Their
embeddings become `embeddings.embedding` calls, whose backward adds into `.grad` only the rows of
the tokens present (embeddings.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import SolforgeBackend, compile_with
from solforge.compact import recompose_linear
from solforge.embeddings import rewrite_embeddings
from solforge.linears import group_linears
from solforge.plan import find_matches, rewrite
from solforge.records import Workload
from solforge.tune import family_module


@dataclass
class IntegrationStats:
    """What the rewriting backend did, graph by graph (filled in as dynamo compiles)."""

    replaced: dict[str, int] = field(default_factory=dict)  # workload key -> regions replaced
    untuned: dict[str, int] = field(default_factory=dict)  # shapes never tuned: heuristic config
    graphs: int = 0
    linears: int = 0  # decomposed nn.Linear calls put back as one aten.linear (compact.py)
    grouped: int = 0  # linears of training graphs turned into linears.linears calls (linears.py)
    embeddings: int = 0  # embeddings of training graphs turned into embeddings.embedding calls

    @property
    def total(self) -> int:
        return sum(self.replaced.values()) + sum(self.untuned.values())


@dataclass
class Integrator:
    """The rewrite function given to SolforgeBackend. `winners` maps a workload to its tuned
    config string. A region whose workload was never tuned (a new input shape after
    optimization) gets the family's heuristic config if `untuned="heuristic"`, or is left as
    it was if `untuned="skip"`. A workload in `keep` (tuned, but its kernel was slower than the
    region or none verified) is always left as it was. `train`: compose "FWD|BWD" strings (see the
    module's docstring)."""

    winners: Mapping[Workload, str]
    families: tuple[str, ...] | None = None
    untuned: str = "heuristic"
    train: bool = False
    keep: frozenset[Workload] = frozenset()
    stats: IntegrationStats = field(default_factory=IntegrationStats)

    def __call__(self, gm: fx.GraphModule, index: int) -> fx.GraphModule:
        self.stats.graphs += 1
        chosen, configs = [], []
        for m in find_matches(gm.graph, self.families):
            if m.workload in self.keep:
                continue
            config = self.winners.get(m.workload)
            bucket = self.stats.replaced
            if config is None:
                if self.untuned != "heuristic":
                    continue
                config = family_module(m.family).heuristic(m.workload).encode()
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
        return gm

    def _with_backward(self, workload: Workload, config: str) -> str:
        """"FWD|BWD" for a family that tunes its backward; `config` unchanged for any other."""
        fam = family_module(workload.family)
        bwl = fam.backward_workload(workload) if hasattr(fam, "backward_workload") else None
        if bwl is None:
            return config
        return f"{config}|{self.winners.get(bwl, '')}"


def integrate(model: torch.nn.Module, winners: Mapping[Workload, str], *, families: tuple[str, ...] | None = None,
              train: bool = False, keep: Collection[Workload] = ()) -> tuple[Callable[..., Any], IntegrationStats]:
    """The optimized model (called like `model`) and the live stats of what it replaced."""
    integrator = Integrator(dict(winners), families, train=train, keep=frozenset(keep))
    optimized = compile_with(model, SolforgeBackend(rewrite=integrator))
    return optimized, integrator.stats


def integrate_captured(captured: SolforgeBackend, winners: Mapping[Workload, str], *,
                       families: tuple[str, ...] | None = None, train: bool = False,
                       keep: Collection[Workload] = ()) -> tuple[Callable[..., Any], IntegrationStats]:
    """The optimized model from the capture's own compiled model, without tracing it again: its
    ATen graphs are rewritten in place (dynamo calls the same GraphModules), and the backend is
    armed so any graph dynamo compiles later (a new shape, the other grad mode) is rewritten too.
    A second trace of Qwen3-4B costs ~15 s, half of a warm run."""
    assert captured.compiled is not None, "integrate_captured needs capture()'s backend"
    integrator = Integrator(dict(winners), families, train=train, keep=frozenset(keep))
    for g in captured.graphs:
        integrator(g.aten, g.index)
    captured.rewrite = integrator
    return captured.compiled, integrator.stats
