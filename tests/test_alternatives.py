"""A region a hand-written family matched also gets a generated candidate (plan/alternatives.py); both
are tuned and verified, and the faster verified one is integrated (integrate/select.py). Times off
the GPU mean nothing, so the tests that pick a winner stub the recorded times, both ways."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE
from test_plan import HFNorm
from test_rope import Attention

from solforge import capture, plan, settings
from solforge.integrate import integrate
from solforge.integrate.select import generated_wins, kept_out, pick_alternatives, swaps, winner_configs
from solforge.plan.alternatives import alternative_groups
from solforge.records import RunResult, TuneResult
from solforge.tune import tune
from solforge.tune.baseline import region_baseline


class NormThenScale(nn.Module):
    """An RMSNorm (the rmsnorm family's) between two ops the generator takes (its own region)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = HFNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x * 2.0) * 0.5 + 1.0


def _planned(m: nn.Module, x: torch.Tensor) -> list[plan.WorkloadGroup]:
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, (x,)).graphs)
    return groups + alternative_groups(groups)


def _timed(res: TuneResult, us: float) -> TuneResult:
    """`res` with its winner's time (and the region's) as if measured on a GPU."""
    assert res.best is not None
    best = dataclasses.replace(res.best, run=RunResult(us, us, us, meaningful=True))
    return dataclasses.replace(res, best=best, baseline=RunResult(100.0, 100.0, 100.0, meaningful=True))


@pytest.fixture(autouse=True)
def _alternatives_on(monkeypatch: pytest.MonkeyPatch):
    """conftest leaves the alternatives out of the other CPU tests; here they are the subject."""
    monkeypatch.setenv("SOLFORGE_GENERATED_ALTERNATIVES", "1")
    with settings.override(generated_alternatives=True):
        yield


@pytest.fixture(scope="module")
def tuned() -> tuple[nn.Module, torch.Tensor, list[plan.WorkloadGroup], list[TuneResult]]:
    torch.manual_seed(0)
    m = NormThenScale(40).to(DEVICE)
    x = torch.randn(3, 5, 40, device=DEVICE)  # odd rows, a row not a power of two
    groups = _planned(m, x)
    results = [tune(g.workload, region_baseline(g, DEVICE), device=DEVICE, budget_s=0, max_candidates=1)
               for g in groups]
    return m, x, groups, results


def test_the_family_region_gets_a_generated_alternative_and_both_verify(tuned) -> None:  # noqa: ANN001
    _m, _x, groups, results = tuned
    fams = [g.workload.family for g in groups]
    assert fams.count("rmsnorm") == 1
    alt = next(g for g in groups if g.alternative_of is not None)
    fam = next(g for g in groups if g.workload.family == "rmsnorm")
    assert alt.alternative_of == fam.workload and alt.workload.family == "generated"
    # the family region's nodes, not a region of their own, and the x * 2.0 only they read
    # (one op, no region of its own: plan/alternatives.py's absorbed producers)
    assert set(alt.regions[0].nodes) == set(fam.regions[0].nodes) | {"mul"} and alt.absorbed == ("mul",)
    by = {g.workload: r for g, r in zip(groups, results, strict=True)}
    assert by[fam.workload].best is not None and by[fam.workload].best.verdict.passed
    assert by[alt.workload].best is not None and by[alt.workload].best.verdict.passed
    # off the GPU the family keeps its region: the interpreter's times rank nothing
    assert generated_wins(by[fam.workload], by[alt.workload], meaningful=False)[0] is False


