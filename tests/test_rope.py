"""rope family: kernels (forward, backward) against rope_ref, the custom op and its autograd, the
verifier on a tuple-returning family, the config triad, and the matcher on modules written the
Hugging Face way and on the qwen3-tiny zoo model. Shapes stay small off the GPU (the kernels run in
Triton's interpreter); the gpu tests run Qwen3-4B's shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from conftest import DEVICE, FULL_SWEEPS, HAND_WRITTEN, covering, requires_gpu

from solforge import capture, plan
from solforge.integrate import integrate
from solforge.kernels import rope as R
from solforge.numerics import Tolerance, compare, tolerance
from solforge.records import Workload
from solforge.tune import family_module
from solforge.tune.verify import verify

BF16, FP32 = torch.bfloat16, torch.float32
EPS = 1e-6


def _wl(B: int, S: int, Hq: int, Hk: int, D: int, dtype: torch.dtype = BF16, *, norm: bool = True,
        weight: bool = True, rbw: bool = True, heads_first: bool = True, cos_batch: int = 1,
        device: str = DEVICE) -> Workload:
    meta = dict(dtype=dtype, device="meta")
    q, k = torch.empty(B, S, Hq, D, **meta), torch.empty(B, S, Hk, D, **meta)
    c = torch.empty(cos_batch, S, D, **meta)
    w = torch.empty(D, **meta) if norm and weight else None
    wl = R.workload_for(q, k, c, c, w, w, EPS, norm=norm, round_before_weight=rbw, heads_first=heads_first)
    return dataclasses.replace(wl, device=device)


def _check_fwd(wl: Workload, config: R.Config | None = None, *, seed: int = 0, strides: bool = True) -> None:
    """Poisoned outputs, inputs unchanged, both outputs within tolerance, HF's strides (the launcher
    allocates the same way for every config: a sweep checks them once)."""
    args, kw = R.make_inputs(wl, seed=seed)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref = R.rope_ref(*args, **kw)
    out = tuple(torch.full_like(r, float("nan")) for r in ref)
    got = R.rope(*args, config=config, out=out, **kw)
    assert got[0] is out[0] and got[1] is out[1]
    for a, b in zip(args, before, strict=True):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)
    for o, r in zip(out, ref, strict=True):
        c = compare(o, r, R.output_tolerance(wl))
        assert c.ok, f"{config.encode() if config else 'heuristic'} on {wl.key}: {c.reason}"
    if not strides:
        return
    fresh = R.rope(*args, config=config, **kw)  # allocated by the launcher: the strides HF produces
    assert [t.stride() for t in fresh] == [r.stride() for r in ref]


# ---------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("norm,weight,rbw", [(False, False, False), (True, True, True), (True, True, False),
                                             (True, False, False)])
@pytest.mark.parametrize("heads_first", [True, False])
def test_forward_matches_reference(dtype: torch.dtype, norm: bool, weight: bool, rbw: bool,
                                   heads_first: bool) -> None:
    # odd S, GQA (Hq = 3 Hk), cos shared by the batch
    _check_fwd(_wl(2, 7, 6, 2, 16, dtype, norm=norm, weight=weight, rbw=rbw, heads_first=heads_first))


def test_round_before_weight_is_honored() -> None:
    """The tolerance cannot see one bf16 ulp of the normalized value, so check the rounding itself:
    with the same flag kernel and reference agree to the bit almost everywhere (both round to
    nearest even; see kernels/interp.py _RNE_BY_HAND), with the other flag they disagree often."""
    wl = _wl(2, 33, 8, 4, 64)
    args, kw = R.make_inputs(wl, seed=0)
    ref = R.rope_ref(*args, **kw)
    for rbw, lo, hi in ((True, 0.0, 0.02), (False, 0.1, 1.0)):
        got = R.rope(*args, **{**kw, "round_before_weight": rbw})
        for g, r in zip(got, ref, strict=True):
            assert lo <= float((g != r).float().mean()) <= hi, rbw


@pytest.mark.parametrize("D", [24, 8])
def test_head_dim_not_a_power_of_two_and_per_batch_cos(D: int) -> None:
    # D/2 = 12: a 16-wide masked half; cos given per batch element (position ids differ per sequence)
    _check_fwd(_wl(3, 5, 3, 1, D, cos_batch=3))


def test_every_config_in_space() -> None:
    wl = _wl(2, 9, 8, 3, 32)  # tiles wider than Hk and than B * S: masked heads and tokens
    configs = R.space(wl)
    assert len(configs) >= 8 and len({(c.tokens, c.heads) for c in configs}) >= 4
    # through the interpreter a program costs the same whatever its warps, and a 1x1 tile runs ~200 of
    # them: the persistent, two-stage representative is a wide tile (the 1x1 one runs one-shot); warps and
    # programs per SM need no value each (test_persistent_forward_matches_the_tile_kernel: progs, stages)
    first = [c for c in configs if c.progs and c.stages == 2 and c.tokens * c.heads > 1][:1]
    assert first
    for i, c in enumerate(covering(configs, first, ignore=("num_warps", "progs"))):  # all of it on a GPU
        _check_fwd(wl, c, strides=i == 0)


def test_strided_inputs_from_a_fused_projection() -> None:
    """q and k as views of one qkv projection (row stride > H * D), cos as (S, D)."""
    B, S, Hq, Hk, D = 2, 5, 4, 2, 16
    qkv = torch.randn(B, S, (Hq + 2 * Hk) * D, device=DEVICE, dtype=BF16)
    q = qkv[..., : Hq * D].view(B, S, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hk) * D].view(B, S, Hk, D)
    theta = torch.rand(S, D, device=DEVICE) * 6
    cos, sin = theta.cos().to(BF16), theta.sin().to(BF16)
    got = R.rope(q, k, cos, sin)
    ref = R.rope_ref(q, k, cos, sin)
    for o, r in zip(got, ref, strict=True):
        assert compare(o, r).ok


def test_launcher_rejects_bad_inputs() -> None:
    q = torch.randn(1, 3, 2, 8, device=DEVICE)
    c = torch.randn(1, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="even"):
        R.rope(q[..., :7], q[..., :7], c[..., :7], c[..., :7])
    with pytest.raises(ValueError, match="cos must have shape"):
        R.rope(q, q, c[:, :2], c)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        R.rope(q, q, c, c, torch.ones(8, device=DEVICE), None, norm=True)
    wl = R.workload_for(q, q, c, c, None, None, EPS, norm=False, round_before_weight=False, heads_first=True)
    with pytest.raises(ValueError, match="not valid"):
        R.rope(q, q, c, c, config=R.Config("tile", 64, 64, 1))
    assert not R.is_valid(R.Config("tile", 64, 64, 1), wl)


# ---------------------------------------------------------------------------------------------
# backward


def _grads(wl: Workload, *, seed: int = 3) -> None:
    """Gradients of the custom op (its Triton backward) against autograd through rope_ref."""
    args, kw = R.make_inputs(wl, seed=seed)
    q, k, cos, sin, qw, kw_, eps = args
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (q, k, qw, kw_)]
    refs = [t.clone().requires_grad_() if t is not None else None for t in (q, k, qw, kw_)]
    out = R.rope_op(leaves[0], leaves[1], cos, sin, leaves[2], leaves[3], eps, kw["norm"],
                    kw["round_before_weight"], kw["heads_first"], kw["out_dtype"], "")
    ref = R.rope_ref(refs[0], refs[1], cos, sin, refs[2], refs[3], eps, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    gq = torch.randn(out[0].shape, generator=g).to(out[0].dtype).to(DEVICE)
    gk = torch.randn(out[1].shape, generator=g).to(out[1].dtype).to(DEVICE)
    torch.autograd.backward(out, (gq, gk))
    torch.autograd.backward(ref, (gq, gk))
    for name, a, b in zip(("dq", "dk", "dq_weight", "dk_weight"), leaves, refs, strict=True):
        if a is None:
            continue
        assert a.grad is not None and a.grad.shape == a.shape and a.grad.dtype == a.dtype, name
        # weight grads sum over every row: compare them relative to their own scale
        tol = tolerance(a.dtype) if name in ("dq", "dk") else Tolerance(1e-2 * float(b.grad.abs().max()), 2e-2)
        c = compare(a.grad, b.grad, tol)
        assert c.ok, f"{name} on {wl.key}: {c.reason}"


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("norm,weight,rbw", [(False, False, False), (True, True, True), (True, False, False)])
@pytest.mark.parametrize("heads_first", [True, False])
def test_backward_matches_autograd_of_reference(dtype: torch.dtype, norm: bool, weight: bool, rbw: bool,
                                                heads_first: bool) -> None:
    _grads(_wl(2, 7, 6, 2, 16, dtype, norm=norm, weight=weight, rbw=rbw, heads_first=heads_first))


def test_backward_loops_over_many_token_blocks() -> None:
    # 4 fake SMs in the interpreter: 2 head blocks x 2 programs, each looping over 30 token blocks
    _grads(_wl(2, 61, 4, 4, 16, FP32))


@pytest.mark.parametrize("weight", [True, False])
def test_backward_configs_with_the_next_block_loaded_ahead(weight: bool) -> None:
    """Configs of bwd_space, one stage and two (the next token block loaded before this one is
    computed), with loops of many token blocks, against autograd through rope_ref."""
    wl = _wl(2, 9, 4, 2, 16, BF16, norm=True, weight=weight, rbw=weight)  # 9 blocks of 2 tokens: loops of several
    args, kw = R.make_inputs(wl, seed=5)
    q, k, cos, sin, qw, kw_, eps = args
    refs = [t.clone().requires_grad_() if t is not None else None for t in (q, k, qw, kw_)]
    ref = R.rope_ref(refs[0], refs[1], cos, sin, refs[2], refs[3], eps, **kw)
    g = torch.Generator().manual_seed(6)
    gq, gk = (torch.randn(o.shape, generator=g).to(o.dtype).to(DEVICE) for o in ref)
    torch.autograd.backward(ref, (gq, gk))
    space = R.bwd_space(wl)
    picked = [c for c in space if c.stages == 2][:3] + [c for c in space if c.stages == 1][:1]
    assert len(picked) == 4 and R.bwd_heuristic(wl) in [*space, R.bwd_heuristic(wl)]
    # through the interpreter each stage count once (a 2x2 tile two-stage, a 1x1 one-stage: a 1x1 tile
    # costs ~3x the programs): 4, 8 or 16 programs an SM (the picks with a weight, all persistent) and
    # the tile's size walk the same loop in the same kernel (all of them on a GPU)
    first = [R.Config("tile", 2, 2, 1, progs=4 if weight else 0, stages=2)]
    assert len({bool(c.progs) for c in picked}) == 1
    for c in covering(picked, first, ignore=("progs", "tokens", "heads")):
        got = R.rope_bwd(gq, gk, q, k, cos, sin, qw, kw_, eps, norm=True, round_before_weight=kw["round_before_weight"],
                         heads_first=kw["heads_first"], config=c)
        for name, a, r in zip(("dq", "dk", "dq_weight", "dk_weight"), got, refs, strict=True):
            if r is None:
                assert a is None
                continue
            tol = tolerance(BF16) if name in ("dq", "dk") else Tolerance(1e-2 * float(r.grad.abs().max()), 2e-2)
            cmp = compare(a, r.grad, tol)
            assert cmp.ok, f"{c.encode()} {name}: {cmp.reason}"
    assert R.Config.decode("tile:t=2:h=2:w=1:p=4:s=2").stages == 2


def test_backward_refuses_cos_grads() -> None:
    wl = _wl(1, 3, 2, 2, 8, FP32, norm=False)
    (q, k, cos, sin, *_), _ = R.make_inputs(wl, seed=0)
    cos = cos.clone().requires_grad_()
    out = R.rope_op(q, k, cos, sin, None, None, EPS, False, False, True, FP32, "")
    with pytest.raises(NotImplementedError, match="cos/sin"):
        out[0].sum().backward()


def test_fake_impls_agree_with_the_kernels() -> None:
    """opcheck: schema, fake tensors (shapes, strides, dtypes) and autograd registration."""
    wl = _wl(2, 3, 4, 2, 8)
    args, kw = R.make_inputs(wl, seed=0)
    q, k, cos, sin, qw, kw_, eps = args
    op_args = (q, k, cos, sin, qw.clone().requires_grad_(), kw_.clone().requires_grad_(), eps, True, True, True,
               BF16, "")
    torch.library.opcheck(R.rope_op.default, op_args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    gq = torch.randn(2, 4, 3, 8, dtype=BF16, device=DEVICE)
    gk = torch.randn(2, 2, 3, 8, dtype=BF16, device=DEVICE)
    torch.library.opcheck(R.rope_bwd_op, (gq, gk, q, k, cos, sin, qw, kw_, eps, True, True, True, ""),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# verifier and config triad


def test_verify_passes_the_kernel_and_catches_an_unwritten_output() -> None:
    wl = _wl(1, 6, 4, 2, 16)
    v = verify(R, wl, lambda *a, **k: R.rope(*a, **k), device=DEVICE)
    assert v.passed, v.reason
    assert v.trials >= 6 and v.max_rel_err < 0.02

    def half_done(*a: object, out: tuple[torch.Tensor, torch.Tensor], **k: object) -> None:
        R.rope(*a, out=(out[0], torch.empty_like(out[1])), **k)  # k's result never reaches `out`

    bad = verify(R, wl, half_done, device=DEVICE)
    assert not bad.passed and "output 1" in (bad.reason or "") and "NaN" in (bad.reason or "")


def test_verify_odd_shape_changes_the_sequence_length() -> None:
    wl = _wl(2, 8, 2, 2, 8)
    assert R.verify_rows(wl) == 8
    (q, k, cos, *_), _ = R.make_inputs(wl, seed=0, rows=5)
    assert q.shape == (2, 5, 2, 8) and k.shape == (2, 5, 2, 8) and cos.shape == (1, 5, 8)


def test_config_triad_at_qwen3_shapes() -> None:
    for B, S, Hq, Hk, D in [(2, 8192, 32, 8, 128), (1, 4096, 32, 8, 128), (1, 1, 32, 8, 128), (3, 7, 14, 2, 64),
                            (1, 100, 16, 16, 256)]:
        wl = _wl(B, S, Hq, Hk, D, device="cuda")
        configs = R.space(wl)
        # tiles (~50 at most), one program each or persistent at 4 or 8 programs per SM
        assert 1 <= len(configs) <= 3 * 64 and len(configs) % 3 == 0, (B, S, len(configs))
        assert len(set(configs)) == len(configs) and all(R.is_valid(c, wl) for c in configs)
        h = R.heuristic(wl)
        assert R.is_valid(h, wl) and R.is_valid(R.bwd_heuristic(wl), wl)
        for c in configs[:5] + [h]:
            assert R.Config.decode(c.encode()) == c
    assert R.heuristic(_wl(2, 8192, 32, 8, 128)).encode() == "tile:t=8:h=4:w=4:p=4:s=2"  # swept on the H100
    with pytest.raises(ValueError, match="bad rope config"):
        R.Config.decode("tile:x=3")


def test_output_tolerance_is_loosened_only_where_rounding_needs_it() -> None:
    assert R.output_tolerance(_wl(1, 4, 2, 2, 8, rbw=False)) == tolerance(BF16)
    assert R.output_tolerance(_wl(1, 4, 2, 2, 8, FP32, rbw=True)) == tolerance(FP32)
    assert R.output_tolerance(_wl(1, 4, 2, 2, 8, rbw=True)).atol == pytest.approx(4 * 2**-7)


# ---------------------------------------------------------------------------------------------
# matcher and integration, on attention written the Hugging Face way


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class HFNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(h))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """Qwen3 (qk_norm=True) or Llama (False) attention; `token_major` rotates before transposing
    (unsqueeze_dim=2); `lone` rotates q only; `leak` also uses q ("input") or q's rotate_half."""

    def __init__(self, hidden: int = 40, Hq: int = 6, Hk: int = 2, D: int = 16, *, qk_norm: bool = True,
                 token_major: bool = False, lone: bool = False, leak: str = "") -> None:
        super().__init__()
        self.Hq, self.Hk, self.D = Hq, Hk, D
        self.q_proj = nn.Linear(hidden, Hq * D, bias=False)
        self.k_proj = nn.Linear(hidden, Hk * D, bias=False)
        self.v_proj = nn.Linear(hidden, Hk * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, hidden, bias=False)
        self.q_norm = HFNorm(D) if qk_norm else nn.Identity()
        self.k_norm = HFNorm(D) if qk_norm else nn.Identity()
        self.token_major, self.lone, self.leak = token_major, lone, leak
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float) / D))

    def rotary(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(x.shape[1], device=x.device)[None].float()  # (1, S): cos shared by the batch
        freqs = (self.inv_freq.to(x.device)[None, :, None] @ pos[:, None, :]).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        cos, sin = self.rotary(x)
        q = self.q_norm(self.q_proj(x).view(B, S, -1, self.D))
        k = self.k_norm(self.k_proj(x).view(B, S, -1, self.D))
        v = self.v_proj(x).view(B, S, -1, self.D).transpose(1, 2)
        extra = 0
        if self.token_major:
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            if self.lone:
                q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
            else:
                if self.leak == "input":  # the rotated tensor has another user
                    # (not rotate_half(q).sum(): the capture computes that rotate_half once, shared
                    # with the rope's, which is the "rotate_half" leak below)
                    extra = q.sum()
                if self.leak == "rotate_half":  # an intermediate of q's rope has another user
                    rq = rotate_half(q)
                    extra = rq.sum()
                    q = q * cos.unsqueeze(1) + rq * sin.unsqueeze(1)
                    k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
                else:
                    q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1)) + extra


