"""linear_cross_entropy's gradient bookkeeping (kernels/lce_grads.py): which passes over dweight
each variant makes (one GEMM for one chunk, no zero-fill, no add for the first chunk), the "fp32"
products formed in slices (one alive at a time, the chunk buffer freed before the final cast, as
lce_model.peak_bytes counts), and the backward's in-place scaling (skipped at g == 1, redone from
the inputs on a second backward)."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from conftest import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode

from solforge.kernels import lce_model
from solforge.kernels import linear_cross_entropy as L
from solforge.numerics import compare

BF16, FP32 = torch.bfloat16, torch.float32


def _wl(N: int, H: int, V: int, *, bias: bool = False, grads: int = 3) -> object:
    m = dict(device="meta", dtype=BF16)
    wl = L.workload_for(torch.empty(N, H, **m), torch.empty(V, H, **m), torch.empty(V, **m) if bias else None,
                        torch.empty(N, dtype=torch.int64, device="meta"), out_dtype=FP32, grads=grads)
    return dataclasses.replace(wl, device=DEVICE)


class _Log(TorchDispatchMode):
    """The name of every ATen op (views aside) that returns a tensor of `numel` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and not func.is_view:
                self.ops.append(func.__name__.split(".")[0])
        return out


def test_passes_over_dweight() -> None:
    """Which ATen ops produce a V x H tensor: one chunk, in any variant: one empty and one mm (the
    GEMM rounds once, into dweight); "fp32" in 3 chunks: the first chunk's mm writes the fp32
    buffer (no zero-fill, no add), the others a product and an add each, then one cast; "native"
    in 3 chunks: one mm, then an addmm_ per chunk."""
    N, H, V = 37, 24, 131
    wl = _wl(N, H, V)
    args, kw = L.make_inputs(wl, seed=0)
    for variant in ("fp32", "native"):
        with _Log(V * H) as log:
            L.forward(*args, **kw, config=L.Config(variant, 64, 64, 1))
        assert log.ops == ["empty", "mm"], (variant, log.ops)
    with _Log(V * H) as log:
        L.forward(*args, **kw, config=L.Config("fp32", 16, 64, 1))
    assert log.ops[0] == "empty" and log.ops[1] == "mm" and log.ops[-1] == "_to_copy", log.ops
    assert log.ops[2:-1] == ["mm", "add_"] * 2 and "zeros" not in log.ops and "fill" not in log.ops, log.ops
    with _Log(V * H) as log:
        L.forward(*args, **kw, config=L.Config("native", 16, 64, 1))
    assert log.ops == ["empty", "mm", "addmm_", "addmm_"], log.ops


class _Slices(TorchDispatchMode):
    """The element counts of the mm outputs, and whether the (rows, V) chunk buffer is still alive
    when dweight's fp32 buffer is cast."""

    def __init__(self, buf_numel: int, vh: int) -> None:
        super().__init__()
        self.buf_numel, self.vh = buf_numel, vh
        self.mms: list[int] = []
        self.buf: weakref.ref | None = None
        self.buf_alive_at_cast: bool | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.__name__.split(".")[0]
        if name == "_to_copy" and args[0].numel() == self.vh:
            self.buf_alive_at_cast = self.buf is not None and self.buf() is not None
        out = func(*args, **(kwargs or {}))
        if name == "empty" and out.numel() == self.buf_numel:
            self.buf = weakref.ref(out)
        if name == "mm":
            self.mms.append(out.numel())
        return out


