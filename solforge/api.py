"""Public entry points. `optimize()` runs capture -> plan -> tune -> integrate -> validate -> report."""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import inspect
import platform
import sys
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from solforge import capture as _capture
from solforge import plan as _plan
from solforge import settings
from solforge.errors import UserError
from solforge.integrate import Integrator, config_text, integrate_captured
from solforge.kernels import registry
from solforge.numerics import dtype_name
from solforge.records import E2EReport, Profile, RegionReport, Report, RunResult, TuneResult, TuningRecord
from solforge.report import TRACE_BASELINE, TRACE_OPTIMIZED, ensure_writable, write_report
from solforge.runtime.stepgraphs import settled_since_now
from solforge.tune import candidates, tune
from solforge.tune.timing import time_kernel
from solforge.validate import validate

if TYPE_CHECKING:
    from solforge.db import KernelDB

MODES = ("inference", "train")


class Reporter(Protocol):
    """What optimize() tells the outside world as it goes (the CLI draws progress bars with it)."""

    def stage(self, name: str, detail: str = "") -> None: ...
    def tune_start(self, workload_key: str, n_candidates: int) -> None: ...
    def tune_step(self, record: TuningRecord) -> None: ...
    def tune_end(self, result: TuneResult) -> None: ...


class _Timed:
    """Passes every call on to a Reporter and keeps the wall seconds of each stage (report.json's
    `extra.stage_seconds`: what a cold and a warm run spend where)."""

    def __init__(self, inner: Reporter) -> None:
        self.inner = inner
        self.seconds: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def stage(self, name: str, detail: str = "") -> None:
        self.stop()
        self._current = (name, time.perf_counter())
        self.inner.stage(name, detail)

    def stop(self) -> None:
        if self._current is not None:
            name, t = self._current
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - t, 3)
            self._current = None

    def tune_start(self, workload_key: str, n_candidates: int) -> None:
        self.inner.tune_start(workload_key, n_candidates)

    def tune_step(self, record: TuningRecord) -> None:
        self.inner.tune_step(record)

    def tune_end(self, result: TuneResult) -> None:
        self.inner.tune_end(result)


class _Silent:
    def stage(self, name: str, detail: str = "") -> None: ...
    def tune_start(self, workload_key: str, n_candidates: int) -> None: ...
    def tune_step(self, record: TuningRecord) -> None: ...
    def tune_end(self, result: TuneResult) -> None: ...


