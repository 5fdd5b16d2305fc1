"""Terminal output: live progress while optimizing, and the table of regions and end-to-end result."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from solforge.records import Profile, RegionReport, Report, TuneResult, TuningRecord
from solforge.settings import describe


class RichReporter:
    """Implements api.Reporter with rich: one line per stage, and per tuned workload a bar of
    candidates measured (of the space, or of --max-candidates), the best verified time so far,
    failures, elapsed time and an ETA. The bar ends early when the search converges or the
    budget runs out; a kernel from the database prints one line instead."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[best]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self.task: int | None = None
        self.best = float("inf")

    def __enter__(self) -> RichReporter:
        self.progress.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.progress.__exit__(et, e, tb)

    def stage(self, name: str, detail: str = "") -> None:
        if name != "tune":
            self.progress.console.print(f"[cyan]{name:>9}[/] {detail}")

    def tune_start(self, workload_key: str, n_candidates: int) -> None:
        self.best = float("inf")
        self.failed = 0
        self.task = self.progress.add_task(f"tune {workload_key}", total=n_candidates, best="")

    def tune_step(self, record: TuningRecord) -> None:
        if self.task is None:
            return
        if record.ok:
            self.best = min(self.best, record.time_us)
        else:
            self.failed += 1
        best = f"best {self.best:.1f} µs" if self.best < float("inf") else "no verified candidate yet"
        if self.failed:
            best += f", {self.failed} failed"
        self.progress.update(self.task, advance=1, best=best)

    def tune_end(self, result: TuneResult) -> None:
        if result.source == "database" and result.best is not None:
            self.progress.console.print(f"[cyan]{'database':>9}[/] {result.workload.key}: "
                                        f"{result.best.candidate.label} ({result.best.time_us:,.1f} µs when tuned)")
        if self.task is not None:
            done = len(result.records)
            self.progress.update(self.task, total=done, completed=done)
        self.task = None


def _source(r: RegionReport) -> str:
    """Where the kernel came from: the database, or this run's search (measured/known)."""
    if r.source == "database":
        return "database"
    known = f"+{r.known} known" if r.known else ""
    return f"{r.strategy or 'tuned'} {r.candidates}{known}"


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def print_report(report: Report, console: Console) -> None:
    t = Table(title=f"solforge: {report.model} on {report.device} ({report.dtype}, {report.mode})")
    for col in ("region", "n", "before µs", "after µs", "speedup", "generated µs", "config", "from", "ok",
                "rel err"):
        t.add_column(col, justify="left" if col in ("region", "config", "ok") else "right")
    for r in report.regions:
        cfg = r.config_text or r.note or "-"
        # ok: verified and swapped in; "kept original": verified but not faster than the region
        ok = ("yes" if r.integrated else "kept original") if r.verified else "[red]no[/]"
        # a family region's generated alternative (plan/alternatives.py): its time, "won" when it runs
        alt = "-" if r.alternative is None else _us(r.alternative_us) + (" won" if r.won == "generated" else "")
        t.add_row(f"{r.family} {r.label}", str(r.count), _us(r.baseline_us), _us(r.best_us),
                  "-" if r.speedup is None else f"{r.speedup:.2f}x", alt, cfg, _source(r), ok,
                  "-" if r.max_rel_err is None else f"{r.max_rel_err:.1e}")
    console.print(t)
    e = report.e2e
    if e is not None and e.status == "nothing to validate":  # not a pass, nor a wrong kernel: no figures
        console.print(f"end to end: [yellow]nothing to validate[/] ({e.note})")
    elif e is not None:
        status = ("[green]passed[/]" + (f" ({e.note})" if e.note else "")) if e.passed else f"[red]FAILED[/] ({e.note})"
        timing = (f"{e.baseline_ms:,.2f} ms -> {e.optimized_ms:,.2f} ms ({e.speedup:.2f}x)"
                  if e.baseline_ms is not None and e.optimized_ms is not None and e.speedup is not None
                  else "not timed")
        agree = "" if e.argmax_agree is None else f", argmax agrees at {e.argmax_agree:.2%} of positions"
        if e.argmax_agree_decisive is not None:
            agree += f" ({e.argmax_agree_decisive:.2%} where the margin is decisive)"
        console.print(f"end to end: {timing}; max abs err {e.max_abs_err:.3g}, max rel err "
                      f"{e.max_rel_err:.3g}{agree}: {status}")
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}")
    if changed := describe(report.settings):
        console.print(f"settings not at their defaults: {changed}")


def print_profile(prof: Profile, console: Console, top: int = 15) -> None:
    """The top regions by Amdahl saving, then where the rest of the forward went."""
    title = f"solforge profile: {prof.model} on {prof.device}"
    title += "" if prof.meaningful else " (CPU: times mean nothing)"
    t = Table(title=title)
    for col in ("#", "region", "shape", "n", "ms", "% fwd", "µs/call", "achieved", "% SOL", "bound", "saves ms"):
        t.add_column(col, justify="left" if col in ("region", "shape", "bound") else "right")
    fwd = prof.forward_us if prof.forward_us > 0 else float("nan")
    for r in prof.regions[:top]:
        rate = f"{r.achieved_tflops:,.1f} TFLOP/s" if r.bound == "compute" else f"{r.achieved_gbs:,.0f} GB/s"
        t.add_row(str(r.rank), f"{r.family} {r.module}".strip(), r.label, str(r.count), f"{r.time_us / 1e3:,.2f}",
                  f"{100 * r.time_us / fwd:.1f}", f"{r.time_us / max(r.count, 1):,.1f}", rate,
                  f"{r.pct_of_sol:.0f}", r.bound, f"{r.saving_us / 1e3:,.2f}")
    console.print(t)
    status = "[green]complete[/]" if prof.complete else "[red]PARTIAL[/]"
    console.print(f"forward {prof.forward_us / 1e3:,.2f} ms measured; regions add up to "
                  f"{prof.attributed_us / 1e3:,.2f} ms ({prof.attributed_us / fwd:.1%}); outside regions "
                  f"{prof.outside_us / 1e3:,.2f} ms; idle between kernels {prof.idle_us / 1e3:,.2f} ms; "
                  f"{prof.kernels:,} kernels: {status}")
    console.print("counts: " + ", ".join(f"{f} {n}" for f, n, _ in prof.by_family))
    c = prof.ceilings
    console.print(f"ceilings: copy {c.copy_gbs:,.0f} GB/s, bf16 {c.bf16_tflops:,.1f} TFLOP/s, fp32 "
                  f"{c.fp32_tflops:,.1f} TFLOP/s ({c.device}{'' if c.meaningful else ', not meaningful'})")
    for note in prof.notes:
        console.print(f"[yellow]note:[/] {note}")
