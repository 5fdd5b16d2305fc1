"""Validate: the optimized model against the original on fresh inputs, then both timed end to end."""

from __future__ import annotations

import copy
import functools
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from solforge.numerics import dtype_name
from solforge.records import E2EReport, RunResult
from solforge.runtime import distributed
from solforge.tune.timing import time_models

# End-to-end thresholds: errors from a different (fp32) reduction order in one op can flip a
# bf16 rounding, and the flip travels through every later layer, so the bar is the whole model's
# output relative to its scale (‖out - ref‖ / ‖ref‖), not one op's element-wise tolerance.
E2E_REL_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-8}
# Argmax agreement is judged where the original's top-1/top-2 margin is decisive: more than 2% of
# its largest |logit|. Random-weight models tie almost everywhere: on Qwen3-4B (B2 S8192, H100,
# 2026-11-22) torch.compile agreed with eager at 88.1% of all positions and Liger at 88.5%, but at
# 98.97% / 99.31% where the margin was > 0.1 (~2% of the largest logit) and 100% above 0.25.
ARGMAX_MIN_AGREE = 0.99
# Gradients go through the backward of every layer after the first difference, so they are held to
# twice the outputs' bar (the worst parameter, norm-relative).
GRAD_REL_TOL = {k: 2 * v for k, v in E2E_REL_TOL.items()}
DECISIVE_MARGIN = 0.02
# A bf16/fp16 model's own rounding can exceed E2E_REL_TOL on a deep model: on Phi-3-mini's
# dimensions (32 layers, random weights, B2 S4096, H100, 2026-11-25) eager bf16 was 5.30% from
# the same weights computed in fp32, and solforge's and Liger's forwards were 5.59% / 5.30% from
# eager but 4.97% / 5.17% from fp32 (bench/archs.py). Where the optimized model misses the bar
# above, both models are therefore compared with the original computed in fp32 (its parameters
# and floating inputs upcast): the optimized model passes when it is no further from that than
# the original is, within WIDE_SLACK (the two round at different places, so their distances
# differ by chance, by 3-6% in those runs). An fp32 model is compared with the original computed
# in fp64 the same way: its bar (1e-4) is finer than a TF32 convolution's own rounding, and a
# reduction in another order than eager's (KernelBench level 2's Conv3d_Min_Softmax: 1.03e-4 from
# eager, H100, 2026-11-28) missed it.
WIDE_SLACK = 1.1
# E2EReport.status
PASSED, FAILED, NOTHING = "passed", "failed", "nothing to validate"


class NothingToTrain(ValueError):
    """No output of the model carries a gradient: there is no loss to differentiate."""


def flatten_tensors(out: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a model output (tensor, tuple/list, dict, ModelOutput), with a path name."""
    found: list[tuple[str, torch.Tensor]] = []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            found.append((path or "output", x))
        elif isinstance(x, dict):  # transformers' ModelOutput is an OrderedDict
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk(out, "")
    return found


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs_err: float
    max_rel_err: float  # max |a - b| / max |b|
    norm_rel_err: float  # ‖a - b‖ / ‖b‖
    nonfinite: bool  # NaN/Inf in the optimized output where the original had none


def output_error(name: str, out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 25,
                 any_dtype: bool = False) -> OutputError:
    """Errors computed in float64 chunk by chunk, so multi-GB logits need no multi-GB copies. The
    running maxima and sums stay on the device and are read once at the end: a sync per chunk cost
    ~1 s on Qwen3-4B's 2.5e9 logits (H100 host, 2026-11-22). A dtype that differs from the
    reference's is an infinite error, unless `any_dtype` (a bf16 output against an fp32 reference)."""
    if out.shape != ref.shape or (out.dtype != ref.dtype and not any_dtype):
        return OutputError(name, math.inf, math.inf, math.inf, False)
    a, b = out.detach().reshape(-1), ref.detach().reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=a.device)
    max_abs, max_ref, sq_err, sq_ref = zero, zero, zero, zero
    nonfinite = torch.zeros((), dtype=torch.bool, device=a.device)
    for i in range(0, a.numel(), chunk):
        x, y = a[i : i + chunk].double(), b[i : i + chunk].double()
        fin = torch.isfinite(y)  # only where the original is finite: its own NaN/Inf are not errors
        nonfinite = nonfinite | (~torch.isfinite(x) & fin).any()
        d = torch.where(fin, (x - y).abs(), zero)
        yr = torch.where(fin, y.abs(), zero)
        max_abs = torch.maximum(max_abs, d.max())
        max_ref = torch.maximum(max_ref, yr.max())
        sq_err = sq_err + (d * d).sum()
        sq_ref = sq_ref + (yr * yr).sum()
    m_abs, m_ref, e2, r2 = torch.stack([max_abs, max_ref, sq_err, sq_ref]).tolist()
    rel = m_abs / m_ref if m_ref > 0 else (0.0 if m_abs == 0 else math.inf)
    norm_rel = math.sqrt(e2 / r2) if r2 > 0 else (0.0 if e2 == 0 else math.inf)
    return OutputError(name, m_abs, rel, norm_rel, bool(nonfinite))


