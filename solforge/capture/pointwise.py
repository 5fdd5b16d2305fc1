"""Which ATen ops are pointwise: ATen's `pointwise` tag, and the pointwise ops that lack it.

The capture passes ask this to know what the generated region after a value will take (a
convolution's bias add, its copy back to NCHW); they must not import codegen, whose lowering table
is the full answer. `aten.hardswish` has no tag (torch 2.11-2.13), so a convolution followed by a
HardSwish kept ATen's separate bias pass (KernelBench level 2's 69_Conv2d_HardSwish_ReLU: 410 µs of
1308, H200, 2026-11-28).
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

UNTAGGED = frozenset({aten.hardswish.default})


def is_pointwise(target: Any) -> bool:
    """Whether an FX node's target is a pointwise ATen op (tagged, or one of UNTAGGED)."""
    return isinstance(target, torch._ops.OpOverload) and (torch.Tag.pointwise in target.tags or target in UNTAGGED)
