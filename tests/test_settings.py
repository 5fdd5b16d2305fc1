"""solforge.settings: the parser, the process's record (read once, override, followers), report.json,
the kernel database key."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from solforge import settings
from solforge.db import KernelDB, db_key
from solforge.errors import UserError
from solforge.records import BuildResult, Candidate, Report, RunResult, TuningRecord, Verdict, Workload, from_json
from solforge.report import write_report
from solforge.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
Field = dataclasses.Field[Any]
SWITCHES = [f for f in settings.switches() if f.type == "bool"]
PATHS = [f for f in settings.switches() if f.type != "bool"]
ON = ["1", "true", "on", "yes", "TRUE", "On", " yes ", "Yes"]
OFF = ["0", "false", "off", "no", "", "FALSE", "Off", " 0 ", "NO"]


def env_of(f: Field) -> str:
    return f.metadata["env"]


# ----------------------------------------------------------------------------------------------
# the record and its parser


def test_every_switch_has_its_variable_default_and_doc() -> None:
    fields = settings.switches()
    names = [env_of(f) for f in fields]
    assert len(fields) == 19 and len(set(names)) == len(names)
    assert names == ["SOLFORGE_" + f.name.upper() for f in fields]
    assert all(f.metadata["doc"] and isinstance(f.metadata["kernels"], bool) for f in fields)
    assert Settings.from_env({}) == Settings()
    assert all(getattr(Settings(), f.name) is True for f in SWITCHES)  # every switch defaults to on
    assert all(getattr(Settings(), f.name) is None for f in PATHS)
    assert {f.name for f in fields if f.metadata["kernels"]} == {"torch_order", "pdl"}


def test_no_module_reads_a_switch_from_the_environment_itself() -> None:
    """Every SOLFORGE_* variable is read in solforge/settings.py only."""
    offenders = []
    for path in (ROOT / "solforge").rglob("*.py"):
        if path.name == "settings.py" and path.parent.name == "solforge":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"environ(\.get)?\s*[\(\[]\s*[\"']SOLFORGE_", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert offenders == []


@pytest.mark.parametrize("field", SWITCHES, ids=lambda f: f.name)
def test_every_spelling_of_every_switch(field: Field) -> None:
    for text, want in [(t, True) for t in ON] + [(t, False) for t in OFF]:
        s = Settings.from_env({env_of(field): text})
        assert getattr(s, field.name) is want, text
        # the other switches keep their defaults
        assert dataclasses.replace(s, **{field.name: True}) == Settings()


@pytest.mark.parametrize("field", SWITCHES, ids=lambda f: f.name)
@pytest.mark.parametrize("bad", ["2", "enable", "nope", "0x1", "true1", "-"])
def test_a_bad_value_is_one_line_naming_the_variable(field: Field, bad: str) -> None:
    with pytest.raises(UserError) as e:
        Settings.from_env({env_of(field): bad})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{env_of(field)}={bad!r}")
    assert all(w in msg for w in ("1, true, on, yes", "0, false, off, no", "empty"))


@pytest.mark.parametrize("field", PATHS, ids=lambda f: f.name)
def test_paths(field: Field, tmp_path: Path) -> None:
    assert getattr(Settings.from_env({env_of(field): str(tmp_path / "x")}), field.name) == tmp_path / "x"
    assert getattr(Settings.from_env({env_of(field): "~/k.db"}), field.name) == Path.home() / "k.db"
    assert getattr(Settings.from_env({env_of(field): ""}), field.name) is None


def test_env_round_trip(tmp_path: Path) -> None:
    s = Settings(torch_order=False, linears=False, db=tmp_path / "k.db")
    assert Settings.from_env(s.as_env()) == s and Settings.from_env(Settings().as_env()) == Settings()
    assert s.as_env(kernels_only=True) == {"SOLFORGE_TORCH_ORDER": "0", "SOLFORGE_PDL": "1"}
    assert s.kernel_key() == "pdl=1 torch_order=0" and Settings().kernel_key() == "pdl=1 torch_order=1"


def test_the_table_in_the_module_doc_lists_every_switch() -> None:
    """The docs link the module docstring's table: one row per switch, in field order, with the
    field's kernels flag."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in settings.__doc__.splitlines()
            if line.startswith("| SOLFORGE_")]
    assert [r[0] for r in rows] == [env_of(f) for f in settings.switches()]
    assert [r[2] == "yes" for r in rows] == [f.metadata["kernels"] for f in settings.switches()]
    assert [r[1] for r in rows] == ["1" if f.type == "bool" else "unset" for f in settings.switches()]


# ----------------------------------------------------------------------------------------------
# the process's settings


def test_current_is_read_once_and_reload_reads_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first = settings.current()
    assert settings.current() is first
    monkeypatch.setenv("SOLFORGE_LOWERING_CACHE", "0")
    monkeypatch.setattr(settings, "_active", None)  # outside the test's database override
    try:
        assert settings.current().lowering_cache == first.lowering_cache  # read once: not seen yet
        assert settings.reload().lowering_cache is False and settings.current().lowering_cache is False
    finally:
        monkeypatch.delenv("SOLFORGE_LOWERING_CACHE")
        settings.reload()
    assert settings.current().lowering_cache is True


