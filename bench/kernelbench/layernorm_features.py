"""LayerNorm over (features, dim1, dim2) of a (16, 64, 256, 256) fp32 tensor: the form and shapes of
KernelBench's level-1 LayerNorm problem. Rows of 4M values are past what one program holds (64K):
the layernorm family's split variant cuts each row into chunks (kernels/layernorm_split.py)."""

import torch
import torch.nn as nn

batch_size, features, dim1, dim2 = 16, 64, 256, 256


class Model(nn.Module):
    def __init__(self, normalized_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(normalized_shape=normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(batch_size, features, dim1, dim2)]


def get_init_inputs() -> list[tuple[int, int, int]]:
    return [(features, dim1, dim2)]
