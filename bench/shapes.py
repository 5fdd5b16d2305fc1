"""Other input shapes on a GPU (shapes.py): what each call of a new length costs the optimized
model, against the original model.

    python bench/shapes.py [--model qwen3-0.6b] [--seq 128] [--lengths 128,200,333,200,200,128,128,512]
                           [--prompts 128,97,150,97,97] [--new 32] [--budget 30] [--out bench/results/NAME.json]

solforge optimizes the model at `--seq`. Then, for a forward:
- the optimized model is called at each of `--lengths` in turn;
- each call is timed (wall clock, synchronized), together with the number of graphs dynamo has
  compiled so far, the number made again for one set of sizes, and the Triton compiles the call
  did (`bench/compiles.py`; one found in Triton's on-disk cache counts too, at a few ms);
- the original model is timed at the same length, and the largest difference of the logits is
  recorded.

The first new length compiles the graph for all lengths. A length's second call makes the graph
again for its sizes. Later calls run that graph.

For generation, `optimized.generate` runs with the default cache (no cache chosen) and greedy
decoding, for each prompt length of `--prompts`, `--new` tokens each. Each call is timed, with the
original model's time, and the count of tokens equal to the original's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiles import CompileCounter  # noqa: E402
from e2e import provenance, write_json  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn: Any) -> tuple[Any, float]:
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, round((time.perf_counter() - t) * 1e3, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lengths", default="128,200,333,200,200,128,128,512")
    p.add_argument("--prompts", default="128,97,150,97,97")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--budget", type=float, default=30.0)
    p.add_argument("--device", default="cuda", help="cpu: a check of the script (its times mean nothing)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/shapes.py needs a CUDA GPU (or --device cpu to check the script)", file=sys.stderr)
        return 2
    import solforge
    from solforge.zoo import load_model

    lm = load_model(args.model, device=args.device, dtype="bf16", batch=1, seq=args.seq)
    model = lm.model
    result: dict[str, Any] = {**provenance(), "model": args.model, "seq": args.seq, "forward": [], "generate": []}
    t0 = time.perf_counter()
    opt, rep = solforge.optimize(model, lm.example_inputs, budget=args.budget, inplace=False)  # model: eager
    result["optimize_s"] = round(time.perf_counter() - t0, 1)
    result["e2e_passed"] = rep.e2e.passed if rep.e2e is not None else None
    stats = getattr(opt, "solforge_stats", None)  # integrate.IntegrationStats, live
    compiles = CompileCounter()  # Triton's compiles in each optimized call (none off the GPU)
    gen = torch.Generator(device=args.device).manual_seed(0)
    vocab = model.config.vocab_size
    with torch.no_grad():
        for n in (int(v) for v in args.lengths.split(",")):
            ids = torch.randint(0, vocab, (1, n), device=args.device, generator=gen)
            compiles.take()
            got, ms = _ms(lambda ids=ids: opt(ids).logits)
            compiled = compiles.take()
            ref, eager_ms = _ms(lambda ids=ids: model(ids).logits)
            row = {"length": n, "ms": ms, "eager_ms": eager_ms,
                   "max_abs_diff": round(float((got.float() - ref.float()).abs().max()), 4), **compiled}
            if stats is not None:
                row.update(graphs=stats.graphs, specialized=stats.specialized,
                           dynamic_regions=sum(stats.dynamic.values()))
            result["forward"].append(row)
            print(row, flush=True)
        model.config.use_cache = True
        model.generation_config.use_cache = True
        kw: dict[str, Any] = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False}
        for n in (int(v) for v in args.prompts.split(",")):
            ids = torch.randint(0, vocab, (1, n), device=args.device, generator=gen)
            compiles.take()
            out, ms = _ms(lambda ids=ids: opt.generate(ids, **kw))
            compiled = compiles.take()
            ref, eager_ms = _ms(lambda ids=ids: model.generate(ids, disable_compile=True, **kw))
            row = {"prompt": n, "ms": ms, "eager_ms": eager_ms,
                   "tokens_equal": int((out[:, n:] == ref[:, n:]).sum()), "tokens": int(ref[:, n:].numel()),
                   **compiled}
            if stats is not None:
                row.update(graphs=stats.graphs, specialized=stats.specialized)
            result["generate"].append(row)
            print(row, flush=True)
    result["step_graphs"] = [s.summary() for s in getattr(opt.generate, "step_graphs", [])]
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
