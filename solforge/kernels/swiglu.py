"""SwiGLU family (gated activations): y = act(gate) * up, act in silu, gelu_tanh, gelu (erf form).

In order: reference, Triton kernels, launcher, backward kernel + launcher, custom ops (with
autograd), config triad (+ workload_for, make_inputs). Every kernel loads the native dtype,
computes in fp32 and casts on store (the interpreter cannot do bf16 arithmetic, and it is what a
memory-bound kernel should do anyway). The forward rounds act(gate) to the output dtype before the
multiply, as the model's activation op stores it (rounding.as_stored): a bf16 product of two bf16
values is exact in fp32, so the output is then eager's wherever the two fp32 activations round
alike. Rounding once at the end changed 27% of a bf16 SwiGLU's outputs against eager's.

gate and up are seen as (rows, N) after flattening the leading dims. They may be views with a row
stride (Phi-3 writes `gate, up = gate_up.chunk(2, dim=-1)`): the kernels take the strides, so a
chunk costs no copy. The forward reads 2 and writes 1 tensor, the backward reads 3 (dy, gate, up)
and writes 2 (dgate, dup); nothing else, so both are purely memory bound.

Variants (both tile (rows, N) into [ROWS, BLOCK_N] blocks, one 1-D grid over the tiles):
  tile     one tile per program.
  persist  a grid of (SM count x programs per SM) looping over the tiles.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from solforge.kernels import config_text, direct
from solforge.kernels import edges as _edges
from solforge.kernels.launch import Meta, sm_count
from solforge.kernels.launch import launch as _launch
from solforge.kernels.rounding import as_stored
from solforge.numerics import dtype_name, input_generator, parse_dtype
from solforge.records import Workload
from solforge.runtime.shapes import hint

FAMILY = "swiglu"
ACTS = ("silu", "gelu_tanh", "gelu")

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Reference


def _act_ref(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(g)
    if act == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    if act == "gelu":
        return F.gelu(g)
    raise ValueError(f"solforge swiglu: act must be one of {ACTS}, got {act!r}")


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The function every kernel must compute, in fp32 (fp64 for fp32/fp64 inputs): act(gate)
    rounded to gate's dtype, as the model's own activation op stores it, times up, rounded again."""
    acc = torch.float64 if gate.dtype in (torch.float32, torch.float64) else torch.float32
    a = _act_ref(gate.to(acc), act).to(gate.dtype).to(acc)
    return (a * up.to(acc)).to(gate.dtype)


