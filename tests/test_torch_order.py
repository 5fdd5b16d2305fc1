"""The norms' statistic in torch's order (solforge/kernels/torch_order.py).

On the CPU, through Triton's interpreter: the kernels' sums against `sumsq_ref`, the emulation of
ATen's CUDA reduce order that tools/reduce_order_probe.py matched bit for bit against torch 2.11
on an H100, and the norms' outputs against eager's formula with that order. On a GPU: the norms'
outputs against eager PyTorch itself, bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from solforge.kernels.add_rmsnorm import add_rmsnorm
from solforge.kernels.rmsnorm import Config, rmsnorm
from solforge.kernels.rope import rope
from solforge.kernels.torch_order import row_sumsq, sumsq_ref, torch_sum_width

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not INTERP, reason="Triton needs a GPU or TRITON_INTERPRET=1")


@pytest.mark.parametrize(("rows", "n", "width"), [
    (4096, 2560, 32), (16384, 2560, 32), (524288, 128, 32), (16, 2560, 32), (7, 2560, 128), (2, 2560, 256),
    (1, 2560, 512), (300, 896, 32), (4096, 1536, 32), (8, 128, 32),
    (1024, 8192, 0),  # torch splits these rows across warps: another order
    (100, 64, 0), (100, 130, 0),  # not vectorized by 4
])
def test_the_width_is_torchs_block_width(rows: int, n: int, width: int) -> None:
    """The first ten are the widths tools/reduce_order_probe.py's configuration gave for shapes
    whose emulated sums matched torch's on an H100 (2026-11-26), or follow from the same rule."""
    assert torch_sum_width(rows, n) == width


def test_the_reference_order_is_not_a_plain_sum() -> None:
    """The emulation is an order of its own: on random rows it differs from a sequential sum."""
    sq = torch.randn(256, 2560, generator=torch.Generator().manual_seed(0)).pow(2)
    ref = sumsq_ref(sq, 32)
    seq = sq[:, 0].clone()
    for j in range(1, 2560):
        seq = seq + sq[:, j]
    assert (ref.view(torch.int32) != seq.view(torch.int32)).any()
    torch.testing.assert_close(ref, sq.double().sum(-1).float(), rtol=1e-5, atol=0)


@triton.jit
def _sums_kernel(x_ptr, r_ptr, o_ptr, n_rows, H, sx, sr, ROWS: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
                 ADD: tl.constexpr, S_DTYPE: tl.constexpr):
    row0 = tl.program_id(0) * ROWS
    ss = row_sumsq(x_ptr, r_ptr, row0, n_rows, H, sx, sr, ROWS, W, K, ADD, S_DTYPE)
    rows = row0 + tl.arange(0, ROWS)
    tl.store(o_ptr + rows, ss, mask=rows < n_rows)


@needs_triton
@pytest.mark.parametrize(("rows", "n"), [(16, 2560), (3, 2560), (1, 640), (20, 128), (5, 896), (17, 1536)])
@pytest.mark.parametrize("add", [False, True], ids=["x", "x+r"])
def test_row_sums_are_the_reference_order_bit_for_bit(rows: int, n: int, add: bool) -> None:
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(rows, n, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch_sum_width(rows, n)
    s = x + r if add else x
    out = torch.empty(rows, device=DEVICE)
    _sums_kernel[(triton.cdiv(rows, 2),)](x, r, out, rows, n, x.stride(0), r.stride(0), ROWS=2, W=w,
                                          K=triton.cdiv(n, 4 * w), ADD=add, S_DTYPE=tl.bfloat16)
    want = sumsq_ref(s.float().pow(2), w)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def _eager_norm(x: torch.Tensor, w: torch.Tensor, eps: float, emulate: bool) -> torch.Tensor:
    """Qwen3's RMSNorm as transformers writes it; with `emulate`, its mean taken in torch's CUDA
    order by the reference (for the CPU, whose torch sums in another order)."""
    h = x.float()
    if emulate:
        n = x.shape[-1]
        rows = x.numel() // n
        ss = sumsq_ref(h.reshape(rows, n).pow(2), torch_sum_width(rows, n)).reshape(*x.shape[:-1], 1)
        factor = torch.tensor(float(rows)) / torch.tensor(float(rows * n))
        var = ss * factor.to(x.device)
    else:
        var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + eps)).to(x.dtype)


