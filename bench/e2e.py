"""Benchmark on a GPU: eager vs torch.compile vs Liger-Kernel (when installed) vs solforge.

    python bench/e2e.py [--what rmsnorm,qwen3,qwen3train] [--out bench/results/NAME.json]

- rmsnorm: the RMSNorm shapes of ../shared/BASELINES.md (bf16, eps 1e-6, weight), medians of
  triton.testing.do_bench (L2 flushed between runs). solforge's kernel is tuned for each shape
  first (full space). The decode shape (1 x 2560) is also timed through the integrated model path:
  a module holding one RMSNorm, optimized by solforge.optimize, called in a loop (wall clock per
  call, CPU launch overhead included), and the custom op alone.
- qwen3: the Qwen3-4B forward (published config, random bf16 weights, sdpa, B2 S8192,
  inference_mode) of the model body, each variant in its own process (Liger patches classes).
  Variant "fp32" runs eager in fp32: each variant's argmax agreement with it (`argmax_agree_vs_fp32`)
  next to eager bf16's own says whether a variant is less accurate than the original or only
  differs from it where bf16 rounding decides near-ties (random weights give them everywhere).
  Like qwen3train, it records clocks and power during the timing and a steady-state profile.
  `--weights W --ids I` run the forward on a saved state dict and saved token ids instead
  (tools/train_bytes.py trains the architecture on local text so that its logits have margins).
- qwen3train: BASELINES.md's training step (B1 S4096, loss = mean of the squared last hidden
  state, forward + backward; solforge optimizes with --mode train), its peak memory, the SM clock
  and board power during the timing (`during_do_bench`), and a profile of two steps run back to
  back (`steady_profile`: summed kernel time against the device time they spanned, idle gaps by
  size).
Variants for A/B, each solforge with one pass turned off by its environment switch (ENV_VARIANTS):
"solforge-nocompact" (SOLFORGE_COMPACT=0: no compact.py), "solforge-nolinears" (SOLFORGE_LINEARS=0:
no linears.py), "solforge-nograd-in-place" (SOLFORGE_GRAD_IN_PLACE=0: linears.py's and
embeddings.py's ops, but every weight gradient handed back to autograd's AccumulateGrad) and "solforge-noembedding"
(SOLFORGE_EMBEDDING=0: no embeddings.py). "solforge-profile" runs optimize's
profile stage even when the kernel database knows every kernel (as a first run does).
"solforge-judged" lets every training forward past traingraphs.py's screen (TRAIN_IDLE -inf), so
that its judgement on whole steps alone decides whether the step replays from CUDA graphs.

Writes one JSON file with device, versions, date, command and every number.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

EPS = 1e-6
# solforge with one pass switched off (read by the pass's module at import, so one process each)
ENV_VARIANTS = {"solforge-nocompact": {"SOLFORGE_COMPACT": "0"}, "solforge-nolinears": {"SOLFORGE_LINEARS": "0"},
                "solforge-nograd-in-place": {"SOLFORGE_GRAD_IN_PLACE": "0"},
                "solforge-noembedding": {"SOLFORGE_EMBEDDING": "0"}}
# BASELINES.md's q/k-norm row says 1048576 x 128 but its speed of light (88.9 us) is 524288 x 128,
# Qwen3-4B's q-norm at B2 S8192: both are timed.
RMSNORM_SHAPES = [(16384, 2560), (1048576, 128), (524288, 128), (1, 2560), (32768, 4096)]


def hf_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Hugging Face Qwen3RMSNorm.forward, written out."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + EPS)
    return w * h.to(dtype)


class OneNorm(torch.nn.Module):
    def __init__(self, H: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hf_rmsnorm(x, self.weight)


def versions() -> dict[str, str]:
    import triton

    v = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
         "cuda": str(torch.version.cuda),
         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    for mod in ("transformers", "liger_kernel"):
        try:
            from importlib.metadata import version

            v[mod] = version(mod.replace("_", "-"))
        except Exception:
            v[mod] = "not installed"
    return v


def commit() -> str | None:
    """The checkout's commit: a `.commit` file at its root where there is one (a copy sent to a GPU
    machine, whose `.git` may be missing or stale), else git's HEAD; None when neither answers."""
    root = Path(__file__).resolve().parent.parent
    mark = root / ".commit"
    if mark.is_file():
        return mark.read_text().strip() or None
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def provenance() -> dict[str, Any]:
    """What every results file starts with: the device, versions, commit, date and the command."""
    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "versions": versions(),
            "commit": commit(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv)}


