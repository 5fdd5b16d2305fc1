"""Kernel database: every measured candidate and every winner, kept across runs (docs/design.md, The kernel database).

One SQLite file (stdlib sqlite3; `~/.cache/solforge/kernels.db` unless $SOLFORGE_DB or --db says
otherwise). Records are stored as their JSON (solforge.records round-trips them exactly) next to
the columns that list/show/prune query. Recipes, not binaries: a winner is rebuilt from its config.

The key (`db_key`) is the workload's key + the device's name and compute capability + the torch and
triton versions + a hash of the template source (the family's module and every solforge.kernels
module it imports) + the settings that change kernel code (`Settings.kernel_key`, schema 3:
"pdl=1 torch_order=1"). Change any of them and the workload is a new key, so it is tuned again; a
template change re-tunes only the families whose sources it touched. A run under other settings
(SOLFORGE_TORCH_ORDER=0) keeps its own entries beside the default ones.

Besides the tuner's records, the file keeps each region's original time (`baselines`, schema 2),
so that a warm run does not time the model's own regions again; those stay on the machine that
measured them (export/import carry measurements and winners only).

Concurrency: WAL journal, a busy timeout, and one short `BEGIN IMMEDIATE` transaction per write,
committed at once: several processes may tune into one file, and a run killed at any moment loses
nothing it had measured (WAL with synchronous=NORMAL survives a killed process; only a power loss
can cost the last transactions). Open one KernelDB per process (a connection must not cross fork).

Faults (solforge/db/file.py): a corrupt file is moved aside and rebuilt, keeping what this process
wrote; a read-only one is read and not written; either is one warning line (KernelDB's docstring).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from solforge import settings as _settings
from solforge.db import file as dbfile
from solforge.db.file import BUSY_TIMEOUT_S
from solforge.errors import UserError
from solforge.records import RunResult, TuningRecord, Workload, from_dict, to_dict, to_json

SCHEMA_VERSION = 3
EXPORT_FORMAT = 2  # the "format" field of every exported JSON line (1: no settings among the parts)
KERNELS = "solforge.kernels"
# packages whose modules a family's template hash follows through imports: the generated family's
# kernels are written by solforge.codegen, so a change there re-tunes its workloads
_HASHED = (KERNELS, "solforge.codegen")

# the tables as schema version 1 made them; _MIGRATIONS brings a new file up to SCHEMA_VERSION
_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    key TEXT PRIMARY KEY, id TEXT NOT NULL, family TEXT NOT NULL, workload_key TEXT NOT NULL,
    label TEXT NOT NULL, device_name TEXT NOT NULL, capability TEXT NOT NULL, torch TEXT NOT NULL,
    triton TEXT NOT NULL, template TEXT NOT NULL, workload TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS keys_family ON keys (family);
CREATE TABLE IF NOT EXISTS measurements (
    rowid INTEGER PRIMARY KEY, key TEXT NOT NULL REFERENCES keys (key), run_id TEXT NOT NULL,
    candidate TEXT NOT NULL, config TEXT NOT NULL, ok INTEGER NOT NULL, p20 REAL, p50 REAL, p80 REAL,
    error TEXT, record TEXT NOT NULL, created REAL NOT NULL, UNIQUE (key, run_id, candidate));
CREATE TABLE IF NOT EXISTS winners (
    key TEXT PRIMARY KEY REFERENCES keys (key), record TEXT NOT NULL, run_id TEXT NOT NULL,
    created REAL NOT NULL);
"""
# Schema changes since version 1, each run once on an older file: version -> the statements that
# bring a file at that version to the next. Version 2: the original regions' times (`baselines`),
# so a warm run does not time every region again (a region's time depends on the key's device and
# torch; `region` names the ATen computation the model ran, since two spellings share a workload).
# Version 3: the settings that change kernel code are part of the key (KeyParts.settings). What an
# older file holds was measured under settings nobody wrote down: its keys keep their text and get
# settings '' (unknown), which no run's key has, so they are never a hit again, and show as stale
# (`solforge db prune --stale` removes them).
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("CREATE TABLE IF NOT EXISTS baselines (key TEXT NOT NULL REFERENCES keys (key), region TEXT NOT NULL, "
        "run TEXT NOT NULL, created REAL NOT NULL, PRIMARY KEY (key, region))",),
    2: ("ALTER TABLE keys ADD COLUMN settings TEXT NOT NULL DEFAULT ''",),
}
_TABLES = {"keys", "measurements", "winners", "baselines"}


