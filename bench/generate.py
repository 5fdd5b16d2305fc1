"""Generation on a GPU: transformers' `generate` with a static cache, greedy, for the original model
(eager), for transformers' own compiled forward (its static-cache default: torch.compile) and for
solforge's optimized model, whose `generate` runs the fused kernels (generation.route_generate).

    python bench/generate.py [--model qwen3-0.6b] [--prompt 128] [--new 64] [--budget 30]
                             [--variants eager,hf_compile,solforge,solforge_nographs] [--out bench/results/NAME.json]

The zoo builds its models without a KV cache (whole-sequence forwards); here the cache is turned
on. Each variant generates once to compile and warm up, then `--runs` times; the time of a run is the
wall clock of the whole `generate` call (prompt and every new token, the host included: a decode
step is launch-bound), synchronized before and after. solforge tunes the prompt's shape with
`--budget` seconds; its decode step, a shape it did not tune, gets the database's kernels or the
heuristic configs (README, other input shapes). The tokens of each variant are compared with
eager's (random weights: near-ties may differ in bf16, so this is a count, not a check).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import provenance, write_json  # noqa: E402


def _time(fn: Any, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--budget", type=float, default=30.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--variants", default="eager,hf_compile,solforge")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/generate.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import solforge
    from solforge.zoo import load_model

    lm = load_model(args.model, device="cuda", dtype="bf16", batch=1, seq=args.prompt)
    model, ids = lm.model, lm.example_inputs[0]
    # the zoo builds its models for whole-sequence forwards (no KV cache); generation decodes with one
    model.config.use_cache = True
    model.generation_config.use_cache = True
    kw: dict[str, Any] = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False,
                          "cache_implementation": "static"}
    result: dict[str, Any] = {**provenance(), "model": args.model, "prompt": args.prompt, "new_tokens": args.new,
                              "runs": []}
    ref = None
    for variant in args.variants.split(","):
        row: dict[str, Any] = {"variant": variant}
        t0 = time.perf_counter()
        if variant == "eager":
            gen = lambda: model.generate(ids, disable_compile=True, **kw)  # noqa: E731
        elif variant == "hf_compile":
            gen = lambda: model.generate(ids, **kw)  # noqa: E731
        elif variant in ("solforge", "solforge_nographs"):
            # solforge: the decode steps replay from CUDA graphs (stepgraphs.py); nographs: they
            # run solforge's graphs from Python
            opt, rep = solforge.optimize(model, (ids,), budget=args.budget, inplace=False,  # model: eager
                                         cuda_graphs=variant == "solforge")
            row["optimize_s"] = round(time.perf_counter() - t0, 1)
            row["e2e_passed"] = rep.e2e.passed if rep.e2e is not None else None
            t0 = time.perf_counter()
            gen = lambda opt=opt: opt.generate(ids, **kw)  # noqa: E731
        else:
            raise SystemExit(f"unknown variant {variant!r}")
        with torch.no_grad():
            try:
                tokens = gen()
                row["first_generate_s"] = round(time.perf_counter() - t0, 2)
                ms = _time(gen, args.runs)
            except Exception as e:  # a variant that fails is a row with its error
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                result["runs"].append(row)
                print(row, flush=True)
                continue
        new = tokens[:, ids.shape[1]:]
        if ref is None:
            ref = new
        if variant.startswith("solforge"):
            row["step_graphs"] = [s.summary() for s in getattr(opt.generate, "step_graphs", [])]
        row.update(generate_ms=[round(x, 2) for x in ms], median_ms=round(sorted(ms)[len(ms) // 2], 2),
                   ms_per_new_token_with_prompt=round(sorted(ms)[len(ms) // 2] / args.new, 3),
                   tokens_equal_to_first=int((new == ref).sum()), tokens=int(new.numel()),
                   # to compare variants run in separate processes (each process's dynamo keeps at
                   # most 8 graphs of the model's forward, so one process per variant is cleaner)
                   token_ids=new.flatten().tolist())
        result["runs"].append(row)
        print(row, flush=True)
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
