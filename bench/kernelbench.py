"""Model files in the KernelBench format on a GPU: eager, torch.compile and solforge, in one run.

    python bench/kernelbench.py [FILE ...] [--dtype fp32] [--budget 60] [--out bench/results/NAME.json]

FILE defaults to bench/kernelbench/*.py: problems written here in that format (`Model`,
`get_inputs`, `get_init_inputs`), among them the forms and shapes of KernelBench's level-1 RMSNorm
(over `features`, a middle dim: kernels/rmsnorm_cols.py) and LayerNorm (over three trailing dims:
the split variant), and the forms of its Softmax, MinGPTNewGelu and CrossEntropyLoss problems at
sizes chosen here (not yet run on a GPU).
Each file and variant runs in a process of its own (bench/e2e.py's run_one). A process loads the
model with solforge.zoo.load_model (the same weights and inputs in every variant), computes eager's
output, builds its variant (torch.compile's default mode, or solforge.optimize with --budget
seconds of tuning), checks it against eager's output (largest error over the largest magnitude),
and times one call with do_bench (median, L2 flushed between calls) and, on a GPU, 200 calls back
to back (`loop_us`: wall clock a call, the host's time included). `--profile` adds each variant's
CUDA kernels a call with their GPU time (torch.profiler), to tell kernel time from the rest.
Effective TB/s counts the inputs read once and the outputs written once. solforge's row holds
optimize()'s regions (workload, config, verified, kernel speedup) and notes.

`--device cpu` runs the same code through Triton's interpreter on small inputs
(`--scale`), a smoke test of this script only: its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors need it

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import bench_us, loop_us, provenance, run_one, write_json  # noqa: E402  (bench/ holds scripts, not a package)

HERE = Path(__file__).resolve().parent
VARIANTS = ("eager", "compile", "solforge")


def _tensors(x: Any) -> list[torch.Tensor]:
    from solforge.validate import flatten_tensors

    return [t for _, t in flatten_tensors(x)]


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _rel_err(out: Any, ref: Any) -> float:
    worst = 0.0
    for o, r in zip(_tensors(out), _tensors(ref), strict=True):
        scale = r.float().abs().max().item() or 1.0
        worst = max(worst, (o.float() - r.float()).abs().max().item() / scale)
    return worst


def _time_us(fn: Any, device: str) -> float:
    if device == "cuda":
        return bench_us(fn)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def kernels_per_call(fn: Any, calls: int = 5) -> dict[str, Any]:
    """The CUDA kernels (and copies/memsets) of `calls` calls of `fn` under torch.profiler: each
    name's GPU µs a call, and their sum. A sum well below the call's do_bench time means the GPU
    waited for the host between them, or something ran that the names show."""
    from collections import defaultdict

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total / calls
            count[e.name] += 1
    rows = sorted(per.items(), key=lambda kv: -kv[1])
    return {"kernels": [{"name": k[:120], "us": round(v, 2), "launches_per_call": count[k] / calls} for k, v in rows],
            "kernel_us_sum": round(sum(per.values()), 2)}


def build_variant(name: str, model: torch.nn.Module, inputs: tuple[Any, ...], *, budget: float, label: str,
                  max_candidates: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The callable of one variant of `model` (eager: the model itself; compile: torch.compile's
    default mode; compile-max-autotune: mode "max-autotune"; solforge: solforge.optimize with
    `budget` seconds of tuning, in the caller's grad mode) and what its row records about it:
    solforge's regions (family, workload, configs, verified), notes and end-to-end check."""
    import solforge
    from solforge.records import to_dict

    if name == "eager":
        return model, {}
    if name == "compile":
        return torch.compile(model), {}
    if name == "compile-max-autotune":
        return torch.compile(model, mode="max-autotune"), {}
    if name != "solforge":
        raise ValueError(f"unknown variant {name!r}")
    fn, report = solforge.optimize(model, inputs, budget=budget, name=label, max_candidates=max_candidates,
                                   inplace=False)  # the wrapper carries solforge_stats (how each graph runs)
    rep = to_dict(report)
    extra = {"regions": [{k: r.get(k) for k in ("family", "workload", "count", "baseline_us", "best_us",
                                                "speedup", "config", "verified", "max_rel_err", "source",
                                                "integrated", "note")}
                         for r in rep["regions"]],
             "notes": rep["notes"], "e2e": rep["e2e"]}
    # whether optimize handed back the optimized model or the original (a report field newer
    # solforge versions carry; absent before)
    returned = rep.get("returned", rep.get("extra", {}).get("returned"))
    if returned is not None:
        extra["returned"] = returned
    return fn, extra


