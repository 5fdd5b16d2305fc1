"""RoPE family: rotary position embedding of q and k in one launch, optionally fused with the
per-head RMSNorm that Qwen3 applies right before it (q_norm / k_norm over head_dim).

    n   = rmsnorm(x, weight, eps) over D            (only with norm=True; else n = x)
    out = n * cos + rotate_half(n) * sin            rotate_half(n) = cat(-n[D/2:], n[:D/2])

for x = q (B, S, Hq, D) and x = k (B, S, Hk, D), with cos, sin of shape (Bc, S, D) or (S, D),
Bc in {1, B}, shared by every head. Nothing is materialized: a program loads the two halves of
its rows and of cos/sin, and stores the two halves of the result, so q and k cross memory once.

Layout. The op takes q and k token-major, (B, S, H, D), as a projection writes them (any strides,
last dim contiguous); that is the tensor the graph has before Hugging Face's `.transpose(1, 2)`
(and before the norm, when it is fused). With heads_first=True (the HF form) the outputs are
(B, H, S, D) with the strides of a transposed (B, S, H, D)-contiguous tensor: exactly the values,
shape and strides that eager HF produces for q_embed/k_embed, and what SDPA reads. With
heads_first=False they are (B, S, H, D) contiguous (models that rotate before transposing).

Numerics. Every kernel loads the native dtype and computes in fp32, rounding where the model's ops
store a half-dtype result: after the norm (`round_before_weight`), after the weight multiply, after
each rope product and after their sum. Products of half-dtype values are exact in fp32, so from the
norm's output on this is eager's arithmetic bit for bit. The norm's statistic is eager's too for a
head of 128 (summed in torch's order, kernels/torch_order.py); other head sizes sum in the
kernel's own order and may land an ulp apart. Rounding once at the end instead (fewer roundings,
but not the model's function) changed 40% of the bf16 outputs of Qwen3's q/k norm + rope against
eager's on random inputs.

Backward: dq_in, dk_in (through the rope and, when fused, the norm) and dq_weight, dk_weight.
Gradients with respect to cos and sin are not computed: HF builds them from positions under
no_grad. Rather than return a silently wrong None, the backward raises if cos or sin requires grad.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from solforge.kernels import config_text, direct, torch_order
from solforge.kernels.interp import INTERPRETED, cast_rne
from solforge.kernels.launch import Meta, sm_count
from solforge.kernels.launch import launch as _launch
from solforge.kernels.rounding import as_stored
from solforge.kernels.torch_order import head_sumsq_128, rstd_of
from solforge.numerics import Tolerance, dtype_name, input_generator, parse_dtype, tolerance
from solforge.records import Workload
from solforge.runtime.shapes import hint

FAMILY = "rope"

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
Pair = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Reference


def _ref_one(x: torch.Tensor, w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
             norm: bool, round_before_weight: bool, heads_first: bool, out_dtype: torch.dtype) -> torch.Tensor:
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32

    def stored(t: torch.Tensor) -> torch.Tensor:
        """t as a half-dtype output stores it (the model's ops round each result); the gradient
        passes unrounded, so the backward's reference is the unrounded function's."""
        if out_dtype not in (torch.bfloat16, torch.float16):
            return t
        return t + (t.to(out_dtype).to(acc) - t).detach()

    n = x.to(acc)
    if norm:
        n = n * torch.rsqrt(n.pow(2).mean(dim=-1, keepdim=True) + eps)
        if round_before_weight:
            n = n.to(x.dtype).to(acc)
        if w is not None:
            n = n * w.to(acc)
        n = stored(n)
    c, s = cos.to(acc).unsqueeze(-2), sin.to(acc).unsqueeze(-2)  # (.., S, 1, D): one per head
    h = x.shape[-1] // 2
    out = (stored(n * c) + stored(torch.cat((-n[..., h:], n[..., :h]), dim=-1) * s)).to(out_dtype)
    return out.transpose(1, 2) if heads_first else out


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             norm: bool = False, round_before_weight: bool = False, heads_first: bool = True,
             out_dtype: torch.dtype | None = None) -> Pair:
    """The function every kernel must compute, in fp32 (fp64 for fp32 inputs); differentiable, so
    it is the backward's reference too. `round_before_weight` rounds the normalized value to the
    input dtype before the weight multiply, as HF's RMSNorm does. With a half output dtype the
    norm's output, each rope product and their sum are rounded to it, as the model's ops store
    them (the backward treats those roundings as the identity)."""
    od = out_dtype or q.dtype
    return (_ref_one(q, q_weight, cos, sin, eps, norm, round_before_weight, heads_first, od),
            _ref_one(k, k_weight, cos, sin, eps, norm, round_before_weight, heads_first, od))


# ----------------------------------------------------------------------------------------------
# Triton kernels. A program owns a [TOKENS, HEADS, D/2] tile twice (the two halves of each row):
# rotate_half is then plain arithmetic between the halves. Grid axis 1 enumerates the head blocks
# of q, then those of k, so one launch covers both tensors and each program reads the cos/sin rows
# of its tokens once for HEADS heads.


# The interpreter's bf16 cast truncates; `_cast` rounds to nearest even there too, so CPU tests
# compare the function the GPU computes (interp.cast_rne).
_INTERPRETED = INTERPRETED
_cast = cast_rne


@triton.jit
def _offsets(b, s, heads, sb, ss, sh):
    """[T, H, 1] element offsets (int64: B*S*H*D passes 2^31 at long contexts)."""
    return (b.to(tl.int64) * sb + s.to(tl.int64) * ss)[:, None, None] + heads.to(tl.int64)[None, :, None] * sh


@triton.jit
def _load_cs(c_ptr, b, s, scb, scs, d, m, D2: tl.constexpr):
    """cos or sin halves of these tokens as fp32 [T, 1, BLOCK]."""
    off = (b.to(tl.int64) * scb + s.to(tl.int64) * scs)[:, None, None] + d
    lo = tl.load(c_ptr + off, mask=m, other=0.0).to(tl.float32)
    hi = tl.load(c_ptr + off + D2, mask=m, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _token_block(tb, n_tok, S, cos_ptr, sin_ptr, scb, scs, ssb, sss, D2: tl.constexpr, BLOCK: tl.constexpr,
                 TOKENS: tl.constexpr):
    """Token block `tb`: batch and position of each token, its mask, the half-row lanes and their
    mask, and the cos/sin halves of each token (forward and backward share this)."""
    tok = tb * TOKENS + tl.arange(0, TOKENS)
    tmask = tok < n_tok
    b = tok // S
    s = tok - b * S
    d = tl.arange(0, BLOCK)[None, None, :]
    dmask = _dmask(d, D2, BLOCK)
    cm = tmask[:, None, None] & dmask
    c1, c2 = _load_cs(cos_ptr, b, s, scb, scs, d, cm, D2)
    s1, s2 = _load_cs(sin_ptr, b, s, ssb, sss, d, cm, D2)
    return b, s, tmask, d, dmask, c1, c2, s1, s2


@triton.jit
def _dmask(d, D2: tl.constexpr, BLOCK: tl.constexpr):
    """Column mask; a constant true one when D/2 is a power of two, so loads stay vectorized."""
    if BLOCK == D2:
        m = tl.full([1, 1, BLOCK], 1, tl.int1)
    else:
        m = d < D2
    return m


_TORCH_ORDER = tl.constexpr(torch_order.ENABLED)


@triton.jit
def _rstd(x1, x2, eps, D2: tl.constexpr):
    """The q/k norm's rstd. A head of 128 (Qwen3's) sums its squares in torch's order
    (kernels/torch_order.py), as eager's `pow(2).mean(-1)` does: bit for bit its statistic."""
    if D2 == 64 and _TORCH_ORDER:
        ss = head_sumsq_128(x1, x2)
    else:
        ss = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)
    return rstd_of(ss, 2 * D2, eps)[:, :, None]


