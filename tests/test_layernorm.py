"""layernorm and add_layernorm families: forward against the references for every config of the
space, odd shapes, with and without weight/bias; the backward kernel against autograd through the
reference; autograd through the custom ops; the verifier; matching and integration of the forms
nn.LayerNorm / F.layer_norm take after capture."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE, FULL_SWEEPS, alternating, covering, requires_gpu

from solforge.kernels import add_layernorm as A
from solforge.kernels import layernorm as L
from solforge.kernels.rmsnorm_bwd import BwdConfig as RmsBwdConfig
from solforge.numerics import compare, tolerance
from solforge.records import Workload

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-5


def _wl(rows: int, H: int, dtype: torch.dtype = BF16, *, weight: bool = True, bias: bool = True,
        residual: bool = False, pdtype: torch.dtype | None = None) -> Workload:
    meta = dict(device="meta")
    x = torch.empty(rows, H, dtype=dtype, **meta)
    w = torch.empty(H, dtype=pdtype or dtype, **meta) if weight else None
    b = torch.empty(H, dtype=pdtype or dtype, **meta) if bias else None
    wl = A.workload_for(x, x, w, b, EPS) if residual else L.workload_for(x, w, b, EPS)
    return dataclasses.replace(wl, device=DEVICE)


def _check(wl: Workload, config: L.Config | None = None, rows: int | None = None, seed: int = 0) -> None:
    fam = A if wl.family == "add_layernorm" else L
    args, kw = fam.make_inputs(wl, seed=seed, rows=rows)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    label = f"{config.encode() if config else 'heuristic'} on {wl.key}"
    if fam is A:
        rs, ry = A.add_layernorm_ref(*args, **kw)
        out = (torch.full_like(rs, float("nan")), torch.full_like(ry, float("nan")))
        got = A.add_layernorm(*args, config=config, out=out, **kw)
        assert got[0] is out[0] and got[1] is out[1]
        # the sum is one rounding of an fp32 add, as the model's own add (on the interpreter too)
        assert torch.equal(out[0], rs), label
        y, ref = out[1], ry
    else:
        ref = L.layernorm_ref(*args, **kw)
        y = torch.full_like(ref, float("nan"))
        assert L.layernorm(*args, config=config, out=y, **kw) is y
    for a, b in zip(args, before, strict=True):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b), f"{label}: an input was modified"
    c = compare(y, ref)
    assert c.ok, f"{label}: {c.reason}"


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows,H", [(37, 96), (5, 200), (3, 80)])
def test_every_config_in_space(rows: int, H: int, residual: bool) -> None:
    wl = _wl(rows, H, residual=residual)
    configs = L.space(wl)
    assert len(configs) >= 6 and len(set(configs)) == len(configs)
    assert {c.variant for c in configs} == {"row", "rows"} and all(L.is_valid(c, wl) for c in configs)
    # 96 = 64 + 32 and 80 = 64 + 16 are split into a main block and a tail; 200 (-> 256) is not
    assert any(c.block_t for c in configs) is (H != 200)
    for c in covering(configs, ignore=("num_warps",)):  # the whole space on a GPU (warps size the same work)
        _check(wl, c)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("rows,H", [(3, 1000), (2, 4096), (5, 777), (1, 33)])
def test_split_variant_every_chunking(rows: int, H: int, dtype: torch.dtype) -> None:
    """Rows cut into chunks of 32 to 1024 values (one chunk, an even cut, a ragged last chunk),
    with and without weight and bias: the statistics combined across chunks are the row's."""
    affine = ((True, True), (False, False), (True, False))
    chunks = ((32, 1), (64, 1), (128, 2), (256, 4), (1024, 4))
    # every chunking with every weight/bias choice on a GPU; through the interpreter each chunking
    # once and each choice at least once (the chunk loop and the affine step are separate code)
    pairs = [(a, c) for a in affine for c in chunks] if FULL_SWEEPS else \
        [(affine[i % len(affine)], c) for i, c in enumerate(chunks)]
    # and the chunkings alternate between the two dtypes there: each runs at every shape, in one of them
    turn = [(3, 1000), (2, 4096), (5, 777), (1, 33)].index((rows, H)) + (dtype == BF16)
    for (weight, bias), (chunk, warps) in alternating(pairs, turn, keep=0):
        wl = _wl(rows, H, dtype=dtype, weight=weight, bias=bias)
        c = L.Config("split", chunk, 0, 1, warps)
        assert L.is_valid(c, wl), c
        _check(wl, c)


