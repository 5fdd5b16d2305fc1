"""Decided layernorm_bwd's heuristic without the residual gradient (kernels/layernorm_bwd.py); sweeps the layernorm /
add_layernorm spaces and the softmax backward's.

GPU: sweep of the layernorm / add_layernorm kernels (forward space, backward space) and of the
softmax backward, with eager / torch.compile / Liger references, in one run of < 4 minutes.

    python tools/ln_sweep.py --out $OUT/ln.json [--budget-s 180] [--no-warm]
    python tools/ln_sweep.py --smoke     # no GPU: tiny shapes through Triton's interpreter (logic check)

bf16, weight + bias, eps 1e-5. Kernel times are triton.testing.do_bench medians (L2 flushed before
each run), every config checked against the fp32 reference once. Phases, in order, each skipped
(and said so in the JSON) once the time budget is spent:
  warm        compiles every config in parallel processes into Triton's on-disk cache (256-row
              inputs: the same specialization as the timed shapes), so the timing loop pays loads
  copy        device-to-device copy of 512 MiB: the bandwidth ceiling
  fwd / bwd   layernorm and add_layernorm at 16384 x 2560 and 4096 x 2560, every config of
              `space()` and `bwd_space()` (add_layernorm's backward with the residual gradient ds)
  softmax     the backward over `bwd_space()` at 2x32x1024x1024 and 1x32x4096x4096
  steps       solforge (heuristic configs) against eager, torch.compile and Liger (if importable):
              the forward, and forward+backward by autograd.grad three ways: do_bench of the call
              (what bench/families.py reports), CUDA-graph replay of it (the GPU's time alone), and
              host time per call (wall clock of 20 calls without synchronizing: Python + launches).
              A step whose host time exceeds its graph time is host-bound, and its do_bench figure
              measures the host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from e2e import provenance, write_json  # noqa: E402

BF = torch.bfloat16
EPS = 1e-5
LN_SHAPES = [(16384, 2560), (4096, 2560)]
SM_SHAPES = [(2 * 32 * 1024, 1024), (32 * 4096, 4096)]  # attention scores B2 S1024 and B1 S4096, as rows
DEADLINE = [float("inf")]
DEV = ["cuda"]  # "cpu" with --smoke (Triton's interpreter)


def sync() -> None:
    if DEV[0] == "cuda":
        torch.cuda.synchronize()


def left() -> float:
    return DEADLINE[0] - time.perf_counter()


def bench(fn: Callable[[], Any], rep: int = 25) -> float:
    """Median µs of `fn` (do_bench: L2 flushed before each run)."""
    from triton.testing import do_bench

    if DEV[0] != "cuda":  # --smoke: one timed call, meaningless but exercises the path
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return float(do_bench(fn, warmup=5, rep=rep, return_mode="median")) * 1e3


# ----------------------------------------------------------------------------------------------
# Cases: inputs, reference, and a call per config. One function serves the warm workers (256 rows)
# and the timing loop (the real rows).


def _ln_inputs(rows: int, H: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV[0]).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEV[0])

    t = {k: rnd(rows, H).to(BF) for k in ("x", "r", "dy", "ds")}
    t["x"] = (t["x"].float() * 2 + rnd(rows, 1)).to(BF)  # rows with their own means
    t["w"] = (1 + 0.1 * rnd(H)).to(BF)
    t["b"] = (0.1 * rnd(H)).to(BF)
    return t


def case_calls(kind: str, rows: int, H: int) -> tuple[list[Any], Callable[[Any], Any], Callable[[Any], Any], Any]:
    """(configs, call(config) -> outputs, check(outputs) -> error string or "", heuristic) for one case."""
    from solforge.kernels import add_layernorm as A
    from solforge.kernels import layernorm as L
    from solforge.kernels import softmax as S
    from solforge.numerics import compare

    if kind.startswith("softmax"):
        g = torch.Generator(device=DEV[0]).manual_seed(0)
        y = torch.softmax(torch.randn(rows, H, generator=g, device=DEV[0]) * 3, -1).to(BF)
        dy = torch.randn(rows, H, generator=g, device=DEV[0]).to(BF)
        wl = S.workload_for(y, BF)
        ref = S.softmax_bwd_ref(dy, y).to(BF)
        return (S.bwd_space(wl), lambda c: S.softmax_bwd(dy, y, config=c),
                lambda dx: "" if compare(dx, ref).ok else compare(dx, ref).reason or "mismatch", S.bwd_heuristic(wl))
    t = _ln_inputs(rows, H)
    x, r, w, b, dy, ds = t["x"], t["r"], t["w"], t["b"], t["dy"], t["ds"]
    res = kind.startswith("add_layernorm")
    if kind.endswith("fwd"):
        wl = A.workload_for(x, r, w, b, EPS) if res else L.workload_for(x, w, b, EPS)
        if res:
            rs, ry = A.add_layernorm_ref(x, r, w, b, EPS)
            out2 = (torch.empty_like(x), torch.empty_like(x))

            def call(c: Any) -> Any:
                return A.add_layernorm(x, r, w, b, EPS, config=c, out=out2)

            def check(o: Any) -> str:
                cmp = compare(o[1], ry)
                return "" if torch.equal(o[0], rs) and cmp.ok else (cmp.reason or "sum differs")
        else:
            ref = L.layernorm_ref(x, w, b, EPS)
            out = torch.empty_like(x)

            def call(c: Any) -> Any:
                return L.layernorm(x, w, b, EPS, config=c, out=out)

            def check(o: Any) -> str:
                cmp = compare(o, ref)
                return "" if cmp.ok else cmp.reason or "mismatch"
        return L.space(wl), call, check, L.heuristic(wl)
    dsx = ds if res else None
    rdx, rdw, rdb = L.layernorm_bwd_ref(dy, x, w, EPS, ds=dsx, bias_grad=True)

    def call_b(c: Any) -> Any:
        return L.layernorm_bwd(dy, x, w, EPS, ds=dsx, bias_grad=True, config=c)

    def check_b(o: Any) -> str:
        dx, dw, db = o
        cmp = compare(dx, rdx)
        if not cmp.ok:
            return cmp.reason or "dx mismatch"
        for name, got, want in (("dw", dw, rdw), ("db", db, rdb)):
            if float((got - want).abs().max()) > 1e-2 * float(want.abs().max()):
                return f"{name} off by {float((got - want).abs().max()):.3g}"
        return ""

    return L.bwd_space(rows, H), call_b, check_b, L.bwd_heuristic(rows, H, x.device, ds=res)


def _cases() -> list[tuple[str, int, int]]:
    return ([(f"{f}_{d}", rows, H) for d in ("fwd", "bwd") for f in ("layernorm", "add_layernorm")
             for rows, H in LN_SHAPES] + [("softmax_bwd", rows, N) for rows, N in SM_SHAPES])


CASES = _cases()


def _warm(kind: str, H: int, encodings: list[str]) -> int:
    """Worker: run each config once on 256 rows (compiles it into Triton's cache). The kernels
    specialize on row counts only by divisibility by 16 (and the backward's loop counts not at all)."""
    configs, call, _check, _h = case_calls(kind, 256, H)
    for e in encodings:
        call(type(configs[0]).decode(e))
    sync()
    return len(encodings)


def warm(workers: int) -> dict[str, Any]:
    import multiprocessing as mp

    t0 = time.perf_counter()
    tasks = []
    seen: set[tuple[str, int]] = set()
    for kind, rows, H in CASES:
        if (kind, H) in seen:  # both row counts compile the same kernels
            continue
        seen.add((kind, H))
        encs = [c.encode() for c in case_calls_configs(kind, rows, H)]
        tasks += [(kind, H, encs[i:i + 6]) for i in range(0, len(encs), 6)]
    done = 0
    errors = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_warm, *t) for t in tasks]
        for f in futs:
            try:
                done += f.result(timeout=max(1.0, left()))
            except Exception as e:  # a failure here only costs the timing loop its compile time
                errors.append(f"{type(e).__name__}: {str(e)[:160]}")
    return {"configs": done, "tasks": len(tasks), "workers": workers, "s": round(time.perf_counter() - t0, 1),
            "errors": errors[:5]}