def _families(m: nn.Module, x: torch.Tensor) -> list[tuple[str, int, Workload]]:
    with torch.no_grad():
        groups = plan.plan(capture.capture(m, (x,)).graphs, HAND_WRITTEN)
    return sorted(((g.workload.family, g.count, g.workload) for g in groups), key=lambda t: (t[0], t[1]))


def _integrated(m: nn.Module, x: torch.Tensor, families: tuple[str, ...] | None = HAND_WRITTEN,  # noqa: ANN202
                found: list[tuple[str, int, Workload]] | None = None):
    """`found`: what _families(m, x) found (the same capture and families), rather than capture again."""
    if found is None:
        with torch.no_grad():
            found = [(g.workload.family, g.count, g.workload)
                     for g in plan.plan(capture.capture(m, (x,)).graphs, families)]
    winners = {wl: family_module(wl.family).heuristic(wl).encode() for _f, _c, wl in found}
    return integrate(m, winners, families=families)


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("qk_norm,token_major", [(True, False), (False, False), (True, True), (False, True)])
def test_hf_attention_is_matched_and_swapped(dtype: torch.dtype, qk_norm: bool, token_major: bool) -> None:
    torch.manual_seed(0)
    m = Attention(qk_norm=qk_norm, token_major=token_major).to(DEVICE, dtype)
    x = torch.randn(2, 7, 40, device=DEVICE, dtype=dtype)
    found = _families(m, x)
    assert [(f, c) for f, c, _ in found] == [("rope", 1)]  # the norms are fused, not left to rmsnorm
    wl = found[0][2]
    assert wl.shapes[:4] == ((2, 7, 6, 16), (2, 7, 2, 16), (1, 7, 16), (1, 7, 16))
    assert wl.param("norm") is qk_norm and wl.param("heads_first") is (not token_major)
    assert wl.param("round_before_weight") is (qk_norm and dtype == BF16)
    opt, stats = _integrated(m, x, found=found)
    with torch.no_grad():
        out, ref = opt(x), m(x)
    assert stats.total == 1
    c = compare(out, ref)
    assert c.ok, c.reason


