"""gelu (y = gelu(x + b), bf16 x and bias) against eager and torch.compile, forward and
forward+backward; run through bench/families.py --families gelu [--gelu-approx tanh,none].

Shapes: GPT-2 small's MLP at B8 S1024 (8192 x 3072) and a large 16384 x 10240. Liger has no
plain GELU (its LigerGELUMulFunction is the gated geglu, swiglu's business here). Two eager
spellings: `F.gelu(x + b)` (2 kernels forward) and, for the tanh form, transformers'
NewGELUActivation on x + b, the formula GPT-2 runs written out (~9 kernels forward); torch.compile
compiles the first. Effective TB/s counts the bytes a fused kernel must move: forward reads x and
writes y (2 rows of traffic), forward+backward adds dy and x read and dx written (5); the bias
and db's partial rows are ignored (< 1%). The backward kernel is also timed alone and, unless
--no-bwd-sweep, over a third of the space (each config checked against gelu_bwd_ref first): the
backward is not tuned by `tune` (it runs `bwd_heuristic`), the sweep says how far that is from best.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from e2e import bench_us

DEVICE = "cuda"
SHAPES = [(8192, 3072, "GPT-2 small MLP, B8 S1024"), (16384, 10240, "large MLP, B2 S8192 x 10240")]


def _new_gelu(h: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation (gelu_new), as GPT-2 runs it."""
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


def _tbps(nbytes: int, us: float) -> float:
    return round(nbytes / (us * 1e-6) / 1e12, 3)


def bwd_sweep(fam: Any, wl: Any, dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor, approx: str,
              elem: int) -> list[tuple[float, float, str]]:
    """(us, TB/s, config) of the backward kernel (with db) for every third config of the space,
    the fastest 10 and the heuristic (marked '*')."""
    from solforge.numerics import compare

    rdx, rdb = fam.gelu_bwd_ref(dy, x, b, approx)
    heur = fam.bwd_heuristic(wl)
    out = []
    for c in [heur, *[c for c in fam.space(wl)[::3] if c != heur]]:
        with torch.no_grad():
            dx, db = fam.gelu_bwd(dy, x, b, approx, config=c)
            if not (compare(dx, rdx).ok and compare(db, rdb).ok):
                out.append((float("inf"), 0.0, c.encode() + " FAILED"))
                continue
            us = bench_us(lambda c=c: fam.gelu_bwd(dy, x, b, approx, config=c))
        out.append((round(us, 2), _tbps(3 * elem, us), c.encode() + ("*" if c == heur else "")))
    top = sorted(out)[:10]
    return top + [r for r in out if r[2].endswith("*") and r not in top]


def _row(rows: int, N: int, label: str, approx: str, budget: float, sweep: bool) -> dict[str, Any]:
    from solforge.kernels import gelu as fam
    from solforge.records import RunResult
    from solforge.tune import tune

    torch.manual_seed(0)
    bf = torch.bfloat16
    x = (2 * torch.randn(rows, N, device=DEVICE)).to(bf)
    b = (0.5 * torch.randn(N, device=DEVICE)).to(bf)
    dy = torch.randn(rows, N, device=DEVICE).to(bf)
    elem = x.numel() * x.element_size()
    fwd_bytes, train_bytes = 2 * elem, 5 * elem
    row: dict[str, Any] = {"family": "gelu", "shape": [rows, N], "what": label, "approximate": approx,
                           "dtype": "bf16", "bias": True, "fwd_bytes": fwd_bytes, "fwd_bwd_bytes": train_bytes}

    def eager(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + b, approximate=approx)

    fns: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "eager": eager, "compile": torch.compile(eager, dynamic=False)}
    if approx == "tanh":
        fns["eager_hf_new_gelu"] = lambda x, b: _new_gelu(x + b)
    wl = fam.workload_for(x, b, approx)
    t0 = time.perf_counter()
    res = tune(wl, RunResult(), device=DEVICE, budget_s=budget)
    row["tune_s"], row["candidates"] = round(time.perf_counter() - t0, 1), len(res.records)
    row["rejected"] = [f"{r.candidate.label}: {r.error}" for r in res.records if not r.ok][:5]
    assert res.best is not None, [r.error for r in res.records]
    enc = fam.Config(**res.best.candidate.config_dict).encode()
    row["solforge_config"], row["solforge_heuristic"] = enc, fam.heuristic(wl).encode()
    row["solforge_bwd_heuristic"] = fam.bwd_heuristic(wl).encode()
    row["tuned"] = sorted((round(r.time_us, 2), fam.Config(**r.candidate.config_dict).encode())
                          for r in res.records if r.ok)[:8]
    op = fam.gelu_op.default
    fns["solforge"] = lambda x, b: op(x, b, approx, enc)
    with torch.no_grad():
        ref = fam.gelu_ref(x, b, approx)
        for name, f in fns.items():
            f(x, b)
            row[f"fwd_{name}_us"] = bench_us(lambda f=f: f(x, b))
            row[f"max_abs_err_{name}"] = float((f(x, b).float() - ref.float()).abs().max())
        row["fwd_solforge_heuristic_us"] = bench_us(lambda: op(x, b, approx, ""))
        row["fwd_solforge_nobias_us"] = bench_us(lambda: op(x, None, approx, enc))
        row["bwd_solforge_kernel_us"] = bench_us(lambda: fam.gelu_bwd_op(dy, x, b, approx, True, ""))
    if sweep:
        row["bwd_sweep"] = bwd_sweep(fam, wl, dy, x, b, approx, elem)
    for name, f in fns.items():
        leaves = [x.clone().requires_grad_(True), b.clone().requires_grad_(True)]

        def step(f: Callable[..., Any] = f, leaves: list[torch.Tensor] = leaves) -> Any:
            return torch.autograd.grad(f(*leaves), leaves, dy)

        step()
        row[f"fwd_bwd_{name}_us"] = bench_us(step)
    for k in [k for k in row if k.endswith("_us") and k.startswith(("fwd_", "bwd_"))]:
        nbytes = train_bytes if k.startswith("fwd_bwd_") else 3 * elem if k.startswith("bwd_") else fwd_bytes
        row[k.replace("_us", "_TBps")] = _tbps(nbytes, row[k])
        row[k] = round(row[k], 2)
    row["speed_of_light_fwd_us_at_3.02TBps"] = round(fwd_bytes / 3.02e12 * 1e6, 2)
    row["speed_of_light_fwd_bwd_us_at_3.02TBps"] = round(train_bytes / 3.02e12 * 1e6, 2)
    return row


def run(budget: float, approximations: str = "tanh", sweep: bool = True) -> list[dict[str, Any]]:
    import json

    out = []
    for approx in approximations.split(","):
        for rows, N, label in SHAPES:
            out.append(_row(rows, N, label, approx, budget, sweep))
            print(json.dumps(out[-1]), flush=True)
    return out