def versions(device: str) -> dict[str, str]:
    import triton

    v = {"solforge": _version(), "python": platform.python_version(), "torch": torch.__version__,
         "triton": triton.__version__}
    try:
        import transformers

        v["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        v |= {"gpu": p.name, "compute_capability": f"{p.major}.{p.minor}", "cuda": str(torch.version.cuda)}
    return v


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("solforge")
    except PackageNotFoundError:
        return "unknown"


def check_device(device: str) -> str:
    """'cuda' or 'cpu', or a UserError saying what to do (one check for loaders and optimize)."""
    from solforge.zoo.base import resolve_device

    return resolve_device(device).type


def _model_device(model: torch.nn.Module, inputs: Sequence[Any]) -> str:
    for t in list(model.parameters())[:1] + [x for x in inputs if isinstance(x, torch.Tensor)][:1]:
        return t.device.type
    return "cpu"


def _model_dtype(model: torch.nn.Module, inputs: Sequence[Any]) -> torch.dtype:
    for t in [*model.parameters(), *[x for x in inputs if isinstance(x, torch.Tensor)]]:
        if t.dtype.is_floating_point:
            return t.dtype
    return torch.float32


def host_time(step_graphs: Sequence[Any]) -> str:
    """What the graphs' timed calls (stepgraphs.py: host time to enqueue a call against its GPU
    time) say about a slow end-to-end result."""
    timed = [s for s in step_graphs if s.host_s is not None and s.gpu_s is not None]
    if not timed:
        return "a step this small may be bound by the host's launches"
    host, gpu = sum(s.host_s for s in timed) * 1e6, sum(s.gpu_s for s in timed) * 1e6
    bound = ": bound by the host" if host >= gpu else ""
    return f"its timed call took {host:.0f} us of host time for {gpu:.0f} us on the GPU{bound}"


def _check_trainable(model: torch.nn.Module, inputs: Sequence[Any]) -> None:
    """--mode train differentiates the outputs with respect to the parameters and the inputs that
    require grad: with neither (a KernelBench operator: no parameters, plain input tensors) there
    is no backward to optimize or check. Said before any tuning, not after it (validate's loss)."""
    from solforge.validate import flatten_tensors

    if any(p.requires_grad for p in model.parameters()):
        return
    if any(t.requires_grad for _, t in flatten_tensors(tuple(inputs))):
        return
    raise UserError("--mode train: the model has no parameter that requires grad and no example input that "
                    "does, so there is no backward to optimize; use --mode inference (or, from Python, pass "
                    "inputs with requires_grad=True)")


def _baseline(group: _plan.WorkloadGroup, device: str) -> RunResult:
    """Time the region exactly as the model ran it (the extracted ATen subgraph); for a backward
    group, eager autograd's backward of that subgraph."""
    assert group.example is not None
    sub, metas = _plan.extract(group.example[1])
    gen = torch.Generator(device="cpu").manual_seed(0)
    # integer inputs (cross-entropy targets, indices) as 0/1: valid for any class count or size
    args = [torch.randn(tuple(m.shape), generator=gen, dtype=torch.float32).to(device=device, dtype=m.dtype)
            if m.dtype.is_floating_point else
            torch.randint(0, 2, tuple(m.shape), generator=gen).to(device=device, dtype=m.dtype) for m in metas]
    if group.forward is not None:
        return _backward_baseline(group, sub, args, gen, device)
    # a family whose kernel also computes its region's gradients (linear_cross_entropy) names the
    # inputs they are for: its region is then timed with their backward, as the kernel is
    wants = registry.baseline_grads(group.workload.family, group.workload)
    if wants:
        leaves = [args[i].requires_grad_(True) for i in wants]
        return time_kernel(lambda: torch.autograd.grad(sub(*args), leaves), device)
    with torch.no_grad():
        return time_kernel(lambda: sub(*args), device)


def _backward_baseline(group: _plan.WorkloadGroup, sub: torch.fx.GraphModule, args: list[torch.Tensor],
                       gen: torch.Generator, device: str) -> RunResult:
    """Eager's backward of the region: the subgraph run forward once with the inputs the backward
    kernel differentiates as requires_grad leaves (the bwd family's `baseline_leaves(workload)`,
    default every floating-point input), then `torch.autograd.grad` of its outputs timed alone,
    with random incoming gradients in the outputs' own layout (what the next op hands over)."""
    idx = registry.baseline_leaves(group.workload.family, group.workload, args)
    # a leaf the region reads only through ops left outside it (a transpose): the value it reads
    read = [bool(n.users) for n in sub.graph.nodes if n.op == "placeholder"]
    derived = _plan.derived_inputs(group.example[1])
    via = {i: [k for k, src in derived.items() if src == i and read[k]] for i in idx}
    idx = tuple(dict.fromkeys(j for i in idx if i < len(args) for j in ((i,) if read[i] else via[i])))
    leaves = [args[i].requires_grad_(True) for i in idx]
    with torch.enable_grad():
        out = sub(*args)
    outs = tuple(o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad)
    grads = tuple(torch.empty_like(o).copy_(torch.randn(tuple(o.shape), generator=gen)) for o in outs)
    return time_kernel(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True), device)


def _keeps_model(fn: Callable[..., tuple[Any, Report]]) -> Callable[..., tuple[Any, Report]]:
    """optimize's contract with the user's model (runtime/inplace.py): a model optimized before is
    restored first (its original call is what the new run captures and validates against); its
    train/eval flags, and every submodule's, are put back however optimize ends (it runs the model
    in eval for inference, in train for training); and the optimized call is installed in the
    model, which is what optimize returns, unless `inplace=False` (the call is then returned as a
    wrapper and the model is left as it was)."""
    from solforge.runtime.inplace import SolforgeCall, install, installed, modes_kept, restore

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> tuple[Any, Report]:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        model, inplace = bound.arguments["model"], bound.arguments["inplace"]
        before = installed(model) if isinstance(model, torch.nn.Module) else None
        if before is not None:
            restore(model)
        try:
            with modes_kept(model) if isinstance(model, torch.nn.Module) else contextlib.nullcontext():
                optimized, report = fn(*bound.args, **bound.kwargs)
        except BaseException:
            if before is not None:
                install(model, before)
            raise
        if inplace and isinstance(optimized, SolforgeCall):
            return install(model, optimized), report
        return optimized, report

    return wrapper


