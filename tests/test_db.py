"""The kernel database: exact round trips, keys, concurrent writers, a killed run, sharing, the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import solforge.db as dbmod
from solforge import settings
from solforge.cli import main
from solforge.db import KernelDB, db_key, default_path, key_parts, template_hash
from solforge.errors import UserError
from solforge.records import INF, BuildResult, Candidate, RunResult, TuningRecord, Verdict, Workload

ROOT = Path(__file__).resolve().parents[1]


def wl(family: str = "rmsnorm", rows: int = 7, hidden: int = 33) -> Workload:
    shapes = ((rows, hidden), (hidden,)) if family != "rope" else ((1, 3, rows, hidden), (rows, hidden))
    return Workload(family, shapes, ("bf16",) * len(shapes), (("eps", 1e-6),), "cpu")


def rec(w: Workload, block: int, p50: float | None = 2.5, *, fail: str | None = None,
        provenance: tuple[tuple[str, object], ...] = ()) -> TuningRecord:
    """A passing record timed at p50, or a failure at the stage `fail` names."""
    cand = Candidate(w, "triton", "row", (("block_h", block), ("num_warps", 4)))
    if fail == "build":
        return TuningRecord(cand, BuildResult(False, 0.25, "CompilationError: out of shared memory"))
    if fail == "verify":
        return TuningRecord(cand, BuildResult(True, 0.5), Verdict(False, 2, 3.0, 0.75, "max rel err 0.75 > 0.02"))
    if fail == "run":
        return TuningRecord(cand, BuildResult(True, 0.5), Verdict(True, 3, 1e-3, 2e-3),
                            RunResult(INF, INF, INF, True, "RuntimeError: launch failed"))
    assert p50 is not None
    return TuningRecord(cand, BuildResult(True, 0.5), Verdict(True, 3, 1e-3, 2e-3),
                        RunResult(p50 * 0.9, p50, p50 * 1.25, False), provenance)


def test_records_round_trip_exactly(tmp_path: Path) -> None:
    w, other = wl(), wl(rows=5)
    recs = [rec(w, 16, 3.25, provenance=(("host", "a"), ("seed", 0))), rec(w, 32, fail="build"),
            rec(w, 64, fail="verify"), rec(w, 128, fail="run")]
    with KernelDB(tmp_path / "k.db") as db:
        assert db.known(w) == [] and db.winner(w) is None
        for r in recs:
            db.add(w, r, run_id="run-1")
        db.add(w, recs[0], run_id="run-1")  # the same candidate again in the same run: kept once
        db.add(other, rec(other, 16, 9.0), run_id="run-1")
        db.set_winner(w, recs[0], run_id="run-1")
        assert db.known(w) == recs  # equal records: every field, failures and infinities included
        assert db.winner(w) == recs[0] and db.winner(other) is None
        assert [r.candidate.workload for r in db.known(other)] == [other]
        # a later run re-measures one candidate: a new row; known() gives its latest measurement
        again = rec(w, 64, 1.75)
        db.add(w, again, run_id="run-2")
        assert db.known(w) == [recs[0], recs[1], recs[3], again]
        history = [(m.run_id, m.record) for m in db.history(db_key(w))]
        assert history == [("run-1", r) for r in recs] + [("run-2", again)]
        with pytest.raises(ValueError, match="stored under"):
            db.add(other, recs[0], run_id="run-2")
    with KernelDB(tmp_path / "k.db") as db:  # reopened: everything is still there
        assert db.winner(w) == recs[0] and len(db.history(db_key(w))) == 5
        [e] = [e for e in db.entries() if e.parts.workload_key == w.key]
        assert (e.measured, e.passed, e.best_us, e.last_run, e.winner_run) == (5, 2, 1.75, "run-2", "run-1")
        assert e.stale is None and e.label == "7x33 bf16"


def test_key_has_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    import solforge.kernels.rmsnorm as rmsnorm

    w = wl()
    parts = key_parts(w)
    assert parts.workload_key == w.key and parts.family == "rmsnorm"
    assert (parts.device_name, parts.capability) == ("cpu", "interpreter")
    assert parts.torch == importlib.metadata.version("torch") and parts.triton == importlib.metadata.version("triton")
    assert parts.template == template_hash(rmsnorm) and len(parts.template) == 16
    key = db_key(w)
    assert key == db_key(wl()) and key != db_key(wl(rows=9)) and w.key in key and parts.template in key
    assert parts.settings == settings.current().kernel_key() and key.endswith(f" settings {parts.settings}")
    monkeypatch.setattr(dbmod, "device_key", lambda device: ("NVIDIA H100 80GB HBM3", "9.0"))
    assert db_key(w) != key and "NVIDIA H100 80GB HBM3" in db_key(w) and "9.0" in db_key(w)
    monkeypatch.setattr(dbmod, "installed_version", lambda pkg: "9.9.9")
    assert "torch 9.9.9 triton 9.9.9" in db_key(w)
    # each family hashes its own sources: add_rmsnorm's include rmsnorm's, rope's do not
    hashes = {f: dbmod._current_template(f) for f in ("rmsnorm", "add_rmsnorm", "rope", "swiglu")}
    assert len(set(hashes.values())) == 4


def _kernels_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of solforge/kernels that template hashing reads instead of the real one."""
    copy = tmp_path / "kernels"
    shutil.copytree(ROOT / "solforge" / "kernels", copy, ignore=shutil.ignore_patterns("__pycache__"))
    real = dbmod._module_file

    def module_file(name: str) -> Path | None:
        if name.startswith("solforge.kernels."):
            path = copy / (name.split(".")[2] + ".py")
            return path if path.exists() else None
        return real(name)

    monkeypatch.setattr(dbmod, "_module_file", module_file)
    return copy