@pytest.mark.parametrize("winner", ["generated", "rmsnorm"])
def test_the_recorded_faster_kernel_is_integrated(tuned, winner: str) -> None:  # noqa: ANN001
    m, x, groups, results = tuned
    fast, slow = 10.0, 20.0

    def stub(g: plan.WorkloadGroup, r: TuneResult) -> TuneResult:
        kind = "generated" if g.alternative_of is not None else g.workload.family
        return _timed(r, fast if kind == winner else slow) if kind in ("generated", "rmsnorm") \
            and (g.alternative_of is not None or kind == "rmsnorm") else r

    stubbed = [stub(g, r) for g, r in zip(groups, results, strict=True)]
    rest, own, judged, picks = pick_alternatives(groups, stubbed, meaningful=True)
    assert len(rest) == len(groups) - 1 and all(g.alternative_of is None for g in rest)
    (pick,) = picks.values()
    assert pick.won is (winner == "generated")
    assert (pick.family_us, pick.generated_us) == ((fast, slow) if winner == "rmsnorm" else (slow, fast))
    keep, _ = kept_out(rest, judged, meaningful=True)
    swapped = swaps(picks, stubbed, keep)
    winners = winner_configs(own, keep)
    with torch.no_grad():
        opt, stats = integrate(m, winners, swaps=swapped)
        out, ref = opt(x), m(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    fam = next(g.workload for g in rest if g.workload.family == "rmsnorm")
    used = pick.generated.key if winner == "generated" else fam.key
    other = fam.key if winner == "generated" else pick.generated.key
    assert stats.replaced.get(used) == 1 and other not in stats.replaced


def test_a_tie_or_an_unverified_alternative_goes_to_the_family(tuned) -> None:  # noqa: ANN001
    _m, _x, groups, results = tuned
    fam = next(r for g, r in zip(groups, results, strict=True) if g.workload.family == "rmsnorm")
    alt = next(r for g, r in zip(groups, results, strict=True) if g.alternative_of is not None)
    assert generated_wins(_timed(fam, 5.0), _timed(alt, 5.0), meaningful=True)[0] is False
    assert generated_wins(_timed(fam, 5.0), _timed(alt, 4.0), meaningful=True)[0] is True
    failed = dataclasses.replace(_timed(alt, 1.0), best=None)
    assert generated_wins(_timed(fam, 5.0), failed, meaningful=True)[0] is False
    # the family without a verified kernel: a verified alternative takes the region
    assert generated_wins(dataclasses.replace(fam, best=None), _timed(alt, 50.0), meaningful=True)[0] is True


def test_a_family_region_the_generator_cannot_lower_says_why() -> None:
    # Llama's rope: q (6 heads) and k (2 heads) are two loop spaces, which one generated kernel cannot store
    m = Attention(qk_norm=False).to(DEVICE)
    groups = _planned(m, torch.randn(2, 5, 40, device=DEVICE))
    rope = next(g for g in groups if g.workload.family == "rope")
    assert not any(g.alternative_of == rope.workload for g in groups)
    assert rope.no_alternative is not None and "cannot be stored by the region's loop" in rope.no_alternative


def test_optimize_reports_both_kernels_of_a_family_region(tmp_path) -> None:  # noqa: ANN001
    import json

    from solforge import optimize

    torch.manual_seed(1)
    m = NormThenScale(24).to(DEVICE)
    x = torch.randn(5, 7, 24, device=DEVICE)
    opt, report = optimize(m, (x,), budget=1, max_candidates=1, db=False, profile="off", out_dir=tmp_path)
    row = next(r for r in report.regions if r.family == "rmsnorm")
    assert row.alternative is not None and row.alternative.startswith("generated")
    assert row.best_us is not None and row.alternative_us is not None  # both verified
    if DEVICE == "cpu":  # the interpreter's times rank nothing: the family's kernel keeps the region
        assert row.won == "rmsnorm" and "interpreter" in (row.alternative_note or "")
    else:  # the faster of the two, a tie to the family, the note naming both times; the alternative
        # took the x * 2.0 too (absorbed), so the family's kernel is charged that op's eager time
        fam_us, gen_us, note = row.best_us, row.alternative_us, row.alternative_note or ""
        charge = re.search(r"absorbed ops as eager ran them ([\d,.]+) µs", note)
        assert charge is not None, note
        assert row.won == ("generated" if gen_us < fam_us + float(charge[1].replace(",", "")) else "rmsnorm"), row
        assert f"{fam_us:,.1f} µs" in note and f"{gen_us:,.1f} µs" in note
    assert [r.family for r in report.regions].count("generated") == 1  # the tail (* 0.5 + 1.0): one
    assert report.e2e is not None and report.e2e.passed
    saved = next(r for r in json.loads((tmp_path / "report.json").read_text())["regions"] if r["family"] == "rmsnorm")
    assert (saved["won"], saved["best_us"], saved["alternative_us"]) == (row.won, row.best_us, row.alternative_us)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), atol=1e-5, rtol=1e-5)