def write_json(result: dict[str, Any], out: str | None, indent: int = 2) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=indent) + "\n")


def bench_us(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=300, return_mode="median")) * 1e3


def loop_us(fn: Any, n: int = 2000) -> float:
    """Wall clock per call over n back-to-back calls: what a decode loop pays (launch included)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def graph_us(fn: Any, per_graph: int = 32) -> float:
    """Per call of `fn` when `per_graph` calls are captured in one CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    return bench_us(g.replay) / per_graph


def rmsnorm_rows(shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError:
        LigerRMSNorm = None  # noqa: N806
    rows_out = []
    for rows, H in shapes:
        rows_out.append(rmsnorm_row(rows, H, LigerRMSNorm))
        print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def rmsnorm_row(rows: int, H: int, LigerRMSNorm: Any, tune_budget: float = 30.0) -> dict[str, Any]:  # noqa: N803
    from solforge.kernels import rmsnorm as fam
    from solforge.records import RunResult
    from solforge.tune import tune

    torch.manual_seed(0)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    nbytes = 2 * x.numel() * x.element_size()
    row: dict[str, Any] = {"shape": [rows, H], "bytes_moved": nbytes}
    row["eager_us"] = bench_us(lambda: hf_rmsnorm(x, w))
    comp = torch.compile(hf_rmsnorm, dynamic=False)
    comp(x, w)
    row["compile_us"] = bench_us(lambda: comp(x, w))
    lig = None
    if LigerRMSNorm is not None:
        lig = LigerRMSNorm(H, eps=EPS).cuda().to(torch.bfloat16)
        lig.weight.data.copy_(w)
        with torch.no_grad():
            lig(x)
            row["liger_us"] = bench_us(lambda: lig(x))
    wl = fam.workload_for(x, w, EPS, out_dtype=torch.bfloat16, round_before_weight=True)
    t0 = time.perf_counter()
    res = tune(wl, RunResult(), device="cuda", budget_s=tune_budget)
    row["tune_s"] = round(time.perf_counter() - t0, 1)
    row["candidates"] = len(res.records)
    row["rejected"] = sum(1 for r in res.records if not r.ok)
    assert res.best is not None, [r.error for r in res.records]
    cfg = fam.Config(**res.best.candidate.config_dict)
    enc = cfg.encode()
    op = fam.rmsnorm_op.default
    row["solforge_config"] = enc
    row["solforge_tuned_p50_us"] = res.best.time_us
    row["solforge_us"] = bench_us(lambda: fam.rmsnorm(x, w, EPS, round_before_weight=True, config=cfg))
    row["solforge_op_us"] = bench_us(lambda: op(x, w, EPS, torch.bfloat16, True, enc))
    if rows == 1:
        from solforge.api import optimize
        from solforge.runtime.graphed import Graphed

        m = OneNorm(H).cuda().to(torch.bfloat16)
        with torch.no_grad():
            opt, rep = optimize(m, (x,), budget=60, inplace=False)  # m stays eager
            assert rep.e2e is not None and rep.e2e.passed, rep
            row["model_path_do_bench_us"] = bench_us(lambda: opt(x))
            row["model_path_loop_us"] = loop_us(lambda: opt(x))
            row["op_loop_us"] = loop_us(lambda: op(x, w, EPS, torch.bfloat16, True, enc))
            row["eager_loop_us"] = loop_us(lambda: m(x))
            if lig is not None:
                row["liger_loop_us"] = loop_us(lambda: lig(x))
            # the way decode loops are served: the step captured in a CUDA graph, so the host's
            # launch cost is paid once per graph, not per kernel
            row["model_path_cuda_graph_us"] = graph_us(lambda: opt(x))
            row["eager_cuda_graph_us"] = graph_us(lambda: m(x))
            # the same, one step per replay, through solforge.runtime.graphed (what a decode loop would use)
            gopt, geager = Graphed(opt, (x,)), Graphed(m, (x,))
            row["model_path_graphed_do_bench_us"] = bench_us(lambda: gopt(x))
            row["model_path_graphed_loop_us"] = loop_us(lambda: gopt(x))
            row["eager_graphed_do_bench_us"] = bench_us(lambda: geager(x))
            row["eager_graphed_loop_us"] = loop_us(lambda: geager(x))
            # outputs left in the graph's buffers (valid until the next call), as serving loops run
            gstatic = Graphed(opt, (x,), copy_outputs=False)
            row["model_path_graphed_static_do_bench_us"] = bench_us(lambda: gstatic(x))
            row["model_path_graphed_static_loop_us"] = loop_us(lambda: gstatic(x))
            assert gopt.fallbacks == 0 and geager.fallbacks == 0
    for k in [k for k in row if k.endswith("_us")]:
        if rows > 1:
            row[k.replace("_us", "_TBps")] = round(nbytes / (row[k] * 1e-6) / 1e12, 3)
        row[k] = round(row[k], 2)
    return row


class GpuSampler:
    """SM clock, board power and utilization (the share of each sample period in which a kernel
    ran) sampled by nvidia-smi every 100 ms while the block runs: whether a variant's kernels ran
    at power-capped clocks, and whether the device sat idle waiting for the host. Means over the
    samples; empty if nvidia-smi is missing."""

    def __enter__(self) -> GpuSampler:
        import tempfile

        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,utilization.gpu", "--format=csv,noheader,nounits",
                 "-lms", "100"],
                stdout=self.log, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
        self.log.close()

    def summary(self) -> dict[str, float]:
        log = Path(self.log.name)
        lines = log.read_text().splitlines()
        log.unlink(missing_ok=True)
        rows = []
        for line in lines:
            try:
                rows.append(tuple(float(v) for v in line.split(",")))
            except ValueError:
                continue
        rows = rows[5:]  # the first half second: clocks still settling
        if not rows:
            return {}
        return {"sm_clock_mhz": round(sum(r[0] for r in rows) / len(rows), 1),
                "power_w": round(sum(r[1] for r in rows) / len(rows), 1),
                "utilization_pct": round(sum(r[2] for r in rows) / len(rows), 1), "samples": len(rows)}


