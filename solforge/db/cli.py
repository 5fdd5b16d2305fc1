"""`solforge db list|show|export|import|prune`: look into, share and clean the kernel database.

Flags -> solforge.db calls -> rich tables; nothing else (cli.py adds the parser and dispatches here).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from solforge.db import Entry, KernelDB, default_path
from solforge.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console

DB_DESCRIPTION = """\
The kernel database keeps every candidate solforge measured (config, p20/p50/p80 times, verdict,
error) and each workload's winner, keyed by workload (family, shapes, dtypes) + GPU name and
compute capability + torch and triton versions + a hash of the kernel template's source. A warm
`solforge optimize` re-tunes nothing it already knows; a template change re-tunes what it touched.
"""

DB_EPILOG = """\
examples:
  solforge db list                                  # one row per key; ID names it for show
  solforge db show rmsnorm                          # every candidate of every rmsnorm key
  solforge db show 3fa2c1                           # one key, by its ID (a prefix is enough)
  solforge db export team.jsonl --family rmsnorm    # JSON lines, to share tuned kernels
  solforge db import team.jsonl                     # importing the same file twice adds nothing
  solforge db prune --stale --dry-run               # what a template or torch/triton change made stale
  solforge db prune --older-than 30
  solforge db prune --lowered --older-than 30       # the ATen lowering cache beside the database