class _Confirming:
    """A runner whose side-by-side times are given (the GPU's confirmation, stubbed)."""

    def __init__(self, times: list[RunResult]) -> None:
        self.times, self.asked = times, []

    def confirm(self, cands):  # noqa: ANN001, ANN201
        self.asked.append(list(cands))
        return self.times


def test_both_winners_are_timed_again_side_by_side(tuned) -> None:  # noqa: ANN001
    from solforge.tune.stage import side_by_side

    _m, _x, groups, results = tuned
    fam = _timed(next(r for g, r in zip(groups, results, strict=True) if g.workload.family == "rmsnorm"), 10.0)
    alt = _timed(next(r for g, r in zip(groups, results, strict=True) if g.alternative_of is not None), 9.0)
    run = _Confirming([RunResult(7.0, 7.0, 7.0), RunResult(8.0, 8.0, 8.0)])
    f2, a2 = side_by_side(fam, alt, run)  # type: ignore[arg-type]
    assert [c.workload for c in run.asked[0]] == [fam.workload, alt.workload]
    assert (f2.best.time_us, a2.best.time_us) == (7.0, 8.0)
    assert dict(f2.best.provenance)["search_us"] == 10.0 and dict(a2.best.provenance)["search_us"] == 9.0
    # the search had the alternative faster; side by side the family is: the family keeps the region
    assert generated_wins(fam, alt, meaningful=True)[0] and not generated_wins(f2, a2, meaningful=True)[0]
    # times that mean nothing (the interpreter's) are not confirmed
    untimed = [dataclasses.replace(r, best=dataclasses.replace(r.best, run=dataclasses.replace(r.best.run,
                                                                                               meaningful=False)))
               for r in (fam, alt)]
    run = _Confirming([])
    assert side_by_side(*untimed, run) == tuple(untimed) and not run.asked  # type: ignore[arg-type]
    if DEVICE == "cpu":  # as the interpreter timed them
        assert side_by_side(results[0], results[-1], run) == (results[0], results[-1]) and not run.asked  # type: ignore[arg-type]


