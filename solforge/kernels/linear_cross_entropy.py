"""Linear + cross-entropy family: an LM head's projection and its loss, without the (rows, V) logits.

    logits = hidden @ weight.T (+ bias)          in the input dtype (the model's lm_head rounds here)
    loss   = cross_entropy(logits.float(), labels, ignore_index, reduction)   mean or sum

At Qwen3's vocabulary (V = 151936) the logits of 8192 tokens are 2.5 GB in bf16, and the loss as a
model computes it adds an fp32 copy (5 GB), the log-softmax (5 GB) and in training its gradient
(5 GB). Here the rows go through in chunks of `Config.rows`: one reused (rows, V) buffer takes
each chunk's logits (torch.mm / addmm in the input dtype, so they round exactly as the model's),
one Triton program per row computes its logsumexp and loss (kernels/cross_entropy.py's loads and
gradient step) and, when gradients are wanted, overwrites the row in place with
dloss/dlogits = (softmax - onehot) * scale (1 / #valid rows for the mean, 1 for the sum, 0 on
ignored rows). The chunk's gradients follow at once while it is in the buffer:

    dhidden[chunk] = dlogits @ weight;  dweight += dlogits.T @ hidden[chunk];  dbias += dlogits.sum(0)

so the forward returns the loss together with dhidden, dweight and dbias, and the backward only
multiplies them by the incoming (scalar) gradient. Peak memory is the chunk buffer plus the
gradients: O(rows x V + V x H), never O(N x V). Without gradients (inference, no_grad) only the
projection and the loss run.

Which gradients to compute is an argument (`grads`, bits GRAD_HIDDEN | GRAD_WEIGHT | GRAD_BIAS):
the graph rewrite knows it (capture records grad mode and each input's requires_grad, both of
which dynamo guards on). A frozen lm_head skips the dweight GEMM; a tied embedding's weight gets
dweight like any other, and autograd adds it to the embedding's own gradient. Should autograd ask
for a gradient the forward did not compute, the backward computes it again from saved inputs.

dweight sums over every chunk; each GEMM accumulates in fp32 and the result must be rounded to the
weight's dtype once (lce_grads.DWeight). One chunk (rows >= N: the compile-like point, one buffer
of N x V) is three GEMMs, dweight written by cuBLAS in the weight's dtype: exactly eager's
arithmetic, no accumulator. Over several chunks the first writes dweight's storage directly (no
zero-fill) and the variant says how the rest add: "fp32" forms each product in fp32
(torch.mm(out_dtype=float32), in 256 MB slices) and adds it into an fp32 buffer, cast once at the
end (per chunk after the first: an extra 4.7 GB of traffic at Qwen3-4B, ~1.5 ms); "native" lets
cuBLAS add into the dweight in the input dtype (beta = 1; Liger's way): no extra memory or pass,
but the running sum is rounded once per chunk, and a column whose chunks cancel keeps the error of
the largest one (it failed verification at Qwen3-4B's head; the heuristic never picks it). The
verifier decides what is accurate enough. lce_model.py estimates each config's time and peak
memory; the heuristic takes the fastest within the unchunked graph's peak.

A third variant, "rmw" (a Triton GEMM adding each chunk's fp32 product into a running sum kept as
dweight's bf16 bits plus a plane of their low halves), was measured on the H100 and removed: at
4096 rows it took 16.2-16.7 ms against 14.6 ms for one chunk, and its sums were less exact than
the fp32 sum rounded once (elements beyond 2^-7 relative).

The backward multiplies the saved gradients by the incoming one in place, reading it on the device
and skipping the pass when it is 1 (lce_grads.scale_in_place); traced (torch.compile), it multiplies
out of place.

fp16 note: the gradients are scaled by 1/#valid before the incoming gradient is known, so a
GradScaler's large loss scale cannot keep small fp16 dlogits from underflowing as it does in eager.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from solforge.kernels import config_text, direct, lce_grads, lce_model
from solforge.kernels.cross_entropy import _grad_chunk, _ld
from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch
from solforge.numerics import Tolerance, dtype_name, input_generator, parse_dtype, tolerance
from solforge.records import Workload
from solforge.runtime.shapes import hint

FAMILY = "linear_cross_entropy"

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_TARGETS = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum")  # "none" needs a gradient per row, known only in the backward
GRAD_HIDDEN, GRAD_WEIGHT, GRAD_BIAS = 1, 2, 4


# ----------------------------------------------------------------------------------------------
# Reference


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             labels: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                             out_dtype: torch.dtype | None = None, grads: int = 0
                             ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The loss (out_dtype) and, for each bit of `grads`, the gradient (dhidden, dweight, dbias in
    their inputs' dtypes): the logits rounded to the input dtype as the model's lm_head rounds them
    (computed exactly, then rounded once: what a GEMM with an fp32 accumulator gives up to the
    accumulation order), then everything in fp32 (fp64 for fp32 inputs) by autograd. The logits'
    gradient is rounded to the input dtype before the gradient GEMMs, as in the model: the backward
    of its `logits.float()` casts that gradient back to the logits' dtype. Against an unrounded
    reference the H100 rejected every config at 8192 rows (2026-11-22: seven dweight elements 2.2e-6
    off at 3.6e-5), for error the model itself makes."""
    acc = torch.float64 if hidden.dtype == torch.float32 else torch.float32
    H = hidden.shape[-1]
    h2 = hidden.reshape(-1, H)
    with torch.no_grad():  # (fp32 GEMMs of bf16/fp16 values are exact products, summed in fp32)
        logits = F.linear(h2.to(acc), weight.to(acc), None if bias is None else bias.to(acc)).to(hidden.dtype)
    with torch.enable_grad():
        x = logits.to(acc).requires_grad_(bool(grads))
        loss = F.cross_entropy(x, labels.reshape(-1).long(), ignore_index=ignore_index, reduction=reduction)
        out = loss.detach().to(out_dtype or hidden.dtype)
        if not grads:
            return out
        (dx,) = torch.autograd.grad(loss, [x])
    dx = dx.to(hidden.dtype).to(acc)
    outs = [out]
    if grads & GRAD_HIDDEN:
        outs.append((dx @ weight.to(acc)).reshape(hidden.shape).to(hidden.dtype))
    if grads & GRAD_WEIGHT:
        outs.append((dx.T @ h2.to(acc)).to(weight.dtype))
    if grads & GRAD_BIAS and bias is not None:
        outs.append(dx.sum(0).to(bias.dtype))
    return tuple(outs)


