"""Cross-entropy family: loss over rows of logits (rows, V) with integer targets, as
F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...) computes it.

    lse_r  = log(sum_j exp(x_rj))                   (fp32, the row's max subtracted first)
    loss_r = lse_r - x_r[t_r]                       0 where t_r == ignore_index
    mean   = sum_r loss_r / #(t_r != ignore_index)  NaN when every target is ignored (as torch)
    sum    = sum_r loss_r;  none = loss_r

In order: reference, Triton kernels, launchers, custom ops, config triad (+ workload_for,
make_inputs). The logits are read in their own dtype (bf16 in Hugging Face's causal-LM loss, whose
`logits.float()` becomes part of the region) and never copied to fp32: the forward reads them once,
in chunks, keeping a running max and rescaled sum per lane (an online logsumexp), and writes two
floats per row: the row's loss and its logsumexp. torch sums the row losses (deterministic; N floats).

The backward, dx_rj = (exp(x_rj - lse_r) - [j == t_r]) * dloss / n_valid (mean; dloss for sum,
dloss_r for none; 0 on ignored rows), is one more read of the logits and one write, using the saved
lse. Liger instead writes the gradient during the forward, into the logits' own storage. We do not:
the logits are the model's returned output in Hugging Face (they must stay intact), the gradient
needs the incoming dloss anyway (a loss divided by num_items_in_batch, loss scaling), and a separate
gradient buffer would be held from forward to backward. The cost is one extra read of the logits
(1.2 GB at 4096 x 151936 bf16, ~0.4 ms on an H100), and the forward alone stays at one read.
The backward kernel is tuned as its own family, cross_entropy_bwd (kernels/cross_entropy_bwd.py,
over the forward's space): in training the op's config string is "FWD|BWD" and the backward op runs
BWD ("" = `heuristic`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from solforge.kernels import config_text, direct
from solforge.kernels.interp import round_bf16
from solforge.kernels.launch import Meta
from solforge.kernels.launch import launch as _launch
from solforge.numerics import dtype_name, input_generator, parse_dtype
from solforge.records import Workload
from solforge.runtime.shapes import hint

FAMILY = "cross_entropy"

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_TARGETS = (torch.int64, torch.int32)
REDUCTIONS = ("none", "mean", "sum")  # ATen's reduction enum order: 0, 1, 2


# ----------------------------------------------------------------------------------------------
# Reference


def cross_entropy_ref(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                      reduction: str = "mean", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The function every kernel must compute, in fp32 (fp64 for fp32 logits), cast once."""
    acc = torch.float64 if logits.dtype in (torch.float32, torch.float64) else torch.float32
    V = logits.shape[-1]
    loss = F.cross_entropy(logits.to(acc).reshape(-1, V), target.reshape(-1).long(), ignore_index=ignore_index,
                           reduction=reduction)
    return loss.to(out_dtype or logits.dtype)


