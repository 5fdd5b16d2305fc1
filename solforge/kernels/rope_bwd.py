"""rope_bwd: the backward of the rope family (kernels/rope.py `rope_bwd`) as a tunable family.

The pattern (swiglu_bwd.py and gelu_bwd.py follow it; wire another family the same way):

  kernels/<family>_bwd.py, an ordinary family module (the interface of solforge/tune/__init__.py
  and tune/verify.py): FAMILY = "<family>_bwd"; Config (the forward's class will do: the op
  decodes the BWD string with it); space(wl), is_valid(c, wl), heuristic(wl) (exactly what the
  backward op runs with config ""); make_inputs(wl, *, seed, rows=None, device=None) -> (args,
  kwargs) with random incoming gradients laid out as the model hands them over; the launcher
  `<family>_bwd(*args, config=, out=, **kwargs)` returning a tuple of tensors and writing into
  `out` when given; `<family>_bwd_ref` (fp32/fp64, e.g. autograd through the forward's reference)
  returning the same tuple, no None items. Optional: output_tolerance(wl) (one per output; a
  reduction such as a weight gradient needs a wider atol), verify_rows(wl) (which size the odd
  shape replaces), baseline_leaves(wl) (which of the region's tensor inputs eager's backward is
  timed for; default every floating-point one). Import the module that holds the code the kernel
  runs (the forward's, or a base module both import, as rope_base.py here), so the database's
  template hash covers it; never the forward module where the forward imports this one (no
  import cycles: tests/test_layout.py).
  kernels/<family>.py: backward_workload(wl) -> Workload | None (family "<family>_bwd" and
  everything the backward kernel depends on); the op impl decodes config.partition("|")[0];
  setup_context keeps config.partition("|")[2]; the backward passes it to the <family>_bwd op.
  Nothing else: plan.backward_groups, api.optimize (train mode) and integrate.Integrator(train=
  True) find families by `backward_workload`.

The config, space and heuristic and the helpers the kernel calls live in kernels/rope_base.py
(its template hash covers that file: importing it makes it part of this family's source). Here: the
fp32 reference (autograd through `rope_ref`), random inputs with the incoming gradients laid out as
the model hands them over, the kernel and its launcher `grads` (which rope.py's op calls), and the
family's launcher with `out=`.

Gradients: dq, dk (B, S, H, D) like q and k, and with norm weights dq_weight, dk_weight (D,).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import triton
import triton.language as tl

from solforge.kernels import rope_base as _rope
from solforge.kernels.launch import launch as _launch
from solforge.kernels.launch import sm_count
from solforge.kernels.reduce import sum2, sum_rows
from solforge.kernels.rope_base import (
    _DEFAULT_PROGS,
    Config,
    _bad,
    _cast,
    _check,
    _checked_config,
    _cs_strides,
    _dmask,
    _offsets,
    _rows,
    _sig,
    _token_block,
    _token_major,
)
from solforge.numerics import Tolerance, input_generator, parse_dtype, tolerance
from solforge.records import Workload

FAMILY = "rope_bwd"

# the forward's Config (imported above): the BWD part of the op's string is decoded by rope.py's op
is_valid = _rope.is_valid
verify_rows = _rope.verify_rows  # the odd shape replaces the sequence length S


def space(workload: Workload) -> list[Config]:
    """The forward's tiles x programs per SM of the weight-gradient loop (rope.bwd_space)."""
    return _rope.bwd_space(workload)


def heuristic(workload: Workload) -> Config:
    """What the op runs with config "" (rope.bwd_heuristic, swept on the H100)."""
    return _rope.bwd_heuristic(workload)


def baseline_leaves(workload: Workload) -> tuple[int, ...]:
    """The region's tensor inputs (q, k, cos, sin[, q_weight, k_weight]) whose gradients the kernel
    computes: eager's backward, the baseline, is timed for the same ones (not cos/sin, which HF
    builds under no_grad)."""
    return (0, 1, 4, 5) if len(workload.shapes) > 4 else (0, 1)


