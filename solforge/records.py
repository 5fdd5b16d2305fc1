"""Plain records passed between the stages (docs/design.md, Records).

Every record is a frozen dataclass made of JSON-friendly values (str, int, float, bool, None,
tuples and nested records), so `to_json(record)` / `from_json(cls, data)` round-trip exactly.
A failure is a record with an `error` string and infinite time, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

INF = math.inf


@dataclass(frozen=True)
class Workload:
    """One kernel problem: a family applied to fixed shapes and dtypes on one device.

    `shapes` and `dtypes` list the family's tensor inputs in its launcher's order; `params` holds
    the non-tensor arguments (eps, ...) as sorted (name, value) pairs so the record hashes.
    """

    family: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()
    device: str = "cpu"

    def param(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    @property
    def label(self) -> str:
        """Short name for tables: the first input's shape and dtype ("no inputs" for a region
        computed from generators alone, such as a causal mask built from aranges)."""
        if not self.shapes:
            return "no inputs"
        return "x".join(str(d) for d in self.shapes[0]) + f" {self.dtypes[0]}"

    @property
    def key(self) -> str:
        """Stable text key: the same workload always gets the same key."""
        shapes = ";".join("x".join(str(d) for d in s) for s in self.shapes)
        params = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.family}[{shapes}|{','.join(self.dtypes)}|{params}]@{self.device}"


@dataclass(frozen=True)
class Candidate:
    """One thing to build and measure: a workload, a backend, a template variant and its config."""

    workload: Workload
    backend: str
    variant: str
    config: tuple[tuple[str, Any], ...]

    @property
    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.variant}:" + ",".join(f"{k}={v}" for k, v in self.config)


@dataclass(frozen=True)
class BuildResult:
    ok: bool
    seconds: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    passed: bool
    trials: int = 0
    max_abs_err: float = INF
    max_rel_err: float = INF
    reason: str | None = None
    # worst ||out - ref|| / ||ref|| over the trials (tune/verify.py; a family's norm_error_bound caps it)
    max_norm_err: float = INF


@dataclass(frozen=True)
class RunResult:
    """Timing of one callable, microseconds. `meaningful` is False off the GPU (interpreter)."""

    p20_us: float = INF
    p50_us: float = INF
    p80_us: float = INF
    meaningful: bool = True
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.p50_us)


@dataclass(frozen=True)
class TuningRecord:
    candidate: Candidate
    build: BuildResult
    verdict: Verdict | None = None
    run: RunResult | None = None
    provenance: tuple[tuple[str, Any], ...] = ()

    @property
    def ok(self) -> bool:
        return (
            self.build.ok and self.verdict is not None and self.verdict.passed
            and self.run is not None and self.run.ok
        )

    @property
    def time_us(self) -> float:
        return self.run.p50_us if self.ok and self.run is not None else INF

    @property
    def error(self) -> str | None:
        if not self.build.ok:
            return f"build: {self.build.error}"
        if self.verdict is not None and not self.verdict.passed:
            return f"verify: {self.verdict.reason}"
        if self.run is not None and not self.run.ok:
            return f"run: {self.run.error}"
        return None


@dataclass(frozen=True)
class TuneResult:
    """What tuning one workload produced: the baseline, every record, and the winner (if any)."""

    workload: Workload
    baseline: RunResult
    records: tuple[TuningRecord, ...] = ()  # measured by this run
    best: TuningRecord | None = None
    # "database": the winner of an earlier, finished search, nothing measured; "untimed": the region
    # could not be timed for want of memory, so it was not tuned (left as the model ran it)
    source: str = "tuned"
    known: int = 0  # earlier measurements (database) the search used instead of measuring again

    @property
    def speedup(self) -> float | None:
        if self.best is None or not self.baseline.ok or not self.best.ok:
            return None
        return self.baseline.p50_us / self.best.time_us


@dataclass(frozen=True)
class RegionReport:
    family: str
    workload: str
    count: int
    baseline_us: float | None
    best_us: float | None
    speedup: float | None
    backend: str | None
    config: dict[str, Any] | None
    verified: bool
    max_rel_err: float | None
    candidates: int = 0
    rejected: int = 0
    note: str | None = None
    label: str = ""  # short shape/dtype name for tables
    config_text: str | None = None  # the config as the custom op receives it
    modules: tuple[str, ...] = ()  # module paths of the regions (first few)
    source: str = "tuned"  # "tuned" (measured by this run), "database" (an earlier run's winner) or "untimed"
    built: int = 0  # candidates this run compiled ...
    timed: int = 0  # ... and timed (verified ones); `rejected` failed to build, verify or time
    known: int = 0  # earlier measurements from the database used instead of measuring again
    strategy: str | None = None  # the search that found the winner (exhaustive, evolutionary)
    integrated: bool = True  # False: no verified kernel, or (GPU) none faster than the original region
    # a family region's generated alternative (plan/alternatives.py): which kernel won ("generated"
    # or the family; None: no alternative competed), its workload, its verified time (best_us is
    # the family's) and why it won or lost, or why the region has none
    won: str | None = None
    alternative: str | None = None
    alternative_us: float | None = None
    alternative_note: str | None = None


@dataclass(frozen=True)
class E2EReport:
    baseline_ms: float | None
    optimized_ms: float | None
    speedup: float | None
    max_abs_err: float
    max_rel_err: float
    argmax_agree: float | None
    passed: bool
    timings_meaningful: bool = True
    outputs_compared: int = 0
    note: str | None = None
    # agreement where the original's top-1/top-2 logit margin is > 2% of its largest |logit|:
    # what `passed` judges (solforge/validate/__init__.py says why)
    argmax_agree_decisive: float | None = None
    # mode train: parameter gradients of the training loss (validate.train_loss) compared too,
    # and the timings are whole steps (forward + backward)
    grads_compared: int = 0
    grad_max_rel_err: float | None = None  # worst ‖g - g_ref‖ / ‖g_ref‖ over the parameters
    baseline_peak_gb: float | None = None
    optimized_peak_gb: float | None = None
    # where the errors above miss their bar: both models' largest norm-relative error against the
    # original computed wider (fp32 for bf16/fp16, fp64 for fp32: validate.wide_dtype; the fields
    # keep their names) (validate.WIDE_SLACK says how that is judged)
    fp32_err_original: float | None = None
    fp32_err_optimized: float | None = None
    fp32_grad_err_original: float | None = None
    fp32_grad_err_optimized: float | None = None
    # "passed", "failed", or "nothing to validate" (the model returned no tensor to compare: never
    # "passed"); "" in reports written before it existed
    status: str = ""


@dataclass(frozen=True)
class Attempt:
    """One model `optimize` validated before choosing what to return (validate/guarantee.py): the
    forward workloads it left out against the full set of winners, and its end-to-end result."""

    dropped: tuple[str, ...]  # workload keys left as the model ran them; () for the full set
    regions: int  # forward workloads whose kernels it ran
    passed: bool
    speedup: float | None
    baseline_ms: float | None = None
    optimized_ms: float | None = None
    note: str | None = None


@dataclass(frozen=True)
class Ceilings:
    """A device's measured limits (profile/ceilings.py): what "speed of light" means on it."""

    device: str
    copy_gbs: float  # device-to-device copy, bytes read + written per second / 1e9
    bf16_tflops: float
    fp32_tflops: float
    meaningful: bool = True  # False on the CPU: a tiny copy and matmul, not a GPU's limits
    measured: str = ""  # when (ISO time) and with which torch
    torch: str = ""


