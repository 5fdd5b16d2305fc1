"""Adversarial launchers: small wrong variants of the real rmsnorm, softmax, layernorm and swiglu
launchers, each of a kind that an earlier verifier let through (tests/test_verify_adversarial.py
asserts the verifier rejects every one, and names the check that caught it).

Each entry of ADVERSARIES[family] is (name, factory, check): `factory(fam, wl)` returns a launcher
`launch(*args, out=None, **kwargs)` and `check` is a piece of the reason the verifier must give ("a|b": either).
Generic ones wrap the family's real launcher; family ones compute the family's reference with one
thing changed (a dropped eps, a reduction one element short, a half-precision accumulator, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from solforge.records import Workload
from solforge.tune import launcher_of

Launch = Callable[..., Any]
Factory = Callable[[ModuleType, Workload], Launch]
Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def _items(x: Outputs) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _emit(y: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A computed fp32 result, stored the way a launcher stores it: into `out` or a new tensor."""
    if out is not None:
        out.copy_(y.to(dtype))
        return out
    return y.to(dtype)


def _span(t: torch.Tensor) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


# ---------------------------------------------------------------------------------------------
# generic: the real launcher with one thing wrong around it


def scaled_after(n: int, factor: float = 1.005) -> Factory:
    """Right for its first `n` calls, then every output scaled by `factor` (a cache that goes stale)."""
    def make(fam: ModuleType, wl: Workload) -> Launch:
        real, calls = launcher_of(fam), [0]

        def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
            calls[0] += 1
            r = real(*a, out=out, **kw)
            if calls[0] > n:
                for o in _items(r):
                    o.mul_(factor)
            return r
        return launch
    return make


def skips_last_row_without_out(fam: ModuleType, wl: Workload) -> Launch:
    """Through `out=` right; without it (the model's path), the last row is never written."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        if out is not None:
            return real(*a, out=out, **kw)
        y = real(*a, **kw)
        fresh = torch.empty_like(y)
        fresh[:-1] = y[:-1]
        return fresh
    return launch


def returns_input_without_out(fam: ModuleType, wl: Workload) -> Launch:
    """Without `out=`, returns its first input."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        return real(*a, out=out, **kw) if out is not None else a[0]
    return launch


def computes_in_place_without_out(fam: ModuleType, wl: Workload) -> Launch:
    """Without `out=`, writes the right result over its first input and returns that."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        if out is not None:
            return real(*a, out=out, **kw)
        return a[0].copy_(real(*a, **kw))
    return launch


def writes_past_the_end(fam: ModuleType, wl: Workload) -> Launch:
    """The real kernel, then one element written just past `out` (through its storage, which on the
    CPU is safe only because the verifier's buffer is larger: with an exact-size one the write
    raises)."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        r = real(*a, out=out, **kw)
        if out is not None:
            for o in _items(out):
                o.as_strided((1,), (1,), o.storage_offset() + _span(o)).fill_(0.0)
        return r
    return launch


def writes_before_the_start(fam: ModuleType, wl: Workload) -> Launch:
    """The real kernel, then one element written just before `out` (a row index of -1)."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        r = real(*a, out=out, **kw)
        if out is not None:
            for o in _items(out):
                o.as_strided((1,), (1,), o.storage_offset() - 1).fill_(1.0)
        return r
    return launch


def writes_a_row_past_the_end(fam: ModuleType, wl: Workload) -> Launch:
    """A grid one tile too many: the last row written again one row further on."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        r = real(*a, out=out, **kw)
        if out is not None:
            for o in _items(out):
                n = o.shape[-1]
                o.as_strided((n,), (1,), o.storage_offset() + _span(o)).copy_(o.reshape(-1, n)[-1])
        return r
    return launch


