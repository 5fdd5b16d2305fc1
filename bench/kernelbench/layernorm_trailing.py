"""LayerNorm over the last two dims, (64, 32), of a (4096, 64, 32) tensor: merged into rows of 2048."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, normalized_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(4096, 64, 32)]


def get_init_inputs() -> list[tuple[int, int]]:
    return [(64, 32)]
