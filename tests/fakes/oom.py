"""A fake kernel family whose configs run out of memory on purpose (torch.OutOfMemoryError, as a
CUDA allocation raises it): when building (every call), when verifying (calls given `out=`), or
when timed (calls without `out=` after the build's first one). `ok` is correct."""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

import torch

from solforge.records import Workload

FAMILY = "fakes.oom"
MODES = ("ok", "oom_build", "oom_verify", "oom_time")
_calls: dict[str, int] = {}  # calls without out= so far, per mode


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.40 GiB (a fake)")


def oom_ref(x: torch.Tensor) -> torch.Tensor:
    return x.float() * 2


def oom(x: torch.Tensor, *, config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    mode = (config or Config()).mode
    if out is None:
        _calls[mode] = _calls.get(mode, 0) + 1
    if mode == "oom_build" or (mode == "oom_verify" and out is not None) \
            or (mode == "oom_time" and out is None and _calls[mode] > 1):
        raise _oom()
    y = out if out is not None else torch.empty_like(x, dtype=torch.float32)
    return y.copy_(x.float() * 2)


@dataclass(frozen=True)
class Config:
    variant: str = "v"
    mode: str = "ok"

    def items(self) -> tuple[tuple[str, Any], ...]:
        return tuple(zip(("variant", "mode"), astuple(self), strict=True))

    def encode(self) -> str:
        return self.mode


def space(workload: Workload) -> list[Config]:
    return [Config(mode=m) for m in MODES]


def is_valid(config: Config, workload: Workload) -> bool:
    return config.mode in MODES


def heuristic(workload: Workload) -> Config:
    return Config(mode="oom_build")  # the heuristic first: a failure must not stop the search


def workload(rows: int = 8, cols: int = 16) -> Workload:
    return Workload(FAMILY, ((rows, cols),), ("float32",))


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | None = None) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    r, c = workload.shapes[0]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows or r, c, generator=g).to(device or "cpu"),), {}
