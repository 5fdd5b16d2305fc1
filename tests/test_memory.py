"""Memory-aware tuning: a candidate that runs out of memory (torch.OutOfMemoryError, faked here
as a CUDA allocation raises it) is a failure record at whichever stage it happens; a region whose
baseline does not fit is left as the model ran it, with a note; optimize() never raises either."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from solforge.records import RunResult
from solforge.tune import candidates, family_module, measure, tune
from solforge.tune.runners import LocalRunner

fake = family_module("fakes.oom")


def test_candidates_that_run_out_of_memory_are_failure_records_and_the_tune_goes_on() -> None:
    w = fake.workload()
    res = tune(w, RunResult(10.0, 10.0, 10.0), device=DEVICE, budget_s=60, runner=LocalRunner(DEVICE))
    by = {r.candidate.config_dict["mode"]: r for r in res.records}
    assert set(by) == set(fake.MODES)
    for mode in ("oom_build", "oom_verify", "oom_time"):
        assert not by[mode].ok and "OutOfMemoryError" in (by[mode].error or ""), (mode, by[mode].error)
    assert by["oom_build"].error.startswith("build:")
    assert by["ok"].ok and res.best is not None and res.best.candidate.config_dict["mode"] == "ok"


def test_running_out_of_memory_outside_the_verify_trials_is_a_failure_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """verify compares outputs after its trials (float64 copies of two large tensors): an OOM there
    is the candidate's failure too."""
    import importlib

    verify_mod = importlib.import_module("solforge.tune.verify")  # the package's `verify` is the function

    def compare(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (a fake)")

    monkeypatch.setattr(verify_mod, "compare", compare)
    (cand,) = [c for c in candidates(fake, fake.workload()) if c.config_dict["mode"] == "ok"]
    rec = measure(fake, cand, device=DEVICE)
    assert rec.build.ok and not rec.ok and rec.error is not None
    assert rec.error.startswith("verify:") and "OutOfMemoryError" in rec.error


class Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.norm = torch.nn.RMSNorm(32, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _optimize(model: torch.nn.Module) -> tuple[object, object]:
    from solforge.api import optimize

    x = torch.randn(5, 32, device=DEVICE)
    return optimize(model, (x,), budget=30, max_candidates=1, db=False, profile="off", families=["rmsnorm"])


def test_a_region_whose_baseline_runs_out_of_memory_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The region as the model ran it does not fit (its inputs drawn afresh, say): no search is run
    for it, it stays as the model ran it, the report says why, and optimize returns the model."""
    from solforge.tune import baseline

    def no_room(group: object, device: str) -> RunResult:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.40 GiB (a fake)")

    monkeypatch.setattr(baseline, "_baseline", no_room)
    m = Normed().to(DEVICE)
    opt, report = _optimize(m)
    (r,) = report.regions
    assert r.source == "untimed" and r.candidates == 0 and not r.integrated and r.baseline_us is None
    assert r.note is not None and "could not be timed" in r.note and "OutOfMemoryError" in r.note
    assert any("could not be timed" in n and "left as it is" in n for n in report.notes), report.notes
    assert not any("no kernel verified" in n for n in report.notes)
    assert opt is m and report.e2e is None
    # measured on the GPU only
    assert (report.extra["tune_peak_gb"] is None) == (DEVICE != "cuda")


def test_a_launcher_that_runs_out_of_memory_leaves_the_region_and_optimize_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rmsnorm candidate runs out of memory: each is a failure record naming the error, no
    kernel enters the model, and optimize returns the model with its report (no exception)."""
    from solforge.kernels import rmsnorm

    def launcher(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (a fake)")

    monkeypatch.setattr(rmsnorm, "rmsnorm", launcher)
    m = Normed().to(DEVICE)
    opt, report = _optimize(m)
    (r,) = report.regions
    assert r.candidates >= 1 and r.rejected == r.candidates and not r.verified and not r.integrated
    assert r.note is not None and "OutOfMemoryError" in r.note
    assert opt is m
