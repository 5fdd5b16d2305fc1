"""Decided the shared direct launch (kernels/launch.py, SOLFORGE_DIRECT_LAUNCH): host time per op call with it on and
off (bench/results/2026-11-22-h100-session4.md). tests/test_launch.py reuses its cases.

Host (CPU) time per call of every solforge custom op, with the direct launch path
(solforge/kernels/launch.py) on and off, against eager PyTorch.

    python tools/host_overhead.py [--families rmsnorm,rope] [--shapes small,train] [--calls 30]
                                  [--out bench/results/NAME.json]

For each family op, at 64 rows ("small") and at a Qwen3-4B training shape ("train": B1 S4096,
hidden 2560, intermediate 9728, 32/8 heads of 128, vocabulary 151936), the host time of one call is
the wall clock of --calls back-to-back calls without synchronizing, after warm-up calls (so the
kernels are compiled and the direct path's cache is filled), divided by the count: Python,
dispatch, allocations and launches. Measured for the forward alone (no_grad) and forward +
backward (torch.autograd.grad through the op's autograd formula), with the direct path on and off
(set_enabled; SOLFORGE_DIRECT_LAUNCH=0 turns it off for a whole process), and for the eager
PyTorch form of the same computation. A call whose host time is below its GPU time is not
host-bound; the GPU queue holds far more launches than one run makes, so the host time is not
inflated by a full queue. `launch_us` is the launch alone: one small kernel of 14 arguments
through Triton's `kernel[grid](...)`, through `launch` (direct path on), and CompiledKernel.run.

The case builders (`build`) are shared with tests/test_launch.py's GPU tests.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

EPS = 1e-6
BF = torch.bfloat16


@dataclass(frozen=True)
class Dims:
    hidden: int = 2560
    inter: int = 9728
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    vocab: int = 151936
    softmax_n: int = 4096  # an attention row at S4096


QWEN3_4B = Dims()
FAMILIES = ("rmsnorm", "add_rmsnorm", "rope", "swiglu", "gelu", "layernorm", "add_layernorm", "softmax",
            "cross_entropy", "linear_cross_entropy")


@dataclass
class Case:
    family: str
    leaves: list[torch.Tensor]  # the op's tensor inputs; those requiring grad are differentiated
    op: Callable[..., Any]  # the solforge custom op on the leaves
    eager: Callable[..., Any]  # the same computation in eager PyTorch
    pick: Callable[[Any], tuple[torch.Tensor, ...]]  # the outputs a backward starts from


def _t(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: str, offset: int = 0,
       scale: float = 1.0, shift: float = 0.0, grad: bool = False) -> torch.Tensor:
    """A contiguous random tensor whose first element sits `offset` elements into its storage, so
    offset * itemsize % 16 != 0 gives a pointer that is not 16-byte aligned."""
    n = 1
    for d in shape:
        n *= d
    buf = (torch.randn(n + offset, generator=g, device=device) * scale + shift).to(dtype)
    t = buf[offset:].view(shape)
    return t.requires_grad_(grad)


def _hf_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _hf_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qw: torch.Tensor,
             kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's q/k norm, transpose to (B, H, S, D) and rotary embedding, as Hugging Face writes it."""
    q, k = _hf_rms(q, qw).transpose(1, 2), _hf_rms(k, kw).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _first(r: Any) -> tuple[torch.Tensor, ...]:
    return (r[0],) if isinstance(r, (tuple, list)) else (r,)


def _all(r: Any) -> tuple[torch.Tensor, ...]:
    return tuple(r) if isinstance(r, (tuple, list)) else (r,)