def rope_bwd_ref(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, *, norm: bool = False, round_before_weight: bool = False,
                 heads_first: bool = True) -> tuple[torch.Tensor, ...]:
    """(dq, dk[, dq_weight, dk_weight]) by autograd through `rope_ref` (fp32 inside, fp64 for fp32
    inputs), contiguous, in the inputs' dtypes. cos/sin get no gradient (HF builds them under
    no_grad; the kernel computes none)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, q_weight, k_weight) if t is not None]
    ws = leaves[2:] if q_weight is not None else [None, None]
    with torch.enable_grad():
        out = _rope.rope_ref(leaves[0], leaves[1], cos, sin, ws[0], ws[1], eps, norm=norm,
                             round_before_weight=round_before_weight, heads_first=heads_first,
                             out_dtype=grad_q.dtype)
        grads = torch.autograd.grad(out, leaves, (grad_q, grad_k))
    return tuple(g.contiguous() for g in grads)


def rope_bwd(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
             eps: float = 1e-6, *, norm: bool = False, round_before_weight: bool = False, heads_first: bool = True,
             config: Config | None = None, out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The launcher: `grads` (what rope.rope_bwd runs) as `rope_bwd_ref` returns them (no None items)."""
    dq, dk, dqw, dkw = grads(grad_q, grad_k, q, k, cos, sin, q_weight, k_weight, eps, norm=norm,
                             round_before_weight=round_before_weight, heads_first=heads_first, config=config,
                             out=out)
    return (dq, dk) if dqw is None else (dq, dk, dqw, dkw)