def test_split_variant_configs_and_heuristic() -> None:
    """Rows past the row kernels' 64K: the heuristic and the whole space are split configs; none
    with a residual; a config the norm kernel cannot combine (over 4096 chunks) is invalid."""
    long = _wl(16, 64 * 256 * 256)  # KernelBench's LayerNorm over (64, 256, 256)
    h = L.heuristic(long)
    assert h.variant == "split" and L.is_valid(h, long) and L.supported(long) and not L.trainable(long)
    space = L.space(long)
    assert len(space) >= 6 and {c.variant for c in space} == {"split"} and h in space
    assert L.Config.decode(h.encode()) == h
    assert not L.is_valid(L.Config("split", 8192, 0, 1, 8), _wl(16, 1 << 25, residual=True))
    assert not L.is_valid(L.Config("split", 1024, 0, 1, 4), _wl(2, 1024 * 4097))
    assert not L.is_valid(L.Config("split", 1024, 512, 1, 4), _wl(2, 4096))  # no tail
    mid = _wl(8, 32768)  # both kinds in the space: the tuner decides
    assert {c.variant for c in L.space(mid)} >= {"row", "split"}
    assert L.trainable(_wl(8, 2560)) and L.trainable(_wl(8, 32768))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype,weight,bias", [(BF16, True, True), (BF16, True, False), (BF16, False, False),
                                               (FP32, True, True), (FP32, False, True), (FP16, True, True)])
def test_heuristic_odd_shapes(dtype: torch.dtype, weight: bool, bias: bool, residual: bool) -> None:
    for rows, H in [(1, 64), (7, 130), (3, 1000), (2, 1)]:
        _check(_wl(rows, H, dtype, weight=weight, bias=bias, residual=residual), seed=rows)


def test_mixed_dtypes_and_views() -> None:
    """bf16 x with fp32 weight/bias and fp32 output; 3-D input and a strided (sliced) one."""
    wl = dataclasses.replace(_wl(9, 48, BF16, pdtype=FP32), params=_wl(9, 48, BF16, pdtype=FP32).params)
    (x, w, b, eps), _ = L.make_inputs(wl, seed=3)
    y = L.layernorm(x, w, b, eps, out_dtype=FP32)
    assert y.dtype == FP32 and compare(y, L.layernorm_ref(x, w, b, eps, out_dtype=FP32), tolerance(BF16)).ok
    wide = torch.randn(3, 5, 80, device=DEVICE) * 3 + 1
    xs = wide[..., 10:58]  # rows addressed with a stride of 80
    y = L.layernorm(xs, w.float(), None, EPS)
    assert compare(y, L.layernorm_ref(xs, w.float(), None, EPS)).ok
    torch.testing.assert_close(y, F.layer_norm(xs, (48,), w.float(), None, EPS), atol=1e-5, rtol=1e-5)


def test_supported_row_lengths() -> None:
    for rows, H, residual, ok in [(4, 65536, False, True), (2, 70000, False, True), (4, 32768, True, True),
                                  (2, 40000, True, False), (16384, 2560, True, True), (1, 768, False, True)]:
        wl = _wl(rows, H, residual=residual)
        assert L.supported(wl) is ok, (rows, H, residual)
        assert L.is_valid(L.heuristic(wl), wl) is ok


def test_config_text_round_trips() -> None:
    for c in L.space(_wl(33, 768)):
        assert L.Config.decode(c.encode()) == c
    with pytest.raises(ValueError, match="layernorm"):
        L.Config.decode("loop:bh=1024")


@pytest.mark.parametrize("residual", [False, True])
def test_verifier_accepts_the_family(residual: bool) -> None:
    from solforge.tune import candidates, family_module, measure

    wl = _wl(9, 80, residual=residual)
    fam = family_module(wl.family)
    rec = measure(fam, candidates(fam, wl)[0], device=DEVICE)
    assert rec.ok, rec.error


def test_verifier_rejects_a_wrong_kernel() -> None:
    from solforge.tune.verify import verify

    wl = _wl(9, 80)

    def no_centering(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float, **kw: object) -> None:
        out = kw.pop("out")
        out.copy_(F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps) + b.float())  # type: ignore[union-attr]

    assert not verify(L, wl, no_centering).passed