def test_lone_rope_is_left_alone() -> None:
    """A rope with no partner sharing cos/sin: no rope region (the q/k norms are then plain rmsnorm
    regions)."""
    m = Attention(lone=True).to(DEVICE)
    found = _families(m, torch.randn(1, 5, 40, device=DEVICE))
    assert [(f, c) for f, c, _ in found] == [("rmsnorm", 1), ("rmsnorm", 1)]  # q's and k's shapes


def test_rope_whose_rotate_half_leaks_keeps_it_and_leaves_the_norms_out() -> None:
    """q's rotate_half is also read elsewhere: the rope region keeps it (and the slices it reads) for
    that reader (plan/sharing.py), and does not fuse the q/k norms, which would have to be kept
    too: they are rmsnorm regions of their own. The model computes what the original does."""
    m = Attention(leak="rotate_half").to(DEVICE)
    x = torch.randn(1, 5, 40, device=DEVICE)
    found = _families(m, x)
    assert [(f, c) for f, c, _ in found] == [("rmsnorm", 1), ("rmsnorm", 1), ("rope", 1)]
    assert found[2][2].param("norm") is False
    with torch.no_grad():
        (g,) = capture.capture(m, (x,)).graphs
    (rope,) = plan.find_matches(g.aten.graph, ["rope"])
    assert [n.target for n in rope.kept if n.target in (torch.ops.aten.cat.default, torch.ops.aten.neg.default)] \
        == [torch.ops.aten.neg.default, torch.ops.aten.cat.default]
    opt, stats = _integrated(m, x, found=found)
    with torch.no_grad():
        out, ref = opt(x), m(x)
    assert stats.total == 3 and compare(out, ref).ok