def output_tolerance(workload: Workload) -> tuple[Tolerance, ...]:
    """dq, dk: their dtype's entry (rope.output_tolerance's rounding case does not apply: the
    gradient through a rounding is the identity in both). A weight gradient sums B*S*H products
    whose factors agree to the dtype's tolerance; those errors have random signs, so the sum's
    absolute error grows like sqrt(terms): atol scaled by it (the kernel's fp32 partial sums in
    another order add ~1e-7 x sqrt(terms) relative, far less)."""
    dx = tolerance(parse_dtype(workload.dtypes[0]))
    if len(workload.shapes) <= 4:
        return (dx, dx)
    (B, S, Hq, _), (_, _, Hk, _) = workload.shapes[0], workload.shapes[1]
    out = []
    for H, name in ((Hq, workload.dtypes[4]), (Hk, workload.dtypes[5])):
        t = tolerance(parse_dtype(name))
        out.append(Tolerance(t.atol * math.sqrt(B * S * H), t.rtol))
    return (dx, dx, *out)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `rope_bwd` / `rope_bwd_ref`: rope's inputs (make_inputs of
    the forward workload; `rows` replaces S) after random incoming gradients of the outputs' dtype
    and layout: with heads_first, (B, H, S, D) views of (B, S, H, D)-contiguous memory, the
    forward's output strides, which is what SDPA's backward hands over (as tools/rope_bwd_sweep.py
    measures it); else (B, S, H, D) contiguous."""
    fwd = dataclasses.replace(workload, family=_rope.FAMILY)
    (q, k, cos, sin, qw, kw, eps), opts = _rope.make_inputs(fwd, seed=seed, rows=rows, device=device)
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    out_dtype, heads_first = opts.pop("out_dtype"), opts["heads_first"]
    g, where = input_generator(q.numel(), q.device, seed + 1)
    grads = []
    for H in (Hq, Hk):
        t = _rope._new_out(B, S, H, D, out_dtype, q.device, heads_first)
        t.copy_(torch.randn(t.shape, generator=g, device=where).to(out_dtype))
        grads.append(t)
    return (grads[0], grads[1], q, k, cos, sin, qw, kw, eps), opts


# ----------------------------------------------------------------------------------------------
# The backward kernel (moved here from rope.py, which keeps the forward) and its launcher


@triton.jit
def _bwd_load(tb, g_ptr, x_ptr, cos_ptr, sin_ptr, n_tok, S, H, head0, sgb, sgs, sgh, sxb, sxs, sxh, scb, scs, ssb,
              sss, D2: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr,
              NORM: tl.constexpr):
    """Everything token block `tb` reads: cos/sin halves (fp32), and the grad and x halves in their
    own dtype (x only with the norm). A block past the end (grid-stride tail) is all masked."""
    b, s, tmask, d, dmask, c1, c2, s1, s2 = _token_block(tb, n_tok, S, cos_ptr, sin_ptr, scb, scs, ssb, sss, D2,
                                                         BLOCK, TOKENS)
    heads = head0 + tl.arange(0, HEADS)
    m = tmask[:, None, None] & (heads < H)[None, :, None] & dmask
    gp = g_ptr + _offsets(b, s, heads, sgb, sgs, sgh) + d
    g1 = tl.load(gp, mask=m, other=0.0)
    g2 = tl.load(gp + D2, mask=m, other=0.0)
    x1 = 0.0
    x2 = 0.0
    if NORM:
        xp = x_ptr + _offsets(b, s, heads, sxb, sxs, sxh) + d
        x1 = tl.load(xp, mask=m, other=0.0)
        x2 = tl.load(xp + D2, mask=m, other=0.0)
    return c1, c2, s1, s2, g1, g2, x1, x2


@triton.jit
def _bwd_tile(tb, loaded, x_ptr, w_ptr, dx_ptr, n_tok, S, H, head0, sdb, sds, sdh, eps, D2: tl.constexpr,
              BLOCK: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr):
    """dx of token block `tb` from what `_bwd_load` read, and the tile's share of dweight as two
    [TOKENS, HEADS, BLOCK] tiles of products (zeros without a weight), left unreduced: the caller
    adds them up elementwise over its loop and reduces once at the end (a reduction over tokens and
    heads per tile made the H100 run at 1.5 TB/s).
    Rope: out1 = n1 c1 - n2 s1, out2 = n2 c2 + n1 s2, hence dn1 = g1 c1 + g2 s2, dn2 = g2 c2 - g1 s1.
    Norm: y = x r with r = rsqrt(mean(x^2) + eps); dy = dn w; dx = r (dy - y mean(dy y)); the
    weight gets sum(dn * y) with y rounded as the forward used it (HF: weight * y.to(bf16))."""
    c1, c2, s1, s2, g1, g2, x1, x2 = loaded
    tok = tb * TOKENS + tl.arange(0, TOKENS)
    b = tok // S
    s = tok - b * S
    d = tl.arange(0, BLOCK)[None, None, :]
    heads = head0 + tl.arange(0, HEADS)
    m = (tok < n_tok)[:, None, None] & (heads < H)[None, :, None] & _dmask(d, D2, BLOCK)
    g1 = g1.to(tl.float32)
    g2 = g2.to(tl.float32)
    dn1 = g1 * c1 + g2 * s2
    dn2 = g2 * c2 - g1 * s1
    dw1 = tl.zeros(g1.shape, tl.float32)
    dw2 = tl.zeros(g1.shape, tl.float32)
    if NORM:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        e1 = dn1  # dy = dn w, the gradient of the normalized y
        e2 = dn2
        if HAS_WEIGHT:
            dmask = _dmask(d, D2, BLOCK)
            e1 = dn1 * tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            e2 = dn2 * tl.load(w_ptr + D2 + d, mask=dmask, other=0.0).to(tl.float32)
        # sum(x^2) for r and mean(dy y) = r mean(dy x), over both halves, in one reduction
        ss, dot = sum2(x1 * x1 + x2 * x2, e1 * x1 + e2 * x2, 2)
        r1 = tl.rsqrt(ss / (2 * D2) + eps)
        r = r1[:, :, None]
        y1 = x1 * r
        y2 = x2 * r
        if HAS_WEIGHT:
            if ROUND:
                dw1 = dn1 * _cast(y1, x_ptr.dtype.element_ty).to(tl.float32)
                dw2 = dn2 * _cast(y2, x_ptr.dtype.element_ty).to(tl.float32)
            else:
                dw1 = dn1 * y1
                dw2 = dn2 * y2
        dot = (dot * r1)[:, :, None] / (2 * D2)
        dn1 = r * (e1 - y1 * dot)
        dn2 = r * (e2 - y2 * dot)
    dp = dx_ptr + _offsets(b, s, heads, sdb, sds, sdh) + d
    tl.store(dp, _cast(dn1, dx_ptr.dtype.element_ty), mask=m)
    tl.store(dp + D2, _cast(dn2, dx_ptr.dtype.element_ty), mask=m)
    return dw1, dw2


@triton.jit
def _bwd_step(i, pid, n_progs, cur, acc1, acc2, g_ptr, x_ptr, cos_ptr, sin_ptr, w_ptr, dx_ptr, n_tok, S, H, head0,
              sgb, sgs, sgh, sxb, sxs, sxh, scb, scs, ssb, sss, sdb, sds, sdh, eps, D2: tl.constexpr,
              BLOCK: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr, STAGES: tl.constexpr):
    """Token block pid + i * n_progs. STAGES == 2: `cur` holds it, already loaded, and the next
    block's loads are issued before this one is computed, so a program keeps two in flight."""
    tb = pid + i * n_progs
    loaded = cur
    if STAGES > 1:
        cur = _bwd_load(tb + n_progs, g_ptr, x_ptr, cos_ptr, sin_ptr, n_tok, S, H, head0, sgb, sgs, sgh, sxb, sxs,
                        sxh, scb, scs, ssb, sss, D2, BLOCK, TOKENS, HEADS, NORM)
    else:
        loaded = _bwd_load(tb, g_ptr, x_ptr, cos_ptr, sin_ptr, n_tok, S, H, head0, sgb, sgs, sgh, sxb, sxs, sxh,
                           scb, scs, ssb, sss, D2, BLOCK, TOKENS, HEADS, NORM)
    dw1, dw2 = _bwd_tile(tb, loaded, x_ptr, w_ptr, dx_ptr, n_tok, S, H, head0, sdb, sds, sdh, eps, D2, BLOCK, TOKENS,
                         HEADS, NORM, HAS_WEIGHT, ROUND)
    return cur, acc1 + dw1, acc2 + dw2


