"""Backs embeddings.py: its backward gives eager's bits and saves the dense vocabulary-sized gradient
(bench/results/2026-11-23-h100-session9.md).

An embedding's forward + backward with `.grad` held, eager vs embeddings.py: bits and elapsed time.

    python tools/embedding_bwd.py [--vocab 151936] [--hidden 2560] [--tokens 2048,4096,8192] [--out FILE]

Qwen3-4B's table (151936 x 2560 bf16) by default. Eager: `F.embedding` then `backward`, whose
`embedding_dense_backward` fills and writes a V x H gradient that AccumulateGrad adds to `.grad`.
embeddings.py: `embedding(...)` then `backward`, which adds into `.grad` only the rows of the
tokens present. Ids drawn uniformly from the vocabulary. Both start from the same `.grad`, and the
first step of each is compared bit for bit (`bits_equal`). Medians of triton's do_bench, in µs:
elapsed time from an idle host, so embeddings.py's dozen small launches from an autograd Function
show as host time here (H100, 2026-11-23: 834.9 against eager's 1272.8 at 4096 tokens). In a
training step the host runs ahead of the device there; its device time is in bench/e2e.py's steady
profile (bench/results/2026-11-23-h100-session9.md). JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from solforge.integrate import embeddings  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--tokens", default="2048,4096,8192", help="N = B*S, comma-separated (<= 3072: CUDA's other kernel)")
    p.add_argument("--out")
    a = p.parse_args()
    from e2e import bench_us, provenance, write_json

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    start = torch.randn(a.vocab, a.hidden, device=dev, dtype=dt)
    rows = []
    for n in (int(v) for v in a.tokens.split(",")):
        ids = torch.randint(0, a.vocab, (1, n), device=dev)
        dy = torch.randn(1, n, a.hidden, device=dev, dtype=dt)
        ws = {k: torch.nn.Parameter(torch.randn(a.vocab, a.hidden, device=dev, dtype=dt)) for k in ("eager", "ours")}
        steps = {"eager": lambda w=ws["eager"], i=ids, g=dy: F.embedding(i, w).backward(g),
                 "ours": lambda w=ws["ours"], i=ids, g=dy: embeddings.embedding(w, i).backward(g)}
        for k, w in ws.items():
            w.grad = start.clone()
            steps[k]()
        row: dict[str, Any] = {"tokens": n, "bits_equal": torch.equal(ws["eager"].grad.view(torch.int16),
                                                                      ws["ours"].grad.view(torch.int16))}
        before = embeddings.COUNTERS.in_place
        for k, f in steps.items():
            row[f"us {k}"] = round(bench_us(f), 1)
        row["ours took the in-place path"] = embeddings.COUNTERS.in_place > before
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    write_json({**provenance(), "vocab": a.vocab, "hidden": a.hidden, "rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