def test_template_change_invalidates_only_the_families_it_touched(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    copy = _kernels_copy(tmp_path, monkeypatch)
    ws = {f: wl(f, rows=5) for f in ("rmsnorm", "add_rmsnorm", "rope", "swiglu")}
    db = KernelDB(tmp_path / "k.db")
    for w in ws.values():
        db.add(w, rec(w, 16), run_id="run-1")
        db.set_winner(w, rec(w, 16), run_id="run-1")
    before = {f: db_key(w) for f, w in ws.items()}
    # the backward kernel changes: rmsnorm (whose op uses it) and add_rmsnorm (imports both) re-tune
    with open(copy / "rmsnorm_bwd.py", "a") as f:
        f.write("\n# a changed template\n")
    touched = {f for f, w in ws.items() if db_key(w) != before[f]}
    assert touched == {"rmsnorm", "add_rmsnorm"}
    for f, w in ws.items():
        assert (db.known(w) == [], db.winner(w) is None) == ((True, True) if f in touched else (False, False))
    stale = {e.family: e.stale for e in db.entries()}
    assert stale == {"rmsnorm": "template changed", "add_rmsnorm": "template changed", "rope": None, "swiglu": None}
    # a change to the shared config parser touches every family that imports it
    (copy / "config_text.py").write_text((copy / "config_text.py").read_text() + "\nX = 1\n")
    assert {f for f, w in ws.items() if db_key(w) != before[f]} == {"rmsnorm", "add_rmsnorm", "rope", "swiglu"}
    # prune --stale drops them all, new measurements key under the new hash
    removed = db.prune(stale=True)
    assert sorted(e.family for e in removed) == sorted(ws) and db.entries() == []
    db.add(ws["rope"], rec(ws["rope"], 32), run_id="run-2")
    assert db.known(ws["rope"]) == [rec(ws["rope"], 32)] and db.entries()[0].stale is None
    db.close()


def test_template_hash_covers_the_module_and_its_kernel_imports(tmp_path: Path) -> None:
    def load(name: str, source: str) -> object:
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    a = load("fam_a", "FAMILY = 'x'\n")
    b = load("fam_b", "FAMILY = 'x'\n")
    c = load("fam_c", "FAMILY = 'y'\n")
    d = load("fam_d", "from solforge.kernels import config_text\nFAMILY = 'x'\n")
    ha, hb, hc, hd = (template_hash(m) for m in (a, b, c, d))  # type: ignore[arg-type]
    assert ha != hb  # the module's name is part of what is hashed
    assert len({ha, hc, hd}) == 3
    assert dbmod._kernel_imports("import solforge.kernels.rope as r\nfrom .rmsnorm import Config\n"
                                 "from solforge.kernels.swiglu import swiglu\nimport torch\n") == {
        "solforge.kernels.rope", "solforge.kernels.rmsnorm", "solforge.kernels.swiglu"}


WRITER = """
import sys, time
from solforge.db import KernelDB
from solforge.records import BuildResult, Candidate, RunResult, TuningRecord, Verdict, Workload
path, who, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
w = Workload("rmsnorm", ((3 + who, 17), (17,)), ("fp16", "fp16"), (("eps", 1e-5),), "cpu")
db = KernelDB(path)
while not __import__("os").path.exists(path + ".go"):
    time.sleep(0.01)
for i in range(n):
    cand = Candidate(w, "triton", "row", (("block_h", i), ("num_warps", 4)))
    db.add(w, TuningRecord(cand, BuildResult(True, 0.1), Verdict(True, 1, 0.0, 0.0), RunResult(1.0, 1.0 + i, 9.0)),
           run_id=f"writer-{who}")
    print(i + 1, flush=True)
    if i == n // 2:
        db.set_winner(w, TuningRecord(cand, BuildResult(True, 0.1)), run_id=f"writer-{who}")
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    """Several processes create and fill one file at once: every record arrives, no lock error."""
    path, writers, n = str(tmp_path / "shared.db"), 4, 60
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, str(k), str(n)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(writers)]
    time.sleep(0.5)
    Path(path + ".go").touch()  # all start writing together
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert "locked" not in err
    with KernelDB(path) as db:
        entries = db.entries()
        assert len(entries) == writers and all(e.measured == n and e.winner is not None for e in entries)
        for k in range(writers):
            w = Workload("rmsnorm", ((3 + k, 17), (17,)), ("fp16", "fp16"), (("eps", 1e-5),), "cpu")
            assert [r.run.p50_us for r in db.known(w) if r.run] == [1.0 + i for i in range(n)]


KILLED = WRITER.replace("for i in range(n):", "for i in range(10**9):")


def test_killed_run_keeps_every_committed_record(tmp_path: Path) -> None:
    path = str(tmp_path / "killed.db")
    Path(path + ".go").touch()
    proc = subprocess.Popen([sys.executable, "-c", KILLED, path, "0", "0"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    done = 0
    while done < 40:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        done = int(line)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: no close, no checkpoint
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with KernelDB(path) as db:
        w = Workload("rmsnorm", ((3, 17), (17,)), ("fp16", "fp16"), (("eps", 1e-5),), "cpu")
        times = [r.run.p50_us for r in db.known(w) if r.run]
        assert len(times) >= done and times == [1.0 + i for i in range(len(times))]  # every add printed is there
        db.add(w, rec(w, 10**6), run_id="after")  # and the file still takes writes
        assert db.known(w)[-1] == rec(w, 10**6)
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def _filled(path: Path) -> tuple[KernelDB, list[Workload]]:
    db = KernelDB(path)
    ws = [wl("rmsnorm", 7, 33), wl("rope", 5, 8)]
    for w in ws:
        db.add(w, rec(w, 16, 4.0), run_id="run-1")
        db.add(w, rec(w, 32, fail="verify"), run_id="run-1")
        db.add(w, rec(w, 16, 3.0), run_id="run-2")
        db.set_winner(w, rec(w, 16, 3.0), run_id="run-2")
    return db, ws


def test_export_import_round_trip_is_exact_and_idempotent(tmp_path: Path) -> None:
    src, ws = _filled(tmp_path / "a.db")
    out = io.StringIO()
    assert src.export(out) == (6, 2)
    lines = out.getvalue().splitlines()
    assert len(lines) == 8 and all(json.loads(x)["parts"]["template"] for x in lines)
    dst = KernelDB(tmp_path / "b.db")
    assert dst.import_lines(lines) == (6, 2, 0)
    for w in ws:
        assert dst.known(w) == src.known(w) and dst.winner(w) == src.winner(w) == rec(w, 16, 3.0)
        assert dst.history(db_key(w)) == src.history(db_key(w))  # run ids and times kept
    assert dst.import_lines(lines) == (0, 0, 8)  # again: nothing added
    again = io.StringIO()
    dst.export(again)
    assert again.getvalue() == out.getvalue()
    # one family only
    fam = io.StringIO()
    assert src.export(fam, family="rope") == (3, 1)
    assert {json.loads(x)["parts"]["family"] for x in fam.getvalue().splitlines()} == {"rope"}
    # a newer winner from elsewhere replaces ours, an older one does not
    newer = [json.loads(x) for x in lines if json.loads(x)["kind"] == "winner"][0]
    newer["created"] += 10
    newer["record"]["candidate"]["config"][0][1] = 128
    assert dst.import_lines([json.dumps(newer)]) == (0, 1, 0)
    w = ws[0] if newer["parts"]["family"] == "rmsnorm" else ws[1]
    assert dst.winner(w) == rec(w, 128, 3.0)
    newer["created"] -= 100
    assert dst.import_lines([json.dumps(newer)]) == (0, 0, 1)
    src.close()
    dst.close()


def test_import_keys_other_machines_entries_by_their_own_parts(tmp_path: Path) -> None:
    src, ws = _filled(tmp_path / "a.db")
    out = io.StringIO()
    src.export(out)
    h100 = []
    for x in out.getvalue().splitlines():
        d = json.loads(x)
        d["parts"] |= {"device_name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "torch": "2.9.0+cu128"}
        d["key"] = dbmod.KeyParts(**d["parts"]).text
        h100.append(json.dumps(d))
    dst = KernelDB(tmp_path / "b.db")
    assert dst.import_lines(h100) == (6, 2, 0)
    assert all(dst.known(w) == [] and dst.winner(w) is None for w in ws)  # not this machine's key
    entries = dst.entries()
    assert {e.parts.device_name for e in entries} == {"NVIDIA H100 80GB HBM3"}
    assert all(e.stale == "torch 2.9.0+cu128" for e in entries)


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not JSON"),
    ('{"kind": "measurement"}', "missing"),
    ("KEY", "does not match"),
    ("FORMAT", "export format"),
    ("RECORD", "malformed"),
])
def test_import_rejects_a_bad_line_by_number_and_writes_nothing(tmp_path: Path, bad: str, why: str) -> None:
    src, _ = _filled(tmp_path / "a.db")
    out = io.StringIO()
    src.export(out)
    lines = out.getvalue().splitlines()
    d = json.loads(lines[1])
    if bad == "KEY":
        d["key"] = d["key"].replace("template", "template 0")
    elif bad == "FORMAT":
        d["format"] = 99
    elif bad == "RECORD":
        del d["record"]["build"]
    lines[2] = json.dumps(d) if bad.isupper() else bad
    dst = KernelDB(tmp_path / "b.db")
    with pytest.raises(UserError, match=rf"team.jsonl:3: .*{why}"):
        dst.import_lines(lines, source="team.jsonl")
    assert dst.entries() == []


def _written_by_schema(path: Path, version: int) -> tuple[Workload, TuningRecord]:
    """A file as schema `version` (1 or 2) wrote it: one measurement and winner under the key text
    of then (no settings), and for version 1 no baselines table."""
    w, r = wl(), rec(wl(), 64)
    with KernelDB(path) as db:
        db.add(w, r, run_id="r1")
        db.set_winner(w, r, run_id="r1")
    old = dataclasses.replace(key_parts(w), settings="").text
    with sqlite3.connect(path) as c:
        for table in ("keys", "measurements", "winners"):
            c.execute(f"UPDATE {table} SET key = ?", (old,))
        c.execute("UPDATE keys SET id = ?", (dbmod.short_id(old),))
        c.execute("ALTER TABLE keys DROP COLUMN settings")
        if version == 1:
            c.execute("DROP TABLE baselines")
        c.execute(f"PRAGMA user_version = {version}")
    return w, r


@pytest.mark.parametrize("version", [1, 2])
def test_older_file_is_migrated_and_keeps_its_records_as_stale(tmp_path: Path, version: int) -> None:
    """A file written by schema 1 (no baselines table) or 2 (no settings in the key) opens and
    gains what it lacks. Its records stay, but they were measured under settings nobody wrote
    down: never a hit, shown stale, removed by prune --stale."""
    path = tmp_path / f"v{version}.db"
    w, r = _written_by_schema(path, version)
    db = KernelDB(path)
    [e] = db.entries()
    assert e.measured == 1 and e.winner == r and e.parts.settings == ""
    assert e.stale == "settings unknown (stored before schema 3)" and e.key == db.history(e.key)[0].key
    assert db.known(w) == [] and db.winner(w) is None  # not this run's key
    db.add(w, r, run_id="r2")  # measured again, under this run's settings: a key of its own
    assert db.known(w) == [r] and len(db.entries()) == 2
    assert db.baseline(w, "sig") is None
    db.set_baseline(w, "sig", RunResult(1.0, 2.0, 3.0))
    assert db.baseline(w, "sig") == RunResult(1.0, 2.0, 3.0) and db.baseline(w, "other") is None
    assert db.baseline(wl(rows=9), "sig") is None
    assert [x.key for x in db.prune(stale=True)] == [e.key] and db.known(w) == [r]
    db.close()
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == dbmod.SCHEMA_VERSION == 3


def test_import_of_a_format_1_line_keys_it_under_unknown_settings(tmp_path: Path) -> None:
    src, ws = _filled(tmp_path / "a.db")
    out = io.StringIO()
    src.export(out)
    lines = []
    for x in out.getvalue().splitlines():
        d = json.loads(x)
        assert d["format"] == dbmod.EXPORT_FORMAT == 2 and d["parts"]["settings"] == settings.current().kernel_key()
        del d["parts"]["settings"]
        d["format"], d["key"] = 1, dbmod.KeyParts(**d["parts"], settings="").text
        lines.append(json.dumps(d))
    dst = KernelDB(tmp_path / "b.db")
    assert dst.import_lines(lines) == (6, 2, 0)
    assert all(dst.known(w) == [] and dst.winner(w) is None for w in ws)
    assert {e.stale for e in dst.entries()} == {"settings unknown (stored before schema 3)"}
    src.close()
    dst.close()


def test_schema_version_and_foreign_files_are_user_errors(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    KernelDB(path).close()
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == dbmod.SCHEMA_VERSION
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        c.execute(f"PRAGMA user_version = {dbmod.SCHEMA_VERSION + 1}")
    with pytest.raises(UserError, match="upgrade solforge"):
        KernelDB(path)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database, just text\n" * 100)
    # the read-only commands do not move it (the tuner's side does: test_db_faults.py)
    with pytest.raises(UserError, match="is corrupt"):
        KernelDB(junk, create=False)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE photos (id INTEGER)")
    with pytest.raises(UserError, match="photos"):
        KernelDB(other)
    with pytest.raises(UserError, match="no kernel database"):
        KernelDB(tmp_path / "missing.db", create=False)


def test_default_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with settings.override(db=tmp_path / "x.db"):
        assert default_path() == tmp_path / "x.db"
    monkeypatch.setenv("HOME", str(tmp_path))
    with settings.override(db=None):
        assert default_path() == tmp_path / ".cache" / "solforge" / "kernels.db"


def test_prune_criteria(tmp_path: Path) -> None:
    db, ws = _filled(tmp_path / "a.db")
    with pytest.raises(UserError, match="at least one"):
        db.prune()
    now = time.time()
    assert db.prune(older_than_days=1, now=now) == []
    assert [e.family for e in db.prune(older_than_days=1, now=now + 2 * 86400, family="rope", dry_run=True)] == ["rope"]
    assert len(db.entries()) == 2  # a dry run removes nothing
    assert db.prune(stale=True) == []
    assert [e.family for e in db.prune(family="rope")] == ["rope"]
    assert db.known(ws[1]) == [] and db.winner(ws[1]) is None and len(db.known(ws[0])) == 2
    db.close()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "k.db"
    db, ws = _filled(path)
    ids = {e.family: e.id for e in db.entries()}
    db.close()
    assert main(["db", "list", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 keys" in out and ids["rmsnorm"] in out and ids["rope"] in out and "current" in out
    assert main(["db", "show", ids["rope"][:6], "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert ws[1].key in out and ws[0].key not in out
    assert "verify: max rel err 0.75 > 0.02" in out and "run-2" in out and "block_h=32" in out
    assert main(["db", "show", "rmsnorm", "--db", str(path)]) == 0
    assert ws[0].key in capsys.readouterr().out
    export = tmp_path / "team.jsonl"
    assert main(["db", "export", str(export), "--db", str(path)]) == 0
    assert "exported 6 measurements and 2 winners" in capsys.readouterr().err
    assert len(export.read_text().splitlines()) == 8
    assert main(["db", "import", str(export), "--db", str(tmp_path / "b.db")]) == 0
    assert "imported 6 measurements and 2 winners" in capsys.readouterr().out
    assert main(["db", "import", str(export), "--db", str(tmp_path / "b.db")]) == 0
    assert "imported 0 measurements and 0 winners" in capsys.readouterr().out
    assert main(["db", "prune", "--family", "rope", "--dry-run", "--db", str(path)]) == 0
    assert "would remove 1 keys, 3 measurements, 1 winners" in capsys.readouterr().out
    assert main(["db", "prune", "--older-than", "0", "--db", str(path)]) == 0
    assert "removed 2 keys" in capsys.readouterr().out
    assert main(["db", "list", "--db", str(path)]) == 0
    assert "empty" in capsys.readouterr().out
    # the default file comes from $SOLFORGE_DB (conftest points it into a temporary directory)
    assert main(["db", "import", str(export)]) == 0 and default_path().exists()
    capsys.readouterr()


@pytest.mark.parametrize("argv, message", [
    (["db", "show", "nothing-like-this"], "no key in"),
    (["db", "show", "rmsnorm", "--db", "/nonexistent/dir/k.db"], "no kernel database at /nonexistent"),
    (["db", "prune"], "at least one of"),
    (["db", "import", "/nonexistent/team.jsonl"], "cannot read /nonexistent/team.jsonl"),
    (["db", "export", "/nonexistent/dir/out.jsonl"], "cannot write"),
])
def test_cli_user_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    KernelDB().close()  # the default ($SOLFORGE_DB) database exists and is empty
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("solforge: error: ") and message in err and "\n" not in err and "Traceback" not in err


def test_cli_help_and_missing_database(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["db", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(a in out for a in ("list", "show", "export", "import", "prune", "template"))
    assert main(["db"]) == 2
    capsys.readouterr()
    assert main(["db", "list", "--db", str(tmp_path / "none.db")]) == 0
    assert "no kernel database" in capsys.readouterr().out and not (tmp_path / "none.db").exists()
