"""Found the norms' fp32 statistic to be what still parted solforge's forward from eager's, which led to
kernels/torch_order.py (bench/results/2026-11-26-h100-h200-session22.md).

Where solforge's forward parts from eager's: the Qwen3-4B body optimized with one set of kernel
families at a time, each compared with eager on the same weights and tokens.

    python tools/divergence.py [--weights W --ids I] [--sets "rope;swiglu;add_rmsnorm,rmsnorm;all"]
                               [--batch 1 --seq 4096] [--budget 5] [--out bench/results/NAME.json]

For each set (families joined by ",", sets by ";"; "all" is every family) it reports the share of
the last hidden state's elements that differ from eager's, its norm-relative error, and the argmax
agreement of the next-token logits (the tied lm_head run eagerly on each hidden state): at all
positions and where eager's top-1/top-2 margin exceeds 0.05 / 0.1. Eager runs twice first, so
the table starts with what eager's own repeat gives. `--weights`/`--ids` take what
tools/train_bytes.py saved (trained weights: margins that mean something); without them the weights
are seeded random and the tokens random.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import provenance, write_json  # noqa: E402


def predictions(model: Any, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, top-1 minus top-2 logit) at every position, the lm_head applied eagerly."""
    logits = model.lm_head(h)
    top2 = logits.topk(2, dim=-1).values.float()
    return logits.argmax(-1), top2[..., 0] - top2[..., 1]


def compare(h: torch.Tensor, ref_h: torch.Tensor, pred: torch.Tensor, ref_pred: torch.Tensor,
            ref_margin: torch.Tensor) -> dict[str, float]:
    same = pred == ref_pred
    out = {"hidden_differ": round(float((h != ref_h).float().mean()), 5),
           "hidden_rel_err": float((h.float() - ref_h.float()).norm() / ref_h.float().norm()),
           "argmax_agree": round(float(same.float().mean()), 5),
           "positions_differing": int((~same).sum())}
    for m in (0.05, 0.1):
        sel = ref_margin > m
        out[f"argmax_agree_margin_gt_{m}"] = round(float(same[sel].float().mean()), 5)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--weights", default=None)
    p.add_argument("--ids", default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--sets", default="rope;swiglu;add_rmsnorm,rmsnorm;all")
    p.add_argument("--budget", type=float, default=5.0, help="tuning seconds for each set")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from transformers import AutoModelForCausalLM

    from solforge.api import optimize
    from solforge.zoo import zoo_config

    cfg = zoo_config(a.model)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    if a.weights:
        model.load_state_dict(torch.load(a.weights, map_location=a.device))
    body = model.model.eval()
    if a.ids:
        ids = torch.load(a.ids).to(a.device)
    else:
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device=a.device)
    result: dict[str, Any] = {**provenance(), "model": a.model, "weights": a.weights or "seeded random",
                              "ids": a.ids or "random", "shape": list(ids.shape), "rows": []}
    with torch.inference_mode():
        ref_h = body(ids).last_hidden_state.clone()
        ref_pred, ref_margin = predictions(model, ref_h)
        again = body(ids).last_hidden_state
        row = {"set": "eager again", **compare(again, ref_h, predictions(model, again)[0], ref_pred, ref_margin)}
        del again
    result["positions_margin_gt_0.05"] = round(float((ref_margin > 0.05).float().mean()), 4)
    print(row, flush=True)
    result["rows"].append(row)
    for s in a.sets.split(";"):
        fams = None if s == "all" else s.split(",")
        t0 = time.time()
        with torch.no_grad():
            f, rep = optimize(body, (ids,), families=fams, budget=a.budget, is_language_model=False, profile="off")
        with torch.inference_mode():
            h = f(ids).last_hidden_state
            row = {"set": s, "optimize_s": round(time.time() - t0, 1),
                   "regions": [[r.family, r.count, r.integrated] for r in rep.regions],
                   **compare(h, ref_h, predictions(model, h)[0], ref_pred, ref_margin)}
        del f, h
        print(row, flush=True)
        result["rows"].append(row)
    write_json(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
