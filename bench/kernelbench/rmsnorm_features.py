"""RMSNorm over dim 1 (`features`) of a (batch, features, dim1, dim2) fp32 tensor, no weight: the
form and shapes of KernelBench's level-1 RMSNorm problem, written here in its file format."""

import torch
import torch.nn as nn

batch_size, features, dim1, dim2 = 16, 64, 256, 256


class Model(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + self.eps)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(batch_size, features, dim1, dim2)]


def get_init_inputs() -> list[int]:
    return [features]
