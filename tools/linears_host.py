"""Decided that linears.py's call is an autograd.Function, not a torch.library op: the host time of each way of calling
a group of linears (linears.py).

Host time of one group of linears in a training forward: aten.linear calls vs linears.py's call.

    python tools/linears_host.py [--device cuda] [--n 3] [--calls 200] [--out FILE]

The optimized training forward is nearly host-bound (compact.py), so each op the graph calls
costs step time when the loop syncs every step (a `loss.item()`). On tiny shapes (the device
finishes each launch long before the host issues the next), for `--n` weights on one input
(3: q/k/v, 2: gate/up, 1: o or down), each with requires_grad:
- forward: host µs per call of the n aten.linear calls and of `linears.linears`;
- forward + backward: the same, with `sum(out).backward()` each time (.grad kept, so the
  backward accumulates in place where linears.py may).
Medians of 5 rounds of `--calls` calls each. JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from solforge.integrate import linears  # noqa: E402


def host_us(fn: Any, calls: int, device: str) -> float:
    rounds = []
    for _ in range(6):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(rounds[1:]), 2)  # the first round warms up


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", default="3,2,1", help="weights per group, comma-separated")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out")
    a = p.parse_args()
    from e2e import provenance

    dt = torch.bfloat16 if a.device == "cuda" else torch.float32
    rows = []
    for n in (int(v) for v in a.n.split(",")):
        x = torch.randn(1, 8, 64, device=a.device, dtype=dt, requires_grad=True)
        ws = [torch.nn.Parameter(torch.randn(64, 64, device=a.device, dtype=dt)) for _ in range(n)]
        fwd = {"aten.linear": lambda x=x, ws=ws: [torch.nn.functional.linear(x, w) for w in ws],
               "linears.linears": lambda x=x, ws=ws: linears.linears(x, ws)}
        row: dict[str, Any] = {"n": n}
        for name, f in fwd.items():
            row[f"fwd_us {name}"] = host_us(f, a.calls, a.device)

            def step(f: Any = f) -> None:
                sum(o.sum() for o in f()).backward()

            row[f"fwd_bwd_us {name}"] = host_us(step, a.calls // 2, a.device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {**provenance(), "device_arg": a.device, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