@triton.jit
def _bwd_loop(pid, n_progs, n_iter, g_ptr, x_ptr, cos_ptr, sin_ptr, w_ptr, dx_ptr, n_tok, S, H, head0, sgb, sgs,
              sgh, sxb, sxs, sxh, scb, scs, ssb, sss, sdb, sds, sdh, eps, D2: tl.constexpr, BLOCK: tl.constexpr,
              TOKENS: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
              ROUND: tl.constexpr, STAGES: tl.constexpr):
    """One program's grid-stride loop over token blocks, for one head block of q or of k (the
    caller picks the tensors once, so the loop loads from one set of pointers); returns the
    elementwise dweight sums."""
    acc1 = tl.zeros([TOKENS, HEADS, BLOCK], tl.float32)
    acc2 = tl.zeros([TOKENS, HEADS, BLOCK], tl.float32)
    cur = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if STAGES > 1:
        cur = _bwd_load(pid, g_ptr, x_ptr, cos_ptr, sin_ptr, n_tok, S, H, head0, sgb, sgs, sgh, sxb, sxs, sxh, scb,
                        scs, ssb, sss, D2, BLOCK, TOKENS, HEADS, NORM)
    for i in range(0, n_iter):
        cur, acc1, acc2 = _bwd_step(i, pid, n_progs, cur, acc1, acc2, g_ptr, x_ptr, cos_ptr, sin_ptr, w_ptr,
                                    dx_ptr, n_tok, S, H, head0, sgb, sgs, sgh, sxb, sxs, sxh, scb, scs, ssb, sss,
                                    sdb, sds, sdh, eps, D2, BLOCK, TOKENS, HEADS, NORM, HAS_WEIGHT, ROUND, STAGES)
    return acc1, acc2


@triton.jit
def _rope_bwd_kernel(gq_ptr, gk_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, dq_ptr, dk_ptr, dw_ptr,
                     n_tok, S, Hq, Hk, n_qb, n_iter, n_progs, sgqb, sgqs, sgqh, sgkb, sgks, sgkh, sqb, sqs, sqh,
                     skb, sks, skh, scb, scs, ssb, sss, sdqb, sdqs, sdqh, sdkb, sdks, sdkh, eps, D2: tl.constexpr,
                     BLOCK: tl.constexpr, TOKENS: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr, STAGES: tl.constexpr):
    """Grid (n_progs, head blocks of q then k): a grid-stride loop over token blocks, so each
    program sums its share of dweight in registers and writes one partial row (the launcher adds
    the n_progs rows: a few hundred KB, not one row per token)."""
    pid = tl.program_id(0)
    hb = tl.program_id(1)
    if hb < n_qb:
        acc1, acc2 = _bwd_loop(pid, n_progs, n_iter, gq_ptr, q_ptr, cos_ptr, sin_ptr, qw_ptr, dq_ptr, n_tok, S, Hq,
                               hb * HEADS, sgqb, sgqs, sgqh, sqb, sqs, sqh, scb, scs, ssb, sss, sdqb, sdqs, sdqh, eps,
                               D2, BLOCK, TOKENS, HEADS, NORM, HAS_WEIGHT, ROUND, STAGES)
    else:
        acc1, acc2 = _bwd_loop(pid, n_progs, n_iter, gk_ptr, k_ptr, cos_ptr, sin_ptr, kw_ptr, dk_ptr, n_tok, S, Hk,
                               (hb - n_qb) * HEADS, sgkb, sgks, sgkh, skb, sks, skh, scb, scs, ssb, sss, sdkb, sdks,
                               sdkh, eps, D2, BLOCK, TOKENS, HEADS, NORM, HAS_WEIGHT, ROUND, STAGES)
    if NORM and HAS_WEIGHT:
        d = tl.arange(0, BLOCK)
        row = dw_ptr + (hb * n_progs + pid) * (2 * D2)
        tl.store(row + d, tl.sum(tl.sum(acc1, axis=0), axis=0), mask=d < D2)
        tl.store(row + D2 + d, tl.sum(tl.sum(acc2, axis=0), axis=0), mask=d < D2)