def ignores_strides(fam: ModuleType, wl: Workload) -> Launch:
    """Reads every 2-D+ input as if its rows were packed (row stride = row length)."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        packed = tuple(t.as_strided(t.shape, _contiguous_strides(t.shape), t.storage_offset())
                       if isinstance(t, torch.Tensor) and t.dim() >= 2 else t for t in a)
        return real(*packed, out=out, **kw)
    return launch


def tail_rows_unwritten(block: int) -> Factory:
    """Writes only whole blocks of `block` rows: the tail of a row count that is no multiple of it
    is never written."""
    def make(fam: ModuleType, wl: Workload) -> Launch:
        real = launcher_of(fam)

        def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
            y = real(*a, **kw)
            dst = out if out is not None else torch.empty_like(y)
            n = y.shape[0] // block * block
            dst[:n] = y[:n]
            return dst
        return launch
    return make


def right_only_at_the_workload_rows(fam: ModuleType, wl: Workload) -> Launch:
    """Right at the workload's row count, its last row left unwritten at any other (a plan cached
    for one shape): an odd workload whose odd-shape trial had the same rows let it through."""
    real = launcher_of(fam)
    rows = wl.shapes[0][0]

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        y = real(*a, **kw)
        dst = out if out is not None else torch.empty_like(y)
        n = y.shape[0] if y.shape[0] == rows else y.shape[0] - 1
        dst[:n] = y[:n]
        return dst
    return launch


def clamps_input(lim: float = 6.0) -> Factory:
    """The first input clamped to +-lim before the real kernel (a saturating load)."""
    def make(fam: ModuleType, wl: Workload) -> Launch:
        real = launcher_of(fam)

        def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
            return real(a[0].clamp(-lim, lim), *a[1:], out=out, **kw)
        return launch
    return make


def clamps_finite_input(lim: float) -> Factory:
    """Finite values of the first input clamped to +-lim (-inf, a mask, kept)."""
    def make(fam: ModuleType, wl: Workload) -> Launch:
        real = launcher_of(fam)

        def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
            x = a[0]
            return real(torch.where(x.isinf(), x, x.clamp(-lim, lim)), *a[1:], out=out, **kw)
        return launch
    return make


def clamps_output(lim: float = 6.0) -> Factory:
    """The real kernel's output clamped to +-lim (a saturating store)."""
    def make(fam: ModuleType, wl: Workload) -> Launch:
        real = launcher_of(fam)

        def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
            r = real(*a, out=out, **kw)
            for o in _items(r):
                o.clamp_(-lim, lim)
            return r
        return launch
    return make


def last_column_unwritten(fam: ModuleType, wl: Workload) -> Launch:
    """A tail mask one short: the last column never stored."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        y = real(*a, **kw)
        dst = out if out is not None else torch.empty_like(y)
        dst[..., :-1] = y[..., :-1]
        return dst
    return launch


def flushes_tiny_outputs(fam: ModuleType, wl: Workload) -> Launch:
    """Outputs under 1e-3 in magnitude stored as 0 (a fast-math flush)."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        r = real(*a, out=out, **kw)
        for o in _items(r):
            o.masked_fill_(o.abs() < 1e-3, 0.0)
        return r
    return launch


def last_ulp_bias(fam: ModuleType, wl: Workload) -> Launch:
    """Every output nudged up by 0.3% before its rounding: inside bf16's element tolerance."""
    real = launcher_of(fam)

    def launch(*a: Any, out: Outputs | None = None, **kw: Any) -> Any:
        y = real(*a, **kw)
        dst = out if out is not None else torch.empty_like(y)
        dst.copy_((y.double() * 1.003).to(y.dtype))
        return dst
    return launch


GENERIC: list[tuple[str, Factory, str]] = [
    ("right for 2 calls", scaled_after(2), "norm-relative"),
    ("right for 5 calls", scaled_after(5), "norm-relative"),
    ("right for 8 calls", scaled_after(8), "norm-relative"),
    ("skips the last row without out=", skips_last_row_without_out, "model path"),
    ("returns its input without out=", returns_input_without_out, "model path"),
    ("computes in place without out=", computes_in_place_without_out, "model path"),
    ("writes 1 element past the end", writes_past_the_end, "past the end of the output"),
    ("writes 1 element before the start", writes_before_the_start, "before the output"),
    ("writes a row past the end", writes_a_row_past_the_end, "past the end of the output"),
    ("ignores strides", ignores_strides, "strided inputs"),
    ("writes whole 4-row blocks only", tail_rows_unwritten(4), "NaN/Inf (or unwritten)"),
    ("right only at the workload's rows", right_only_at_the_workload_rows, "odd shape"),
    ("leaves the last column unwritten", last_column_unwritten, "NaN/Inf (or unwritten)"),
    ("biased by 0.3%", last_ulp_bias, "norm-relative"),
]


# ---------------------------------------------------------------------------------------------
# family ones: the reference with one thing changed


def torch_kernel(fn: Callable[..., torch.Tensor], out_dtype: Callable[..., torch.dtype]) -> Factory:
    """A launcher computing `fn(*args, **kwargs)` in torch, stored in `out_dtype(*args, **kwargs)`."""
    def make(fam: ModuleType, wl: Workload) -> Launch:
        def launch(*a: Any, out: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
            return _emit(fn(*a, **kw), out, out_dtype(*a, **kw))
        return launch
    return make


def _seq_sum(v: torch.Tensor, dtype: torch.dtype, n: int | None = None) -> torch.Tensor:
    """sum over the last dim, one element at a time in `dtype` (a low-precision accumulator)."""
    acc = torch.zeros(v.shape[:-1], dtype=dtype, device=v.device)
    for j in range(v.shape[-1] if n is None else n):
        acc = (acc.float() + v[..., j].float()).to(dtype)
    return acc.float()


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, *, ss: torch.Tensor | None = None,
         denom: float | None = None, eps_outside: bool = False, plus_one: bool = False,
         **_: Any) -> torch.Tensor:
    xf = x.float()
    H = x.shape[-1]
    s = (xf * xf).sum(-1) if ss is None else ss
    ms = (s / (denom or H))[..., None]
    y = xf / (ms.sqrt() + eps) if eps_outside else xf * torch.rsqrt(ms + eps)
    if w is not None:
        y = y * ((1 + w.float()) if plus_one else w.float())
    return y


