"""The tune loop with the kernel database and the runners: a warm run measures nothing it knows,
a budget-cut search resumes without measuring again, a template change re-tunes only its family,
every runner gives the same verdicts, and optimize() reports where each kernel came from."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE

from solforge import settings
from solforge.db import KernelDB
from solforge.records import RunResult, Verdict, Workload
from solforge.runtime.stepgraphs import step_graphs
from solforge.tune import candidates, family_module, tune
from solforge.tune.runners import LocalRunner

BASE = RunResult(10.0, 10.0, 10.0, meaningful=False)


def _rms_workload() -> Workload:
    from solforge.kernels import rmsnorm

    # 13 rows (odd; 52 candidates): the interpreter's candidates cost by the row tile (37: 2x the time)
    return rmsnorm.workload_for(torch.empty(13, 96, device=DEVICE), torch.empty(96, device=DEVICE), 1e-6)


class CountingRunner(LocalRunner):
    """The local runner, counting what it measured."""

    def __init__(self) -> None:
        super().__init__(DEVICE)
        self.measured: list[str] = []

    def measure(self, cands):  # type: ignore[override]
        self.measured += [c.label for c in cands]
        yield from super().measure(cands)


class FailingRunner(CountingRunner):
    """Every candidate fails its verification, as on a GPU another job had filled."""

    def measure(self, cands):  # type: ignore[override]
        for rec in super().measure(cands):
            yield dataclasses.replace(rec, verdict=Verdict(False, reason="RuntimeError: CUDA out of memory"),
                                      run=None)


def test_failed_verifications_are_measured_again(tmp_path):
    """A run where every candidate failed its verification leaves no winner; the next run measures
    them again and finds one (it measured nothing and kept no kernel, until --retune, before)."""
    from solforge.records import BuildResult, TuningRecord
    from solforge.tune import reusable

    w = _rms_workload()
    db = KernelDB(tmp_path / "k.db")
    bad = FailingRunner()
    res1 = tune(w, BASE, device=DEVICE, budget_s=1e9, max_candidates=3, runner=bad, db=db, run_id="run1")
    assert res1.best is None and len(bad.measured) == 3 and db.winner(w) is None
    good = CountingRunner()
    res2 = tune(w, BASE, device=DEVICE, budget_s=1e9, max_candidates=3, runner=good, db=db, run_id="run2")
    assert res2.best is not None and res2.best.ok and set(bad.measured) <= set(good.measured)
    # a candidate Triton failed to compile is not built again (that failure repeats); one whose
    # build failed otherwise (a launch refused: no interpreter on a CPU) is
    cand = candidates(family_module("rmsnorm"), w)[0]
    broken = TuningRecord(cand, BuildResult(False, 0.1, "OutOfResources: out of resource: shared memory"))
    refused = TuningRecord(cand, BuildResult(False, 0.1, "ValueError: solforge rmsnorm: x is on cpu"))
    failed = TuningRecord(cand, BuildResult(True), Verdict(False, reason="odd shape: mismatch"))
    assert reusable([broken, refused, failed, res2.best]) == [broken, res2.best]


def test_warm_tune_measures_nothing_and_cut_search_resumes(tmp_path):
    w = _rms_workload()
    db = KernelDB(tmp_path / "k.db")
    space = len(candidates(family_module("rmsnorm"), w))
    # a tiny wall budget: the first candidate runs, then the search is cut short
    r1 = CountingRunner()
    res1 = tune(w, BASE, device=DEVICE, budget_s=1e-9, runner=r1, db=db, run_id="run1")
    assert res1.best is not None and res1.source == "tuned" and len(r1.measured) == 1 < space
    assert not dict(res1.best.provenance)["complete"]
    assert len(db.known(w)) == 1
    # a warm run uses that winner as it is: nothing measured
    r_warm = CountingRunner()
    res_warm = tune(w, BASE, device=DEVICE, budget_s=1e9, runner=r_warm, db=db, run_id="run1b")
    assert r_warm.measured == [] and res_warm.source == "database"
    # resumed: what run1 measured is observed, never measured again
    r2 = CountingRunner()
    res2 = tune(w, BASE, device=DEVICE, budget_s=1e9, max_candidates=6, runner=r2, db=db, run_id="run2",
                resume=True)
    assert not set(r1.measured) & set(r2.measured) and len(r2.measured) == 6
    assert res2.known == 1 and dict(res2.best.provenance)["complete"]  # the caller's cap ends it
    # warm: the finished search's winner comes back, nothing is measured
    r3 = CountingRunner()
    res3 = tune(w, BASE, device=DEVICE, budget_s=1e9, runner=r3, db=db, run_id="run3", resume=True)
    assert r3.measured == [] and res3.source == "database" and res3.records == ()
    assert res3.best == db.winner(w) and res3.best.candidate == res2.best.candidate
    # off the GPU the heuristic wins (interpreter times mean nothing), whichever run measured it;
    # on a GPU one of the finalists of both runs' measurements, the fastest when they were timed
    # again side by side (tune.confirm_finalists; its time is that timing's)
    if DEVICE == "cpu":
        assert res3.best.candidate.config == family_module("rmsnorm").heuristic(w).items()
    else:
        from solforge.tune import finalists

        final = finalists(db.known(w))
        prov = dict(res3.best.provenance)
        if final:
            assert res3.best.candidate in {r.candidate for r in final} and prov["confirmed"] >= 2
            assert prov["search_us"] == next(r.time_us for r in final if r.candidate == res3.best.candidate)
        else:
            assert res3.best.time_us == min(r.time_us for r in db.known(w))
    # --retune measures again
    r4 = CountingRunner()
    tune(w, BASE, device=DEVICE, budget_s=1e9, max_candidates=2, runner=r4, db=db, run_id="run4", retune=True)
    assert len(r4.measured) == 2
    db.close()


def test_template_change_retunes_only_that_family(tmp_path, monkeypatch):
    import solforge.db as sdb
    from solforge.kernels import swiglu

    w_rms = _rms_workload()
    w_sw = swiglu.workload_for(torch.empty(5, 40, device=DEVICE), torch.empty(5, 40, device=DEVICE), "silu")
    db = KernelDB(tmp_path / "k.db")
    for w in (w_rms, w_sw):
        tune(w, BASE, device=DEVICE, budget_s=1e9, max_candidates=1, runner=CountingRunner(), db=db, run_id="a")
    real = sdb._current_template

    def edited(family: str) -> str | None:  # as if swiglu.py had been edited since
        h = real(family)
        return h[::-1] if h and family == "swiglu" else h

    monkeypatch.setattr(sdb, "_current_template", edited)
    counts = {}
    for w in (w_rms, w_sw):
        r = CountingRunner()
        res = tune(w, BASE, device=DEVICE, budget_s=1e9, max_candidates=1, runner=r, db=db, run_id="b")
        counts[w.family] = (res.source, len(r.measured))
    assert counts == {"rmsnorm": ("database", 0), "swiglu": ("tuned", 1)}
    db.close()


def test_runners_give_the_same_winner_and_verdicts(tmp_path):
    from solforge.tune.runners import make_runner

    w = _rms_workload()
    out = {}
    for spec in ("local", "process"):
        run = make_runner(spec, device=DEVICE, timeout_s=120)
        try:
            res = tune(w, BASE, device=DEVICE, budget_s=1e9, max_candidates=3, runner=run, strategy="exhaustive")
        finally:
            run.close()
        out[spec] = (res.best.candidate, [(r.candidate, r.ok, r.verdict.max_abs_err) for r in res.records])
    # the same candidates, each with the same verdict and error, whichever runner measured them
    assert sorted(out["local"][1], key=str) == sorted(out["process"][1], key=str)
    if DEVICE == "cpu":
        # the same winner: only where timing cannot pick differently. On a GPU two candidates
        # within noise of each other swapped places between the runners (H100, 2026-11-22)
        assert out["local"][0] == out["process"][0]


def test_optimize_warm_run_comes_from_the_database(tmp_path):
    # the lowering cache where a user has it, beside the database (conftest shares one between tests)
    with settings.override(lowering_dir=None):
        _warm_run_comes_from_the_database(tmp_path)


def _warm_run_comes_from_the_database(tmp_path):
    from solforge.api import optimize
    from solforge.plan import _matchers
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device=DEVICE, dtype=torch.float32, batch=1, seq=8, seed=0)
    db = tmp_path / "k.db"
    # max_candidates, not the wall budget, stops each search: two candidates a workload on a machine of any
    # speed or load (at 60 s, a busy 2-core machine measured rope's first candidate alone); the
    # hand-written families only: the interpreter's time on generated regions is another test's
    fams = [f for f in _matchers() if f != "generated"]
    kw = dict(budget=3600, max_candidates=2, db=db, name="tiny", make_inputs=lm.make_inputs, is_language_model=True,
              families=fams)
    _, cold = optimize(lm.model, lm.example_inputs, **kw, profile="on")  # (off the GPU, auto would skip it)
    assert cold.e2e is not None and cold.e2e.passed
    assert {r.source for r in cold.regions} == {"tuned"}
    for r in cold.regions:
        assert r.candidates == 2 and r.built + (r.candidates - r.built) == 2 and r.timed <= r.built
        assert r.strategy in ("exhaustive", "evolutionary")
    assert "profile" in cold.extra["stage_seconds"]
    torch.compiler.reset()
    opt, warm = optimize(lm.model, lm.example_inputs, **kw)
    assert [r.source for r in warm.regions] == ["database"] * len(cold.regions)
    assert all(r.candidates == 0 and r.known >= 2 for r in warm.regions)
    assert {(r.workload, r.config_text) for r in warm.regions} == {(r.workload, r.config_text) for r in cold.regions}
    assert warm.e2e is not None and warm.e2e.passed
    assert "profile" not in warm.extra["stage_seconds"] and any("profile skipped" in n for n in warm.notes)
    # the capture's ATen graph came from the lowering cache beside the database, and nothing broke
    assert any("1 ATen graph(s) read from the lowering cache" in n and str(tmp_path) in n for n in warm.notes)
    assert not any("lowering cache" in n for n in cold.notes)
    # the regions' original times too: stored by the cold run, not timed again
    # (keyed by workload: the cold run orders regions by the profile's ranking, which noise on this
    # machine can swap, and the warm run, with no profile, in plan order)
    assert {r.workload: r.baseline_us for r in warm.regions} == {r.workload: r.baseline_us for r in cold.regions}
    assert any(f"original time of {len(warm.regions)} region(s) came from the kernel database" in n
               for n in warm.notes)
    # the warm model really calls the tuned kernels (the capture's compiled model, rewritten in place);
    # its graph run as it is: on a GPU the calls so far (validate's) made it replay from a CUDA graph,
    # which dispatches no op the profiler could list
    fresh = lm.make_inputs(2)
    with torch.no_grad(), step_graphs(False):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = opt(*fresh).logits
        assert torch.allclose(got, lm.model(*fresh).logits, atol=1e-4, rtol=1e-4)
    seen = {e.name.split("::")[1] for e in prof.events() if e.name.startswith("solforge::")}
    assert seen == {r.family for r in warm.regions}
    if DEVICE == "cuda":  # and the replays of it give the same values
        steps = [s for s in opt.solforge_stats.step_graphs if s.replays]
        assert steps, [s.summary() for s in opt.solforge_stats.step_graphs]
        with torch.no_grad():
            torch.testing.assert_close(opt(*fresh).logits, got, rtol=0, atol=0)


@pytest.mark.parametrize("argv, msg", [
    (["--runner", "gpu"], "unknown runner"),
    (["--gpus", "x"], "--gpus"),
    (["--db", "x.db", "--no-db"], "contradict"),
    (["--search", "beam"], None),  # argparse rejects it (exit 2)
    (["--build-workers", "-1"], "--build-workers"),
    (["--timeout", "0"], "--timeout"),
])
def test_cli_tuning_flags_bad_input(argv, msg, capsys):
    from solforge.cli import main

    with pytest.raises(SystemExit) if msg is None else _nullcontext():
        code = main(["optimize", "qwen3-tiny", "--out", "/tmp/solforge-test-out", *argv])
        assert code == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err


def test_region_report_counts_roundtrip():
    from solforge.records import RegionReport, from_json, to_json

    r = RegionReport("rmsnorm", "k", 1, 1.0, 1.0, 1.0, "triton", {}, True, 0.0, candidates=5, rejected=1,
                     source="database", built=4, timed=4, known=9, strategy="evolutionary")
    assert from_json(RegionReport, to_json(r)) == r
    assert dataclasses.asdict(r)["source"] == "database"


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def test_a_kernel_slower_than_the_original_region_is_kept_out():
    from solforge.api import not_faster
    from solforge.records import BuildResult, Candidate, TuneResult, TuningRecord, Verdict

    w = _rms_workload()
    cand = Candidate(w, "triton", "row", ())

    def result(base_us: float, best_us: float) -> TuneResult:
        rec = TuningRecord(cand, BuildResult(True), Verdict(True, 4, 0.0, 0.0), RunResult(best_us, best_us, best_us))
        return TuneResult(w, RunResult(base_us, base_us, base_us), (rec,), rec)

    slow, fast = result(10.0, 12.0), result(10.0, 8.0)
    assert not_faster([slow], meaningful=True) == {w}
    assert not_faster([fast], meaningful=True) == set()
    assert not_faster([slow], meaningful=False) == set()  # interpreter times say nothing
    assert not_faster([TuneResult(w, RunResult(10.0, 10.0, 10.0))], meaningful=True) == set()  # nothing to keep out
