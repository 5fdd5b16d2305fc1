"""Public entry points. `optimize()` runs capture -> plan -> tune -> integrate -> validate -> report."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import inspect
import platform
import sys
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from solforge import capture as _capture
from solforge import plan as _plan
from solforge import settings
from solforge.capture.backend import static_shapes
from solforge.capture.stage import capture_model, capture_notes, lowering_cache
from solforge.errors import UserError
from solforge.integrate import IntegrationStats, Integrator, config_text, integrate, integrate_captured
from solforge.integrate.select import Pick, integration_notes, kept_out, not_faster, select
from solforge.kernels import registry
from solforge.numerics import dtype_name
from solforge.options import MODES, Options, check_families, check_interpreter, check_seconds  # noqa: F401  (check_seconds: the CLI's)
from solforge.records import E2EReport, Profile, RegionReport, Report, TuneResult, Workload
from solforge.report import TRACE_BASELINE, TRACE_OPTIMIZED, ensure_writable, write_report
from solforge.report.progress import Reporter, Silent, Timed
from solforge.runtime import distributed
from solforge.runtime.logits import shown
from solforge.runtime.stepgraphs import settled_since_now
from solforge.tune.stage import known, tune_groups
from solforge.validate import validate
from solforge.validate.guarantee import OPTIMIZED, ORIGINAL, SUBSET, Choice, choose, failed_run, gains, release
from solforge.validate.notes import host_time, random_ops

if TYPE_CHECKING:
    from solforge.db import KernelDB

# names other modules and tests import from here
__all__ = ["MODES", "Reporter", "check_device", "host_time", "kept_out", "not_faster", "optimize", "profile",
           "random_ops", "versions"]


def versions(device: str) -> dict[str, str]:
    import triton

    v = {"solforge": _version(), "python": platform.python_version(), "torch": torch.__version__,
         "triton": triton.__version__}
    # from the package's metadata: importing transformers only to read its version costs seconds
    # (each tuning or bench process that never uses it)
    tf = sys.modules.get("transformers")
    try:
        v["transformers"] = tf.__version__ if tf is not None else _dist_version("transformers")
    except PackageNotFoundError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        v |= {"gpu": p.name, "compute_capability": f"{p.major}.{p.minor}", "cuda": str(torch.version.cuda)}
    return v


def _version() -> str:
    try:
        return _dist_version("solforge")
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
    keep_slower: bool = False,
    skip_logits: bool = False,
    inplace: bool = True,
) -> tuple[Callable[..., Any], Report]:
    """Optimize `model` for inputs shaped like `example_inputs` (on the device the model is on).

    Returns a model (called exactly like `model`) and the Report. On a GPU the model returned
    passed the end-to-end check and is not slower end to end than `model`; where the model with
    every kernel is not so, one without the kernels that save least (a subset) or else `model`
    itself is returned (validate/guarantee.py). Off the GPU speed is not judged, but a model that
    fails the check gives `model` back. `report.returned` ("optimized", "subset", "original") and
    `report.why` say which and why, `report.attempts` every model checked; `keep_slower` returns
    the model with every verified kernel, one slower than its region included, whatever its check
    or its speed (for analysis).

    The model returned when kernels were integrated is `model` itself, optimized in place as
    `model.compile()` does (runtime/inplace.py): its class, forward signature, state_dict keys,
    train/eval flags, `save_pretrained` and `generate` are the model's own; a deepcopy, pickle or
    `torch.save` of it is a plain, un-optimized copy; `solforge.restore(model)` takes the
    optimization out again. `inplace=False` leaves the model as it was and returns a wrapper
    running the optimized graphs.

    `budget` is the tuning time in seconds across all workloads; every workload measures at least
    one candidate. With `out_dir`, writes `out_dir/report.json`.

    Tuning: `strategy` (auto, exhaustive, evolutionary) searches each workload's space on
    `runner` (local: in this process, without isolation: `timeout` does not apply, a candidate that
    hangs stalls the call and one that crashes the process ends it; process: one worker process per
    GPU in `gpus`, isolating
    crashes and hangs past `timeout` seconds; ray[:ADDRESS]), with `build_workers` processes
    compiling ahead. `db` is the kernel database (True: ~/.cache/solforge/kernels.db or
    $SOLFORGE_DB; a path; False: none): a workload it knows is not tuned again unless `retune`
    (from the start) or `resume` (searches an earlier budget cut short go on where they stopped).
    `profile`: "on", "off", or "auto" (profile unless every kernel comes from the database).
    `cuda_graphs`: the optimized model replays its launch-bound calls from CUDA graphs:
    `generate`'s decode steps (transformers models) and a small model's forward under
    torch.no_grad (stepgraphs.py), and a small model's training step, forward and backward
    (traingraphs.py; SOLFORGE_TRAIN_GRAPHS=0 turns that part off).

    `skip_logits`: a call in training mode whose output has a loss (a transformers ForCausalLM
    called with `labels`) returns `logits=None`, as Liger's `skip_logits` does: the logits are then
    no graph output, so the LM head and the loss fuse into one op that never materializes them
    (linear_cross_entropy; runtime/logits.py). Eval calls and calls without labels are unchanged.
    """
    opts = Options(mode=mode, budget=budget, out_dir=Path(out_dir) if out_dir is not None else None,
                   make_inputs=make_inputs, is_language_model=is_language_model, name=name,
                   families=tuple(families) if families is not None else None, max_candidates=max_candidates,
                   command=command, db=db, runner=runner, gpus=tuple(gpus) if gpus else None, strategy=strategy,
                   build_workers=build_workers, timeout=timeout, retune=retune, resume=resume, profile=profile,
                   cuda_graphs=cuda_graphs, keep_slower=keep_slower, skip_logits=skip_logits)
    opts.check()
    if opts.out_dir is not None:
        ensure_writable(opts.out_dir)
    rep = Timed(reporter or Silent())
    started = time.perf_counter()
    example_inputs = tuple(example_inputs)
    opts, device, dtype, notes = _start(model, example_inputs, opts)
    fams = check_families(opts.families)
    name = opts.name or type(model).__name__

    rep.stage("capture", "torch.compile backend -> ATen graphs")
    model.train(opts.train)
    cache = lowering_cache(opts.db)
    captured = capture_model(model, example_inputs, train=opts.train, cache=cache, skip_logits=opts.skip_logits)
    notes += capture_notes(captured, cache)

    rep.stage("plan", f"{len(captured.graphs)} graph(s)")
    groups = _plan.plan(captured.graphs, fams)
    # convolutions the capture made channels-last (capture/layout.py): a change to integrate and
    # check end to end even where no region matched
    layouts = sum(g.conv_layouts for g in captured.graphs)
    if not groups and not layouts:
        names = ", ".join(registry.forward_names())
        notes.append(f"nothing to optimize: no region of a known kernel family ({names}) was found")
    notes += _add_alternatives(groups, opts, fams)
    if opts.train:  # the fused ops' backward kernels are tuned too, as workloads of family <family>_bwd
        groups += _plan.backward_groups(groups)

    kdb = _open_db(opts.db)
    try:
        run_id = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:6]}"
        cached = {g.workload for g in groups
                  if kdb is not None and not opts.retune and known(kdb, g.workload, opts.resume)}
        prof, more = _profile_and_rank(model, example_inputs, groups, cached, opts, device=device, name=name,
                                       families=fams, cache=cache, reporter=rep)
        notes += more
        tuned = tune_groups(groups, device=device, opts=opts, kdb=kdb, cached=cached, run_id=run_id, reporter=rep)
    finally:
        if kdb is not None:
            kdb.close()
    notes += tuned.notes
    if kdb is not None:  # a corrupt or read-only file: the run went on, the report says how
        notes += [f"kernel database: {p}" for p in kdb.problems]
    sel = select(groups, tuned.results, meaningful=device == "cuda", keep_slower=opts.keep_slower)
    notes += sel.notes
    groups, results, judged, picks = sel.groups, sel.results, sel.judged, sel.picks
    keep, swapped, winners = sel.keep, sel.swapped, sel.winners
    prof_after: Profile | None = None
    choice = Choice(model, ORIGINAL, "no region of a known kernel family was found" if not groups else
                    "no region got a kernel that is verified and (on the GPU) faster than the region", None)
    if winners or swapped or layouts:
        rep.stage("integrate", f"{len(set(winners) | set(swapped))} kernel(s)"
                  + (f", {layouts} convolution(s) channels-last" if layouts else ""))
        # the capture's own compiled model, rewritten in place: no second trace
        # a shape the model is called with later is compiled then: the database's winner for it, if any
        db_path = kdb.path if kdb is not None else None
        optimized, stats = integrate_captured(captured, winners, families=fams, train=opts.train, keep=keep,
                                              db=db_path, cuda_graphs=opts.cuda_graphs, swaps=swapped)
        rep.stage("validate", "original vs optimized on fresh inputs")
        choice, stats = _deliver(model, example_inputs, (optimized, stats), opts, winners=winners, keep=keep,
                                 groups=groups, results=judged, device=device, dtype=dtype, db_path=db_path,
                                 cache=cache, reporter=rep, swaps=swapped)
        drawn = random_ops(g.aten for g in captured.graphs)
        if drawn:
            notes.append(f"the model draws random numbers ({', '.join(drawn)}): the end-to-end check started "
                         "both models from the same seed")
        used = {**winners, **{f: c for f, (_, c) in swapped.items()}}
        notes += integration_notes(stats, groups, {w: c for w, c in used.items() if w not in choice.dropped})
        if prof is not None and choice.returned != ORIGINAL:
            rep.stage("profile", "the optimized model, the same way")
            prof_after = _profile_stage(
                model, example_inputs, device=device, name=name, families=fams,
                rewrite=Integrator(dict(winners), fams, train=opts.train, keep=frozenset(keep | choice.dropped),
                                   db=db_path, swaps=swapped),
                trace=opts.out_dir / TRACE_OPTIMIZED if opts.out_dir is not None else None, lowering_cache=cache)
    notes.append(f"{RETURNED[choice.returned]}: {choice.why}")

    rep.stop()
    report = Report(
        model=name, device=_device_name(device), dtype=dtype_name(dtype), mode=opts.mode,
        versions=versions(device), settings=settings.current().as_dict(),
        regions=tuple(_region_report(g, r, keep | choice.dropped, picks.get(g.workload))
                      for g, r in zip(groups, results, strict=True)),
        e2e=choice.e2e, timings_meaningful=device == "cuda", notes=tuple(notes),
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), command=opts.command or " ".join(sys.argv),
        graphs=len(captured.graphs), profile=prof, profile_after=prof_after,
        extra={"stage_seconds": rep.seconds, "wall_seconds": round(time.perf_counter() - started, 3),
               "tune_peak_gb": None if tuned.peak_bytes is None else round(tuned.peak_bytes / 1e9, 3)},
        returned=choice.returned, why=choice.why, attempts=tuple(choice.attempts),
    )
    if opts.out_dir is not None:
        write_report(report, opts.out_dir)
    return choice.model, report


def _start(model: torch.nn.Module, example_inputs: tuple[Any, ...],
           opts: Options) -> tuple[Options, str, torch.dtype, list[str]]:
    """The checks before any stage (a clear error for what cannot work) and what they decide: the
    options (off the GPU one candidate per workload), the device, the model's dtype, first notes."""
    distributed.check_wrapper(model)
    if opts.profile == "on" and distributed.active():
        # the profile times forwards until they are steady: each rank would make its own number of
        # calls, and a sharded model's calls gather across the ranks (runtime/distributed.py)
        raise UserError("profile='on' is not supported under torch.distributed (the ranks would time different "
                        "numbers of calls); use profile='auto' (skipped there) or 'off'")
    device = check_device(_model_device(model, example_inputs))
    if device == "cpu":
        check_interpreter()
    dtype = _model_dtype(model, example_inputs)
    notes: list[str] = []
    if device != "cuda":
        notes.append("no GPU: kernels ran in Triton's interpreter; every timing here means nothing")
        if opts.max_candidates is None:
            # the interpreter's times rank nothing (tune._winner keeps the heuristic config there
            # anyway): each workload's heuristic config is built, verified and run once, no more
            opts = dataclasses.replace(opts, max_candidates=1)
    if opts.train:
        _check_trainable(model, example_inputs)
    return opts, device, dtype, notes