def build(family: str, rows: int, device: str, dims: Dims = QWEN3_4B, offset: int = 0, seed: int = 0) -> Case:
    """One family's op on fresh inputs of `rows` rows (tokens); `offset` misaligns every float input."""
    from solforge.kernels import (
        add_layernorm,
        add_rmsnorm,
        cross_entropy,
        gelu,
        layernorm,
        linear_cross_entropy,
        rmsnorm,
        rope,
        softmax,
        swiglu,
    )

    g = torch.Generator(device=device).manual_seed(seed)
    H, o = dims.hidden, offset

    def t(shape: tuple[int, ...], **kw: Any) -> torch.Tensor:
        return _t(shape, BF, g, device, o, grad=True, **kw)

    if family == "rmsnorm":
        return Case(family, [t((rows, H)), t((H,), scale=0.1, shift=1.0)],
                    lambda x, w: rmsnorm.rmsnorm_op(x, w, EPS, BF, True, ""), _hf_rms, _all)
    if family == "add_rmsnorm":
        def eager_add_rms(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> Any:
            s = x + r
            return s, _hf_rms(s, w)
        return Case(family, [t((rows, H)), t((rows, H)), t((H,), scale=0.1, shift=1.0)],
                    lambda x, r, w: add_rmsnorm.add_rmsnorm_op(x, r, w, EPS, BF, True, ""), eager_add_rms, _all)
    if family == "rope":
        D = dims.head_dim
        theta = torch.rand((1, rows, D), generator=g, device=device) * 6.2832
        return Case(family, [t((1, rows, dims.heads_q, D)), t((1, rows, dims.heads_kv, D)), theta.cos().to(BF),
                             theta.sin().to(BF), t((D,), scale=0.1, shift=1.0), t((D,), scale=0.1, shift=1.0)],
                    lambda q, k, c, s, qw, kw: rope.rope_op(q, k, c, s, qw, kw, EPS, True, True, True, BF, ""),
                    _hf_rope, _all)
    if family == "swiglu":
        return Case(family, [t((rows, dims.inter)), t((rows, dims.inter))],
                    lambda a, b: swiglu.swiglu_op(a, b, "silu", ""), lambda a, b: F.silu(a) * b, _all)
    if family == "gelu":
        return Case(family, [t((rows, dims.inter)), t((dims.inter,))],
                    lambda x, b: gelu.gelu_op(x, b, "tanh", ""), lambda x, b: F.gelu(x + b, approximate="tanh"), _all)
    if family in ("layernorm", "add_layernorm"):
        w, b = t((H,), scale=0.1, shift=1.0), t((H,), scale=0.1)
        if family == "layernorm":
            return Case(family, [t((rows, H)), w, b], lambda x, w, b: layernorm.layernorm_op(x, w, b, EPS, BF, ""),
                        lambda x, w, b: F.layer_norm(x, (H,), w, b, EPS), _all)

        def eager_add_ln(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
            s = x + r
            return s, F.layer_norm(s, (H,), w, b, EPS)
        return Case(family, [t((rows, H)), t((rows, H)), w, b],
                    lambda x, r, w, b: add_layernorm.add_layernorm_op(x, r, w, b, EPS, BF, ""), eager_add_ln, _all)
    if family == "softmax":
        return Case(family, [t((rows, dims.softmax_n), scale=3.0)], lambda x: softmax.softmax_op(x, BF, ""),
                    lambda x: F.softmax(x.float(), dim=-1).to(x.dtype), _all)
    labels = torch.randint(0, dims.vocab, (rows,), generator=g, device=device)
    labels[::7] = -100  # some ignored rows
    if family == "cross_entropy":
        return Case(family, [t((rows, dims.vocab), scale=2.0), labels],
                    lambda x, y: cross_entropy.cross_entropy_op(x, y, -100, "mean", torch.float32, ""),
                    lambda x, y: F.cross_entropy(x.float(), y), _first)
    if family == "linear_cross_entropy":
        return Case(family, [t((rows, H)), t((dims.vocab, H), scale=0.02), labels],
                    lambda h, w, y: linear_cross_entropy.linear_cross_entropy_op(h, w, None, y, -100, "mean",
                                                                               torch.float32, 3, ""),
                    lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y), _first)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def forward(case: Case, eager: bool = False) -> Any:
    with torch.no_grad():
        return (case.eager if eager else case.op)(*case.leaves)


def stepper(case: Case, eager: bool = False) -> Callable[[], tuple[torch.Tensor, ...]]:
    """forward + backward: the gradients of the differentiable leaves for fixed random output
    gradients (drawn once, on the first call)."""
    fn = case.eager if eager else case.op
    wrt = [t for t in case.leaves if t.requires_grad]
    grads: list[torch.Tensor] = []

    def step() -> tuple[torch.Tensor, ...]:
        outs = case.pick(fn(*case.leaves))
        if not grads:
            g = torch.Generator(device=outs[0].device).manual_seed(1)
            grads.extend(torch.randn(o.shape, generator=g, device=o.device).to(o.dtype) for o in outs)
        return torch.autograd.grad(outs, wrt, grads)

    return step


# ----------------------------------------------------------------------------------------------


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn: Callable[[], Any], calls: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    _sync()
    return round(us, 2)


@triton.jit
def _launch_probe(a, b, c, d, e, f, y, n, h, s1, s2, s3, s4, eps, BLOCK: tl.constexpr, FLAG: tl.constexpr,  # noqa: N803
                  MODE: tl.constexpr):
    """A one-program kernel with a norm's argument list: 7 pointers, 6 ints, a float, 3 constexprs."""
    i = tl.arange(0, BLOCK)
    v = tl.load(a + i, mask=i < n, other=0.0)
    if FLAG:
        v = v + eps
    tl.store(y + i, v, mask=i < n)


def launch_us(calls: int = 2000) -> dict[str, float]:
    """The launch alone: Triton's path, `launch` with the direct path (a plain dict and a Meta of
    constexprs), and CompiledKernel.run called by hand."""
    from solforge.kernels import launch as L

    x = torch.zeros(4096, device="cuda")
    args = (x, x, x, x, x, x, torch.empty_like(x), 1000, 4096, 4096, 4096, 4096, 4096, 1e-6)
    meta = dict(BLOCK=1024, FLAG=True, MODE="a", num_warps=4)
    frozen = L.Meta(meta)
    compiled = _launch_probe[(1,)](*args, **meta)
    stream = torch.cuda.current_stream().cuda_stream
    prev = L.set_enabled(True)
    out = {
        "triton": host_us(lambda: _launch_probe[(1,)](*args, **meta), calls, 50),
        "direct_dict": host_us(lambda: L.launch(_launch_probe, (1,), args, meta), calls, 50),
        "direct_meta": host_us(lambda: L.launch(_launch_probe, (1,), args, frozen), calls, 50),
        "compiled_run": host_us(lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata,
                                                     None, None, None, *args, 1024, True, "a"), calls, 50),
    }
    L.set_enabled(prev)
    return out