@_keeps_model
def optimize(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    mode: str = "inference",
    budget: float = 120.0,
    out_dir: str | Path | None = None,
    make_inputs: Callable[[int], Sequence[Any]] | None = None,
    is_language_model: bool | None = None,
    name: str | None = None,
    families: Sequence[str] | None = None,
    max_candidates: int | None = None,
    reporter: Reporter | None = None,
    command: str = "",
    db: str | Path | bool = True,
    runner: str = "local",
    gpus: Sequence[int] | None = None,
    strategy: str = "auto",
    build_workers: int = 0,
    timeout: float = 120.0,
    retune: bool = False,
    resume: bool = False,
    profile: str = "auto",
    cuda_graphs: bool = True,
    inplace: bool = True,
) -> tuple[Callable[..., Any], Report]:
    """Optimize `model` for inputs shaped like `example_inputs` (on the device the model is on).

    Returns the optimized model and the Report. The optimized model is `model` itself, optimized in
    place as `model.compile()` does (runtime/inplace.py): its class, forward signature, state_dict
    keys, train/eval flags, `save_pretrained` and `generate` are the model's own; a deepcopy,
    pickle or `torch.save` of it is a plain, un-optimized copy; `solforge.restore(model)` takes the
    optimization out again. Nothing is installed where nothing was integrated. `inplace=False`
    leaves the model as it was and returns a wrapper running the optimized graphs (called like the
    model, with its `generate`; other attributes are the model's). `budget` is the
    tuning time in seconds across all workloads; every workload measures at least one candidate.
    With `out_dir`, writes `out_dir/report.json`.

    Tuning: `strategy` (auto, exhaustive, evolutionary) searches each workload's space on
    `runner` (local: in this process; process: one worker process per GPU in `gpus`, isolating
    crashes and hangs past `timeout` seconds; ray[:ADDRESS]), with `build_workers` processes
    compiling ahead. `db` is the kernel database (True: ~/.cache/solforge/kernels.db or
    $SOLFORGE_DB; a path; False: none): a workload it knows is not tuned again unless `retune`
    (from the start) or `resume` (searches an earlier budget cut short go on where they stopped).
    `profile`: "on", "off", or "auto" (profile unless every kernel comes from the database).
    `cuda_graphs`: the optimized model replays its launch-bound calls from CUDA graphs:
    `generate`'s decode steps (transformers models) and a small model's forward under
    torch.no_grad (stepgraphs.py), and a small model's training step, forward and backward
    (traingraphs.py; SOLFORGE_TRAIN_GRAPHS=0 turns that part off).
    """
    if mode not in MODES:
        raise UserError(f"mode {mode!r} is not supported: use --mode inference or --mode train")
    if budget <= 0:
        raise UserError(f"--budget must be positive (got {budget})")
    if profile not in ("auto", "on", "off"):
        raise UserError(f"--profile must be auto, on or off (got {profile!r})")
    if timeout <= 0:
        raise UserError(f"--timeout must be positive (got {timeout})")
    from solforge.tune.runners import check_spec

    check_spec(runner)
    if out_dir is not None:
        ensure_writable(Path(out_dir))
    rep = _Timed(reporter or _Silent())
    started = time.perf_counter()
    example_inputs = tuple(example_inputs)
    device = check_device(_model_device(model, example_inputs))
    dtype = _model_dtype(model, example_inputs)
    fams = _check_families(families)
    if is_language_model is None:
        is_language_model = hasattr(getattr(model, "config", None), "vocab_size")
    notes: list[str] = []
    if device != "cuda":
        notes.append("no GPU: kernels ran in Triton's interpreter; every timing here means nothing")

    train = mode == "train"
    if train:
        _check_trainable(model, example_inputs)
    rep.stage("capture", "torch.compile backend -> ATen graphs")
    model.train(train)
    lowering_cache = _lowering_cache(db)
    try:
        # train: captured with autograd on, as training runs it; the fused ops carry their backward
        captured = _capture.capture(model, example_inputs, grad=train, cache=lowering_cache)
    except Exception as e:
        raise UserError(f"the model failed to run on its example inputs: {type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
    notes += captured.errors
    if lowering_cache is not None:
        if lowering_cache.hits:
            notes.append(f"capture: {lowering_cache.hits} ATen graph(s) read from the lowering cache "
                         f"({lowering_cache.directory}) instead of traced again")
        notes += [f"lowering cache: {p}" for p in dict.fromkeys(lowering_cache.problems)]
    restored = sum(g.attention_restored for g in captured.graphs)
    if restored:
        notes.append(f"attention: {restored} SDPA call(s) traced with a materialized causal mask run as "
                     "is_causal SDPA again, as in eager (no K/V repeat copies)")

    rep.stage("plan", f"{len(captured.graphs)} graph(s)")
    groups = _plan.plan(captured.graphs, fams)
    if not groups:
        known = ", ".join(registry.forward_names())
        notes.append(f"nothing to optimize: no region of a known kernel family ({known}) was found")
    if train:  # the fused ops' backward kernels are tuned too, as workloads of family <family>_bwd
        groups += _plan.backward_groups(groups)

    kdb = _open_db(db)
    run_id = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:6]}"
    cached = {g.workload for g in groups if kdb is not None and not retune and _known(kdb, g.workload, resume)}
    prof: Profile | None = None
    if profile == "on" or (profile == "auto" and len(cached) < len(groups)):
        rep.stage("profile", "torch.profiler: kernels -> regions -> roofline -> Amdahl ranking")
        prof = _profile_stage(model, example_inputs, device=device, name=name or type(model).__name__,
                              families=fams, trace=Path(out_dir) / TRACE_BASELINE if out_dir is not None else None,
                              lowering_cache=lowering_cache)
        # tune where the end-to-end time is: the largest Amdahl saving first (the budget may run out);
        # the profile is of the forward, so a backward group ranks with its forward, right after it
        saving = _ranking(prof)
        groups.sort(key=lambda g: -saving((g.forward or g.workload).key))
    elif profile == "auto" and groups:
        notes.append("profile skipped: every kernel came from the kernel database (--profile on to profile anyway)")

    results: list[TuneResult] = []
    t0 = time.perf_counter()
    from solforge.tune.runners import make_runner

    todo = [g for g in groups if g.workload not in cached]
    run = make_runner(runner, device=device, gpus=gpus, timeout_s=timeout, build_workers=build_workers) \
        if todo else None
    stored_baselines = 0
    try:
        for group in groups:
            rep.stage("tune", group.workload.key)
            assert group.example is not None
            sig = _plan.region_signature(group.example[1])
            # a known kernel's region was timed by an earlier run on this device and software: a
            # warm run reuses that time rather than timing every region again
            baseline = kdb.baseline(group.workload, sig) if kdb is not None and group.workload in cached else None
            if baseline is not None:
                stored_baselines += 1
            else:
                baseline = _baseline(group, device)
                if kdb is not None and baseline.ok:
                    kdb.set_baseline(group.workload, sig, baseline)
            if group.workload in cached:
                res = tune(group.workload, baseline, device=device, budget_s=0, db=kdb)
            else:
                left = max(0.0, budget - (time.perf_counter() - t0))
                n = len(candidates(registry.module(group.workload.family), group.workload))
                rep.tune_start(group.workload.key, min(n, max_candidates or n))
                res = tune(group.workload, baseline, device=device, budget_s=left / (len(todo) - todo.index(group)),
                           max_candidates=max_candidates, progress=rep.tune_step, runner=run, strategy=strategy,
                           db=kdb, run_id=run_id, retune=retune, resume=resume)
            rep.tune_end(res)
            results.append(res)
            if res.source == "database" and res.best is not None and not dict(res.best.provenance).get("complete"):
                notes.append(f"{group.workload.key}: the database's search was cut short by its budget "
                             f"({res.known} candidates measured); --resume goes on with it")
    finally:
        if run is not None:
            run.close()
        if kdb is not None:
            kdb.close()

    if stored_baselines:
        notes.append(f"the original time of {stored_baselines} region(s) came from the kernel database "
                     "(measured by an earlier run on this device; --retune measures everything again)")
    keep, kept_notes = kept_out(groups, results, meaningful=device == "cuda")
    notes += kept_notes
    winners = {r.workload: _encode(r) for r in results if r.best is not None and r.workload not in keep}
    optimized: Callable[..., Any] = model
    e2e: E2EReport | None = None
    prof_after: Profile | None = None
    if winners:
        rep.stage("integrate", f"{len(winners)} kernel(s)")
        # the capture's own compiled model, rewritten in place: no second trace
        # a shape the model is called with later is compiled then: the database's winner for it, if any
        db_path = kdb.path if kdb is not None else None
        optimized, stats = integrate_captured(captured, winners, families=fams, train=train, keep=keep, db=db_path,
                                              cuda_graphs=cuda_graphs)
        rep.stage("validate", "original vs optimized on fresh inputs")
        fresh = tuple(make_inputs(1)) if make_inputs is not None else _fresh(example_inputs)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if train else None
        e2e = validate(model, optimized, fresh, dtype=dtype, device=device,
                       is_language_model=bool(is_language_model), params=params,
                       settled=settled_since_now(stats.step_graphs))
        if device == "cuda" and e2e.speedup is not None and e2e.speedup < 1:
            graphed = "" if train else "; solforge.runtime.graphed replays a forward from a CUDA graph"
            notes.append(f"the optimized model is slower end to end than the original ({e2e.speedup:.2f}x): "
                         f"keep the original for these inputs ({host_time(stats.step_graphs)}{graphed})")
        drawn = random_ops(g.aten for g in captured.graphs)
        if drawn:
            notes.append(f"the model draws random numbers ({', '.join(drawn)}): the end-to-end check started "
                         "both models from the same seed")
        planned = sum(g.count for g in groups if g.workload in winners and g.forward is None)
        if stats.total < planned:
            notes.append(f"integration replaced {stats.total} of {planned} planned regions")
        if stats.grouped:
            notes.append(f"{stats.grouped} linear layers run through linears.py: their backward sums sibling "
                         "input gradients and adds weight gradients to an existing .grad inside the GEMMs "
                         "(SOLFORGE_LINEARS=0 turns this off)")
        if stats.embeddings:
            notes.append(f"{stats.embeddings} embedding(s) run through embeddings.py: their backward adds the gradient "
                         "to an existing .grad only in the rows of the tokens present, with eager's values "
                         "(SOLFORGE_EMBEDDING=0 turns this off)")
        if prof is not None:
            rep.stage("profile", "the optimized model, the same way")
            prof_after = _profile_stage(
                model, example_inputs, device=device, name=name or type(model).__name__, families=fams,
                rewrite=Integrator(dict(winners), fams, train=train, keep=frozenset(keep), db=db_path),
                trace=Path(out_dir) / TRACE_OPTIMIZED if out_dir is not None else None, lowering_cache=lowering_cache)

    rep.stop()
    report = Report(
        model=name or type(model).__name__, device=_device_name(device), dtype=dtype_name(dtype), mode=mode,
        versions=versions(device), settings=settings.current().as_dict(),
        regions=tuple(_region_report(g, r, keep) for g, r in zip(groups, results, strict=True)),
        e2e=e2e, timings_meaningful=device == "cuda", notes=tuple(notes),
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), command=command or " ".join(sys.argv),
        graphs=len(captured.graphs), profile=prof, profile_after=prof_after,
        extra={"stage_seconds": rep.seconds, "wall_seconds": round(time.perf_counter() - started, 3)},
    )
    if out_dir is not None:
        write_report(report, Path(out_dir))
    return optimized, report


