"""kernels/reduce.py: the paired row sums (sum2, sum3) the norm backwards take, and sum_rows, which
adds up their per-program partial weight-gradient rows. Against torch's sums in fp64; the norm
kernels themselves are checked against their autograd references in test_norm_bwd.py,
test_bwd_families.py and test_rope.py."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE

from solforge.kernels.reduce import sum2, sum3, sum_rows


@triton.jit
def _sums_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """Five sums of each of 4 rows of N (masked to BLOCK lanes): sum2(a*a, a*b), sum3(a, b*c, c)."""
    r = tl.arange(0, 4)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    m = cols < N
    a = tl.load(a_ptr + r * N + cols, mask=m, other=0.0)
    b = tl.load(b_ptr + r * N + cols, mask=m, other=0.0)
    c = tl.load(c_ptr + r * N + cols, mask=m, other=0.0)
    s, t = sum2(a * a, a * b, 1)
    u, v, w = sum3(a, b * c, c, 1)
    rows = tl.arange(0, 4)
    tl.store(out_ptr + rows, s)
    tl.store(out_ptr + 4 + rows, t)
    tl.store(out_ptr + 8 + rows, u)
    tl.store(out_ptr + 12 + rows, v)
    tl.store(out_ptr + 16 + rows, w)


@pytest.mark.parametrize("path", ["vectorized", "element-wise"])
def test_paired_sums_equal_separate_sums(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter sum2/sum3 run vectorized (reduce._vectorized_sums); "element-wise" runs
    the interpreter's own reduction, which calls the combine functions themselves (on a GPU both
    cases run the compiled kernel)."""
    if path == "element-wise":
        from triton.runtime import interpreter

        ops = interpreter.ReduceOps
        real = getattr(ops.generic_reduce, "solforge_real", None)
        if real is not None:
            monkeypatch.setattr(ops, "generic_reduce", real)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4, 37, generator=g).to(DEVICE) for _ in range(3))
    out = torch.empty(20, device=DEVICE)
    _sums_kernel[(1,)](a, b, c, out, N=37, BLOCK=64)
    a, b, c = a.double(), b.double(), c.double()
    want = torch.cat([(a * a).sum(1), (a * b).sum(1), a.sum(1), (b * c).sum(1), c.sum(1)])
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, M, bounds", [(132, 2560, (0, 132)), (7, 33, (0, 7)), (300, 100, (0, 211, 300)),
                                              (5, 3, (0, 0, 5)), (130, 200, (3, 65, 130)), (1, 1, (0, 1))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_rows_sums_each_segment_in_its_dtype(rows: int, M: int, bounds: tuple[int, ...],
                                                 dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows + M)
    part = torch.randn(rows, M, generator=g).to(DEVICE)
    n = len(bounds) - 1
    outs = [torch.full((M,), float("nan"), dtype=dtype, device=DEVICE) for _ in range(n)]  # poisoned
    got = sum_rows(part, bounds, outs)
    assert len(got) == n and all(g is o for g, o in zip(got, outs, strict=True))
    want = torch.stack([part[bounds[i]:bounds[i + 1]].double().sum(0) for i in range(n)])
    # fp32: the order of the additions; bf16: plus the one rounding of the fp32 sum to the nearest value
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-4, rtol=2 ** -8)
    torch.testing.assert_close(torch.stack(outs).double(), want, **tol)


def test_sum_rows_outputs_may_differ_in_dtype() -> None:
    part = torch.randn(50, 24, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    a, b = sum_rows(part, (0, 20, 50), (torch.empty(24, device=DEVICE), torch.empty(24, dtype=torch.bfloat16,
                                                                                    device=DEVICE)))
    torch.testing.assert_close(a.double(), part[:20].double().sum(0), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(b.double(), part[20:].double().sum(0), atol=1e-4, rtol=2 ** -8)


def test_sum_rows_is_deterministic() -> None:
    part = torch.randn(257, 300, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    a = sum_rows(part, (0, 257), [torch.empty(300, device=DEVICE)])[0]
    b = sum_rows(part, (0, 257), [torch.empty(300, device=DEVICE)])[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("part, bounds, outs", [
    (torch.zeros(4, 8, dtype=torch.float64), (0, 4), [torch.zeros(8)]),  # not fp32
    (torch.zeros(4, 8).t(), (0, 8), [torch.zeros(4)]),  # not contiguous
    (torch.zeros(4, 8), (0, 5), [torch.zeros(8)]),  # past the last row
    (torch.zeros(4, 8), (2, 1), [torch.zeros(8)]),  # decreasing
    (torch.zeros(4, 8), (0, 1, 2, 4), [torch.zeros(8)] * 3),  # three segments
    (torch.zeros(4, 8), (0, 2, 4), [torch.zeros(8)]),  # one output for two segments
    (torch.zeros(4, 8), (0, 4), [torch.zeros(2, 8)]),  # not (M,)
])
def test_sum_rows_rejects_bad_arguments(part: torch.Tensor, bounds: tuple[int, ...], outs: list[torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="sum_rows"):
        sum_rows(part, bounds, outs)
