"""linear_cross_entropy's gradient bookkeeping (kernels/lce_grads.py): the rmw GEMM that adds A^T B
into an fp32 running sum split over two 16-bit planes, against fp32 sums rounded once, at odd
shapes and in every mode; which passes over dweight each variant makes (one GEMM for one chunk,
no zero-fill, no add for the first chunk); rmw through the family's forward in 2 and 3 chunks;
the backward's in-place scaling (skipped at g == 1, redone from the inputs on a second backward).
GPU: every rmw tiling of the space at 1024 x 2560 x 32000, and the family's forward with it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import DEVICE, requires_gpu
from torch.utils._python_dispatch import TorchDispatchMode

from solforge.kernels import lce_grads as G
from solforge.kernels import linear_cross_entropy as L
from solforge.numerics import compare

BF16, FP32 = torch.bfloat16, torch.float32
SMALL = {"bm": 32, "bn": 32, "bk": 16, "stages": 1, "num_warps": 4}


def _products(K: list[int], M: int, N: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(k, M, generator=g).to(BF16).to(DEVICE), torch.randn(k, N, generator=g).to(BF16).to(DEVICE))
            for k in K]


def _run(prods: list[tuple[torch.Tensor, torch.Tensor]], M: int, N: int, **tiles: int | bool) -> torch.Tensor:
    hi = torch.full((M, N), float("nan"), dtype=BF16, device=DEVICE)  # poisoned: every element written
    lo = torch.full((M, N), -1, dtype=torch.int16, device=DEVICE)
    last = len(prods) - 1
    for i, (a, b) in enumerate(prods):
        mode = (G.MODE_ONLY if last == 0 else G.MODE_FIRST) if i == 0 else G.MODE_LAST if i == last else G.MODE_MID
        G.acc_tn(a, b, hi.view(torch.int16), lo, mode, **tiles)
    return hi


@pytest.mark.parametrize("K,preload", [([37], 0), ([16, 21], 0), ([17, 16, 5], 0), ([8, 0, 9], 0), ([17, 16, 5], 1)])
def test_acc_tn_is_the_fp32_sum_rounded_once(K: list[int], preload: int) -> None:
    """M = 75, N = 41 (not multiples of the 32 x 32 tiles: wrapped loads, masked stores), K not a
    multiple of 16 (masked K steps), an empty product in the middle; the running sum added in the
    epilogue or preloaded as the dot's accumulator. The fp32 sum over the
    products, rounded to bf16 once, is the answer up to fp32 summation order: at most a few
    elements one bf16 ulp apart."""
    M, N = 75, 41
    prods = _products(K, M, N)
    got = _run(prods, M, N, **SMALL, preload=bool(preload))
    exact = sum((a.double().T @ b.double() for a, b in prods), torch.zeros(M, N, dtype=torch.float64, device=DEVICE))
    want = exact.float().to(BF16)
    assert torch.isfinite(got.float()).all()
    same = (got == want).float().mean().item()
    assert same > 0.99, same
    ulp = (want.float().abs() * 2.0**-7).clamp_min(1e-30)  # one bf16 ulp, generously
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    # one rounding, not one per product: a per-product bf16 sum is visibly worse
    per_chunk = torch.zeros(M, N, dtype=BF16, device=DEVICE)
    for a, b in prods:
        per_chunk = (per_chunk.float() + (a.float().T @ b.float()).to(BF16).float()).to(BF16)
    err = lambda x: float((x.double() - exact).abs().max())  # noqa: E731
    if len(K) > 1:
        assert err(got) < err(per_chunk)


def test_acc_tn_checks_its_inputs() -> None:
    a, b = _products([4], 8, 6)[0]
    hi = torch.empty(8, 6, dtype=torch.int16, device=DEVICE)
    with pytest.raises(ValueError, match="bf16"):
        G.acc_tn(a.float(), b, hi, hi.clone(), G.MODE_FIRST)
    with pytest.raises(ValueError, match="int16"):
        G.acc_tn(a, b, hi[:, :5], hi.clone(), G.MODE_FIRST)
    lo = torch.full((8, 6), 7, dtype=torch.int16, device=DEVICE)
    G.acc_tn(a[:0], b[:0], hi, lo, G.MODE_FIRST)  # an empty first product: the sum is 0
    assert not hi.any() and not lo.any()


# ---------------------------------------------------------------------------------------------
# through the family's forward


def _wl(N: int, H: int, V: int, *, bias: bool = False, grads: int = 3) -> object:
    m = dict(device="meta", dtype=BF16)
    wl = L.workload_for(torch.empty(N, H, **m), torch.empty(V, H, **m), torch.empty(V, **m) if bias else None,
                        torch.empty(N, dtype=torch.int64, device="meta"), out_dtype=FP32, grads=grads)
    return dataclasses.replace(wl, device=DEVICE)


def _rmw(rows: int) -> L.Config:
    return L.Config("rmw", rows, 64, 1, 32, 32, 16, 1, 4, rows % 2)  # (odd rows: the running sum preloaded)


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
    buffer (no zero-fill, no add), the others a product and an add each, then one cast; "rmw": the
    two planes and nothing else (the Triton GEMM does the rest)."""
    N, H, V = 37, 24, 131
    wl = _wl(N, H, V)
    args, kw = L.make_inputs(wl, seed=0)
    for variant in ("fp32", "native", "rmw"):
        with _Log(V * H) as log:
            L.forward(*args, **kw, config=dataclasses.replace(_rmw(64), variant=variant) if variant == "rmw"
                      else L.Config(variant, 64, 64, 1))
        assert log.ops == ["empty", "mm"], (variant, log.ops)
    with _Log(V * H) as log:
        L.forward(*args, **kw, config=L.Config("fp32", 16, 64, 1))
    assert log.ops[0] == "empty" and log.ops[1] == "mm" and log.ops[-1] == "_to_copy", log.ops
    assert log.ops[2:-1] == ["mm", "add_"] * 2 and "zeros" not in log.ops and "fill" not in log.ops, log.ops
    with _Log(V * H) as log:
        L.forward(*args, **kw, config=_rmw(16))
    # (set_: Triton's interpreter rebinding a kernel argument's storage, not a pass)
    assert [o for o in log.ops if o != "set_"] == ["empty", "empty"], log.ops