def test_override_nests_and_restores() -> None:
    before = settings.current()
    with settings.override(linears=False, ceilings_dir="/tmp/c") as s:
        assert s is settings.current() and s.linears is False and s.ceilings_dir == Path("/tmp/c")
        with settings.override(linears=True, compact=False):
            assert settings.current() == dataclasses.replace(before, compact=False, ceilings_dir=Path("/tmp/c"))
        assert settings.current() is s
    assert settings.current() is before
    with pytest.raises(RuntimeError), settings.override(tidy=False):
        raise RuntimeError  # restored after an exception too
    assert settings.current() is before


def test_override_rejects_unknown_names_and_wrong_types() -> None:
    with pytest.raises(TypeError, match="no setting linear "), settings.override(linear=False):
        pass
    with pytest.raises(TypeError, match="SOLFORGE_LINEARS.* is a bool"), settings.override(linears="0"):
        pass
    with pytest.raises(TypeError, match="SOLFORGE_DB.* is a path"), settings.override(db=3):
        pass


def test_override_of_torch_order_is_refused_once_the_kernels_are_imported() -> None:
    import solforge.kernels.torch_order  # noqa: F401

    with pytest.raises(ValueError, match="SOLFORGE_TORCH_ORDER is fixed"):
        with settings.override(torch_order=not settings.current().torch_order):
            pass
    with settings.override(torch_order=settings.current().torch_order):  # no change: fine
        pass


def test_hot_path_names_follow_an_override() -> None:
    """The modules that keep a switch in a module-level name (read on every call or step) take an
    override's value and get theirs back after it."""
    import torch

    from solforge.kernels import direct, launch
    from solforge.runtime import accumulate, traingraphs

    def names() -> tuple[bool, bool, bool, bool, bool, bool]:
        return (direct.ENABLED, launch._ENABLED, accumulate.IN_PLACE, traingraphs.ENABLED,
                traingraphs.ACCUMULATE, launch.pdl(torch.device("cpu")))

    assert names() == (True, True, True, True, True, False)  # no PDL on the CPU
    with settings.override(direct_calls=False, direct_launch=False, grad_in_place=False, train_graphs=False,
                           train_accumulate=False):
        assert names() == (False, False, False, False, False, False) and not launch.enabled()
    assert names() == (True, True, True, True, True, False)
    launch.set_enabled(False)  # a switch set by hand is not undone by an override of another setting
    try:
        with settings.override(linears=False):
            assert launch._ENABLED is False
        assert launch._ENABLED is False
    finally:
        launch.set_enabled(True)


def test_pdl_reads_the_settings_for_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from solforge.kernels import launch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    launch.pdl.cache_clear()
    try:
        assert launch.pdl(torch.device("cuda", 0)) is True
        with settings.override(pdl=False):
            assert launch.pdl(torch.device("cuda", 0)) is False
        assert launch.pdl(torch.device("cuda", 0)) is True
    finally:
        launch.pdl.cache_clear()


def test_tuning_workers_get_the_settings_in_force() -> None:
    from solforge.tune.runners import _Worker

    with settings.override(pdl=False, linears=False):
        env = _Worker("measure", "cpu", None, 1.0)._env()
    assert env["SOLFORGE_PDL"] == "0" and env["SOLFORGE_LINEARS"] == "0" and env["SOLFORGE_TORCH_ORDER"] == "1"
    assert Settings.from_env(env) == dataclasses.replace(settings.current(), pdl=False, linears=False)


def test_bad_environment_is_a_one_line_cli_error(tmp_path: Path) -> None:
    code = "from solforge.cli import main; raise SystemExit(main(['db', 'list']))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SOLFORGE_TIDY": "maybe", "SOLFORGE_DB": str(tmp_path / "k.db")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "solforge: error: SOLFORGE_TIDY='maybe' is not a switch value: use 1, true, on, yes or 0, false, off, no "
        "(or leave it empty)"]


# ----------------------------------------------------------------------------------------------
# report.json


def _report(**kw: object) -> Report:
    return Report(model="m", device="cpu", dtype="bf16", mode="inference", versions={"torch": "x"}, regions=(),
                  e2e=None, **kw)  # type: ignore[arg-type]


def test_settings_round_trip_through_report_json(tmp_path: Path) -> None:
    with settings.override(linears=False, pdl=False, ceilings_dir=tmp_path / "c", db=None) as s:
        path = write_report(_report(settings=s.as_dict()), tmp_path / "out")
    data = json.loads(path.read_text())
    assert data["settings"]["linears"] is False and data["settings"]["ceilings_dir"] == str(tmp_path / "c")
    assert Settings.from_dict(data["settings"]) == s
    assert from_json(Report, path.read_text()).settings == s.as_dict()
    html = (tmp_path / "out" / "report.html").read_text()
    line = re.search(r"settings not at their defaults: <code>([^<]*)</code>", html)
    assert line is not None and line.group(1).split(", ")[:2] == ["SOLFORGE_PDL=0", "SOLFORGE_LINEARS=0"]
    assert f"SOLFORGE_CEILINGS_DIR={tmp_path / 'c'}" in line.group(1) and "SOLFORGE_DB" not in line.group(1)