def grads(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
             eps: float = 1e-6, *, norm: bool = False, round_before_weight: bool = False, heads_first: bool = True,
             config: Config | None = None, out: tuple[torch.Tensor, ...] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """(dq, dk, dq_weight, dk_weight) for grads of `rope`'s outputs (dweights None without weights),
    the kernel's launcher (rope.rope_bwd and the rope_bwd op call it).
    dq, dk are (B, S, H, D) contiguous like q and k; the weight grads are summed in fp32. `out`
    ((dq, dk) or, with weights, (dq, dk, dq_weight, dk_weight); dq, dk any strides with a
    contiguous last dim) is written in place when given (kernels/rope_bwd.py tunes this)."""
    B, S, Hq, Hk, D = _check(q, k, q_weight, k_weight, norm)
    has_w = q_weight is not None
    if out is not None:
        if len(out) != (4 if has_w else 2) or any(o.shape != t.shape or o.dtype != t.dtype or o.stride(-1) != 1
                                                   for o, t in zip(out[:2], (q, k), strict=True)):
            raise _bad("out must be (dq, dk[, dq_weight, dk_weight]) shaped like q, k with a contiguous last dim")
        dq, dk = out[0], out[1]
    else:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    if q.numel() == 0:
        z = (torch.zeros_like(q_weight), torch.zeros_like(k_weight)) if has_w else (None, None)  # type: ignore[arg-type]
        if out is not None and has_w:
            z = (out[2].zero_(), out[3].zero_())
        return dq, dk, *z
    gq, gk = _token_major(grad_q, heads_first), _token_major(grad_k, heads_first)
    q4, k4 = _rows(q), _rows(k)
    c, scb, scs = _cs_strides(cos, "cos", B, S, D)
    sn, ssb, sss = _cs_strides(sin, "sin", B, S, D)
    cfg, meta = _checked_config(_sig(q, k, cos, sin, q_weight, k_weight), float(eps), norm, round_before_weight,
                                heads_first, grad_q.dtype, config, q.device.type, backward=True)
    n_tok = B * S
    n_qb, n_kb = triton.cdiv(Hq, cfg.heads), triton.cdiv(Hk, cfg.heads)
    n_tb = triton.cdiv(n_tok, cfg.tokens)
    # With a weight gradient: a grid-stride loop, `progs` programs per SM in all (config), each
    # writing one partial dweight row.
    per_sm = cfg.progs or _DEFAULT_PROGS
    progs = max(1, min(n_tb, per_sm * sm_count(q.device) // (n_qb + n_kb))) if has_w else n_tb
    dw = torch.empty(((n_qb + n_kb) * progs, D), dtype=torch.float32, device=q.device) if has_w else q4
    qw = q4 if q_weight is None else _rows(q_weight)
    kw = k4 if k_weight is None else _rows(k_weight)
    _launch(_rope_bwd_kernel, (progs, n_qb + n_kb),
            (gq, gk, q4, k4, c, sn, qw, kw, dq, dk, dw, n_tok, S, Hq, Hk, n_qb, triton.cdiv(n_tb, progs), progs,
             *gq.stride()[:3], *gk.stride()[:3], *q4.stride()[:3], *k4.stride()[:3], scb, scs, ssb, sss,
             *dq.stride()[:3], *dk.stride()[:3], eps), meta)
    if not has_w:
        return dq, dk, None, None
    # the partial rows of both weights summed, and cast to their dtypes, in one launch
    outs = out[2:] if out is not None else (torch.empty_like(q_weight), torch.empty_like(k_weight))  # type: ignore[arg-type]
    dqw, dkw = sum_rows(dw, (0, n_qb * progs, (n_qb + n_kb) * progs), outs)
    return dq, dk, dqw, dkw
