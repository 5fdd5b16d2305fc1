"""add_rmsnorm family and the RMSNorm backward: forward against add_rmsnorm_ref for every config
of the space, the backward kernel against autograd through the reference, and autograd through the
custom ops (the residual stream's gradient joins the norm's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, alternating, covering, requires_gpu

from solforge.kernels import add_rmsnorm as A
from solforge.kernels import rmsnorm as R
from solforge.kernels.rmsnorm_bwd import BwdConfig, rmsnorm_bwd, rmsnorm_bwd_ref
from solforge.numerics import compare, tolerance
from solforge.records import Workload

BF16, FP32 = torch.bfloat16, torch.float32
EPS = 1e-6


def _wl(rows: int, H: int, dtype: torch.dtype = BF16, rbw: bool = True) -> Workload:
    x = torch.empty(rows, H, dtype=dtype, device="meta")
    w = torch.empty(H, dtype=dtype, device="meta")
    return dataclasses.replace(A.workload_for(x, x, w, EPS, None, rbw), device=DEVICE)


def _check(wl: Workload, config: A.Config | None = None, rows: int | None = None, seed: int = 0) -> None:
    (x, r, w, eps), kw = A.make_inputs(wl, seed=seed, rows=rows)
    before = (x.clone(), r.clone())
    rs, ry = A.add_rmsnorm_ref(x, r, w, eps, **kw)
    out = (torch.full_like(rs, float("nan")), torch.full_like(ry, float("nan")))
    got = A.add_rmsnorm(x, r, w, eps, config=config, out=out, **kw)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])
    label = config.encode() if config else "heuristic"
    # the sum is one rounding of an fp32 add, as the model's own add: exact, on the interpreter
    # too (its bf16 cast truncates; the kernel rounds to nearest first there). Before, a quarter
    # of the sums were one ulp off on the CPU, and a tiny Llama's add_rmsnorm failed its check.
    assert torch.equal(out[0], rs), label
    c = compare(out[1], ry, A.output_tolerance(wl))
    assert c.ok, f"{label} on {wl.key}: {c.reason}"


@pytest.mark.parametrize("rows,H", [(33, 96), (5, 2560)])
def test_every_config_in_space(rows: int, H: int) -> None:
    wl = _wl(rows, H)
    configs = A.space(wl)
    assert configs and all(c.variant in A.VARIANTS and A.is_valid(c, wl) for c in configs)
    # the whole space on a GPU; through the interpreter a covering sample: every variant, block split,
    # rows and evict value (the warps only size the same program's work)
    for c in covering(configs, ignore=("num_warps",)):
        _check(wl, c)


@pytest.mark.parametrize("dtype,rbw", [(BF16, True), (BF16, False), (FP32, False)])
def test_heuristic_odd_shapes(dtype: torch.dtype, rbw: bool) -> None:
    for rows, H in [(1, 64), (7, 130), (3, 1000)]:
        _check(_wl(rows, H, dtype, rbw), seed=rows)


def test_heuristic_always_valid_and_long_rows_refused() -> None:
    for rows, H in [(1, 2560), (16384, 2560), (524288, 128), (4, 32768), (2, 70000)]:
        wl = _wl(rows, H)
        assert A.is_valid(A.heuristic(wl), wl) == A.supported(wl)
    assert A.supported(_wl(4, 32768)) and not A.supported(_wl(2, 70000))


def test_verifier_accepts_the_family() -> None:
    from solforge.tune import candidates, measure

    wl = _wl(9, 80)
    rec = measure(A, candidates(A, wl)[0], device=DEVICE)
    assert rec.ok, rec.error


def test_bad_inputs() -> None:
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        A.add_rmsnorm(x, torch.randn(4, 9, device=DEVICE), None, EPS)
    with pytest.raises(ValueError, match="weight"):
        A.add_rmsnorm(x, x, torch.ones(9, device=DEVICE), EPS)


# ---------------------------------------------------------------------------------------------
# backward


BWD_CASES = [((5, 48), True, False, True), ((3, 7, 130), True, True, False), ((9, 64), False, True, False),
             ((4, 200), True, True, True)]


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("shape,weight,ds,rbw", BWD_CASES)
def test_backward_kernel(dtype: torch.dtype, shape: tuple[int, ...], weight: bool, ds: bool, rbw: bool) -> None:
    g = torch.Generator().manual_seed(len(shape))
    x, dy = (torch.randn(*shape, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE) if weight else None
    dsx = torch.randn(*shape, generator=g).to(dtype).to(DEVICE) if ds else None
    # heuristic; loops of several tiles (4 fake SMs); the main block + tail split (130 = 128 + 2,
    # 200 = 128 + a masked 128), the next tile loaded ahead, evict_first loads. Every config at both
    # dtypes on a GPU; through the interpreter the heuristic at both and the others alternate between
    # the two dtypes, and between shapes, so each config runs at each shape and at each dtype
    cfgs = (None, BwdConfig(2, 1, 1), BwdConfig(1, 1, 2), BwdConfig(2, 1, 1, split=1, stages=2),
            BwdConfig(1, 1, 2, split=1, evict=1), BwdConfig(4, 1, 1, stages=2))
    turn = [c[0] for c in BWD_CASES].index(shape) + (dtype == FP32)
    for cfg in alternating(cfgs, turn):
        dx, *dw = rmsnorm_bwd(dy, x, w, EPS, round_before_weight=rbw, ds=dsx, config=cfg)
        rdx, *rdw = rmsnorm_bwd_ref(dy, x, w, EPS, round_before_weight=rbw, ds=dsx)
        assert dx.dtype == rdx.dtype == dtype
        c = compare(dx, rdx)
        assert c.ok, c.reason
        assert len(dw) == len(rdw) == int(weight)  # (dx, dw) with a weight, (dx,) without
        if weight:
            assert dw[0].dtype == rdw[0].dtype == FP32
            # dw sums over rows in fp32: compare relative to its scale
            assert (dw[0] - rdw[0]).abs().max() <= 10 * tolerance(dtype).rtol * rdw[0].abs().max()


def test_autograd_through_the_ops() -> None:
    torch.manual_seed(0)
    x, r, dy, ds = (torch.randn(6, 72, device=DEVICE) for _ in range(4))
    w = 1 + 0.1 * torch.randn(72, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    s, y = A.add_rmsnorm_op(*leaves, EPS, FP32, False, "")
    torch.autograd.backward([s, y], [ds, dy])
    refs = [t.clone().requires_grad_() for t in (x, r, w)]
    s2 = refs[0] + refs[1]
    y2 = s2 * torch.rsqrt(s2.pow(2).mean(-1, keepdim=True) + EPS) * refs[2]
    torch.autograd.backward([s2, y2], [ds, dy])
    for a, b in zip(leaves, refs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    # only the normalized output used: the sum's gradient is None inside the formula
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    A.add_rmsnorm_op(*leaves, EPS, FP32, False, "")[1].backward(dy)
    refs = [t.clone().requires_grad_() for t in (x, r, w)]
    s2 = refs[0] + refs[1]
    (s2 * torch.rsqrt(s2.pow(2).mean(-1, keepdim=True) + EPS) * refs[2]).backward(dy)
    for a, b in zip(leaves, refs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    # and the rmsnorm op has the same backward
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    R.rmsnorm_op(xl, wl, EPS, FP32, False, "").backward(dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + EPS) * wr).backward(dy)
    torch.testing.assert_close(xl.grad, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wl.grad, wr.grad, atol=1e-5, rtol=1e-5)


@requires_gpu
@pytest.mark.parametrize("rows,H", [(16384, 2560), (4096, 2560)])
def test_qwen3_shapes_on_gpu(rows: int, H: int) -> None:
    wl = _wl(rows, H)
    _check(wl)
    g = torch.Generator().manual_seed(1)
    x, dy, ds = (torch.randn(rows, H, generator=g).to(BF16).cuda() for _ in range(3))
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(BF16).cuda()
    dx, dw = rmsnorm_bwd(dy, x, w, EPS, round_before_weight=True, ds=ds)
    rdx, rdw = rmsnorm_bwd_ref(dy, x, w, EPS, round_before_weight=True, ds=ds)
    assert compare(dx, rdx).ok
    assert (dw - rdw).abs().max() <= 1e-2 * rdw.abs().max()


# ---------------------------------------------------------------------------------------------
# matching and integration


class Block(torch.nn.Module):
    """A pre-norm residual block as transformers writes it: the sum is the next residual."""

    def __init__(self, h: int, broadcast: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(h, h, bias=False)
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(h))
        self.broadcast = broadcast

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = x
        for _ in range(2):
            delta = self.lin(self.norm(res))
            res = res + (delta[:, :1] if self.broadcast else delta)
        return self.norm(res) + res


def _plan(m: torch.nn.Module, x: torch.Tensor) -> list:
    from solforge import capture, plan

    with torch.no_grad():
        return plan.plan(capture.capture(m, (x,)).graphs)


def test_residual_adds_fuse_and_the_model_computes_the_same() -> None:
    from solforge.integrate import integrate

    torch.manual_seed(0)
    m = Block(64).to(BF16).to(DEVICE).eval()
    x = torch.randn(3, 5, 64, dtype=BF16, device=DEVICE)
    fams = sorted((g.workload.family, g.count) for g in _plan(m, x))
    assert fams == [("add_rmsnorm", 2), ("rmsnorm", 1)]  # the first norm reads the input: no add
    opt, stats = integrate(m, {})
    with torch.no_grad():
        y, ref = opt(x), m(x)
    assert sum(stats.untuned.values()) == 3
    # bf16 through three norms and two linears (the interpreter's bf16 casts truncate): compare as
    # the end-to-end check does, by norm; a wrong residual or a dropped add is off by ~100%
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_broadcast_add_is_not_fused() -> None:
    m = Block(32, broadcast=True).eval()
    fams = {g.workload.family for g in _plan(m, torch.randn(2, 4, 32))}
    assert fams == {"rmsnorm"}


def test_qwen3_tiny_regions() -> None:
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device="cpu", dtype=BF16, batch=1, seq=8, weights=None, seed=0)
    groups = _plan(lm.model, *lm.example_inputs)
    adds = [g for g in groups if g.workload.family == "add_rmsnorm"]
    assert sum(g.count for g in adds) == 4
    modules = {r.module for g in adds for r in g.regions}
    assert {"model.layers.0.post_attention_layernorm", "model.layers.1.input_layernorm", "model.norm"} <= modules


def test_backward_config_strings() -> None:
    # the first configs' strings (before the split, stages and evict knobs) decode to the same kernel
    assert BwdConfig.decode("bwd:r=2:p=2:w=4") == BwdConfig(2, 2, 4)
    c = BwdConfig(1, 4, 8, split=1, stages=2, evict=1)
    assert c.encode() == "bwd:r=1:p=4:w=8:t=1:s=2:e=1" and BwdConfig.decode(c.encode()) == c
    # the tail: the power of two past the main block, widened to one pass of its layout (8 bf16 or 4
    # fp32 values x 32 lanes x warps); as wide as the main block means no split
    split = BwdConfig(split=1)
    assert BwdConfig(split=1, num_warps=2).blocks(2560) == (2048, 512) and split.blocks(3000) == (2048, 1024)
    assert split.blocks(2560) == (2048, 1024) and split.blocks(2560, vec=4) == (2048, 512)
    assert BwdConfig(split=1, num_warps=8).blocks(2560) == (4096, 0)
    assert BwdConfig(split=1, num_warps=1).blocks(768) == (512, 256)
    assert BwdConfig(split=1).blocks(128) == (128, 0) and BwdConfig().blocks(2560) == (4096, 0)
    with pytest.raises(ValueError, match="backward config"):
        BwdConfig.decode("bwd:r=1:q=2")
