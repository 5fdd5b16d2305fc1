"""Report: report.json (and, in a later issue, report.html and traces)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from solforge.errors import UserError
from solforge.records import Report, to_dict


def ensure_writable(out_dir: Path) -> None:
    """Fail before any work is done, not after it, when the report cannot be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise UserError(f"cannot write the report to {out_dir}: {e.strerror or e}") from e


def write_report(report: Report, out_dir: Path) -> Path:
    """Write OUT/report.json atomically (a crash never leaves half a file)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".report.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(to_dict(report), f, indent=2)
            f.write("\n")
        path = out_dir / "report.json"
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write the report to {out_dir}: {e.strerror or e}") from e
    return path
