"""Generic fusion: region formation over ATen graphs of every op class, each region's generated
kernels checked against its fp64 reference (and the reference against the graph's own values) on
odd shapes, with fp32 and bf16 inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import form_and_check, ops

pytestmark = pytest.mark.usefixtures("on_device")

torch.manual_seed(0)


def _r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_chain_is_one_region(dtype: torch.dtype) -> None:
    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x + b) * F.gelu(x) - torch.where(x > 0.5, x, torch.clamp(x, -0.25, 0.25))
        return F.silu(y).float() * 0.5 + F.gelu(x, approximate="tanh").float()

    (r,) = form_and_check(f, _r(7, 13, dtype=dtype), _r(13, dtype=dtype))
    assert r.record.space.reduced == () and r.record.space.shape == (7, 13)
    assert "sigmoid" in ops(r) and "where" in ops(r) and len(r.inputs) == 2


def test_activations_and_scalars() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (F.relu(x) + F.leaky_relu(x, 0.1) + F.elu(x) + F.softplus(x) + F.hardswish(x) + F.hardtanh(x)
                + F.mish(x) + torch.tanh(x) + x.abs().sqrt() + torch.exp(-x * x) + x.pow(3) + (x.abs() + 1).pow(1.5)
                + F.hardsigmoid(x) + torch.erf(x) + x.neg().clamp_min(0.1).log() + torch.rsqrt(x.abs() + 1))

    (r,) = form_and_check(f, _r(3, 5, 17))
    assert r.record.space.shape == (3, 5, 17)


def test_broadcast_per_channel_and_strided_inputs() -> None:
    def f(x: torch.Tensor, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x NCHW, s (1, C, 1, 1), y a permuted, sliced view of a bigger tensor
        return x * s + y.permute(0, 3, 1, 2)[:, :, 1:, ::2]

    x, s = _r(2, 3, 4, 5), _r(1, 3, 1, 1)
    y = _r(2, 5, 10, 3)
    (r,) = form_and_check(f, x, s, y)
    assert r.record.space.shape == (2, 3, 4, 5) and len(r.inputs) == 3


def test_non_contiguous_inputs() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x.t() * 2 + y).exp()

    x = _r(13, 7)
    y = _r(7, 26)[:, ::2]  # non-contiguous graph input
    (r,) = form_and_check(f, x, y)
    assert r.record.space.shape == (7, 13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_and_log_softmax(dtype: torch.dtype) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.softmax(x, -1), torch.log_softmax(x.float(), -1)

    (r,) = form_and_check(f, _r(7, 13, dtype=dtype) * 4)
    assert r.record.space.reduced == (1,) and len(r.outputs) == 2


@pytest.mark.parametrize("dim", [-1, 1, (0, 2)])
def test_sum_mean_amax_over_dims(dim: object) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(dim), x.mean(dim, keepdim=True), x.amax(dim), x.amin(dim)

    (r,) = form_and_check(f, _r(3, 5, 17))
    d = (dim,) if isinstance(dim, int) else dim
    assert r.record.space.reduced == tuple(sorted(x % 3 for x in d))  # type: ignore[union-attr]
    assert len(r.outputs) == 4


def test_groupnorm_written_out() -> None:
    G = 2

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n, c, h, ww = x.shape
        xg = x.reshape(n, G, -1)
        mean = xg.mean(-1, keepdim=True)
        var = xg.var(-1, keepdim=True, unbiased=False)
        y = ((xg - mean) / torch.sqrt(var + 1e-5)).reshape(n, c, h, ww)
        return y * w.view(1, c, 1, 1) + b.view(1, c, 1, 1)

    (r,) = form_and_check(f, _r(3, 4, 5, 3), _r(4), _r(4))
    assert r.record.space.shape == (3, 2, 30) and r.record.space.reduced == (2,) and r.record.space.stages == 2


def test_batchnorm_like_reduction_over_n_h_w() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        mean = x.mean((0, 2, 3), keepdim=True)
        var = ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
        return (x - mean) * torch.rsqrt(var + 1e-5)

    (r,) = form_and_check(f, _r(3, 5, 4, 7))
    assert r.record.space.reduced == (0, 2, 3) and r.record.space.rows == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mse_loss_full_reduction(dtype: torch.dtype) -> None:
    def f(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.mean((p - t) ** 2)

    (r,) = form_and_check(f, _r(37, 29, dtype=dtype), _r(37, 29, dtype=dtype))
    assert r.record.space.rows == 1 and r.outputs[0].meta["val"].shape == ()


def test_l2_norm_rmsnorm_layernorm() -> None:
    def l2(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).sum(-1, keepdim=True))

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    def ln(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        return (x - m) / torch.sqrt(v + 1e-5) * w

    for fn, args in ((l2, (_r(5, 19),)), (rms, (_r(6, 21, dtype=torch.bfloat16), _r(21, dtype=torch.bfloat16))),
                     (ln, (_r(9, 11), _r(11)))):
        (r,) = form_and_check(fn, *args)
        assert r.record.space.reduced == (1,)


def test_matmul_cuts_two_regions() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(x * 2 + 1)
        return torch.relu(h @ w) * 3

    regions = form_and_check(f, _r(5, 7), _r(7, 6))
    assert len(regions) == 2
    assert all("mm" not in ops(r) for r in regions)


def test_random_op_not_fused() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.rand_like(x) * x.exp()

    gm_regions = form_and_check(lambda x: x.exp() + 1, _r(4, 5))
    assert len(gm_regions) == 1
    from codegen_helpers import trace

    from solforge.codegen.regions import form_regions
    regions = form_regions(trace(f, _r(4, 5)).graph)
    assert all("rand_like" not in ops(r) for r in regions)


def test_inner_value_read_outside_is_an_output() -> None:
    def f(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + r  # the residual stream, read again outside
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w, h @ w.unsqueeze(1)

    regions = form_and_check(f, _r(7, 13), _r(7, 13), _r(13))
    big = max(regions, key=lambda r: len(r.nodes))
    assert len(big.outputs) == 2 and "add" in ops(big)


def test_shapes_that_need_two_loops_are_cut() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(-1), x.sum(0)  # two different reduced dims

    regions = form_and_check(f, _r(6, 9))
    assert len(regions) == 2