def _rms_out(x: torch.Tensor, *a: Any, out_dtype: torch.dtype | None = None, **kw: Any) -> torch.Tensor:
    return out_dtype or x.dtype


RMSNORM: list[tuple[str, Factory, str]] = [
    ("drops eps", torch_kernel(lambda x, w, eps, **k: _rms(x, w, 0.0), _rms_out), "edge 'all-zero row'"),
    ("eps outside the root", torch_kernel(lambda x, w, eps, **k: _rms(x, w, eps, eps_outside=True), _rms_out),
     "norm-relative|edge 'tiny magnitudes'"),
    ("eps 10x", torch_kernel(lambda x, w, eps, **k: _rms(x, w, eps * 10), _rms_out),
     "norm-relative|edge 'tiny magnitudes'"),
    ("sum of squares one short", torch_kernel(
        lambda x, w, eps, **k: _rms(x, w, eps, ss=(x.float()[..., :-1] ** 2).sum(-1)), _rms_out),
     "out of tolerance|norm-relative"),
    ("mean over H + 1", torch_kernel(lambda x, w, eps, **k: _rms(x, w, eps, denom=x.shape[-1] + 1), _rms_out),
     "norm-relative"),
    ("fp16 squares", torch_kernel(  # each square rounded to fp16: 0.05% errors, inf past 256
        lambda x, w, eps, **k: _rms(x, w, eps, ss=(x.half() * x.half()).float().sum(-1)), _rms_out),
     "norm-relative"),
    ("fp16 accumulator", torch_kernel(  # an fp16 running sum: overflows past 65504
        lambda x, w, eps, **k: _rms(x, w, eps, ss=_seq_sum(x.float() ** 2, torch.float16)), _rms_out),
     "norm-relative"),
    ("bf16 accumulator", torch_kernel(
        lambda x, w, eps, **k: _rms(x, w, eps, ss=_seq_sum(x.float() ** 2, torch.bfloat16)), _rms_out),
     "norm-relative"),
    ("weight as 1 + w", torch_kernel(lambda x, w, eps, **k: _rms(x, w, eps, plus_one=True), _rms_out),
     "out of tolerance"),
    ("ignores the weight", torch_kernel(lambda x, w, eps, **k: _rms(x, None, eps), _rms_out), "out of tolerance"),
    ("clamps its output at +-6", clamps_output(), "edge 'single spike'"),
    ("flushes outputs under 1e-3", flushes_tiny_outputs, "norm-relative"),
    ("clamps its input at +-6", clamps_input(), "edge 'large magnitudes'"),
]


def _softmax(x: torch.Tensor, *, n: int | None = None, max_sub: bool = True, nan_to: float | None = None,
             acc: torch.dtype | None = None, **_: Any) -> torch.Tensor:
    xf = x.float()
    m = xf.max(-1, keepdim=True).values if max_sub else torch.zeros_like(xf[..., :1])
    e = (xf - m).exp()
    if acc is not None:
        s = _seq_sum(e, acc, n)[..., None]
    else:
        s = e[..., :n].sum(-1, keepdim=True)  # n None: the whole row
    y = e / s
    return y.nan_to_num(nan=nan_to) if nan_to is not None else y


def _sm_out(x: torch.Tensor, *a: Any, out_dtype: torch.dtype | None = None, **kw: Any) -> torch.Tensor:
    return out_dtype or x.dtype