def test_a_report_without_settings_still_loads() -> None:
    old = json.loads(json.dumps({"model": "m", "device": "cpu", "dtype": "bf16", "mode": "inference",
                                 "versions": {}, "regions": [], "e2e": None}))
    r = from_json(Report, json.dumps(old))
    assert r.settings == {} and settings.describe(r.settings) == ""
    # a newer report's unknown setting is left out, a mistyped value shown as it is
    assert settings.describe({"linears": True, "warp_drive": False, "tidy": "no"}) == "SOLFORGE_TIDY='no'"


# ----------------------------------------------------------------------------------------------
# the kernel database key


def _wl() -> Workload:
    return Workload("rmsnorm", ((7, 33), (33,)), ("bf16", "bf16"), (("eps", 1e-6),), "cpu")


def _rec(block: int, p50: float) -> TuningRecord:
    return TuningRecord(Candidate(_wl(), "triton", "row", (("block_h", block), ("num_warps", 4))),
                        BuildResult(True, 0.5), Verdict(True, 3, 1e-3, 2e-3), RunResult(p50, p50, p50, False))


def test_kernel_settings_key_their_own_entries(tmp_path: Path) -> None:
    """A measurement made under SOLFORGE_PDL=0 is never served to a run with it on, and is found
    again under it (PDL: a kernel-changing switch an override may change in this process)."""
    w, on, off = _wl(), _rec(64, 2.0), _rec(32, 3.0)
    with KernelDB(tmp_path / "k.db") as db:
        with settings.override(pdl=True):
            key_on = db_key(w)
            db.add(w, on, run_id="r1")
            db.set_winner(w, on, run_id="r1")
            db.set_baseline(w, "sig", RunResult(5.0, 5.0, 5.0))
        with settings.override(pdl=False):
            assert db_key(w) != key_on and "pdl=0" in db_key(w) and "pdl=1" in key_on
            assert db.known(w) == [] and db.winner(w) is None and db.baseline(w, "sig") is None
            db.add(w, off, run_id="r2")
            db.set_winner(w, off, run_id="r2")
            assert db.known(w) == [off] and db.winner(w) == off
        with settings.override(pdl=True):
            assert db.known(w) == [on] and db.winner(w) == on and db.baseline(w, "sig") == RunResult(5.0, 5.0, 5.0)
        entries = db.entries()
        assert sorted(e.parts.settings for e in entries) == sorted(
            dataclasses.replace(settings.current(), pdl=p).kernel_key() for p in (False, True))
        assert all(e.stale is None for e in entries)  # kept for runs under those settings, not stale
        # a setting that does not change kernels shares the key
        with settings.override(linears=False, direct_launch=False, train_graphs=False):
            assert db.known(w) == [on]


def test_torch_order_keys_its_own_entries_across_processes(tmp_path: Path) -> None:
    """SOLFORGE_TORCH_ORDER is fixed per process: a process with it off stores a winner that this
    process (on) does not see, and a later process with it off finds again."""
    path = tmp_path / "k.db"
    code = textwrap.dedent(f"""
        import sys
        from solforge.db import KernelDB
        from tests.test_settings import _rec, _wl
        with KernelDB({str(path)!r}) as db:
            if sys.argv[1] == "store":
                db.set_winner(_wl(), _rec(128, 1.0), run_id="off")
            w = db.winner(_wl())
            print(None if w is None else dict(w.candidate.config)["block_h"])
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SOLFORGE_TORCH_ORDER": "0"}

    def run(what: str) -> str:
        out = subprocess.run([sys.executable, "-c", code, what], env=env, capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run("store") == "128"
    assert settings.current().torch_order is True
    with KernelDB(path) as db:
        assert db.winner(_wl()) is None
        db.set_winner(_wl(), _rec(16, 2.0), run_id="on")
        assert db.winner(_wl()) == _rec(16, 2.0)
        assert {e.parts.settings for e in db.entries()} == {"pdl=1 torch_order=0", "pdl=1 torch_order=1"}
    assert run("find") == "128"


def test_an_unknown_solforge_variable_is_warned_about_once() -> None:
    """A misspelled switch changes nothing: say so (with the closest name), once per variable."""
    env = {"SOLFORGE_TIDDY": "0", "SOLFORGE_CODEGEN_FULL": "1", "SOLFORGE_DB": "/tmp/x.db", "OTHER": "1"}
    settings._warned.discard("SOLFORGE_TIDDY")
    with pytest.warns(UserWarning, match=r"SOLFORGE_TIDDY is not a solforge setting.*did you mean SOLFORGE_TIDY"):
        s = Settings.from_env(env)
    assert s == Settings(db=Path("/tmp/x.db"))  # the known ones still apply; the test suite's own is no setting
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert settings.unknown(env) == ["SOLFORGE_TIDDY"]  # named again, not warned again