def swiglu_bwd_ref(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of `swiglu_ref` by autograd in fp32/fp64, cast to the inputs' dtypes."""
    acc = torch.float64 if gate.dtype in (torch.float32, torch.float64) else torch.float32
    g = gate.detach().to(acc).requires_grad_(True)
    u = up.detach().to(acc).requires_grad_(True)
    with torch.enable_grad():
        y = _act_ref(g, act) * u
        dg, du = torch.autograd.grad(y, (g, u), dy.to(acc))
    return dg.to(gate.dtype), du.to(up.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@triton.jit
def _act_fwd(g, ACT: tl.constexpr):
    """act(g) for fp32 g. gelu_tanh uses 0.5 * (1 + tanh(z)) == sigmoid(2z), which needs no tanh
    (libdevice only, absent from the interpreter) and stays exact in both tails."""
    if ACT == "silu":
        a = g * tl.sigmoid(g)
    elif ACT == "gelu_tanh":
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g * tl.sigmoid(2.0 * z)
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    return a


@triton.jit
def _act_fwd_bwd(g, ACT: tl.constexpr):
    """(act(g), act'(g)) for fp32 g."""
    if ACT == "silu":
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == "gelu_tanh":
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        s = tl.sigmoid(2.0 * z)
        a = g * s
        # d/dg [g * sigmoid(2z)] = s + g * s * (1 - s) * 2 * z'(g)
        dz = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        da = s + 2.0 * g * s * (1.0 - s) * dz
    else:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    return a, da


@triton.jit
def _tile(tile, n_rows, N, n_col_tiles, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """Row offsets (int64, [ROWS, 1]), columns ([1, BLOCK_N]) and mask of tile number `tile`.

    The column mask is added only where a block pokes past N: a row-only mask is constant along
    the row, so the compiler keeps 16-byte vector accesses. A tile past the last one (persistent
    loop) has every row masked and touches no memory."""
    rt = tile // n_col_tiles
    ct = tile - rt * n_col_tiles
    rows = rt * ROWS + tl.arange(0, ROWS)
    cols = (ct * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    m = (rows < n_rows)[:, None]
    if not EVEN_N:
        m = m & (cols < N)
    # int64: rows * stride overflows int32 past 2^31 elements (chunk views double the stride)
    return rows.to(tl.int64)[:, None], cols, m


@triton.jit
def _fwd_tile(g_ptr, u_ptr, y_ptr, tile, n_rows, N, sg, su, sy, n_col_tiles, ACT: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, EVICT: tl.constexpr):
    r, c, m = _tile(tile, n_rows, N, n_col_tiles, ROWS, BLOCK_N, EVEN_N)
    g = tl.load(g_ptr + r * sg + c, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    u = tl.load(u_ptr + r * su + c, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    y = as_stored(_act_fwd(g, ACT), y_ptr.dtype.element_ty) * u
    tl.store(y_ptr + r * sy + c, as_stored(y, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, n_rows, N, sg, su, sy, n_col_tiles, n_iter, n_progs,
                       ACT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
                       EVICT: tl.constexpr, PERSIST: tl.constexpr):
    """`tile`: program i computes tile i. `persist`: program i computes tiles i, i + n_progs, ...
    (every program runs n_iter trips; tiles past the end are fully masked)."""
    pid = tl.program_id(0)
    if not PERSIST:
        _fwd_tile(g_ptr, u_ptr, y_ptr, pid, n_rows, N, sg, su, sy, n_col_tiles, ACT, ROWS, BLOCK_N, EVEN_N, EVICT)
    else:
        for i in range(0, n_iter):
            _fwd_tile(g_ptr, u_ptr, y_ptr, pid + i * n_progs, n_rows, N, sg, su, sy, n_col_tiles, ACT, ROWS,
                      BLOCK_N, EVEN_N, EVICT)


# The interpreter replaces @triton.jit functions when TRITON_INTERPRET=1 is set before import;
# only then can CPU tensors be launched.
_INTERPRETED = type(_swiglu_fwd_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------
# Launcher


def _bad(msg: str) -> ValueError:
    return ValueError(f"solforge swiglu: {msg}")


def _rows_view(t: torch.Tensor, N: int) -> tuple[torch.Tensor, int]:
    """`t` as (rows, N) with a row stride and a contiguous last dim: a view when the leading dims
    merge into one stride (chunk/split halves of a wider tensor do), else a contiguous copy."""
    t2 = t if t.dim() == 2 else t.reshape(-1, N)
    s0, s1 = t2.stride()
    if s1 != 1 and N > 1:
        t2 = t2.contiguous()
        s0 = N
    return t2, s0


def _rows_out(out: torch.Tensor, N: int, name: str) -> tuple[torch.Tensor, int]:
    try:
        o2 = out if out.dim() == 2 else out.view(-1, N)
    except RuntimeError as e:
        raise _bad(f"{name} must be viewable as (rows, N); pass a contiguous tensor") from e
    s0, s1 = o2.stride()
    if s1 != 1 and N > 1:
        raise _bad(f"{name}'s last dim must be contiguous")
    return o2, s0


def _check(tensors: dict[str, torch.Tensor], act: str) -> tuple[torch.Size, torch.device]:
    if act not in ACTS:
        raise _bad(f"act must be one of {ACTS}, got {act!r}")
    first = next(iter(tensors.values()))
    shape, device = first.shape, first.device
    for name, t in tensors.items():
        if t.dtype not in _SUPPORTED:
            raise _bad(f"{name} has dtype {t.dtype}; supported: bf16, fp16, fp32 (use swiglu_ref for others)")
        if t.shape != shape:
            raise _bad(f"{name} has shape {tuple(t.shape)} but gate has {tuple(shape)}; no broadcasting")
        if t.device != device:
            raise _bad(f"{name} is on {t.device} but gate is on {device}; move them to one device")
    if len(shape) == 0:
        raise _bad("gate must have at least one dimension")
    if device.type != "cuda" and not _INTERPRETED:
        raise _bad(f"tensors are on {device}; the Triton kernels need CUDA tensors "
                   "(or TRITON_INTERPRET=1 set before triton is imported, for CPU tests)")
    return shape, device


def _launch_args(n_rows: int, N: int, config: Config, device: torch.device) -> tuple[int, tuple[int, ...],
                                                                                     dict[str, Any]]:
    """(grid, runtime args after the strides, constexpr/launch kwargs) of a config."""
    c = config
    n_col_tiles = triton.cdiv(N, c.block_n)
    n_tiles = triton.cdiv(n_rows, c.rows) * n_col_tiles
    grid, n_iter = n_tiles, 1
    if c.variant == "persist":
        grid = min(n_tiles, sm_count(device) * c.progs)
        n_iter = triton.cdiv(n_tiles, grid)
    kw = dict(ROWS=c.rows, BLOCK_N=c.block_n, EVEN_N=N % c.block_n == 0,
              EVICT="evict_first" if c.evict else "", PERSIST=c.variant == "persist",
              num_warps=c.num_warps)
    return grid, (n_col_tiles, n_iter, grid), kw


# Everything about a launch that depends only on (shape, dtype, act, config, device), cached so
# a decode step pays for a dict lookup, not for Workload/heuristic/Config work.
_Plan = tuple[int, tuple[int, ...], dict[str, Any]]
_PLANS: dict[tuple[Any, ...], _Plan] = {}


def _plan(n_rows: int, N: int, dtype: torch.dtype, act: str, config: Config | None, device: torch.device) -> _Plan:
    key = (n_rows, N, dtype, act, config, device)
    plan = _PLANS.get(key)
    if plan is None:
        wl = Workload(FAMILY, ((n_rows, N),) * 2, (dtype_name(dtype),) * 2, (("act", act),))
        cfg = heuristic(wl) if config is None else config
        if not is_valid(cfg, wl):  # a bad config could silently skip columns: refuse it
            raise _bad(f"config {cfg.encode()} is not valid for {wl.key}")
        if len(_PLANS) > 4096:  # many distinct row counts (varying sequence lengths): start over
            _PLANS.clear()
        grid, extra, kw = _launch_args(n_rows, N, cfg, device)
        plan = _PLANS[key] = grid, extra, Meta(kw, ACT=act)
    return plan


def swiglu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", *, config: Config | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up with the Triton kernels (see `swiglu_ref`): a fresh contiguous tensor of
    gate's dtype, or `out` written in place (gate's shape and dtype, last dim contiguous).
    `config` picks the kernel (default: `heuristic` for this workload)."""
    shape, device = _check({"gate": gate, "up": up}, act)
    if gate.dtype != up.dtype:
        raise _bad(f"gate is {gate.dtype} but up is {up.dtype}; pass one dtype")
    if out is not None and (out.shape != shape or out.dtype != gate.dtype or out.device != device):
        raise _bad(f"out must have shape {tuple(shape)}, dtype {gate.dtype} and device {device}; got "
                   f"{tuple(out.shape)}, {out.dtype}, {out.device}")
    if out is None:
        out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if gate.numel() == 0:
        return out
    N = int(shape[-1])
    g2, sg = _rows_view(gate, N)
    u2, su = _rows_view(up, N)
    y2, sy = _rows_out(out, N, "out")
    n_rows = g2.shape[0]
    grid, extra, kw = _plan(n_rows, N, gate.dtype, act, config, device)
    _launch(_swiglu_fwd_kernel, (grid,), (g2, u2, y2, n_rows, N, sg, su, sy, *extra), kw)
    return out


# ----------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _bwd_tile(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, tile, n_rows, N, sdy, sg, su, sd, n_col_tiles,
              ACT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
              EVICT: tl.constexpr):
    r, c, m = _tile(tile, n_rows, N, n_col_tiles, ROWS, BLOCK_N, EVEN_N)
    dy = tl.load(dy_ptr + r * sdy + c, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    g = tl.load(g_ptr + r * sg + c, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    u = tl.load(u_ptr + r * su + c, mask=m, other=0.0, eviction_policy=EVICT).to(tl.float32)
    a, da = _act_fwd_bwd(g, ACT)
    off = r * sd + c  # dgate and dup are fresh contiguous tensors: one stride
    tl.store(dg_ptr + off, (dy * u * da).to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(du_ptr + off, (dy * a).to(du_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_rows, N, sdy, sg, su, sd, n_col_tiles, n_iter,
                       n_progs, ACT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                       EVEN_N: tl.constexpr, EVICT: tl.constexpr, PERSIST: tl.constexpr):
    """Grid as in `_swiglu_fwd_kernel`."""
    pid = tl.program_id(0)
    if not PERSIST:
        _bwd_tile(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, pid, n_rows, N, sdy, sg, su, sd, n_col_tiles, ACT, ROWS,
                  BLOCK_N, EVEN_N, EVICT)
    else:
        for i in range(0, n_iter):
            _bwd_tile(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, pid + i * n_progs, n_rows, N, sdy, sg, su, sd,
                      n_col_tiles, ACT, ROWS, BLOCK_N, EVEN_N, EVICT)


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str = "silu", *,
               config: Config | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of y = act(gate) * up for the incoming gradient dy, in one launch: fresh
    contiguous tensors of gate's and up's dtypes, or `out` (two contiguous tensors of those shapes
    and dtypes) written in place. dy may be strided (even expanded: autograd hands `y.sum()`'s
    gradient over as a stride-0 tensor, which is copied first)."""
    shape, device = _check({"gate": gate, "up": up, "dy": dy}, act)
    if out is not None:
        if len(out) != 2 or any(o.shape != t.shape or o.dtype != t.dtype or not o.is_contiguous()
                                for o, t in zip(out, (gate, up), strict=True)):
            raise _bad("out must be (dgate, dup): contiguous tensors of gate's and up's shapes and dtypes")
        dg, du = out
    else:
        dg = torch.empty_like(gate, memory_format=torch.contiguous_format)
        du = torch.empty_like(up, memory_format=torch.contiguous_format)
    if gate.numel() == 0:
        return dg, du
    N = int(shape[-1])
    dy2, sdy = _rows_view(dy, N)
    g2, sg = _rows_view(gate, N)
    u2, su = _rows_view(up, N)
    n_rows = g2.shape[0]
    grid, extra, kw = _plan(n_rows, N, gate.dtype, act, config, device)
    _launch(_swiglu_bwd_kernel, (grid,), (dy2, g2, u2, dg, du, n_rows, N, sdy, sg, su, N, *extra), kw)
    return dg, du


# ----------------------------------------------------------------------------------------------
# Custom ops: what the graph rewrite calls. The config travels as its encoded string ("" for the
# heuristic) so the schema stays plain and torch.compile / export see a constant. Registered with
# torch.library's Library API rather than the @custom_op decorator: the decorator's Python
# wrappers cost 9.3 us a call against 3.6 us here (see rmsnorm.py).

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("swiglu(Tensor gate, Tensor up, str act, str config) -> Tensor")
_LIB.define("swiglu_bwd(Tensor dy, Tensor gate, Tensor up, str act, str config) -> (Tensor, Tensor)")


def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, act: str, config: str) -> torch.Tensor:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return swiglu(gate, up, act, config=Config.decode(fwd) if fwd else None)


def _swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str,
                   config: str) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_bwd(dy, gate, up, act, config=Config.decode(config) if config else None)


_LIB.impl("swiglu", _swiglu_op, "CompositeExplicitAutograd")
_LIB.impl("swiglu_bwd", _swiglu_bwd_op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::swiglu")
def _swiglu_fake(gate: torch.Tensor, up: torch.Tensor, act: str, config: str) -> torch.Tensor:
    return gate.new_empty(gate.shape)  # contiguous, like the real output


@torch.library.register_fake("solforge::swiglu_bwd")
def _swiglu_bwd_fake(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str,
                     config: str) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    gate, up, act, config = inputs
    # Save the inputs, not act(gate): the backward recomputes it from gate, which it reads anyway.
    ctx.save_for_backward(gate, up)
    ctx.act = act
    # the backward's config: the part after "|" (tuned as family swiglu_bwd; "" = the heuristic)
    ctx.bwd_config = config.partition("|")[2]


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
    gate, up = ctx.saved_tensors
    # The forward's tuned config was chosen for 2 reads + 1 write; the backward (3 + 2) has its own.
    dg, du = _swiglu_bwd_call(dy, gate, up, ctx.act, ctx.bwd_config)
    need_g, need_u = ctx.needs_input_grad[:2]
    return (dg if need_g else None), (du if need_u else None), None, None


torch.library.register_autograd("solforge::swiglu", _backward, setup_context=_setup_context)
direct.register(torch.ops.solforge.swiglu.default, _swiglu_op, _setup_context, _backward)
_swiglu_bwd_call = direct.plain(torch.ops.solforge.swiglu_bwd.default, _swiglu_bwd_op)  # what _backward calls

swiglu_op = torch.ops.solforge.swiglu
swiglu_bwd_op = torch.ops.solforge.swiglu_bwd


# ----------------------------------------------------------------------------------------------
# Config triad

VARIANTS = ("tile", "persist")
_WARPS = (1, 2, 4, 8, 16, 32)
# Register budget: fp32 values per operand a thread holds at once (as in rmsnorm.py).
_MAX_PER_THREAD = 64
_MIN_BLOCK = 16
_ABBREV = {"block_n": "bn", "rows": "r", "num_warps": "w", "progs": "p", "evict": "e"}


@dataclass(frozen=True)
class Config(config_text.Text):
    """One kernel choice: [rows, block_n] tiles, warps, and for `persist` programs per SM."""

    variant: str = "tile"
    block_n: int = 1024  # columns per tile, a power of two
    rows: int = 1  # rows per tile, a power of two
    num_warps: int = 4
    progs: int = 0  # persist: programs per SM
    evict: int = 0  # 1: load with evict_first (the inputs are read once)

    _family, _variants, _abbrev = FAMILY, VARIANTS, _ABBREV
    _always = ("block_n", "rows", "num_warps")



def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _dims(workload: Workload) -> tuple[int, int]:
    shape = workload.shapes[0]
    return math.prod(shape[:-1]), shape[-1]


def is_valid(config: Config, workload: Workload) -> bool:
    """Can this config compute this workload correctly without spilling registers?"""
    c = config
    rows, N = _dims(workload)
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or c.evict not in (0, 1):
        return False
    if (c.variant == "persist") != (c.progs > 0) or c.progs > 32:
        return False
    if not (_pow2(c.block_n) and _pow2(c.rows)):
        return False
    # no block wider than the row needs (past the minimum), no tile taller than the rows
    if not (_MIN_BLOCK <= c.block_n <= max(_MIN_BLOCK, triton.next_power_of_2(N))):
        return False
    if c.rows > triton.next_power_of_2(max(rows, 1)):
        return False
    return c.rows * c.block_n // (32 * c.num_warps) <= _MAX_PER_THREAD


def _warps_for(elems: int, per_thread: int) -> int:
    """Warps (a power of two, 1..32) that give each thread about `per_thread` elements."""
    return max(1, min(32, elems // (32 * per_thread)))


def _block_for(N: int) -> int:
    """Column block: the largest power of two <= 1024 that divides N, if >= 256 (no masked lanes:
    9728 -> 512, 11008 -> 256, 14336 -> 1024); otherwise 1024, or the row's width if smaller."""
    full = max(_MIN_BLOCK, triton.next_power_of_2(N))
    if full <= 1024:
        return full
    b = 1024
    while b >= 256:
        if N % b == 0:
            return b
        b //= 2
    return 1024


def _space_blocks(N: int) -> list[int]:
    full = max(_MIN_BLOCK, triton.next_power_of_2(N))
    return [b for b in (256, 512, 1024, 2048, 4096) if b <= full] or [full]


def _unique_valid(cands: list[Config], workload: Workload) -> list[Config]:
    seen: set[Config] = set()
    out = []
    for c in cands:
        if c not in seen and is_valid(c, workload):
            seen.add(c)
            out.append(c)
    return out


def space(workload: Workload) -> list[Config]:
    """The search space: `pruned_space` first (so a budget-limited walk in order tries the
    hand-picked configs first), then the rest of the cross product column block x tile size
    (2K..16K elements) x warps (8 or 16 elements a thread) x {tile, persist with 2/4/8 programs
    per SM} x evict_first, valid configs only. 264 configs at Qwen3-4B's (16384, 9728): the search
    strategies (solforge/tune/search.py) walk it evolutionarily, not exhaustively; 8..112 at the
    small shapes of the CPU tests."""
    rows, N = _dims(workload)
    cands = pruned_space(workload)
    for bn in _space_blocks(N):
        for elems in (2048, 4096, 8192, 16384):
            r = max(1, min(elems // bn, triton.next_power_of_2(max(rows, 1))))
            for ept in (8, 16):
                w = _warps_for(r * bn, ept)
                for variant, progs in (("tile", 0), ("persist", 2), ("persist", 4), ("persist", 8)):
                    cands += [Config(variant, bn, r, w, progs, evict) for evict in (0, 1)]
    return _unique_valid(cands, workload)


def pruned_space(workload: Workload) -> list[Config]:
    """The hand-picked space (what `space` was before the search strategies): column block x
    rows per tile (2K..16K elements a tile) x warps (8 or 16 elements a thread), then persistent
    and evict_first versions of the heuristic's tile; ~20-45 configs at the Qwen3-4B shapes.
    Blocks that divide N come first."""
    rows, N = _dims(workload)
    blocks = _space_blocks(N)
    blocks.sort(key=lambda b: N % b != 0)  # stable: even blocks first, each group ascending
    cands: list[Config] = []
    for bn in blocks:
        for elems in (2048, 4096, 8192, 16384):
            r = max(1, min(elems // bn, triton.next_power_of_2(max(rows, 1))))
            for ept in (8, 16):
                cands.append(Config("tile", bn, r, _warps_for(r * bn, ept)))
    h = heuristic(workload)
    cands += [dataclasses.replace(h, evict=1)]
    for progs in (2, 4, 8):
        cands.append(dataclasses.replace(h, variant="persist", progs=progs))
    return _unique_valid(cands, workload)


def heuristic(workload: Workload) -> Config:
    """Untuned default (always valid): ~4096 elements a tile (8 KB per bf16 operand: with 8
    programs of 8 warps resident per SM that is >= 128 KB of loads in flight, well past what
    HBM3's latency x bandwidth needs per SM), 16 elements (two 16-byte vectors of bf16) a
    thread, column block from `_block_for`. Not yet measured on a GPU: bench/families.py does."""
    rows, N = _dims(workload)
    bn = _block_for(N)
    r = max(1, min(4096 // bn, triton.next_power_of_2(max(rows, 1))))
    c = Config("tile", bn, r, _warps_for(r * bn, 16))
    return c if is_valid(c, workload) else Config("tile", bn, 1, _warps_for(bn, 16))


def workload_for(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> Workload:
    """The Workload record of one swiglu call (gate and up seen as (rows, N))."""
    # hint(): under dynamic shapes these may be SymInts; a Workload holds plain numbers (no guard).
    N = hint(gate.shape[-1]) if gate.dim() else 1
    rows = math.prod(hint(d) for d in gate.shape[:-1])
    return Workload(family=FAMILY, shapes=((rows, N), (rows, N)),
                    dtypes=(dtype_name(gate.dtype), dtype_name(up.dtype)), params=(("act", act),),
                    device=gate.device.type)


def backward_workload(workload: Workload) -> Workload:
    """The workload of this call's backward (family swiglu_bwd, kernels/swiglu_bwd.py): the same
    shapes, dtypes and act, which are what the backward kernel depends on."""
    return dataclasses.replace(workload, family=f"{FAMILY}_bwd")


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `swiglu` / `swiglu_ref` on this workload.

    Drawn on the CPU from `seed` then moved, so the same seed gives the same numbers on any device;
    except past 2^24 elements, drawn on the device itself (seeded too): the CPU generator needs
    seconds for Qwen3-4B's 16384 x 9728 (159M elements) and the verifier draws 5 sets per
    candidate, which would eat most of a tuning budget.
    gate is spread over [-6, 6]-ish (randn x 2) so both tails of every activation are exercised.
    """
    n_rows, N = _dims(workload)
    n_rows = n_rows if rows is None else rows
    device = torch.device(device or workload.device)
    g, where = input_generator(n_rows * N, device, seed)
    gate = (2 * torch.randn(n_rows, N, generator=g, device=where)).to(parse_dtype(workload.dtypes[0])).to(device)
    up = torch.randn(n_rows, N, generator=g, device=where).to(parse_dtype(workload.dtypes[1])).to(device)
    return (gate, up), {"act": workload.param("act", "silu")}


def edge_inputs(workload: Workload, *, seed: int, rows: int | None = None, device: str | torch.device | None = None
                ) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Rows the verifier adds to its random ones (tune/verify.py; kernels/edges.py), in a draw of
    `rows` rows: a config's row tile is valid only up to about the workload's row count."""
    args, kwargs = make_inputs(workload, seed=seed, rows=rows, device=device)
    return _edges.edge_rows(args, kwargs, {
        "large gate": lambda r: r * 30,  # exp(-gate) overflows in a sigmoid written x * e^x / (1 + e^x); a clamp
        "zero gate": lambda r: r * 0,  # act(0) = 0 exactly
    }) + _edges.edge_rows(args, kwargs, {"large up": lambda r: r * 100}, arg=1)  # a clamp of up or the product


def norm_error_bound(workload: Workload) -> float:
    """The verifier's norm-relative error bound (tune/verify.py), from what the kernels reach on the
    interpreter (the measurement: the comment on _NORM_COMPUTE_ULPS)."""
    return _edges.norm_bound(parse_dtype(workload.dtypes[0]), compute_ulps=_NORM_COMPUTE_ULPS,
                             round_ulps=_NORM_ROUND_ULPS)


# Norm-relative error bound of the verifier, in ulps (kernels/edges.py norm_bound). Measured on the
# interpreter (2026-11-27), heuristic + 6 configs each of 13 x 96 (silu: bf16, fp16, fp32;
# gelu_tanh: bf16, fp32), with the edge rows: 9.1e-7 for bf16 (gelu_tanh; 0 with silu), 4.8e-6 for
# fp16 (0.005 ulp), 6.5e-8 for fp32. Bounds: bf16 3.9e-4, fp16 5.0e-5 (10x), fp32 9.6e-7 (15x);
# skipping the activation's rounding to gate's dtype gives 2.7e-3.
_NORM_COMPUTE_ULPS, _NORM_ROUND_ULPS = 8, 0.05
