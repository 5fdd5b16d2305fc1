"""Kernel launches with less host time: every solforge launcher calls `launch` instead of
`kernel[grid](*args, **constexprs)`.

Triton's `kernel[grid](...)` binds the arguments and re-derives the specialization of every one of
them (dtype and 16-byte alignment of tensors, int32/int64 range, == 1 and % 16 of ints) on every
call: 17-23 us a launch on the H100 host we measured, against 6.5 us for calling the compiled
kernel's launcher (`CompiledKernel.run`) directly. `launch` takes Triton's path the first time it
sees a combination and keeps the CompiledKernel Triton returned, under a key that holds everything
Triton's choice of kernel can depend on; later calls with the same key call `CompiledKernel.run`
with the argument list Triton 3.6 builds itself (runtime/jit.py, `JITFunction.run`):

    run(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata,
        launch_enter_hook, launch_exit_hook, *every parameter's value in signature order)

where "every parameter" includes the constexprs and None arguments (the generated launcher skips
them) and defaults of parameters not passed. For a kernel without scratch memory the hit calls
the generated C launcher under `run` itself (`_runner`).

The key: the kernel (by identity), the grid, the constexpr/option kwargs with their types (True and
1 and 1.0 are equal in Python but not to Triton), the current device, and per positional argument
  - tensor: dtype and data_ptr() % 16 (Triton specializes pointers on % 16 == 0 only),
  - int: its exact value (Triton looks at == 1, % 16 and the int32/int64/uint64 range),
  - float: its type only (always passed as fp32, never specialized), bool: (bool, value), None.
Every one is at least as strict as Triton's own specialization, so a hit launches exactly the
kernel Triton would pick. Anything else (a tensor among the kwargs, an unknown argument type, an
async compile) takes Triton's path every time.

The direct path is taken only on Triton 3.6.x (CompiledKernel.run's argument list is internal),
not under the interpreter, with no launch hooks installed (profilers such as proton add them: while
they are there, every launch goes through Triton so they see it; torch.profiler's CUPTI records the
direct launches as well), and without Triton's debug or instrumentation knobs. Unlike Triton, the
direct path does not re-check that the kernel's global variables kept their values.
SOLFORGE_DIRECT_LAUNCH=0 in the environment (settings.direct_launch; kept in `_ENABLED`, read on every
launch) or `set_enabled(False)` turns it off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import triton
from triton.knobs import HookChain

from solforge import settings

# Many distinct keys come from varying row counts (sequence lengths); past this many entries the
# cache starts over rather than growing without bound.
MAX_ENTRIES = 4096

_SUPPORTED = triton.__version__.startswith("3.6.") and not triton.knobs.runtime.interpret
_ENABLED = True
_ON = _SUPPORTED

_runtime = triton.knobs.runtime
_compilation = triton.knobs.compilation
_get_device: Any = None  # torch's current-device getter, set at the first fill (needs CUDA)
_get_stream: Any = None

# key -> (kernel, run, the values between the stream and the args, grid_0, grid_1, grid_2, values
# after the args)
_Entry = tuple[Any, Any, tuple[Any, ...], int, int, int, tuple[Any, ...]]
_CACHE: dict[tuple[Any, ...], _Entry] = {}
_SLOW = [0]  # launches that went through Triton while the direct path was on (tests, benchmarks)
_Tensor = torch.Tensor


class _Uncacheable(Exception):
    """An argument whose specialization the key cannot vouch for: Triton's path, always."""


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`, for persistent and grid-stride launches. Under the
    interpreter (CPU tensors) a small fake count, so those loops really stride in CPU tests."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` may use programmatic dependent launch (Hopper and later): a
    kernel launched with `launch_pdl=True` may be scheduled before the kernel ahead of it in the
    stream has finished, and must `gdc_wait()` before reading what that kernel wrote; the one
    ahead may call `gdc_launch_dependents()` to let it start early. Off for the interpreter, and
    with SOLFORGE_PDL=0 in the environment (settings.pdl; cached per device, so the cache is
    cleared whenever the settings change)."""
    if not settings.current().pdl:
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def enabled() -> bool:
    """Whether launches may take the direct path (Triton 3.6, no interpreter, not switched off)."""
    return _ON


def set_enabled(on: bool) -> bool:
    """Switch the direct path on or off (off: every launch through Triton); returns the previous
    switch (what was asked, not whether the path is supported, so that `set_enabled(prev)` restores
    it on every machine). Switching on has no effect where it is not supported."""
    global _ON, _ENABLED
    prev = _ENABLED
    _ENABLED = bool(on)
    _ON = _SUPPORTED and _ENABLED
    return prev


def _follow(s: settings.Settings) -> None:
    set_enabled(s.direct_launch)
    pdl.cache_clear()


settings.follow(_follow, "direct_launch", "pdl")


def clear() -> None:
    """Forget every cached launch."""
    _CACHE.clear()


def cache_size() -> int:
    return len(_CACHE)


def slow_launches() -> int:
    """How many launches went through Triton's path while the direct path was on: a repeated
    call that adds none took the direct path for every kernel it launched."""
    return _SLOW[0]


def _other_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):  # a subclass (nn.Parameter)
        return a.dtype, a.data_ptr() & 15
    t = type(a)
    if t is float:
        return float
    if a is None:
        return None
    if t is bool:
        return bool, a
    raise _Uncacheable(t)


def arg_key(args: Sequence[Any]) -> tuple[Any, ...]:
    """What Triton's specialization of the positional arguments can depend on (see the module
    doc). Distinct kinds never compare equal: ints are bare, tensors (dtype, alignment) pairs,
    floats the type `float`, bools (bool, value). Written out rather than mapped over a function:
    this runs on every launch (1.3 us for 13 arguments on a 2-core CPU, against 2.0 mapped)."""
    out = []
    for a in args:
        t = type(a)
        if t is int:
            out.append(a)
        elif t is _Tensor:
            out.append((a.dtype, a.data_ptr() & 15))
        else:
            out.append(_other_key(a))
    return tuple(out)


def _kwargs_key(constexprs: Mapping[str, Any]) -> tuple[Any, ...]:
    # with the types: True, 1 and 1.0 are equal in Python but specialize differently
    return tuple(constexprs.items()), tuple(map(type, constexprs.values()))


class Meta(dict):  # type: ignore[type-arg]
    """A kernel's constexprs and launch options, frozen, with their part of the key computed
    once: what a launcher's cached plan should hold (a plain dict works too, at ~0.5 us a launch
    on a 2-core CPU for its key). Every mutating method raises, so the key cannot go stale."""

    __slots__ = ("key",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key = _kwargs_key(self)

    def _frozen(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("launch.Meta is frozen: build a new one")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _frozen  # type: ignore[assignment]

    def __or__(self, other: Any) -> Meta:  # type: ignore[override]
        return Meta({**self, **other})

    def __reduce__(self) -> Any:
        return Meta, (dict(self),)


def launch_key(kernel: Any, grid: tuple[int, ...], args: Sequence[Any], constexprs: Mapping[str, Any],
               device: int) -> tuple[Any, ...]:
    """The cache key of one launch (raises _Uncacheable). Public for tests."""
    mk = constexprs.key if type(constexprs) is Meta else _kwargs_key(constexprs)  # type: ignore[attr-defined]
    return id(kernel), grid, device, mk, arg_key(args)


def _quiet() -> bool:
    """No launch hooks (Triton 3.6 keeps them in HookChains; older code may assign a function)
    and no debug/instrumentation mode, which would change the kernel Triton compiles."""
    enter, leave = _runtime.launch_enter_hook, _runtime.launch_exit_hook
    return ((enter is None or (type(enter) is HookChain and not enter.calls))
            and (leave is None or (type(leave) is HookChain and not leave.calls))
            and not _runtime.debug and not _compilation.instrumentation_mode)


def launch(kernel: Any, grid: tuple[int, ...], args: Sequence[Any], constexprs: Mapping[str, Any]) -> None:
    """`kernel[grid](*args, **constexprs)`, directly through the compiled kernel when this exact
    specialization was launched before. `args`: the runtime arguments, positionally, in the
    kernel's order; `constexprs`: the constexpr parameters and launch options (num_warps, ...)."""
    if _ON:
        try:
            key = launch_key(kernel, grid, args, constexprs, _get_device()) if _get_device is not None else None
        except (_Uncacheable, TypeError):  # TypeError: an unhashable kwarg value
            key = None
        if key is not None:
            hit = _CACHE.get(key)
            if hit is not None and hit[0] is kernel and _quiet():
                _, run, head, g0, g1, g2, tail = hit
                run(g0, g1, g2, _get_stream(key[2]), *head, *args, *tail)
                return
        _SLOW[0] += 1
        compiled = kernel[grid](*args, **constexprs)
        _fill(key, kernel, grid, args, constexprs, compiled)
        return
    kernel[grid](*args, **constexprs)


