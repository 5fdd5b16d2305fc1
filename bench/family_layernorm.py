"""layernorm / add_layernorm against eager, torch.compile and Liger's LayerNorm (bf16 x, weight and
bias, eps 1e-5), forward and forward+backward; run through bench/families.py --families layernorm.

Shapes: GPT-2 small training (B8 S1024: 8192 x 768), GPT-2 XL (B2 S1024: 2048 x 1600) and the
Qwen3-4B-sized 16384 x 2560. Liger has no fused residual add: its add_layernorm row is torch's add
followed by LigerLayerNormFunction. Effective TB/s counts the bytes a fused kernel must move:
layernorm fwd reads x and writes y (2 rows of traffic), fwd+bwd adds dy and x read, dx written (5);
add_layernorm fwd reads x, r and writes s, y (4), fwd+bwd adds dy, ds, s read and dx written (8).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from e2e import bench_us

DEVICE = "cuda"
EPS = 1e-5
SHAPES = [(8192, 768, "GPT-2 small, B8 S1024"), (2048, 1600, "GPT-2 XL, B2 S1024"),
          (16384, 2560, "Qwen3-4B-sized, B2 S8192")]


def _liger() -> Callable[..., torch.Tensor] | None:
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except ImportError:
        return None
    return LigerLayerNormFunction.apply


def _row(rows: int, H: int, label: str, residual: bool, budget: float) -> dict[str, Any]:
    from solforge.kernels import add_layernorm as A
    from solforge.kernels import layernorm as L
    from solforge.records import RunResult
    from solforge.tune import tune

    torch.manual_seed(0)
    bf = torch.bfloat16
    x, r, dy, ds = (torch.randn(rows, H, device=DEVICE).to(bf) for _ in range(4))
    w = (1 + 0.1 * torch.randn(H, device=DEVICE)).to(bf)
    b = (0.1 * torch.randn(H, device=DEVICE)).to(bf)
    elem = x.numel() * x.element_size()
    fwd_bytes, train_bytes = (4 * elem, 8 * elem) if residual else (2 * elem, 5 * elem)
    fam: Any = A if residual else L
    row: dict[str, Any] = {"family": fam.FAMILY, "shape": [rows, H], "what": label, "dtype": "bf16",
                           "fwd_bytes": fwd_bytes, "fwd_bwd_bytes": train_bytes}

    def eager(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
        if residual:
            s = x + r
            return s, F.layer_norm(s, (H,), w, b, EPS)
        return F.layer_norm(x, (H,), w, b, EPS)

    fns: dict[str, Callable[..., Any]] = {"eager": eager, "compile": torch.compile(eager, dynamic=False)}
    liger = _liger()
    if liger is not None:
        fns["liger"] = (lambda x, r, w, b: (x + r, liger(x + r, w, b, EPS))) if residual \
            else (lambda x, r, w, b: liger(x, w, b, EPS))
    wl = A.workload_for(x, r, w, b, EPS) if residual else L.workload_for(x, w, b, EPS)
    t0 = time.perf_counter()
    res = tune(wl, RunResult(), device=DEVICE, budget_s=budget)
    row["tune_s"], row["candidates"] = round(time.perf_counter() - t0, 1), len(res.records)
    assert res.best is not None, [rec.error for rec in res.records]
    enc = fam.Config(**res.best.candidate.config_dict).encode()
    row["solforge_config"], row["solforge_heuristic"] = enc, fam.heuristic(wl).encode()
    fns["solforge"] = (lambda x, r, w, b: A.add_layernorm_op(x, r, w, b, EPS, bf, enc)) if residual \
        else (lambda x, r, w, b: L.layernorm_op(x, w, b, EPS, bf, enc))
    with torch.no_grad():
        ref = A.add_layernorm_ref(x, r, w, b, EPS) if residual else L.layernorm_ref(x, w, b, EPS)
        for name, f in fns.items():
            f(x, r, w, b)
            row[f"fwd_{name}_us"] = bench_us(lambda f=f: f(x, r, w, b))
            got = f(x, r, w, b)
            pairs = zip(got, ref, strict=True) if residual else [(got, ref)]
            row[f"max_abs_err_{name}"] = max(float((a.float() - c.float()).abs().max()) for a, c in pairs)
    for name, f in fns.items():
        leaves = [t.clone().requires_grad_(True) for t in (x, r, w, b)]
        if not residual:
            leaves[1].requires_grad_(False)
        wrt = [t for t in leaves if t.requires_grad]

        def step(f: Callable[..., Any] = f, leaves: list[torch.Tensor] = leaves, wrt: list[torch.Tensor] = wrt) -> Any:
            out = f(*leaves)
            return torch.autograd.grad(out, wrt, (ds, dy) if residual else dy)

        step()
        row[f"fwd_bwd_{name}_us"] = bench_us(step)
    for k in [k for k in row if k.endswith("_us") and k.startswith("fwd_")]:
        row[k.replace("_us", "_TBps")] = round((train_bytes if k.startswith("fwd_bwd_") else fwd_bytes)
                                               / (row[k] * 1e-6) / 1e12, 3)
        row[k] = round(row[k], 2)
    return row


def run(budget: float) -> list[dict[str, Any]]:
    import json

    out = []
    for rows, H, label in SHAPES:
        for residual in (False, True):
            out.append(_row(rows, H, label, residual, budget))
            print(json.dumps(out[-1]), flush=True)
    return out
