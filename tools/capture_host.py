"""probe: the host seconds of a warm optimize's capture, plan and integrate stages (no GPU needed).

Host (CPU) seconds of what a warm `solforge optimize` does around its kernels: capture (dynamo +
ATen lowering), plan (the matchers), and the integrate rewrite; no GPU needed.

    python tools/capture_host.py [--model qwen3-4b] [--seq 16] [--profile capture] [--top 40]

The model is built with uninitialized CPU weights (values do not matter to the graphs; a tiny
input keeps the real forward cheap; its eager time is printed so it can be subtracted). Prints one
JSON line of seconds; with --profile STAGE, the cProfile table of that stage (by cumulative time).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import time
from typing import Any

import torch

if not torch.cuda.is_available():  # the first call runs the kernels: Triton's interpreter on a CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

def build(name: str, seq: int) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    import transformers

    from solforge.zoo import zoo_config

    config = zoo_config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    # uninitialized memory, not random init (minutes for 4B parameters on two cores); then the
    # buffers computed at construction (RoPE's inv_freq) are recomputed by a fresh rotary module
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() < 2 else p.zero_()
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.eval()
    ids = torch.randint(0, int(config.vocab_size), (1, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids,)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--profile", choices=["capture", "plan", "integrate", "first_call"], default=None)
    p.add_argument("--after", type=int, default=200000,
                   help="objects to allocate after integrate (stands in for the rest of a run): a full "
                        "collection that the capture put off lands here, and is counted")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--sort", default="cumulative")
    p.add_argument("--no-call", action="store_true", help="skip the first call of the optimized model")
    p.add_argument("--cache", default=None, help="lowering cache directory (run twice: a miss, then a hit)")
    p.add_argument("--gc", choices=["none", "capture", "process"], default="capture",
                   help="none: no GC handling; capture: capture()'s own (default); process: also gc.freeze() "
                        "after the model is built, as the CLI does")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a shared box, spinning OpenMP threads made the "
                        "real forward inside the capture take 9 s instead of 0.4)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import solforge.capture as cap
    import solforge.plan as plan
    from solforge.integrate import integrate_captured
    from solforge.tune import family_module

    t = time.perf_counter()
    for fam in plan._matchers():  # the kernel modules the matchers import on first use
        family_module(fam)
    secs: dict[str, float] = {"imports": time.perf_counter() - t}
    t = time.perf_counter()
    model, inputs = build(a.model, a.seq)
    secs["build"] = time.perf_counter() - t
    if a.gc == "none":
        cap.few_full_collections = contextlib.nullcontext
    elif a.gc == "process":
        gc.freeze()
    gc_s: dict[str, float] = {}
    cpu: dict[str, float] = {}  # process CPU seconds: less disturbed than wall time on a shared box
    gc_start = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_s[current[0]] = gc_s.get(current[0], 0.0) + time.perf_counter() - gc_start[0]

    current = ["build"]
    gc.callbacks.append(on_gc)
    with torch.no_grad():
        t = time.perf_counter()
        model(*inputs)
        secs["eager_forward"] = time.perf_counter() - t

    prof = cProfile.Profile()

    def stage(name: str, fn: Any) -> Any:
        current[0] = name
        if a.profile == name:
            prof.enable()
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        secs[name] = time.perf_counter() - t
        cpu[name] = time.process_time() - c
        if a.profile == name:
            prof.disable()
        return out

    captured = stage("capture", lambda: cap.capture(model, inputs, cache=a.cache))
    groups = stage("plan", lambda: plan.plan(captured.graphs))
    # a warm run: every workload's winner known (the heuristic config stands in for the database's)
    winners = {g.workload: family_module(g.workload.family).heuristic(g.workload).encode() for g in groups}
    optimized, stats = stage("integrate", lambda: integrate_captured(captured, winners))
    if not a.no_call:
        with torch.no_grad():
            stage("first_call", lambda: optimized(*inputs))
    current[0] = "after"
    t = time.perf_counter()
    junk = [[i] for i in range(a.after)]
    del junk
    secs["after"] = time.perf_counter() - t
    secs = {k: round(v, 3) for k, v in secs.items()}
    secs["capture_plan_integrate"] = round(secs["capture"] + secs["plan"] + secs["integrate"], 3)
    nodes = sum(len(g.aten.graph.nodes) for g in captured.graphs)
    print("CAPTURE_HOST " + json.dumps({"model": a.model, "seq": a.seq, "graphs": len(captured.graphs),
                                        "aten_nodes": nodes, "workloads": len(groups),
                                        "regions": sum(g.count for g in groups), "replaced": stats.total,
                                        "errors": captured.errors, "seconds": secs,
                                        "gc_seconds": {k: round(v, 3) for k, v in gc_s.items()},
                                        "cpu_seconds": {k: round(v, 3) for k, v in cpu.items()},
                                        "cache": None if captured.cache is None else
                                        {"hits": captured.cache.hits, "stored": captured.cache.stored,
                                         "problems": captured.cache.problems}}), flush=True)
    if a.profile:
        pstats.Stats(prof).sort_stats(a.sort).print_stats(a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