def profile(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    out_dir: str | Path | None = None,
    name: str | None = None,
    families: Sequence[str] | None = None,
    ceilings_cache: str | Path | None = None,
    reporter: Reporter | None = None,
    command: str = "",
) -> Report:
    """Where one forward's device time goes (on the device the model is on): every kernel
    attributed to a graph region, each region against the device's measured ceilings, ranked by
    the end-to-end time it would save at speed of light. With `out_dir`: report.json,
    trace_baseline.json (open it in Perfetto) and report.html. Returns a Report whose `profile`
    holds the result (no tuning: `regions` is empty)."""
    if out_dir is not None:
        ensure_writable(Path(out_dir))
    rep = reporter or _Silent()
    example_inputs = tuple(example_inputs)
    device = check_device(_model_device(model, example_inputs))
    dtype = _model_dtype(model, example_inputs)
    from solforge.runtime.inplace import modes_kept

    rep.stage("profile", "torch.profiler: kernels -> regions -> roofline -> Amdahl ranking")
    with modes_kept(model):  # the user's train/eval flags are theirs
        model.eval()
        prof = _profile_stage(model, example_inputs, device=device, name=name or type(model).__name__,
                              families=_check_families(families),
                              trace=Path(out_dir) / TRACE_BASELINE if out_dir is not None else None,
                              ceilings_cache=ceilings_cache)
    report = Report(
        model=name or type(model).__name__, device=_device_name(device), dtype=dtype_name(dtype), mode="inference",
        versions=versions(device), settings=settings.current().as_dict(), regions=(), e2e=None,
        timings_meaningful=prof.meaningful, notes=prof.notes,
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), command=command or " ".join(sys.argv),
        graphs=prof.graphs, profile=prof,
    )
    if out_dir is not None:
        write_report(report, Path(out_dir))
    return report


