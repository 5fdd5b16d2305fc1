"""Benchmark on a GPU: Qwen3's q/k RMSNorm + rotary embedding, eager vs torch.compile vs Liger vs solforge.

    python bench/family_rope.py [--budget 60] [--out bench/results/NAME.json]

Cases (Qwen3-4B: Hq 32, Hk 8, head_dim 128, bf16, eps 1e-6, cos/sin (1, S, 128) bf16):
  fwd       B2 S8192 (inference) and B1 S4096 (training shape), forward only
  fwd+bwd   B1 S4096: forward, then backward into q, k and both norm weights
Variants:
  eager     Hugging Face's code: q_norm/k_norm (Qwen3RMSNorm), transpose, apply_rotary_pos_emb
  compile   torch.compile of the same function
  liger     LigerRMSNorm for the norms + liger_rotary_pos_emb (Liger fuses the rope, not the norm)
  solforge  torch.ops.solforge.rope (norm and rope fused, q and k in one launch), heuristic config
            and the config tuned by solforge.tune within --budget seconds
Medians of triton.testing.do_bench (L2 flushed). `bytes` counts what any fused kernel must move
(read q, k; write q_out, k_out; cos/sin are L2-resident), so TB/s compares with the copy roof.

`cases(...)` builds the callables for one shape and mode, for bench/families.py's registry;
`run(...)` times every case and returns JSON-ready rows. --help works without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: import this checkout's solforge and bench helpers
    sys.path.insert(0, str(_ROOT))

EPS = 1e-6
HQ, HK, D = 32, 8, 128
SHAPES = {"fwd": [(2, 8192), (1, 4096)], "fwd+bwd": [(1, 4096)]}


def _hf(q: Any, k: Any, cos: Any, sin: Any, qw: Any, kw: Any) -> tuple[Any, Any]:
    """Qwen3Attention's q/k path as transformers writes it (from the projections' (B, S, H, D))."""
    import torch

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return w * h.to(dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    q, k = norm(q, qw).transpose(1, 2), norm(k, kw).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def _inputs(B: int, S: int, grad: bool) -> tuple[Any, ...]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(B, S, HQ, D, device="cuda", generator=g).to(bf)
    k = torch.randn(B, S, HK, D, device="cuda", generator=g).to(bf)
    theta = torch.arange(S, device="cuda")[None, :, None].float() * (
        1e6 ** (-torch.arange(0, D, 2, device="cuda").float() / D)).repeat(2)
    cos, sin = theta.cos().to(bf), theta.sin().to(bf)
    qw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(bf)
    kw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(bf)
    if grad:
        for t in (q, k, qw, kw):
            t.requires_grad_()
    return q, k, cos, sin, qw, kw


def _liger(qw: Any, kw: Any) -> Callable[..., tuple[Any, Any]] | None:
    """LigerRMSNorm modules holding copies of the norm weights (their grads land there), then
    Liger's rope kernel."""
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    import torch

    norms = []
    for w in (qw, kw):
        n = LigerRMSNorm(D, eps=EPS).cuda().to(w.dtype)
        with torch.no_grad():
            n.weight.copy_(w)
        norms.append(n)

    def fn(q: Any, k: Any, cos: Any, sin: Any, _qw: Any, _kw: Any) -> tuple[Any, Any]:
        return liger_rotary_pos_emb(norms[0](q).transpose(1, 2), norms[1](k).transpose(1, 2), cos, sin)

    return fn


def _solforge(config: str) -> Callable[..., tuple[Any, Any]]:
    import torch

    from solforge.kernels import rope as R  # noqa: F401 (registers the op)

    op = torch.ops.solforge.rope.default

    def fn(q: Any, k: Any, cos: Any, sin: Any, qw: Any, kw: Any) -> tuple[Any, Any]:
        return op(q, k, cos, sin, qw, kw, EPS, True, True, True, torch.bfloat16, config)

    return fn


def tuned_config(B: int, S: int, budget: float) -> tuple[str, dict[str, Any]]:
    """solforge.tune over the family's space at this shape (forward); the winner's config."""
    from solforge.kernels import rope as R
    from solforge.records import RunResult
    from solforge.tune import tune

    q, k, cos, sin, qw, kw = _inputs(B, S, False)
    wl = R.workload_for(q, k, cos, sin, qw, kw, EPS, norm=True, round_before_weight=True, heads_first=True)
    t0 = time.perf_counter()
    res = tune(wl, RunResult(), device="cuda", budget_s=budget)
    info = {"tune_s": round(time.perf_counter() - t0, 1), "candidates": len(res.records),
            "rejected": sum(1 for r in res.records if not r.ok), "heuristic": R.heuristic(wl).encode()}
    if res.best is None:
        raise RuntimeError(f"no rope config verified: {[r.build.error for r in res.records][:3]}")
    cfg = R.Config(**res.best.candidate.config_dict).encode()
    info["config"] = cfg
    return cfg, info


def cases(B: int, S: int, mode: str, *, tuned: str | None = None) -> dict[str, Callable[[], Any]]:
    """Variant name -> zero-argument callable running one step of `mode` ("fwd" or "fwd+bwd")."""
    import torch

    grad = mode == "fwd+bwd"
    args = _inputs(B, S, grad)
    fns: dict[str, Callable[..., tuple[Any, Any]]] = {"eager": _hf, "compile": torch.compile(_hf, dynamic=False)}
    liger = _liger(args[4], args[5])
    if liger is not None:
        fns["liger"] = liger
    fns["solforge_heuristic"] = _solforge("")
    if tuned is not None:
        fns["solforge_tuned"] = _solforge(tuned)
    gq = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
    gk = torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16)

    def step(fn: Callable[..., tuple[Any, Any]]) -> Callable[[], Any]:
        if not grad:
            return lambda: fn(*args)

        def fwd_bwd() -> None:
            for t in args:
                t.grad = None
            torch.autograd.backward(fn(*args), (gq, gk))

        return fwd_bwd

    return {name: step(fn) for name, fn in fns.items()}


def run(budget: float = 60.0) -> list[dict[str, Any]]:
    import torch
    from triton.testing import do_bench

    rows = []
    configs: dict[tuple[int, int], tuple[str, dict[str, Any]]] = {}
    for mode, shapes in SHAPES.items():
        for B, S in shapes:
            if (B, S) not in configs:
                configs[(B, S)] = tuned_config(B, S, budget)
            cfg, info = configs[(B, S)]
            nbytes = 2 * 2 * B * S * (HQ + HK) * D  # bf16 q, k read and written
            row: dict[str, Any] = {"mode": mode, "shape": {"B": B, "S": S, "Hq": HQ, "Hk": HK, "D": D},
                                   "bytes": nbytes * (3 if mode == "fwd+bwd" else 1), "tune": info}
            for name, fn in cases(B, S, mode, tuned=cfg).items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    us = float(do_bench(fn, warmup=50, rep=300, return_mode="median")) * 1e3
                    row[f"{name}_us"] = round(us, 2)
                    row[f"{name}_TBps"] = round(row["bytes"] / (us * 1e-6) / 1e12, 3)
                except Exception as e:  # a failing variant is a row entry, not a crash
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=60.0, help="solforge tuning budget per shape (s)")
    p.add_argument("--out", default=None, help="write the JSON record here")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/family_rope.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.e2e import provenance, write_json

    write_json({**provenance(), "rope": run(a.budget)}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
