"""A shape the optimized model meets after optimize (integrate/__init__.py): dynamo compiles a new graph
for it (for every size of the dims that changed; shapes.py makes it again for sizes that come
back), and its regions get the kernel database's verified winner for exactly that workload, are
left as the model ran them when the database holds a faster time for the region, or get the
family's heuristic config when the database has nothing (or cannot be read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE

import solforge.kernels.rmsnorm as rms
from solforge import capture, plan
from solforge.db import KernelDB
from solforge.integrate import integrate
from solforge.records import BuildResult, RunResult, TuningRecord, Verdict, Workload
from solforge.tune import candidates

BF16 = torch.bfloat16


class Norm(nn.Module):
    """Hugging Face's Qwen3/Llama RMSNorm."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(h))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _workload(m: nn.Module, x: torch.Tensor) -> Workload:
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, (x,)).graphs)
    assert [g.workload.family for g in groups] == ["rmsnorm"]
    # as a new process would: dynamo remembers the shapes it compiled a function for, and the next
    # compilation of it for another shape would be a dynamic-shape graph from the start
    torch.compiler.reset()
    return groups[0].workload


def _record(w: Workload, p50: float, *, meaningful: bool) -> TuningRecord:
    """A verified record of a config of `w` that is not its heuristic."""
    cand = candidates(rms, w)[1]
    assert cand.config_dict != candidates(rms, w)[0].config_dict
    return TuningRecord(cand, BuildResult(True, 0.5), Verdict(True, 3, 1e-3, 2e-3),
                        RunResult(p50 * 0.9, p50, p50 * 1.1, meaningful))


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The config of every rmsnorm kernel call (the custom op calls the module's `rmsnorm`)."""
    calls: list[Any] = []
    real = rms.rmsnorm

    def spy(*a: Any, config: Any = None, **kw: Any) -> torch.Tensor:
        calls.append(config)
        return real(*a, config=config, **kw)

    monkeypatch.setattr(rms, "rmsnorm", spy)
    return calls


def _pair(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    m = Norm(64).to(BF16).to(DEVICE).eval()
    return m, torch.randn(2, 3, 64, dtype=BF16, device=DEVICE), torch.randn(4, 5, 64, dtype=BF16, device=DEVICE)


def _check(m: nn.Module, opt: Any, x: torch.Tensor) -> None:
    with torch.no_grad():
        y, ref = opt(x), m(x)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_a_new_shape_gets_the_database_winner(tmp_path: Path, seen: list[Any]) -> None:
    m, x, x2 = _pair()
    w2 = _workload(m, x2)
    stored = _record(w2, 5.0, meaningful=True)
    with KernelDB(tmp_path / "k.db") as db:
        db.set_winner(w2, stored, run_id="earlier")
        db.set_baseline(w2, "spelling-a", RunResult(9.0, 10.0, 11.0, True))  # slower than the kernel
    w = _workload(m, x)
    opt, stats = integrate(m, {}, db=tmp_path / "k.db")
    _check(m, opt, x)  # a shape the database does not know: the heuristic
    assert sum(stats.untuned.values()) == 1 and not stats.stored
    assert seen[-1] == rms.heuristic(w)
    # the second shape: one graph for all sizes, whose kernel takes its heuristic per call ...
    _check(m, opt, x2)
    assert stats.graphs == 2 and stats.dynamic and not stats.stored and seen[-1] is None
    # ... and, for sizes that come back, that graph made again for them: the database's winner
    _check(m, opt, x2)
    assert stats.specialized == 1 and stats.stored == {w2.key: 1} and not stats.left
    assert seen[-1] == rms.Config(**stored.candidate.config_dict)
    # the first shape now comes to that graph too: made for it, with its heuristic again
    _check(m, opt, x)
    _check(m, opt, x)
    assert stats.specialized == 2 and sum(stats.untuned.values()) == 2 and seen[-1] == rms.heuristic(w)
    assert stats.graphs == 2  # dynamo compiled nothing more


def test_a_stored_winner_slower_than_the_region_leaves_it(tmp_path: Path, seen: list[Any]) -> None:
    m, _, x2 = _pair(1)
    w2 = _workload(m, x2)
    with KernelDB(tmp_path / "k.db") as db:
        db.set_winner(w2, _record(w2, 5.0, meaningful=True), run_id="earlier")
        db.set_baseline(w2, "spelling-a", RunResult(4.0, 4.5, 5.0, True))  # the model's own is faster
    opt, stats = integrate(m, {}, db=tmp_path / "k.db")
    n = len(seen)
    _check(m, opt, x2)
    assert stats.left == {w2.key: 1} and stats.total == 0 and len(seen) == n  # no kernel ran


def test_interpreter_times_never_leave_a_region(tmp_path: Path, seen: list[Any]) -> None:
    """Off the GPU no time means anything: a stored winner is used whatever the stored times say
    (as optimize does with the kernels it tunes there)."""
    m, _, x2 = _pair(2)
    w2 = _workload(m, x2)
    with KernelDB(tmp_path / "k.db") as db:
        db.set_winner(w2, _record(w2, 5.0, meaningful=False), run_id="earlier")
        db.set_baseline(w2, "spelling-a", RunResult(1.0, 1.0, 1.0, False))
    opt, stats = integrate(m, {}, db=tmp_path / "k.db")
    _check(m, opt, x2)
    assert stats.stored == {w2.key: 1}


def test_an_unreadable_database_falls_back_to_the_heuristic(tmp_path: Path, seen: list[Any]) -> None:
    m, _, x2 = _pair(3)
    bad = tmp_path / "k.db"
    bad.write_bytes(b"not a database")
    opt, stats = integrate(m, {}, db=bad)
    _check(m, opt, x2)
    assert sum(stats.untuned.values()) == 1 and seen[-1] == rms.heuristic(_workload(m, x2))
    opt, stats = integrate(m, {}, db=tmp_path / "missing.db")
    _check(m, opt, x2)
    assert sum(stats.untuned.values()) == 1 and not (tmp_path / "missing.db").exists()