def test_norm_output_used_elsewhere_is_not_fused() -> None:
    """When the normalized q is also read outside the rope, the norm must still be computed: the
    pair is a rope region without the norm, and both norms stay rmsnorm regions."""
    m = Attention(leak="input").to(DEVICE)
    x = torch.randn(1, 5, 40, device=DEVICE)
    found = _families(m, x)
    assert [(f, c) for f, c, _ in found] == [("rmsnorm", 1), ("rmsnorm", 1), ("rope", 1)]
    assert found[2][2].param("norm") is False
    opt, stats = _integrated(m, x, found=found)
    with torch.no_grad():
        out, ref = opt(x), m(x)
    assert stats.total == 3 and compare(out, ref).ok


def test_training_through_the_integrated_model_matches_eager() -> None:
    """Forward and every gradient (input, projections, q/k norm weights) through the fused op's
    Triton backward agree with eager autograd."""
    torch.manual_seed(1)
    m = Attention().to(DEVICE)
    x = torch.randn(2, 9, 40, device=DEVICE)
    opt, stats = _integrated(m, x, ("rope",))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = opt(xa)
    ref = m(xb)
    assert stats.total == 1
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, [xa, *m.parameters()], g)
    want = torch.autograd.grad(ref, [xb, *m.parameters()], g)
    tol = Tolerance(1e-4, 1e-4)
    assert compare(out.detach(), ref.detach(), tol).ok
    for (name, _), a, b in zip([("x", None), *m.named_parameters()], got, want, strict=True):
        c = compare(a, b, tol)
        assert c.ok, f"grad of {name}: {c.reason}"


