"""linear_cross_entropy against eager (F.linear + F.cross_entropy), torch.compile of the same and
Liger's LigerFusedLinearCrossEntropyLoss (when installed): forward+backward time, forward-only
time and peak memory; run through bench/families.py --families linear_cross_entropy.

Qwen3-4B's head: hidden 2560, vocabulary 151936, bf16, 8192 tokens (B1 S8192), one label in ten
-100, mean over the rest, gradients for the hidden states and the weight (a trained lm_head).
solforge's side is a sweep of the space (verified, then timed: the launcher with grads=3 is the
whole training cost, the backward only scales the saved gradients), with the cost model's time and
peak for each config and the unchunked graph's peak (fam.memory_budget: torch.compile's) the
heuristic stays within. LCE_ROWS=4096 limits the shapes.
Peak memory is torch.cuda.max_memory_allocated during one step above what was allocated before it
(inputs), including the gradients returned (hidden 42 MB, weight 0.78 GB). The N x V fp32 logits
alone are 5.0 GB at this shape.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from e2e import bench_us
from family_softmax import sweep

DEVICE = "cuda"
SHAPES = [(8192, 2560, 151936, "Qwen3-4B head, B1 S8192"), (4096, 2560, 151936, "Qwen3-4B head, B1 S4096")]
if os.environ.get("LCE_ROWS"):  # e.g. LCE_ROWS=4096 or 4096,8192: only those shapes
    SHAPES = [s for s in SHAPES if str(s[0]) in os.environ["LCE_ROWS"].split(",")]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _liger() -> Step | None:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    return lambda h, w, t: loss(w, h, t)


def _peak_bytes(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def _row(N: int, H: int, V: int, label: str) -> dict[str, Any]:
    from solforge.kernels import linear_cross_entropy as fam

    torch.manual_seed(0)
    bf, f32 = torch.bfloat16, torch.float32
    h = (torch.randn(N, H, device=DEVICE) * 2).to(bf)
    w = (torch.randn(V, H, device=DEVICE) / H**0.5).to(bf)
    t = torch.randint(0, V, (N,), device=DEVICE)
    t[torch.rand(N, device=DEVICE) < 0.1] = -100
    row: dict[str, Any] = {"family": "linear_cross_entropy", "shape": [N, H, V], "what": label, "dtype": "bf16",
                           "logits_fp32_GB": round(N * V * 4 / 1e9, 2),
                           "fwd_bwd_TFLOP": round(3 * 2 * N * H * V / 1e12, 2)}
    wl = fam.workload_for(h, w, None, t, out_dtype=f32, grads=3)
    row.update(sweep(fam, wl, lambda c: fam.linear_cross_entropy(h, w, None, t, out_dtype=f32, grads=3, config=c)))
    enc = row["best_config"] or ""
    # the cost model's view of every timed config (what the heuristic ranks by)
    budget = fam.memory_budget(wl)
    row["budget_GB"] = round(budget / 1e9, 3)
    row["model"] = {e: [round(fam.estimated_ms(fam.Config.decode(e), wl), 2),
                        round(fam.estimated_peak_bytes(fam.Config.decode(e), wl) / 1e9, 3)] for e in row["space_us"]}

    def eager(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)

    fns: dict[str, Step] = {
        "eager": eager, "compile": torch.compile(eager, dynamic=False),
        "solforge": lambda h, w, t: fam.linear_cross_entropy_op(
            h, w, None, t, -100, "mean", f32, 3 if torch.is_grad_enabled() else 0, enc)[0],
        "solforge_heuristic": lambda h, w, t: fam.linear_cross_entropy_op(
            h, w, None, t, -100, "mean", f32, 3 if torch.is_grad_enabled() else 0, "")[0]}
    liger = _liger()
    if liger is not None:
        fns["liger"] = liger
    ref = eager(h, w, t)
    for name, f in fns.items():
        try:
            with torch.no_grad():
                f(h, w, t)
                row[f"fwd_{name}_us"] = round(bench_us(lambda f=f: f(h, w, t)), 2)
                row[f"abs_err_{name}"] = float((f(h, w, t).float() - ref).abs())
            hl, wl_ = h.clone().requires_grad_(True), w.clone().requires_grad_(True)

            def step(f: Step = f, hl: torch.Tensor = hl, wl_: torch.Tensor = wl_) -> Any:
                return torch.autograd.grad(f(hl, wl_, t), [hl, wl_])

            step()
            row[f"fwd_bwd_{name}_us"] = round(bench_us(step), 2)
            row[f"peak_{name}_GB"] = round(_peak_bytes(step) / 1e9, 3)
            row[f"fwd_bwd_{name}_TFLOPs"] = round(row["fwd_bwd_TFLOP"] / (row[f"fwd_bwd_{name}_us"] * 1e-6), 1)
        except Exception as e:  # a competitor that cannot run this shape (out of memory): say so, go on
            row[f"error_{name}"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            torch.cuda.empty_cache()
    return row


def run() -> list[dict[str, Any]]:
    import json

    out = []
    for N, H, V, label in SHAPES:
        out.append(_row(N, H, V, label))
        print(json.dumps(out[-1]), flush=True)
    return out
