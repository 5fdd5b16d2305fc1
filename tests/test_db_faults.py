"""The kernel database's faults: a corrupt file (garbage pages, truncated, damaged between two
writes of a tune) is moved aside and rebuilt without losing what this run measured; a read-only
file or directory is read and not written. Each says so in one warning line."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import random
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_db import rec, wl

from solforge.db import KernelDB, db_key
from solforge.records import RunResult

ROOT = Path(__file__).resolve().parents[1]


def _filled(path: Path, n: int = 40) -> list:
    """A file of several pages: n measurements of one workload, a winner, a baseline; closed."""
    w = wl()
    recs = [rec(w, 16 + i, 1.0 + i) for i in range(n)]
    with KernelDB(path) as db:
        for r in recs:
            db.add(w, r, run_id="old")
        db.set_winner(w, recs[0], run_id="old")
        db.set_baseline(w, "sig", RunResult(5.0, 5.0, 5.0, meaningful=False))
    with contextlib.closing(sqlite3.connect(path)) as c:  # the last connection: -wal and -shm go
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert path.stat().st_size > 8 * 4096 and not Path(f"{path}-shm").exists()
    return recs


def _garble(path: Path, start: int, seed: int = 0) -> None:
    """Overwrite everything from byte `start` on with seeded random bytes."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(random.Random(seed).randbytes(size - start))


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("solforge: warning:")]


def _aside(path: Path) -> list[Path]:
    return sorted(path.parent.glob(path.name + ".corrupt-*[0-9]"))


def _check_rebuilt(path: Path, before: bytes, err: str) -> None:
    """One warning naming the moved file; the corrupt bytes kept beside; a healthy file in place."""
    (line,) = _warnings(err)
    (aside,) = _aside(path)
    assert "is corrupt" in line and aside.name in line
    assert aside.read_bytes() == before
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


