"""Runners: the same records whichever runner measures; crash and hang isolation in worker
processes (deliberately broken candidates from tests/fakes/broken.py); the Ray runner on a local
Ray instance. Without a GPU the workers run Triton's interpreter, so the whole path runs here."""

from __future__ import annotations

import tempfile

import pytest
import torch
from conftest import DEVICE

from solforge.errors import UserError
from solforge.records import Candidate
from solforge.tune import candidates, family_module
from solforge.tune.runners import Builder, LocalRunner, ProcessRunner, make_runner, parse_gpus

fake = family_module("fakes.broken")


def _cand(mode: str) -> Candidate:
    return Candidate(fake.workload(), "triton", "v", fake.Config(mode=mode).items())


def _by_mode(records) -> dict[str, object]:
    return {r.candidate.config_dict["mode"]: r for r in records}


# A hang costs its whole timeout: the runners' tests time out after HANG_S, a few hundred times what a
# fake candidate takes in a ready worker (~10 ms; a worker's start is not counted: STARTUP_S).
HANG_S = 4


def test_process_runner_isolates_crashes_and_hangs(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the workers' logs go
    modes = ["ok", "segv", "ok", "hang", "abort", "nan", "exit", "raise", "hang_verify", "wrong", "ok"]
    # distinct candidates: sizes tell the three "ok" ones apart
    cands = [Candidate(fake.workload(), "triton", "v", fake.Config(mode=m, size=i).items())
             for i, m in enumerate(modes)]
    runner = ProcessRunner("cpu", timeout_s=HANG_S)
    try:
        recs = list(runner.measure(cands))
        assert sorted(r.candidate.label for r in recs) == sorted(c.label for c in cands)  # one each
        by = {r.candidate.config_dict["size"]: r for r in recs}
        for i, m in enumerate(modes):
            rec = by[i]
            if m == "ok":
                assert rec.ok and rec.verdict.passed and rec.run.p50_us > 0, rec.error
                continue
            assert not rec.ok and rec.error, m
            err = rec.error
            expect = {
                "segv": ("build:", "SIGSEGV"), "abort": ("build:", "SIGABRT"), "exit": ("build:", "exit code 7"),
                "hang": ("build:", f"hung: no result after {HANG_S} s in build"),
                "hang_verify": ("verify:", f"hung: no result after {HANG_S} s in verify"),
                "nan": ("verify:", "NaN"), "raise": ("build:", "cannot be built"),
                "wrong": ("verify:", "out of tolerance"),
            }[m]
            assert err.startswith(expect[0]) and expect[1] in err, (m, err)
        # every crash or hang cost one process; the good candidates after them still ran
        assert runner.restarts == 5
    finally:
        runner.close()
    assert all(w.proc is None for w in runner.pool.workers)
    assert not list(tmp_path.glob("solforge-*.log"))  # every restarted process's log went too


def test_two_workers_measure_in_parallel_and_agree_with_local():
    cands = [_cand(m) for m in ("ok", "wrong", "nan", "raise")]
    local = LocalRunner("cpu")
    expected = {m: (r.ok, (r.error or "").split(":")[0]) for m, r in _by_mode(local.measure(cands)).items()}
    runner = make_runner("process", device="cpu", gpus=[0, 1], timeout_s=60)
    try:
        assert runner.parallelism == 2
        got = _by_mode(runner.measure(cands))
        assert {m: (r.ok, (r.error or "").split(":")[0]) for m, r in got.items()} == expected
        pids = {w.proc.pid for w in runner.pool.workers if w.proc is not None}
        assert len(pids) == 2  # both workers served
    finally:
        runner.close()


def test_builder_failures_short_circuit_and_real_family_agrees():
    """A real family (rmsnorm, interpreter) through builder + worker: the same verdicts as in-process,
    and a candidate that fails to build never reaches the measuring worker."""
    from solforge.kernels import rmsnorm

    w = rmsnorm.workload_for(torch.empty(13, 96, device=DEVICE), torch.empty(96, device=DEVICE), 1e-6)
    cands = candidates(rmsnorm, w)[:2]
    local = {r.candidate: r for r in LocalRunner(DEVICE).measure(cands)}
    runner = make_runner("process", device=DEVICE, timeout_s=120, build_workers=2)
    try:
        got = {r.candidate: r for r in runner.measure(cands)}
        assert got.keys() == local.keys()
        for c in cands:
            assert got[c].ok == local[c].ok and got[c].ok
            assert got[c].verdict.max_abs_err == pytest.approx(local[c].verdict.max_abs_err, abs=0)
        bad = [_cand("raise"), _cand("ok")]
        recs = _by_mode(runner.measure(bad))
        assert recs["raise"].error.startswith("build: RuntimeError") and recs["ok"].ok
    finally:
        runner.close()


def test_builder_hang_is_isolated():
    b = Builder("cpu", workers=2, timeout_s=HANG_S)
    try:
        recs = _by_mode(b.build([_cand("hang"), _cand("ok"), _cand("segv")]))
        assert "hung" in recs["hang"].build.error and "SIGSEGV" in recs["segv"].build.error
        assert recs["ok"].build.ok
    finally:
        b.close()


def test_ray_runner_on_a_local_instance():
    ray = pytest.importorskip("ray")
    # Ray's timeout runs from a candidate's submission, an actor's start included (seconds of
    # imports): long while actors start, HANG_S for the hang, sent to an actor already started
    runner = make_runner("ray", device="cpu", timeout_s=60)
    try:
        assert ray.is_initialized()
        recs = _by_mode(runner.measure([_cand("ok"), _cand("wrong"), _cand("segv")]))
        assert recs["ok"].ok
        assert recs["wrong"].error.startswith("verify:")
        assert "died" in recs["segv"].error
        again = _by_mode(runner.measure([_cand("ok")]))  # a fresh actor replaced the dead one
        assert again["ok"].ok
        runner.timeout_s = HANG_S
        hung = _by_mode(runner.measure([_cand("hang")]))
        assert "hung" in hung["hang"].error and f"after {HANG_S} s" in hung["hang"].error
        runner.timeout_s = 60
        got = runner.confirm([_cand("ok"), _cand("raise")])  # on the actor that replaced the hung one
        assert got[0].ok and not got[1].ok and "cannot be built" in got[1].error
    finally:
        runner.close()
    assert not ray.is_initialized()


def test_bad_runner_specs():
    with pytest.raises(UserError, match="unknown runner"):
        make_runner("gpu", device="cpu")
    with pytest.raises(UserError, match="--runner process"):
        make_runner("local", device="cpu", gpus=[0, 1])
    for text in ("a,b", "", "0,0", "-1"):
        with pytest.raises(UserError, match="--gpus"):
            parse_gpus(text)
    assert parse_gpus("0,1") == [0, 1] and parse_gpus(None) is None


def test_every_runner_confirms_finalists_in_order_with_failures_as_data():
    ok, raises = _cand("ok"), _cand("raise")
    for runner in (LocalRunner(DEVICE), ProcessRunner(DEVICE, timeout_s=30)):
        try:
            got = runner.confirm([ok, raises])
            assert len(got) == 2 and got[0].ok and got[0].p50_us > 0, (runner.name, got)
            assert got[0].meaningful == (DEVICE == "cuda")
            assert not got[1].ok and "cannot be built" in got[1].error, (runner.name, got)
        finally:
            runner.close()


def test_a_crash_while_confirming_costs_the_worker_not_the_tune():
    runner = ProcessRunner("cpu", timeout_s=HANG_S)
    try:
        got = runner.confirm([_cand("ok"), _cand("segv")])
        assert all(not r.ok and "killed the worker" in r.error for r in got), got
        hung = runner.confirm([_cand("hang")])
        assert not hung[0].ok and "hung" in hung[0].error
        again = runner.confirm([_cand("ok")])  # a fresh worker
        assert again[0].ok and runner.restarts == 2
        assert next(iter(runner.measure([_cand("ok")]))).ok
    finally:
        runner.close()


@pytest.mark.parametrize("shadow", ["typing_extensions.py", "numpy.py"])
def test_workers_do_not_import_from_the_working_directory(tmp_path, monkeypatch, shadow):
    """A file in the directory the user runs from, named like a module torch imports, is not
    imported by the workers (`python -m` would put that directory first on sys.path); what this
    process imports (PYTHONPATH, the tests' fakes) still is."""
    (tmp_path / shadow).write_text("raise ImportError('the worker imported the working directory')\n")
    monkeypatch.chdir(tmp_path)
    for runner in (ProcessRunner("cpu", timeout_s=60), Builder("cpu", workers=1, timeout_s=60)):
        try:
            if isinstance(runner, Builder):
                (got,) = runner.build([_cand("ok")])
                assert got.build.ok, got.build.error
            else:
                got = _by_mode(runner.measure([_cand("ok"), _cand("wrong")]))
                assert got["ok"].ok and got["ok"].run.p50_us > 0, got["ok"].error
                assert got["wrong"].error.startswith("verify:")  # the fake family from PYTHONPATH runs
        finally:
            runner.close()
