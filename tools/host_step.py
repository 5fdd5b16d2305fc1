"""Decided kernels/direct.py's direct op calls: a training step's host time, and one rmsnorm call's through torch.ops
against its implementation alone (bench/results/2026-11-25-h100-session16.md).

Where a training step's host (CPU) time goes: eager against solforge, on one of bench/archs.py's models.

    python tools/host_step.py [--arch gpt2-medium] [--variants eager,solforge] [--steps 10]
                              [--profile-steps 3] [--top 40] [--out bench/results/NAME.json]

A small model's training step can be bound by the host: the GPU finishes each kernel before the
host has launched the next (bench/archs.py: GPT-2 medium's step took 61.8 ms under eager for
10.6 ms of kernels). For each variant, in its own process, this times --steps synchronized steps
(each starts on an idle device, as after a `loss.item()`): the host's time to run the forward and
the backward call, and the device's time between the same points (CUDA events). Then cProfile
runs over --profile-steps more steps, and the --top functions by internal time and by cumulative
time are kept (file:line, calls per step, ms per step), and torch.profiler (CPU activity) over as
many steps gives each op's and autograd node's host time (self and total). Under torch.profiler an
optimized model's solforge ops go through torch.ops (kernels/direct.py: so the profile names them),
so that table shows torch.ops's host cost; the timed steps and cProfile show the direct calls'. The step is
bench/archs.py's: loss = mean of the squared last hidden state, gradients accumulated, never zeroed.

`calibration` (in the parent process): host µs per call, in a loop without synchronizing, of
`torch.empty_like`, an `aten.add`, and solforge's rmsnorm op on 64 x 2048 through torch.ops with
autograd recording, through an autograd.Function calling its implementation directly, and its
implementation alone: what one call costs on this host.

`--tiny --device cpu` checks the script through Triton's interpreter; its times mean nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from archs import ARCHS, build  # noqa: E402
from e2e import provenance, run_one, write_json  # noqa: E402


def _table(stats: pstats.Stats, key: str, top: int, steps: int) -> list[dict[str, Any]]:
    rows = []
    raw = stats.stats  # type: ignore[attr-defined]
    idx = 2 if key == "tottime" else 3
    for func, val in sorted(raw.items(), key=lambda kv: kv[1][idx], reverse=True)[:top]:
        file, line, name = func
        rows.append({"function": f"{Path(file).name}:{line}({name})" if file != "~" else name,
                     "calls_per_step": round(val[1] / steps, 1),
                     "ms_per_step": round(val[idx] / steps * 1e3, 3)})
    return rows


def one(arch: str, name: str, seq: int, budget: float, steps: int, profile_steps: int, top: int, tiny: bool,
        device: str) -> dict[str, Any]:
    model = build(arch, tiny, device)
    body = model.base_model.train()
    seq = min(seq, ARCHS[arch].max_seq or seq)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    out: dict[str, Any] = {"arch": arch, "variant": name, "seq": seq}
    f: Any = body
    if name == "solforge":
        from solforge.api import optimize

        t0 = time.time()
        f, rep = optimize(body, (ids,), budget=budget, is_language_model=False, mode="train",
                          max_candidates=2 if tiny else None)
        out["optimize_s"] = round(time.time() - t0, 1)
        out["passed"] = rep.e2e.passed if rep.e2e else None
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> None:
        f(ids).last_hidden_state.float().square().mean().backward()

    def timed_step() -> tuple[float, float, float, float]:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
        sync()
        t0 = time.perf_counter()
        if cuda:
            ev[0].record()
        loss = f(ids).last_hidden_state.float().square().mean()
        t1 = time.perf_counter()
        if cuda:
            ev[1].record()
        loss.backward()
        t2 = time.perf_counter()
        if cuda:
            ev[2].record()
        sync()
        t3 = time.perf_counter()
        dev_f = ev[0].elapsed_time(ev[1]) if cuda else 0.0
        dev_b = ev[1].elapsed_time(ev[2]) if cuda else 0.0
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, dev_f + dev_b, (t3 - t0) * 1e3

    for _ in range(3):
        timed_step()
    runs = [timed_step() for _ in range(steps)]
    for i, key in enumerate(("host_fwd_ms", "host_bwd_ms", "device_ms", "step_synced_ms")):
        out[key] = round(statistics.median(r[i] for r in runs), 2)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(profile_steps):
        step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof)
    out["profiled_steps"] = profile_steps
    out["profile_total_ms_per_step"] = round(stats.total_tt / profile_steps * 1e3, 2)  # type: ignore[attr-defined]
    out["top_tottime"] = _table(stats, "tottime", top, profile_steps)
    out["top_cumtime"] = _table(stats, "cumtime", top, profile_steps)
    out.update(_torch_profile(step, profile_steps, top, cuda))
    return out


def _torch_profile(step: Any, steps: int, top: int, cuda: bool) -> dict[str, Any]:
    """torch.profiler over `steps` steps, CPU activity only: each op's and autograd node's host
    time (self: its own; total: with what it calls), per step, the top of each."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    avgs = prof.key_averages()

    def rows(attr: str) -> list[dict[str, Any]]:
        ranked = sorted(avgs, key=lambda e: getattr(e, attr), reverse=True)[:top]
        return [{"op": e.key, "calls_per_step": round(e.count / steps, 1),
                 "ms_per_step": round(getattr(e, attr) / steps / 1e3, 3)} for e in ranked]

    return {"op_self_cpu": rows("self_cpu_time_total"), "op_total_cpu": rows("cpu_time_total")}