# ----------------------------------------------------------------------------------------------
# Triton kernel: the loss of each row of a chunk of logits and, with GRAD, its gradient in place


@triton.jit
def _lse_fold(x_row, off, V, mv, sv, BLOCK: tl.constexpr, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """cross_entropy's online logsumexp step, with the eviction policy a parameter: the gradient
    pass reads the row again, so the first pass leaves it in L2 then."""
    cols = off + tl.arange(0, BLOCK)
    x = _ld(x_row + cols, cols, V, -float("inf"), EVEN, EVICT)
    new = tl.maximum(mv, x)
    safe = tl.where(new == -float("inf"), 0.0, new)
    return new, sv * tl.exp(mv - safe) + tl.exp(x - safe)


@triton.jit
def _lce_rows_kernel(x_ptr, t_ptr, loss_ptr, scale_ptr, V, stride_x, ignore_index, BLOCK: tl.constexpr,
                     EVEN: tl.constexpr, INTERP: tl.constexpr, GRAD: tl.constexpr, EVICT: tl.constexpr):
    """One row per program: loss = logsumexp(x) - x[t] (0 on ignored rows, NaN for a target outside
    [0, V)); with GRAD, x is overwritten by (softmax(x) - onehot(t)) * scale."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    mv = tl.full([BLOCK], -float("inf"), tl.float32)
    sv = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(0, V, BLOCK):
        mv, sv = _lse_fold(x_row, off, V, mv, sv, BLOCK, EVEN, EVICT)
    mx = tl.max(mv, axis=0)
    safe = tl.where(mx == -float("inf"), 0.0, mx)
    lse = safe + tl.log(tl.sum(tl.where(mv == -float("inf"), 0.0, sv * tl.exp(mv - safe)), axis=0))
    t = tl.load(t_ptr + row).to(tl.int64)
    inside = (t >= 0) & (t < V)
    xt = tl.load(x_row + tl.where(inside, t, 0)).to(tl.float32)  # read before the row is overwritten
    loss = tl.where(inside, lse - xt, float("nan"))
    tl.store(loss_ptr + row, tl.where(t == ignore_index, 0.0, loss))
    if GRAD:
        # where, not a multiply: the mean's 1 / #valid is inf when every target is ignored
        scale = tl.where(t == ignore_index, 0.0, tl.load(scale_ptr))
        for off in tl.range(0, V, BLOCK):
            _grad_chunk(x_row, x_row, off, V, lse, t, scale, BLOCK, EVEN, INTERP)


_INTERPRETED = type(_lce_rows_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Launchers


def _bad(msg: str) -> ValueError:
    return ValueError(f"solforge linear_cross_entropy: {msg}")


def _check(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
           reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden as (N, H), labels as (N,)), checked."""
    if reduction not in REDUCTIONS:
        raise _bad(f"reduction {reduction!r}: one of {REDUCTIONS}")
    if hidden.dtype not in _SUPPORTED or weight.dtype != hidden.dtype or \
            (bias is not None and bias.dtype != hidden.dtype):
        raise _bad(f"hidden {hidden.dtype}, weight {weight.dtype}, bias {None if bias is None else bias.dtype}: "
                   "one dtype of bf16, fp16, fp32")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise _bad(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: need (..., H) and (V, H)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise _bad(f"bias {tuple(bias.shape)} for {weight.shape[0]} classes")
    if labels.dtype not in _TARGETS:
        raise _bad(f"labels have dtype {labels.dtype}: int64 or int32 class indices")
    if len({t.device for t in (hidden, weight, labels, *(() if bias is None else (bias,)))}) != 1:
        raise _bad("hidden, weight, bias and labels must be on one device")
    if hidden.device.type != "cuda" and not _INTERPRETED:
        raise _bad(f"inputs are on {hidden.device}; the kernels need CUDA (or TRITON_INTERPRET=1 set before "
                   "triton is imported)")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t = labels.reshape(-1)
    if t.shape[0] != h2.shape[0]:
        raise _bad(f"{h2.shape[0]} rows of hidden states but {t.shape[0]} labels")
    return h2, t.contiguous()


@functools.lru_cache(maxsize=1024)
def _plan(N: int, H: int, V: int, dtype: torch.dtype, grads: int, config: Config | None) -> tuple[Config, dict]:
    wl = _workload(N, H, V, dtype, False, torch.int64, -100, "mean", torch.float32, grads, "cuda")
    c = config or heuristic(wl)
    if not is_valid(c, wl):
        raise _bad(f"config {c.encode()} is not valid for {wl.key}")
    # one pass (no gradient): the logits are read once, keep L2 for the next rows; two passes: keep
    # the row for the second
    kw = dict(BLOCK=c.block, EVEN=V % c.block == 0, INTERP=_INTERPRETED, GRAD=bool(grads),
              EVICT="evict_last" if grads else "evict_first", num_warps=c.num_warps)
    return c, Meta(kw)


def forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, *,
            ignore_index: int = -100, reduction: str = "mean", out_dtype: torch.dtype | None = None,
            grads: int = 0, config: Config | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dhidden, dweight, dbias): what the custom op returns. A gradient not asked for by
    `grads` (or dbias without a bias) is an empty tensor."""
    h2, t = _check(hidden, weight, bias, labels, reduction)
    grads &= GRAD_HIDDEN | GRAD_WEIGHT | (GRAD_BIAS if bias is not None else 0)
    N, H = h2.shape
    V = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    dh = torch.empty(hidden.shape, dtype=dt, device=dev) if grads & GRAD_HIDDEN else hidden.new_empty(0)
    f32 = torch.float32
    c, kw = _plan(N, H, V, dt, grads, config)
    rows = max(1, min(c.rows, N))
    # (a fresh empty tensor per gradient not computed: an op's outputs must not alias each other)
    dw = lce_grads.DWeight(c.variant, weight, -(-N // rows)) if grads & GRAD_WEIGHT and N else None
    db = torch.zeros(V, dtype=f32, device=dev) if grads & GRAD_BIAS else hidden.new_empty(0)
    loss_rows = torch.empty(N, dtype=f32, device=dev)
    n_valid = (t != ignore_index).sum()
    # 1 / 0 = inf when every target is ignored; the kernel zeroes ignored rows with a where
    scale = (1.0 / n_valid.to(f32) if reduction == "mean" else torch.ones((), dtype=f32, device=dev)).reshape(1)
    if N and V:
        buf = torch.empty(rows, V, dtype=dt, device=dev)
        wt = weight.t()
        for i, s in enumerate(range(0, N, rows)):
            e = min(s + rows, N)
            hc, x = h2[s:e], buf[: e - s]
            if bias is None:
                torch.mm(hc, wt, out=x)
            else:
                torch.addmm(bias, hc, wt, out=x)
            _launch(_lce_rows_kernel, (e - s,), (x, t[s:e], loss_rows[s:e], scale, V, x.stride(0), ignore_index), kw)
            if grads & GRAD_HIDDEN:
                torch.mm(x, weight, out=dh.view(N, H)[s:e])
            if dw is not None:
                dw.add(i, x, hc)
            if grads & GRAD_BIAS:
                db.add_(x.sum(0, dtype=f32))
        # before dweight's cast ("fp32"): the two need not be held together. x too: a view keeps
        # the buffer's storage alive (measured on the H100: 0.51 GB above the model at the cast)
        del buf, x
    elif grads & GRAD_HIDDEN:
        dh.zero_()
    if dw is not None:
        dwt = dw.result()
    elif grads & GRAD_WEIGHT:  # no rows: a zero gradient
        dwt = torch.zeros(weight.shape, dtype=dt, device=dev)
    else:
        dwt = hidden.new_empty(0)
    total = loss_rows.sum()
    loss = total / n_valid if reduction == "mean" else total  # 0 / 0 = NaN when all are ignored, as torch
    return (loss.to(out_dtype or dt), dh, dwt, db.to(bias.dtype) if bias is not None and grads & GRAD_BIAS else db)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                         *, ignore_index: int = -100, reduction: str = "mean", out_dtype: torch.dtype | None = None,
                         grads: int = 0, config: Config | None = None,
                         out: torch.Tensor | tuple[torch.Tensor, ...] | None = None
                         ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The loss of `hidden @ weight.T + bias` against `labels`, and the gradients `grads` asks for,
    shaped as `linear_cross_entropy_ref` returns them. `config` picks chunking and kernel (default:
    `heuristic`); `out` (a tensor, or a tuple like the result) is written in place when given."""
    loss, dh, dw, db = forward(hidden, weight, bias, labels, ignore_index=ignore_index, reduction=reduction,
                               out_dtype=out_dtype, grads=grads, config=config)
    res: tuple[torch.Tensor, ...] = (loss,)
    for bit, g in ((GRAD_HIDDEN, dh), (GRAD_WEIGHT, dw), (GRAD_BIAS, db)):
        if grads & bit and (bit != GRAD_BIAS or bias is not None):
            res += (g,)
    result = res if grads else loss
    if out is None:
        return result
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != len(res) or any(o.shape != r.shape or o.dtype != r.dtype for o, r in zip(outs, res, strict=True)):
        raise _bad("out must match the result: " + ", ".join(f"{r.dtype} {tuple(r.shape)}" for r in res))
    for o, r in zip(outs, res, strict=True):
        o.copy_(r)
    return out


# ----------------------------------------------------------------------------------------------
# Custom op: (loss, dhidden, dweight, dbias). Only the loss is differentiable; the autograd formula
# scales the saved gradients by the incoming one. Library API, not @custom_op (kernels/rmsnorm.py).

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index, "
            "str reduction, ScalarType out_dtype, int grads, str config) -> (Tensor, Tensor, Tensor, Tensor)")


