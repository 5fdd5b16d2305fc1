"""Terminal output: live progress while optimizing, and the table of regions and end-to-end result."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from solforge.records import Report, TuneResult, TuningRecord


class RichReporter:
    """Implements api.Reporter with rich: one line per stage, a progress bar per tuned workload."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[best]}"), TimeElapsedColumn(), console=console, transient=False,
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
        self.task = self.progress.add_task(f"tune {workload_key}", total=n_candidates, best="")

    def tune_step(self, record: TuningRecord) -> None:
        if self.task is None:
            return
        if record.ok:
            self.best = min(self.best, record.time_us)
        best = f"best {self.best:.1f} µs" if self.best < float("inf") else "no verified candidate yet"
        self.progress.update(self.task, advance=1, best=best)

    def tune_end(self, result: TuneResult) -> None:
        if self.task is not None:
            done = len(result.records)
            self.progress.update(self.task, total=done, completed=done)
        self.task = None


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def print_report(report: Report, console: Console) -> None:
    t = Table(title=f"solforge: {report.model} on {report.device} ({report.dtype}, {report.mode})")
    for col in ("region", "n", "before µs", "after µs", "speedup", "config", "ok", "rel err"):
        t.add_column(col, justify="left" if col in ("region", "config", "ok") else "right")
    for r in report.regions:
        cfg = r.config_text or r.note or "-"
        t.add_row(f"{r.family} {r.label}", str(r.count), _us(r.baseline_us), _us(r.best_us),
                  "-" if r.speedup is None else f"{r.speedup:.2f}x", cfg,
                  "yes" if r.verified else "[red]no[/]", "-" if r.max_rel_err is None else f"{r.max_rel_err:.1e}")
    console.print(t)
    e = report.e2e
    if e is not None:
        status = "[green]passed[/]" if e.passed else f"[red]FAILED[/] ({e.note})"
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