@triton.jit
def _fwd_tile(x_ptr, w_ptr, o_ptr, sxb, sxs, sxh, sob, sos, soh, H, head0, b, s, tmask, d, dmask,
              c1, c2, s1, s2, eps, D2: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr):
    heads = head0 + tl.arange(0, HEADS)
    m = tmask[:, None, None] & (heads < H)[None, :, None] & dmask
    xp = x_ptr + _offsets(b, s, heads, sxb, sxs, sxh) + d
    x1 = tl.load(xp, mask=m, other=0.0)
    x2 = tl.load(xp + D2, mask=m, other=0.0)
    _fwd_store(x1, x2, c1, c2, s1, s2, x_ptr, w_ptr, o_ptr + _offsets(b, s, heads, sob, sos, soh) + d, m, d, dmask,
               eps, D2, NORM, HAS_WEIGHT, ROUND)


@triton.jit
def _fwd_store(x1, x2, c1, c2, s1, s2, x_ptr, w_ptr, op, m, d, dmask, eps, D2: tl.constexpr, NORM: tl.constexpr,
               HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr):
    """Norm (optional), weight and rotation of loaded x halves in fp32; the two halves stored at op."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM:
        r = _rstd(x1, x2, eps, D2)
        x1 = x1 * r
        x2 = x2 * r
        if ROUND:  # HF rounds the normalized value to the input dtype before the weight
            x1 = as_stored(x1, x_ptr.dtype.element_ty)
            x2 = as_stored(x2, x_ptr.dtype.element_ty)
        if HAS_WEIGHT:
            x1 = x1 * tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            x2 = x2 * tl.load(w_ptr + D2 + d, mask=dmask, other=0.0).to(tl.float32)
        x1 = as_stored(x1, op.dtype.element_ty)  # the norm's output, as the model stores it
        x2 = as_stored(x2, op.dtype.element_ty)
    # each product rounded as the model's mul stores it, then their sum: with half-dtype operands
    # the products are exact in fp32, so this is eager's arithmetic, not an approximation of it
    od = op.dtype.element_ty
    tl.store(op, _cast(as_stored(x1 * c1, od) - as_stored(x2 * s1, od), od), mask=m)
    tl.store(op + D2, _cast(as_stored(x2 * c2, od) + as_stored(x1 * s2, od), od), mask=m)


@triton.jit
def _rope_fwd_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, n_tok, S, Hq, Hk, n_qb,
                     sqb, sqs, sqh, skb, sks, skh, scb, scs, ssb, sss, sqob, sqos, sqoh, skob, skos, skoh, eps,
                     D2: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr,
                     NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr):
    hb = tl.program_id(1)
    b, s, tmask, d, dmask, c1, c2, s1, s2 = _token_block(tl.program_id(0), n_tok, S, cos_ptr, sin_ptr, scb, scs,
                                                         ssb, sss, D2, BLOCK, TOKENS)
    if hb < n_qb:
        _fwd_tile(q_ptr, qw_ptr, qo_ptr, sqb, sqs, sqh, sqob, sqos, sqoh, Hq, hb * HEADS, b, s, tmask, d, dmask,
                  c1, c2, s1, s2, eps, D2, HEADS, NORM, HAS_WEIGHT, ROUND)
    else:
        _fwd_tile(k_ptr, kw_ptr, ko_ptr, skb, sks, skh, skob, skos, skoh, Hk, (hb - n_qb) * HEADS, b, s, tmask,
                  d, dmask, c1, c2, s1, s2, eps, D2, HEADS, NORM, HAS_WEIGHT, ROUND)


@triton.jit
def _fwd_load(tb, x_ptr, cos_ptr, sin_ptr, n_tok, S, H, head0, sxb, sxs, sxh, scb, scs, ssb, sss, D2: tl.constexpr,
              BLOCK: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr):
    """cos/sin halves (fp32) and x's halves (its own dtype) of token block `tb` (persistent forward)."""
    b, s, tmask, d, dmask, c1, c2, s1, s2 = _token_block(tb, n_tok, S, cos_ptr, sin_ptr, scb, scs, ssb, sss, D2,
                                                         BLOCK, TOKENS)
    heads = head0 + tl.arange(0, HEADS)
    m = tmask[:, None, None] & (heads < H)[None, :, None] & dmask
    xp = x_ptr + _offsets(b, s, heads, sxb, sxs, sxh) + d
    return c1, c2, s1, s2, tl.load(xp, mask=m, other=0.0), tl.load(xp + D2, mask=m, other=0.0)


