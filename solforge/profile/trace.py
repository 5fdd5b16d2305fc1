"""Run a callable under torch.profiler and attribute every device kernel to the range that launched it.

The profiler's Chrome trace links each GPU kernel to the CUDA runtime/driver call that launched
it (the same `correlation` number on both events). That call happened on a host thread at a
known time, inside at most one `solforge:<id>|...` range (regions' ranges never nest: a graph
runs its nodes one after the other). So: kernel -> launch -> innermost range -> region. A kernel
launched inside the step but outside every region range (dynamo's wrapper, a graph we could not
lower) is counted as "outside", never dropped.

On the CPU there are no kernels: the top-level ATen ops (cpu_op events not inside another
cpu_op) play their part, each attributed by its own start time.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from solforge.profile.regions import PREFIX, STEP

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclass
class Attribution:
    """Per step (averaged over the profiled steps), in microseconds."""

    region_us: dict[int, float] = field(default_factory=dict)
    region_kernels: dict[int, int] = field(default_factory=dict)
    outside_us: float = 0.0
    outside_kernels: int = 0
    busy_us: float = 0.0
    span_us: float = 0.0
    kernels: int = 0
    unlinked: int = 0  # kernels whose launch is not in the trace: attributed nowhere
    steps: int = 0
    kernel_names: dict[int, list[str]] = field(default_factory=dict)  # region -> a few kernel names

    @property
    def attributed_us(self) -> float:
        return sum(self.region_us.values())


def run_profiled(fn: Callable[[], Any], *, device: str, trace_path: Path, steps: int = 1) -> list[dict[str, Any]]:
    """Profile `steps` calls of `fn` (each inside a `solforge:step` range), write the Chrome trace
    to `trace_path` and return its events."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP):
                fn()
                if device == "cuda":
                    torch.cuda.synchronize()  # the step's kernels end inside the step
    prof.export_chrome_trace(str(trace_path))
    with open(trace_path) as f:
        return list(json.load(f).get("traceEvents", []))


@dataclass
class _Ranges:
    """Flat (non-nested) ranges of one thread, sorted by start, for 'which range holds time t'."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    def add(self, start: float, end: float, rid: int) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.ids.append(rid)

    def sort(self) -> None:
        order = sorted(range(len(self.starts)), key=self.starts.__getitem__)
        self.starts = [self.starts[i] for i in order]
        self.ends = [self.ends[i] for i in order]
        self.ids = [self.ids[i] for i in order]

    def find(self, t: float) -> int | None:
        i = bisect.bisect_right(self.starts, t) - 1
        return self.ids[i] if i >= 0 and t <= self.ends[i] else None


def _region_id(name: str) -> int | None:
    if not name.startswith(PREFIX) or name == STEP:
        return None
    head = name[len(PREFIX):].split("|", 1)[0]
    return int(head) if head.isdigit() else None


def _complete_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


def _top_level_ops(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """cpu_op events not inside another cpu_op of the same thread (nested ops are the same time)."""
    by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in ops:
        by_tid[e.get("tid")].append(e)
    top: list[dict[str, Any]] = []
    for evs in by_tid.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        end = -float("inf")
        for e in evs:
            if float(e["ts"]) >= end:
                top.append(e)
                end = float(e["ts"]) + float(e.get("dur", 0))
    return top


def attribute(events: Iterable[dict[str, Any]], *, gpu: bool) -> Attribution:
    """Attribute device work (GPU kernels, or top-level CPU ops) of the profiled steps to regions."""
    evs = _complete_events(events)
    regions: dict[Any, _Ranges] = defaultdict(_Ranges)
    steps: dict[Any, _Ranges] = defaultdict(_Ranges)
    for e in evs:
        if e.get("cat") != "user_annotation":
            continue
        name = str(e.get("name", ""))
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if name == STEP:
            steps[e.get("tid")].add(start, end, len(steps[e.get("tid")].ids))
        elif (rid := _region_id(name)) is not None:
            regions[e.get("tid")].add(start, end, rid)
    for r in (*regions.values(), *steps.values()):
        r.sort()

    # (tid, launch time, start, duration, name) of every piece of device work
    work: list[tuple[Any, float, float, float, str]] = []
    unlinked = 0
    if gpu:
        launches: dict[Any, tuple[Any, float]] = {}
        # fallback: the profiler also tags a kernel with the External id of the op that launched it
        by_external: dict[Any, tuple[Any, float]] = {}
        for e in evs:
            args = e.get("args") or {}
            cat = str(e.get("cat", ""))
            # cudaLaunchKernel & co. (cuda_runtime) and cuLaunchKernel (cuda_driver: Triton)
            if cat.endswith(("_runtime", "_driver")) and "correlation" in args:
                launches.setdefault(args["correlation"], (e.get("tid"), float(e["ts"])))
            if e.get("cat") == "cpu_op" and "External id" in args:
                by_external.setdefault(args["External id"], (e.get("tid"), float(e["ts"])))
        for e in evs:
            if e.get("cat") not in DEVICE_CATS:
                continue
            args = e.get("args") or {}
            launch = launches.get(args.get("correlation")) or by_external.get(args.get("External id"))
            if launch is None:
                unlinked += 1
                continue
            work.append((launch[0], launch[1], float(e["ts"]), float(e.get("dur", 0)), str(e.get("name", ""))))
    else:
        # operators only ("aten::mm", "solforge::rmsnorm"): dynamo's own spans ("Torch-Compiled
        # Region", "TorchDynamo Cache Lookup") are cpu_op events too, but enclose the graph
        ops = [e for e in evs if e.get("cat") == "cpu_op" and "::" in str(e.get("name", ""))]
        for e in _top_level_ops(ops):
            ts = float(e["ts"])
            work.append((e.get("tid"), ts, ts, float(e.get("dur", 0)), str(e.get("name", ""))))

    att = Attribution(steps=sum(len(s.ids) for s in steps.values()))
    spans: dict[tuple[Any, int], tuple[float, float]] = {}
    for tid, launch, start, dur, name in work:
        step = steps[tid].find(launch)
        if step is None:
            continue  # not part of a profiled step
        att.kernels += 1
        att.busy_us += dur
        first, last = spans.get((tid, step), (start, start + dur))
        spans[(tid, step)] = (min(first, start), max(last, start + dur))
        rid = regions[tid].find(launch)
        if rid is None:
            att.outside_us += dur
            att.outside_kernels += 1
            continue
        att.region_us[rid] = att.region_us.get(rid, 0.0) + dur
        att.region_kernels[rid] = att.region_kernels.get(rid, 0) + 1
        names = att.kernel_names.setdefault(rid, [])
        if name not in names and len(names) < 4:
            names.append(name)
    att.unlinked = unlinked
    att.span_us = sum(b - a for a, b in spans.values())
    n = max(att.steps, 1)
    if n > 1:  # per step
        att.region_us = {k: v / n for k, v in att.region_us.items()}
        att.outside_us /= n
        att.busy_us /= n
        att.span_us /= n
    return att
