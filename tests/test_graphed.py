"""CUDA-graph replay of an optimized model: same numbers as the model, fallbacks where the graph
does not apply, and a clear error without CUDA inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import requires_gpu

from solforge.errors import UserError
from solforge.integrate import integrate
from solforge.runtime.graphed import Graphed


class Norm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(h))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return {"y": self.weight * h.to(dtype), "s": x.sum(-1)}


def test_cpu_inputs_are_refused() -> None:
    with pytest.raises(UserError, match="CUDA inputs"):
        Graphed(lambda x: x, [torch.ones(3)])


@requires_gpu
def test_replay_matches_the_model_and_falls_back_on_other_shapes() -> None:
    torch.manual_seed(0)
    m = Norm(2560).cuda().to(torch.bfloat16)
    x = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)
    opt, stats = integrate(m, {})
    with torch.no_grad():
        g = Graphed(opt, [x])
        assert stats.total == 1  # the graph replays solforge's kernel, not the eager chain
        for seed in range(3):
            torch.manual_seed(seed)
            x2 = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)
            first = g(x2)
            ref = m(x2)
            torch.testing.assert_close(first["y"], ref["y"], atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(first["s"], ref["s"], atol=1e-1, rtol=2e-2)
            g(torch.randn_like(x2))  # outputs are copies: the next replay leaves `first` alone
            torch.testing.assert_close(first["y"], ref["y"], atol=2e-2, rtol=2e-2)
        assert g.replays == 6 and g.fallbacks == 0
        y3 = torch.randn(3, 2560, device="cuda", dtype=torch.bfloat16)  # another shape: no replay
        torch.testing.assert_close(g(y3)["y"], m(y3)["y"], atol=2e-2, rtol=2e-2)
        assert g.fallbacks == 1
    g(x)  # autograd on: the graph holds no backward, so the model runs itself
    assert g.fallbacks == 2
