"""The online max / sum-of-exp schedule option (codegen/online.py) on a GPU: for softmax-like regions,
the time of eager, of torch.compile (default mode), of the heuristic's schedule, and of the best
chunked schedule (looped, split, tiles) per `online` value: 0 (one pass per stage: max, then sum of
exp, then the store), 1 (the pair in one pass, a running max per lane), 2 (per row). Each schedule
is verified against eager before it is timed (eager in fp32 is accurate enough at these sizes; the
fp64 reference of a 4096 x 393216 row would not fit).

    python bench/codegen_online.py [--cases kb24_log_softmax,...] [--limit 12] [--out FILE.json]

What to look for: online 1 or 2 ahead of 0 by up to the 4 -> 3 (softmax: 3 reads + 1 write -> 2 + 1)
memory passes on the long rows (KernelBench level 1 problems 23 and 24: 4096 x 393216 fp32, eager
~8.6 ms and torch.compile ~6.7 ms for 24 on an H100), and the heuristic near the best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import bench_us  # noqa: E402

from solforge.codegen import regions as RG  # noqa: E402
from solforge.codegen import runtime as RT  # noqa: E402
from solforge.codegen import schedule as SC  # noqa: E402
from solforge.numerics import compare  # noqa: E402

DEVICE = "cuda"
CHUNKED = ("looped", "split", "tiles")


def _ce(x: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    return -(torch.log_softmax(x.float(), -1) * onehot).sum(-1)


def _cases() -> dict[str, tuple[Callable[..., Any], Callable[[], list[torch.Tensor]]]]:
    def r(*s: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.rand(*s, device=DEVICE, dtype=dtype)

    def onehot(n: int, k: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.randint(0, k, (n,), device=DEVICE), k).to(torch.bfloat16)

    return {
        "kb23_softmax": (lambda x: torch.softmax(x, -1), lambda: [r(4096, 393216)]),
        "kb24_log_softmax": (lambda x: torch.log_softmax(x, -1), lambda: [r(4096, 393216)]),
        "logsumexp_bf16": (lambda x: torch.logsumexp(x.float(), -1), lambda: [r(8192, 65536, dtype=torch.bfloat16)]),
        "ce_onehot": (_ce, lambda: [r(8192, 32768, dtype=torch.bfloat16), onehot(8192, 32768)]),
        "softmax_16x1m": (lambda x: torch.softmax(x.float(), -1).to(torch.bfloat16),
                          lambda: [r(16, 1 << 20, dtype=torch.bfloat16)]),
    }


def _row(name: str, fn: Callable[..., Any], make: Callable[[], list[torch.Tensor]], limit: int) -> dict[str, Any]:
    torch.manual_seed(0)
    xs = make()
    gm = make_fx(fn, tracing_mode="fake")(*xs)
    regions = RG.form_regions(gm.graph)
    if len(regions) != 1:
        return {"case": name, "error": f"{len(regions)} regions"}
    fr = regions[0]
    low = fr.lowered
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ins = [xs[places.index(a)] for a in fr.inputs]
    want = fn(*xs)
    want = want if isinstance(want, tuple) else (want,)
    nbytes = sum(x.numel() * x.element_size() for x in ins) + sum(o.numel() * o.element_size() for o in want)

    def timed(c: SC.Schedule) -> float | None:
        try:
            got = RT.run(low, c, ins)
        except Exception as e:  # noqa: BLE001 - a failing schedule is a row, the sweep goes on
            print(f"  {c.encode()}: {type(e).__name__}: {e}", file=sys.stderr)
            return None
        if len(got) != len(want) or not all(compare(g, w).ok for g, w in zip(got, want, strict=True)):
            print(f"  {c.encode()}: wrong result", file=sys.stderr)
            return None
        return bench_us(lambda: RT.run(low, c, ins))

    space = SC.space(low)
    h = SC.heuristic(low)
    rng = random.Random(0)
    out: dict[str, Any] = {"case": name, "loop": str(low.space), "heuristic": h.encode(), "bytes": nbytes,
                           "eager_us": bench_us(lambda: fn(*xs)), "space": len(space)}
    try:
        comp = torch.compile(fn)
        comp(*xs)
        out["compile_us"] = bench_us(lambda: comp(*xs))
    except Exception as e:  # noqa: BLE001
        out["compile_error"] = f"{type(e).__name__}: {e}"[:200]
    out["heuristic_us"] = timed(h)
    # the same sample of chunked schedules under each online value, so the three are compared like for like
    base = list(dict.fromkeys(dataclasses.replace(c, online=0) for c in space if c.variant in CHUNKED))
    base = base if len(base) <= limit else rng.sample(base, limit)
    for v in (0, 1, 2):
        cs = [c for c in (dataclasses.replace(b, online=v) for b in base) if SC.is_valid(c, low)]
        times = {c.encode(): t for c in cs if (t := timed(c)) is not None}
        if times:
            best = min(times, key=times.__getitem__)
            out[f"best_online{v}"], out[f"best_online{v}_us"] = best, times[best]
    for k in [k for k in out if k.endswith("_us") and isinstance(out[k], float)]:
        out[k.replace("_us", "_tbs")] = round(nbytes / out[k] / 1e6, 3) if math.isfinite(out[k]) else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--limit", type=int, default=12, help="chunked schedules timed per online value, sampled")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    a = ap.parse_args()
    cases = _cases()
    names = [n for n in a.cases.split(",") if n] or list(cases)
    rows = []
    for n in names:
        row = _row(n, *cases[n], a.limit)
        torch.cuda.empty_cache()  # the case's tensors are gone: the next one's large inputs need the room
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