# caching-allocator counters (torch.cuda.memory_stats): cudaMalloc retries after freeing cached
# blocks, and the device-wide syncs they cost
ALLOC_COUNTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def spread(times: list[float]) -> dict[str, Any]:
    """How a do_bench timing's samples spread: a few slow ones (pauses) or all of them slow."""
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return {"n": len(times), "min_ms": round(min(times), 2), "p10_ms": round(q[0], 2), "p90_ms": round(q[-1], 2),
            "max_ms": round(max(times), 2)}


def kernel_kind(name: str) -> str:
    """GEMM, attention, solforge (its Triton kernels are named _<family>..._kernel) or other."""
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")):
        return "gemm"
    if any(k in n for k in ("flash", "fmha", "attention", "cudnn")):
        return "attention"
    if n.startswith("_") and "kernel" in n:
        return "solforge"
    return "other"


def steady_profile(step: Any, n: int = 2) -> dict[str, Any]:
    """Device time of `n` steps run back to back with no sync, as do_bench runs them, after three
    unprofiled steps queued the device ahead (torch.profiler, CUDA activity only): the kernels'
    summed time against the span from the first one's start to the last one's end, and the idle
    gaps between consecutive kernels by size. Small gaps are the device's own kernel-to-kernel
    latency. The profiler slows the host (it records every launch), so large gaps here can be its
    own doing: GpuSampler's utilization says whether the unprofiled timing left the device idle."""
    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    if not events:
        return {}
    edges = (2.0, 5.0, 20.0, 100.0, float("inf"))
    hist = {e: [0, 0.0] for e in edges}
    by_kind: dict[str, float] = {}
    other: dict[str, float] = {}
    big: list[tuple[float, str, str]] = []
    end, prev = events[0][0], ""
    for a, b, name in events:
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (b - a)
        if kind == "other":  # keyed by a shortened name, summed (two kernels may share it)
            short = name.replace("void ", "").replace("at::native::", "").replace("(anonymous namespace)::", "")[:140]
            other[short] = other.get(short, 0.0) + (b - a)
        if a > end:
            gap = a - end
            edge = next(e for e in edges if gap <= e)
            hist[edge][0] += 1
            hist[edge][1] += gap
            big.append((gap, prev, name))
        if b > end:
            end, prev = b, name
    span = end - events[0][0]
    big.sort(reverse=True)
    top_other = sorted(other.items(), key=lambda kv: -kv[1])[:8]
    return {"steps": n, "kernels_per_step": round(len(events) / n),
            "kernel_ms_per_step": round(sum(by_kind.values()) / n / 1e3, 2),
            "span_ms_per_step": round(span / n / 1e3, 2),
            "by_kind_ms_per_step": {k: round(v / n / 1e3, 2) for k, v in sorted(by_kind.items())},
            "top_other_ms_per_step": {k: round(v / n / 1e3, 2) for k, v in top_other},
            "gaps_per_step": {f"<={e:g}us" if e != float("inf") else ">100us":
                              {"count": round(c / n), "ms": round(t / n / 1e3, 2)} for e, (c, t) in hist.items()},
            "largest_gaps": [{"us": round(g, 1), "after": p[:80], "before": q[:80]} for g, p, q in big[:8]]}