def test_every_swappable_family_region_of_a_decoder_runs_as_its_alternative() -> None:
    """Qwen3-tiny with each family region that lowers (add_rmsnorm's two outputs, rmsnorm, swiglu,
    softmax; not rope: its q and k are two loop spaces) swapped for its generated alternative, heuristic
    schedules: the logits match eager's."""
    from test_arch_matching import _ids, _model

    m = _model("qwen3")
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, (_ids(0),)).graphs)
    alts = alternative_groups(groups)
    assert {g.workload.family for g in groups if any(a.alternative_of == g.workload for a in alts)} == \
        {"add_rmsnorm", "rmsnorm", "swiglu", "softmax"}
    swapped = {a.alternative_of: (a.workload, "") for a in alts}
    own = {g.workload: "" for g in groups if g.workload.family != "generated"}  # the families' heuristics
    with torch.no_grad():
        opt, stats = integrate(m, own, swaps=swapped)
        ids = _ids(3)
        a, b = opt(ids).logits, m(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # the regions whose alternative is the tuned one (the example's) ran as the generated op; one
    # whose alternative is another workload kept the family's kernel: the final add_rmsnorm, whose
    # sum nothing else reads (the family's op returns it anyway, the generated region does not)
    counts = {g.workload: g.count for g in groups}
    for alt in alts:
        f = alt.alternative_of
        got, kept = stats.replaced.get(alt.workload.key, 0), stats.replaced.get(f.key, 0)
        assert got >= 1 and got + kept == counts[f], (f.family, got, kept)
        assert kept == (1 if f.family == "add_rmsnorm" else 0), f.family


class MaskedGate(nn.Module):
    """Mixtral's expert activations (transformers' grouped_mm experts): the projection's rows of
    tokens routed nowhere masked to 0, split into gate and up halves, silu(gate) * up (the swiglu
    family's). The masked_fill alone is one op, no region of its own."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        gate, up = x.masked_fill(mask, 0.0).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def _masked_gate_inputs(rows: int = 37, width: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    # a strided input (every other column of a wider projection) and odd row counts
    x = torch.randn(rows, 4 * width, device=DEVICE)[:, ::2]
    return x, torch.rand(rows, 1, device=DEVICE) > 0.6


def test_an_alternative_absorbs_the_producers_only_its_region_reads() -> None:
    m = MaskedGate()
    x, mask = _masked_gate_inputs()
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, (x, mask)).graphs)
    (fam,) = [g for g in groups if g.workload.family == "swiglu"]
    assert not [g for g in groups if g.workload.family == "generated"]  # the masked_fill stays eager's
    (alt,) = alternative_groups(groups)
    assert alt.alternative_of == fam.workload
    # the masked_fill and the split whose items only the family's region reads, beside its nodes
    assert set(alt.regions[0].nodes) - set(fam.regions[0].nodes) == {"masked_fill", "split", "getitem", "getitem_1"}
    assert {"masked_fill", "split", "getitem", "getitem_1"} <= set(alt.regions[0].nodes)
    assert alt.absorbed == ("masked_fill",)  # the ops eager launched (the split is views)

    results = [tune(g.workload, region_baseline(g, DEVICE), device=DEVICE, budget_s=0, max_candidates=1)
               for g in [fam, alt]]
    assert all(r.best is not None and r.best.verdict.passed for r in results), results
    # the alternative's baseline is its own region's as eager ran it (the masked_fill included)
    assert results[1].baseline.ok and results[1].baseline is not results[0].baseline

    def timed(r: TuneResult, us: float, base: float) -> TuneResult:
        assert r.best is not None
        return dataclasses.replace(r, best=dataclasses.replace(r.best, run=RunResult(us, us, us, meaningful=True)),
                                   baseline=RunResult(base, base, base, meaningful=True))

    # the family's kernel is charged the absorbed ops' eager time: 10 + (108 - 100) = 18 µs
    f = timed(results[0], 10.0, 100.0)
    for g_us, wins in ((15.0, True), (18.0, False), (19.0, False)):
        got, why = generated_wins(f, timed(results[1], g_us, 108.0), meaningful=True, absorbed=True)
        assert got is wins, why
        assert "18.0 µs" in why and "absorbed" in why
    # the note names the absorbed ops where their names are given
    why = generated_wins(f, timed(results[1], 15.0, 108.0), meaningful=True, absorbed=("masked_fill", "mul_1"))[1]
    assert "them 8.0 µs (masked_fill, mul_1) = 18.0 µs" in why, why
    # a region's eager time below the family's (noise) charges nothing
    assert generated_wins(f, timed(results[1], 9.0, 95.0), meaningful=True, absorbed=True)[0]
    assert not generated_wins(f, timed(results[1], 11.0, 95.0), meaningful=True, absorbed=True)[0]

    # swapped in: one generated op replaces the masked_fill, the split and the family's region
    with torch.no_grad():
        opt, stats = integrate(m, {}, swaps={fam.workload: (alt.workload, "")})
        for rows in (37,):
            xs, ms = _masked_gate_inputs(rows)
            torch.testing.assert_close(opt(xs, ms), m(xs, ms), atol=1e-5, rtol=1e-5)
    assert stats.replaced == {alt.workload.key: 1}


class ConvNeXtBlockHead(nn.Module):
    """ConvNeXt's block up to its MLP: a depthwise convolution with a bias, permuted to
    channels-last, a LayerNorm (the layernorm family's)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dw(x).permute(0, 2, 3, 1))


def test_a_convolutions_bias_joins_the_norms_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (forced here) the depthwise convolution's bias, read through a permute by the
    LayerNorm, becomes an add (capture/layout.py's strip_bias): no region alone, it joins the
    layernorm family's generated alternative, which computes what the block computes."""
    from solforge.capture import layout as L

    monkeypatch.setattr(L, "on_cuda", lambda n: True)
    torch.manual_seed(3)
    m = ConvNeXtBlockHead(24).to(DEVICE)
    x = torch.randn(2, 24, 5, 7, device=DEVICE)  # odd spatial sizes
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, (x,)).graphs)
    (fam,) = [g for g in groups if g.workload.family == "layernorm"]
    (alt,) = alternative_groups(groups)
    assert alt.alternative_of == fam.workload and len(alt.absorbed) == 1, alt.absorbed
    assert alt.absorbed[0].startswith("add"), alt.absorbed
    res = tune(alt.workload, region_baseline(alt, DEVICE), device=DEVICE, budget_s=0, max_candidates=1)
    assert res.best is not None and res.best.verdict.passed
    with torch.no_grad():
        opt, stats = integrate(m, {}, swaps={fam.workload: (alt.workload, "")})
        torch.testing.assert_close(opt(x), m(x), atol=1e-5, rtol=1e-5)
    assert stats.replaced == {alt.workload.key: 1}


class SplitThreeWays(nn.Module):
    """The gate and up halves as two of three pieces of a split_with_sizes (the third unused)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        gate, up, _ = x.masked_fill(mask, 0.0).split([48, 48, 7], dim=-1)
        return torch.nn.functional.silu(gate) * up


class Unbound(nn.Module):
    """The gate and up halves as the items of an unbind of a scaled input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x * 2.0).unbind(0)
        return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("case", ["split_with_sizes", "unbind"])