def _profile_stage(model: torch.nn.Module, inputs: Sequence[Any], *, device: str, name: str,
                   families: Sequence[str] | None, trace: Path | None, rewrite: _capture.Rewrite | None = None,
                   ceilings_cache: str | Path | None = None,
                   lowering_cache: _capture.LoweringCache | None = None) -> Profile:
    from solforge.profile import profile_model

    return profile_model(model, inputs, device=device, name=name, families=families, rewrite=rewrite,
                         trace_path=trace, ceilings_cache=ceilings_cache, lowering_cache=lowering_cache)


def _ranking(prof: Profile) -> Callable[[str], float]:
    from solforge.profile import ranking

    return ranking(prof)


def not_faster(results: Sequence[TuneResult], *, meaningful: bool) -> set[Any]:
    """Workloads whose verified best kernel is slower than the region as the model ran it (only
    where times mean something: on the interpreter every kernel is "slower")."""
    return {r.workload for r in results
            if meaningful and r.best is not None and r.speedup is not None and r.speedup < 1.0}


def kept_out(groups: Sequence[_plan.WorkloadGroup], results: Sequence[TuneResult], *,
             meaningful: bool) -> tuple[set[Any], list[str]]:
    """The forward workloads whose regions stay as the model ran them, and notes:
    - a kernel that is not faster than the region as the model ran it (on the GPU, where times
      mean something): never trade the original for a slower kernel;
    - a workload with no verified kernel, and in training one whose backward has none: nothing
      unproven enters a model (the heuristic config is not used in their place).
    A backward that is merely slower is used (the fused forward op always runs its own backward
    kernel, so the best backward config is used whatever eager's backward would cost): noted."""
    backward = {g.workload for g in groups if g.forward is not None}
    slower = not_faster([r for r in results if r.workload not in backward], meaningful=meaningful)
    slow_bwd = not_faster([r for r in results if r.workload in backward], meaningful=meaningful)
    unverified = {r.workload for r in results if r.best is None}
    keep = set(slower) | (unverified - backward)
    notes = []
    for r in results:
        if r.workload in unverified:
            what = "its backward" if r.workload in backward else "it"
            notes.append(f"{r.workload.key}: no kernel verified, so {what} stays as the model ran it")
        elif r.workload in slower:
            notes.append(f"kept the original {r.workload.key}: its best kernel ({r.best.time_us:,.1f} µs) is "
                         f"not faster than the region as the model ran it ({r.baseline.p50_us:,.1f} µs)")
        elif r.workload in slow_bwd:
            notes.append(f"{r.workload.key}: its best kernel ({r.best.time_us:,.1f} µs) is slower than eager's "
                         f"backward of the region ({r.baseline.p50_us:,.1f} µs); used anyway: the fused forward "
                         "op runs its own backward")
    # a forward whose backward has no verified kernel stays out too: its op would run that backward
    for g in groups:
        if g.forward is not None:
            continue
        bwl = registry.backward_workload(g.workload.family, g.workload)
        if bwl is not None and bwl in unverified:
            keep.add(g.workload)
    return keep, notes


