"""Report: report.json, report.html (one offline page), and the names of the Chrome traces."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from solforge.errors import UserError
from solforge.records import Report, to_dict

TRACE_BASELINE = "trace_baseline.json"  # Chrome trace JSON: ui.perfetto.dev or chrome://tracing opens it
TRACE_OPTIMIZED = "trace_optimized.json"


def ensure_writable(out_dir: Path) -> None:
    """Fail before any work is done, not after it, when the report cannot be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise UserError(f"cannot write the report to {out_dir}: {e.strerror or e}") from e


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_report(report: Report, out_dir: Path) -> Path:
    """Write OUT/report.json and OUT/report.html atomically (a crash never leaves half a file)."""
    from solforge.report.html import render

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "report.json"
        _write_atomic(path, json.dumps(to_dict(report), indent=2) + "\n")
        _write_atomic(out_dir / "report.html", render(report))
    except OSError as e:
        raise UserError(f"cannot write the report to {out_dir}: {e.strerror or e}") from e
    return path