def test_other_splits_join_the_alternative_whole(case: str) -> None:
    """A split_with_sizes (a piece nothing reads) and an unbind: their items are slices (selects)
    of the producer the alternative absorbs; swapped in, the masked_fill or the scale, the split and
    the family's region are one generated op, with the model's values."""
    torch.manual_seed(5)
    if case == "unbind":
        m: nn.Module = Unbound()
        args: tuple[torch.Tensor, ...] = (torch.randn(2, 37, 48, device=DEVICE),)
        absorbed, split = ("mul",), "unbind"
    else:
        m = SplitThreeWays()
        args = (torch.randn(37, 103, device=DEVICE), torch.rand(37, 1, device=DEVICE) > 0.6)
        absorbed, split = ("masked_fill",), "split_with_sizes"
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, args).graphs)
    (fam,) = [g for g in groups if g.workload.family == "swiglu"]
    (alt,) = alternative_groups(groups)
    assert alt.absorbed == absorbed and split in alt.regions[0].nodes, (alt.absorbed, alt.regions[0].nodes)
    res = tune(alt.workload, region_baseline(alt, DEVICE), device=DEVICE, budget_s=0, max_candidates=1)
    assert res.best is not None and res.best.verdict.passed
    with torch.no_grad():
        opt, stats = integrate(m, {}, swaps={fam.workload: (alt.workload, "")})
        torch.testing.assert_close(opt(*args), m(*args), atol=1e-5, rtol=1e-5)
    assert stats.replaced == {alt.workload.key: 1}