def random_ops(graphs: Iterable[torch.fx.GraphModule]) -> list[str]:
    """The seeded-random ATen ops (dropout, rand, bernoulli, ...) the graphs call, by name; not an
    attention or dropout call whose dropout probability is 0 (or whose `train` is False): those are
    tagged as random but draw nothing."""
    names = {n.target._overloadpacket.__name__ for gm in graphs for n in gm.graph.nodes
             if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
             and torch.Tag.nondeterministic_seeded in n.target.tags and _draws(n)}
    return sorted(names)


def _draws(node: torch.fx.Node) -> bool:
    schema = node.target._schema  # type: ignore[union-attr]
    args = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value))
            for i, a in enumerate(schema.arguments)}
    if "dropout_p" in args:
        return args["dropout_p"] not in (0, 0.0, None)
    if schema.name in ("aten::native_dropout", "aten::dropout"):
        return args.get("p") not in (0, 0.0) and args.get("train") is not False
    return True


def _open_db(db: str | Path | bool) -> KernelDB | None:
    if db is False:
        return None
    from solforge.db import KernelDB

    return KernelDB(None if db is True else db)


def _lowering_cache(db: str | Path | bool) -> _capture.LoweringCache | None:
    """The ATen lowering cache beside the kernel database (`lowered/` in its directory): a run that
    keeps no database keeps no lowerings either. SOLFORGE_LOWERING_CACHE=0 (settings.lowering_cache)
    turns it off alone."""
    if db is False or not settings.current().lowering_cache:
        return None
    from solforge.db import default_path

    path = default_path() if db is True else Path(db).expanduser()
    return _capture.LoweringCache(path.parent / "lowered")


