"""Build and launch generated kernels: source file cache, import, output allocation, launch.

Triton's JIT reads a kernel's source with inspect.getsource, so each generated module is a real
file: <cache dir>/<sha256 of the source>.py, written once (atomically) and imported by path. The
cache dir is settings.codegen_dir (SOLFORGE_CODEGEN_DIR), else ~/.cache/solforge/codegen. Imported kernels are kept per
(region key, schedule), so a call after the first pays a dict lookup and the launch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import triton

from solforge import settings
from solforge.codegen import layout
from solforge.codegen.lower import Lowered
from solforge.codegen.schedule import Schedule, heuristic, is_valid, tile_axes, tile_extent
from solforge.codegen.triton_gen import (
    I32_MAX,
    KERNEL,
    Runs,
    generate,
    linear_runs,
    needs_index64,
    passes,
    recorded_runs,
    reductions,
)
from solforge.kernels.launch import launch as _launch

_KERNELS: dict[tuple[str, Schedule, Runs], Any] = {}


def cache_dir() -> Path:
    d = settings.current().codegen_dir
    return d if d is not None else Path.home() / ".cache" / "solforge" / "codegen"


def source_file(source: str) -> Path:
    """The file holding `source` (written if absent): content-addressed, so it never goes stale."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    path = cache_dir() / f"g_{digest[:32]}.py"
    if not path.exists() or path.read_text() != source:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    return path


def stride_aligns(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Per stride argument of a launch (each tensor's dims of size > 1, in order): the largest power
    of two up to 16 that divides it (0: 16). Triton marks an argument divisible by 16 itself, not
    by 4: an NCHW output of H*W = 16900 (4 mod 16) written along W by a transposing tile took
    scalar stores; told that the channel stride is a multiple of 4 (triton_gen.generate's
    `aligns`), 16-byte ones, as Inductor's kernels, whose strides are literals, do."""
    out = []
    for t in tensors:
        for n, st in zip(t.shape, t.stride(), strict=True):
            if n != 1:
                st = abs(st)
                out.append(next(a for a in (16, 8, 4, 2, 1) if st % a == 0))
    return tuple(out)


def kernel(region: Lowered, sched: Schedule, runs: Runs | None = None, aligns: tuple[int, ...] | None = None) -> Any:
    """The @triton.jit kernel of a region under a schedule for tensors of linear runs `runs`
    (triton_gen.linear_runs; default: the strides the region recorded) and stride arguments
    divisible by `aligns` (`stride_aligns`; None: nothing assumed), generated, written and
    imported once."""
    runs = runs if runs is not None else recorded_runs(region)
    key = (region.ir.key, sched, runs, aligns)
    k = _KERNELS.get(key)
    if k is None:
        path = source_file(generate(region, sched, runs, aligns))
        spec = importlib.util.spec_from_file_location(f"solforge_generated_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        k = _KERNELS[key] = getattr(mod, KERNEL)
    return k


def empty_outputs(region: Lowered, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Outputs laid out as the graph's values are (when dense; contiguous otherwise)."""
    outs = []
    for r in region.ir.outputs:
        m = region.ir.out_meta(r)
        stride = m.stride if layout.dense(m.shape, m.stride) else None
        outs.append(torch.empty_strided(m.shape, stride, dtype=m.dtype, device=device) if stride is not None
                    else torch.empty(m.shape, dtype=m.dtype, device=device))
    return tuple(outs)


def _bad(msg: str) -> ValueError:
    return ValueError(f"solforge codegen: {msg}")


def run(region: Lowered, schedule: Schedule | None, inputs: Sequence[torch.Tensor],
        out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Run the generated kernel of `region` under `schedule` (None: the heuristic) on `inputs`
    (shaped and typed as the region's inputs, any strides); returns its outputs (`out` if given)."""
    ir = region.ir
    sched = schedule or heuristic(region)
    if not is_valid(sched, region):
        raise _bad(f"schedule {sched.encode()} is not valid for this region")
    if len(inputs) != len(ir.inputs):
        raise _bad(f"{len(inputs)} inputs for a region of {len(ir.inputs)}")
    for i, (x, m) in enumerate(zip(inputs, ir.inputs, strict=True)):
        if tuple(x.shape) != m.shape or x.dtype != m.dtype:
            raise _bad(f"input {i} is {x.dtype} {tuple(x.shape)}, the region's is {m.dtype} {m.shape}")
    device = inputs[0].device if inputs else torch.device(ir.device)
    outs = tuple(out) if out is not None else empty_outputs(region, device)
    for k, (o, r) in enumerate(zip(outs, ir.outputs, strict=True)):
        m = ir.out_meta(r)
        if tuple(o.shape) != m.shape or o.dtype != m.dtype:
            raise _bad(f"out {k} is {o.dtype} {tuple(o.shape)}, the region's is {m.dtype} {m.shape}")
    if region.space.numel == 0:
        return outs
    if not needs_index64(region):  # the kernel was built with int32 index math: these must fit
        for t in (*inputs, *outs):
            if sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) > I32_MAX:
                raise _bad("a tensor's strides pass int32 for a kernel built for int32 indices")
    args: list[Any] = [*inputs, *outs]
    for t in (*inputs, *outs):
        args += [s for n, s in zip(t.shape, t.stride(), strict=True) if n != 1]
    sp = region.space
    k = kernel(region, sched, tuple(linear_runs(t.shape, t.stride()) for t in (*inputs, *outs)),
               stride_aligns((*inputs, *outs)))
    if not region.reduces and sched.variant == "tiles":
        fast, slow = tile_axes(sched, region)
        ext = tile_extent(region, slow)
        n = triton.cdiv(sp.shape[fast], sched.block) * triton.cdiv(ext, sched.rblock)
        _launch(k, (n * sp.numel // (sp.shape[fast] * ext),), args, {"num_warps": sched.num_warps})
    elif not region.reduces:
        _launch(k, (triton.cdiv(sp.numel, sched.block),), args, {"num_warps": sched.num_warps})
    elif sched.splits > 1:  # split, or split tiles
        # fp32 partials of every reduction: [reduction, split, row]; one launch per stage (an online
        # pair's sum: in its max's), then the stores
        ws = torch.empty(len(reductions(region)) * sched.splits * sp.rows, dtype=torch.float32, device=device)
        per = sched.block if sched.variant == "tiles" else sched.rows
        grid = (triton.cdiv(sp.rows, per) * sched.splits,)
        for phase in range(1, len(passes(region, sched)) + 2):
            _launch(k, grid, [*args, ws], {"num_warps": sched.num_warps, "PHASE": phase})
    elif sched.variant == "tiles":
        _launch(k, (triton.cdiv(sp.rows, sched.block),), args, {"num_warps": sched.num_warps})
    else:
        _launch(k, (triton.cdiv(max(sp.rows, 1), sched.rows),), args, {"num_warps": sched.num_warps})
    return outs
