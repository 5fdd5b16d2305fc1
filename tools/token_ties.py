"""Showed that generate's bf16 tokens part from eager's only at near-ties: eager's top-2 margin below the logits'
rounding differences.

Where `optimized.generate`'s greedy tokens leave eager's, and whether eager's own top-2 margin at
that step is below the logits' rounding differences (a near-tie, not a wrong kernel).

    python tools/token_ties.py [--model qwen3-0.6b] [--prompts 128,97,97,150,150] [--new 32] [--device cuda]
                               [--out bench/results/NAME.json]

The model is integrated without tuning (each region's heuristic config), then for each prompt length:
eager with transformers' default cache, eager with a static cache, and solforge with a static cache
(the cache solforge gives a call that chose none). Printed per prompt: the first step where each
pair's tokens differ (None: never), eager's top-2 logit margin at solforge's first differing step,
and the largest logit difference from eager up to that step. Random weights make near-ties common.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import provenance, write_json  # noqa: E402


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> int | None:
    d = (a != b).nonzero()
    return int(d[0, 1]) if len(d) else None


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a.float() - b.float()).abs().max()), 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--prompts", default="128,97,97,150,150")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--device", default="cuda", help="cpu: a check of the script (fp32 under the interpreter)")
    p.add_argument("--out", default=None, help="where to write the rows as JSON, with device and versions")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tools/token_ties.py needs a CUDA GPU (or --device cpu to check the script)", file=sys.stderr)
        return 2
    from solforge.integrate import integrate
    from solforge.zoo import load_model

    dtype = "bf16" if args.device == "cuda" else "fp32"
    m = load_model(args.model, device=args.device, dtype=dtype, batch=1, seq=128).model
    m.config.use_cache = True
    m.generation_config.use_cache = True
    opt, stats = integrate(m, {})
    result: dict[str, Any] = {**provenance(), "model": args.model, "new_tokens": args.new, "rows": []}
    gen = torch.Generator(device=args.device).manual_seed(0)
    kw: dict[str, Any] = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False,
                          "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        for n in (int(v) for v in args.prompts.split(",")):
            ids = torch.randint(0, m.config.vocab_size, (1, n), device=args.device, generator=gen)
            runs = {"eager_dynamic": m.generate(ids, disable_compile=True, **kw),
                    "eager_static": m.generate(ids, disable_compile=True, cache_implementation="static", **kw),
                    "solforge": opt.generate(ids, cache_implementation="static", **kw)}
            toks = {k: v.sequences[:, n:] for k, v in runs.items()}
            row: dict[str, Any] = {"prompt": n}
            for a, b in (("eager_dynamic", "eager_static"), ("eager_static", "solforge"),
                         ("eager_dynamic", "solforge")):
                row[f"{a}~{b}"] = _first_diff(toks[a], toks[b])
            ref, got = runs["eager_static"].logits, runs["solforge"].logits
            i = row["eager_static~solforge"]
            if i is not None:
                top = ref[i][0].float().topk(2).values
                row["eager_static_top2_margin_at_diff"] = round(float(top[0] - top[1]), 4)
                row["logit_maxdiff_before"] = max(_maxdiff(ref[j][0], got[j][0]) for j in range(i + 1))
            row["logit_maxdiff_step0"] = _maxdiff(ref[0][0], got[0][0])
            result["rows"].append(row)
            print(row, flush=True)
    result.update(graphs=stats.graphs, specialized=stats.specialized)
    print({"graphs": stats.graphs, "specialized": stats.specialized})
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