def _op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
        ignore_index: int, reduction: str, out_dtype: torch.dtype, grads: int, config: str
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return forward(hidden, weight, bias, labels, ignore_index=ignore_index, reduction=reduction, out_dtype=out_dtype,
                   grads=grads, config=Config.decode(config) if config else None)


_LIB.impl("linear_cross_entropy", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::linear_cross_entropy")
def _fake(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
          ignore_index: int, reduction: str, out_dtype: torch.dtype, grads: int, config: str
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (hidden.new_empty((), dtype=out_dtype),
            hidden.new_empty(hidden.shape) if grads & GRAD_HIDDEN else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grads & GRAD_WEIGHT else hidden.new_empty(0),
            bias.new_empty(bias.shape) if bias is not None and grads & GRAD_BIAS else hidden.new_empty(0))


linear_cross_entropy_op = torch.ops.solforge.linear_cross_entropy.default


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, bias, labels, ignore_index, reduction, out_dtype, grads, config = inputs
    _loss, dh, dw, db = output
    ctx.mark_non_differentiable(dh, dw, db)
    need = ctx.needs_input_grad
    want = (need[0] and GRAD_HIDDEN) | (need[1] and GRAD_WEIGHT) | (bias is not None and need[2] and GRAD_BIAS)
    ctx.want, ctx.missing, ctx.used = want, want & ~grads, False
    ctx.args = (ignore_index, reduction, out_dtype, config)
    # the inputs too (references, no copies): for gradients the rewrite did not expect, and for a
    # second backward (retain_graph) after the first scaled the saved gradients in place
    ctx.save_for_backward(dh, dw, db, hidden, weight, bias, labels)


def _backward(ctx: Any, dloss: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
    dh, dw, db, hidden, weight, bias, labels = ctx.saved_tensors
    if ctx.missing or ctx.used:  # gradients not computed, or already scaled by an earlier backward
        _l, dh, dw, db = linear_cross_entropy_op(hidden, weight, bias, labels, *ctx.args[:3], ctx.want, ctx.args[3])
    g = dloss.detach()
    want = [(bit, t) for bit, t in ((GRAD_HIDDEN, dh), (GRAD_WEIGHT, dw), (GRAD_BIAS, db)) if ctx.want & bit]
    if lce_grads.scale_in_place([t for _b, t in want], g):
        ctx.used = True
        got = dict(want)
    else:  # a 0-dim fp32 factor keeps each gradient's dtype (no promotion against a 0-dim tensor)
        got = {bit: t * g for bit, t in want}
    return (got.get(GRAD_HIDDEN), got.get(GRAD_WEIGHT), got.get(GRAD_BIAS), None, None, None, None, None, None)


torch.library.register_autograd("solforge::linear_cross_entropy", _backward, setup_context=_setup)
direct.register(torch.ops.solforge.linear_cross_entropy.default, _op, _setup, _backward)


# ----------------------------------------------------------------------------------------------
# Config triad

VARIANTS = ("fp32", "native")
_WARPS = (1, 2, 4, 8, 16, 32)
_MAX_PER_THREAD = 32  # as cross_entropy.py: fp32 values of a vocabulary chunk a thread holds
# The family's memory promise: a chunk's logits never exceed this. 2.5 GiB holds all 8192 rows of
# Qwen3-4B's head (8192 x 151936 bf16 = 2.49 GB) in one chunk: the compile-like point (three
# GEMMs, dweight rounded once), whose peak torch.compile's own (3.31 GB there) already holds.
MAX_CHUNK_BYTES = 2560 << 20
# Fewer, larger chunks: below 512 rows the dhidden GEMM (rows x H outputs) fills under half the
# H100's 132 SMs and each chunk repeats dweight's pass over V x H (lce_model.py).
_MIN_ROWS = 512
_ABBREV = {"rows": "r", "block": "b", "num_warps": "w"}


@dataclass(frozen=True)
class Config(config_text.Text):
    """`rows` rows of logits per chunk; the row kernel reads `block` classes at a time (a power of
    two) with `num_warps` warps; `variant`: how dweight accumulates (module docstring)."""

    variant: str = "fp32"
    rows: int = 1024
    block: int = 4096
    num_warps: int = 8

    _family, _variants, _abbrev = FAMILY, VARIANTS, _ABBREV
    _always = ("rows", "block", "num_warps")  # text form, e.g. "fp32:r=1024:b=4096:w=8"


def _dims(workload: Workload) -> tuple[int, int, int]:
    (N, H), (V, _H) = workload.shapes[0], workload.shapes[1]
    return N, H, V


def _itemsize(workload: Workload) -> int:
    return parse_dtype(workload.dtypes[0]).itemsize


def is_valid(config: Config, workload: Workload) -> bool:
    """Correct and within the memory promise: a chunk's logits at most MAX_CHUNK_BYTES (or one row),
    a vocabulary block no wider than the row needs and within the registers."""
    c = config
    N, _H, V = _dims(workload)
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or c.rows < 1:
        return False
    if c.block <= 0 or c.block & (c.block - 1) or c.block > triton.next_power_of_2(V):
        return False
    rows = min(c.rows, max(N, 1))
    if rows > 1 and rows * V * _itemsize(workload) > MAX_CHUNK_BYTES:
        return False
    return c.block // (32 * c.num_warps) <= _MAX_PER_THREAD


def _kernel_shape(V: int) -> tuple[int, int]:
    """cross_entropy's heuristic chunk width and warps (the row kernel is its kernel)."""
    block = min(8192, triton.next_power_of_2(V))
    return block, max(1, min(32, block // (32 * 16)))


def _rows_options(workload: Workload) -> list[int]:
    """Powers of two from _MIN_ROWS below N, then N itself (one chunk), within the memory cap."""
    N, _H, V = _dims(workload)
    row_bytes = max(1, V * _itemsize(workload))
    cap = max(1, MAX_CHUNK_BYTES // row_bytes)
    if N <= cap:
        opts = [r for r in (_MIN_ROWS << i for i in range(32)) if r < N]
        return [*opts, max(N, 1)]
    top = 1 << (cap.bit_length() - 1)
    return [r for r in (_MIN_ROWS << i for i in range(32)) if r <= top] or [top]


def _variants(workload: Workload, rows: int) -> tuple[str, ...]:
    N, _H, _V = _dims(workload)
    if rows >= N or not int(workload.param("grads", 0)) & GRAD_WEIGHT or _itemsize(workload) == 4:
        return ("fp32",)  # one chunk (one GEMM), no dweight, or fp32 inputs: the variants coincide
    return VARIANTS


def _model_args(c: Config, workload: Workload) -> dict[str, Any]:
    N, H, V = _dims(workload)
    return {"N": N, "H": H, "V": V, "itemsize": _itemsize(workload), "grads": int(workload.param("grads", 0)),
            "has_bias": bool(workload.param("bias", False)), "variant": c.variant, "rows": c.rows}


def estimated_peak_bytes(config: Config, workload: Workload) -> int:
    """Device memory the call holds at its peak above its inputs (lce_model.peak_bytes)."""
    return lce_model.peak_bytes(**_model_args(config, workload))


def estimated_ms(config: Config, workload: Workload) -> float:
    """The H100 time the cost model expects (lce_model.time_ms): for ranking, not a measurement."""
    return lce_model.time_ms(**_model_args(config, workload))


def memory_budget(workload: Workload) -> int:
    """What the unchunked graph (eager's or torch.compile's) holds at once: the (N, V) logits in
    the input dtype and the gradients (lce_model.unchunked_bytes); the heuristic stays within it."""
    N, H, V = _dims(workload)
    return lce_model.unchunked_bytes(N, H, V, _itemsize(workload), int(workload.param("grads", 0)),
                                     bool(workload.param("bias", False)))


def space(workload: Workload) -> list[Config]:
    """Rows per chunk (powers of two from 512 below N, and all N rows at once when the buffer fits
    MAX_CHUNK_BYTES) x accumulation (one variant for one chunk; "native" too for half inputs with
    a weight gradient): 10 configs at Qwen3-4B's head for 8192 rows. The GEMMs dominate; rows and
    the variant move them; the row kernel's second shape is tried on one chunk only."""
    N, _H, V = _dims(workload)
    grads = int(workload.param("grads", 0))
    shapes = sorted({_kernel_shape(V), (min(4096, triton.next_power_of_2(V)), 8)})
    b0, w0 = _kernel_shape(V)
    out = []
    for r in _rows_options(workload):
        for v in _variants(workload, r):
            out += [Config(v, r, b, w) for b, w in (shapes if r >= N or v == "fp32" and not grads & GRAD_WEIGHT
                                                 else [(b0, w0)])]
    out = [c for c in out if is_valid(c, workload)]
    return list(dict.fromkeys(out)) or [heuristic(workload)]


def heuristic(workload: Workload) -> Config:
    """Untuned default: the config the cost model (lce_model.py) expects fastest among those
    within `memory_budget` (the unchunked graph's peak; with no such config, the smallest peak),
    preferring the smaller peak among those within 2% of the fastest, never "native". At Qwen3-4B's
    head (bf16, dhidden and dweight) that is one chunk for 4096 and 8192 rows (model: 15.5 / 30.9
    ms; measured on the H100 at 4096 rows: 14.6 ms, 2.045 GB, torch.compile 15.0 ms, 2.045 GB) and
    "fp32" in 2 chunks of 8192 for 16384 rows (64.1 ms, 4.40 GB against 5.85 unchunked). Without
    gradients, chunks of 512 rows (the GEMM's time does not depend on the chunking, the buffer
    does)."""
    block, warps = _kernel_shape(_dims(workload)[2])
    # not "native": its per-chunk rounding fails verification at Qwen3-4B's head (H100, 2026-11-22)
    cands = [Config(v, r, block, warps) for r in _rows_options(workload) for v in _variants(workload, r)
             if v != "native"]
    cands = [c for c in cands if is_valid(c, workload)] or [Config("fp32", 1, block, warps)]
    budget = memory_budget(workload)
    fits = [c for c in cands if estimated_peak_bytes(c, workload) <= budget]
    if not fits:
        return min(cands, key=lambda c: estimated_peak_bytes(c, workload))
    best = min(estimated_ms(c, workload) for c in fits)
    near = [c for c in fits if estimated_ms(c, workload) <= 1.02 * best]
    return min(near, key=lambda c: (estimated_peak_bytes(c, workload), estimated_ms(c, workload)))


def _workload(N: int, H: int, V: int, dtype: torch.dtype, has_bias: bool, tdtype: torch.dtype, ignore_index: int,
              reduction: str, out_dtype: torch.dtype, grads: int, device: str) -> Workload:
    shapes = ((N, H), (V, H), *(((V,),) if has_bias else ()), (N,))
    dt = dtype_name(dtype)
    return Workload(family=FAMILY, shapes=shapes,
                    dtypes=(dt, dt, *((dt,) if has_bias else ()), str(tdtype).removeprefix("torch."),
                            dtype_name(out_dtype)),
                    params=(("bias", has_bias), ("grads", int(grads)), ("ignore_index", int(ignore_index)),
                            ("out_dtype", dtype_name(out_dtype)), ("reduction", reduction)), device=device)


def workload_for(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, *,
                 ignore_index: int = -100, reduction: str = "mean", out_dtype: torch.dtype | None = None,
                 grads: int = 0) -> Workload:
    """The Workload record of one call (hidden seen as (N, H)). A bias gradient without a bias is
    dropped from `grads`."""
    H = hint(hidden.shape[-1])
    N = hint(labels.numel())
    grads &= GRAD_HIDDEN | GRAD_WEIGHT | (GRAD_BIAS if bias is not None else 0)
    return _workload(N, H, hint(weight.shape[0]), hidden.dtype, bias is not None, labels.dtype, ignore_index,
                     reduction, out_dtype or hidden.dtype, grads, hidden.device.type)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `linear_cross_entropy` / its reference.

    Weights ~ N(0, 1/H) and hidden states ~ N(0, 4) give logits of std ~2 (a trained LM head's
    spread). Each row is shifted by its own constant (std 3: a hidden-state component along a weight
    column of ones). Not more: in bf16 a logit of 100 has an ulp of 0.5, so two GEMMs (chunked or
    not) would disagree by e^0.5 in a probability, and in fp32 a column of large hidden values
    makes dweight a sum of terms 100x its size, beyond any element-wise fp32 tolerance. The tests
    check the overflow a kernel without the max would hit with a bias of +100 instead. About one
    label in five is the ignore_index."""
    N, H, V = _dims(workload)
    N = N if rows is None else rows
    device = device or workload.device
    dt = parse_dtype(workload.dtypes[0])
    g, where = input_generator(max(N, V) * H, device, seed)
    w = torch.randn(V, H, generator=g, device=where) / H**0.5
    w[:, 0] = 1.0  # the shared direction: column 0 of hidden shifts a whole row
    h = 2 * torch.randn(N, H, generator=g, device=where)
    h[:, 0] = 3 * torch.randn(N, generator=g, device=where)
    bias = None
    if workload.param("bias", False):
        bias = (0.5 * torch.randn(V, generator=g, device=where)).to(dt).to(device)
    ignore = int(workload.param("ignore_index", -100))
    t = torch.randint(0, V, (N,), generator=g, device=where)
    t = t.masked_fill(torch.rand(N, generator=g, device=where) < 0.2, ignore)
    tdt = workload.dtypes[3 if bias is not None else 2]
    kwargs = {"ignore_index": ignore, "reduction": str(workload.param("reduction", "mean")),
              "out_dtype": parse_dtype(workload.param("out_dtype", workload.dtypes[0])),
              "grads": int(workload.param("grads", 0))}
    return (h.to(dt).to(device), w.to(dt).to(device), bias, t.to(getattr(torch, tdt)).to(device)), kwargs


def output_tolerance(workload: Workload) -> tuple[Tolerance, ...]:
    """One tolerance per output. The loss: its dtype's. A gradient of the mean carries a factor
    1 / #valid rows (~0.8 N in make_inputs), so its absolute tolerance does too: the dtype's atol
    (sized for values ~1) would accept any gradient of a few thousand rows."""
    N, _H, _V = _dims(workload)
    grads = int(workload.param("grads", 0))
    dt = parse_dtype(workload.dtypes[0])
    out = [tolerance(parse_dtype(workload.param("out_dtype", workload.dtypes[0])))]
    g = tolerance(dt)
    if workload.param("reduction", "mean") == "mean":
        g = Tolerance(atol=g.atol / max(1, N), rtol=g.rtol)
    bits = (GRAD_HIDDEN, GRAD_WEIGHT, *((GRAD_BIAS,) if workload.param("bias", False) else ()))
    out += [g for b in bits if grads & b]
    return tuple(out)


def baseline_grads(workload: Workload) -> tuple[int, ...]:
    """Which of the region's tensor inputs (hidden, weight, bias, labels) the kernel returns the
    gradient of: the baseline (the region as the model ran it) is timed with their backward too,
    since this family's time includes it."""
    grads = int(workload.param("grads", 0))
    has_bias = bool(workload.param("bias", False))
    idx = [i for i, b in enumerate((GRAD_HIDDEN, GRAD_WEIGHT)) if grads & b]
    return tuple(idx + ([2] if has_bias and grads & GRAD_BIAS else []))
