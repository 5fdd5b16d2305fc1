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
from typing import Any

import torch
import triton
import triton.language as tl

from solforge.kernels import direct, torch_order
from solforge.kernels.launch import Meta, sm_count
from solforge.kernels.launch import launch as _launch
from solforge.kernels.rope_base import (  # noqa: F401  (re-exported: rope.py was all of this family)
    _ABBREV,
    _DEFAULT_PROGS,
    _INTERPRETED,
    _MAX_PER_THREAD,
    _POW2,
    _PROGS,
    _SUPPORTED,
    _WARPS,
    FAMILY,
    VARIANTS,
    Config,
    Pair,
    _bad,
    _cast,
    _check,
    _checked_config,
    _common,
    _cs_strides,
    _dims,
    _dmask,
    _elems,
    _load_cs,
    _new_out,
    _offsets,
    _ref_one,
    _rows,
    _sig,
    _tiles,
    _token_block,
    _token_major,
    bwd_heuristic,
    bwd_space,
    heuristic,
    is_valid,
    make_inputs,
    rope_ref,
    verify_rows,
    workload_for,
)
from solforge.kernels.rounding import as_stored
from solforge.kernels.torch_order import head_sumsq_128, rstd_of
from solforge.numerics import Tolerance, parse_dtype, tolerance
from solforge.records import Workload

# The reference, the Triton and launch helpers the backward shares, the config triad (but the
# forward's `space`), workload_for and make_inputs are in kernels/rope_base.py, imported above.


# ----------------------------------------------------------------------------------------------
# Triton kernels. A program owns a [TOKENS, HEADS, D/2] tile twice (the two halves of each row):
# rotate_half is then plain arithmetic between the halves. Grid axis 1 enumerates the head blocks
# of q, then those of k, so one launch covers both tensors and each program reads the cos/sin rows
# of its tokens once for HEADS heads.


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


def space(workload: Workload) -> list[Config]:
    """The forward's: every tile of `_tiles`, one program per tile or in the persistent kernel
    (4 or 8 programs per SM, the next token block loaded ahead): ~150 configs at Qwen3's shapes."""
    return [dataclasses.replace(c, progs=p, stages=st) for c in _tiles(workload)
            for p, st in ((0, 1), (4, 2), (8, 2))]


def backward_workload(workload: Workload) -> Workload:
    """The workload of this call's backward (family rope_bwd, kernels/rope_bwd.py): the same
    shapes, dtypes and options, which are all the backward kernel depends on (the incoming grads
    have the outputs' layout, set by heads_first, and out_dtype)."""
    return dataclasses.replace(workload, family=f"{FAMILY}_bwd")


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


# the backward's kernels and launcher live in kernels/rope_bwd.py; it does not import this file (what
# both use is in rope_base.py), so the dependency runs one way
from solforge.kernels import rope_bwd as _bwd  # noqa: E402