def _fill(key: tuple[Any, ...] | None, kernel: Any, grid: tuple[int, ...], args: Sequence[Any],
          constexprs: Mapping[str, Any], compiled: Any) -> None:
    """Remember a launch Triton just made, if it can be repeated exactly."""
    global _get_device, _get_stream
    if _get_device is None:  # the first launch: CUDA is up now
        drv = triton.runtime.driver.active
        _get_stream = drv.get_current_stream
        # torch.cuda.current_device is _lazy_init() + this; CUDA is initialized by now
        _get_device = getattr(torch._C, "_cuda_getDevice", drv.get_current_device)
        try:
            key = launch_key(kernel, grid, args, constexprs, _get_device())
        except (_Uncacheable, TypeError):
            return
    if key is None or compiled is None or not hasattr(compiled, "packed_metadata") or not 1 <= len(grid) <= 3:
        return
    params = getattr(kernel, "params", None)
    if getattr(kernel, "pre_run_hooks", None):  # Triton calls them on every launch
        return
    if params is None or len(args) > len(params) or any(isinstance(v, torch.Tensor) for v in constexprs.values()):
        return
    # A constexpr passed positionally specializes on its value: the key holds a float's type only.
    if any(p.is_constexpr and type(a) is float for p, a in zip(params, args, strict=False)):
        return
    tail = []
    for p in params[len(args):]:
        if p.name in constexprs:
            tail.append(constexprs[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:  # a parameter Triton would have refused: nothing to repeat
            return
    g = (*grid, 1, 1)
    run, head = _runner(compiled)
    if len(_CACHE) >= MAX_ENTRIES:
        _CACHE.clear()
    _CACHE[key] = (kernel, run, head, g[0], g[1], g[2], tuple(tail))


def _runner(compiled: Any) -> tuple[Any, tuple[Any, ...]]:
    """What a hit calls, and the values it passes between the stream and the kernel's arguments.
    `CompiledKernel.run` is Triton's CudaLauncher, whose `__call__` allocates the kernel's scratch
    buffers (none for most kernels) and calls the generated C launcher with the launch options
    added: (function, cooperative grid, PDL, global scratch, profile scratch, packed metadata,
    launch metadata, enter hook, exit hook). With no scratch to allocate, a hit calls the C
    launcher itself, with those values fixed: one Python frame and two calls fewer a launch."""
    run = compiled.run
    function, metadata = compiled.function, compiled.packed_metadata
    c_launch = getattr(run, "launch", None)
    if (type(run).__name__ == "CudaLauncher" and callable(c_launch)
            and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")):
        return c_launch, (function, run.launch_cooperative_grid, run.launch_pdl, None, None, metadata, None, None,
                          None)
    return run, (function, metadata, None, None, None)


class Bound:
    """One call site's launch with its key worked out once (`bind`). A call passes the arguments in
    the kernel's order, as `launch` gets them; every int, bool and None among them must be the
    value it was bound with, each float a float, each tensor of the bound dtype (the caller's
    contract: a site that checked its inputs' shapes and dtypes passes the ints it derived from
    them). What may change from call to call is checked: the tensors' 16-byte alignment, launch
    hooks, the direct path being on. Otherwise the launch goes through `launch`."""

    __slots__ = ("kernel", "grid", "constexprs", "run", "head", "g0", "g1", "g2", "tail", "device", "tensors")

    def __init__(self, kernel: Any, grid: tuple[int, ...], constexprs: Mapping[str, Any], entry: _Entry,
                 device: int, tensors: tuple[int, ...]) -> None:
        self.kernel, self.grid, self.constexprs = kernel, grid, constexprs
        _, self.run, self.head, self.g0, self.g1, self.g2, self.tail = entry
        self.device, self.tensors = device, tensors

    def __call__(self, *args: Any) -> None:
        ptrs = 0
        for i in self.tensors:
            ptrs |= args[i].data_ptr()
        if not ptrs & 15 and _ON and _quiet():
            self.run(self.g0, self.g1, self.g2, _get_stream(self.device), *self.head, *args, *self.tail)
        else:
            launch(self.kernel, self.grid, args, self.constexprs)


def bind(kernel: Any, grid: tuple[int, ...], args: Sequence[Any], constexprs: Mapping[str, Any]) -> Bound | None:
    """A `Bound` launch of what `launch(kernel, grid, args, constexprs)` just launched through the
    direct path, for a site that will launch it again with arguments of the same kinds. None where
    there is nothing to bind: the direct path off, the launch not cached, a tensor argument not
    16-byte aligned, or an argument the key does not hold by value."""
    if not _ON or _get_device is None:
        return None
    try:
        device = _get_device()
        key = launch_key(kernel, grid, args, constexprs, device)
    except (_Uncacheable, TypeError):
        return None
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not kernel:
        return None
    tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    if any(args[i].data_ptr() & 15 for i in tensors):
        return None
    return Bound(kernel, grid, constexprs, hit, device, tensors)


def _no_device() -> int:
    return -1  # what get_device() says of a CPU tensor


def empty_strided(device: torch.device) -> tuple[Callable[[tuple[int, ...], tuple[int, ...], torch.dtype],
                                                          torch.Tensor], Callable[[], int]]:
    """For a call site that allocates its outputs by (shape, strides, dtype) on `device`: the
    fastest allocator torch has for it (the one inductor's generated code calls, without the
    dispatcher), and the getter of the current device, which the caller must check equals
    `device`'s index first (the CUDA allocator allocates on the current device; on the CPU the
    getter says -1, as a CPU tensor's get_device() does)."""
    guards = getattr(torch._C._dynamo, "guards", None)
    if device.type == "cuda":
        fast = getattr(guards, "_empty_strided_cuda", None)
        now = torch._C._cuda_getDevice
    else:
        fast = getattr(guards, "_empty_strided_cpu", None) if device.type == "cpu" else None
        now = _no_device
    if fast is None:
        def fast(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return fast, now
