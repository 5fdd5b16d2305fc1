"""minGPT's GELU written out (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))) on a (2000, 2000)
fp32 tensor, in the KernelBench file format (the form of its level-1 MinGPTNewGelu problem; these
sizes are chosen here)."""

import math

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(2000, 2000)]


def get_init_inputs() -> list[int]:
    return []