def _known(kdb: KernelDB, workload: Any, resume: bool) -> bool:
    """The database holds a winner for this workload (with `resume`: of a search that finished)."""
    win = kdb.winner(workload)
    return win is not None and (bool(dict(win.provenance).get("complete")) or not resume)


def _check_families(families: Sequence[str] | None) -> tuple[str, ...] | None:
    if families is None:
        return None
    known = registry.forward_names()
    unknown = [f for f in families if f not in known]
    if unknown or not families:
        raise UserError(f"unknown kernel families {unknown or '(none given)'}: choose from {', '.join(known)}")
    return tuple(families)


def _fresh(inputs: Sequence[Any]) -> tuple[Any, ...]:
    from solforge.zoo import fresh_like

    return tuple(fresh_like(tuple(inputs), seed=1))


def _encode(result: TuneResult) -> str:
    assert result.best is not None
    return config_text(result.best)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def _region_report(group: _plan.WorkloadGroup, res: TuneResult, keep: Collection[Any]) -> RegionReport:
    """The report row of one workload; `keep`: the forward workloads left as the model ran them
    (kept_out). A backward kernel is integrated with its forward op, faster than eager's or not."""
    best = res.best
    rejected = sum(1 for r in res.records if not r.ok)
    built = sum(1 for r in res.records if r.build.ok)
    timed = sum(1 for r in res.records if r.run is not None and r.run.ok)
    note = None
    if best is None:
        errs = [r.error for r in res.records if r.error]
        note = "no candidate passed: " + (errs[0] if errs else "none measured")
    return RegionReport(
        integrated=best is not None and (group.forward or group.workload) not in keep,
        family=group.workload.family, workload=group.workload.key, count=group.count,
        baseline_us=res.baseline.p50_us if res.baseline.ok else None,
        best_us=best.time_us if best else None, speedup=res.speedup,
        backend=best.candidate.backend if best else None,
        config=best.candidate.config_dict if best else None,
        verified=best is not None, max_rel_err=best.verdict.max_rel_err if best and best.verdict else None,
        candidates=len(res.records), rejected=rejected, note=note, label=group.workload.label,
        config_text=_encode(res) if best else None,
        modules=tuple(dict.fromkeys(r.module for r in group.regions if r.module))[:8],
        source=res.source, built=built, timed=timed, known=res.known,
        strategy=dict(best.provenance).get("strategy") if best else None,
    )
