"""The kernels' loops with a runtime trip count (`for i in range(n)`, `tl.range(0, n, BLOCK)`) run
under Triton's interpreter as they compile on the GPU: interp.py's fix of Triton 3.6's scalar
__index__ under numpy >= 2.4 (triton#9171) is what lets the CPU tests run them."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE

import solforge.kernels  # noqa: F401  (installs the interpreter fix under TRITON_INTERPRET)


@triton.jit
def _strided_sum_kernel(x_ptr, out_ptr, n, n_chunks, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for off in tl.range(0, n, BLOCK, num_stages=2):  # runtime bound, with a GPU-only option
        cols = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + cols, mask=cols < n, other=0.0)
    for i in range(0, n_chunks):  # plain range, runtime bound: the grid-stride form
        acc += i
    tl.store(out_ptr, tl.sum(acc, axis=0))


@pytest.mark.parametrize("n", [1, 37, 1000])
def test_runtime_bound_loops_run(n: int) -> None:
    x = torch.randn(n, device=DEVICE)
    out = torch.empty(1, device=DEVICE)
    block, chunks = 64, 5
    _strided_sum_kernel[(1,)](x, out, n, chunks, BLOCK=block)
    want = x.double().sum() + block * sum(range(chunks))
    torch.testing.assert_close(out.double()[0], want, rtol=1e-5, atol=1e-4)
