"""A benchmark suite to rerun: KernelBench's problems and 15 architectures, eager vs torch.compile vs solforge.

    python bench/suite.py [--kernelbench PATH] [--levels 1,2,3] [--problems GLOB] [--skip-gemm-bound]
                          [--archs NAME,...|all] [--arch-modes fwd,train] [--variants eager,compile,solforge]
                          [--max-autotune] [--budget 20] [--timeout 300] [--profile]
                          [--out bench/results/suite.jsonl] [--resume] [--stop-after SECONDS] [--gpus 0,1,...]
    python bench/suite.py --table docs/results/suite.md [--out bench/results/suite.jsonl]

KernelBench (--kernelbench PATH, a checkout with level1/ level2/ level3/; default ../shared/kernelbench
beside the repository when it exists): every problem file of the chosen levels whose name matches
--problems, at its official sizes and dtype (fp32, unless the file names a torch dtype in a global
`dtype` or `precision`; --dtype overrides). --skip-gemm-bound leaves out the problems that
bench/kernelbench_gemm_bound.json lists (a list of names with the reason for each: GEMM/conv stacks
and recurrent nets, where the time is in cuBLAS/cuDNN and fusion has little to take); each skipped
problem is a row of the results with its reason. Models run in eval mode (KernelBench's Model is
left in train mode: its BatchNorms would use batch statistics and its dropouts draw).

Architectures (--archs, bench/suite_archs.py): transformers decoders, encoders and timm vision models
with seeded random bf16 weights and layers cut to a stated number; the forward of each, and a
training step (loss = mean of squares of the last hidden state) for four decoders (suite_archs.TRAIN).

Every problem (or architecture and mode) x variant runs in a process of its own with a wall-clock
limit (--timeout; max-autotune: --autotune-timeout): a crash or a hang is a row with its error, and
the suite goes on. Each process builds the model and inputs from the same seeds, computes eager's
output itself, builds its variant (eager; torch.compile's default mode; with --max-autotune also
mode "max-autotune"; solforge.optimize with --budget seconds of tuning) and records:
- `us`: the median of triton's do_bench (L2 flushed between calls), one call (training: one step);
- `err`: max |out - eager| / max |eager| over the outputs (training: the loss and every
  parameter's gradient, the worst), `max_abs_err`, and `allclose` at the dtype's tolerance
  (KernelBench's: 1e-4 for fp32, 1e-2 for bf16/fp16, as atol and rtol);
- `peak_MiB`: torch.cuda.max_memory_allocated over two calls, reset after the first (the timing's
  L2-flush buffer is not in it); `first_call_s`: compile/capture and the first run;
- with --profile, `kernel_us_sum` and the top kernels a call (torch.profiler);
- solforge's regions (family, or "generated" for kernels codegen wrote), whether each went in,
  its notes, end-to-end check and `returned` verdict where the report has one.
Rows are appended to --out (JSON lines) as each one finishes; --resume skips those already there
(--retry-errors runs the errored ones again). --stop-after S starts no row after S seconds and cuts
running rows' limits to end by then (a row cut short that way is not written: resume runs it
again), to fit a run in pieces into device calls of fixed length. --gpus runs one row per GPU at a
time (CUDA_VISIBLE_DEVICES), for an 8-GPU machine to run the suite 8 times faster.

--table OUT.md renders --out as markdown (bench/suite_table.py): every row, per-level geomeans,
wins, losses and errors, problems where solforge matched nothing.

`--device cpu --tiny` is a smoke test of this script: 2 problems a level with every integer global of
the problem file above 16 cut to 16, and 3 architectures at hidden 64 and 2 layers, through
Triton's interpreter; its times mean nothing.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors need it

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SKIPS = HERE / "kernelbench_gemm_bound.json"
# $KERNELBENCH, else a checkout beside the repository (../shared/kernelbench), else inside it
DEFAULT_KERNELBENCH = next((p for p in (Path(os.environ.get("KERNELBENCH", "/nonexistent")),
                                        REPO.parent / "shared" / "kernelbench", REPO / "shared" / "kernelbench")
                            if p.is_dir()), REPO.parent / "shared" / "kernelbench")
VARIANTS = ("eager", "compile", "compile-max-autotune", "solforge")
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}  # KernelBench's (atol = rtol), by dtype
TINY_INT = 16  # --tiny: integer globals of a problem file above this become this
TINY_PROBLEMS = {1: ("19_ReLU", "23_Softmax"), 2: ("76_Gemm_Add_ReLU", "99_Matmul_GELU_Softmax"),
                 3: ("31_VisionAttention", "46_NetVladWithGhostClusters")}
MIN_ROW_S = 15.0  # --stop-after: no row is started with less time than this left


@dataclass(frozen=True)
class Task:
    """One row to measure: a KernelBench problem's or an architecture's variant."""

    suite: str  # "kernelbench" | "arch"
    problem: str  # the problem file's stem, or the architecture's name
    variant: str
    level: int = 0  # kernelbench
    path: str = ""  # kernelbench: the problem file
    mode: str = "fwd"  # fwd | train

    @property
    def key(self) -> str:
        return f"{self.suite}/{self.level or '-'}/{self.problem}/{self.mode}/{self.variant}"


def _number(stem: str) -> int:
    m = re.match(r"(\d+)_", stem)
    return int(m.group(1)) if m else 10**6


def gemm_bound() -> dict[str, dict[str, str]]:
    """bench/kernelbench_gemm_bound.json: level -> {problem: why it is left out}."""
    data = json.loads(SKIPS.read_text())
    return {k: v for k, v in data.items() if k.startswith("level")}


def list_problems(root: Path, levels: list[int], pattern: str, skip_gemm_bound: bool,
                  tiny: bool = False) -> tuple[list[tuple[int, Path]], list[dict[str, Any]]]:
    """The problem files to run, in level and number order, and the skipped ones as rows."""
    skips = gemm_bound() if skip_gemm_bound else {}
    run: list[tuple[int, Path]] = []
    skipped: list[dict[str, Any]] = []
    for level in levels:
        folder = root / f"level{level}"
        if not folder.is_dir():
            raise SystemExit(f"{folder} is not a folder: --kernelbench must name a KernelBench checkout "
                             "(with level1/ level2/ level3/)")
        files = sorted(folder.glob("*.py"), key=lambda f: (_number(f.stem), f.stem))
        if tiny and pattern == "*":
            files = [f for f in files if f.stem in TINY_PROBLEMS.get(level, ())]
        for f in files:
            if not any(fnmatch.fnmatch(f.stem, g) or fnmatch.fnmatch(f"level{level}/{f.stem}", g)
                       for g in pattern.split(",")):
                continue
            reason = skips.get(f"level{level}", {}).get(f.stem)
            if reason:
                skipped.append({"suite": "kernelbench", "level": level, "problem": f.stem, "variant": "-",
                                "mode": "fwd", "key": f"kernelbench/{level}/{f.stem}/fwd/-",
                                "skipped": f"GEMM/conv-bound: {reason}"})
            else:
                run.append((level, f))
    return run, skipped


# ----------------------------------------------------------------------------------------------
# one row, in its own process


def _tensors(x: Any) -> list[Any]:
    from solforge.validate import flatten_tensors

    return [t for _, t in flatten_tensors(x)]


CHUNK = 1 << 26  # compare() works through a tensor this many elements at a time (fp32 copies stay small)


def compare(out: Any, ref: Any, tol: float) -> dict[str, Any]:
    """max |out - ref| / max |ref| over all the output tensors together (`err`), max |out - ref|
    and allclose(atol = rtol = tol) over them all; with several tensors (a training step: the loss
    and every gradient) also the worst tensor's own max |out - ref| / max |ref|
    (`err_worst_tensor`: a tiny gradient's rounding can make it large). Equal values (infinities
    too) and NaN in both agree; a NaN in one only is infinitely off. Large outputs are compared in
    chunks: KernelBench's largest are several GB, and fp32 temporaries of their size would not fit
    beside them."""
    import torch

    worst, worst_abs, top, close = 0.0, 0.0, 0.0, True
    outs, refs = _tensors(out), _tensors(ref)
    if len(outs) != len(refs):
        return {"err": None, "allclose": False, "compare_note": f"{len(outs)} outputs, eager has {len(refs)}"}
    for o, r in zip(outs, refs, strict=True):
        if o.shape != r.shape:
            return {"err": None, "allclose": False, "compare_note": f"shape {tuple(o.shape)} vs {tuple(r.shape)}"}
        if not (o.is_floating_point() or o.is_complex()):
            same = bool(torch.equal(o, r))
            close &= same
            worst = max(worst, 0.0 if same else 1.0)
            continue
        of, rf = o.detach().reshape(-1), r.detach().reshape(-1)
        d, scale = 0.0, 0.0
        for i in range(0, of.numel(), CHUNK):
            o32, r32 = of[i:i + CHUNK].float(), rf[i:i + CHUNK].float()
            diff = torch.where((o32 == r32) | (o32.isnan() & r32.isnan()), 0.0, (o32 - r32).abs())
            d = max(d, diff.nan_to_num(float("inf")).max().item())
            scale = max(scale, r32.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max().item())
            close &= bool(torch.allclose(o32, r32, atol=tol, rtol=tol, equal_nan=True))
        worst_abs = max(worst_abs, d)
        top = max(top, scale)
        worst = max(worst, d / (scale or 1.0))
    row = {"err": float(f"{worst_abs / (top or 1.0):.3g}"), "max_abs_err": float(f"{worst_abs:.3g}"),
           "allclose": close}
    if len(outs) > 1:
        row["err_worst_tensor"] = float(f"{worst:.3g}")
    return row


def _shrink(module: Any) -> None:
    """--tiny: every integer global of a problem file above TINY_INT becomes TINY_INT, in tuples
    and lists too (sizes and shapes, so get_inputs and get_init_inputs make small tensors; small
    counts such as kernel sizes stay)."""
    def small(v: Any) -> Any:
        if type(v) is int:
            return min(v, TINY_INT)
        if isinstance(v, tuple | list) and all(type(x) is int for x in v):
            return type(v)(min(x, TINY_INT) for x in v)
        return v

    for k, v in list(vars(module).items()):
        if not k.startswith("_"):
            setattr(module, k, small(v))


def _official_dtype(module: Any) -> str:
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    for k in ("dtype", "precision"):
        v = getattr(module, k, None)
        if isinstance(v, torch.dtype) and v in names:
            return names[v]
        if isinstance(v, str) and v in TOLERANCE:
            return v
    return "fp32"


def load_problem(path: str, device: str, dtype: str | None, tiny: bool) -> tuple[Any, tuple[Any, ...], str]:
    """A KernelBench file's Model(*get_init_inputs()) and get_inputs(), seeded, made on `device`
    (no host copy of large inputs), floating tensors cast to the dtype; eval mode."""
    import torch

    from solforge.zoo.base import module_to_target, seeded, to_target
    from solforge.zoo.loaders import import_file

    module = import_file(path)
    if tiny:
        _shrink(module)
    dt = dtype or _official_dtype(module)
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    dev = torch.device(device)
    with seeded(0, dev), dev:
        model = module.Model(*module.get_init_inputs())
    model = module_to_target(model, dev, tdt)
    with seeded(1, dev), dev:
        raw = module.get_inputs()
    inputs = to_target(tuple(raw) if isinstance(raw, list | tuple) else (raw,), dev, tdt)
    return model, inputs, dt


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def measure(call: Any, device: str, profile: bool) -> dict[str, Any]:
    """Peak memory over two calls (after a first), do_bench's median, and the kernels a call."""
    import torch
    from e2e import bench_us

    row: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        call()
        call()
        torch.cuda.synchronize()
        row["peak_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        row["us"] = round(bench_us(call), 2)
        if profile:
            from kernelbench import kernels_per_call

            k = kernels_per_call(call)
            row["kernel_us_sum"] = k["kernel_us_sum"]
            row["kernels"] = k["kernels"][:12]
    else:  # the interpreter: one call's wall clock, a number that means nothing
        t = time.perf_counter()
        call()
        row["us"] = round((time.perf_counter() - t) * 1e6, 1)
    return row


def _solforge_fields(extra: dict[str, Any]) -> dict[str, Any]:
    regions = extra.get("regions") or []
    fams = sorted({r.get("family") or "?" for r in regions})
    out = {"regions": regions, "families": fams,
           "integrated": sum(1 for r in regions if r.get("integrated", r.get("verified"))),
           "notes": extra.get("notes"), "e2e": extra.get("e2e")}
    if "returned" in extra:
        out["returned"] = extra["returned"]
    return out


def kernelbench_row(task: Task, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    from kernelbench import build_variant

    device = opts["device"]
    row: dict[str, Any] = {}
    model, inputs, dt = load_problem(task.path, device, opts.get("dtype"), opts["tiny"])
    tol = TOLERANCE[dt]
    row.update(dtype=dt, atol=tol, rtol=tol, shapes=[list(t.shape) for t in inputs if isinstance(t, torch.Tensor)])
    with torch.no_grad():
        ref = model(*inputs)
        t0 = time.perf_counter()
        fn, extra = build_variant(task.variant, model, inputs, budget=opts["budget"], label=task.problem,
                                  max_candidates=2 if opts["tiny"] else None)
        out = fn(*inputs)
        _sync(device)
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        row.update(compare(out, ref, tol))
        del out
        row.update(measure(lambda: fn(*inputs), device, opts["profile"]))
    if task.variant == "solforge":
        row.update(_solforge_fields(extra))
    return row


def arch_row(task: Task, opts: dict[str, Any]) -> dict[str, Any]:
    import suite_archs as sa
    import torch

    device, tiny = opts["device"], opts["tiny"]
    model, inputs = sa.build(task.problem, tiny, device, task.mode)
    spec = sa.SPECS[task.problem]
    tol = TOLERANCE["bf16"]
    batch, seq = sa.shape(task.problem, tiny, task.mode)
    row: dict[str, Any] = {"dtype": "bf16", "atol": tol, "rtol": tol, "batch": batch, "seq": seq,
                           "layers": sa.TINY_LAYERS if tiny and spec.source != "timm" else spec.layers or None,
                           "kind": spec.kind, "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    lm = dict(budget=opts["budget"], label=task.problem, max_candidates=2 if tiny else None)
    t0 = time.perf_counter()
    if task.mode == "fwd":
        model.eval()
        with torch.no_grad():
            ref = sa.hidden(model(*inputs))
            fn, extra = _build_arch(task.variant, model, inputs, lm, train=False)
            out = sa.hidden(fn(*inputs))
            _sync(device)
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            row.update(compare(out, ref, tol))
            del out
            row.update(measure(lambda: fn(*inputs), device, opts["profile"]))
    else:
        model.train()
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        loss_ref = sa.loss_of(model(*inputs))
        loss_ref.backward()
        grads_ref = [p.grad.detach().clone() if p.grad is not None else None for _, p in params]
        model.zero_grad(set_to_none=True)
        fn, extra = _build_arch(task.variant, model, inputs, lm, train=True)
        model.zero_grad(set_to_none=True)
        loss = sa.loss_of(fn(*inputs))
        loss.backward()
        _sync(device)
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        grads = [p.grad for _, p in params]
        row.update(compare([loss.detach(), *[g for g in grads if g is not None]],
                           [loss_ref.detach(), *[g for g, h in zip(grads_ref, grads, strict=True) if h is not None]],
                           tol))
        missing = sum(1 for g, h in zip(grads_ref, grads, strict=True) if (g is None) != (h is None))
        if missing:
            row["compare_note"] = f"{missing} parameter(s) got a gradient in one run and none in the other"
        del grads_ref, grads

        def step() -> None:
            sa.loss_of(fn(*inputs)).backward()

        row.update(measure(step, device, opts["profile"]))
    if task.variant == "solforge":
        row.update(_solforge_fields(extra))
    return row


def _build_arch(variant: str, model: Any, inputs: tuple[Any, ...], kw: dict[str, Any],
                train: bool) -> tuple[Any, dict[str, Any]]:
    import torch

    if variant != "solforge":
        from kernelbench import build_variant

        return build_variant(variant, model, inputs, **kw)
    import solforge
    from solforge.records import to_dict

    # archs.py's call: the body is no language model (no lm_head), mode by the row
    with torch.enable_grad() if train else torch.no_grad():
        fn, report = solforge.optimize(model, inputs, budget=kw["budget"], name=kw["label"],
                                       max_candidates=kw["max_candidates"], is_language_model=False,
                                       mode="train" if train else "inference")
    rep = to_dict(report)
    keys = ("family", "workload", "count", "baseline_us", "best_us", "speedup", "verified", "max_rel_err",
            "source", "integrated", "note", "won", "alternative_us")  # won: which kernel runs (alternatives)
    extra: dict[str, Any] = {"regions": [{k: r.get(k) for k in keys} for r in rep["regions"]],
                             "notes": rep["notes"], "e2e": rep["e2e"]}
    returned = rep.get("returned", rep.get("extra", {}).get("returned"))
    if returned is not None:
        extra["returned"] = returned
    return fn, extra


def one(task: Task, opts: dict[str, Any]) -> dict[str, Any]:
    """The row of one task, measured in this process."""
    row = {**_ident(task)}
    if opts["device"] == "cuda":
        import torch

        row["device"] = torch.cuda.get_device_name(0)
    row.update(kernelbench_row(task, opts) if task.suite == "kernelbench" else arch_row(task, opts))
    return row


def _ident(task: Task) -> dict[str, Any]:
    row: dict[str, Any] = {"suite": task.suite, "problem": task.problem, "variant": task.variant, "mode": task.mode,
                           "key": task.key}
    if task.suite == "kernelbench":
        row["level"] = task.level
    return row


# ----------------------------------------------------------------------------------------------
# the suite: processes, limits, the results file


def run_isolated(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[int | None, str, str]:
    """Run `cmd` in a session of its own with output to files (not pipes: a compile worker it left
    behind cannot hold them open); past `timeout` seconds the whole process group is killed.
    Returns (exit code or None on timeout, stdout, stderr)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True, text=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        try:  # the group: the child if it hangs, and whatever it started (compile workers, tuners)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read()


def run_task(task: Task, opts: dict[str, Any], timeout: float, gpu: str | None) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", opts["device"],
           "--one", json.dumps({"task": asdict(task), "opts": opts})]
    env = dict(os.environ)
    if opts["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    t0 = time.monotonic()
    rc, out, err = run_isolated(cmd, timeout, env)
    wall = round(time.monotonic() - t0, 1)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if lines:
        row = json.loads(lines[-1][len("RESULT "):])
    else:
        why = (f"timed out after {timeout:.0f} s" if rc is None else
               f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}")
        tail = err.strip()[-1500:]
        if rc is None:  # the error says so; what it printed last goes beside it
            row = {**_ident(task), "error": why, "timed_out": True, "stderr_tail": tail}
        else:
            row = {**_ident(task), "error": f"{why}: {tail}" if tail else why}
    row["wall_s"] = wall
    if gpu is not None:
        row["gpu"] = gpu
    return row


def rows_by_device(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{device name: {key: row}}: a row's device is its own field, or the one of the meta row
    (written at each run's start) before it."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    device = "unknown"
    for r in rows:
        if r.get("suite") == "meta":
            device = r.get("device", "unknown")
        elif "key" in r:
            out.setdefault(r.get("device", device), {})[r["key"]] = r
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a results file; a line cut short by a killed run is left out."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def append_row(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_suite(tasks: list[Task], opts: dict[str, Any], out: Path, *, timeouts: dict[str, float],
              stop_after: float | None, gpus: list[str | None]) -> dict[str, int]:
    """Run `tasks`, one process each, `len(gpus)` at a time, appending each row to `out` as it ends."""
    queue = deque(tasks)
    lock = threading.Lock()
    end = time.monotonic() + stop_after if stop_after is not None else None
    counts = {"written": 0, "errors": 0, "deferred": 0, "not_started": 0}

    def worker(gpu: str | None) -> None:
        while True:
            with lock:
                if not queue:
                    return
                if end is not None and end - time.monotonic() < MIN_ROW_S:
                    counts["not_started"] += len(queue)
                    queue.clear()
                    return
                task = queue.popleft()
            limit = timeouts.get(task.variant, timeouts["default"])
            cut = end is not None and end - time.monotonic() < limit
            if cut and end is not None:
                limit = end - time.monotonic()
            row = run_task(task, opts, limit, gpu)
            with lock:
                if cut and row.get("timed_out"):  # stopped by --stop-after, not by its own limit
                    counts["deferred"] += 1
                    print(f"[suite] {task.key}: cut by --stop-after, left for --resume", flush=True)
                    continue
                if opts.get("commit"):  # each row its commit: files are merged across runs
                    row.setdefault("commit", opts["commit"])
                append_row(out, row)
                counts["written"] += 1
                counts["errors"] += bool(row.get("error"))
                shown = {k: row.get(k) for k in ("key", "us", "err", "allclose", "peak_MiB", "wall_s")}
                if row.get("error"):
                    lines = row["error"].strip().splitlines() or [""]
                    shown["error"] = (lines[0] if row.get("timed_out") else lines[-1])[:160]
                print("[suite] " + json.dumps(shown), flush=True)

    threads = [threading.Thread(target=worker, args=(g,), daemon=True) for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def _variants(a: argparse.Namespace) -> list[str]:
    names = [v for v in a.variants.split(",") if v]
    if a.max_autotune and "compile-max-autotune" not in names:
        names.insert(names.index("compile") + 1 if "compile" in names else len(names), "compile-max-autotune")
    return names


def plan(a: argparse.Namespace) -> tuple[list[Task], list[dict[str, Any]]]:
    """Every task of the run, in order, and the rows of skipped problems and architectures."""
    import suite_archs as sa

    variants = _variants(a)
    tasks: list[Task] = []
    skipped: list[dict[str, Any]] = []
    if a.levels:
        root = Path(a.kernelbench)
        levels = [int(x) for x in a.levels.split(",") if x]
        problems, skipped = list_problems(root, levels, a.problems, a.skip_gemm_bound, tiny=a.tiny)
        for level, f in problems:
            tasks += [Task("kernelbench", f.stem, v, level=level, path=str(f)) for v in variants]
    if a.archs:
        names = (list(sa.TINY_DEFAULT) if a.tiny else list(sa.SPECS)) if a.archs == "all" else a.archs.split(",")
        modes = a.arch_modes.split(",")
        for name in names:
            if sa.SPECS[name].source == "timm" and not sa.timm_available():
                skipped.append({"suite": "arch", "problem": name, "variant": "-", "mode": "fwd",
                                "key": f"arch/-/{name}/fwd/-", "skipped": "timm is not installed here"})
                continue
            for mode in modes:
                if mode == "train" and name not in sa.TRAIN:
                    continue
                tasks += [Task("arch", name, v, mode=mode) for v in variants]
    return tasks, skipped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernelbench", default=str(DEFAULT_KERNELBENCH),
                   help="a KernelBench checkout (level1/ level2/ level3/); default: $KERNELBENCH or "
                   "../shared/kernelbench")
    p.add_argument("--levels", default="", help="KernelBench levels to run, e.g. 1,2,3 (none: no KernelBench)")
    p.add_argument("--problems", default="*",
                   help="globs over problem names (19_ReLU, level1/19_ReLU), comma-separated")
    p.add_argument("--skip-gemm-bound", action="store_true",
                   help="leave out the problems bench/kernelbench_gemm_bound.json lists (rows say why)")
    p.add_argument("--archs", default="", help="architectures (bench/suite_archs.py), comma-separated, or all")
    p.add_argument("--arch-modes", default="fwd,train", help="fwd, train (train: suite_archs.TRAIN only)")
    p.add_argument("--variants", default="eager,compile,solforge", help=f"of: {', '.join(VARIANTS)}")
    p.add_argument("--max-autotune", action="store_true", help="also torch.compile(mode='max-autotune')")
    p.add_argument("--dtype", default=None, choices=tuple(TOLERANCE), help="override the problems' dtype")
    p.add_argument("--budget", type=float, default=20.0, help="solforge's tuning budget a row (s)")
    p.add_argument("--timeout", type=float, default=300.0, help="wall-clock limit of a row's process (s)")
    p.add_argument("--autotune-timeout", type=float, default=420.0, help="the same for compile-max-autotune")
    p.add_argument("--profile", action="store_true", help="also each row's CUDA kernels a call (torch.profiler)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="smoke test: tiny sizes, 2 problems a level, 3 archs")
    p.add_argument("--out", default=str(HERE / "results" / "suite.jsonl"), help="the results file (JSON lines)")
    p.add_argument("--resume", action="store_true", help="skip rows --out already has")
    p.add_argument("--retry-errors", action="store_true", help="with --resume: run errored rows again")
    p.add_argument("--stop-after", type=float, default=None, help="start no row after this many seconds")
    p.add_argument("--gpus", default="", help="GPU indices to run rows on side by side, e.g. 0,1,2,3")
    p.add_argument("--list", action="store_true", help="print the rows the run would measure, and stop")
    p.add_argument("--table", default=None, help="render --out as markdown into this file, and stop")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one task in this process
    a = p.parse_args()
    sys.path.insert(0, str(HERE))
    if a.one:
        spec = json.loads(a.one)
        print("RESULT " + json.dumps(one(Task(**spec["task"]), spec["opts"])), flush=True)
        return 0
    out = Path(a.out)
    if a.table:
        from suite_table import render

        Path(a.table).parent.mkdir(parents=True, exist_ok=True)
        Path(a.table).write_text(render(read_rows(out), source=str(out)))
        print(f"wrote {a.table}")
        return 0
    unknown = [v for v in _variants(a) if v not in VARIANTS]
    import suite_archs as sa

    if a.archs and a.archs != "all":
        unknown += [x for x in a.archs.split(",") if x not in sa.SPECS]
    if unknown:
        print(f"unknown variant(s) or architecture(s): {', '.join(unknown)}; architectures: {', '.join(sa.SPECS)}",
              file=sys.stderr)
        return 2
    if not a.levels and not a.archs:
        print("nothing to run: pass --levels (KernelBench) and/or --archs", file=sys.stderr)
        return 2
    if a.levels and not Path(a.kernelbench).is_dir():
        print(f"no KernelBench checkout at {a.kernelbench}: pass --kernelbench PATH", file=sys.stderr)
        return 2
    tasks, skipped = plan(a)
    if a.list:
        for s in skipped:
            print(f"skip {s['key']}: {s['skipped']}")
        for t in tasks:
            print(t.key)
        print(f"{len(tasks)} rows, {len(skipped)} skipped")
        return 0
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench/suite.py needs a CUDA GPU (or --device cpu --tiny for a smoke run)", file=sys.stderr)
            return 2
    done = {}
    if a.resume:
        # rows of another GPU model are no use beside this one's: numbers compare within one machine
        here = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
        done = {k: r for k, r in rows_by_device(read_rows(out)).get(here, {}).items()}
        if a.retry_errors:
            done = {k: r for k, r in done.items() if not r.get("error")}
    todo = [t for t in tasks if t.key not in done]
    if not todo and all(s["key"] in done for s in skipped):
        print(f"[suite] 0 of {len(tasks)} rows to run (all already in {out})", flush=True)
        return 0
    from e2e import provenance

    meta = {"suite": "meta", "key": f"meta/{time.time():.0f}", **provenance(), "kernelbench": a.kernelbench,
            "budget_s": a.budget, "timeout_s": a.timeout, "tiny": a.tiny, "rows_planned": len(tasks),
            "rows_to_run": len(todo), "skipped": len(skipped)}
    if a.device != "cuda":  # the rows' device (what --resume matches), not the machine's GPU
        meta["device"] = "cpu"
    append_row(out, meta)
    for s in skipped:
        if s["key"] not in done:
            append_row(out, s)
            print(f"[suite] skip {s['key']}: {s['skipped']}", flush=True)
    opts = {"device": a.device, "tiny": a.tiny, "budget": a.budget, "dtype": a.dtype, "profile": a.profile,
            "commit": meta.get("commit")}
    timeouts = {"default": a.timeout, "compile-max-autotune": a.autotune_timeout}
    gpus: list[str | None] = [g for g in a.gpus.split(",") if g] or [None]
    print(f"[suite] {len(todo)} of {len(tasks)} rows to run ({len(tasks) - len(todo)} already in {out})", flush=True)
    counts = run_suite(todo, opts, out, timeouts=timeouts, stop_after=a.stop_after, gpus=gpus)
    left = counts["deferred"] + counts["not_started"]
    print(f"[suite] wrote {counts['written']} rows ({counts['errors']} with an error) to {out}; "
          f"{left} left for --resume", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
