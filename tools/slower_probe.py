"""Probe: where an optimized model that came back slower than the original spends its GPU time.

On KernelBench rows the guarantee returned the original because the optimized model was slower end
to end although its regions ran faster (level 3's ResNetBasicBlock at 0.82x with its only region
1.8x faster, H200 2026-11-27; level 2's GEMM rows at 0.95x). This optimizes each problem with
`keep_slower=True` (the slower model is returned for analysis), then times and profiles the original
and the optimized model in the same process: each kernel's GPU time a call for both, and the names
whose time differs most. A kernel that is slower in the optimized model's graph than in eager's
(another cuDNN/cuBLAS algorithm, another layout, a copy eager does not make) shows there.

    python tools/slower_probe.py --kernelbench PATH --problems level3/8_ResNetBasicBlock,... [--budget 10]
        [--out FILE.json]

Found (2026-11-27, bench/results/2026-11-27-h100-slower-probe-8ef04dc.json and
...-h200-slower-probe-b59f2dd.json): ResNetBasicBlock's ReLUs and residual add were in-place ops
that no region took (capture/inplace.py since: 1.36x, the check and do_bench agree); LeNet5 is
host-bound and its step graph declines to replay (723.6 against 723.9 us), the check reads 0.98x
and the original comes back. The first run's 0.69x-in-the-check against 1.12x-by-do_bench did not
come back.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
from e2e import bench_us  # noqa: E402
from kernelbench import kernels_per_call  # noqa: E402
from suite import load_problem  # noqa: E402


def _by_name(prof: dict[str, Any]) -> dict[str, float]:
    return {k["name"]: k["us"] for k in prof["kernels"]}


def _tm(fn: Any) -> float | None:
    from solforge.tune.timing import time_model

    r = time_model(fn, "cuda")
    return round(r.p50_us, 2) if r.ok else None


def _step_state(s: Any) -> dict[str, Any]:
    """A StepGraph's CUDA-graph state: calls, judged costs, why it declined (runtime/stepgraphs.py)."""
    keys = ("calls", "declined", "launch_bound", "host_s", "gpu_s", "replay_s", "run_s", "judged")
    return {k: getattr(s, k, None) for k in keys} | {"settled": getattr(s, "settled", None)}


def probe(path: Path, budget: float) -> dict[str, Any]:
    import solforge

    model, inputs, dt = load_problem(str(path), "cuda", None, False)
    original = copy.deepcopy(model)
    with torch.no_grad():
        opt, report = solforge.optimize(model, inputs, budget=budget, keep_slower=True)
        ref, got = original(*inputs), opt(*inputs)
        err = float((got.float() - ref.float()).abs().max()) if isinstance(got, torch.Tensor) else None
        steps = [_step_state(s) for s in getattr(getattr(opt, "solforge_stats", None), "step_graphs", [])]
        # validation's own timer (CUDA events around each call, a sync between calls) and do_bench's
        # (calls back to back), twice each: a difference between them, or between the rounds, is
        # what the end-to-end check's number missed
        rounds = [{"time_model_original_us": _tm(lambda: original(*inputs)), "time_model_optimized_us":
                   _tm(lambda: opt(*inputs)), "do_bench_original_us": bench_us(lambda: original(*inputs)),
                   "do_bench_optimized_us": bench_us(lambda: opt(*inputs))} for _ in range(2)]
        steps_after = [_step_state(s) for s in getattr(getattr(opt, "solforge_stats", None), "step_graphs", [])]
        t_orig, t_opt = rounds[-1]["do_bench_original_us"], rounds[-1]["do_bench_optimized_us"]
        p_orig, p_opt = kernels_per_call(lambda: original(*inputs)), kernels_per_call(lambda: opt(*inputs))
    a, b = _by_name(p_orig), _by_name(p_opt)
    diff = sorted(((n, a.get(n, 0.0), b.get(n, 0.0)) for n in set(a) | set(b)), key=lambda r: -abs(r[2] - r[1]))
    return {"problem": path.stem, "dtype": dt, "original_us": round(t_orig, 2), "optimized_us": round(t_opt, 2),
            "e2e": None if report.e2e is None else {"baseline_ms": report.e2e.baseline_ms,
                                                    "optimized_ms": report.e2e.optimized_ms},
            "rounds": rounds, "step_graphs": steps, "step_graphs_after": steps_after,
            "max_abs_err": err, "returned": report.returned, "notes": report.notes,
            "original_kernel_us": p_orig["kernel_us_sum"], "optimized_kernel_us": p_opt["kernel_us_sum"],
            "differ": [{"name": n, "original_us": x, "optimized_us": y} for n, x, y in diff[:16]],
            "original_kernels": p_orig["kernels"][:16], "optimized_kernels": p_opt["kernels"][:16]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernelbench", required=True, help="a KernelBench checkout (level1/ level2/ level3/)")
    p.add_argument("--problems", required=True, help="comma-separated, e.g. level3/8_ResNetBasicBlock")
    p.add_argument("--budget", type=float, default=10.0, help="solforge's tuning budget a problem (s)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for name in a.problems.split(","):
        path = Path(a.kernelbench) / (name if name.endswith(".py") else name + ".py")
        if not path.is_file():
            print(f"no such problem: {path}", file=sys.stderr)
            return 2
        try:
            r = probe(path, a.budget)
        except Exception as e:  # noqa: BLE001 - one problem's failure is a row, the others still run
            r = {"problem": path.stem, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("original_kernels", "optimized_kernels")},
                         default=str), flush=True)
        torch.compiler.reset()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
