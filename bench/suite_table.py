"""bench/suite.py's results (JSON lines) as markdown: every row, geomeans, wins, losses, errors.

Nothing is filtered out: a problem whose variant errored, timed out or lost is a row like the others.
Ratios are times (lower is faster for the first named): solforge/eager < 1 means solforge was
faster than eager. A geomean covers the problems where both variants have a time and no error;
wins and losses of solforge count only differences beyond +-2% (TIE), the rest are ties. Where a
results file holds a row more than once (--retry-errors), the last one counts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

TIE = 0.02
COLS = ("eager", "compile", "compile-max-autotune", "solforge")


def latest(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("suite") in ("kernelbench", "arch") and "key" in r:
            out[r["key"]] = r
    return out


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and not r.get("error") and isinstance(r.get("us"), int | float) and r["us"] > 0


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    return a["us"] / b["us"] if _ok(a) and _ok(b) else None  # type: ignore[index]


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _f(x: float | None, nd: int = 2) -> str:
    return "" if x is None else f"{x:.{nd}f}"


def _us(r: dict[str, Any] | None) -> str:
    if r is None:
        return ""
    if r.get("error"):
        return "timeout" if r.get("timed_out") else "error"
    us = r.get("us")
    return f"{us:,.1f}" if isinstance(us, int | float) else ""


def _err(r: dict[str, Any] | None) -> str:
    if r is None or r.get("error") or r.get("err") is None:
        return ""
    return f"{r['err']:.1e}" + ("" if r.get("allclose", True) else " ✗")


def _regions(r: dict[str, Any] | None) -> str:
    if r is None or r.get("error"):
        return ""
    regions = r.get("regions") or []
    if not regions:
        return "none"
    fams: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for g in regions:
        f = fams[g.get("family") or "?"]
        f[0] += 1
        f[1] += bool(g.get("integrated", g.get("verified")))
    text = ", ".join(f"{k} {n}/{m}" if n != m else f"{k} {m}" for k, (n, m) in sorted(fams.items()))
    if r.get("returned") is not None:
        text += f"; returned: {r['returned']}"
    return text


def _short_error(r: dict[str, Any] | None) -> str:
    if r is None or not r.get("error"):
        return ""
    lines = [ln.strip() for ln in str(r["error"]).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else "error"
    if r.get("timed_out"):
        text = lines[0] if lines else "timed out"
    return text.replace("|", "\\|")[:140]


def _groups(rows: dict[str, dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, dict[str, Any]]]:
    """(suite, level or kind, problem, mode) -> variant -> row, in the order rows were written."""
    out: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows.values():
        group = r.get("level") if r["suite"] == "kernelbench" else r.get("kind", "")
        out.setdefault((r["suite"], group, r["problem"], r.get("mode", "fwd")), {})[r["variant"]] = r
    return out


def _summary(groups: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    ratios: dict[str, list[float]] = {"solforge/eager": [], "compile/eager": [], "solforge/compile": [],
                                      "solforge/compile where compile is allclose": []}
    wins = {"vs eager": [0, 0, 0], "vs compile": [0, 0, 0]}  # wins, losses, ties
    errors: dict[str, int] = defaultdict(int)
    not_close: dict[str, int] = defaultdict(int)
    nothing = 0
    for g in groups:
        for name, (a, b) in {"solforge/eager": ("solforge", "eager"), "compile/eager": ("compile", "eager"),
                             "solforge/compile": ("solforge", "compile")}.items():
            x = _ratio(g.get(a), g.get(b))
            if x is not None:
                ratios[name].append(x)
        # compile's speed outside the tolerance (fp32 convolutions in TF32) is no speed to match
        x = _ratio(g.get("solforge"), g.get("compile"))
        if x is not None and g["compile"].get("allclose") is not False:
            ratios["solforge/compile where compile is allclose"].append(x)
        for name, b in (("vs eager", "eager"), ("vs compile", "compile")):
            x = _ratio(g.get("solforge"), g.get(b))
            if x is not None:
                wins[name][0 if x < 1 - TIE else 1 if x > 1 + TIE else 2] += 1
        for v, r in g.items():
            errors[v] += bool(r.get("error"))
            not_close[v] += r.get("allclose") is False and not r.get("error")
        s = g.get("solforge")
        nothing += s is not None and not s.get("error") and not s.get("regions")
    return {"geo": {k: (geomean(v), len(v)) for k, v in ratios.items()}, "wins": wins, "errors": dict(errors),
            "not_close": dict(not_close), "nothing": nothing, "n": len(groups)}


def _summary_lines(title: str, s: dict[str, Any]) -> list[str]:
    geo = "; ".join(f"{k} {_f(g, 3) or '-'} (n={n})" for k, (g, n) in s["geo"].items())
    wl = "; ".join(f"solforge {k}: {w} faster, {lo} slower, {t} within {TIE:.0%}"
                   for k, (w, lo, t) in s["wins"].items())
    errs = ", ".join(f"{v} {n}" for v, n in sorted(s["errors"].items()) if n) or "none"
    nc = ", ".join(f"{v} {n}" for v, n in sorted(s["not_close"].items()) if n) or "none"
    return [f"- **{title}** ({s['n']} problems): geomean {geo}.", f"  {wl}.",
            f"  Errors (incl. timeouts): {errs}. Outside the tolerance vs eager: {nc}. "
            f"solforge matched nothing: {s['nothing']}."]


def render(all_rows: list[dict[str, Any]], source: str = "") -> str:
    metas = [r for r in all_rows if r.get("suite") == "meta"]
    rows = latest(all_rows)
    skipped = [r for r in rows.values() if r.get("skipped")]
    groups = _groups({k: r for k, r in rows.items() if not r.get("skipped")})
    present = [c for c in COLS if any(c in g for g in groups.values())]
    lines = ["# solforge benchmark suite", ""]
    if source:
        lines.append(f"From `{source}` (bench/suite.py; rendered by bench/suite_table.py).")
    devices = sorted({str(m.get("device")) for m in metas})
    versions = metas[-1].get("versions", {}) if metas else {}
    lines += [f"Device(s): {', '.join(devices) or 'unknown'}"
              + (" — rows measured on different devices are not comparable" if len(devices) > 1 else "") + ".",
              "Versions (last run): " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
              f"Runs (pieces): {len(metas)}; first {metas[0].get('date') if metas else '?'}, "
              f"last {metas[-1].get('date') if metas else '?'}." + (" Smoke run (--tiny): times mean nothing."
                                                                   if any(m.get("tiny") for m in metas) else ""),
              "", "Times in µs (median of do_bench, L2 flushed; training rows: one step). Ratios: lower is faster "
              "for the first named. err: max |out - eager| / max |eager| (✗: not allclose at the dtype's "
              "tolerance). Regions: solforge's regions by family (integrated/found).", ""]
    by_section: dict[tuple[str, Any], list[tuple[tuple[Any, ...], dict[str, dict[str, Any]]]]] = defaultdict(list)
    for key, g in groups.items():
        by_section[(key[0], key[1] if key[0] == "kernelbench" else key[3])].append((key, g))
    lines += ["## Summary", ""]
    for (suite, sec), items in sorted(by_section.items(), key=lambda kv: (kv[0][0] != "kernelbench", str(kv[0][1]))):
        title = f"KernelBench level {sec}" if suite == "kernelbench" else f"architectures, {sec}"
        lines += _summary_lines(title, _summary([g for _, g in items]))
    lines.append("")
    for (suite, sec), items in sorted(by_section.items(), key=lambda kv: (kv[0][0] != "kernelbench", str(kv[0][1]))):
        title = f"KernelBench level {sec}" if suite == "kernelbench" else f"Architectures, {sec}"
        lines += [f"## {title}", ""]
        head = ["problem" if suite == "kernelbench" else "architecture"] + [f"{c} µs" for c in present]
        head += ["solforge/eager", "compile/eager", "solforge/compile", "err compile", "err solforge",
                 "peak MiB e/c/s", "regions", "errors"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key, g in items:
            name = key[2] if suite == "kernelbench" else f"{key[2]} ({key[1]})"
            peaks = "/".join(_f(g[v].get("peak_MiB"), 0) or "-" if v in g and not g[v].get("error") else "-"
                             for v in ("eager", "compile", "solforge"))
            by_msg: dict[str, list[str]] = defaultdict(list)  # one message, the variants that had it
            for v, r in g.items():
                if r.get("error"):
                    by_msg[_short_error(r)].append(v)
            errs = "; ".join(f"{', '.join(vs)}: {msg}" for msg, vs in by_msg.items())
            cells = [name] + [_us(g.get(c)) for c in present]
            cells += [_f(_ratio(g.get("solforge"), g.get("eager"))), _f(_ratio(g.get("compile"), g.get("eager"))),
                      _f(_ratio(g.get("solforge"), g.get("compile"))), _err(g.get("compile")),
                      _err(g.get("solforge")), peaks, _regions(g.get("solforge")), errs]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    nothing = [f"{k[0]} {k[1]} {k[2]}" if k[0] == "kernelbench" else f"{k[2]} ({k[3]})"
               for k, g in groups.items()
               if g.get("solforge") is not None and not g["solforge"].get("error") and not g["solforge"].get("regions")]
    lines += ["## Problems where solforge matched nothing", "",
              f"{len(nothing)} (solforge ran and found no region of a kernel family nor a generated one):", ""]
    lines += [", ".join(nothing) if nothing else "(none)", ""]
    if skipped:
        lines += ["## Skipped", "", "| problem | why |", "|---|---|"]
        for r in skipped:
            where = f"level {r['level']} " if r.get("level") else ""
            lines.append(f"| {where}{r['problem']} | {r['skipped']} |")
        lines.append("")
    return "\n".join(lines)