def variant(path: str, name: str, dtype: str, budget: float, device: str, scale: float,
            profile: bool = False) -> dict[str, Any]:
    """One file's one variant in this process: its row."""
    from solforge.zoo import load_model

    row: dict[str, Any] = {"file": path, "variant": name, "dtype": dtype}
    loaded = load_model(path, device=device, dtype=dtype)
    model = loaded.model.eval()
    inputs = loaded.example_inputs
    if scale != 1.0:  # a CPU smoke run: the first dim of every input tensor cut down
        inputs = tuple(t[: max(1, int(t.shape[0] * scale))] if isinstance(t, torch.Tensor) and t.dim() else t
                       for t in inputs)
    with torch.no_grad():
        ref = model(*inputs)
        fn, extra = build_variant(name, model, inputs, budget=budget, label=Path(path).name)
        row.update(extra)
        out = fn(*inputs)  # compiles, captures and warms up
        row["max_rel_err_vs_eager"] = float(f"{_rel_err(out, ref):.3g}")
        us = _time_us(lambda: fn(*inputs), device)
        stats = getattr(fn, "solforge_stats", None)  # None: optimize returned the original model
        if name == "solforge" and stats is not None:  # how each graph runs: replayed or not, and why
            row["step_graphs"] = [s.summary() for s in stats.step_graphs]
        if device == "cuda":
            row["loop_us"] = round(loop_us(lambda: fn(*inputs), 200), 2)
            if profile:
                row.update(kernels_per_call(lambda: fn(*inputs)))
    moved = _nbytes([t for t in inputs if isinstance(t, torch.Tensor)]) + _nbytes(_tensors(ref))
    row.update(us=round(us, 2), bytes_moved=moved, effective_TBps=round(moved / (us * 1e-6) / 1e12, 3))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="model files (default: bench/kernelbench/*.py)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="the models' and inputs' dtype (KernelBench's problems are fp32)")
    p.add_argument("--budget", type=float, default=60.0, help="solforge's tuning budget per file (s)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--scale", type=float, default=1.0, help="cut every input's first dim by this factor")
    p.add_argument("--variant-timeout", type=float, default=900.0, help="seconds allowed to each variant")
    p.add_argument("--profile", action="store_true",
                   help="also list each variant's CUDA kernels a call (torch.profiler) and their GPU time")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: VARIANT:FILE in this process
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench/kernelbench.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if a.one:
        name, _, path = a.one.partition(":")
        print("RESULT " + json.dumps(variant(path, name, a.dtype, a.budget, a.device, a.scale, a.profile)), flush=True)
        return 0
    files = a.files or sorted(str(f) for f in (HERE / "kernelbench").glob("*.py"))
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS] + [f for f in files if not Path(f).is_file()]
    if unknown:
        print(f"unknown variant(s) or missing file(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {**provenance(), "dtype": a.dtype, "budget_s": a.budget, "scale": a.scale,
                              "rows": []}
    for f in files:
        for name in names:
            cmd = [sys.executable, __file__, "--one", f"{name}:{f}", "--dtype", a.dtype, "--budget", str(a.budget),
                   "--device", a.device, "--scale", str(a.scale)] + (["--profile"] if a.profile else [])
            row = run_one(cmd, a.variant_timeout, {"file": f, "variant": name})
            result["rows"].append(row)
            print(json.dumps({k: row.get(k) for k in ("file", "variant", "us", "loop_us", "kernel_us_sum",
                                                       "effective_TBps", "max_rel_err_vs_eager", "error")}),
                  flush=True)
            write_json(result, a.out)  # after every row: a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