@pytest.mark.parametrize("rows", [20, 16, 7])  # 2 chunks (first, last), 3 (a middle one), 6
def test_rmw_through_the_forward(rows: int) -> None:
    """rmw's dweight against the reference (the verifier's tolerances) and against "fp32" (the
    same fp32 sums, cast once: equal but for summation order)."""
    wl = _wl(37, 48, 131, bias=True, grads=7)
    args, kw = L.make_inputs(wl, seed=rows)
    ref = L.linear_cross_entropy_ref(*args, **kw)
    got = L.linear_cross_entropy(*args, config=_rmw(rows), **kw)
    fp32 = L.linear_cross_entropy(*args, config=L.Config("fp32", rows, 64, 1), **kw)
    for name, o, r, tol in zip(("loss", "dhidden", "dweight", "dbias"), got, ref, L.output_tolerance(wl), strict=True):
        c = compare(o, r, tol)
        assert c.ok, (name, c.reason)
    assert torch.equal(got[1], fp32[1]) and torch.equal(got[3], fp32[3])  # (same GEMMs but dweight's)
    assert (got[2] == fp32[2]).float().mean() > 0.99
    assert float((got[2].double() - ref[2].double()).norm() / ref[2].double().norm()) < 5e-3


def test_one_chunk_is_the_same_in_every_variant() -> None:
    """rows >= N: one GEMM per gradient, whatever the variant says, so the outputs are identical;
    and the reference agrees."""
    wl = _wl(29, 40, 77, bias=True, grads=7)
    args, kw = L.make_inputs(wl, seed=5)
    outs = [L.linear_cross_entropy(*args, config=c, **kw)
            for c in (L.Config("fp32", 29, 64, 1), L.Config("native", 64, 64, 1), _rmw(1000))]
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
    loss, *_ = L.linear_cross_entropy_op(x, wr, None, t, -100, "sum", FP32, 3, _rmw(8).encode())
    first = torch.autograd.grad(loss * 3.0, [x, wr], retain_graph=True)
    second = torch.autograd.grad(loss * 3.0, [x, wr])
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# built for Hopper without a GPU (Triton's own ptxas): pipelined, wgmma, registers