@triton.jit
def _fwd_loop(pid, n_progs, n_iter, x_ptr, cos_ptr, sin_ptr, w_ptr, o_ptr, n_tok, S, H, head0, sxb, sxs, sxh, scb,
              scs, ssb, sss, sob, sos, soh, eps, D2: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
              HEADS: tl.constexpr, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr,
              STAGES: tl.constexpr):
    """One program's grid-stride loop over token blocks for one head block; STAGES == 2 loads the
    next block before computing this one."""
    cur = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if STAGES > 1:
        cur = _fwd_load(pid, x_ptr, cos_ptr, sin_ptr, n_tok, S, H, head0, sxb, sxs, sxh, scb, scs, ssb, sss, D2, BLOCK,
                        TOKENS, HEADS)
    i = 0
    while i < n_iter:  # a while loop: the interpreter runs it too (triton#9171), and it compiles the same
        tb = pid + i * n_progs
        loaded = cur
        if STAGES > 1:
            cur = _fwd_load(tb + n_progs, x_ptr, cos_ptr, sin_ptr, n_tok, S, H, head0, sxb, sxs, sxh, scb, scs, ssb,
                            sss, D2, BLOCK, TOKENS, HEADS)
        else:
            loaded = _fwd_load(tb, x_ptr, cos_ptr, sin_ptr, n_tok, S, H, head0, sxb, sxs, sxh, scb, scs, ssb, sss, D2,
                               BLOCK, TOKENS, HEADS)
        c1, c2, s1, s2, x1, x2 = loaded
        tok = tb * TOKENS + tl.arange(0, TOKENS)
        b = tok // S
        s = tok - b * S
        d = tl.arange(0, BLOCK)[None, None, :]
        dmask = _dmask(d, D2, BLOCK)
        heads = head0 + tl.arange(0, HEADS)
        m = (tok < n_tok)[:, None, None] & (heads < H)[None, :, None] & dmask
        _fwd_store(x1, x2, c1, c2, s1, s2, x_ptr, w_ptr, o_ptr + _offsets(b, s, heads, sob, sos, soh) + d, m, d,
                   dmask, eps, D2, NORM, HAS_WEIGHT, ROUND)
        i += 1