# the note that says what optimize returned, before its reason
RETURNED = {OPTIMIZED: "returned the optimized model", SUBSET: "returned the optimized model without some kernels",
            ORIGINAL: "returned the original model"}


def _deliver(model: torch.nn.Module, example_inputs: tuple[Any, ...], full: tuple[Any, IntegrationStats],
             opts: Options, *, winners: dict[Workload, str], keep: set[Any], groups: list[_plan.WorkloadGroup],
             results: list[TuneResult], device: str, dtype: torch.dtype, db_path: Path | None,
             cache: _capture.LoweringCache | None, reporter: Timed,
             swaps: dict[Workload, tuple[Workload, str]]) -> tuple[Choice, IntegrationStats]:
    """The validate stage and the guarantee (validate/guarantee.py): the full model checked, subsets
    integrated again and checked where it is not acceptable, the choice made; every model not
    returned has its CUDA graphs released. Returns the choice and the returned model's stats (the
    full model's when the original comes back)."""
    fresh = tuple(opts.make_inputs(1)) if opts.make_inputs is not None else _fresh(example_inputs)
    # FSDP2: the sharded parameters, whose .grad the steps' reduce-scatters set (runtime/distributed.py)
    params = ([(n, p) for n, p in distributed.resting(model).named_parameters() if p.requires_grad]
              if opts.train else None)
    is_lm = opts.is_language_model
    if is_lm is None:
        is_lm = hasattr(getattr(model, "config", None), "vocab_size")
    stats_of: dict[int, IntegrationStats] = {id(full[0]): full[1]}
    # the original as the option shows it: what the optimized model is compared with
    view = functools.partial(shown, model) if opts.skip_logits else None

    def check(optimized: Any) -> E2EReport:
        try:
            return validate(model, optimized, fresh, dtype=dtype, device=device, is_language_model=is_lm,
                            params=params, settled=settled_since_now(stats_of[id(optimized)].step_graphs), view=view)
        except Exception as e:  # noqa: BLE001 - a model that cannot run is one that failed its check
            return failed_run(e)

    def retry(dropped: frozenset[Workload]) -> tuple[Any, E2EReport]:
        reporter.stage("validate", f"without the kernels of {len(dropped)} workload(s)")
        for stats in stats_of.values():  # the models tried before are not returned: their graphs' memory goes
            release(stats)
        optimized, stats = integrate(model, winners, families=check_families(opts.families), train=opts.train,
                                     keep=keep | dropped, db=db_path, cuda_graphs=opts.cuda_graphs, cache=cache,
                                     swaps=swaps, skip_logits=opts.skip_logits)
        stats_of[id(optimized)] = stats
        try:  # compiled for the example inputs as the capture was: static graphs
            with static_shapes(), torch.set_grad_enabled(opts.train):
                optimized(*example_inputs)
        except Exception as e:  # noqa: BLE001 - said by its check
            return optimized, failed_run(e)
        return optimized, check(optimized)

    integrated = {g.workload for g in groups if g.forward is None and (g.workload in winners or g.workload in swaps)}
    graphed = "" if opts.train else "; solforge.runtime.graphed replays a forward from a CUDA graph"
    choice = choose(model, (full[0], check(full[0])), retry, gains(groups, results, integrated),
                    meaningful=device == "cuda", keep_slower=opts.keep_slower,
                    hint=f"{host_time(full[1].step_graphs)}{graphed}")
    for optimized, _ in choice.runs:
        if optimized is not choice.model:
            release(stats_of[id(optimized)])
    return choice, stats_of.get(id(choice.model), full[1])


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
    rep = reporter or Silent()
    example_inputs = tuple(example_inputs)
    device = check_device(_model_device(model, example_inputs))
    dtype = _model_dtype(model, example_inputs)
    from solforge.runtime.inplace import modes_kept

    rep.stage("profile", "torch.profiler: kernels -> regions -> roofline -> Amdahl ranking")
    with modes_kept(model):  # the user's train/eval flags are theirs
        model.eval()
        prof = _profile_stage(model, example_inputs, device=device, name=name or type(model).__name__,
                              families=check_families(families),
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


def _profile_and_rank(model: torch.nn.Module, example_inputs: tuple[Any, ...], groups: list[_plan.WorkloadGroup],
                      cached: set[Any], opts: Options, *, device: str, name: str, families: Any, cache: Any,
                      reporter: Reporter) -> tuple[Profile | None, list[str]]:
    """The profile stage where it pays: on the GPU, with workloads left to tune (or `profile="on"`),
    not under torch.distributed (each rank would time its own number of calls). `groups` are then
    sorted so the tuning budget goes where the end-to-end time is: the largest Amdahl saving first;
    the profile is of the forward, so a backward group ranks with its forward, right after it.
    Returns the profile (None where skipped) and notes saying why it was skipped."""
    if opts.profile == "on" or (opts.profile == "auto" and len(cached) < len(groups) and device == "cuda"
                                and not distributed.active()):
        reporter.stage("profile", "torch.profiler: kernels -> regions -> roofline -> Amdahl ranking")
        prof = _profile_stage(model, example_inputs, device=device, name=name, families=families,
                              trace=opts.out_dir / TRACE_BASELINE if opts.out_dir is not None else None,
                              lowering_cache=cache)
        saving = _ranking(prof)
        groups.sort(key=lambda g: -saving((g.forward or g.alternative_of or g.workload).key))
        return prof, []
    if opts.profile != "auto" or not groups:
        return None, []
    if distributed.active():
        return None, ["profile skipped: under torch.distributed each rank would time its own number of calls"]
    if device != "cuda":
        # the profile ranks regions by GPU time to spend the budget where it pays; off the GPU
        # every region gets its heuristic config, and the interpreter's times rank nothing
        return None, ["profile skipped: off the GPU it ranks nothing (--profile on to profile anyway)"]
    return None, ["profile skipped: every kernel came from the kernel database (--profile on to profile anyway)"]


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


def _open_db(db: str | Path | bool) -> KernelDB | None:
    if db is False:
        return None
    from solforge.db import KernelDB

    return KernelDB(None if db is True else db)


def _fresh(inputs: Sequence[Any]) -> tuple[Any, ...]:
    from solforge.zoo import fresh_like

    return tuple(fresh_like(tuple(inputs), seed=1))


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def _add_alternatives(groups: list[_plan.WorkloadGroup], opts: Options, fams: Sequence[str] | None) -> list[str]:
    """Append each forward family group's generated alternative (plan/alternatives.py), tuned as a
    competitor of the family's kernel (SOLFORGE_GENERATED_ALTERNATIVES); notes on what was not."""
    if not settings.current().generated_alternatives or not groups:
        return []
    if fams is not None and "generated" not in fams:
        return []
    if not any(g.workload.family != "generated" for g in groups):
        return []
    if opts.train:
        # a generated forward would run its own backward, which would have to be tuned and weighed
        # with it (forward + backward against the family's pair): not done yet
        return ["generated alternatives of the families' regions are formed for inference only"]
    from solforge.plan.alternatives import alternative_groups

    groups += alternative_groups(groups)
    return []


def _region_report(group: _plan.WorkloadGroup, res: TuneResult, keep: Collection[Any],
                   pick: Pick | None = None) -> RegionReport:
    """The report row of one workload; `keep`: the forward workloads left as the model ran them
    (kept_out). A backward kernel is integrated with its forward op, faster than eager's or not.
    `pick`: the choice between the family's kernel and its generated alternative (the row's other
    fields are the family's)."""
    best = res.best
    rejected = sum(1 for r in res.records if not r.ok)
    built = sum(1 for r in res.records if r.build.ok)
    timed = sum(1 for r in res.records if r.run is not None and r.run.ok)
    note = None
    if res.source == "untimed":
        note = f"not tuned: the region could not be timed ({res.baseline.error})"
    elif best is None:
        errs = [r.error for r in res.records if r.error]
        note = "no candidate passed: " + (errs[0] if errs else "none measured")
    return RegionReport(
        integrated=(best is not None or (pick is not None and pick.won))
        and (group.forward or group.workload) not in keep,
        family=group.workload.family, workload=group.workload.key, count=group.count,
        baseline_us=res.baseline.p50_us if res.baseline.ok else None,
        best_us=best.time_us if best else None, speedup=res.speedup,
        backend=best.candidate.backend if best else None,
        config=best.candidate.config_dict if best else None,
        verified=best is not None, max_rel_err=best.verdict.max_rel_err if best and best.verdict else None,
        candidates=len(res.records), rejected=rejected, note=note, label=group.workload.label,
        config_text=config_text(best) if best else None,
        modules=tuple(dict.fromkeys(r.module for r in group.regions if r.module))[:8],
        source=res.source, built=built, timed=timed, known=res.known,
        strategy=dict(best.provenance).get("strategy") if best else None,
        won=None if pick is None else (pick.generated.family if pick.won else group.workload.family),
        alternative=None if pick is None else pick.generated.key,
        alternative_us=None if pick is None else pick.generated_us,
        alternative_note=group.no_alternative if pick is None else pick.why,
    )