@dataclass(frozen=True)
class RegionProfile:
    """One kind of region and all its repeats in one forward: measured time, roofline, Amdahl saving.

    Regions with the same `key` (a kernel family's workload, or family + module path with layer
    numbers folded + shapes) are one row: `count` repeats, `time_us` summed over them.
    """

    key: str
    family: str  # a kernel family (rmsnorm), a pseudo-family (residual_add, silu_mul, rope) or a kind
    kind: str  # gemm | attention | normalization | pointwise | reduction | copy | other
    label: str  # shapes and dtype, for tables
    module: str  # module path(s) with layer numbers folded: model.layers.*.self_attn.q_norm
    count: int
    kernels: int  # device kernels attributed to it (on the CPU: top-level ATen ops), all repeats
    time_us: float  # all repeats
    bytes: int  # per repeat: region inputs read + outputs written
    flops: int  # per repeat
    sol_us: float  # per repeat, at the ceilings
    achieved_gbs: float
    achieved_tflops: float
    pct_of_sol: float  # sol_us / measured per repeat, in percent
    bound: str  # memory | compute | launch
    saving_us: float  # Amdahl: end-to-end time saved if every repeat ran at speed of light
    rank: int = 0
    workload: str | None = None  # the Workload key when a kernel family claims the region
    modules: tuple[str, ...] = ()  # a few real module paths