def argmax_agreement(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float | None]:
    """(agreement at every position, agreement where the reference's top-2 margin is decisive;
    None when no position is)."""
    same = out.argmax(-1) == ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values.float() if ref.shape[-1] > 1 else None
    decisive = None
    if top2 is not None:
        sel = (top2[..., 0] - top2[..., 1]) > DECISIVE_MARGIN * float(ref.detach().abs().max())
        decisive = float(same[sel].float().mean()) if bool(sel.any()) else None
    return float(same.float().mean()), decisive


def _logits(outputs: Sequence[tuple[str, torch.Tensor]]) -> int | None:
    for i, (name, _) in enumerate(outputs):
        if name.split(".")[-1] == "logits":
            return i
    floating = [i for i, (_, t) in enumerate(outputs) if t.dtype.is_floating_point and t.dim() >= 2]
    return floating[0] if floating else None


Params = Sequence[tuple[str, torch.nn.Parameter]]
# what the optimized model returns of an output of the original (the skip_logits option: no logits)
View = Callable[[Any], Any]


def _viewed(fn: Callable[..., Any], view: View | None) -> Callable[..., Any]:
    if view is None:
        return fn
    return lambda *args: view(fn(*args))


def train_loss(out: Any, seed: int = 0) -> torch.Tensor:
    """The loss the train-mode check differentiates: each floating output that carries a gradient,
    projected on a fixed random direction (seeded, the same for both models), in fp32.

    Not the mean square of the last hidden state that BASELINES.md times: behind a final RMSNorm
    with unit weights that loss is nearly constant (the norm fixes the RMS), so the gradients
    below the norm are rounding noise: on a bf16 Qwen3 (2 layers, B1 S4096, H100, 2026-11-22) eager
    and solforge differed by up to 140% there while agreeing on the final norm's weight; a random
    projection gives every path a real gradient."""
    ts = [t for _, t in flatten_tensors(out) if t.dtype.is_floating_point and t.requires_grad]
    if not ts:
        raise NothingToTrain("no output of the model carries a gradient: nothing to train")
    total = torch.zeros((), dtype=torch.float32, device=ts[0].device)
    for i, t in enumerate(ts):
        g = torch.Generator(device=t.device).manual_seed(seed + i)
        # drawn in fp32 and rounded to bf16 whatever t's dtype: the same direction for the original,
        # the optimized model and the original computed in fp32 (_wide)
        direction = torch.randn(t.shape, generator=g, device=t.device).to(torch.bfloat16).float()
        total = total + (t.float() * direction).sum() / max(1, t.numel()) ** 0.5
    return total


# Both models draw their random numbers (dropout in training) from generators reset to this seed,
# each run in a forked RNG state so the caller's own stream is left as it was: a model that draws
# the same numbers in the same order (the optimized graph keeps every random op of the original,
# in order) then computes the same function, and a difference is the kernels'.
COMPARE_SEED = 0x5F0F


