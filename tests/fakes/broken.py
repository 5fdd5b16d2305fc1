"""A fake kernel family whose configs misbehave on purpose: crash and hang isolation tests.

`mode` picks what the launcher does: ok (correct), wrong (wrong numbers), nan, raise, hang (in
build, i.e. on every call), hang_verify (only when verifying: `out` given), segv (kills the process
with SIGSEGV), abort (SIGABRT through os.abort), exit (the process exits mid-candidate).
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import astuple, dataclass
from typing import Any

import torch

from solforge.records import Workload

FAMILY = "fakes.broken"
MODES = ("ok", "wrong", "nan", "raise", "hang", "hang_verify", "segv", "abort", "exit")


def broken_ref(x: torch.Tensor) -> torch.Tensor:
    return x.float() * 2


def broken(x: torch.Tensor, *, config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    mode = (config or Config()).mode
    y = out if out is not None else torch.empty_like(x, dtype=torch.float32)
    if mode == "hang" or (mode == "hang_verify" and out is not None):
        time.sleep(1e6)
    if mode == "segv":
        ctypes.string_at(0)
    if mode == "abort":
        os.abort()
    if mode == "exit":
        os._exit(7)
    if mode == "raise":
        raise RuntimeError("this config cannot be built")
    y.copy_(x.float() * (3 if mode == "wrong" else 2))
    if mode == "nan":
        y.fill_(float("nan"))
    return y


@dataclass(frozen=True)
class Config:
    variant: str = "v"
    mode: str = "ok"
    size: int = 1

    def items(self) -> tuple[tuple[str, Any], ...]:
        return tuple(zip(("variant", "mode", "size"), astuple(self), strict=True))

    def encode(self) -> str:
        return f"{self.mode}:{self.size}"


def space(workload: Workload) -> list[Config]:
    return [Config(mode=m) for m in MODES]


def is_valid(config: Config, workload: Workload) -> bool:
    return config.mode in MODES


def heuristic(workload: Workload) -> Config:
    return Config()


def workload(rows: int = 8, cols: int = 16) -> Workload:
    return Workload(FAMILY, ((rows, cols),), ("float32",))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | None = None) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    r, c = workload.shapes[0]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows or r, c, generator=g).to(device or "cpu"),), {}