def test_bad_inputs() -> None:
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        A.add_layernorm(x, torch.randn(4, 9, device=DEVICE), None, None, EPS)
    with pytest.raises(ValueError, match="bias"):
        L.layernorm(x, None, torch.ones(9, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="not valid"):
        L.layernorm(x, None, None, EPS, config=L.Config("row", block_h=4))
    with pytest.raises(ValueError, match="not valid"):  # a tail that stops short of the row's end
        L.layernorm(torch.randn(4, 80, device=DEVICE), None, None, EPS, config=L.Config("row", block_h=64, block_t=8))


def test_block_split_and_heuristics() -> None:
    """Rows that are not a power of two get a main block + tail in the forward's heuristic (2560: no
    masked lanes instead of 37%); the backward's loads the next tile ahead and, measured, splits
    2560 into 2048 + a 1024 tail (one pass of 4 warps' layout) without the residual gradient, and
    keeps one power-of-two block with it; every heuristic is valid with power-of-two rows wherever
    rows fit."""
    assert L.blocks(2560) == [(2048, 512), (4096, 0)] and L.blocks(768) == [(512, 256), (1024, 0)]
    assert L.blocks(1600) == [(2048, 0)] and L.blocks(1024) == [(1024, 0)]
    c = L.heuristic(_wl(16384, 2560))
    assert (c.block_h, c.block_t, c.rows) == (2048, 512, 1), c
    b = L.bwd_heuristic(16384, 2560, torch.device(DEVICE))
    assert (b.block_h, b.block_t, b.stages, b.num_warps) == (2048, 1024, 2, 4) and L.bwd_is_valid(b, 16384, 2560), b
    b = L.bwd_heuristic(16384, 2560, torch.device(DEVICE), ds=True)
    assert (b.block_h, b.block_t, b.stages) == (4096, 0, 2) and L.bwd_is_valid(b, 16384, 2560), b
    for H in [*range(1, 3000, 61), 768, 2560, 4096, 5120, 32768, 40000, 65536]:
        for residual in (False, True):
            wl = dataclasses.replace(_wl(1000, H, residual=residual), device="cuda")
            h = L.heuristic(wl)
            assert L.supported(wl) is (L.is_valid(h, wl) and h.rows & (h.rows - 1) == 0), (H, residual, h)
            assert L.supported(wl) is (H <= 32768 or not residual), (H, residual)
        for ds in (False, True):
            bh = L.bwd_heuristic(1000, H, "cuda", ds=ds)
            assert H > 32768 or L.bwd_is_valid(bh, 1000, H), (H, bh)
        assert all(L.bwd_is_valid(c, 1000, H) for c in L.bwd_space(1000, H))


def test_bwd_config_text() -> None:
    for c in L.bwd_space(77, 160):
        assert L.BwdConfig.decode(c.encode()) == c
    old = L.BwdConfig.decode("bwd:r=2:p=2:w=4")  # before the split: one power-of-two block
    assert old == L.BwdConfig(2, 2, 4) and old.split(2560) == (4096, 0)
    with pytest.raises(ValueError, match="backward config"):
        L.BwdConfig.decode("bwd:r=2:q=1")


# ---------------------------------------------------------------------------------------------
# backward


BWD_CASES = [((5, 48), True, True, False), ((3, 7, 130), True, False, True), ((9, 64), False, True, True),
             ((4, 33), False, False, False)]


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("shape,weight,bias,ds", BWD_CASES)
def test_backward_kernel(dtype: torch.dtype, shape: tuple[int, ...], weight: bool, bias: bool, ds: bool) -> None:
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (torch.randn(*shape, generator=g) * 2 + torch.randn(*shape[:-1], 1, generator=g) * 3).to(dtype).to(DEVICE)
    dy = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE) if weight else None
    dsx = torch.randn(*shape, generator=g).to(dtype).to(DEVICE) if ds else None
    rdx, *rparts = L.layernorm_bwd_ref(dy, x, w, EPS, ds=dsx, bias_grad=bias)
    assert rdx.dtype == dtype and len(rparts) == int(weight) + int(bias)  # (dx[, dw][, db])
    H = shape[-1]
    # heuristic (48, 130 and 33 split: 32 + 16, 128 + 2, 32 + 1); one block; loops over several
    # tiles (4 fake SMs); rmsnorm_bwd's config type; a split whose tail is wider than the rest (masked)
    cfgs: list = [None, L.BwdConfig(2, 1, 1, triton_pow2(H)), L.BwdConfig(1, 1, 2), RmsBwdConfig(2, 1, 2)]
    if L.blocks(H)[0][1]:
        bh, bt = L.blocks(H)[0]
        cfgs += [L.BwdConfig(2, 1, 2, bh, bt), L.BwdConfig(1, 1, 1, bh, 2 * bt if 2 * bt <= bh else bt),
                 L.BwdConfig(2, 1, 2, bh, bt, stages=2), L.BwdConfig(1, 1, 1, bh, bt, stages=2, evict=1)]
    # the next tile loaded ahead (one block), and rmsnorm_bwd's config with it
    cfgs += [L.BwdConfig(2, 1, 1, stages=2), RmsBwdConfig(1, 1, 2, stages=2)]
    # every config at both dtypes on a GPU; through the interpreter the heuristic at both and the
    # others alternate between the dtypes, and between shapes, so each runs at each shape and dtype
    turn = [c[0] for c in BWD_CASES].index(shape) + (dtype == FP32)
    for cfg in alternating(cfgs, turn):
        dx, *parts = L.layernorm_bwd(dy, x, w, EPS, ds=dsx, bias_grad=bias, config=cfg)
        c = compare(dx, rdx)
        assert c.ok, c.reason
        assert len(parts) == len(rparts)
        for got, want in zip(parts, rparts, strict=True):  # sums over rows in fp32: relative to their scale
            assert got.dtype == want.dtype == FP32
            assert (got - want).abs().max() <= 10 * tolerance(dtype).rtol * want.abs().max()


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows,H,stride", [(7, 80, 4), (3, 1100, 10)])
def test_backward_space(rows: int, H: int, stride: int, residual: bool) -> None:
    """A sample of bwd_space (every `stride`-th config: split or not, one stage or two) against
    autograd. A split needs a tail narrower than the main block once widened to a pass of its
    layout: at 1100 (1024 + 512 on 2 warps), not at 80; 1100 samples a tenth (the interpreter's time)."""
    g = torch.Generator().manual_seed(H + rows)
    x = (torch.randn(rows, H, generator=g) * 2 + torch.randn(rows, 1, generator=g) * 3).to(BF16).to(DEVICE)
    dy, ds = (torch.randn(rows, H, generator=g).to(BF16).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(BF16).to(DEVICE)
    dsx = ds if residual else None
    rdx, rdw, rdb = L.layernorm_bwd_ref(dy, x, w, EPS, ds=dsx, bias_grad=True)
    space = L.bwd_space(rows, H)
    split = H == 1100
    assert len(space) >= 16 and any(c.block_t for c in space) is split and any(not c.block_t for c in space)
    sample = space[::stride]  # no multiple of 3: every config comes in threes (stages, evict)
    assert any(c.stages == 2 and c.block_t for c in sample) is split and any(c.stages == 1 for c in sample)
    assert any(c.block_t for c in sample) is split and any(not c.block_t for c in sample)
    # the whole sample on a GPU; through the interpreter a covering part of it, whose configs after
    # the first alternate between the cases with and without the residual gradient
    for cfg in alternating(covering(sample), residual):
        dx, dw, db = L.layernorm_bwd(dy, x, w, EPS, ds=dsx, bias_grad=True, config=cfg)
        c = compare(dx, rdx)
        assert c.ok, f"{cfg.encode()}: {c.reason}"
        for got, want in ((dw, rdw), (db, rdb)):
            assert (got - want).abs().max() <= 1e-3 * want.abs().max() + 1e-4, cfg.encode()


@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, False)])
def test_autograd_through_the_ops(weight: bool, bias: bool) -> None:
    torch.manual_seed(0)
    x, r, dy, ds = (torch.randn(6, 72, device=DEVICE) * 2 + 1 for _ in range(4))
    w = 1 + 0.1 * torch.randn(72, device=DEVICE) if weight else None
    b = 0.1 * torch.randn(72, device=DEVICE) if bias else None

    def leaves() -> list[torch.Tensor | None]:
        return [t.clone().requires_grad_() if t is not None else None for t in (x, r, w, b)]

    def grads(ts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return [t.grad if t is not None else None for t in ts]

    def close(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
        for a, c in zip(got, want, strict=True):
            assert (a is None) == (c is None)
            if a is not None:
                torch.testing.assert_close(a, c, atol=2e-5, rtol=2e-5)

    # add_layernorm, both outputs used, then the normalized one alone
    for both in (True, False):
        mine, ref = leaves(), leaves()
        s, y = A.add_layernorm_op(mine[0], mine[1], mine[2], mine[3], EPS, FP32, "")
        s2 = ref[0] + ref[1]  # type: ignore[operator]
        y2 = F.layer_norm(s2, (72,), ref[2], ref[3], EPS)
        if both:
            torch.autograd.backward([s, y], [ds, dy])
            torch.autograd.backward([s2, y2], [ds, dy])
        else:
            y.backward(dy)
            y2.backward(dy)
        close(grads(mine), grads(ref))
    # layernorm
    mine, ref = leaves(), leaves()
    L.layernorm_op(mine[0], mine[2], mine[3], EPS, FP32, "").backward(dy)
    F.layer_norm(ref[0], (72,), ref[2], ref[3], EPS).backward(dy)  # type: ignore[arg-type]
    close(grads(mine)[:1] + grads(mine)[2:], grads(ref)[:1] + grads(ref)[2:])


@requires_gpu
@pytest.mark.parametrize("rows,H,dtype", [(16, 64 * 256 * 256, FP32), (8, 100003, BF16), (64, 32768, BF16)])
def test_gpu_split_variant_every_config(rows: int, H: int, dtype: torch.dtype) -> None:
    """KernelBench's LayerNorm shape, a ragged row past 64K and rows the row kernels hold too."""
    wl = _wl(rows, H, dtype=dtype)
    configs = [c for c in L.space(wl) if c.variant == "split"]
    assert configs
    for c in configs:
        _check(wl, c)


@requires_gpu
@pytest.mark.parametrize("rows,H", [(4096, 2560), (16384, 2560), (8192, 768), (2048, 1600)])
def test_qwen_and_gpt2_shapes_on_gpu(rows: int, H: int) -> None:
    for residual in (False, True):
        _check(_wl(rows, H, residual=residual))
    g = torch.Generator().manual_seed(1)
    x, dy, ds = (torch.randn(rows, H, generator=g).to(BF16).cuda() for _ in range(3))
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(BF16).cuda()
    dx, dw, db = L.layernorm_bwd(dy, x, w, EPS, ds=ds, bias_grad=True)
    rdx, rdw, rdb = L.layernorm_bwd_ref(dy, x, w, EPS, ds=ds, bias_grad=True)
    assert compare(dx, rdx).ok
    assert (dw - rdw).abs().max() <= 1e-2 * rdw.abs().max()
    assert (db - rdb).abs().max() <= 1e-2 * rdb.abs().max()
    for c in L.space(_wl(rows, H))[:6]:  # a sample of the space at full size
        _check(_wl(rows, H), c)
    for cfg in L.bwd_space(rows, H)[::9]:  # and of the backward's, with and without the split
        dx, dw, db = L.layernorm_bwd(dy, x, w, EPS, ds=ds, bias_grad=True, config=cfg)
        assert compare(dx, rdx).ok, cfg.encode()
        assert (dw - rdw).abs().max() <= 1e-2 * rdw.abs().max(), cfg.encode()
        assert (db - rdb).abs().max() <= 1e-2 * rdb.abs().max(), cfg.encode()


# ---------------------------------------------------------------------------------------------
# matching and integration


class Block(nn.Module):
    """GPT-2's residual wiring: norm, sublayer, add; the sum is the next residual."""

    def __init__(self, h: int, *, bias: bool = True, broadcast: bool = False) -> None:
        super().__init__()
        self.ln_1, self.ln_2, self.ln_f = (nn.LayerNorm(h, bias=bias) for _ in range(3))
        self.lin = nn.Linear(h, h)
        self.broadcast = broadcast
        for ln in (self.ln_1, self.ln_2, self.ln_f):  # not the identity init: a swapped weight must show
            nn.init.normal_(ln.weight, 1.0, 0.1)
            if ln.bias is not None:
                nn.init.normal_(ln.bias, 0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.lin(self.ln_1(x))
        delta = self.lin(self.ln_2(h))
        h = h + (delta[:, :1] if self.broadcast else delta)
        return self.ln_f(h) + F.layer_norm(h, h.shape[-1:], None, None, 1e-6)


def _plan(m: nn.Module, x: torch.Tensor) -> list:
    from solforge import capture, plan

    with torch.no_grad():
        return plan.plan(capture.capture(m, (x,)).graphs)


def _counts(groups: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in groups:
        out[g.workload.family] = out.get(g.workload.family, 0) + g.count
    return out


@pytest.mark.parametrize("dtype,bias", [(FP32, True), (BF16, True), (BF16, False)])
def test_block_regions_and_integration(dtype: torch.dtype, bias: bool) -> None:
    from solforge.integrate import integrate

    torch.manual_seed(0)
    m = Block(64, bias=bias).to(dtype).to(DEVICE).eval()
    x = torch.randn(3, 5, 64, dtype=dtype, device=DEVICE) * 2 + 1
    groups = _plan(m, x)
    # ln_1 reads the input (no add); ln_2 reads h; the last add feeds ln_f and the functional
    # LayerNorm without parameters: the first claims the add, the second stays plain
    assert _counts(groups) == {"add_layernorm": 2, "layernorm": 2}
    wl = {g.workload.family: g.workload for g in groups if g.workload.param("weight")}
    assert wl["add_layernorm"].param("bias") is bias
    opt, stats = integrate(m, {})
    with torch.no_grad():
        y, ref = opt(x), m(x)
    assert sum(stats.untuned.values()) == 4
    tol = 1e-5 if dtype == FP32 else 1e-2  # bf16 through three norms and a linear: compare by norm
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < tol


def test_broadcast_add_is_not_fused() -> None:
    m = Block(32, broadcast=True).eval()
    assert _counts(_plan(m, torch.randn(2, 4, 32))) == {"add_layernorm": 1, "layernorm": 3}


def test_training_through_the_integrated_block() -> None:
    """Gradients of every parameter through the fused ops (their Triton backward) match eager's."""
    from solforge.integrate import integrate

    torch.manual_seed(0)
    m = Block(48).to(DEVICE).train()
    x = torch.randn(2, 5, 48, device=DEVICE) * 2 + 1
    opt, stats = integrate(m, {})
    opt(x).square().mean().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}  # type: ignore[union-attr]
    assert sum(stats.untuned.values()) == 4
    m.zero_grad()
    m(x).square().mean().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


class NormThenPointwise(nn.Module):
    """A linear, a LayerNorm, then `tail` of its result (odd sizes)."""

    def __init__(self, tail: str) -> None:
        super().__init__()
        self.lin, self.ln, self.out = nn.Linear(37, 37), nn.LayerNorm(37), nn.Linear(37, 37)
        self.tail = tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = self.ln(h)
        if self.tail == "gelu_scale":  # KernelBench level 2's ..._LayerNorm_GELU_Scaling
            return F.gelu(y) * 2.0
        if self.tail == "residual":  # a residual add of a tensor as large: the next norm's
            return y + h
        return self.out(y)  # a matmul reads it


@pytest.mark.parametrize(("tail", "joins"), [("gelu_scale", True), ("residual", False), ("linear", False)])
def test_a_layer_norm_read_by_pointwise_ops_alone_joins_them(tail: str, joins: bool) -> None:
    """A LayerNorm whose result only pointwise ops of it read (a GELU, a scale) gives way to one
    generated region holding it and them (registry `joins` "readers": one kernel, not the family's
    and a generated one); read by a matmul or added to a tensor as large, it stays the family's.
    Values as eager's."""
    from solforge import optimize

    torch.manual_seed(0)
    m = NormThenPointwise(tail).to(DEVICE).eval()
    make = lambda s: (torch.randn(3, 5, 37, generator=torch.Generator().manual_seed(s)).to(DEVICE),)  # noqa: E731
    (x,) = make(0)
    families = sorted(g.workload.family for g in _plan(m, x))
    if joins:
        assert families == ["generated"], families
        opt, report = optimize(m, (x,), budget=1, max_candidates=1, db=False, profile="off", keep_slower=True,
                               make_inputs=make)
        assert report.e2e is not None and report.e2e.passed, report.notes
        (x2,) = make(7)
        with torch.no_grad():
            torch.testing.assert_close(opt(x2), m(x2), rtol=1e-5, atol=1e-5)
    else:
        assert "layernorm" in families, families