def _seeded(fn: Callable[[], Any], device: str) -> Any:
    devices = [torch.cuda.current_device()] if device == "cuda" and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(COMPARE_SEED)
        return fn()


def _clocked(fn: Callable[[], Any], device: str, wall: list[float]) -> Any:
    """_seeded, its wall time (µs) appended to `wall`. Off the GPU these runs are also the timed ones:
    the interpreter's times mean nothing, and a run of the optimized model there costs seconds."""
    t = time.perf_counter()
    out = _seeded(fn, device)
    wall.append((time.perf_counter() - t) * 1e6)
    return out


def _step(fn: Callable[..., Any], inputs: Sequence[Any], params: Params) -> tuple[Any, dict[str, torch.Tensor]]:
    """One forward and backward; returns the outputs and a copy of every parameter's gradient (of
    a sharded parameter's, its local shard: runtime/distributed.py)."""
    for _, p in params:
        p.grad = None
    out = fn(*inputs)
    train_loss(out).backward()
    grads = {n: distributed.local(p.grad).detach().clone() for n, p in params if p.grad is not None}
    for _, p in params:
        p.grad = None
    return out, grads


@dataclass(frozen=True)
class WideCheck:
    """Both models against the original computed wider (`_wide`: fp32, fp64 for an fp32 model):
    each output's norm-relative error (name, original's, optimized's), and the largest over the
    parameter gradients (train mode; the bar above is on the worst parameter too)."""

    outputs: tuple[tuple[str, float, float], ...]
    grad_original: float | None = None
    grad_optimized: float | None = None
    lean: bool = False  # the fp32 run went block by block (`_wide`: the whole did not fit)

    @property
    def original(self) -> float:
        return max((a for _, a, _ in self.outputs), default=0.0)

    @property
    def optimized(self) -> float:
        return max((b for _, _, b in self.outputs), default=0.0)

    def output_ok(self, name: str) -> bool:
        """The output is no further from the fp32 computation than the original's (WIDE_SLACK)."""
        return any(n == name and b <= WIDE_SLACK * a for n, a, b in self.outputs)

    def grads_ok(self) -> bool:
        return self.grad_optimized is None or self.grad_optimized <= WIDE_SLACK * (self.grad_original or 0.0)


def _upcast(x: Any, wide: torch.dtype = torch.float32) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(wide) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _upcast(v, wide) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_upcast(v, wide) for v in x)
    return x


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `_wide` computes the original in: fp64 for an fp32 model, fp32 for bf16/fp16."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _wide(original: torch.nn.Module, inputs: Sequence[Any], device: str, params: Params | None,
          ref_out: Sequence[tuple[str, torch.Tensor]], opt_out: Sequence[tuple[str, torch.Tensor]],
          ref_g: dict[str, torch.Tensor] | None, opt_g: dict[str, torch.Tensor] | None,
          view: View | None = None, wide: torch.dtype = torch.float32) -> WideCheck | str:
    """The original run once more in fp32 (`wide`: fp64 for an fp32 model): a copy whose floating
    parameters and buffers are fp32 copies of the original's (made directly, never a second copy
    in the model's dtype), on the inputs upcast likewise, from the same seed. Returns both models'
    distances from it, or why it could not run (out of memory, a model that cannot be copied).

    A run that does not fit runs again lean, block by block (the blocks of the model's outermost
    nn.ModuleLists: a transformer's layers). Same numbers, less memory:
    - a training step (a 7B model's fp32 step needs ~110 GB): `ref_g` and `opt_g` move to host
      memory (this moves the caller's dicts' tensors), the blocks run under activation
      checkpointing, and each fp32 gradient is compared as soon as it is made, then freed
      (`_lean_grads`);
    - a forward (a 14B model's fp32 copy needs 56 GB beside its own 28): each block's weights are
      made fp32 for its forward only (`_fp32_block_by_block`)."""
    for lean in (False, True):
        if lean:
            for grads in (ref_g, opt_g) if params is not None else ():
                for n in grads or {}:
                    grads[n] = grads[n].cpu()
        try:
            return _wide_check(original, inputs, device, params, ref_out, opt_out, ref_g, opt_g, lean=lean,
                               view=view, wide=wide)
        except torch.OutOfMemoryError:
            pass  # tried lean next, once this frame's tensors are gone with the exception
        except (RuntimeError, TypeError, copy.Error) as e:  # a model that cannot be copied or run in fp32
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            _release(device)
    return f"out of memory for an {dtype_name(wide)} copy of the model, even block by block"


