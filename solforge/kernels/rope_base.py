"""What the rope family's forward (kernels/rope.py) and backward (kernels/rope_bwd.py) both use: the
reference (the backward differentiates it), the Triton helpers both kernels call, the launch
helpers (argument checks, layouts, the cached config check), the config triad with the backward's
space and heuristic, workload_for and make_inputs.

Here so that rope_bwd.py need not import rope.py, which imports rope_bwd.py for the backward's
launcher: the dependency runs one way, rope -> rope_bwd -> rope_base. rope.py re-exports every name
(and keeps the forward kernels, the launcher, the forward's space and the custom ops). The Triton
helpers' bodies and the globals they read are unchanged: the compiled kernels are the same.
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

from solforge.kernels import config_text
from solforge.kernels.interp import INTERPRETED, cast_rne
from solforge.kernels.launch import Meta
from solforge.numerics import dtype_name, input_generator, parse_dtype
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
# Triton helpers the forward and backward kernels share (a [TOKENS, HEADS, D/2] tile twice: see rope.py)


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


# ----------------------------------------------------------------------------------------------
# Launch helpers


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


# ----------------------------------------------------------------------------------------------
# Config triad (the forward's space is in rope.py; the backward's here, rope_bwd.py tunes it)


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


def verify_rows(workload: Workload) -> int:
    """The verifier's odd shape replaces the sequence length S (see make_inputs' `rows`)."""
    return workload.shapes[0][1]


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
