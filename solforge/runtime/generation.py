"""Generation through the optimized model: `optimized.generate(...)`.

The model optimized in place (runtime/inplace.py) runs solforge's graphs whenever it is called,
transformers' generate included; this module's generate, installed as the model's own, adds the
cache handling below. Where the optimized call is not installed (`optimize(..., inplace=False)`,
or a wrapper of integrate.integrate) the model's own call is the original: `route_generate` then
gives the wrapper a generate that runs transformers' generate with the model's forward compiled by
solforge's backend (its graphs rewritten like the optimized model's), swapped in for the call and
put back after it, even on an error. transformers' own compilation of the forward (static caches)
is turned off for the call: solforge's compilation takes its place.

With `cuda_graphs`, launch-bound calls (decode steps, a short prompt) replay from CUDA graphs
(stepgraphs.py). A CUDA graph reads the KV cache at the address it had at capture, and
transformers makes a new static cache for every generate call, so each call would capture its
decode step again (a Python run of the graph plus instantiation: ~30 ms on Qwen3-0.6B). Instead
the static cache transformers made for the previous call is handed back, reset, when the new call
asks for the same one (implementation, batch size, length, prefill chunking, the model's dtype and
device): a cache reset holds zeros and length 0, as a new one does, and is sized as transformers
would size a new one. A cache made to be kept is allocated before the prompt runs (transformers
allocates it inside the first prefill), so the prompt's graph is the same on every call and
compiles once. It is not handed back when the caller could still hold the previous one: a call
that returns its cache (`return_dict_in_generate`) neither keeps nor gets one, and a call running
while another is in progress (another thread) gets a new one.

A call that leaves the cache to transformers (no `past_key_values`, no `cache_implementation`, in
the call or the generation config) would get a dynamic cache, whose length is a new shape at every
step: a new graph compiled per token until dynamo's recompile limit, then the model's own code.
Such a call gets a static cache instead, where the model supports one (`_can_compile_fullgraph`)
and the call does not return its cache. Its length is rounded up to a multiple of
`CACHE_LENGTH_STEP`, and never below the longest an earlier call asked for (transformers' rule),
so calls of other lengths reuse the same cache and the same graphs. A static cache attends over
its whole length with a mask, so its tokens are the dynamic cache's.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from solforge.capture import SolforgeBackend, compile_forward
from solforge.runtime.stepgraphs import step_graphs

CACHE_LENGTH_STEP = 256  # a cache solforge chooses is a multiple of this long (see the module doc)


class StaticCacheKeeper:
    """Stands in for the model's `_prepare_static_cache` (transformers) during generate calls: the
    previous call's cache, reset, for the same request; else transformers' own, kept. Only the
    thread that owns the keeper for its call (`owning`) gets or leaves a kept cache; any call may
    ask for its length rounded up (`rounding`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.kept: tuple[tuple[Any, ...], Any] | None = None
        self.reused = 0
        self.made = 0
        self._call = threading.local()  # owner: keeps caches; step: the length's rounding

    def available(self) -> bool:
        return callable(getattr(type(self.model), "_prepare_static_cache", None))

    @contextmanager
    def owning(self, own: bool, step: int | None) -> Iterator[None]:
        self._call.owner, self._call.step = own, step
        try:
            yield
        finally:
            self._call.owner, self._call.step = False, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = type(self.model)._prepare_static_cache  # type: ignore[attr-defined]
        bound = inspect.signature(original).bind(self.model, *args, **kwargs)
        step = getattr(self._call, "step", None)
        length = bound.arguments.get("max_cache_len")
        if isinstance(length, int):
            # the length transformers will give the cache (at least the longest asked for before),
            # rounded up where solforge chose the cache: the key is the cache's real length
            length = max(length, getattr(self.model, "_previous_max_cache_length", -1))
            if step:
                length = -(-length // step) * step
            bound.arguments["max_cache_len"] = length
        if not getattr(self._call, "owner", False):
            return original(*bound.args, **bound.kwargs)
        first = next(self.model.parameters(), None)
        key = (*((k, v) for k, v in bound.arguments.items() if k not in ("self", "model_kwargs")),
               (first.dtype, first.device) if first is not None else None)  # a model moved or cast since
        if self.kept is not None and self.kept[0] == key and callable(getattr(self.kept[1], "reset", None)):
            cache = self.kept[1]
            cache.reset()
            self.reused += 1
            return cache
        cache = original(*bound.args, **bound.kwargs)
        if first is not None and self._initialize(cache, bound.arguments.get("batch_size"), first.device) is False:
            cache = original(*bound.args, **bound.kwargs)  # a half-initialized one: a new, lazy one
        self.kept = (key, cache)
        self.made += 1
        return cache

    def _initialize(self, cache: Any, batch_size: Any, device: torch.device) -> bool | None:
        """Allocate a new cache's tensors now, as transformers does for a compiled prefill, so the
        prefill sees the same cache on the first call as on the later ones (a lazy cache is
        allocated inside the first prefill: another graph, compiled again on the second call).
        Only where the cache's dtype is sure to be the model's: no autocast, one floating dtype.
        None: left lazy; False: failed."""
        layers = getattr(cache, "layers", None)
        shape_of = getattr(self.model, "_get_static_cache_init_shape", None)
        if (not layers or any(getattr(layer, "is_initialized", True) for layer in layers) or shape_of is None
                or not isinstance(batch_size, int) or torch.is_autocast_enabled()):
            return None
        dtypes = {p.dtype for p in self.model.parameters() if p.dtype.is_floating_point}
        shape = shape_of()
        if shape is None or len(dtypes) != 1:
            return None
        try:
            cache.early_initialization(batch_size=batch_size, num_heads=shape[0], head_dim=shape[1],
                                       dtype=dtypes.pop(), device=device)
        except Exception:  # noqa: BLE001 - a cache transformers cannot initialize early stays lazy
            return False
        return True


def _returns_cache(model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether this generate call returns its cache to the caller (a ModelOutput with it)."""
    return bool(_setting(model, kwargs, "return_dict_in_generate", False))


def _setting(model: torch.nn.Module, kwargs: dict[str, Any], name: str, default: Any) -> Any:
    """A generation setting as transformers resolves it: the call's argument, else the generation
    config passed, else the model's (a config's None is unset)."""
    if name in kwargs:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


# generate arguments under which the cache is not transformers' plain default, or a static cache
# is not known to work: the call is left as it is
_OWN_CACHE = ("past_key_values", "cache_params", "cache_implementation", "assistant_model",
              "prompt_lookup_num_tokens", "custom_generate")


def _default_static(model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether to give this call a static cache (see the module doc): the caller left the cache to
    transformers, wants one, and the model supports a static cache (the caller's own check: the
    call does not get its cache back)."""
    if any(kwargs.get(name) is not None for name in _OWN_CACHE):
        return False
    if _setting(model, kwargs, "cache_implementation", None) is not None:
        return False
    if not _setting(model, kwargs, "use_cache", True):
        return False
    supports_dynamic = getattr(model, "_supports_default_dynamic_cache", None)
    return bool(getattr(type(model), "_can_compile_fullgraph", False)) and callable(supports_dynamic) \
        and bool(supports_dynamic())


def _with_static_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments asking for a static cache: in the generation config passed, if any
    (transformers warns when a config and generation arguments are both given), else as one."""
    config = kwargs.get("generation_config")
    if config is None:
        return {**kwargs, "cache_implementation": "static"}
    config = copy.deepcopy(config)
    config.cache_implementation = "static"
    return {**kwargs, "generation_config": config}


def route_generate(optimized: Any, model: torch.nn.Module, backend: SolforgeBackend, *,
                   cuda_graphs: bool = True, swap_forward: bool | Callable[[], bool] = True) -> None:
    """Give `optimized` a `generate` that runs solforge's graphs (see the module doc). A model
    without `generate` is left as it is. `swap_forward` (or a function saying, per call, whether to):
    False where the model's own call runs solforge's graphs (installed in place: runtime/inplace.py),
    so its forward is left as it is. The generate made here calls the class's `generate`: it may be
    installed as the model's own."""
    if not callable(getattr(model, "generate", None)):
        return
    compiled: list[Callable[..., Any]] = []
    keeper = StaticCacheKeeper(model)
    busy = threading.Lock()  # held by the call that owns the keeper
    swap = threading.Lock()  # guards `active` and the attributes swapped onto the model
    active: list[dict[str, Any]] = []  # one entry per call in progress: the model's own attributes

    def swapped() -> dict[str, Any]:
        forward = swap_forward() if callable(swap_forward) else swap_forward
        if forward and not compiled:
            compiled.append(compile_forward(model, backend))
        names: dict[str, Any] = {"forward": compiled[0]} if forward else {}
        if keeper.available():
            names["_prepare_static_cache"] = keeper
        return names

    def enter() -> None:
        with swap:
            if not active:  # the first call in progress swaps; the last one out puts back
                names = swapped()
                own = {name: model.__dict__[name] for name in names if name in model.__dict__}
                for name, value in names.items():
                    setattr(model, name, value)
                active.append(own)
            else:
                active.append(active[0])

    def leave() -> None:
        with swap:
            own = active.pop()
            if not active:
                for name in swapped():
                    if name in own:
                        setattr(model, name, own[name])
                    else:
                        model.__dict__.pop(name, None)

    def generate(*args: Any, **kwargs: Any) -> Any:
        if hasattr(getattr(model, "generation_config", None), "disable_compile"):
            kwargs.setdefault("disable_compile", True)
        returned = _returns_cache(model, kwargs)
        chosen = not returned and _default_static(model, kwargs)
        if chosen:
            kwargs = _with_static_cache(kwargs)
        keep = cuda_graphs and keeper.available() and not returned and busy.acquire(blocking=False)
        try:
            enter()
            try:
                with keeper.owning(keep, CACHE_LENGTH_STEP if chosen else None), step_graphs(cuda_graphs):
                    # the class's: the model's own `generate` may be this one (installed in place)
                    return type(model).generate(model, *args, **kwargs)
            finally:
                leave()
        finally:
            if keep:
                busy.release()

    # what the CUDA graphs did, graph by graph (StepGraph.summary()), and the caches handed back
    generate.step_graphs = backend.step_graphs  # type: ignore[attr-defined]
    generate.static_caches = keeper  # type: ignore[attr-defined]
    # on the compiled module itself: its __setattr__ would set the attribute on the original module
    object.__setattr__(optimized, "generate", generate)