@triton.jit
def _rope_fwd_persistent_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, n_tok, S, Hq, Hk,
                                n_qb, n_iter, n_progs, sqb, sqs, sqh, skb, sks, skh, scb, scs, ssb, sss, sqob, sqos,
                                sqoh, skob, skos, skoh, eps, D2: tl.constexpr, BLOCK: tl.constexpr,
                                TOKENS: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr,
                                HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr, STAGES: tl.constexpr):
    """Forward with `progs` > 0: grid (n_progs, head blocks of q then k), each program walking
    token blocks (the backward's layout, without the weight gradient)."""
    pid = tl.program_id(0)
    hb = tl.program_id(1)
    if hb < n_qb:
        _fwd_loop(pid, n_progs, n_iter, q_ptr, cos_ptr, sin_ptr, qw_ptr, qo_ptr, n_tok, S, Hq, hb * HEADS, sqb, sqs,
                  sqh, scb, scs, ssb, sss, sqob, sqos, sqoh, eps, D2, BLOCK, TOKENS, HEADS, NORM, HAS_WEIGHT, ROUND,
                  STAGES)
    else:
        _fwd_loop(pid, n_progs, n_iter, k_ptr, cos_ptr, sin_ptr, kw_ptr, ko_ptr, n_tok, S, Hk, (hb - n_qb) * HEADS,
                  skb, sks, skh, scb, scs, ssb, sss, skob, skos, skoh, eps, D2, BLOCK, TOKENS, HEADS, NORM,
                  HAS_WEIGHT, ROUND, STAGES)


# ----------------------------------------------------------------------------------------------
# Launchers