def qwen3_variant(variant: str, batch: int, seq: int, budget: float, mode: str = "fwd",
                  weights: str | None = None, ids_path: str | None = None) -> dict[str, Any]:
    """One variant of the Qwen3-4B body, forward (mode fwd) or training step (mode train), in this
    process; with the state dict at `weights` and the token ids at `ids_path` when given
    (tools/train_bytes.py writes both), else seeded random weights and random ids."""
    from transformers import Qwen3ForCausalLM

    from solforge.zoo import zoo_config

    if variant.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    cfg = zoo_config("qwen3-4b")  # the published config, use_cache=False
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        # fp32: the same seeded weights, rounded to bf16 as every other variant has them, then
        # computed in fp32 (the accuracy reference for the argmax agreement)
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        if weights:
            model.load_state_dict(torch.load(weights, map_location="cuda"))
        if variant == "fp32":
            model = model.float()
    body = model.model.eval() if mode == "fwd" else model.model.train()
    if ids_path:
        ids = torch.load(ids_path).to("cuda")
        batch, seq = ids.shape
    else:
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    out: dict[str, Any] = {"variant": variant, "mode": mode, "batch": batch, "seq": seq,
                           "weights": weights or "seeded random", "ids": ids_path or "random"}
    t0 = time.time()
    if variant.startswith("solforge"):
        from solforge.api import optimize
        from solforge.runtime import traingraphs

        if variant == "solforge-judged":  # past the screen: the judgement on whole steps decides
            traingraphs.TRAIN_IDLE = float("-inf")

        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            f, rep = optimize(body, (ids,), budget=budget, is_language_model=False, inplace=False,
                              mode="inference" if mode == "fwd" else "train",
                              profile="on" if "-profile" in variant else "auto")
        out["optimize_s"] = round(time.time() - t0, 1)
        # best_us/speedup are the family kernel's; `won` says which kernel runs where a generated
        # alternative competed (its time: alternative_us)
        out["regions"] = [{"workload": r.workload, "count": r.count, "baseline_us": r.baseline_us,
                           "best_us": r.best_us, "speedup": r.speedup, "config": r.config, "won": r.won,
                           "alternative": r.alternative, "alternative_us": r.alternative_us,
                           "alternative_note": r.alternative_note} for r in rep.regions]
        out["validate"] = {"passed": rep.e2e.passed, "max_rel_err": rep.e2e.max_rel_err,
                           "grad_max_rel_err": rep.e2e.grad_max_rel_err, "note": rep.e2e.note} if rep.e2e else None
    elif variant.endswith("compile"):
        f = torch.compile(body)
    else:
        f = body
    if mode == "train":
        # BASELINES.md's training step: loss = mean of the squared last hidden state, fwd + bwd
        def step() -> None:
            f(ids).last_hidden_state.float().square().mean().backward()

        t1 = time.time()
        step()
        torch.cuda.synchronize()
        out["first_call_s"] = round(time.time() - t1, 1)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
        with GpuSampler() as gpu:
            times = sorted(__import__("triton").testing.do_bench(step, warmup=500, rep=2000, return_mode="all"))
        after = torch.cuda.memory_stats()
        out["train_step_ms"] = round(statistics.median(times), 2)
        out["peak_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
        stats = getattr(f, "solforge_stats", None)
        if stats is not None:  # whether the step replayed from CUDA graphs (traingraphs.py)
            out["step_graphs"] = [s.summary() for s in stats.step_graphs]
        out["during_do_bench"] = {**gpu.summary(), **spread(times)}
        out["allocator_during_do_bench"] = {k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_COUNTS}
        # the same step once more, nothing changed: whether a slow first timing is only transient
        times = sorted(__import__("triton").testing.do_bench(step, warmup=200, rep=2000, return_mode="all"))
        out["train_step_ms_again"] = round(statistics.median(times), 2)
        out["again_spread"] = spread(times)
        # the same step again after the caching allocator gave its free blocks back: a slower
        # first timing that this fixes was allocation retries (each frees cached blocks, a sync)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_stats()
        times = sorted(__import__("triton").testing.do_bench(step, warmup=200, rep=2000, return_mode="all"))
        after = torch.cuda.memory_stats()
        out["train_step_ms_after_empty_cache"] = round(statistics.median(times), 2)
        out["after_empty_cache"] = {**spread(times), **{k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_COUNTS}}
        if variant.startswith("solforge"):
            from solforge.integrate.linears import COUNTERS

            out["weight_grads"] = {"accumulated_in_gemm": COUNTERS.in_place, "handed_to_autograd": COUNTERS.handed_back}
        out["steady_profile"] = steady_profile(step)
        return out
    with torch.inference_mode():
        t1 = time.time()
        h = f(ids).last_hidden_state
        torch.cuda.synchronize()
        out["first_call_s"] = round(time.time() - t1, 1)
        if variant != "fp32":  # the accuracy reference is not timed: one call gives its argmax
            with GpuSampler() as gpu:
                times = sorted(__import__("triton").testing.do_bench(lambda: f(ids), warmup=300, rep=1500,
                                                                     return_mode="all"))
            out["fwd_ms"] = round(statistics.median(times), 2)
            out["during_do_bench"] = {**gpu.summary(), **spread(times)}
            out["steady_profile"] = steady_profile(lambda: f(ids))
        out["checksum"] = float(h.float().abs().mean())
        # next-token argmax through the (tied) lm_head, to compare every variant with eager
        logits = model.lm_head(h)
        top2 = logits.topk(2, dim=-1).values.float()
        torch.save({"argmax": logits.argmax(-1).cpu(), "margin": (top2[..., 0] - top2[..., 1]).cpu()},
                   f"/tmp/argmax_{variant}.pt")
    out["peak_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    return out


def run_one(cmd: list[str], timeout: float, what: dict[str, Any], env: dict[str, str] | None = None,
            tail: int = 3000) -> dict[str, Any]:
    """A variant run in its own process (`cmd`, a script's internal --one): the row its last
    "RESULT {json}" line printed, or `what` with the end of its stderr (or the timeout) as the error."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        proc = subprocess.CompletedProcess(cmd, -9, out, f"timed out after {timeout} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {**what, "error": proc.stderr[-tail:]}


def agreement(rows: list[dict[str, Any]]) -> None:
    """Each variant's argmax agreement with eager (and with the fp32 variant when it ran): all
    positions, and positions where the reference's top-1/top-2 logit margin exceeds a threshold
    (random weights give near-ties everywhere)."""
    for ref_name in ("eager", "fp32"):
        try:
            ref = torch.load(f"/tmp/argmax_{ref_name}.pt")
        except FileNotFoundError:
            continue
        for row in rows:
            try:
                other = torch.load(f"/tmp/argmax_{row['variant']}.pt")
            except FileNotFoundError:
                continue
            same = other["argmax"] == ref["argmax"]
            row[f"argmax_agree_vs_{ref_name}"] = round(float(same.float().mean()), 5)
            for m in (0.05, 0.1, 0.25):
                sel = ref["margin"] > m
                row[f"argmax_agree_vs_{ref_name}_margin_gt_{m}"] = round(float(same[sel].float().mean()), 5)
                row[f"positions_{ref_name}_margin_gt_{m}"] = round(float(sel.float().mean()), 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="rmsnorm,qwen3")
    p.add_argument("--shapes", default=",".join(f"{r}x{h}" for r, h in RMSNORM_SHAPES),
                   help="rmsnorm shapes, ROWSxH,... (default: BASELINES.md's)")
    p.add_argument("--variants", default="eager,compile,liger,solforge")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--budget", type=float, default=180.0, help="solforge tuning budget for qwen3 (s)")
    p.add_argument("--out", default=None)
    p.add_argument("--variant-timeout", type=float, default=1800.0, help="seconds allowed to each qwen3 variant")
    p.add_argument("--weights", default=None,
                   help="qwen3: a Qwen3-4B state dict to load (tools/train_bytes.py) instead of random weights")
    p.add_argument("--ids", default=None, help="qwen3: token ids to run (a saved tensor) instead of random ones")
    p.add_argument("--mode", default="fwd", help=argparse.SUPPRESS)  # internal, with --one
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one qwen3 variant
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/e2e.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.one:
        row = qwen3_variant(a.one, a.batch, a.seq, a.budget, a.mode, a.weights, a.ids)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    result: dict[str, Any] = provenance()
    what = a.what.split(",")
    if "rmsnorm" in what:
        shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
        result["rmsnorm"] = rmsnorm_rows(shapes)  # type: ignore[arg-type]
    for mode, key, batch, seq in (("fwd", "qwen3", a.batch, a.seq), ("train", "qwen3train", 1, 4096)):
        if key not in what:
            continue
        rows: list[dict[str, Any]] = []
        result["qwen3_4b_fwd" if mode == "fwd" else "qwen3_4b_train"] = rows
        for v in a.variants.split(","):
            if v.startswith("liger") and result["versions"]["liger_kernel"] == "not installed":
                continue
            cmd = [sys.executable, __file__, "--one", v, "--batch", str(batch), "--seq", str(seq),
                   "--budget", str(a.budget), "--mode", mode]
            for flag, value in (("--weights", a.weights), ("--ids", a.ids)):
                if value and mode == "fwd":
                    cmd += [flag, value]
            env = {**os.environ, **ENV_VARIANTS.get(v, {})}
            row = run_one(cmd, a.variant_timeout, {"variant": v}, env=env, tail=2000)
            print(json.dumps(row), flush=True)
            rows.append(row)
        if mode == "fwd":
            agreement(rows)
    write_json(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
