"""The kernel database's SQLite file when it is not a healthy, writable file (solforge.db uses these).

- Corrupt (garbage pages, a truncated file, a file overwritten while a tune runs): SQLite says so
  with SQLITE_CORRUPT or SQLITE_NOTADB, on open (a `PRAGMA quick_check`) or on whatever query first
  touches a bad page. The file is moved aside to `<name>.corrupt-<time>` (kept, not deleted: it is
  the user's data) and an empty one takes its place.
- Read-only (the file, or its directory, which must take the `-wal` / `-shm` files): opened with
  SQLite's `mode=ro`, or `immutable=1` where even that needs a file it cannot create (a WAL
  database in a read-only directory without its `-shm`).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
import urllib.parse
from pathlib import Path

BUSY_TIMEOUT_S = 60.0  # how long a writer waits for another process's transaction
_CORRUPT_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB (primary codes: the low byte)
_READONLY_CODE = 8  # SQLITE_READONLY
SIDE_FILES = ("-wal", "-shm", "-journal")


class Corrupt(sqlite3.DatabaseError):
    """`PRAGMA quick_check` found damage that no query has run into yet."""


def is_corrupt(e: BaseException) -> bool:
    if isinstance(e, Corrupt):
        return True
    code = getattr(e, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in _CORRUPT_CODES
    text = str(e)
    return isinstance(e, sqlite3.DatabaseError) and ("malformed" in text or "not a database" in text)


def is_read_only(e: BaseException) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == _READONLY_CODE


def not_writable(path: Path) -> str | None:
    """Why this process cannot write the database at `path` (and the journal files beside it), or None."""
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is read-only"
    directory = path.parent
    if not directory.is_dir():
        return None  # the caller creates it (or fails to, and says so)
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"its directory {directory} is read-only"
    return None


def connect(path: Path, *, read_only: bool) -> sqlite3.Connection:
    """A connection in autocommit mode (solforge.db opens its own transactions), shareable by threads."""
    opts = {"timeout": BUSY_TIMEOUT_S, "isolation_level": None, "check_same_thread": False}
    if not read_only:
        return sqlite3.connect(path, **opts)  # type: ignore[arg-type]
    uri = "file:" + urllib.parse.quote(str(path.resolve()), safe="/")
    conn = sqlite3.connect(uri + "?mode=ro", uri=True, **opts)  # type: ignore[arg-type]
    try:
        conn.execute("PRAGMA user_version").fetchone()  # mode=ro fails only on first use
        return conn
    except sqlite3.OperationalError:
        conn.close()
    # a WAL file in a read-only directory without its -shm: nothing else can be writing it
    # (nobody can create the -shm either), so reading it as immutable is safe
    return sqlite3.connect(uri + "?immutable=1", uri=True, **opts)  # type: ignore[arg-type]


def check(conn: sqlite3.Connection) -> None:
    """Raise Corrupt if SQLite's structural check finds damage (~0.2 s for a 33 MB file)."""
    rows = conn.execute("PRAGMA quick_check(3)").fetchall()
    if [r[0] for r in rows] != ["ok"]:
        text = " ".join(" ".join(str(r[0]) for r in rows).split()).replace("*** in database main *** ", "")
        raise Corrupt(text if len(text) <= 160 else text[:157] + "...")  # one line, as every warning


def inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def move_aside(path: Path) -> Path:
    """Rename a corrupt database (and its WAL) to `<name>.corrupt-<time>`; raises OSError."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    os.replace(path, aside)
    for suffix in SIDE_FILES:
        side = Path(f"{path}{suffix}")
        if side.exists():
            try:  # the WAL goes with the copy (it holds the latest commits); the -shm is rebuilt
                if suffix == "-shm":
                    side.unlink()
                else:
                    os.replace(side, Path(f"{aside}{suffix}"))
            except OSError:
                pass
    return aside


def warn(message: str) -> None:
    """One line on stderr, as the CLI's errors are written."""
    print(f"solforge: warning: {message}", file=sys.stderr, flush=True)