def test_fp32_products_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """"fp32" in 3 chunks with slices of 4 rows of dweight (V = 131: 33 slices, the last of 3 rows):
    the later chunks' products are formed slice by slice, none bigger than a slice; dweight is the
    unsliced one's (the same fp32 products, added per element) and the reference's; and the chunk
    buffer is gone before the final cast (a view of it once kept it alive: 0.51 GB above the cost
    model on the H100)."""
    N, H, V, rows = 37, 24, 131, 16
    wl = _wl(N, H, V)
    args, kw = L.make_inputs(wl, seed=4)
    c = L.Config("fp32", rows, 64, 1)
    whole = L.linear_cross_entropy(*args, config=c, **kw)
    monkeypatch.setattr(lce_model, "F32_SLICE_BYTES", 4 * 4 * H)
    with _Slices(rows * V, V * H) as mode:
        got = L.linear_cross_entropy(*args, config=c, **kw)
    assert mode.buf is not None and mode.buf_alive_at_cast is False
    dw_mms = [n for n in mode.mms if n not in (rows * V, (N - 2 * rows) * V, rows * H, (N - 2 * rows) * H)]
    assert dw_mms[0] == V * H and sorted(dw_mms[1:]) == sorted([4 * H] * 32 * 2 + [3 * H] * 2), dw_mms
    assert torch.equal(got[1], whole[1])
    assert (got[2] == whole[2]).float().mean() > 0.99
    ref = L.linear_cross_entropy_ref(*args, **kw)
    for name, o, r, tol in zip(("loss", "dhidden", "dweight"), got, ref, L.output_tolerance(wl), strict=True):
        res = compare(o, r, tol)
        assert res.ok, (name, res.reason)


def test_one_chunk_is_the_same_in_every_variant() -> None:
    """rows >= N: one GEMM per gradient, whatever the variant says, so the outputs are identical;
    and the reference agrees."""
    wl = _wl(29, 40, 77, bias=True, grads=7)
    args, kw = L.make_inputs(wl, seed=5)
    outs = [L.linear_cross_entropy(*args, config=c, **kw)
            for c in (L.Config("fp32", 29, 64, 1), L.Config("native", 64, 64, 1))]
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0], strict=True))
    ref = L.linear_cross_entropy_ref(*args, **kw)
    for o, r, tol in zip(outs[0], ref, L.output_tolerance(wl), strict=True):
        assert compare(o, r, tol).ok


# ---------------------------------------------------------------------------------------------
# the backward's scaling


def _leaves(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(19, 24, generator=g)).to(BF16).to(DEVICE)
    w = (torch.randn(53, 24, generator=g) / 5).to(BF16).to(DEVICE)
    t = torch.randint(0, 53, (19,), generator=g).to(DEVICE)
    t[::4] = -100
    return h, w, t


def test_backward_scales_in_place_and_skips_one() -> None:
    h, w, t = _leaves()
    x, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, dh, dw, _db = L.linear_cross_entropy_op(x, wr, None, t, -100, "mean", FP32, 3, "fp32:r=8:b=64:w=1")
    dh0, dw0 = dh.clone(), dw.clone()
    loss.backward()  # g == 1: the saved gradients are the gradients, untouched
    assert x.grad is not None and wr.grad is not None
    assert torch.equal(x.grad, dh0) and torch.equal(wr.grad, dw0) and torch.equal(dw, dw0)
    x.grad = wr.grad = None
    loss, dh, dw, _db = L.linear_cross_entropy_op(x, wr, None, t, -100, "mean", FP32, 3, "fp32:r=8:b=64:w=1")
    dh0, dw0 = dh.clone(), dw.clone()
    (loss * 2.5).backward()  # scaled in place, rounded to bf16 as `dw * 2.5` rounds
    assert torch.equal(x.grad, dh0 * torch.tensor(2.5)) and torch.equal(wr.grad, dw0 * torch.tensor(2.5))


def test_second_backward_recomputes() -> None:
    """retain_graph: the first backward scaled the saved gradients in place; the second must not
    scale them again (it recomputes them from the saved inputs)."""
    h, w, t = _leaves(1)
    x, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, *_ = L.linear_cross_entropy_op(x, wr, None, t, -100, "sum", FP32, 3, "fp32:r=8:b=64:w=1")
    first = torch.autograd.grad(loss * 3.0, [x, wr], retain_graph=True)
    second = torch.autograd.grad(loss * 3.0, [x, wr])
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