def _release(device: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _dist(n: str, t: torch.Tensor, w: torch.Tensor) -> float:
    return output_error(n, t.to(w.device), w, any_dtype=True).norm_rel_err


def _wide_check(original: torch.nn.Module, inputs: Sequence[Any], device: str, params: Params | None,
                ref_out: Sequence[tuple[str, torch.Tensor]], opt_out: Sequence[tuple[str, torch.Tensor]],
                ref_g: dict[str, torch.Tensor] | None, opt_g: dict[str, torch.Tensor] | None,
                lean: bool, view: View | None = None, wide: torch.dtype = torch.float32) -> WideCheck | str:
    out, gd = _run_fp32(original, inputs, device, params, ref_g, opt_g, lean, view=view, wide=wide)
    wide_out = flatten_tensors(out)
    if [n for n, _ in wide_out] != [n for n, _ in ref_out]:
        return f"its {dtype_name(wide)} run returned a different output structure"
    triples = zip(wide_out, ref_out, opt_out, strict=True)
    outputs = tuple((n, _dist(n, r, w), _dist(n, o, w)) for (n, w), (_, r), (_, o) in triples if w.is_floating_point())
    return WideCheck(outputs, None if gd is None else max((a for a, _ in gd), default=0.0),
                     None if gd is None else max((b for _, b in gd), default=0.0), lean)


def _run_fp32(original: torch.nn.Module, inputs: Sequence[Any], device: str, params: Params | None,
              ref_g: dict[str, torch.Tensor] | None, opt_g: dict[str, torch.Tensor] | None,
              lean: bool, view: View | None = None,
              wide: torch.dtype = torch.float32) -> tuple[Any, list[tuple[float, float]] | None]:
    """_wide's run: the outputs of an fp32 copy of the original (freed on return) and, with
    `params`, each parameter gradient's distances (the original's, the optimized model's) from its."""
    model32 = _fp32_block_by_block(original, wide) if lean and params is None else _fp32_copy(original, set(), wide)
    inputs32 = _upcast(tuple(inputs), wide)
    run32 = _viewed(model32, view)
    if params is None:
        return _seeded(lambda: run32(*inputs32), device), None
    assert ref_g is not None and opt_g is not None
    named = dict(model32.named_parameters())
    params32 = [(n, named[n]) for n, _ in params]
    with torch.enable_grad():
        if not lean:
            out, wide_g = _seeded(lambda: _step(run32, inputs32, params32), device)
            return out, [(_dist(n, ref_g[n], g), _dist(n, opt_g[n], g)) for n, g in wide_g.items()]
        checkpoint_blocks(model32)
        return _seeded(lambda: _lean_grads(run32, inputs32, params32, ref_g, opt_g), device)


def _fp32_copy(original: torch.nn.Module, keep: set[int], wide: torch.dtype = torch.float32) -> torch.nn.Module:
    """A copy of `original` whose floating parameters and buffers are fp32 copies of its own (made
    directly, never a second copy in the model's dtype), except those in `keep` (ids), shared."""
    memo: dict[int, Any] = {}
    for t in [*original.parameters(), *original.buffers()]:
        if id(t) in memo:
            continue
        if not t.is_floating_point() or id(t) in keep:
            memo[id(t)] = t
            continue
        w = t.detach().to(wide)
        memo[id(t)] = torch.nn.Parameter(w, t.requires_grad) if isinstance(t, torch.nn.Parameter) else w
    return copy.deepcopy(original, memo)


def outer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of the model's outermost nn.ModuleLists (a transformer's layers)."""
    lists: list[str] = []
    blocks: list[torch.nn.Module] = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and not any(o == "" or name.startswith(f"{o}.") for o in lists):
            lists.append(name)
            blocks += list(m)
    return blocks


def checkpoint_blocks(model: torch.nn.Module) -> int:
    """Run each of `outer_blocks` under non-reentrant activation checkpointing: a block keeps only
    its inputs for the backward, which runs its forward again. Returns how many blocks; for a copy
    of the model (it sets `forward`)."""
    from torch.utils.checkpoint import checkpoint

    blocks = outer_blocks(model)
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)


def _fp32_block_by_block(original: torch.nn.Module, wide: torch.dtype = torch.float32) -> torch.nn.Module:
    """For a forward without autograd: a copy of `original` that computes what `_fp32_copy`'s
    does, holding one block's fp32 weights at a time. The blocks' own tensors stay shared with the
    original (no copy) and are swapped for fp32 copies from the block's forward pre-hook to its
    forward hook; every other floating tensor (embeddings, the head, tensors a block shares with
    the rest) is an fp32 copy throughout."""
    blocks = outer_blocks(original)
    inside = {id(t) for b in blocks for t in [*b.parameters(), *b.buffers()]}
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    for m in original.modules():
        if id(m) not in in_blocks:
            inside -= {id(t) for t in [*m._parameters.values(), *m._buffers.values()] if t is not None}
    model = _fp32_copy(original, inside, wide)
    for block in outer_blocks(model):
        held: list[tuple[dict[str, Any], str, torch.Tensor]] = []

        def upcast(_m: torch.nn.Module, _args: Any, held: list = held, block: torch.nn.Module = block) -> None:
            for m in block.modules():
                for slots in (m._parameters, m._buffers):
                    for name, t in slots.items():
                        if t is not None and t.is_floating_point() and t.dtype != wide:
                            held.append((slots, name, t))
                            slots[name] = t.detach().to(wide)

        def restore(_m: torch.nn.Module, _args: Any, _out: Any, held: list = held) -> None:
            while held:
                slots, name, t = held.pop()
                slots[name] = t

        block.register_forward_pre_hook(upcast)
        block.register_forward_hook(restore)
    return model


def _lean_grads(model: Callable[..., Any], inputs: Sequence[Any], params: Params, ref_g: dict[str, torch.Tensor],
                opt_g: dict[str, torch.Tensor]) -> tuple[Any, list[tuple[float, float]]]:
    """_step for the fp32 copy, with each gradient compared as soon as it is accumulated (the
    original's and the optimized model's distances from it), then freed."""
    dists: list[tuple[float, float]] = []

    def consume(n: str, p: torch.Tensor) -> None:
        if p.grad is not None and n in ref_g and n in opt_g:
            dists.append((_dist(n, ref_g[n], p.grad), _dist(n, opt_g[n], p.grad)))
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(functools.partial(consume, n)) for n, p in params]
    try:
        out = model(*inputs)
        train_loss(out).backward()
    finally:
        for h in hooks:
            h.remove()
    return out, dists


def _peak_gb(fn: Callable[[], Any], device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 1e9, 2)


def validate(original: Callable[..., Any], optimized: Callable[..., Any], inputs: Sequence[Any], *,
             dtype: torch.dtype, device: str, is_language_model: bool, time_it: bool = True,
             params: Params | None = None, settled: Callable[[], bool] | None = None,
             view: View | None = None) -> E2EReport:
    """`_validate`, its result agreed across the ranks under torch.distributed (every rank calls it
    with its own inputs: runtime/distributed.py)."""
    return distributed.agree(_validate(original, optimized, inputs, dtype=dtype, device=device,
                                       is_language_model=is_language_model, time_it=time_it, params=params,
                                       settled=settled, view=view))


def _validate(original: Callable[..., Any], optimized: Callable[..., Any], inputs: Sequence[Any], *,
              dtype: torch.dtype, device: str, is_language_model: bool, time_it: bool = True,
              params: Params | None = None, settled: Callable[[], bool] | None = None,
              view: View | None = None) -> E2EReport:
    """Compare outputs (and, with `params`, i.e. in train mode, the parameters' gradients of
    `train_loss`) and time both models: forwards, or whole training steps with `params`. Each
    compared run starts from the same RNG seed (COMPARE_SEED), so dropout draws the same masks.
    `settled`: whether the optimized model runs as its later calls will (its CUDA-graph replays
    judged: stepgraphs.py); it is timed once it does (tune.timing.time_models, both models' calls
    interleaved). `view`: what the
    optimized model shows of an output of the original, applied to the original's (and its fp32
    copy's) outputs before they are compared or differentiated (skip_logits: runtime/logits.py)."""
    train = params is not None
    run = _viewed(original, view)
    wall: list[float] = []  # µs of the compared runs: the original's, the optimized model's
    with torch.set_grad_enabled(train):
        grad_err: float | None = None
        if train:
            assert params is not None
            try:
                ref_raw, ref_g = _clocked(lambda: _step(run, inputs, params), device, wall)
            except NothingToTrain:
                return _nothing("the model returned no tensor that carries a gradient", device)
            opt_raw, opt_g = _clocked(lambda: _step(optimized, inputs, params), device, wall)
            if set(ref_g) != set(opt_g):
                return E2EReport(None, None, None, math.inf, math.inf, None, False, status=FAILED,
                                 note="the optimized model's backward reached different parameters")
            grad_err = max((output_error(n, opt_g[n], g).norm_rel_err for n, g in ref_g.items()), default=0.0)
        else:
            ref_raw = _clocked(lambda: run(*inputs), device, wall)
            opt_raw = _clocked(lambda: optimized(*inputs), device, wall)
            ref_g = opt_g = None
        ref_out, opt_out = flatten_tensors(ref_raw), flatten_tensors(opt_raw)
        del ref_raw, opt_raw
        if len(ref_out) != len(opt_out) or [n for n, _ in ref_out] != [n for n, _ in opt_out]:
            return E2EReport(None, None, None, math.inf, math.inf, None, False, status=FAILED,
                             note="the optimized model returned a different output structure")
        if not ref_out:  # None, or plain Python values: zero outputs compared is not a pass
            return _nothing("the model returned no tensor (None or plain values)", device)
        errors = [output_error(n, o, r) for (n, o), (_, r) in zip(opt_out, ref_out, strict=True)]
        agree = decisive = None
        if is_language_model and (i := _logits(ref_out)) is not None:
            agree, decisive = argmax_agreement(opt_out[i][1], ref_out[i][1])
        tol = E2E_REL_TOL.get(dtype, 5e-2)
        grad_tol = GRAD_REL_TOL.get(dtype, 1e-1)
        bad = [e for e in errors if e.nonfinite or e.norm_rel_err > tol]
        judged = decisive if decisive is not None else agree
        grads_ok = grad_err is None or grad_err <= grad_tol
        note = None
        wide: WideCheck | None = None
        wide_t = wide_dtype(dtype)
        if (bad or not grads_ok) and not any(e.nonfinite for e in bad) and dtype in (torch.bfloat16, torch.float16,
                                                                                    torch.float32):
            # past the bar: is the original's own rounding the larger part? (WIDE_SLACK) Not under
            # torch.distributed: each rank would decide on its own numbers to run the fp32 copy
            # (a sharded model's calls gather across the ranks)
            checked = ("torch.distributed: not run on one rank's numbers" if distributed.active()
                       else _wide(original, inputs, device, params, ref_out, opt_out, ref_g, opt_g, view, wide_t)
                       if isinstance(original, torch.nn.Module) else "the original is not a module")
            if isinstance(checked, WideCheck):
                wide = checked
                was = ([f"outputs past the {tol:g} bar"] if bad else []) + (
                    [] if grads_ok else [f"gradients past the {grad_tol:g} bar"])
                bad = [e for e in bad if not checked.output_ok(e.name)]  # each output on its own
                grads_ok = grads_ok or checked.grads_ok()
                if not bad and grads_ok:
                    note = (f"{' and '.join(was)}, but no further from the original computed in "
                            f"{dtype_name(wide_t)} than the original itself: {_wide_text(checked)}")
                else:
                    note = (f"further from the original computed in {dtype_name(wide_t)} than the original "
                            f"itself: {_wide_text(checked)}")
            else:
                note = f"no {dtype_name(wide_t)} comparison ({checked})"
        del ref_out, opt_out, ref_g, opt_g
        passed = not bad and grads_ok and (judged is None or judged >= ARGMAX_MIN_AGREE)
        if passed:
            note = note if wide is not None else None
        elif not grads_ok:
            note = _join(f"parameter gradients: relative error {grad_err:.3g} > {grad_tol:g}", note)
        elif bad:
            e = bad[0]
            note = _join(f"{e.name}: " + ("NaN/Inf where the original is finite" if e.nonfinite
                                          else f"relative error {e.norm_rel_err:.3g} > {tol:g}"), note)
        elif judged is not None and judged < ARGMAX_MIN_AGREE:
            note = _join(f"argmax agrees at {judged:.2%} of the positions with a decisive margin "
                         f"(< {ARGMAX_MIN_AGREE:.0%})", note)
        base = opt = RunResult(error="not timed")
        peaks: tuple[float | None, float | None] = (None, None)
        if time_it and device != "cuda":  # the interpreter: the compared runs were the timed ones
            base, opt = (RunResult(w, w, w, meaningful=False) for w in wall)
        elif time_it:
            # under torch.distributed every rank times the same number of calls (each call of a
            # sharded model gathers across the ranks): no early stop, no warm-up until settled
            fixed: dict[str, Any] = {}
            if distributed.active():
                fixed = {"runs": 5, "min_runs": 5, "steady": -1.0, "max_seconds": math.inf}
                settled = None
            if train:
                assert params is not None
                runs = [lambda f=f: _step(f, inputs, params) for f in (run, optimized)]
                peaks = (_peak_gb(runs[0], device), _peak_gb(runs[1], device))
            else:
                runs = [lambda f=f: f(*inputs) for f in (run, optimized)]
            base, opt = time_models(runs, device, settled=[None, settled], **fixed)  # interleaved
    ms = lambda r: r.p50_us / 1e3 if r.ok else None  # noqa: E731
    speedup = base.p50_us / opt.p50_us if base.ok and opt.ok else None
    return E2EReport(
        baseline_ms=ms(base), optimized_ms=ms(opt), speedup=speedup,
        max_abs_err=max((e.max_abs_err for e in errors), default=0.0),
        max_rel_err=max((e.max_rel_err for e in errors), default=0.0),
        argmax_agree=agree, argmax_agree_decisive=decisive, passed=passed, timings_meaningful=device == "cuda",
        outputs_compared=len(errors), note=note, grads_compared=len(params or ()) if train else 0,
        grad_max_rel_err=grad_err, baseline_peak_gb=peaks[0], optimized_peak_gb=peaks[1],
        fp32_err_original=None if wide is None else wide.original,
        fp32_err_optimized=None if wide is None else wide.optimized,
        fp32_grad_err_original=None if wide is None else wide.grad_original,
        fp32_grad_err_optimized=None if wide is None else wide.grad_optimized,
        status=PASSED if passed else FAILED,
    )


def _nothing(why: str, device: str) -> E2EReport:
    return E2EReport(None, None, None, 0.0, 0.0, None, False, status=NOTHING, timings_meaningful=device == "cuda",
                     note=f"{why}: nothing to compare, so the optimized model is not validated (what it "
                          "writes into buffers or inputs is not checked)")


def _wide_text(w: WideCheck) -> str:
    text = f"outputs {w.optimized:.3g} against the original's {w.original:.3g}"
    if w.grad_optimized is not None:
        text += f", gradients {w.grad_optimized:.3g} against {w.grad_original:.3g}"
    text += f" (allowed: {WIDE_SLACK:g}x)"
    return text + (", its wide run block by block (out of memory whole)" if w.lean else "")


def _join(first: str, then: str | None) -> str:
    return first if then is None else f"{first}; {then}"