_BUILD = r"""
import json, os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from solforge.kernels import lce_grads as G
bm, bn, bk, stages, warps = map(int, sys.argv[1:6])
names = list(G._acc_tn_kernel.arg_names)
const = {"stride_am": 1, "stride_bn": 1, "BM": bm, "BN": bn, "BK": bk, "GROUP": G.GROUP_M, "EVEN_K": True,
         "INTERP": False}
sig = {n: "constexpr" if n in const or n in ("MODE", "PRELOAD") else "i32" for n in names}
sig.update(a_ptr="*bf16", b_ptr="*bf16", hi_ptr="*i16", lo_ptr="*i16")
# what Triton specializes at Qwen3's shapes: pointers 16-byte aligned, every size a multiple of 16
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "constexpr"}
out = {}
for mode, pre in ((0, 0), (1, 0), (1, 1), (2, 0), (2, 1)):
    src = ASTSource(fn=G._acc_tn_kernel, signature=sig, constexprs={**const, "MODE": mode, "PRELOAD": bool(pre)},
                    attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": warps, "num_stages": stages})
    path = os.path.join(sys.argv[6], f"k{mode}{pre}.cubin")
    open(path, "wb").write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    line = next(l for l in res.splitlines() if "REG:" in l)
    regs = int(line.split("REG:")[1].split()[0])
    stack = int(line.split("STACK:")[1].split()[0])
    ttgir = k.asm["ttgir"]
    out[f"{mode}{pre}"] = {"regs": regs, "stack": stack, "shared": k.metadata.shared,
                          "async": ttgir.count("async_copy_global_to_local"), "wgmma": ttgir.count("warp_group_dot")}
print(json.dumps(out))
"""


def test_rmw_builds_for_hopper(tmp_path: object) -> None:
    """The space's first tiling, built for sm_90 in every epilogue mode (a subprocess without the
    interpreter): a software-pipelined main loop (async copies into `stages` buffers: a modulo on
    the tile's indices or an early return in a helper silently removed it once), wgmma, and no
    register spills; the shared memory is what lce_grads.smem_bytes says."""
    import json
    import os
    import subprocess
    import sys

    bm, bn, bk, st, gw = L._TILES[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(G.__file__)))] +
                                        [p for p in [env.get("PYTHONPATH")] if p])
    run = subprocess.run([sys.executable, "-c", _BUILD, *map(str, (bm, bn, bk, st, gw)), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    if run.returncode and "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip("Triton's ptxas is not installed here")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for key, k in got.items():
        assert k["async"] > 0 and k["wgmma"] > 0, (key, k)
        assert k["stack"] == 0 and k["regs"] <= 255, (key, k)
        assert k["shared"] >= G.smem_bytes(bm, bn, bk, st), (key, k)


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes


@requires_gpu
@pytest.mark.parametrize("pre", [0, 1])
@pytest.mark.parametrize("tiles", L._TILES)
def test_rmw_tilings_on_gpu(tiles: tuple[int, int, int, int, int], pre: int) -> None:
    """dweight of a 32000-word head over 1024 rows of H 2560, in chunks of 512, 256 and 256, with
    each tiling of the space (wgmma, pipelining, the grouped order), the running sum read in the
    epilogue or preloaded: the fp32 sum rounded once."""
    bm, bn, bk, st, gw = tiles
    M, N = 32000, 2560
    prods = _products([512, 256, 256], M, N, seed=3)
    got = _run(prods, M, N, bm=bm, bn=bn, bk=bk, stages=st, num_warps=gw, preload=bool(pre))
    exact = sum((a.float().T @ b.float() for a, b in prods), torch.zeros(M, N, device=DEVICE))
    want = exact.to(BF16)
    assert torch.isfinite(got.float()).all()
    assert (got == want).float().mean().item() > 0.99
    assert bool(((got.float() - want.float()).abs() <= want.float().abs() * 2.0**-7 + 1e-6).all())


@requires_gpu
def test_rmw_forward_on_gpu() -> None:
    """The family at 1024 x 2560 x 32000 in 4 chunks of 256 with rmw (every tiling), against the
    reference, with its dweight and low plane the only V x H memory."""
    wl = _wl(1024, 2560, 32000)
    for (bm, bn, bk, st, gw), pre in itertools.product(L._TILES, (0, 1)):
        c = L.Config("rmw", 256, 8192, 16, bm, bn, bk, st, gw, pre)
        assert L.is_valid(c, wl)
        args, kw = L.make_inputs(wl, seed=bm + bn + st)
        ref = L.linear_cross_entropy_ref(*args, **kw)
        got = L.linear_cross_entropy(*args, config=c, **kw)
        for name, o, r, tol in zip(("loss", "dhidden", "dweight"), got, ref, L.output_tolerance(wl), strict=True):
            cmp = compare(o, r, tol)
            assert cmp.ok, (c.encode(), name, cmp.reason)