def case_calls_configs(kind: str, rows: int, H: int) -> list[Any]:
    """The configs of a case without building its inputs."""
    from solforge.kernels import add_layernorm as A
    from solforge.kernels import layernorm as L
    from solforge.kernels import softmax as S

    meta = torch.empty(rows, H, dtype=BF, device="meta")
    p = torch.empty(H, dtype=BF, device="meta")
    if kind.startswith("softmax"):
        wl = S.workload_for(meta, BF)
        return S.bwd_space(wl)
    if kind.endswith("fwd"):
        wl = A.workload_for(meta, meta, p, p, EPS) if kind.startswith("add") else L.workload_for(meta, p, p, EPS)
        return L.space(wl)  # the space does not depend on the device
    return L.bwd_space(rows, H)


def sweep_case(kind: str, rows: int, H: int) -> dict[str, Any]:
    configs, call, check, heur = case_calls(kind, rows, H)
    out: dict[str, Any] = {"case": kind, "shape": [rows, H], "heuristic": heur.encode(), "n_configs": len(configs),
                           "us": {}, "failed": {}}
    order = [heur, *[c for c in configs if c != heur]]
    for c in order:
        if left() <= 0:
            out["skipped"] = "time budget spent"
            break
        enc = c.encode()
        try:
            err = check(call(c))
            if err:
                out["failed"][enc] = err
                continue
            out["us"][enc] = round(bench(lambda c=c: call(c)), 2)
        except Exception as e:
            out["failed"][enc] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    us = out["us"]
    if us:
        best = sorted(us, key=us.__getitem__)
        out["best"] = [[k, us[k]] for k in best[:5]]
        out["heuristic_us"] = us.get(heur.encode())
        # tensors moved: ln fwd x, y; add fwd x, r, s, y; ln bwd dy, x, dx; add bwd dy, s, ds, dx;
        # softmax bwd dy, y, dx
        n_bytes = {"layernorm_fwd": 2, "add_layernorm_fwd": 4, "layernorm_bwd": 3, "add_layernorm_bwd": 4,
                   "softmax_bwd": 3}[kind]
        out["bytes"] = n_bytes * rows * H * 2
        out["best_TBps"] = round(out["bytes"] / us[best[0]] / 1e6, 3)
    return out