SOFTMAX: list[tuple[str, Factory, str]] = [
    ("no max subtraction", torch_kernel(lambda x, **k: _softmax(x, max_sub=False), _sm_out), "NaN/Inf"),
    ("0 for a fully masked row", torch_kernel(lambda x, **k: _softmax(x, nan_to=0.0), _sm_out),
     "edge 'fully masked row'"),
    ("1/N for a fully masked row", torch_kernel(
        lambda x, **k: _softmax(x, nan_to=1.0 / x.shape[-1]), _sm_out), "edge 'fully masked row'"),
    ("sum one short", torch_kernel(lambda x, **k: _softmax(x, n=x.shape[-1] - 1), _sm_out), "norm-relative"),
    ("bf16 accumulator", torch_kernel(lambda x, **k: _softmax(x, acc=torch.bfloat16), _sm_out), "norm-relative"),
    ("fp16 accumulator", torch_kernel(lambda x, **k: _softmax(x, acc=torch.float16), _sm_out), "norm-relative"),
    ("flushes outputs under 1e-3", flushes_tiny_outputs, "norm-relative"),
    ("clamps its input at +-1e3", clamps_input(1e3), "edge 'fully masked row'"),  # -inf becomes -1e3
    ("clamps finite inputs at +-1e3", clamps_finite_input(1e3), "edge 'large magnitudes'"),
]


def _ln(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, *, one_pass: bool = False,
        unbiased: bool = False, drop_bias: bool = False, **_: Any) -> torch.Tensor:
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    if one_pass:
        var = (xf * xf).mean(-1, keepdim=True) - mean * mean
    else:
        var = xf.var(-1, keepdim=True, unbiased=unbiased)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if w is not None:
        y = y * w.float()
    if b is not None and not drop_bias:
        y = y + b.float()
    return y


LAYERNORM: list[tuple[str, Factory, str]] = [
    ("drops eps", torch_kernel(lambda x, w, b, eps, **k: _ln(x, w, b, 0.0), _rms_out), "edge 'zero row'"),
    ("unbiased variance", torch_kernel(lambda x, w, b, eps, **k: _ln(x, w, b, eps, unbiased=True), _rms_out),
     "norm-relative"),
    ("ignores the bias", torch_kernel(lambda x, w, b, eps, **k: _ln(x, w, b, eps, drop_bias=True), _rms_out),
     "out of tolerance"),
    ("clamps its output at +-6", clamps_output(), "edge 'single spike'"),
    ("clamps its input at +-50", clamps_input(50), "edge 'large magnitudes'"),
]


def _swiglu(g: torch.Tensor, u: torch.Tensor, act: str = "silu", *, naive: bool = False, round_act: bool = True,
            **_: Any) -> torch.Tensor:
    gf = g.float()
    a = gf * gf.exp() / (1 + gf.exp()) if naive else torch.nn.functional.silu(gf)
    if round_act:
        a = a.to(g.dtype).float()
    return a * u.float()


def _sw_out(g: torch.Tensor, *a: Any, **kw: Any) -> torch.dtype:
    return g.dtype


SWIGLU: list[tuple[str, Factory, str]] = [
    ("sigmoid as e^x / (1 + e^x)", torch_kernel(lambda g, u, act="silu", **k: _swiglu(g, u, naive=True), _sw_out),
     "edge 'large gate'"),
    ("act not rounded to gate's dtype", torch_kernel(
        lambda g, u, act="silu", **k: _swiglu(g, u, round_act=False), _sw_out), "norm-relative"),
    ("gate and up swapped", torch_kernel(lambda g, u, act="silu", **k: _swiglu(u, g), _sw_out), "out of tolerance"),
    ("clamps up at +-6", torch_kernel(lambda g, u, act="silu", **k: _swiglu(g, u.clamp(-6, 6)), _sw_out),
     "edge 'large up'"),
    ("clamps its output at +-50", clamps_output(50), "edge 'large"),
    ("clamps gate at +-30", clamps_input(30), "edge 'large gate'"),
]

# fp32 layernorm: E[x^2] - E[x]^2 cancels only where the input keeps a large mean's low bits (bf16
# inputs have none to lose: 1000 + randn rounds to multiples of 8)
LAYERNORM_FP32: list[tuple[str, Factory, str]] = [
    ("one-pass variance", torch_kernel(lambda x, w, b, eps, **k: _ln(x, w, b, eps, one_pass=True), _rms_out),
     "norm-relative|edge 'large mean, unit spread'"),
    ("drops eps", torch_kernel(lambda x, w, b, eps, **k: _ln(x, w, b, 0.0), _rms_out), "norm-relative"),
    ("unbiased variance", torch_kernel(lambda x, w, b, eps, **k: _ln(x, w, b, eps, unbiased=True), _rms_out),
     "out of tolerance"),
    ("biased by 0.3%", last_ulp_bias, "out of tolerance"),
]

# by workload name (tests/test_verify_adversarial.py's WORKLOADS)
ADVERSARIES: dict[str, list[tuple[str, Factory, str]]] = {
    "rmsnorm": GENERIC + RMSNORM,
    "softmax": GENERIC + SOFTMAX,
    "layernorm": GENERIC + LAYERNORM,
    "layernorm fp32": LAYERNORM_FP32,
    "swiglu": GENERIC + SWIGLU,
}
