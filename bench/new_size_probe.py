"""What a new input length costs the integrated model on a GPU: each call's wall time, the Triton
compiles it triggered (count, time, kernels) and the time spent making a graph for its sizes.

    python bench/new_size_probe.py [--lengths 128,200,333,200,200,128,128,512,640,1000,1000] [--layers 4]

A Qwen3-0.6B-shaped model (hidden 1024, 16 heads, random weights, bf16) with `--layers` layers is
integrated without tuning; the lengths are called in turn. Triton's on-disk cache makes a compile
seen before on the machine a few milliseconds.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="128,200,333,200,200,128,128,512,640,1000,1000")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    import transformers

    from solforge.capture import SolforgeBackend
    from solforge.integrate import integrate

    counter = CompileCounter()
    spent = {"specialize": 0.0}
    specialize = SolforgeBackend._specialize

    def timed_specialize(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return specialize(self, *a, **k)
        finally:
            spent["specialize"] += time.perf_counter() - t

    SolforgeBackend._specialize = timed_specialize  # type: ignore[method-assign]
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                                   num_attention_heads=16, num_key_value_heads=8, vocab_size=151936,
                                   max_position_embeddings=4096, head_dim=128)
    m = transformers.Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    opt, stats = integrate(m, {})
    with torch.no_grad():
        for n in (int(v) for v in args.lengths.split(",")):
            ids = torch.randint(0, 1000, (1, n), device="cuda")
            counter.take()
            spent["specialize"] = 0.0
            torch.cuda.synchronize()
            t = time.perf_counter()
            opt(ids)
            torch.cuda.synchronize()
            print({"length": n, "ms": round((time.perf_counter() - t) * 1e3, 1), **counter.take(),
                   "specialize_ms": round(spent["specialize"] * 1e3), "graphs": stats.graphs,
                   "specialized": stats.specialized}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