def default_path() -> Path:
    """$SOLFORGE_DB if set (settings.db; tests point it into a temporary directory), else
    ~/.cache/solforge/kernels.db."""
    configured = _settings.current().db
    return configured if configured is not None else Path.home() / ".cache" / "solforge" / "kernels.db"


# ----------------------------------------------------------------------------------------------
# The key


def _module_file(name: str) -> Path | None:
    """The source file of module `name`, found without importing it (so without torch/triton)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _kernel_imports(source: str) -> set[str]:
    """Names of the solforge.kernels and solforge.codegen modules a source imports (any form of
    import statement)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(tuple(p + "." for p in _HASHED))}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:  # relative, from inside the kernels package
                base = f"{KERNELS}.{base}" if base else KERNELS
            elif node.level > 1:
                continue
            if base in _HASHED:  # from solforge.kernels import rmsnorm (a module, or a package name)
                found |= {f"{base}.{a.name}" for a in node.names}
            elif base.startswith(tuple(p + "." for p in _HASHED)):
                found.add(base)
    return {".".join(n.split(".")[:3]) for n in found}


_hash_cache: dict[tuple[str, str], tuple[tuple[tuple[str, int, int], ...], str]] = {}


def _source_hash(name: str, path: Path) -> str:
    """sha256 (16 hex) over module `name` at `path` and every kernels module it imports, transitively.

    Cached per process and re-read when any of the files changes (size or mtime)."""
    cached = _hash_cache.get((name, str(path)))
    if cached is not None:
        stats, digest = cached
        try:
            if all((s := os.stat(p)).st_mtime_ns == m and s.st_size == z for p, m, z in stats):
                return digest
        except OSError:
            pass
    sources: dict[str, tuple[Path, bytes]] = {}
    todo = [(name, path)]
    while todo:
        mod, file = todo.pop()
        if mod in sources:
            continue
        data = file.read_bytes()
        sources[mod] = (file, data)
        for dep in sorted(_kernel_imports(data.decode())):
            dep_file = _module_file(dep)
            if dep_file is not None and dep not in sources:
                todo.append((dep, dep_file))
    h = hashlib.sha256()
    for mod in sorted(sources):  # module names and contents only: the same on every machine
        h.update(f"{mod}\n{len(sources[mod][1])}\n".encode())
        h.update(sources[mod][1])
    digest = h.hexdigest()[:16]
    stats = tuple((str(f), (s := f.stat()).st_mtime_ns, s.st_size) for f, _ in sources.values())
    _hash_cache[(name, str(path))] = (stats, digest)
    return digest


def template_hash(family: ModuleType) -> str:
    """Hash of the family module's source and every solforge.kernels module it uses, transitively
    (add_rmsnorm: itself, rmsnorm, rmsnorm_bwd, config_text)."""
    if not getattr(family, "__file__", None):
        raise ValueError(f"{family.__name__} has no source file to hash")
    return _source_hash(family.__name__, Path(family.__file__))


def _current_template(family: str) -> str | None:
    """The installed template hash of a family by name (its module in kernels/registry.py's table;
    a dotted name is a module path), or None when no such family or module exists."""
    from solforge.kernels import registry

    name = registry.module_path(family)
    if name is None:
        return None
    path = _module_file(name)
    return None if path is None else _source_hash(name, path)


@functools.cache
def device_key(device: str) -> tuple[str, str]:
    """(device name, compute capability): ("NVIDIA H100 80GB HBM3", "9.0") on cuda,
    ("cpu", "interpreter") otherwise (Triton's interpreter: the CPU model does not change a kernel)."""
    if device.split(":")[0] != "cuda":
        return ("cpu", "interpreter")
    import torch

    index = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(index)
    return (torch.cuda.get_device_name(index), f"{major}.{minor}")