_SHAPES = [(16, 2560), (3, 2560), (2, 5, 896), (20, 128)]
_GPU_SHAPES = [(4096, 2560), (2, 8192, 2560), (1, 2560), (7, 2560), (300, 896), (64, 4096)]


@needs_triton
@pytest.mark.parametrize("shape", _GPU_SHAPES if DEVICE == "cuda" else _SHAPES, ids=str)
def test_rmsnorm_and_add_rmsnorm_are_eagers_bit_for_bit(shape: tuple[int, ...]) -> None:
    """Every output element equal to eager's: the statistic in torch's order, then eager's
    roundings (2026-11-26). On a GPU against eager PyTorch itself."""
    g = torch.Generator().manual_seed(len(shape) * shape[-1])
    x = torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(torch.bfloat16).to(DEVICE)
    emulate = DEVICE == "cpu"
    y = rmsnorm(x, w, 1e-6, round_before_weight=True)
    assert torch.equal(y, _eager_norm(x, w, 1e-6, emulate))
    s, y2 = add_rmsnorm(x, r, w, 1e-6, round_before_weight=True)
    assert torch.equal(s, x + r)
    assert torch.equal(y2, _eager_norm(x + r, w, 1e-6, emulate))


@needs_triton
@pytest.mark.skipif(DEVICE != "cuda", reason="a search over every variant: the GPU's")
def test_every_rmsnorm_tile_config_is_eagers_bit_for_bit() -> None:
    """The statistic does not depend on the tile a config loads: each valid config of the
    heuristic's space gives eager's output."""
    from solforge.kernels.rmsnorm import is_valid, space, workload_for

    x = torch.randn(4096, 2560, device="cuda").to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(2560, device="cuda")).to(torch.bfloat16)
    want = _eager_norm(x, w, 1e-6, False)
    wl = workload_for(x, w, 1e-6, torch.bfloat16, True)
    configs = [c for c in space(wl) if c.variant in ("row", "rows", "persist") and is_valid(c, wl)]
    assert configs
    for c in configs:
        assert isinstance(c, Config)
        assert torch.equal(rmsnorm(x, w, 1e-6, round_before_weight=True, config=c), want), c.encode()


@needs_triton
def test_rope_q_k_norm_of_a_128_head_is_eagers_statistic() -> None:
    """Qwen3's q/k norm (head 128) inside the rope kernel: the normalized, weighted heads equal
    eager's bit for bit, so the rotation's inputs do (its own arithmetic is eager's: test_rope)."""
    B, S, Hq, Hk, D = 2, 24, 4, 2, 128
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, S, Hq, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(B, S, Hk, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    cos = torch.ones(1, S, D, dtype=torch.bfloat16, device=DEVICE)  # rotation by 0: the norm alone
    sin = torch.zeros(1, S, D, dtype=torch.bfloat16, device=DEVICE)
    qw = (torch.rand(D, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    kw = (torch.rand(D, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    got = rope(q, k, cos, sin, qw, kw, 1e-6, norm=True, round_before_weight=True, heads_first=True)
    for out, x, w in zip(got, (q, k), (qw, kw), strict=True):
        want = _eager_norm(x, w, 1e-6, DEVICE == "cpu").transpose(1, 2)
        assert torch.equal(out, want)


def test_the_switch_turns_the_order_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """SOLFORGE_TORCH_ORDER=0 (read at import): no width, so the row kernels sum with tl.sum."""
    from solforge.kernels import torch_order

    monkeypatch.setattr(torch_order, "ENABLED", False)
    assert torch_sum_width(4096, 2560) == 0
