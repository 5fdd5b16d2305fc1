"""report.html: one self-contained offline page (inline SVG charts, a few lines of JS, no network).

Charts are drawn here in Python as SVG, so the page needs nothing to render them; the script
only marks the page as rendered (`<body data-rendered="roofline:N bars:M">`) or records a
script error (`data-error`), which the headless-Chromium test reads back.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence

from solforge.records import Profile, RegionProfile, Report
from solforge.settings import describe

COLORS = {"gemm": "#4e79a7", "attention": "#f28e2b", "normalization": "#e15759", "pointwise": "#76b7b2",
          "reduction": "#59a14f", "copy": "#edc948", "other": "#b07aa1", "outside": "#9d9d9d", "idle": "#d9d9d9"}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1180px;
color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#666;font-size:12px}.warn{background:#fff4d6;border:1px solid #e8c45c;padding:6px 10px;margin:10px 0}
.bad{color:#b00020;font-weight:600}.good{color:#137333;font-weight:600}
table{border-collapse:collapse;font-size:12.5px;width:100%}th,td{padding:3px 7px;border-bottom:1px solid #eee;
text-align:right;white-space:nowrap}th{background:#f6f6f6;position:sticky;top:0}td.l,th.l{text-align:left}
td.l{white-space:normal;max-width:380px;overflow-wrap:anywhere}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;
min-width:150px}.card b{display:block;font-size:18px}svg{background:#fff;display:block}
svg text{font:11px system-ui,sans-serif;fill:#333}.legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}code{font-size:12px}
"""

