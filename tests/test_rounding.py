"""rounding.as_stored against torch's own casts: fp32 -> bf16/fp16 -> fp32, to nearest even, for
random values, exact ties, overflow, infinities and NaNs (in Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE

from solforge.kernels.rounding import as_stored


@triton.jit
def _stored_kernel(x_ptr, y_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, as_stored(tl.load(x_ptr + i, mask=m), DTYPE), mask=m)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty_like(x)
    _stored_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), DTYPE=_TL[dtype], BLOCK=256)
    return y


def _specials() -> torch.Tensor:
    ulp = 2.0 ** -7  # bf16's spacing at 1
    vals = [1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 1 + ulp / 2 + 2.0 ** -20, 3.3895e38, 65519.0, 65520.0,
            1e-30, -0.0, 0.0, float("inf"), float("-inf"), 6e-8, 3e-8]
    x = torch.tensor(vals, dtype=torch.float32)
    odd_nan = torch.tensor([0x7F800001, 0x7FC00000, -0x00000001], dtype=torch.int32).view(torch.float32)
    return torch.cat([x, odd_nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_as_stored_is_torchs_cast(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 10.0 ** torch.randint(-6, 6, (4000,), generator=g),
                   _specials()]).to(DEVICE)
    want = x.to(dtype).to(torch.float32)
    got = _stored(x, dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # -0.0 included
