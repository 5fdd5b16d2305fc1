"""Softmax over the last dim of a (16, 16384) fp32 tensor, in the KernelBench file format (the form
of its level-1 Softmax problem; these sizes are chosen here)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(16, 16384)]


def get_init_inputs() -> list[int]:
    return []
