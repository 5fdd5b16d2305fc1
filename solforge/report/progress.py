"""What optimize() tells the outside world as it goes: the Reporter protocol (the CLI's
RichReporter draws progress bars with it), a silent one, and one that keeps each stage's seconds."""

from __future__ import annotations

import time
from typing import Protocol

from solforge.records import TuneResult, TuningRecord


class Reporter(Protocol):
    """What optimize() tells the outside world as it goes (the CLI draws progress bars with it)."""

    def stage(self, name: str, detail: str = "") -> None: ...
    def tune_start(self, workload_key: str, n_candidates: int) -> None: ...
    def tune_step(self, record: TuningRecord) -> None: ...
    def tune_end(self, result: TuneResult) -> None: ...


class Timed:
    """Passes every call on to a Reporter and keeps the wall seconds of each stage (report.json's
    `extra.stage_seconds`: what a cold and a warm run spend where)."""

    def __init__(self, inner: Reporter) -> None:
        self.inner = inner
        self.seconds: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def stage(self, name: str, detail: str = "") -> None:
        self.stop()
        self._current = (name, time.perf_counter())
        self.inner.stage(name, detail)

    def stop(self) -> None:
        if self._current is not None:
            name, t = self._current
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t, 3)
            self._current = None

    def tune_start(self, workload_key: str, n_candidates: int) -> None:
        self.inner.tune_start(workload_key, n_candidates)

    def tune_step(self, record: TuningRecord) -> None:
        self.inner.tune_step(record)

    def tune_end(self, result: TuneResult) -> None:
        self.inner.tune_end(result)


class Silent:
    def stage(self, name: str, detail: str = "") -> None: ...
    def tune_start(self, workload_key: str, n_candidates: int) -> None: ...
    def tune_step(self, record: TuningRecord) -> None: ...
    def tune_end(self, result: TuneResult) -> None: ...
