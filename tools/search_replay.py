"""Showed that the evolutionary search (tune/search.py) finds swiglu's best config within a few tenths of a percent
while measuring a fraction of the space.

Replay the evolutionary search against a table of exhaustive measurements of swiglu's space.

    # on the H100: measure every config of the space (resumes where a previous run stopped)
    python tools/search_replay.py --measure --out bench/results/NAME-swiglu-exhaustive.json
    # anywhere: replay the search on that table for many seeds
    python tools/search_replay.py bench/results/NAME-swiglu-exhaustive.json --seeds 32 \\
        --out bench/results/NAME-search-replay.json
    # CPU smoke run on a synthetic landscape of the same space
    python tools/search_replay.py --synthetic --seeds 32

The replay's runner looks the time of a config up in the table (a config the table lacks counts
as a failure), so a seed's search measures exactly what it would have on the GPU, in
milliseconds. Per seed: the fraction of the space measured, the best found against the
exhaustive best (%), and how many measurements it took to get within 3%; then median and worst
over the seeds, and the same for random search with the same number of measurements.

Table formats read: {"records": [...]} as --measure writes, or a bare list; each entry either
{"config": {...}, "p50_us": float|null, "ok": bool} or a TuningRecord as records.to_dict writes
it (a database export of records).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import random
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import provenance, write_json  # noqa: E402  (bench/ is a folder of scripts, not a package)

from solforge.kernels import swiglu as S  # noqa: E402
from solforge.records import (  # noqa: E402
    BuildResult,
    Candidate,
    RunResult,
    TuningRecord,
    Verdict,
    Workload,
    from_dict,
    to_dict,
)
from solforge.tune import candidates  # noqa: E402
from solforge.tune.search import make_strategy, search  # noqa: E402

Key = tuple[tuple[str, Any], ...]
WITHIN = 0.03  # the target: within 3% of the exhaustive best


def workload(rows: int, N: int, act: str, device: str = "cuda") -> Workload:
    return Workload(S.FAMILY, ((rows, N), (rows, N)), ("bf16", "bf16"), (("act", act),), device)


def _provenance() -> dict[str, Any]:
    if torch.cuda.is_available():
        return provenance()
    import triton

    return {"device": "cpu (replay only: no kernel ran here)",
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]},
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": "python " + " ".join(sys.argv)}


# ---------------------------------------------------------------------------------------------
# tables


def _key(config: dict[str, Any]) -> Key:
    return S.Config(**config).items()


def load_table(path: str) -> dict[Key, float]:
    """config -> p50 µs (inf for a failure)."""
    import json

    data = json.loads(Path(path).read_text())
    rows = data["records"] if isinstance(data, dict) else data
    table: dict[Key, float] = {}
    for row in rows:
        if "candidate" in row:  # a TuningRecord
            rec = from_dict(TuningRecord, row)
            table[rec.candidate.config] = rec.time_us
        else:
            us = row.get("p50_us")
            table[_key(row["config"])] = float(us) if row.get("ok", us is not None) and us is not None else math.inf
    return table


def synthetic_us(config: dict[str, Any], rows: int, N: int) -> float:
    """A made-up but plausible memory-bound landscape for CPU runs: bytes at 3 TB/s, slower with
    masked lanes, with elements a thread away from 8..16, with small tiles, with persistent grids
    that keep too few bytes in flight; evict_first 1% faster; ±1% deterministic noise; 3% fail."""
    h = zlib.crc32(repr(sorted(config.items())).encode()) / 2**32
    if h < 0.03:
        return math.inf
    bn, r, w = config["block_n"], config["rows"], config["num_warps"]
    ept = r * bn / (32 * w)
    t = 3 * rows * N * 2 / 3.0e12 * 1e6
    t *= 1 + 0.25 * (math.ceil(N / bn) * bn / N - 1)
    t *= (1 + 0.03 * (math.log2(ept) - 3.5) ** 2) * (1 + 0.04 * 2048 / (r * bn))
    if config["variant"] == "persist":
        t *= (1 + 0.3 * max(0.0, 1 - config["progs"] * w * 32 * ept * 4 / 65536)) * 0.98
    return t * (0.99 if config["evict"] else 1.0) * (1 + 0.01 * (2 * h - 1))


# ---------------------------------------------------------------------------------------------
# replay


def _record(cand: Candidate, us: float) -> TuningRecord:
    if not math.isfinite(us):
        return TuningRecord(cand, BuildResult(False, 0.0, "failed in the table"))
    return TuningRecord(cand, BuildResult(True), Verdict(True, 4, 0.0, 0.0), RunResult(us, us, us))


def _summary(times: list[float], best: float, n_space: int) -> dict[str, Any]:
    found = min(times)
    hit = next((i + 1 for i, t in enumerate(times) if t <= best * (1 + WITHIN)), None)
    return {"measured": len(times), "fraction": round(len(times) / n_space, 4), "best_us": found,
            "gap_pct": round(100 * (found / best - 1), 3), "evals_to_within_3pct": hit}


def replay(table: dict[Key, float], wl: Workload, *, seeds: int, frac: float, patience: int | None,
           strategy: str = "evolutionary") -> dict[str, Any]:
    cands = candidates(S, wl)
    space_t = [table.get(c.config, math.inf) for c in cands]
    ok = [t for t in space_t if math.isfinite(t)]
    if not ok:
        raise SystemExit("no config of the space has a time in the table")
    best = min(ok)
    cap = max(1, int(frac * len(cands)))

    def lookup(cs: Any) -> list[TuningRecord]:
        return [_record(c, table.get(c.config, math.inf)) for c in cs]

    runs, rand = [], []
    for seed in range(seeds):
        t0 = time.perf_counter()
        strat = make_strategy(strategy, S, wl, seed=seed)
        recs = search(strat, lookup, budget_s=math.inf, max_candidates=cap, patience=patience)
        row = {"seed": seed, "strategy": strat.name, **_summary([r.time_us for r in recs], best, len(cands)),
               "best_config": min(recs, key=lambda r: r.time_us).candidate.label,
               "cpu_s": round(time.perf_counter() - t0, 3)}
        runs.append(row)
        # random search, same number of measurements, heuristic first as every strategy does
        order = [0, *random.Random(seed).sample(range(1, len(cands)), min(len(recs), len(cands)) - 1)]
        rand.append(_summary([space_t[i] for i in order], best, len(cands)))
        print(f"seed {seed:3d} {row['strategy']}: measured {row['measured']} ({100 * row['fraction']:.0f}%), "
              f"best {row['best_us']:.2f} us, gap {row['gap_pct']:.2f}% (random: {rand[-1]['gap_pct']:.2f}%), "
              f"within 3% after {row['evals_to_within_3pct']}")

    def agg(rows: list[dict[str, Any]]) -> dict[str, Any]:
        gaps = [r["gap_pct"] for r in rows]
        return {"gap_pct_median": statistics.median(gaps), "gap_pct_worst": max(gaps),
                "fraction_median": statistics.median(r["fraction"] for r in rows),
                "fraction_worst": max(r["fraction"] for r in rows),
                "seeds_within_3pct": sum(g <= 100 * WITHIN for g in gaps),
                "seeds_within_1pct": sum(g <= 1.0 for g in gaps)}

    ranked = sorted((t, c.label) for t, c in zip(space_t, cands, strict=True) if math.isfinite(t))
    out = {"workload": to_dict(wl), "space": len(cands), "table_rows": len(table),
           "missing_from_table": sum(c.config not in table for c in cands),
           "failed": sum(not math.isfinite(t) for t in space_t), "exhaustive_best_us": best,
           "exhaustive_best": ranked[0][1], "within_3pct_of_best": sum(t <= best * (1 + WITHIN) for t, _ in ranked),
           "within_1pct_of_best": sum(t <= best * 1.01 for t, _ in ranked),
           "heuristic_us": space_t[0], "cap": cap, "frac": frac, "patience": patience, "seeds": seeds,
           "strategy": strategy, "search": agg(runs), "random": agg(rand), "runs": runs}
    e, r = out["search"], out["random"]
    print(f"space {len(cands)}, exhaustive best {best:.2f} us ({ranked[0][1]}), {out['within_3pct_of_best']} configs "
          f"within 3%; heuristic {space_t[0]:.2f} us")
    print(f"{strategy}: gap median {e['gap_pct_median']:.2f}% worst {e['gap_pct_worst']:.2f}%, measured median "
          f"{100 * e['fraction_median']:.0f}% worst {100 * e['fraction_worst']:.0f}%, "
          f"{e['seeds_within_3pct']}/{seeds} seeds within 3%")
    print(f"random search: gap median {r['gap_pct_median']:.2f}% worst {r['gap_pct_worst']:.2f}%, "
          f"{r['seeds_within_3pct']}/{seeds} seeds within 3%")
    return out


# ---------------------------------------------------------------------------------------------
# exhaustive measurement (GPU)


def measure_all(wl: Workload, out: str, time_limit_s: float) -> None:
    """Measure every config of the space with solforge.tune.measure (build, verify, time), writing
    `out` after each one; configs already in `out` are skipped, so a second run finishes the job."""
    import json

    from solforge.tune import measure

    if not torch.cuda.is_available():
        raise SystemExit("--measure needs a CUDA GPU")
    path = Path(out)
    data = json.loads(path.read_text()) if path.exists() else {**_provenance(), "workload": to_dict(wl), "records": []}
    done = {_key(r["config"]) for r in data["records"]}
    cands = [c for c in candidates(S, wl) if c.config not in done]
    print(f"{len(done)} configs already measured, {len(cands)} to go")
    start = time.perf_counter()
    for i, cand in enumerate(cands):
        if time.perf_counter() - start > time_limit_s:
            print(f"time limit: stopped with {len(cands) - i} configs left; run the same command again")
            break
        rec = measure(S, cand, device="cuda")
        run = rec.run
        data["records"].append({"config": cand.config_dict, "ok": rec.ok, "p50_us": rec.time_us if rec.ok else None,
                                "p20_us": run.p20_us if rec.ok and run else None,
                                "p80_us": run.p80_us if rec.ok and run else None, "error": rec.error,
                                "build_s": round(rec.build.seconds, 3)})
        write_json(data, out)
        print(f"{len(done) + i + 1:4d} {cand.label}: {rec.time_us:.2f} us" + (f" ({rec.error})" if rec.error else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", nargs="?", help="exhaustive measurements (JSON) to replay")
    ap.add_argument("--synthetic", action="store_true", help="replay a synthetic landscape (CPU)")
    ap.add_argument("--measure", action="store_true", help="measure every config on the GPU into --out")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--N", type=int, default=9728)
    ap.add_argument("--act", default="silu")
    ap.add_argument("--seeds", type=int, default=24)
    ap.add_argument("--frac", type=float, default=0.3, help="measurement cap, fraction of the space")
    ap.add_argument("--patience", type=int, default=None, help="early stop (search's patience)")
    ap.add_argument("--strategy", default="evolutionary", help="auto | exhaustive | evolutionary")
    ap.add_argument("--time-limit", type=float, default=540.0, help="--measure: seconds before stopping")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    wl = workload(a.rows, a.N, a.act)
    if a.measure:
        if not a.out:
            raise SystemExit("--measure needs --out")
        measure_all(wl, a.out, a.time_limit)
        return
    if a.synthetic:
        table = {c.config: synthetic_us(c.config_dict, a.rows, a.N) for c in candidates(S, wl)}
    elif a.table:
        table = load_table(a.table)
    else:
        raise SystemExit("give a table to replay, or --synthetic, or --measure")
    result = {**_provenance(), "source": "synthetic" if a.synthetic else a.table,
              **replay(table, wl, seeds=a.seeds, frac=a.frac, patience=a.patience, strategy=a.strategy)}
    write_json(result, a.out)


if __name__ == "__main__":
    main()
