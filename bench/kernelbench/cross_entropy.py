"""Cross-entropy of (4096, 32000) fp32 logits against class indices, in the KernelBench file format
(the form of its level-1 CrossEntropyLoss problem, with a language model's vocabulary as the class
count: these sizes are chosen here)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(predictions, targets)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(4096, 32000), torch.randint(0, 32000, (4096,))]


def get_init_inputs() -> list[int]:
    return []
