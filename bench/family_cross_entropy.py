"""cross_entropy against eager, torch.compile and Liger's LigerCrossEntropyLoss (when installed),
forward and forward+backward; run through bench/families.py --families cross_entropy.

The loss as Hugging Face's ForCausalLMLoss computes it: bf16 logits, `.float()`, mean over the
targets that are not -100 (one in ten ignored here). Shapes: Qwen3 (4096 x 151936, B1 S4096
training), Llama-3 (8192 x 128256) and a 32K vocabulary (16384 x 32000). solforge's side is a sweep
of the space (bench/family_softmax.py's `sweep`). Effective TB/s counts the logits: fwd reads them
once; fwd+bwd reads them twice more and writes the gradient (4 x the bf16 logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from e2e import bench_us
from family_softmax import sweep

DEVICE = "cuda"
SHAPES = [(4096, 151936, "Qwen3 vocabulary, B1 S4096"), (8192, 128256, "Llama-3 vocabulary, B2 S4096"),
          (16384, 32000, "32K vocabulary, B4 S4096")]


def _liger() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except ImportError:
        return None
    return LigerCrossEntropyLoss(ignore_index=-100)


def _row(rows: int, V: int, label: str) -> dict[str, Any]:
    from solforge.kernels import cross_entropy as fam

    torch.manual_seed(0)
    bf, f32 = torch.bfloat16, torch.float32
    x = (torch.randn(rows, V, device=DEVICE) * 2).to(bf)
    t = torch.randint(0, V, (rows,), device=DEVICE)
    t[torch.rand(rows, device=DEVICE) < 0.1] = -100
    elem = x.numel() * 2
    row: dict[str, Any] = {"family": "cross_entropy", "shape": [rows, V], "what": label, "dtype": "bf16 logits",
                           "fwd_bytes": elem, "fwd_bwd_bytes": 4 * elem}
    wl = fam.workload_for(x, t, out_dtype=f32)
    row.update(sweep(fam, wl, lambda c: fam.cross_entropy(x, t, out_dtype=f32, config=c)))

    def eager(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.float(), t, ignore_index=-100)

    enc = row["best_config"] or ""
    fns: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "eager": eager, "compile": torch.compile(eager, dynamic=False),
        "solforge": lambda x, t: fam.cross_entropy_op(x, t, -100, "mean", f32, enc)[0]}
    liger = _liger()
    if liger is not None:
        fns["liger"] = liger
    ref = fam.cross_entropy_ref(x, t, out_dtype=f32)
    for name, f in fns.items():
        try:
            with torch.no_grad():
                f(x, t)
                row[f"fwd_{name}_us"] = round(bench_us(lambda f=f: f(x, t)), 2)
                row[f"abs_err_{name}"] = float((f(x, t).float() - ref).abs())
            # Liger writes the gradient into its input during the forward: every step gets a fresh leaf
            leaf = x.clone().requires_grad_(True)

            def step(f: Callable[..., Any] = f, leaf: torch.Tensor = leaf) -> Any:
                return torch.autograd.grad(f(leaf, t), [leaf])

            step()
            row[f"fwd_bwd_{name}_us"] = round(bench_us(step), 2)
        except Exception as e:  # a competitor that cannot run this shape: say so, go on
            row[f"error_{name}"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    for k in [k for k in row if k.endswith("_us") and k.startswith("fwd_")]:
        nbytes = row["fwd_bwd_bytes"] if k.startswith("fwd_bwd_") else row["fwd_bytes"]
        row[k.replace("_us", "_TBps")] = round(nbytes / (row[k] * 1e-6) / 1e12, 3)
    return row


def run() -> list[dict[str, Any]]:
    import json

    out = []
    for rows, V, label in SHAPES:
        out.append(_row(rows, V, label))
        print(json.dumps(out[-1]), flush=True)
    return out