"""


def add_db_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the `db` command to cli.py's subparsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("db", help="list, show, export, import or prune tuned kernels in the kernel database",
                       description=DB_DESCRIPTION, epilog=DB_EPILOG, formatter_class=fmt)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=None, metavar="PATH",
                        help=f"the database file (default: $SOLFORGE_DB, else {_home(default_path())})")
    dsub = p.add_subparsers(dest="db_command", metavar="ACTION")
    dsub.add_parser("list", parents=[common], help="one row per key: family, workload, device, candidates, "
                    "winner, whether the template is still current", description="One row per key.")
    s = dsub.add_parser("show", parents=[common], help="every candidate of the keys matching KEY",
                        description="Every measured candidate of the matching keys, oldest first, failures "
                        "with their reasons.")
    s.add_argument("query", metavar="KEY", help="an ID (or its prefix) from `solforge db list`, a full key, "
                   "a key prefix, or a family name")
    e = dsub.add_parser("export", parents=[common], help="write measurements and winners as JSON lines",
                        description="Write every measurement and winner as one JSON object a line, with all "
                        "its key parts, so that an import on another machine keys them the same.")
    e.add_argument("file", nargs="?", default="-", metavar="FILE", help="where to write (default: stdout)")
    e.add_argument("--family", default=None, metavar="F", help="only this kernel family")
    i = dsub.add_parser("import", parents=[common], help="add measurements and winners from exported JSON lines",
                        description="Add exported JSON lines. Every line is checked first: a bad line stops "
                        "the import, naming its line number, with nothing written. Measurements already "
                        "stored are skipped; a winner replaces the stored one only if it is newer.")
    i.add_argument("file", metavar="FILE", help="a file written by `solforge db export` ('-': stdin)")
    pr = dsub.add_parser("prune", parents=[common], help="remove stale or old entries",
                         description="Remove whole entries (measurements, winner) matching all the given "
                         "criteria, and print them.")
    pr.add_argument("--stale", action="store_true", help="entries whose template source or torch/triton "
                    "version differs from what is installed here")
    pr.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                    help="entries last measured more than DAYS days ago")
    pr.add_argument("--family", default=None, metavar="F", help="entries of this kernel family")
    pr.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    pr.add_argument("--lowered", action="store_true",
                    help="prune the ATen lowering cache (lowered/ beside the database) instead: every "
                    "entry, or with --older-than those not used for DAYS days (a removed one is traced again)")
    p.set_defaults(db_parser=p)
    return p


def run_db(args: argparse.Namespace) -> int:
    """Dispatch `solforge db ACTION`; UserErrors go up to cli.main (one line, exit 2)."""
    if args.db_command is None:
        args.db_parser.print_help()
        return 2
    action = args.db_command
    path = Path(args.db).expanduser() if args.db else default_path()
    if action == "prune" and args.lowered:
        _prune_lowered(path, args)
        return 0
    if action == "list" and not path.exists():  # nothing tuned yet is no error
        print(f"no kernel database at {path} yet (solforge optimize creates it)")
        return 0
    with KernelDB(args.db, create=action == "import") as db:
        if action == "list":
            _list(db)
        elif action == "show":
            _show(db, args.query)
        elif action == "export":
            _export(db, args.file, args.family)
        elif action == "import":
            _import(db, args.file)
        elif action == "prune":
            _prune(db, args)
    return 0


def _home(path: Path) -> str:
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def _console() -> Console:
    from rich.console import Console

    # piped into a log or a file, rich would fold the wide tables into 80 columns
    return Console() if sys.stdout.isatty() else Console(width=170)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _us(x: float | None) -> str:
    return "-" if x is None or x != x or x == float("inf") else f"{x:,.1f}"


def _entries_table(entries: list[Entry], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in ("id", "family", "workload", "device", "measured", "best µs", "winner", "template", "last run"):
        t.add_column(col, justify="right" if col in ("measured", "best µs") else "left")
    for e in entries:
        winner = "-" if e.winner is None else f"{_us(e.winner.time_us)} µs, {_when(e.winner_time)}"
        t.add_row(e.id, e.family, e.label, f"{e.parts.device_name} ({e.parts.capability})",
                  f"{e.passed}/{e.measured}", _us(e.best_us), winner,
                  "current" if e.stale is None else f"[yellow]stale[/] ({e.stale})", e.last_run or "-")
    return t


def _list(db: KernelDB) -> None:
    entries = db.entries()
    console = _console()
    if not entries:
        console.print(f"the kernel database {db.path} is empty")
        return
    console.print(_entries_table(entries, f"kernel database {db.path}: {len(entries)} keys"))


def _show(db: KernelDB, query: str) -> None:
    from rich.table import Table

    entries = db.find(query)
    if not entries:
        raise UserError(f"no key in {db.path} matches {query!r} (`solforge db list` shows the IDs)")
    console = _console()
    for e in entries:
        p = e.parts
        console.print(f"[bold]{e.id}[/] {p.workload_key}\n  device {p.device_name} (cc {p.capability}), "
                      f"torch {p.torch}, triton {p.triton}, template {p.template}, settings {p.settings or 'unknown'} "
                      f"({'current' if e.stale is None else 'stale: ' + e.stale})")
        w = e.winner
        console.print("  winner: " + ("none" if w is None else
                      f"{w.candidate.label} {_us(w.time_us)} µs (run {e.winner_run}, {_when(e.winner_time)})"))
        t = Table()
        for col in ("when", "run", "candidate", "p20 µs", "p50 µs", "p80 µs", "verdict", "error"):
            t.add_column(col, justify="right" if col.endswith("µs") else "left")
        interpreted = False
        for m in db.history(e.key):
            r, run = m.record, m.record.run
            interpreted |= run is not None and not run.meaningful
            verdict = ("-" if r.verdict is None else
                       f"pass (rel {r.verdict.max_rel_err:.1e})" if r.verdict.passed else "[red]fail[/]")
            t.add_row(_when(m.created), m.run_id, r.candidate.label, _us(run.p20_us if run else None),
                      _us(run.p50_us if run else None), _us(run.p80_us if run else None), verdict,
                      "" if r.error is None else f"[red]{r.error}[/]")
        console.print(t)
        if interpreted:
            console.print("  (times through Triton's interpreter mean nothing)")


def _export(db: KernelDB, file: str, family: str | None) -> None:
    if file == "-":
        n, w = db.export(sys.stdout, family=family)
    else:
        try:
            with open(file, "w") as f:
                n, w = db.export(f, family=family)
        except OSError as e:
            raise UserError(f"cannot write {file}: {e.strerror}") from None
    print(f"exported {n} measurements and {w} winners to {'stdout' if file == '-' else file}", file=sys.stderr)


def _import(db: KernelDB, file: str) -> None:
    if file == "-":
        added, winners, skipped = db.import_lines(sys.stdin, source="<stdin>")
    else:
        try:
            with open(file) as f:
                lines = f.readlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {file}: {getattr(e, 'strerror', None) or e}") from None
        added, winners, skipped = db.import_lines(lines, source=file)
    print(f"imported {added} measurements and {winners} winners into {db.path} "
          f"({skipped} lines already known)")


def _prune_lowered(db_path: Path, args: argparse.Namespace) -> None:
    from solforge.capture import LoweringCache

    if args.stale or args.family:
        raise UserError("--lowered prunes by age only (--older-than DAYS) or everything; "
                        "--stale and --family apply to kernel entries")
    if args.older_than is not None and args.older_than < 0:
        raise UserError("--older-than must be at least 0 days")
    cache = LoweringCache(db_path.parent / "lowered")
    removed = cache.prune(older_than_days=args.older_than, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    if not removed:
        print(f"nothing to prune in {cache.directory}")
        return
    print(f"{verb} {len(removed)} lowered graphs ({sum(n for _, n in removed) / 1e6:.1f} MB) from {cache.directory}")


def _prune(db: KernelDB, args: argparse.Namespace) -> None:
    removed = db.prune(stale=args.stale, older_than_days=args.older_than, family=args.family,
                       dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    if not removed:
        print(f"nothing to prune in {db.path}")
        return
    _console().print(_entries_table(removed, f"{verb} {len(removed)} keys from {db.path}"))
    print(f"{verb} {len(removed)} keys, {sum(e.measured for e in removed)} measurements, "
          f"{sum(e.winner is not None for e in removed)} winners")