@pytest.mark.parametrize("damage", ["garbage pages", "garbage header", "truncated"])
def test_corrupt_file_is_moved_aside_and_rebuilt(tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "k.db"
    _filled(path)
    if damage == "garbage pages":
        _garble(path, 2 * 4096)
    elif damage == "garbage header":
        _garble(path, 0)
    else:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    before = path.read_bytes()
    w = wl()
    new = rec(w, 999, 0.5)
    with KernelDB(path) as db:  # no traceback: the run goes on with an empty file
        assert db.known(w) == [] and db.winner(w) is None
        db.add(w, new, run_id="now")
        db.set_winner(w, new, run_id="now")
    _check_rebuilt(path, before, capsys.readouterr().err)
    with KernelDB(path) as db:
        assert db.known(w) == [new] and db.winner(w) == new
    assert not _warnings(capsys.readouterr().err)


def _scramble_wal_index(path: Path) -> None:
    """What a process that wrote the file would do: the wal-index header changes, so the open
    connection drops its cached pages and reads the damaged ones."""
    shm = Path(f"{path}-shm")
    with open(shm, "r+b") as f:
        f.write(random.Random(1).randbytes(136))


def test_corruption_between_two_writes_loses_nothing_of_this_run(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "k.db"
    old = _filled(path)
    w, other = wl(), wl(rows=5)
    mine = [rec(w, 500, 0.25), rec(other, 16, 3.0)]
    db = KernelDB(path)
    assert len(db.known(w)) == len(old)
    db.add(w, mine[0], run_id="now")
    db.set_baseline(other, "sig2", RunResult(7.0, 7.0, 7.0, meaningful=False))
    with sqlite3.connect(path) as c:  # the records so far into the main file, then damage it
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    _garble(path, 2 * 4096)
    _scramble_wal_index(path)
    before = path.read_bytes()
    db.add(other, mine[1], run_id="now")  # finds the damage: rebuilt, this run's writes replayed
    db.set_winner(other, mine[1], run_id="now")
    assert db.known(w) == [mine[0]] and db.known(other) == [mine[1]] and db.winner(other) == mine[1]
    db.close()
    _check_rebuilt(path, before, capsys.readouterr().err)
    with KernelDB(path) as db:
        assert db.known(w) == [mine[0]] and db.known(other) == [mine[1]] and db.winner(other) == mine[1]
        assert db.baseline(other, "sig2") == RunResult(7.0, 7.0, 7.0, meaningful=False)
        assert [m.run_id for m in db.history(db_key(w))] == ["now"]


def test_corruption_during_a_tune(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """The tuner's own loop: the file is damaged after its first stored record; the tune ends with
    every record and its winner in the rebuilt file."""
    from conftest import DEVICE
    from test_tune_db import BASE, CountingRunner, _rms_workload

    from solforge.tune import tune

    path = tmp_path / "k.db"
    _filled(path)

    class Corrupting(CountingRunner):
        def measure(self, cands):  # type: ignore[override]
            for r in super().measure(cands):
                if len(self.measured) == 2:  # the first record is stored by now
                    with sqlite3.connect(path) as c:
                        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    _garble(path, 2 * 4096)
                    _scramble_wal_index(path)
                yield r

    w = _rms_workload()
    db = KernelDB(path)
    runner = Corrupting()
    res = tune(w, BASE, device=DEVICE, budget_s=1e9, max_candidates=3, runner=runner, db=db, run_id="t")
    assert res.best is not None and len(runner.measured) == 3
    db.close()
    assert len(_warnings(capsys.readouterr().err)) == 1 and len(_aside(path)) == 1
    with KernelDB(path) as db:
        stored = db.known(w)
        assert sorted(r.candidate.label for r in stored) == sorted(r.candidate.label for r in res.records)
        assert db.winner(w) == res.best


# ----------------------------------------------------------------------------------------------
# Read-only. Root writes any file whatever its mode: as root, the scenario runs in a user
# namespace where the files' owner is unmapped, so their mode bits are what holds.

READER = """
import hashlib, sys
from pathlib import Path
from solforge.db import KernelDB
from solforge.records import RunResult
sys.path.insert(0, {tests!r})
from test_db import rec, wl
path = Path({path!r})
w = wl()
with KernelDB(path) as db:
    print("known", len(db.known(w)), "winner", db.winner(w) is not None, "read_only", db.read_only is not None)
    db.add(w, rec(w, 999, 0.5), run_id="ro")
    db.add(w, rec(w, 998, 0.5), run_id="ro")
    db.set_winner(w, rec(w, 999, 0.5), run_id="ro")
    db.set_baseline(w, "x", RunResult(1.0, 1.0, 1.0))
    print("after", len(db.known(w)))
from solforge.cli import main
print("list", main(["db", "list", "--db", str(path)]))
print("prune", main(["db", "prune", "--family", "rmsnorm", "--db", str(path)]))
"""


def _unprivileged() -> None:
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")


def _run_unprivileged(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                              preexec_fn=_unprivileged)
    except subprocess.SubprocessError as e:
        pytest.skip(f"cannot drop root's file access here: {e}")


def _digest(directory: Path) -> dict[str, str]:
    # not the -shm (the wal-index: shared memory every reader updates), nor an empty -wal (SQLite's
    # read-only mode makes one where it can): neither is data
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if not p.name.endswith("-shm") and not (p.name.endswith("-wal") and p.stat().st_size == 0)}


@pytest.mark.parametrize("what", ["file", "directory"])
def test_read_only_database_is_read_and_not_written(tmp_path: Path, what: str):
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "k.db"
    recs = _filled(path)
    before = _digest(directory)
    if what == "file":
        path.chmod(0o444)
    else:
        directory.chmod(0o555)
    try:
        p = _run_unprivileged(textwrap.dedent(READER.format(tests=str(ROOT / "tests"), path=str(path))))
    finally:
        directory.chmod(0o755)
        path.chmod(0o644)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    # its records are used; the tuner's writes are skipped; one line says so
    assert out[0] == f"known {len(recs)} winner True read_only True" and out[1] == f"after {len(recs)}"
    warned = _warnings(p.stderr)
    assert len(warned) == 1 and "not writable" in warned[0] and "not stored" in warned[0], p.stderr
    # `db list` reads it; `db prune`, an explicit write, is refused in one line
    assert "list 0" in out and "1 keys" in p.stdout
    assert "prune 2" in out
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("solforge: error:")]
    assert len(errors) == 1 and "not writable" in errors[0] and "Traceback" not in p.stderr
    assert _digest(directory) == before  # not one byte changed, no file added


def test_read_only_directory_without_a_file_runs_in_memory(tmp_path: Path):
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o555)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from solforge.db import KernelDB
        from test_db import rec, wl
        w = wl()
        with KernelDB({str(directory / "k.db")!r}) as db:
            db.add(w, rec(w, 16, 1.0), run_id="m")
            print(len(db.known(w)), db.in_memory)
        """)
    try:
        p = _run_unprivileged(code)
    finally:
        directory.chmod(0o755)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "True"]  # the run still sees what it measured
    (line,) = _warnings(p.stderr)
    assert "cannot create" in line and "in memory only" in line
    assert list(directory.iterdir()) == []


def test_two_writers_of_a_file_corrupted_under_them_move_it_aside_once(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]):
    """The first writer to find the damage moves the file aside; the second finds the new file
    there, goes on with it and writes its own records again into it: one copy aside, nothing lost."""
    path = tmp_path / "k.db"
    _filled(path)
    w = wl()
    a, b = KernelDB(path), KernelDB(path)
    a.add(w, rec(w, 501, 1.0), run_id="a")
    b.add(w, rec(w, 502, 2.0), run_id="b")
    with contextlib.closing(sqlite3.connect(path)) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    _garble(path, 2 * 4096)
    _scramble_wal_index(path)
    a.add(w, rec(w, 503, 3.0), run_id="a")
    b.add(w, rec(w, 504, 4.0), run_id="b")
    a.close()
    b.close()
    err = capsys.readouterr().err
    assert len(_aside(path)) == 1 and len(_warnings(err)) == 2, err
    assert "moved it to" in err and "another process has" in err
    with KernelDB(path) as db:
        assert sorted(r.candidate.config_dict["block_h"] for r in db.known(w)) == [501, 502, 503, 504]