def _bad(msg: str) -> ValueError:
    return ValueError(f"solforge rope: {msg}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with a contiguous last dim (the kernels address rows through strides)."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _cs_strides(c: torch.Tensor, name: str, B: int, S: int, D: int) -> tuple[torch.Tensor, int, int]:
    """cos/sin as (tensor, batch stride, seq stride); batch stride 0 when shared by the batch."""
    if c.dim() not in (2, 3) or tuple(c.shape[-2:]) != (S, D) or (c.dim() == 3 and c.shape[0] not in (1, B)):
        raise _bad(f"{name} must have shape (S, D), (1, S, D) or (B, S, D) = (..., {S}, {D}); got {tuple(c.shape)}")
    c = _rows(c)
    sb = c.stride(0) if c.dim() == 3 and c.shape[0] == B and B > 1 else 0
    return c, sb, c.stride(-2)


def _new_out(B: int, S: int, H: int, D: int, dtype: torch.dtype, device: torch.device,
             heads_first: bool) -> torch.Tensor:
    """(B, S, H, D)-contiguous memory; seen as (B, H, S, D) when heads_first (HF's layout)."""
    if heads_first:
        return torch.empty_strided((B, H, S, D), (S * H * D, D, H * D, 1), dtype=dtype, device=device)
    return torch.empty((B, S, H, D), dtype=dtype, device=device)


def _token_major(t: torch.Tensor, heads_first: bool) -> torch.Tensor:
    return _rows(t.transpose(1, 2) if heads_first else t)


def _check(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
           norm: bool) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise _bad(f"q and k must be (B, S, H, D) with the same B, S, D; got {tuple(q.shape)}, {tuple(k.shape)}")
    B, S, Hq, D = (int(v) for v in q.shape)
    if D % 2:
        raise _bad(f"head_dim must be even (rotate_half splits it); got {D}")
    if q.dtype not in _SUPPORTED or k.dtype != q.dtype:
        raise _bad(f"q and k must share a dtype among bf16, fp16, fp32; got {q.dtype}, {k.dtype}")
    if q.device.type != "cuda" and not _INTERPRETED:
        raise _bad(f"q is on {q.device}; the Triton kernels need CUDA tensors "
                   "(or TRITON_INTERPRET=1 set before triton is imported, for CPU tests)")
    if (q_weight is None) != (k_weight is None) or (q_weight is not None and not norm):
        raise _bad("pass both q_weight and k_weight or neither, and weights only with norm=True")
    for w in (q_weight, k_weight):
        if w is not None and (tuple(w.shape) != (D,) or w.dtype not in _SUPPORTED):
            raise _bad(f"norm weights must be 1-D of size {D} in bf16/fp16/fp32; got {tuple(w.shape)} {w.dtype}")
    return B, S, Hq, int(k.shape[2]), D


def _common(cfg: Config, D: int) -> dict[str, Any]:
    return dict(D2=D // 2, BLOCK=triton.next_power_of_2(D // 2), TOKENS=cfg.tokens, HEADS=cfg.heads,
                num_warps=cfg.num_warps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
         norm: bool = False, round_before_weight: bool = False, heads_first: bool = True,
         out_dtype: torch.dtype | None = None, config: Config | None = None, out: Pair | None = None) -> Pair:
    """(q_out, k_out) = rope of q and k (each RMS-normalized first when `norm`), one launch.

    q, k: (B, S, H, D) token-major, any strides with a contiguous last dim. Outputs: (B, H, S, D)
    views of (B, S, H, D) memory when heads_first, else (B, S, H, D); `out` (a pair of tensors of
    those shapes, any strides with a contiguous last dim) is written in place when given.
    """
    B, S, Hq, Hk, D = _check(q, k, q_weight, k_weight, norm)
    od = out_dtype or q.dtype
    if od not in _SUPPORTED:
        raise _bad(f"out_dtype {od} is not bf16, fp16 or fp32")
    device = q.device
    if out is None:
        out = (_new_out(B, S, Hq, D, od, device, heads_first), _new_out(B, S, Hk, D, od, device, heads_first))
    for o, H in zip(out, (Hq, Hk), strict=True):
        want = (B, H, S, D) if heads_first else (B, S, H, D)
        if tuple(o.shape) != want or o.dtype != od or o.stride(-1) != 1:
            raise _bad(f"out tensors must have shape {want}, dtype {od} and a contiguous last dim")
    if q.numel() == 0 or k.numel() == 0:
        if q.numel() + k.numel():
            raise _bad("q and k must both be empty or both non-empty")
        return out
    q4, k4 = _rows(q), _rows(k)
    c, scb, scs = _cs_strides(cos, "cos", B, S, D)
    sn, ssb, sss = _cs_strides(sin, "sin", B, S, D)
    qo, ko = (_token_major(o, heads_first) for o in out)
    cfg, meta = _checked_config(_sig(q, k, cos, sin, q_weight, k_weight), float(eps), norm, round_before_weight,
                                heads_first, od, config, q.device.type, backward=False)
    n_tok = B * S
    n_qb, n_kb = triton.cdiv(Hq, cfg.heads), triton.cdiv(Hk, cfg.heads)
    qw = q4 if q_weight is None else _rows(q_weight)  # never read without a weight; any pointer will do
    kw = k4 if k_weight is None else _rows(k_weight)
    n_tb = triton.cdiv(n_tok, cfg.tokens)
    if cfg.progs:  # persistent: `progs` programs per SM in all, each walking token blocks
        progs = max(1, min(n_tb, cfg.progs * sm_count(q.device) // (n_qb + n_kb)))
        _launch(_rope_fwd_persistent_kernel, (progs, n_qb + n_kb),
                (q4, k4, c, sn, qw, kw, qo, ko, n_tok, S, Hq, Hk, n_qb, triton.cdiv(n_tb, progs), progs,
                 *q4.stride()[:3], *k4.stride()[:3], scb, scs, ssb, sss, *qo.stride()[:3], *ko.stride()[:3], eps),
                Meta(meta, STAGES=cfg.stages))
        return out
    _launch(_rope_fwd_kernel, (n_tb, n_qb + n_kb),
            (q4, k4, c, sn, qw, kw, qo, ko, n_tok, S, Hq, Hk, n_qb, *q4.stride()[:3], *k4.stride()[:3], scb, scs,
             ssb, sss, *qo.stride()[:3], *ko.stride()[:3], eps), meta)
    return out


def _sig(*tensors: torch.Tensor | None) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors if t is not None)


@functools.lru_cache(maxsize=1024)
def _checked_config(sig: tuple[Any, ...], eps: float, norm: bool, round_before_weight: bool, heads_first: bool,
                    out_dtype: torch.dtype, config: Config | None, device: str, *,
                    backward: bool) -> tuple[Config, dict[str, Any]]:
    """The config a call runs with (the heuristic when None), checked against its workload, and
    the kernel's constexpr/launch kwargs. Cached per shapes and options: building the Workload and
    the heuristic costs tens of microseconds of Python a call, which at Qwen3-4B's training shape
    was as long as the kernel."""
    metas = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in sig]
    weights = metas[4:] if len(metas) == 6 else [None, None]
    wl = dataclasses.replace(workload_for(*metas[:4], *weights, eps, norm=norm, round_before_weight=round_before_weight,
                                          heads_first=heads_first, out_dtype=out_dtype), device=device)
    cfg = config or (bwd_heuristic(wl) if backward else heuristic(wl))
    if not is_valid(cfg, wl):
        raise _bad(f"config {cfg.encode()} is not valid for {wl.key}")
    meta = Meta(NORM=norm, HAS_WEIGHT=len(sig) == 6, ROUND=norm and round_before_weight,
                **_common(cfg, sig[0][0][3]))
    return cfg, (Meta(meta, STAGES=cfg.stages) if backward else meta)


def rope_bwd(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
             eps: float = 1e-6, *, norm: bool = False, round_before_weight: bool = False, heads_first: bool = True,
             config: Config | None = None, out: tuple[torch.Tensor, ...] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """(dq, dk, dq_weight, dk_weight) for grads of `rope`'s outputs (dweights None without weights),
    by the backward kernel in kernels/rope_bwd.py (`grads` there says more)."""
    return _bwd.grads(grad_q, grad_k, q, k, cos, sin, q_weight, k_weight, eps, norm=norm,
                      round_before_weight=round_before_weight, heads_first=heads_first, config=config, out=out)


# ----------------------------------------------------------------------------------------------
# Config triad

VARIANTS = ("tile",)
_WARPS = (1, 2, 4, 8, 16)
_POW2 = (1, 2, 4, 8, 16, 32, 64)
# fp32 values of x per thread: the two halves of every row of the tile (the backward holds about
# twice as many: grad and x). Past 64 the compiler spills (same budget as kernels/rmsnorm.py).
_MAX_PER_THREAD = 64
_ABBREV = {"tokens": "t", "heads": "h", "num_warps": "w", "progs": "p", "stages": "s"}
# the backward's programs per SM (all head blocks together) when it sums a weight gradient
_PROGS = (1, 2, 4, 8, 16, 32)
_DEFAULT_PROGS = 4


@dataclass(frozen=True)
class Config(config_text.Text):
    """A [tokens, heads, D] tile per program (q heads and k heads in separate programs)."""

    variant: str = "tile"
    tokens: int = 4  # tokens per program: cos/sin rows are loaded once per program
    heads: int = 8  # heads per program
    num_warps: int = 4
    # programs per SM of a grid-stride loop over token blocks. Backward with a weight gradient: each
    # sums one partial dweight row (0: the default, 4). Forward: 0 is one program per tile, > 0 the
    # persistent kernel
    progs: int = 0
    # with a grid-stride loop: 2 loads the next token block before computing this one
    stages: int = 1

    _family, _variants, _abbrev = FAMILY, VARIANTS, _ABBREV
    _always = ("tokens", "heads", "num_warps")  # text form, e.g. "tile:t=4:h=8:w=4" (+ ":p=16")



def _dims(workload: Workload) -> tuple[int, int, int, int]:
    """(tokens B*S, Hq, Hk, D)."""
    (B, S, Hq, D), (_, _, Hk, _) = workload.shapes[0], workload.shapes[1]
    return B * S, Hq, Hk, D


def _elems(c: Config, D: int) -> int:
    return c.tokens * c.heads * triton.next_power_of_2(D // 2) * 2


def is_valid(config: Config, workload: Workload) -> bool:
    """Can this config compute this workload correctly without spilling registers? A tile wider
    than the tensor (more heads than H, more tokens than B*S) would only mask lanes: refused."""
    c = config
    n_tok, Hq, Hk, D = _dims(workload)
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or c.tokens not in _POW2 or c.heads not in _POW2:
        return False
    if (c.progs and c.progs not in _PROGS) or c.stages not in (1, 2):
        return False
    if c.heads > triton.next_power_of_2(max(Hq, Hk)) or c.tokens > triton.next_power_of_2(max(n_tok, 1)):
        return False
    return _elems(c, D) // (32 * c.num_warps) <= _MAX_PER_THREAD


def space(workload: Workload) -> list[Config]:
    """The forward's: every tile of `_tiles`, one program per tile or in the persistent kernel
    (4 or 8 programs per SM, the next token block loaded ahead): ~150 configs at Qwen3's shapes."""
    return [dataclasses.replace(c, progs=p, stages=st) for c in _tiles(workload)
            for p, st in ((0, 1), (4, 2), (8, 2))]


def _tiles(workload: Workload) -> list[Config]:
    """tokens x heads per program (tiles of 2K-8K values) x warps (8-32 values a thread):
    ~50 configs at Qwen3's shapes (fewer where tiles would be wider than the tensor)."""
    n_tok, Hq, Hk, D = _dims(workload)
    out: list[Config] = []
    for heads in _POW2:
        for tokens in _POW2:
            c = Config("tile", tokens, heads, 4)
            elems = _elems(c, D)
            if not (2048 <= elems <= 8192) and not (tokens == 1 and heads == 1):
                continue
            for w in _WARPS:
                per = elems // (32 * w)
                cand = Config("tile", tokens, heads, w)
                if (8 <= per <= 32 or w == 1) and is_valid(cand, workload):
                    out.append(cand)
    if not out:
        out.append(dataclasses.replace(heuristic(workload), progs=0, stages=1))
    return out


def heuristic(workload: Workload) -> Config:
    """Untuned default (always valid): the persistent kernel, 4 programs per SM, the next token
    block loaded ahead; tiles of ~4K values over up to 4 heads, 32 values a thread. From
    tools/rope_fwd_sweep.py on the H100 (2026-11-22, q/k norm with weights, HF layout): 127.0 us at
    B2 S8192 (2.64 TB/s; best 126.5) and 36.2 at B1 S4096 (the best), against 139.4 / 38.1 for the
    earlier guess (t=4:h=8:w=8, one program per tile) and 129.1 / 37.2 for the best tile without
    the loop."""
    n_tok, Hq, Hk, D = _dims(workload)
    heads = min(4, triton.next_power_of_2(max(1, min(Hq, Hk))))
    width = 2 * triton.next_power_of_2(D // 2)
    tokens = max(1, min(4096 // (heads * width), triton.next_power_of_2(max(n_tok, 1)), _POW2[-1]))
    c = Config("tile", tokens, heads, 4)
    w = max(1, min(16, triton.next_power_of_2(_elems(c, D) // (32 * 32))))
    return Config("tile", tokens, heads, w, progs=4, stages=2)


def bwd_space(workload: Workload) -> list[Config]:
    """The backward's configs: the forward's tiles x programs per SM (the latter matters only with
    norm weights, whose gradient the grid-stride loop sums; without them one program per tile) x
    stages (1, or 2: the next token block loaded ahead)."""
    has_w = len(workload.shapes) > 4
    progs = (4, 8, 16, 32) if has_w else (0,)
    out = [dataclasses.replace(c, progs=p, stages=st) for c in _tiles(workload) for p in progs for st in (1, 2)]
    return [c for c in out if is_valid(c, workload)]


def bwd_heuristic(workload: Workload) -> Config:
    """With norm weights (Qwen3's q/k norms): one head and ~2K values a tile, 8 values a thread,
    4 programs per SM. The best of `bwd_space` at both Qwen3-4B shapes on the H100
    (tools/rope_bwd_sweep.py, 2026-11-22): 79.8 us at B1 S4096 and 220.9 us at B2 S8192, where
    the earlier guess below (t=2:h=8:w=8) took 206 us at B1 S4096 in the training step. Swept again
    with the next block loaded ahead (stages 2; -rope-bwd-sweep-s6.json): 77.3 / 209.9 us, within 3%
    of the best (75.4 / 209.3), so it stays.
    Without weights (not swept): the forward's tile halved, one program per tile."""
    n_tok, Hq, Hk, D = _dims(workload)
    if len(workload.shapes) > 4:
        width = 2 * triton.next_power_of_2(D // 2)
        tokens = max(1, min(2048 // width, triton.next_power_of_2(max(n_tok, 1))))
        w = max(1, min(8, triton.next_power_of_2(tokens * width // (32 * 8))))
        cand = Config("tile", tokens, 1, w, progs=4)
        if is_valid(cand, workload):
            return cand
    c = dataclasses.replace(heuristic(workload), progs=0, stages=1)
    if c.tokens > 1:
        return dataclasses.replace(c, tokens=c.tokens // 2)
    if c.heads > 1:
        return dataclasses.replace(c, heads=c.heads // 2)
    return c


def workload_for(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, *, norm: bool,
                 round_before_weight: bool, heads_first: bool, out_dtype: torch.dtype | None = None) -> Workload:
    """The Workload record of one rope call: shapes of q, k (token-major), cos, sin [, weights]."""
    tensors = [q, k, cos, sin] + ([q_weight, k_weight] if q_weight is not None and k_weight is not None else [])
    out_dtype = out_dtype or q.dtype
    shapes = tuple(tuple(hint(d) for d in t.shape) for t in tensors)
    dtypes = tuple(dtype_name(t.dtype) for t in tensors) + (dtype_name(out_dtype),)
    params = (("eps", float(eps)), ("heads_first", bool(heads_first)), ("norm", bool(norm)),
              ("out_dtype", dtype_name(out_dtype)), ("round_before_weight", bool(norm and round_before_weight)))
    return Workload(family=FAMILY, shapes=shapes, dtypes=dtypes, params=params, device=q.device.type)


def backward_workload(workload: Workload) -> Workload:
    """The workload of this call's backward (family rope_bwd, kernels/rope_bwd.py): the same
    shapes, dtypes and options, which are all the backward kernel depends on (the incoming grads
    have the outputs' layout, set by heads_first, and out_dtype)."""
    return dataclasses.replace(workload, family=f"{FAMILY}_bwd")


def verify_rows(workload: Workload) -> int:
    """The verifier's odd shape replaces the sequence length S (see make_inputs' `rows`)."""
    return workload.shapes[0][1]


def output_tolerance(workload: Workload) -> Tolerance:
    """The table's entry for the output dtype, except with round_before_weight in a half dtype.
    There the kernel and the reference round the normalized value y to bf16/fp16 from fp32 values
    that differ in their last bits, so once in a few 10^4 elements they land one ulp of y apart;
    the rope then adds that ulp (times |weight| <= 2 and |cos|, |sin| <= 1) to an output that may
    be near zero, where no relative tolerance helps. One ulp of a |y| below 4 (normalized values
    of random data beyond 4 are ~1e-4 rare) is 2 * eps(dtype): atol = 4 * eps covers weight 2."""
    tol = tolerance(parse_dtype(workload.param("out_dtype", workload.dtypes[0])))
    if workload.param("round_before_weight", False):
        x_dtype = parse_dtype(workload.dtypes[0])
        if x_dtype in (torch.bfloat16, torch.float16):
            tol = Tolerance(max(tol.atol, 4 * torch.finfo(x_dtype).eps), tol.rtol)
    return tol


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `rope` / `rope_ref`; `rows` replaces the sequence length.
    cos/sin are those of random angles (|cos|, |sin| <= 1 as in any rotary table). Small inputs are
    drawn on the CPU from `seed` (the same numbers on any device), large ones on the device
    (numerics.input_generator)."""
    device = device or workload.device
    S = workload.shapes[0][1] if rows is None else rows

    def resized(shape: tuple[int, ...], seq_axis: int) -> tuple[int, ...]:
        return tuple(S if i == seq_axis else d for i, d in enumerate(shape))

    q_shape, k_shape, c_shape = resized(workload.shapes[0], 1), resized(workload.shapes[1], 1), workload.shapes[2]
    c_shape = resized(c_shape, len(c_shape) - 2)
    dt = [parse_dtype(n) for n in workload.dtypes]
    g, where = input_generator(math.prod(q_shape), device, seed)
    q = torch.randn(q_shape, generator=g, device=where).to(dt[0]).to(device)
    k = torch.randn(k_shape, generator=g, device=where).to(dt[1]).to(device)
    theta = torch.rand(c_shape, generator=g, device=where) * 6.2832
    cos, sin = theta.cos().to(dt[2]).to(device), theta.sin().to(dt[3]).to(device)
    qw = kw = None
    if len(workload.shapes) > 4:
        D = q_shape[-1]
        qw = (1.0 + 0.1 * torch.randn(D, generator=g, device=where)).to(dt[4]).to(device)
        kw = (1.0 + 0.1 * torch.randn(D, generator=g, device=where)).to(dt[5]).to(device)
    kwargs = {"norm": bool(workload.param("norm")), "round_before_weight": bool(workload.param("round_before_weight")),
              "heads_first": bool(workload.param("heads_first")),
              "out_dtype": parse_dtype(workload.param("out_dtype", workload.dtypes[0]))}
    return (q, k, cos, sin, qw, kw, float(workload.param("eps", 1e-6))), kwargs


# ----------------------------------------------------------------------------------------------
# Custom ops: what the graph rewrite calls (config: encoded string, "" for the heuristic).
# Library API rather than @custom_op, for the per-call cost (see kernels/rmsnorm.py).

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? q_weight, Tensor? k_weight, float eps, "
            "bool norm, bool round_before_weight, bool heads_first, ScalarType out_dtype, str config) "
            "-> (Tensor, Tensor)")
_LIB.define("rope_bwd(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? q_weight, "
            "Tensor? k_weight, float eps, bool norm, bool round_before_weight, bool heads_first, str config) "
            "-> (Tensor, Tensor, Tensor, Tensor)")


def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
             k_weight: torch.Tensor | None, eps: float, norm: bool, round_before_weight: bool, heads_first: bool,
             out_dtype: torch.dtype, config: str) -> Pair:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return rope(q, k, cos, sin, q_weight, k_weight, eps, norm=norm, round_before_weight=round_before_weight,
                heads_first=heads_first, out_dtype=out_dtype, config=Config.decode(fwd) if fwd else None)


def _rope_fake(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
               k_weight: torch.Tensor | None, eps: float, norm: bool, round_before_weight: bool, heads_first: bool,
               out_dtype: torch.dtype, config: str) -> Pair:
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    return _new_out(B, S, Hq, D, out_dtype, q.device, heads_first), _new_out(B, S, Hk, D, out_dtype, q.device,
                                                                             heads_first)


def _no_weight_grad(w: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    # the schema returns tensors: an empty one stands for "no weight"
    return like.new_empty(0) if w is None else w.new_empty(w.shape)


def _rope_bwd_op(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 norm: bool, round_before_weight: bool, heads_first: bool, config: str) -> tuple[torch.Tensor, ...]:
    dq, dk, dqw, dkw = rope_bwd(grad_q, grad_k, q, k, cos, sin, q_weight, k_weight, eps, norm=norm,
                                round_before_weight=round_before_weight, heads_first=heads_first,
                                config=Config.decode(config) if config else None)
    return dq, dk, q.new_empty(0) if dqw is None else dqw, q.new_empty(0) if dkw is None else dkw


def _rope_bwd_fake(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                   norm: bool, round_before_weight: bool, heads_first: bool, config: str) -> tuple[torch.Tensor, ...]:
    return (q.new_empty(q.shape), k.new_empty(k.shape), _no_weight_grad(q_weight, q), _no_weight_grad(k_weight, q))


_LIB.impl("rope", _rope_op, "CompositeExplicitAutograd")
_LIB.impl("rope_bwd", _rope_bwd_op, "CompositeExplicitAutograd")
torch.library.register_fake("solforge::rope", _rope_fake)
torch.library.register_fake("solforge::rope_bwd", _rope_bwd_fake)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, cos, sin, qw, kw, eps, norm, rbw, heads_first, _out_dtype, config = inputs
    ctx.save_for_backward(q, k, cos, sin, qw, kw)
    # the backward's config: the part after "|" (tuned as family rope_bwd; "" = bwd_heuristic)
    ctx.args = (eps, norm, rbw, heads_first, config.partition("|")[2])


def _backward(ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, cos, sin, qw, kw = ctx.saved_tensors
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise NotImplementedError("solforge rope: gradients with respect to cos/sin are not implemented")
    eps, norm, rbw, heads_first, bwd_config = ctx.args
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    if grad_q is None:
        grad_q = torch.zeros((B, Hq, S, D) if heads_first else q.shape, dtype=q.dtype, device=q.device)
    if grad_k is None:
        grad_k = torch.zeros((B, Hk, S, D) if heads_first else k.shape, dtype=k.dtype, device=k.device)
    dq, dk, dqw, dkw = rope_bwd_call(grad_q, grad_k, q, k, cos, sin, qw, kw, eps, norm, rbw, heads_first,
                                   bwd_config)
    return (dq, dk, None, None, dqw if qw is not None else None, dkw if kw is not None else None,
            None, None, None, None, None, None)


torch.library.register_autograd("solforge::rope", _backward, setup_context=_setup_context)
direct.register(torch.ops.solforge.rope.default, _rope_op, _setup_context, _backward)

rope_op = torch.ops.solforge.rope
rope_bwd_op = torch.ops.solforge.rope_bwd.default
rope_bwd_call = direct.plain(rope_bwd_op, _rope_bwd_op)  # what _backward calls


# the backward's kernels and launcher live in kernels/rope_bwd.py, which imports this file's helpers:
# the module, not its names, so that whichever of the two is imported first works
from solforge.kernels import rope_bwd as _bwd  # noqa: E402