def test_qwen3_tiny_regions_and_integrated_outputs() -> None:
    """qwen3-tiny (2 layers): one fused q/k norm + rope region per layer, the 2 * 2 + 1 hidden
    norms left to (add_)rmsnorm, the SwiGLUs; the integrated model computes the original's logits."""
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device=DEVICE, batch=2, seq=7)
    with torch.no_grad():
        groups = plan.plan(capture.capture(lm.model, lm.example_inputs).graphs)
    got = sorted((g.workload.family, g.count) for g in groups)
    assert got == [("add_rmsnorm", 4), ("rmsnorm", 1), ("rope", 2), ("swiglu", 2)]
    (rope_group,) = [g for g in groups if g.workload.family == "rope"]
    assert rope_group.workload.param("norm") is True
    assert {r.module for r in rope_group.regions} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all(len(r.outputs) == 2 for r in rope_group.regions)
    assert any(n.startswith("rsqrt") for n in rope_group.regions[0].nodes)  # the norm is inside
    winners = {g.workload: family_module(g.workload.family).heuristic(g.workload).encode() for g in groups}
    opt, stats = integrate(lm.model, winners)
    inputs = lm.make_inputs(5)
    with torch.no_grad():
        out, ref = opt(*inputs).logits, lm.model(*inputs).logits
    assert stats.total == 9  # 2 rope, 4 add_rmsnorm, 1 rmsnorm, 2 swiglu
    c = compare(out, ref)
    assert c.ok, c.reason


