"""Deliberately wrong launchers of a tunable family, for tests that verification catches them
(tests/test_bwd_families.py, tests/test_norm_bwd.py). Each wraps the family's real launcher."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from solforge.tune import launcher_of


def scaled_last(fam: ModuleType, factor: float = 1.05) -> Callable[..., Any]:
    """The real kernel, then the last output scaled by `factor`: a wrong gradient in the right layout."""
    launcher = launcher_of(fam)

    def launch(*a: Any, out: tuple[torch.Tensor, ...], **kw: Any) -> Any:
        launcher(*a, out=out, **kw)
        out[-1].mul_(factor)
        return out
    return launch


def half_written(fam: ModuleType) -> Callable[..., Any]:
    """Computes into fresh tensors and copies only the first half of each (flattened) into `out`."""
    launcher = launcher_of(fam)

    def launch(*a: Any, out: tuple[torch.Tensor, ...], **kw: Any) -> Any:
        for o, t in zip(out, launcher(*a, **kw), strict=True):
            half = max(1, o.numel() // 2)
            o.view(-1)[:half].copy_(t.reshape(-1)[:half])
        return out
    return launch