SCRIPT = """
window.addEventListener('error', function (e) { document.body.dataset.error = String(e.message || e); });
window.addEventListener('load', function () {
  var svgs = Array.prototype.slice.call(document.querySelectorAll('svg'));
  var drawn = svgs.length > 0 && svgs.every(function (s) { var b = s.getBBox(); return b.width > 0 && b.height > 0; });
  var pts = document.querySelectorAll('#roofline svg .pt').length;
  var bars = document.querySelectorAll('#time svg .bar').length;
  document.body.dataset.rendered = drawn ? 'roofline:' + pts + ' bars:' + bars : 'blank';
});
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _ms(us: float) -> str:
    return f"{us / 1e3:,.2f} ms" if math.isfinite(us) else "-"


def _num(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}" if math.isfinite(x) else "-"


def _name(r: RegionProfile) -> str:
    return f"{r.family} {r.module}".strip()


class _Log:
    """log10 axis mapping [lo, hi] (powers of ten) onto pixels [a, b]."""

    def __init__(self, lo: float, hi: float, a: float, b: float) -> None:
        self.lo, self.hi = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        if self.hi <= self.lo:
            self.hi = self.lo + 1
        self.a, self.b = a, b

    def __call__(self, v: float) -> float:
        t = (math.log10(max(v, 10.0 ** self.lo)) - self.lo) / (self.hi - self.lo)
        return self.a + t * (self.b - self.a)

    def decades(self) -> range:
        return range(self.lo, self.hi + 1)


def _tick(p: int) -> str:
    return f"{10.0 ** p:g}" if -3 <= p <= 4 else f"1e{p}"


def roofline_svg(prof: Profile, width: int = 760, height: int = 440) -> str:
    c = prof.ceilings
    pts = [r for r in prof.regions if r.time_us > 0 and r.bytes > 0]
    ridge = c.bf16_tflops * 1e3 / c.copy_gbs  # FLOP/B where the copy roof meets the bf16 roof
    xs = [r.flops / r.bytes for r in pts if r.flops > 0] or [1.0]
    x_min = min(min(xs) / 2, 0.1)
    ys = [r.achieved_tflops for r in pts if r.flops > 0] + [r.achieved_gbs * x_min / 1e3 for r in pts if r.flops == 0]
    ys = [y for y in ys if y > 0] or [c.bf16_tflops / 1e3]
    left, right, top, bottom = 64, width - 20, 16, height - 44
    X = _Log(x_min, max(max(xs), ridge) * 4, left, right)
    Y = _Log(min(min(ys), c.copy_gbs * x_min / 1e3) / 2, max(c.bf16_tflops, max(ys)) * 2, bottom, top)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="roofline">']
    for p in X.decades():
        x = X(10.0 ** p)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{_tick(p)}</text>')
    for p in Y.decades():
        y = Y(10.0 ** p)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick(p)}</text>')
    out.append(f'<text x="{(left + right) / 2}" y="{height - 8}" text-anchor="middle">arithmetic intensity '
               '(FLOP/byte)</text>'
               f'<text transform="translate(14 {(top + bottom) / 2}) rotate(-90)" text-anchor="middle">'
               'achieved TFLOP/s</text>')
    for tflops, dash, label in ((c.bf16_tflops, "", f"bf16 {c.bf16_tflops:,.0f} TFLOP/s"),
                                (c.fp32_tflops, "4 3", f"fp32 {c.fp32_tflops:,.1f} TFLOP/s")):
        knee = tflops * 1e3 / c.copy_gbs
        x0, x1 = 10.0 ** X.lo, 10.0 ** X.hi
        path = (f"M{X(x0):.1f},{Y(c.copy_gbs * x0 / 1e3):.1f} L{X(knee):.1f},{Y(tflops):.1f} "
                f"L{X(x1):.1f},{Y(tflops):.1f}")
        out.append(f'<path d="{path}" fill="none" stroke="#333" stroke-width="1.6" stroke-dasharray="{dash}"/>'
                   f'<text x="{right - 4}" y="{Y(tflops) - 5:.1f}" text-anchor="end">{_e(label)}</text>')
    out.append(f'<text x="{X(10.0 ** X.lo) + 8:.1f}" y="{Y(c.copy_gbs * 10.0 ** X.lo / 1e3) - 8:.1f}" '
               f'transform="rotate(0)">copy {c.copy_gbs:,.0f} GB/s</text>')
    t_max = max((r.time_us for r in pts), default=1.0)
    for r in sorted(pts, key=lambda r: -r.time_us):
        x = r.flops / r.bytes if r.flops > 0 else x_min
        y = r.achieved_tflops if r.flops > 0 else r.achieved_gbs * x_min / 1e3
        rad = 3 + 10 * math.sqrt(r.time_us / t_max)
        tip = (f"#{r.rank} {_name(r)} [{r.label}] x{r.count}: {_ms(r.time_us)}, {r.pct_of_sol:.0f}% of speed of "
               f"light, {r.bound}-bound, saves {_ms(r.saving_us)}" + ("" if r.flops else " (no arithmetic)"))
        out.append(f'<circle class="pt" data-region="{_e(r.key)}" cx="{X(x):.1f}" cy="{Y(y):.1f}" r="{rad:.1f}" '
                   f'fill="{COLORS.get(r.kind, "#888")}" fill-opacity="0.7" stroke="#222" stroke-width="0.6">'
                   f'<title>{_e(tip)}</title></circle>')
        if r.rank <= 6:
            out.append(f'<text x="{X(x) + rad + 2:.1f}" y="{Y(y) + 4:.1f}">#{r.rank}</text>')
    out.append("</svg>")
    return "".join(out)


def _bars(rows: Sequence[tuple[str, float, str, str]], scale: float, width: int = 760, label_w: int = 300) -> str:
    """Horizontal bars: (label, value us, color, right-hand text)."""
    h = 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h * len(rows) + 8}">']
    for i, (label, v, color, text) in enumerate(rows):
        y = 4 + i * h
        w = max(1.0, (width - label_w - 150) * v / scale) if scale > 0 and v > 0 else 0.0
        out.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end">{_e(label[:48])}</text>'
                   f'<rect class="bar" x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{h - 6}" fill="{color}">'
                   f'<title>{_e(label)}: {_e(text)}</title></rect>'
                   f'<text x="{label_w + w + 5:.1f}" y="{y + 13}">{_e(text)}</text>')
    out.append("</svg>")
    return "".join(out)


def _kind_rows(prof: Profile) -> list[tuple[str, float]]:
    return [*[(k, v) for k, v in prof.by_kind if v > 0], ("outside", prof.outside_us), ("idle", prof.idle_us)]


def time_svgs(prof: Profile, top: int = 20) -> str:
    total = max(prof.attributed_us + prof.outside_us + prof.idle_us, 1e-9)
    regions = sorted(prof.regions, key=lambda r: -r.time_us)[:top]
    rows = [(f"{_name(r)} x{r.count}", r.time_us, COLORS.get(r.kind, "#888"),
             f"{_ms(r.time_us)} ({100 * r.time_us / total:.1f}%)") for r in regions]
    by_region = _bars(rows, max((r.time_us for r in regions), default=1.0))
    kinds = [(k, v, COLORS.get(k, "#888"), f"{_ms(v)} ({100 * v / total:.1f}%)") for k, v in _kind_rows(prof) if v > 0]
    return (f"<h3>top {len(regions)} regions by time</h3>{by_region}<h3>by kind</h3>"
            f"{_bars(kinds, max((v for _, v, _, _ in kinds), default=1.0))}")


def before_after_svg(before: Profile, after: Profile) -> str:
    a = dict(_kind_rows(after))
    rows: list[tuple[str, float, str, str]] = [
        ("forward (measured)", before.forward_us, "#9d9d9d", _ms(before.forward_us)),
        ("forward, optimized", after.forward_us, "#137333", _ms(after.forward_us))]
    for k, v in _kind_rows(before):
        if v > 0 or a.get(k, 0) > 0:
            rows += [(f"{k} before", v, "#bdbdbd", _ms(v)),
                     (f"{k} after", a.get(k, 0.0), COLORS.get(k, "#888"), _ms(a.get(k, 0.0)))]
    return _bars(rows, max(before.forward_us, after.forward_us, *(v for _, v, _, _ in rows)))


def _table(head: Sequence[str], rows: Iterable[Sequence[object]], left: int = 2) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{_e(v)}</td>' for i, v in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def regions_table(prof: Profile) -> str:
    head = ("#", "region", "shape", "n", "kind", "time", "µs/call", "GB/s", "TFLOP/s", "% SOL", "bound", "saves")
    rows = [(r.rank, _name(r), r.label, r.count, r.kind, _ms(r.time_us), _num(r.time_us / max(r.count, 1)),
             _num(r.achieved_gbs, 0), _num(r.achieved_tflops, 2), _num(r.pct_of_sol, 0), r.bound, _ms(r.saving_us))
            for r in prof.regions]
    return _table(head, rows, left=3)


def _summary(prof: Profile) -> str:
    ratio = prof.attributed_us / prof.forward_us if prof.forward_us > 0 else float("nan")
    cards = [("forward (measured)", _ms(prof.forward_us)), ("regions add up to", f"{_ms(prof.attributed_us)} "
              f"({ratio:.1%})"), ("outside regions", _ms(prof.outside_us)), ("idle between kernels", _ms(prof.idle_us)),
             ("kernels", f"{prof.kernels:,}"), ("graphs", str(prof.graphs))]
    c = prof.ceilings
    status = '<span class="good">complete</span>' if prof.complete else '<span class="bad">PARTIAL</span>'
    return ('<div class="cards">' + "".join(f'<div class="card">{_e(k)}<b>{_e(v)}</b></div>' for k, v in cards)
            + f'</div><p>profile {status}. Ceilings of {_e(c.device)} (measured {_e(c.measured)}): copy '
            f'{c.copy_gbs:,.0f} GB/s, bf16 {c.bf16_tflops:,.1f} TFLOP/s, fp32 {c.fp32_tflops:,.1f} TFLOP/s'
            f'{"" if c.meaningful else " (a CPU stand-in: not meaningful)"}.</p>'
            + "<p>Counts: " + ", ".join(f"{_e(f)} {n}" for f, n, _ in prof.by_family) + "</p>")


def kernels_section(report: Report) -> str:
    if not report.regions:
        return "<p>No kernels were tuned (profile only).</p>"
    head = ("family", "workload", "n", "before µs", "after µs", "speedup", "config", "verified", "max rel err",
            "candidates", "rejected")
    rows = [(r.family, r.label, r.count, _num(r.baseline_us or math.nan), _num(r.best_us or math.nan),
             f"{r.speedup:.2f}x" if r.speedup else "-", r.config_text or r.note or "-",
             "yes" if r.verified else "NO", f"{r.max_rel_err:.1e}" if r.max_rel_err is not None else "-",
             r.candidates, r.rejected) for r in report.regions]
    out = _table(head, rows)
    e = report.e2e
    if e is not None:
        verdict = ('<span class="good">passed</span>' + (f" ({_e(e.note)})" if e.note else "") if e.passed
                   else f'<span class="bad">FAILED</span> {_e(e.note)}')
        agree = "" if e.argmax_agree is None else f", argmax agrees at {e.argmax_agree:.2%} of positions"
        if e.argmax_agree_decisive is not None:
            agree += f" ({e.argmax_agree_decisive:.2%} where the margin is decisive)"
        timing = (f"{_ms(e.baseline_ms * 1e3)} → {_ms(e.optimized_ms * 1e3)} ({e.speedup:.2f}x)"
                  if e.baseline_ms is not None and e.optimized_ms is not None and e.speedup else "not timed")
        out += (f"<p>End to end on fresh inputs: {timing}; {e.outputs_compared} output(s) compared, max abs err "
                f"{e.max_abs_err:.3g}, max rel err {e.max_rel_err:.3g}{agree}: {verdict}</p>")
        if e.status == "nothing to validate":  # not a pass, and not a wrong kernel either: no figures
            out = out.rsplit("<p>End to end", 1)[0] + (
                f'<p>End to end on fresh inputs: <span class="bad">nothing to validate</span> ({_e(e.note)})</p>')
    return out


def render(report: Report) -> str:
    prof, after = report.profile, report.profile_after
    parts = [f"<h1>solforge: {_e(report.model)}</h1><p class=\"meta\">{_e(report.device)} · {_e(report.dtype)} · "
             f"{_e(report.mode)} · {_e(report.created)} · <code>{_e(report.command)}</code></p>"]
    if not report.timings_meaningful:
        parts.append('<div class="warn">No GPU: every time on this page was measured on the CPU and means '
                     "nothing for a GPU (the page shows the method, not the numbers).</div>")
    if prof is not None:
        legend = "".join(f'<span><i style="background:{c}"></i>{k}</span>' for k, c in COLORS.items())
        parts += [f'<section id="summary"><h2>Where the time goes</h2>{_summary(prof)}</section>',
                  f'<section id="roofline"><h2>Roofline: every region against the measured ceilings</h2>'
                  f'<p class="legend">{legend}</p>{roofline_svg(prof)}<p class="meta">Point size: time; '
                  "regions without arithmetic (pure copies) sit at the left edge at their fraction of the copy "
                  "bandwidth. Hover a point for its numbers.</p></section>",
                  f'<section id="time"><h2>Time by region and kind</h2>{time_svgs(prof)}</section>']
        if after is not None:
            parts.append(f'<section id="before-after"><h2>Before / after</h2>{before_after_svg(prof, after)}</section>')
        parts.append(f'<section id="ranking"><h2>Amdahl ranking</h2><p class="meta">saves = end-to-end time '
                     f"gone if every repeat of the region ran at its speed of light</p>{regions_table(prof)}</section>")
    parts.append(f'<section id="kernels"><h2>Tuned kernels and verification</h2>{kernels_section(report)}</section>')
    notes = [*report.notes, *(n for n in (prof.notes if prof else ()) if n not in report.notes)]
    if notes:
        parts.append('<section id="notes"><h2>Notes</h2><ul>' + "".join(f"<li>{_e(n)}</li>" for n in notes)
                     + "</ul></section>")
    versions = json.dumps(report.versions, sort_keys=True)
    parts.append(f'<p class="meta">versions: <code>{_e(versions)}</code></p>')
    if changed := describe(report.settings):
        parts.append(f'<p class="meta">settings not at their defaults: <code>{_e(changed)}</code></p>')
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>solforge: {_e(report.model)}'
            f'</title><style>{CSS}</style></head><body>{"".join(parts)}<script>{SCRIPT}</script></body></html>\n')
