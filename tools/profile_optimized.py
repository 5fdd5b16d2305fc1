"""probe: the optimized Qwen3-4B forward's (or training step's) kernels against eager's, by kind.

Where the optimized Qwen3-4B forward's GPU time goes, kernel by kernel (torch.profiler).

Optimizes the model body (B2 S8192 bf16, as bench/e2e.py's qwen3 variant; point $SOLFORGE_DB at a
filled kernel database to skip tuning), then profiles one forward of eager and of the optimized
body and prints, for each, the kernels grouped by name with their total CUDA time, plus totals by
kind (GEMM, attention, solforge's Triton kernels, everything else), and the wall time of the
profiled call: kernel time well below wall time means the GPU waited for the host. JSON to --out.

--train profiles bench/e2e.py's training step instead (B1 S4096 by default: forward, loss = mean
of the squared last hidden state, backward), solforge optimized with mode="train".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from e2e import kernel_kind, provenance  # noqa: E402


def profile(fn: Any, top: int) -> dict[str, Any]:
    import time

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3  # unprofiled: the profiler adds host time per op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans: list[tuple[float, float, str]] = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += e.device_time_total
            by_name[e.name][1] += 1
            spans.append((e.time_range.start, e.time_range.end, e.name))
    total = sum(v[0] for v in by_name.values())
    kinds: dict[str, float] = defaultdict(float)
    for name, (us, _) in by_name.items():
        kinds[kernel_kind(name)] += us
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    # GPU idle between the first kernel's start and the last one's end: where the host was late
    spans.sort()
    gaps: list[tuple[float, str, str]] = []
    end, prev = (spans[0][0], "") if spans else (0.0, "")
    for a, b, name in spans:
        if a > end:
            gaps.append((a - end, prev, name))
        if b > end:
            end, prev = b, name
    gaps.sort(reverse=True)
    idle = {"idle_ms": round(sum(g for g, _, _ in gaps) / 1e3, 2),
            "gaps_over_50us": sum(g > 50 for g, _, _ in gaps),
            "idle_in_gaps_over_50us_ms": round(sum(g for g, _, _ in gaps if g > 50) / 1e3, 2),
            "largest_gaps": [{"us": round(g, 1), "after": p[:80], "before": n[:80]} for g, p, n in gaps[:12]]}
    return {"total_ms": round(total / 1e3, 2), "wall_ms": round(wall_ms, 2),
            "by_kind_ms": {k: round(v / 1e3, 2) for k, v in kinds.items()},
            "gpu_idle": idle,
            "kernels": [{"name": n[:140], "ms": round(us / 1e3, 3), "calls": c} for n, (us, c) in rows]}


def clocks(fns: dict[str, Any], seconds: float = 8.0) -> dict[str, Any]:
    """SM clock and power while each function runs back to back for `seconds` (nvidia-smi sampled
    every 100 ms in the background): whether a variant runs its GEMMs at lower clocks."""
    import subprocess
    import tempfile
    import time

    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=log, stderr=subprocess.DEVNULL)
    spans: dict[str, tuple[float, float]] = {}
    try:
        time.sleep(1.0)
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            t0 = time.time()
            n = 0
            while time.time() - t0 < seconds:
                fn()
                n += 1
                if n % 4 == 0:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            spans[name] = (t0 + 1.0, time.time())  # skip the first second (clocks settling)
            time.sleep(2.0)  # let the card cool a little between variants
    finally:
        smi.terminate()
        smi.wait()
    import datetime as dt

    rows = []
    for line in open(log.name):
        parts = [p.strip() for p in line.split(",")]
        try:
            t = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(parts[1]), float(parts[2]), float(parts[3])))
        except (ValueError, IndexError):
            continue
    out: dict[str, Any] = {}
    for name, (a, b) in spans.items():
        sel = [r for r in rows if a <= r[0] <= b]
        if sel:
            out[name] = {"samples": len(sel), "sm_clock_mhz": round(sum(r[1] for r in sel) / len(sel), 1),
                         "power_w": round(sum(r[2] for r in sel) / len(sel), 1),
                         "temp_c": round(sum(r[3] for r in sel) / len(sel), 1)}
        else:
            out[name] = {"samples": 0, "note": "no nvidia-smi samples (clock of smi vs host?)"}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train", action="store_true", help="profile the training step (fwd + bwd)")
    p.add_argument("--batch", type=int, default=None, help="default 2, or 1 with --train")
    p.add_argument("--seq", type=int, default=None, help="default 8192, or 4096 with --train")
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--clocks", action="store_true", help="also sample SM clock and power per variant")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.batch = a.batch or (1 if a.train else 2)
    a.seq = a.seq or (4096 if a.train else 8192)
    from transformers import Qwen3ForCausalLM

    from solforge.api import optimize
    from solforge.zoo import zoo_config

    cfg = zoo_config("qwen3-4b")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    body = model.model.train() if a.train else model.model.eval()
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
    with torch.enable_grad() if a.train else torch.no_grad():
        f, rep = optimize(body, (ids,), budget=a.budget, is_language_model=False,
                          mode="train" if a.train else "inference")
    out: dict[str, Any] = {**provenance(), "train": a.train, "batch": a.batch, "seq": a.seq,
                           "regions": [{"workload": r.workload, "count": r.count, "best_us": r.best_us,
                                        "source": r.source} for r in rep.regions]}

    def run(fn: Any) -> Any:
        if a.train:  # bench/e2e.py's training step
            return lambda: fn(ids).last_hidden_state.float().square().mean().backward()
        return lambda: fn(ids)

    with contextlib.nullcontext() if a.train else torch.inference_mode():
        out["eager"] = profile(run(body), a.top)
        out["solforge"] = profile(run(f), a.top)
        if a.clocks:
            out["clocks"] = clocks({"eager": run(body), "solforge": run(f), "eager again": run(body)})
            print("clocks:", json.dumps(out["clocks"]))
    for v in ("eager", "solforge"):
        d = out[v]
        print(f"== {v}: {d['total_ms']} ms of kernels, {d['wall_ms']} ms wall; by kind {d['by_kind_ms']}")
        print(f"   GPU idle {d['gpu_idle']['idle_ms']} ms, {d['gpu_idle']['gaps_over_50us']} gaps over 50 us "
              f"({d['gpu_idle']['idle_in_gaps_over_50us_ms']} ms); largest: {d['gpu_idle']['largest_gaps'][:6]}")
        for k in d["kernels"]:
            print(f"  {k['ms']:9.3f} ms {k['calls']:5d}x  {k['name']}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