def cross_entropy_bwd_ref(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, *,
                          ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """dlogits in fp32/fp64, by autograd through the reference."""
    acc = torch.float64 if logits.dtype in (torch.float32, torch.float64) else torch.float32
    x = logits.detach().to(acc).requires_grad_(True)
    loss = cross_entropy_ref(x, target, ignore_index=ignore_index, reduction=reduction)
    (dx,) = torch.autograd.grad(loss, [x], dloss.to(acc))
    return dx


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _ld(ptrs, cols, V, other, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """A chunk of a row in fp32, masked only where the chunks do not tile the row."""
    if EVEN:
        v = tl.load(ptrs, eviction_policy=EVICT)
    else:
        v = tl.load(ptrs, mask=cols < V, other=other, eviction_policy=EVICT)
    return v.to(tl.float32)


@triton.jit
def _lse_step(x_row, off, V, mv, sv, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Fold one chunk into the per-lane running (max, sum of exp(x - max)): no cross-lane reduction
    per chunk. A lane that has seen only -inf keeps a sum of 0 rather than NaN."""
    cols = off + tl.arange(0, BLOCK)
    # evict_first: the forward reads each logit once; keep L2 for the target loads and the next rows
    x = _ld(x_row + cols, cols, V, -float("inf"), EVEN, "evict_first")
    new = tl.maximum(mv, x)
    safe = tl.where(new == -float("inf"), 0.0, new)
    return new, sv * tl.exp(mv - safe) + tl.exp(x - safe)


@triton.jit
def _ce_fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, V, stride_x, ignore_index, BLOCK: tl.constexpr,
                   EVEN: tl.constexpr, INTERP: tl.constexpr):
    """One row per program: online logsumexp over BLOCK-wide chunks, then loss = lse - x[target].
    INTERP is unused here: the forward takes the backward's launch options (`_launch_plan`)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    mv = tl.full([BLOCK], -float("inf"), tl.float32)
    sv = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(0, V, BLOCK):
        mv, sv = _lse_step(x_row, off, V, mv, sv, BLOCK, EVEN)
    mx = tl.max(mv, axis=0)
    safe = tl.where(mx == -float("inf"), 0.0, mx)
    lse = safe + tl.log(tl.sum(tl.where(mv == -float("inf"), 0.0, sv * tl.exp(mv - safe)), axis=0))
    t = tl.load(t_ptr + row).to(tl.int64)
    inside = (t >= 0) & (t < V)
    xt = tl.load(x_row + tl.where(inside, t, 0)).to(tl.float32)
    # a target outside [0, V) that is not ignored is an error in torch; here its row's loss is NaN
    loss = tl.where(inside, lse - xt, float("nan"))
    tl.store(loss_ptr + row, tl.where(t == ignore_index, 0.0, loss))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _grad_chunk(x_row, dx_row, off, V, lse, t, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                INTERP: tl.constexpr):
    cols = off + tl.arange(0, BLOCK)
    p = tl.exp(_ld(x_row + cols, cols, V, -float("inf"), EVEN, "evict_first") - lse)  # masked lanes: 0
    g = (p - tl.where(cols == t, 1.0, 0.0)) * scale
    if INTERP:  # the interpreter's bf16 cast truncates; round to nearest as the GPU does
        if dx_row.dtype.element_ty == tl.bfloat16:
            g = round_bf16(g)
    if EVEN:
        tl.store(dx_row + cols, g.to(dx_row.dtype.element_ty))
    else:
        tl.store(dx_row + cols, g.to(dx_row.dtype.element_ty), mask=cols < V)


@triton.jit
def _ce_bwd_kernel(x_ptr, t_ptr, lse_ptr, scale_ptr, dx_ptr, V, stride_x, stride_dx, stride_scale, ignore_index,
                   BLOCK: tl.constexpr, EVEN: tl.constexpr, INTERP: tl.constexpr):
    """One row per program: dx = (softmax(x) - onehot(t)) * scale in one pass, from the saved lse."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    dx_row = dx_ptr + row * stride_dx
    t = tl.load(t_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    # where, not a multiply: the mean's dloss / n_valid is inf when every target is ignored
    scale = tl.where(t == ignore_index, 0.0, tl.load(scale_ptr + row * stride_scale))
    for off in tl.range(0, V, BLOCK):
        _grad_chunk(x_row, dx_row, off, V, lse, t, scale, BLOCK, EVEN, INTERP)


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import;
# only then can CPU tensors be launched.
_INTERPRETED = type(_ce_fwd_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Launchers


def _bad(msg: str) -> ValueError:
    return ValueError(f"solforge cross_entropy: {msg}")


def _rows(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, V) logits with a unit column stride and (rows,) contiguous targets, checked."""
    if logits.dtype not in _SUPPORTED or logits.dim() < 1:
        raise _bad(f"logits {logits.dtype} {tuple(logits.shape)}: bf16, fp16 or fp32 with a class dim last")
    if target.dtype not in _TARGETS:
        raise _bad(f"target has dtype {target.dtype}: int64 or int32 class indices")
    if logits.device != target.device:
        raise _bad(f"logits on {logits.device}, target on {target.device}: one device")
    if logits.device.type != "cuda" and not _INTERPRETED:
        raise _bad(f"logits are on {logits.device}; the kernels need CUDA (or TRITON_INTERPRET=1 set before "
                   "triton is imported)")
    V = logits.shape[-1]
    x2 = logits.reshape(-1, V)
    if x2.stride(-1) != 1 and V > 1:
        x2 = x2.contiguous()
    t = target.reshape(-1)
    if t.shape[0] != x2.shape[0]:
        raise _bad(f"{x2.shape[0]} rows of logits but {t.shape[0]} targets")
    return x2, t.contiguous()


@functools.lru_cache(maxsize=1024)
def _launch_plan(n_rows: int, V: int, dtype: torch.dtype, config: Config | None, device: str) -> dict[str, Any]:
    wl = _workload(n_rows, V, dtype, torch.int64, -100, "mean", torch.float32, device)
    c = config or heuristic(wl)
    if not is_valid(c, wl):
        raise _bad(f"config {c.encode()} is not valid for {wl.key}")
    return Meta(BLOCK=c.block, EVEN=V % c.block == 0, INTERP=_INTERPRETED, num_warps=c.num_warps)


def forward(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
            out_dtype: torch.dtype | None = None, config: Config | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss in out_dtype, per-row logsumexp in fp32): what the custom op returns."""
    if reduction not in REDUCTIONS:
        raise _bad(f"reduction {reduction!r}: one of {REDUCTIONS}")
    out_dtype = out_dtype or logits.dtype
    x2, t = _rows(logits, target)
    n_rows, V = x2.shape
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    if n_rows and V:
        kw = _launch_plan(n_rows, V, x2.dtype, config, x2.device.type)
        _launch(_ce_fwd_kernel, (n_rows,), (x2, t, loss_rows, lse, V, x2.stride(0), ignore_index), kw)
    if reduction == "none":
        loss = loss_rows
    elif reduction == "sum":
        loss = loss_rows.sum()
    else:  # 0 / 0 = NaN when every target is ignored, as torch gives
        loss = loss_rows.sum() / (t != ignore_index).sum()
    return loss.to(out_dtype), lse


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  out_dtype: torch.dtype | None = None, config: Config | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of `logits` (any shape, classes last) against `target` (one index per row);
    see `cross_entropy_ref`. `config` picks the kernel (default: `heuristic`); `out` is written in
    place when given."""
    loss, _lse = forward(logits, target, ignore_index=ignore_index, reduction=reduction, out_dtype=out_dtype,
                         config=config)
    if out is None:
        return loss
    if out.shape != loss.shape or out.dtype != loss.dtype:
        raise _bad(f"out must be {loss.dtype} {tuple(loss.shape)}")
    return out.copy_(loss)


def cross_entropy_bwd(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, *,
                      ignore_index: int = -100, reduction: str = "mean", dx_dtype: torch.dtype | None = None,
                      config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """dlogits (shaped like logits, dx_dtype or logits.dtype) from the forward's saved `lse`.
    `out` (shaped like logits, dx_dtype, viewable as (rows, V)) is written in place when given
    (the cross_entropy_bwd family, kernels/cross_entropy_bwd.py, tunes this)."""
    if reduction not in REDUCTIONS:
        raise _bad(f"reduction {reduction!r}: one of {REDUCTIONS}")
    x2, t = _rows(logits, target)
    n_rows, V = x2.shape
    dx_dtype = dx_dtype or logits.dtype
    if out is None:
        dx = torch.empty_like(logits, dtype=dx_dtype, memory_format=torch.contiguous_format)
    elif out.shape != logits.shape or out.dtype != dx_dtype or out.device != logits.device:
        raise _bad(f"backward: out must be {dx_dtype} {tuple(logits.shape)} on {logits.device}")
    else:
        dx = out
    if not (n_rows and V):
        return dx.zero_()
    scale = dloss.detach().to(torch.float32)
    if reduction == "mean":
        scale = scale / (t != ignore_index).sum()
    if reduction == "none":
        scale = scale.reshape(-1).contiguous()
        if scale.shape[0] != n_rows:
            raise _bad(f"dloss has {scale.shape[0]} values for {n_rows} rows")
    elif scale.numel() != 1:
        raise _bad(f"dloss of a {reduction} reduction must be one value; got {tuple(dloss.shape)}")
    kw = _launch_plan(n_rows, V, x2.dtype, config, x2.device.type)
    dx2 = dx.view(-1, V)
    if dx2.stride(-1) != 1 and V > 1:
        raise _bad("backward: out's last dim must be contiguous")
    _launch(_ce_bwd_kernel, (n_rows,),
            (x2, t, lse, scale, dx2, V, x2.stride(0), dx2.stride(0), 1 if reduction == "none" else 0, ignore_index),
            kw)
    return dx


# ----------------------------------------------------------------------------------------------
# Custom ops. The forward returns (loss, lse): the graph uses the loss, the autograd formula saves
# the lse (plan.Match `results`). Registered with the Library API, not @custom_op (3.6 us a call
# against 9.3 us, kernels/rmsnorm.py); the backward is its own op with a fake implementation.

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("cross_entropy(Tensor logits, Tensor target, int ignore_index, str reduction, ScalarType out_dtype, "
            "str config) -> (Tensor, Tensor)")
_LIB.define("cross_entropy_bwd(Tensor dloss, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
            "str reduction, ScalarType dx_dtype, str config) -> Tensor")


def _op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, out_dtype: torch.dtype,
        config: str) -> tuple[torch.Tensor, torch.Tensor]:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return forward(logits, target, ignore_index=ignore_index, reduction=reduction, out_dtype=out_dtype,
                   config=Config.decode(fwd) if fwd else None)


def _bwd_op(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
            reduction: str, dx_dtype: torch.dtype, config: str) -> torch.Tensor:
    return cross_entropy_bwd(dloss, logits, target, lse, ignore_index=ignore_index, reduction=reduction,
                             dx_dtype=dx_dtype, config=Config.decode(config) if config else None)


_LIB.impl("cross_entropy", _op, "CompositeExplicitAutograd")
_LIB.impl("cross_entropy_bwd", _bwd_op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::cross_entropy")
def _fake(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, out_dtype: torch.dtype,
          config: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = target.numel()
    return (logits.new_empty((n,) if reduction == "none" else (), dtype=out_dtype),
            logits.new_empty((n,), dtype=torch.float32))


@torch.library.register_fake("solforge::cross_entropy_bwd")
def _bwd_fake(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
              reduction: str, dx_dtype: torch.dtype, config: str) -> torch.Tensor:
    return logits.new_empty(logits.shape, dtype=dx_dtype)


cross_entropy_op = torch.ops.solforge.cross_entropy.default
cross_entropy_bwd_op = torch.ops.solforge.cross_entropy_bwd.default
cross_entropy_bwd_call = direct.plain(cross_entropy_bwd_op, _bwd_op)  # what the backward formula calls


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits, target, ignore_index, reduction, _out_dtype, config = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.ignore_index, ctx.reduction = ignore_index, reduction
    # the backward's config: the part after "|" (tuned as family cross_entropy_bwd,
    # kernels/cross_entropy_bwd.py; "" = the heuristic, also for a plain "FWD" string)
    ctx.bwd_config = config.partition("|")[2]


def _backward(ctx: Any, dloss: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[Any, ...]:
    logits, target, lse = ctx.saved_tensors
    dx = cross_entropy_bwd_call(dloss, logits, target, lse, ctx.ignore_index, ctx.reduction, logits.dtype,
                              ctx.bwd_config)
    return dx, None, None, None, None, None


torch.library.register_autograd("solforge::cross_entropy", _backward, setup_context=_setup)
direct.register(torch.ops.solforge.cross_entropy.default, _op, _setup, _backward)


# ----------------------------------------------------------------------------------------------
# Config triad

VARIANTS = ("online",)
_WARPS = (1, 2, 4, 8, 16, 32)
# fp32 values of a chunk a thread holds at once: the running max and sum plus the chunk itself
# (rmsnorm.py's measured limit is 64 for one live tile; three live vectors share it here).
_MAX_PER_THREAD = 32
_ABBREV = {"block": "b", "num_warps": "w"}


@dataclass(frozen=True)
class Config(config_text.Text):
    """Chunks of `block` classes (a power of two), one row per program."""

    variant: str = "online"
    block: int = 4096
    num_warps: int = 8

    _family, _variants, _abbrev = FAMILY, VARIANTS, _ABBREV
    _always = ("block", "num_warps")  # text form, e.g. "online:b=4096:w=8"



def _dims(workload: Workload) -> tuple[int, int]:
    return workload.shapes[0][0], workload.shapes[0][1]


def is_valid(config: Config, workload: Workload) -> bool:
    """Can this config compute this workload correctly without spilling registers? A chunk wider
    than the row (rounded up to a power of two) would only add masked lanes."""
    c = config
    _rows, V = _dims(workload)
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or c.block <= 0 or c.block & (c.block - 1):
        return False
    return c.block <= triton.next_power_of_2(V) and c.block // (32 * c.num_warps) <= _MAX_PER_THREAD


def space(workload: Workload) -> list[Config]:
    """Chunk width (1024 to 16384 classes) x warps (2 to 32 values a thread): ~15 configs at
    vocabulary widths."""
    _rows, V = _dims(workload)
    top = min(16384, triton.next_power_of_2(V))
    out = []
    block = min(1024, top)
    while block <= top:
        for w in (2, 4, 8, 16, 32):
            c = Config("online", block, w)
            if is_valid(c, workload) and block // (32 * w) >= min(2, block // 64):
                out.append(c)
        block *= 2
    return out or [heuristic(workload)]


def heuristic(workload: Workload) -> Config:
    """Untuned default: 8192-wide chunks (or the row, if shorter) at ~16 values a thread. Not yet
    measured on the H100: bench/family_cross_entropy.py tunes it there."""
    _rows, V = _dims(workload)
    block = min(8192, triton.next_power_of_2(V))
    return Config("online", block, max(1, min(32, block // (32 * 16))))


def backward_workload(workload: Workload) -> Workload:
    """The workload of this call's backward (family cross_entropy_bwd, kernels/cross_entropy_bwd.py):
    the forward's, renamed. The kernel depends on (rows, V) and the logits' dtype; the reduction
    (one dloss or one a row), ignore_index and out_dtype (dloss's dtype) shape its inputs."""
    return dataclasses.replace(workload, family=f"{FAMILY}_bwd")


def _workload(rows: int, V: int, dtype: torch.dtype, tdtype: torch.dtype, ignore_index: int, reduction: str,
              out_dtype: torch.dtype, device: str) -> Workload:
    return Workload(family=FAMILY, shapes=((rows, V), (rows,)),
                    dtypes=(dtype_name(dtype), str(tdtype).removeprefix("torch."), dtype_name(out_dtype)),
                    params=(("ignore_index", int(ignore_index)), ("out_dtype", dtype_name(out_dtype)),
                            ("reduction", reduction)), device=device)


def workload_for(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                 out_dtype: torch.dtype | None = None) -> Workload:
    """The Workload record of one cross_entropy call (logits seen as (rows, V))."""
    V = hint(logits.shape[-1])
    rows = hint(target.numel())
    return _workload(rows, V, logits.dtype, target.dtype, ignore_index, reduction, out_dtype or logits.dtype,
                     logits.device.type)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `cross_entropy` / `cross_entropy_ref` on this workload.

    Rows get different scales and offsets up to ~+-150 (exp overflows fp32 past 88: a kernel that
    skips the max fails), and about one target in five is the ignore_index."""
    n_rows, V = _dims(workload)
    n_rows = n_rows if rows is None else rows
    device = device or workload.device
    g, where = input_generator(n_rows * V, device, seed)
    x = torch.randn(n_rows, V, generator=g, device=where) * (1 + 2 * torch.rand(n_rows, 1, generator=g, device=where))
    x = (x + 50 * torch.randn(n_rows, 1, generator=g, device=where)).to(parse_dtype(workload.dtypes[0]))
    ignore = int(workload.param("ignore_index", -100))
    t = torch.randint(0, V, (n_rows,), generator=g, device=where)
    t = t.masked_fill(torch.rand(n_rows, generator=g, device=where) < 0.2, ignore)
    t = t.to(getattr(torch, workload.dtypes[1]))
    kwargs = {"ignore_index": ignore, "reduction": str(workload.param("reduction", "mean")),
              "out_dtype": parse_dtype(workload.param("out_dtype", workload.dtypes[0]))}
    return (x.to(device), t.to(device)), kwargs
