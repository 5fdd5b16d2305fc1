"""Found cuDNN's setup of the traced masked attention to be most of a new length's first call, which led to eager's
is_causal attention in dynamic-shape graphs (bench/results/2026-11-25-h100-session14.md).

Where the optimized model's calls at new lengths spend their time (torch.profiler, CPU and CUDA).

    python tools/first_call_profile.py [--model qwen3-0.6b] [--seq 128] [--budget 30]
                                       [--lengths 128,200,333,400,200,128,128,512] [--profile 2,3,5,7] [--out DIR]

solforge optimizes the model at `--seq`, then calls it at each of `--lengths` in turn. Every call
prints its wall time (synchronized), the Triton compiles it did (`bench/compiles.py`), the graphs
dynamo compiled and the graphs made for one set of sizes. The calls at the positions `--profile`
(0-based) run under torch.profiler; each writes `DIR/prof-<position>-<length>-<ms>.txt`: the
device, versions, date and command, then the ops sorted by total and by self CPU time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from compiles import CompileCounter  # noqa: E402
from e2e import provenance  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--budget", type=float, default=30.0)
    p.add_argument("--lengths", default="128,200,333,400,200,128,128,512")
    p.add_argument("--profile", default="2,3,5,7", help="positions in --lengths of the calls to profile")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tools/first_call_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    import solforge
    from solforge.zoo import load_model

    lm = load_model(args.model, device="cuda", dtype="bf16", batch=1, seq=args.seq)
    opt, _ = solforge.optimize(lm.model, lm.example_inputs, budget=args.budget)
    stats = opt.solforge_stats
    compiles = CompileCounter()
    profiled = {int(i) for i in args.profile.split(",") if i}
    gen = torch.Generator(device="cuda").manual_seed(0)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for i, n in enumerate(int(v) for v in args.lengths.split(",")):
            ids = torch.randint(0, lm.model.config.vocab_size, (1, n), device="cuda", generator=gen)
            torch.cuda.synchronize()
            compiles.take()
            t = time.perf_counter()
            if i in profiled:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    opt(ids)
                    torch.cuda.synchronize()
            else:
                opt(ids)
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t) * 1e3
            print(i, n, round(ms, 1), compiles.take(), stats.graphs, stats.specialized, flush=True)
            if i in profiled:
                table = prof.key_averages()
                with open(Path(args.out) / f"prof-{i}-{n}-{ms:.0f}.txt", "w") as f:
                    f.write(f"{provenance()}\n")
                    f.write(table.table(sort_by="cpu_time_total", row_limit=35, max_name_column_width=70))
                    f.write(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