@functools.cache
def installed_version(package: str) -> str:
    """A package's installed version, read from its metadata (no import of torch or triton)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@dataclass(frozen=True)
class KeyParts:
    """Everything a kernel's speed and correctness depend on, besides its config."""

    workload_key: str
    family: str
    device_name: str
    capability: str
    torch: str
    triton: str
    template: str
    settings: str  # Settings.kernel_key(); "" in keys stored before schema 3 (unknown)

    @property
    def text(self) -> str:
        # without settings: the text such a key had before schema 3, which the migrated rows keep
        return (f"{self.workload_key} on {self.device_name} (cc {self.capability}) torch {self.torch} "
                f"triton {self.triton} template {self.template}" + (f" settings {self.settings}" if self.settings
                                                                    else ""))


def key_parts(workload: Workload) -> KeyParts:
    template = _current_template(workload.family)
    if template is None:
        raise ValueError(f"no kernel family module for {workload.family!r} (kernels/registry.py)")
    name, cap = device_key(workload.device)
    return KeyParts(workload.key, workload.family, name, cap, installed_version("torch"),
                    installed_version("triton"), template, _settings.current().kernel_key())


def db_key(workload: Workload) -> str:
    """The workload's key in the database: one stable text of all of KeyParts."""
    return key_parts(workload).text