def measure(family: str, shape: str, rows: int, calls: int, device: str) -> dict[str, Any]:
    from solforge.kernels import launch as L

    case = build(family, rows, device)
    if family == "linear_cross_entropy":  # ~15 ms of GPU a call at the training shape: keep the queue short
        calls = min(calls, 10)
    row: dict[str, Any] = {"rows": rows, "calls": calls}
    prev = L.enabled()
    try:
        for mode, on in (("direct", True), ("triton", False)):
            L.set_enabled(on)
            row[f"{mode}_fwd_us"] = host_us(lambda: forward(case), calls)
            row[f"{mode}_fwd_bwd_us"] = host_us(stepper(case), calls)
        row["eager_fwd_us"] = host_us(lambda: forward(case, eager=True), calls)
        row["eager_fwd_bwd_us"] = host_us(stepper(case, eager=True), calls)
    except Exception as e:  # one family's failure is data, not the end of the run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        L.set_enabled(prev)
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from e2e import provenance, write_json  # bench/ is a folder of scripts, not a package

    from solforge.kernels import launch as L

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--shapes", default="small,train")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {"small": 64, "train": 4096}
    t0 = time.perf_counter()
    result: dict[str, Any] = provenance() | {"direct_supported": L.enabled() or L._SUPPORTED, "calls": args.calls,
                                             "dims": QWEN3_4B.__dict__, "launch_us": {}, "ops": []}
    if device == "cuda":
        result["launch_us"] = launch_us()
        print("launch alone (us):", result["launch_us"])
    print(f"{'family':22s} {'shape':6s} {'rows':>5s} | {'fwd direct':>10s} {'triton':>8s} {'eager':>8s} | "
          f"{'f+b direct':>10s} {'triton':>8s} {'eager':>8s}")
    for shape in args.shapes.split(","):
        for fam in args.families.split(","):
            row = {"family": fam, "shape": shape} | measure(fam, shape, shapes[shape], args.calls, device)
            result["ops"].append(row)
            if "error" in row:
                print(f"{fam:22s} {shape:6s} error: {row['error']}")
                continue
            print(f"{fam:22s} {shape:6s} {row['rows']:5d} | {row['direct_fwd_us']:10.1f} {row['triton_fwd_us']:8.1f} "
                  f"{row['eager_fwd_us']:8.1f} | {row['direct_fwd_bwd_us']:10.1f} {row['triton_fwd_bwd_us']:8.1f} "
                  f"{row['eager_fwd_bwd_us']:8.1f}")
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print(f"total {result['total_s']} s")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