# ---------------------------------------------------------------------------------------------
# GPU: Qwen3-4B's shapes (Hq 32, Hk 8, D 128): B2 S8192 inference, B1 S4096 training


def _hf_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qw: torch.Tensor,
                  kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)

    return apply_rotary_pos_emb(norm(q, qw).transpose(1, 2), norm(k, kw).transpose(1, 2), cos, sin)


@requires_gpu
def test_gpu_qwen3_4b_forward_verifies_and_beats_eager() -> None:
    from triton.testing import do_bench

    wl = _wl(2, 8192, 32, 8, 128, device="cuda")
    _check_fwd(wl)
    v = verify(R, wl, lambda *a, **k: R.rope(*a, **k), device="cuda")
    assert v.passed, v.reason
    args, kw = R.make_inputs(wl, seed=0)
    q, k, cos, sin, qw, kw_, _ = args
    fused = do_bench(lambda: R.rope(*args, **kw))
    eager = do_bench(lambda: _hf_norm_rope(q, k, cos, sin, qw, kw_))
    print(f"rope B2 S8192: fused {fused * 1e3:.1f} us, eager HF norm + rope {eager * 1e3:.1f} us")
    assert fused < eager
    for o, r in zip(R.rope(*args, **kw), _hf_norm_rope(q, k, cos, sin, qw, kw_), strict=True):
        assert compare(o, r, Tolerance(4 * 2**-7, 1.6e-2)).ok  # HF's own extra bf16 roundings


