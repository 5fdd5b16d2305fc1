"""A large generated space is walked as a spread (tune/order.py): the heuristic first, then the
variants in turn, each one's block sizes from the middle out to the extremes, never the list's
order. No kernel runs here: only which candidates a budget would measure first."""

from __future__ import annotations

from collections import Counter

import torch
from codegen_helpers import trace

from solforge.codegen import regions as RG
from solforge.codegen import schedule as SC
from solforge.kernels import generated as GEN
from solforge.kernels import registry
from solforge.tune import candidates
from solforge.tune.order import spread
from solforge.tune.search import EvolutionarySearch, ExhaustiveSearch, make_strategy


def _workload():  # noqa: ANN202
    # few long rows (a split space) that still fit one pass (a rows space): every reduction variant
    x = torch.empty(48, 3000, device="meta")
    gm = trace(lambda t: torch.softmax(t * 0.5, dim=-1), x)
    (fr,) = RG.form_regions(gm.graph)
    return fr.lowered, GEN.workload_for(fr.lowered.ir)


def test_spread_keeps_every_config_and_covers_variants_and_blocks_early() -> None:
    low, _ = _workload()
    listed = SC.space(low)
    ordered = spread(listed)
    assert Counter(ordered) == Counter(listed) and len(listed) > 64
    variants = list(dict.fromkeys(c.variant for c in listed))
    assert len(variants) >= 3
    # the first round names every variant once
    assert [c.variant for c in ordered[:len(variants)]] == variants
    for v in variants:
        mine = [c for c in ordered if c.variant == v]
        blocks = sorted({c.block for c in mine})
        if len(blocks) < 3:
            continue
        # its first three already span the block sizes (the list starts at the smallest block and
        # walks the warps first)
        assert len({c.block for c in mine[:3]}) >= 2
        assert [c.block for c in mine[:3]] != [c.block for c in listed if c.variant == v][:3]


def test_the_search_takes_the_heuristic_then_the_spread() -> None:
    _, wl = _workload()
    fam = registry.module("generated")
    assert registry.space_spread(fam) and not registry.space_spread(registry.module("rmsnorm"))
    cands = candidates(fam, wl)
    assert cands[0].config == GEN.heuristic(wl).items()
    ex = make_strategy("exhaustive", fam, wl)
    assert isinstance(ex, ExhaustiveSearch)
    got = [c.config for c in ex.propose(6)]
    assert got == [c.config for c in cands[:6]]
    evo = make_strategy("evolutionary", fam, wl)
    assert isinstance(evo, EvolutionarySearch)
    first = evo.propose(1)
    assert first[0].config == cands[0].config
    # the initial population: each variant's members in the spread's order, variants in turn
    init = evo.propose(5)
    order = {c.config: i for i, c in enumerate(cands)}
    for v in {c.variant for c in init}:
        idx = [order[c.config] for c in init if c.variant == v]
        assert idx == sorted(idx)
        assert idx[0] == min(i for c, i in order.items() if dict(c)["variant"] == v and i > 0)