def short_id(key: str) -> str:
    """12 hex digits naming a key in `solforge db list` / `show`."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def staleness(parts: KeyParts) -> str | None:
    """Why an entry can no longer be a hit on this machine's software, or None if it still can.

    The device and the settings are not judged: entries imported from other GPUs are kept for those
    GPUs, entries measured under other settings for runs under those."""
    why = []
    if not parts.settings:
        why.append("settings unknown (stored before schema 3)")
    if parts.template != _current_template(parts.family):
        why.append("template changed")
    for pkg in ("torch", "triton"):
        if getattr(parts, pkg) != installed_version(pkg):
            why.append(f"{pkg} {getattr(parts, pkg)}")
    return ", ".join(why) or None


# ----------------------------------------------------------------------------------------------
# The file


@dataclass(frozen=True)
class Measurement:
    """One stored row: a record with where and when it was measured."""

    key: str
    run_id: str
    created: float  # seconds since the epoch
    record: TuningRecord


@dataclass(frozen=True)
class Entry:
    """One key of the database, as `solforge db list` shows it."""

    parts: KeyParts
    label: str
    measured: int
    passed: int
    best_us: float | None  # fastest verified p50 among the measurements
    last_time: float | None  # latest measurement or winner
    last_run: str | None
    winner: TuningRecord | None
    winner_time: float | None
    winner_run: str | None
    stale: str | None  # staleness() on this machine

    @property
    def key(self) -> str:
        return self.parts.text

    @property
    def id(self) -> str:
        return short_id(self.key)

    @property
    def family(self) -> str:
        return self.parts.family


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class KernelDB:
    """The kernel database in one SQLite file; see the module docstring.

    `create=False` (the read-only CLI commands) refuses a path where no database exists yet.

    Faults (solforge.db.file): with `create` (the tuner's side), a corrupt file, found on open or by
    any later query, is moved aside and replaced by an empty one, and this process's own writes so
    far are written again into it, so a run loses nothing it measured. A file this process cannot
    write (read-only file or directory) is read; the tuner's writes are skipped. Each is said once,
    on stderr, and kept in `problems` for the report."""

    def __init__(self, path: str | Path | None = None, *, create: bool = True) -> None:
        self.path = Path(path).expanduser() if path is not None else default_path()
        if not create and not self.path.is_file():
            raise UserError(f"no kernel database at {self.path} (solforge optimize creates it; --db PATH "
                            "picks another file)")
        self._create = create
        self._lock = threading.RLock()  # one connection, usable from the tuner's threads
        self.read_only: str | None = None  # why this process cannot write the file; None: it can
        self.in_memory = False  # no usable file: this run's records live in memory only
        self.problems: list[str] = []  # what went wrong with the file, as said on stderr
        # this process's writes, each a function of a connection: replayed into a rebuilt file
        self._journal: list[Callable[[sqlite3.Connection], object]] = []
        self._inode: int | None = None
        if create:
            with contextlib.suppress(OSError):  # a directory that cannot be made: said by _connect
                self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._connect()

    def _connect(self) -> None:
        """Open the file (read-only if need be) and check it; recover from a corrupt one."""
        why = dbfile.not_writable(self.path)
        if why is None and not self.path.parent.is_dir():
            why = f"its directory {self.path.parent} cannot be created"
        if why is not None and not self.path.is_file():
            self._memory(f"cannot create the kernel database {self.path} ({why})")
            return
        if why is not None and self.read_only is None:
            self.read_only = why
            if self._create:  # the read-only commands (db list, show) have nothing to say about it
                self._warn(f"the kernel database {self.path} is not writable ({why}): its records are used, "
                           "this run's results are not stored")
        try:
            self._conn = dbfile.connect(self.path, read_only=why is not None)
        except (OSError, sqlite3.Error) as e:
            raise UserError(f"cannot open the kernel database {self.path}: {e}") from None
        self._inode = dbfile.inode(self.path)
        try:
            self._open()
            if self._create:  # the tuner's side: damage found now costs nothing measured
                dbfile.check(self._conn)
        except UserError:
            self._conn.close()
            raise
        except sqlite3.DatabaseError as e:
            self._conn.close()
            if self._create and dbfile.is_corrupt(e):
                self._recover(e)
                return
            if "locked" in str(e) or "busy" in str(e):
                raise UserError(f"the kernel database {self.path} stayed locked by another process for "
                                f"{BUSY_TIMEOUT_S:.0f} s; try again") from None
            if dbfile.is_corrupt(e):
                raise UserError(f"the kernel database {self.path} is corrupt ({e}): solforge optimize moves it "
                                "aside and starts an empty one; or pass --db with another path") from None
            raise UserError(f"{self.path} is not a usable solforge kernel database ({e}); move it away or "
                            "pass --db with another path") from None

    def _memory(self, why: str) -> None:
        """No file to use: an empty database in memory, so the run goes on (its results are lost at exit)."""
        self.in_memory = True
        self.read_only = None
        self._warn(f"{why}: this run keeps its results in memory only")
        self._conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self._open()

    def _recover(self, e: BaseException) -> None:
        """The file is corrupt: move it aside (unless another process already did), start an empty
        one, and write this process's records again. Called with the connection unusable."""
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            what = f"the kernel database {self.path} is corrupt ({e})"
            current = dbfile.inode(self.path)
            if current is None:
                self._warn(f"{what}; another process has moved it away already: starting an empty one")
            elif self._inode is not None and current != self._inode:
                self._warn(f"{what}; another process has replaced it already: going on with the new file")
            else:
                try:
                    aside = dbfile.move_aside(self.path)
                except OSError as err:
                    self._memory(f"{what} and cannot be moved aside ({err})")
                    self._replay()
                    return
                self._warn(f"{what}: moved it to {aside.name} and started an empty one")
            self._connect()
            self._replay()

    def _replay(self) -> None:
        if self._journal and self.read_only is None:
            with self._write() as c:
                for op in self._journal:
                    op(c)

    def _warn(self, message: str) -> None:
        self.problems.append(message)
        dbfile.warn(message)

    def _open(self) -> None:
        c = self._conn
        c.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        version = c.execute("PRAGMA user_version").fetchone()[0]  # a non-SQLite file fails here
        if version == 0 and self.read_only is not None:
            tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables - _TABLES:
                raise UserError(f"{self.path} is an SQLite file of something else (tables: "
                                f"{', '.join(sorted(tables))}); pass --db with another path")
            # an empty read-only file: nothing to read, nothing to write
            c.close()
            self._conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            read_only, self.read_only = self.read_only, None
            try:
                self._open()
            finally:
                self.read_only = read_only
            return
        if version == 0:
            with self._write():  # every creator serializes here; the first one creates the tables
                tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                version = c.execute("PRAGMA user_version").fetchone()[0]
                if version == 0 and tables - _TABLES:
                    raise UserError(f"{self.path} is an SQLite file of something else (tables: "
                                    f"{', '.join(sorted(tables))}); pass --db with another path")
                if version == 0:
                    for statement in _SCHEMA.split(";"):  # not executescript: it would COMMIT first
                        if statement.strip():
                            c.execute(statement)
                    version = self._migrate(c, 1)
        elif version < SCHEMA_VERSION and version in _MIGRATIONS:
            with self._write():
                # another process may have migrated the file meanwhile: read the version again
                version = self._migrate(c, c.execute("PRAGMA user_version").fetchone()[0])
        if version != SCHEMA_VERSION:
            newer = version > SCHEMA_VERSION
            raise UserError(
                f"the kernel database {self.path} has schema version {version}, this solforge reads "
                f"version {SCHEMA_VERSION}: " + ("upgrade solforge, or" if newer else "export it with the "
                "solforge that wrote it and import it here, or") + " pass --db with another path")
        if self.read_only is not None:
            return  # the journal mode is the writer's business
        if c.execute("PRAGMA journal_mode").fetchone()[0] not in ("wal", "memory"):
            for attempt in range(100):  # switching the journal needs the file to itself for a moment
                try:
                    c.execute("PRAGMA journal_mode = WAL")
                    break
                except sqlite3.OperationalError:
                    if attempt == 99:
                        raise
                    time.sleep(0.05)
        c.execute("PRAGMA synchronous = NORMAL")  # with WAL: a killed process loses no commit

    @staticmethod
    def _migrate(c: sqlite3.Connection, version: int) -> int:
        """Bring a file at `version` to SCHEMA_VERSION inside the caller's transaction."""
        while version < SCHEMA_VERSION and version in _MIGRATIONS:
            for statement in _MIGRATIONS[version]:
                c.execute(statement)
            version += 1
        c.execute(f"PRAGMA user_version = {version}")
        return version

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction, taken at once (BEGIN IMMEDIATE waits on the busy timeout
        instead of failing later on a lock upgrade), committed before returning. An explicit write
        (import, prune) on a file this process cannot write is a UserError."""
        if self.read_only is not None:
            raise UserError(f"the kernel database {self.path} is not writable ({self.read_only})")
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                if dbfile.is_corrupt(e) or dbfile.is_read_only(e):
                    raise
                raise UserError(f"the kernel database {self.path} stayed locked for {BUSY_TIMEOUT_S:.0f} s "
                                f"({e})") from None
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):  # a corrupt file may refuse even this
                    self._conn.execute("ROLLBACK")
                raise

    def _store(self, op: Callable[[sqlite3.Connection], object]) -> None:
        """The tuner's writes: one transaction, kept in the journal; skipped (said once) on a file
        this process cannot write; on a corrupt file, written again into the rebuilt one."""
        for attempt in (0, 1):
            if self.read_only is not None:
                return
            try:
                with self._write() as c:
                    op(c)
                break
            except sqlite3.DatabaseError as e:
                if attempt == 0 and dbfile.is_read_only(e):  # a read-only mount, or root's view of one
                    self.read_only = str(e)
                    self._warn(f"the kernel database {self.path} is not writable ({e}): this run's results "
                               "are not stored")
                    continue
                if attempt or not (self._create and dbfile.is_corrupt(e)):
                    raise
                self._recover(e)
        self._journal.append(op)

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        for attempt in (0, 1):
            try:
                with self._lock:
                    return self._conn.execute(sql, tuple(args)).fetchall()
            except sqlite3.DatabaseError as e:
                if not dbfile.is_corrupt(e) or attempt:
                    raise
                if not self._create:
                    raise UserError(f"the kernel database {self.path} is corrupt ({e}): solforge optimize moves "
                                    "it aside and starts an empty one; or pass --db with another path") from None
                self._recover(e)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> KernelDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the tuner's side ----------------------------------------------------------------------

    @staticmethod
    def _ensure_key(c: sqlite3.Connection, parts: KeyParts, workload: Workload, created: float) -> None:
        c.execute("INSERT OR IGNORE INTO keys VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (parts.text, short_id(parts.text), parts.family, parts.workload_key, workload.label,
                   parts.device_name, parts.capability, parts.torch, parts.triton, parts.template,
                   to_json(workload), created, parts.settings))

    @staticmethod
    def _insert(c: sqlite3.Connection, key: str, record: TuningRecord, run_id: str, created: float) -> bool:
        run = record.run
        cur = c.execute(
            "INSERT OR IGNORE INTO measurements (key, run_id, candidate, config, ok, p20, p50, p80, error, "
            "record, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (key, run_id, record.candidate.label, json.dumps(to_dict(record.candidate.config)), int(record.ok),
             _finite(run.p20_us) if run else None, _finite(run.p50_us) if run else None,
             _finite(run.p80_us) if run else None, record.error, to_json(record), created))
        return cur.rowcount > 0

    def add(self, workload: Workload, record: TuningRecord, *, run_id: str) -> None:
        """Store one measured candidate, committed at once. The same candidate twice in one run
        keeps the first; a later run's re-measure is a new row."""
        _check(workload, record)
        parts = key_parts(workload)
        now = time.time()

        def op(c: sqlite3.Connection) -> None:
            self._ensure_key(c, parts, workload, now)
            self._insert(c, parts.text, record, run_id, now)

        self._store(op)

    def known(self, workload: Workload) -> list[TuningRecord]:
        """Every candidate measured for this exact key: its LATEST measurement only, oldest first.

        Latest, not all: a search observes each candidate once (a second, older time would count
        twice in its cost model), and the newest measurement is the one taken under the conditions
        closest to now (driver, clocks). `history()` has every row."""
        rows = self._query(
            "SELECT record FROM (SELECT record, created, rowid AS r, ROW_NUMBER() OVER (PARTITION BY candidate "
            "ORDER BY created DESC, rowid DESC) AS n FROM measurements WHERE key = ?) WHERE n = 1 "
            "ORDER BY created, r", (db_key(workload),))
        return [_record(r[0]) for r in rows]

    def history(self, key: str) -> list[Measurement]:
        """Every stored measurement of a key (a db_key text), oldest first."""
        rows = self._query("SELECT key, run_id, created, record FROM measurements WHERE key = ? "
                           "ORDER BY created, rowid", (key,))
        return [Measurement(k, run, t, _record(rec)) for k, run, t, rec in rows]

    def set_winner(self, workload: Workload, record: TuningRecord, *, run_id: str) -> None:
        """Make `record` the workload's winner (replacing any earlier one), with its provenance."""
        _check(workload, record)
        parts = key_parts(workload)
        now = time.time()

        def op(c: sqlite3.Connection) -> None:
            self._ensure_key(c, parts, workload, now)
            c.execute("INSERT OR REPLACE INTO winners VALUES (?, ?, ?, ?)", (parts.text, to_json(record), run_id, now))

        self._store(op)

    def winner(self, workload: Workload) -> TuningRecord | None:
        """The stored winner for exactly this key (template, versions, device), else None."""
        rows = self._query("SELECT record FROM winners WHERE key = ?", (db_key(workload),))
        return _record(rows[0][0]) if rows else None

    def baseline(self, workload: Workload, region: str) -> RunResult | None:
        """The stored time of the original computation `region` (see `set_baseline`), else None."""
        rows = self._query("SELECT run FROM baselines WHERE key = ? AND region = ?", (db_key(workload), region))
        return from_dict(RunResult, json.loads(rows[0][0])) if rows else None

    def baselines(self, workload: Workload) -> list[RunResult]:
        """Every stored time of an original computation of this key (one per spelling of it)."""
        rows = self._query("SELECT run FROM baselines WHERE key = ?", (db_key(workload),))
        return [from_dict(RunResult, json.loads(r[0])) for r in rows]

    def set_baseline(self, workload: Workload, region: str, run: RunResult) -> None:
        """Keep the time of a region as the model ran it: `region` names that computation (a hash of
        its ATen ops, solforge.plan.region_signature), since different spellings share one workload."""
        parts = key_parts(workload)
        now = time.time()

        def op(c: sqlite3.Connection) -> None:
            self._ensure_key(c, parts, workload, now)
            c.execute("INSERT OR REPLACE INTO baselines VALUES (?, ?, ?, ?)", (parts.text, region, to_json(run), now))

        self._store(op)

    # -- the CLI's side (solforge/dbcli.py draws these) ----------------------------------------

    def entries(self) -> list[Entry]:
        """One Entry per key, by family then workload then device."""
        rows = self._query(
            "SELECT k.key, k.family, k.workload_key, k.label, k.device_name, k.capability, k.torch, k.triton, "
            "k.template, k.settings, COUNT(m.rowid), COALESCE(SUM(m.ok), 0), MIN(CASE WHEN m.ok THEN m.p50 END), "
            "MAX(m.created), w.record, w.created, w.run_id FROM keys k LEFT JOIN measurements m ON m.key = k.key "
            "LEFT JOIN winners w ON w.key = k.key GROUP BY k.key ORDER BY k.family, k.workload_key, k.key")
        last_run = dict(self._query("SELECT key, run_id FROM (SELECT key, run_id, ROW_NUMBER() OVER (PARTITION BY "
                                    "key ORDER BY created DESC, rowid DESC) AS n FROM measurements) WHERE n = 1"))
        out = []
        for (key, fam, wkey, label, dev, cap, tv, trv, tmpl, sets, n, passed, best, last, wrec, wtime, wrun) in rows:
            parts = KeyParts(wkey, fam, dev, cap, tv, trv, tmpl, sets)
            times = [t for t in (last, wtime) if t is not None]
            out.append(Entry(parts, label, n, passed, best, max(times) if times else None,
                             last_run.get(key, wrun), _record(wrec) if wrec else None, wtime, wrun,
                             staleness(parts)))
        return out

    def find(self, query: str) -> list[Entry]:
        """Entries named by `query`: a full key, an id prefix, a key prefix, or a family name."""
        entries = self.entries()
        for match in (lambda e: e.key == query, lambda e: e.id.startswith(query),
                      lambda e: e.family == query, lambda e: e.key.startswith(query)):
            found = [e for e in entries if match(e)]
            if found:
                return found
        return []

    def export(self, out: Any, *, family: str | None = None) -> tuple[int, int]:
        """Write every measurement and winner (of `family`, or all) as JSON lines to the text stream
        `out`, each with all its key parts so another machine keys it the same. -> (measurements, winners)."""
        where, args = ("WHERE k.family = ?", (family,)) if family else ("", ())
        counts = [0, 0]
        for kind, table in (("measurement", "measurements"), ("winner", "winners")):
            order = "t.created, t.rowid" if kind == "measurement" else "t.created"
            for row in self._query(
                    f"SELECT k.family, k.workload_key, k.device_name, k.capability, k.torch, k.triton, k.template, "
                    f"k.settings, k.workload, t.run_id, t.created, t.record FROM {table} t "
                    f"JOIN keys k ON k.key = t.key {where} ORDER BY k.key, {order}", args):
                parts = KeyParts(row[1], row[0], *row[2:8])
                line = {"format": EXPORT_FORMAT, "kind": kind, "key": parts.text, "parts": asdict(parts),
                        "workload": json.loads(row[8]), "run_id": row[9], "created": row[10],
                        "record": json.loads(row[11])}
                out.write(json.dumps(line, sort_keys=True) + "\n")
                counts[kind == "winner"] += 1
        return counts[0], counts[1]

    def import_lines(self, lines: Iterable[str], *, source: str = "<input>") -> tuple[int, int, int]:
        """Import exported JSON lines. All lines are checked before anything is written (a bad line
        -> UserError naming it, and nothing imported). Idempotent: a measurement already stored
        (same key, run, candidate) is skipped; a winner replaces the stored one only if newer.
        -> (measurements added, winners added or replaced, lines skipped as already known)."""
        items = [_parse_line(text, f"{source}:{n}") for n, text in enumerate(lines, 1) if text.strip()]
        added = winners = skipped = 0
        with self._write() as c:
            for kind, parts, workload, run_id, created, record in items:
                self._ensure_key(c, parts, workload, created)
                if kind == "measurement":
                    if self._insert(c, parts.text, record, run_id, created):
                        added += 1
                    else:
                        skipped += 1
                    continue
                row = c.execute("SELECT created FROM winners WHERE key = ?", (parts.text,)).fetchone()
                if row is not None and row[0] >= created:
                    skipped += 1
                    continue
                c.execute("INSERT OR REPLACE INTO winners VALUES (?, ?, ?, ?)",
                          (parts.text, to_json(record), run_id, created))
                winners += 1
        return added, winners, skipped

    def prune(self, *, stale: bool = False, older_than_days: float | None = None, family: str | None = None,
              dry_run: bool = False, now: float | None = None) -> list[Entry]:
        """Remove whole entries (their measurements, winner and key) matching ALL the given criteria:
        stale on this machine (template or torch/triton changed), last touched more than
        `older_than_days` ago, of `family`. At least one criterion is required. -> the entries removed
        (or that would be, with dry_run)."""
        if not stale and older_than_days is None and family is None:
            raise UserError("prune needs at least one of --stale, --older-than DAYS, --family F")
        if older_than_days is not None and older_than_days < 0:
            raise UserError("--older-than must be at least 0 days")
        now = time.time() if now is None else now
        doomed = [e for e in self.entries()
                  if (not stale or e.stale is not None) and (family is None or e.family == family)
                  and (older_than_days is None or (e.last_time or 0.0) < now - older_than_days * 86400)]
        if doomed and not dry_run:
            with self._write() as c:
                for e in doomed:
                    for table in ("measurements", "winners", "baselines", "keys"):
                        c.execute(f"DELETE FROM {table} WHERE key = ?", (e.key,))
        return doomed


def _check(workload: Workload, record: TuningRecord) -> None:
    if record.candidate.workload != workload:
        raise ValueError(f"record of {record.candidate.workload.key} stored under {workload.key}")


def _record(text: str) -> TuningRecord:
    return from_dict(TuningRecord, json.loads(text))


_LINE_FIELDS = ("format", "kind", "key", "parts", "workload", "run_id", "created", "record")


def _parse_line(text: str, where: str) -> tuple[str, KeyParts, Workload, str, float, TuningRecord]:
    """One exported JSON line, checked: every field there, the key consistent with its parts."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e})") from None
    if not isinstance(d, dict) or (missing := [f for f in _LINE_FIELDS if f not in d]):
        raise UserError(f"{where}: not a solforge kernel line (missing {', '.join(missing) if d else 'fields'})")
    if d["format"] not in (1, EXPORT_FORMAT):
        raise UserError(f"{where}: export format {d['format']!r}, this solforge reads 1 and {EXPORT_FORMAT}")
    if d["kind"] not in ("measurement", "winner"):
        raise UserError(f"{where}: kind {d['kind']!r} is neither measurement nor winner")
    try:
        # format 1 had no settings: its entries come in as measured under unknown ones (stale)
        parts = KeyParts(**({"settings": ""} if d["format"] == 1 else {}) | {k: str(v) for k, v in d["parts"].items()})
        workload = from_dict(Workload, d["workload"])
        record = from_dict(TuningRecord, d["record"])
        created, run_id = float(d["created"]), str(d["run_id"])
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise UserError(f"{where}: malformed {d['kind']} ({type(e).__name__}: {e})") from None
    if parts.text != d["key"] or workload.key != parts.workload_key or workload.family != parts.family:
        raise UserError(f"{where}: its key does not match its parts and workload")
    if record.candidate.workload != workload:
        raise UserError(f"{where}: its record is of another workload ({record.candidate.workload.key})")
    if not math.isfinite(created):
        raise UserError(f"{where}: created is not a time")
    return d["kind"], parts, workload, run_id, created, record