# ----------------------------------------------------------------------------------------------
# Steps: forward and forward+backward of whole ops against the references


def host_us(fn: Callable[[], Any], n: int = 20) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    sync()
    return us


def graph_us(fn: Callable[[], Any]) -> float:
    """The GPU time of one call: captured in a CUDA graph, replayed under do_bench."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    us = bench(g.replay)
    del g
    return us


def _impls(family: str, H: int) -> dict[str, Callable[..., Any]]:
    import torch.nn.functional as F

    from solforge.kernels import add_layernorm as A
    from solforge.kernels import layernorm as L
    from solforge.kernels import softmax as S

    fns: dict[str, Callable[..., Any]] = {}
    if family == "softmax":
        def eager(x: torch.Tensor) -> torch.Tensor:
            return F.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)
        fns = {"solforge": lambda x: S.softmax_op(x, BF, ""), "eager": eager}
        if DEV[0] == "cuda":
            fns["compile"] = torch.compile(eager, dynamic=False)
        try:
            from liger_kernel.ops.softmax import LigerSoftmaxFunction
            fns["liger"] = LigerSoftmaxFunction.apply
        except ImportError:
            pass
        return fns
    res = family == "add_layernorm"

    def eager_ln(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
        if res:
            s = x + r
            return s, F.layer_norm(s, (H,), w, b, EPS)
        return F.layer_norm(x, (H,), w, b, EPS)

    fns["solforge"] = ((lambda x, r, w, b: A.add_layernorm_op(x, r, w, b, EPS, BF, "")) if res
                       else (lambda x, r, w, b: L.layernorm_op(x, w, b, EPS, BF, "")))
    fns["eager"] = eager_ln
    if DEV[0] == "cuda":
        fns["compile"] = torch.compile(eager_ln, dynamic=False)
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        lg = LigerLayerNormFunction.apply
        fns["liger"] = ((lambda x, r, w, b: (x + r, lg(x + r, w, b, EPS))) if res
                        else (lambda x, r, w, b: lg(x, w, b, EPS)))
    except ImportError:
        pass
    return fns


def steps(family: str, rows: int, H: int) -> dict[str, Any]:
    out: dict[str, Any] = {"family": family, "shape": [rows, H]}
    if family == "softmax":
        g = torch.Generator(device=DEV[0]).manual_seed(0)
        x = (torch.randn(rows, H, generator=g, device=DEV[0]) * 3).to(BF)
        dy = torch.randn(rows, H, generator=g, device=DEV[0]).to(BF)
        args, grads, wrt_mask = [x], dy, [True]
    else:
        t = _ln_inputs(rows, H)
        args = [t["x"], t["r"], t["w"], t["b"]]
        res = family == "add_layernorm"
        grads = (t["ds"], t["dy"]) if res else t["dy"]
        wrt_mask = [True, res, True, True]
    for name, f in _impls(family, H).items():
        if left() <= 0:
            out[f"{name}"] = "skipped: time budget spent"
            continue
        row: dict[str, Any] = {}
        try:
            with torch.no_grad():
                f(*args)
                row["fwd_us"] = round(bench(lambda f=f: f(*args)), 2)
            leaves = [a.clone().requires_grad_(m) for a, m in zip(args, wrt_mask, strict=True)]
            wrt = [a for a in leaves if a.requires_grad]

            def step(f: Callable[..., Any] = f, leaves: list[torch.Tensor] = leaves,
                     wrt: list[torch.Tensor] = wrt) -> Any:
                return torch.autograd.grad(f(*leaves), wrt, grads)

            step()
            row["fwd_bwd_us"] = round(bench(step), 2)
            row["fwd_bwd_host_us"] = round(host_us(step), 2)
            if DEV[0] == "cuda":
                try:
                    row["fwd_bwd_graph_us"] = round(graph_us(step), 2)
                except Exception as e:  # not every implementation captures
                    row["fwd_bwd_graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            with torch.no_grad():
                row["fwd_host_us"] = round(host_us(lambda f=f: f(*args)), 2)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        out[name] = row
        if DEV[0] == "cuda":
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------


def copy_TBps() -> float:  # noqa: N802
    src = torch.empty(256 * 2**20 if DEV[0] == "cuda" else 2**16, dtype=BF, device=DEV[0]).normal_()
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    return round(2 * src.numel() * 2 / us / 1e6, 3)


def table(res: dict[str, Any]) -> str:
    lines = [f"copy ceiling {res.get('copy_TBps')} TB/s; warm {res.get('warm')}"]
    for c in res["cases"]:
        best = ", ".join(f"{k} {v}" for k, v in c.get("best", []))
        lines.append(f"{c['case']:<20} {c['shape'][0]:>6}x{c['shape'][1]:<5} heuristic {c['heuristic']} "
                     f"{c.get('heuristic_us')} | best {c.get('best_TBps')} TB/s: {best}"
                     + (f" | {len(c['failed'])} FAILED" if c["failed"] else "") + (" | CUT" if "skipped" in c else ""))
    for s in res["steps"]:
        for name, row in s.items():
            if isinstance(row, dict):
                vals = " ".join(f"{k.replace('_us', '')}={v}" for k, v in row.items())
                lines.append(f"{s['family']:<14} {s['shape'][0]:>6}x{s['shape'][1]:<5} {name:<9} {vals}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--budget-s", type=float, default=180.0, help="stop starting new measurements after this")
    p.add_argument("--no-warm", action="store_true", help="compile in the timing loop instead of in parallel first")
    p.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)))
    p.add_argument("--smoke", action="store_true", help="no GPU: tiny shapes on Triton's interpreter")
    p.add_argument("--only", default="", help="comma-separated case kinds to sweep (e.g. layernorm_bwd,"
                   "add_layernorm_bwd); the steps phase is skipped then")
    a = p.parse_args()
    global LN_SHAPES, SM_SHAPES, CASES
    if a.smoke:
        DEV[0] = "cpu"
        a.no_warm = True
        LN_SHAPES, SM_SHAPES = [(40, 160), (16, 160)], [(24, 96), (8, 128)]
        CASES = _cases()
    if a.only:
        CASES = [c for c in CASES if c[0] in a.only.split(",")]
    t0 = time.perf_counter()
    DEADLINE[0] = t0 + a.budget_s
    res: dict[str, Any] = {**provenance(), "budget_s": a.budget_s, "cases": [], "steps": []}
    if not a.no_warm:
        res["warm"] = warm(a.workers)
        print("warm", res["warm"], flush=True)
    res["copy_TBps"] = copy_TBps()
    for kind, rows, H in CASES:
        res["cases"].append(sweep_case(kind, rows, H))
        if DEV[0] == "cuda":
            torch.cuda.empty_cache()  # the case's inputs are gone with its closures
        c = res["cases"][-1]
        print(json.dumps({k: v for k, v in c.items() if k not in ("us",)}), flush=True)
        write_json(res, a.out, indent=1)
    # the main shapes first; the others only while time is left
    for family, rows, H in [] if a.only else [
            ("layernorm", *LN_SHAPES[0]), ("add_layernorm", *LN_SHAPES[0]), ("softmax", *SM_SHAPES[0]),
            ("layernorm", *LN_SHAPES[1]), ("add_layernorm", *LN_SHAPES[1])]:
        if left() <= 0:
            res["steps"].append({"family": family, "shape": [rows, H], "skipped": "time budget spent"})
            continue
        res["steps"].append(steps(family, rows, H))
        print(json.dumps(res["steps"][-1]), flush=True)
        write_json(res, a.out, indent=1)
    res["total_s"] = round(time.perf_counter() - t0, 1)
    write_json(res, a.out, indent=1)
    print(table(res))
    print(f"total {res['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