@dataclass(frozen=True)
class Profile:
    """Where one forward's device time goes, by region, against the device's ceilings.

    `attributed_us` (sum of the regions) + `outside_us` (kernels launched outside every graph
    region, e.g. by dynamo's wrapper) = `busy_us`; `idle_us` = GPU idle inside the forward's span.
    `complete` only when every kernel was seen and at least 95% of the busy time is in a region.
    """

    model: str
    device: str
    meaningful: bool
    forward_us: float  # one forward timed without the profiler (CUDA events; wall clock on the CPU)
    span_us: float  # first kernel start to last kernel end in the profiled forward
    busy_us: float
    attributed_us: float
    outside_us: float
    idle_us: float
    kernels: int
    complete: bool
    ceilings: Ceilings
    regions: tuple[RegionProfile, ...]  # ranked by saving_us
    by_kind: tuple[tuple[str, float], ...] = ()  # kind -> us
    by_family: tuple[tuple[str, int, float], ...] = ()  # family -> (regions, us)
    graphs: int = 0
    trace: str | None = None  # Chrome trace JSON path (Perfetto opens it)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    model: str
    device: str
    dtype: str
    mode: str
    versions: dict[str, str]
    regions: tuple[RegionReport, ...]
    e2e: E2EReport | None
    timings_meaningful: bool = True
    notes: tuple[str, ...] = ()
    created: str = ""
    command: str = ""
    graphs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    profile: Profile | None = None  # the baseline's bottlenecks (solforge profile / optimize)
    profile_after: Profile | None = None  # the optimized model, profiled the same way
    # every SOLFORGE_* switch the run had (solforge.settings.Settings.as_dict); {} in reports written
    # before it was recorded
    settings: dict[str, Any] = field(default_factory=dict)
    # what optimize returned (validate/guarantee.py): "optimized" (every verified, faster kernel),
    # "subset" (some left out: faster so), "original" (the model itself); "" before it was recorded.
    # `why` says why, with the numbers; `attempts` holds every model validated on the way
    returned: str = ""
    why: str = ""
    attempts: tuple[Attempt, ...] = ()


# ----------------------------------------------------------------------------------------------
# JSON round trip


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def to_dict(record: Any) -> Any:
    """The record as plain JSON data (infinite floats become the strings "inf"/"-inf")."""
    return _encode(record)


def to_json(record: Any, **kwargs: Any) -> str:
    return json.dumps(_encode(record), **kwargs)


def _decode(tp: Any, data: Any) -> Any:
    if data is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode(args[0], data) if len(args) == 1 else data
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _decode(hints[f.name], data[f.name])
                     for f in dataclasses.fields(tp) if f.name in data})
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in data)
        return tuple(_decode(a, v) for a, v in zip(args, data, strict=True)) if args else tuple(data)
    if tp is float:  # also "inf" / "-inf", as _encode writes them
        return float(data)
    if tp is Any:
        return _freeze(data)
    return data


def _freeze(data: Any) -> Any:
    """Lists inside Any-typed fields (config values, params) come back as tuples so records hash."""
    if isinstance(data, list):
        return tuple(_freeze(v) for v in data)
    return data


def from_dict(cls: type[T], data: Any) -> T:
    return _decode(cls, data)


def from_json(cls: type[T], text: str) -> T:
    return from_dict(cls, json.loads(text))