def calibration(device: str) -> dict[str, float]:
    import solforge.kernels.rmsnorm as R
    from solforge.kernels import direct

    calls = 2000 if device == "cuda" else 3  # on the CPU the kernel runs in the interpreter

    x = torch.randn(64, 2048, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(2048, device=device, dtype=torch.bfloat16, requires_grad=True)
    args = (x, w, 1e-6, torch.bfloat16, True, "")

    # the autograd.Function direct calls apply: the implementation with the op's registered formula
    direct_fn = direct._DIRECT[torch.ops.solforge.rmsnorm.default].function

    def us(fn: Any) -> float:
        for _ in range(min(calls, 20)):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        v = (time.perf_counter() - t) / calls * 1e6
        if device == "cuda":
            torch.cuda.synchronize()
        return round(v, 2)

    op = torch.ops.solforge.rmsnorm.default
    return {"empty_like_us": us(lambda: torch.empty_like(x)), "add_us": us(lambda: x + x),
            "rmsnorm_op_grad_us": us(lambda: op(*args)), "rmsnorm_function_grad_us": us(lambda: direct_fn.apply(*args)),
            "rmsnorm_impl_us": us(lambda: R._rmsnorm_op(*args))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gpt2-medium", choices=list(ARCHS))
    p.add_argument("--variants", default="eager,solforge")
    p.add_argument("--seq", type=int, default=4096, help="sequence length, batch 1 (capped at the model's positions)")
    p.add_argument("--budget", type=float, default=30.0, help="solforge's tuning budget (s)")
    p.add_argument("--steps", type=int, default=10, help="synchronized steps timed")
    p.add_argument("--profile-steps", type=int, default=3, help="steps run under cProfile")
    p.add_argument("--top", type=int, default=40, help="functions kept per table")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: a smoke test of this script")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: VARIANT in this process
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("tools/host_step.py needs a CUDA GPU (or --device cpu --tiny)", file=sys.stderr)
        return 2
    if a.one:
        row = one(a.arch, a.one, a.seq, a.budget, a.steps, a.profile_steps, a.top, a.tiny, a.device)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    result: dict[str, Any] = {**provenance(), "tiny": a.tiny, "calibration": calibration(a.device), "rows": []}
    print(json.dumps(result["calibration"]), flush=True)
    for name in a.variants.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--arch", a.arch, "--seq", str(a.seq), "--budget",
               str(a.budget), "--steps", str(a.steps), "--profile-steps", str(a.profile_steps), "--top",
               str(a.top), "--device", a.device, *(["--tiny"] if a.tiny else [])]
        row = run_one(cmd, 900.0, {"arch": a.arch, "variant": name})
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("top_")}), flush=True)
        result["rows"].append(row)
        write_json(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