@requires_gpu
def test_gpu_qwen3_4b_training_backward() -> None:
    _grads(_wl(1, 4096, 32, 8, 128, device="cuda"))
    _grads(_wl(1, 4095, 32, 8, 128, FP32, device="cuda"))


@pytest.mark.parametrize("B,S,Hq,Hk,D", [(1, 128, 4, 2, 16), (2, 8192, 32, 8, 128), (1, 4096, 32, 8, 128),
                                         (1, 1, 32, 8, 128), (3, 7, 6, 2, 64), (1, 4096, 2, 1, 8)])
def test_heuristics_are_valid(B: int, S: int, Hq: int, Hk: int, D: int) -> None:
    """The untuned defaults must pass the family's own validity check (qwen3-tiny's shape once got
    a 128-token tile, outside the space)."""
    wl = _wl(B, S, Hq, Hk, D)
    assert R.is_valid(R.heuristic(wl), wl) and R.is_valid(R.bwd_heuristic(wl), wl)


# every pairing on a GPU; through the interpreter each stage count once and each norm form once
PERSISTENT = [(s, n, n) for s in (1, 2) for n in (True, False)] if FULL_SWEEPS else [(1, True, True), (2, False, False)]


@pytest.mark.parametrize("stages,norm,weight", PERSISTENT)
def test_persistent_forward_matches_the_tile_kernel(stages: int, norm: bool, weight: bool) -> None:
    """progs > 0: the grid-stride forward (4 fake SMs: several token blocks a program, a ragged
    last one) computes what the one-program-per-tile kernel does, bit for bit."""
    wl = _wl(2, 13, 4, 2, 16, BF16, norm=norm, weight=weight, rbw=weight)  # 13 token blocks a program
    args, kw = R.make_inputs(wl, seed=7)
    tile = R.Config("tile", 2, 2, 1)
    want = R.rope(*args, **kw, config=tile)
    got = R.rope(*args, **kw, config=dataclasses.replace(tile, progs=1, stages=stages))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    c = compare(got[0], R.rope_ref(*args, **kw)[0], R.output_tolerance(wl))
    assert c.ok, c.reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", [True, False])
def test_forward_is_eagers_arithmetic(dtype: torch.dtype, norm: bool) -> None:
    """Qwen3's q/k norm + rope as transformers computes it in a half dtype (every op rounds its
    result): the kernel rounds at the same places, so its outputs equal eager's except where the
    norm's fp32 statistics straddle a rounding boundary. Rounded once at the end, a large share
    of them differ."""
    B, S, Hq, Hk, D = 2, 24, 4, 2, 64
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, S, Hq, D, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(B, S, Hk, D, generator=gen).to(dtype).to(DEVICE)
    ang = torch.randn(S, D // 2, generator=gen)
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[None].to(dtype).to(DEVICE), emb.sin()[None].to(dtype).to(DEVICE)
    qw = (torch.rand(D, generator=gen) * 2).to(dtype).to(DEVICE)
    kw = (torch.rand(D, generator=gen) * 2).to(dtype).to(DEVICE)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)

    def eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if norm:  # Qwen3RMSNorm
            h = x.float()
            x = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        x = x.transpose(1, 2)
        return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)

    got = R.rope(q, k, cos, sin, qw if norm else None, kw if norm else None, 1e-6, norm=norm,
                 round_before_weight=norm, heads_first=True)
    for out, x, w in zip(got, (q, k), (qw, kw), strict=True):
        want = eager(x, w)
        differ = (out != want).float().mean().item()
        assert differ < 2e-3, f"{differ:.2%} of the outputs differ from eager's"
        if not norm:
            assert torch.equal(out, want)
        # the same products and sum computed in fp32 and rounded once
        xn = x.float()
        if norm:
            xn = (xn * torch.rsqrt(xn.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float() * w.float()
        xn = xn.transpose(1, 2)
        once = (xn * cos.float().unsqueeze(1) + rotate_half(xn) * sin.float().unsqueeze(1)).to(dtype)
        assert (once != want).float().mean().item() > 0.1
