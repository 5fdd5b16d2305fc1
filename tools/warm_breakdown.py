"""probe: where one `solforge optimize` command's wall time goes (imports, model, each stage, exit).

Where the wall time of one `solforge optimize` command goes, end to end.

Runs the CLI in this process (the same code path as the `solforge` console script) and prints one
JSON line: seconds from process start to the end of the imports, loading the model, inside
`optimize` (with its own per-stage seconds), and printing/writing the report. It leaves the way
the console script does (`solforge.cli.entry`: flush, then os._exit), so the caller's wall time
of this script (e.g. /usr/bin/time) is the command's.

    python tools/warm_breakdown.py optimize qwen3-4b --batch 2 --seq 8192 --db k.db --quiet
"""

from __future__ import annotations

import json
import os
import sys
import time


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), so interpreter start-up counts too."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def main() -> int:
    t0 = time.perf_counter()
    age0 = process_age()
    import torch  # noqa: F401  (timed: the CLI imports it before loading a model)

    import solforge.api as api
    import solforge.cli as cli

    marks: dict[str, float] = {"imports": time.perf_counter() - t0}
    load, opt = cli._load, api.optimize
    spans: dict[str, float] = {}
    reports: list = []

    def timed_load(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return load(*a, **k)
        finally:
            spans["load"] = time.perf_counter() - t

    def timed_optimize(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            out = opt(*a, **k)
            reports.append(out[1])
            return out
        finally:
            spans["optimize"] = time.perf_counter() - t

    cli._load = timed_load
    api.optimize = timed_optimize
    t = time.perf_counter()
    rc = cli.main(sys.argv[1:])
    main_s = time.perf_counter() - t
    result = {
        "process_start_to_script_s": round(age0, 3) if age0 is not None else None,
        "imports_s": round(marks["imports"], 3),
        "load_s": round(spans.get("load", 0.0), 3),
        "optimize_s": round(spans.get("optimize", 0.0), 3),
        "print_and_rest_s": round(main_s - spans.get("load", 0.0) - spans.get("optimize", 0.0), 3),
        "script_total_s": round(time.perf_counter() - t0 + (age0 or 0.0), 3),
        "stage_seconds": reports[0].extra.get("stage_seconds") if reports else None,
        "sources": sorted({r.source for r in reports[0].regions}) if reports else None,
        "e2e": {"baseline_ms": reports[0].e2e.baseline_ms, "optimized_ms": reports[0].e2e.optimized_ms,
                "passed": reports[0].e2e.passed} if reports and reports[0].e2e else None,
        "rc": rc,
    }
    print("BREAKDOWN " + json.dumps(result), flush=True)
    return rc


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
