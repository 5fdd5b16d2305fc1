"""Generation through the optimized model: `optimized.generate(...)`.

`optimized` is a torch.compile module, and any attribute it lacks is the original module's, so
`optimized.generate` would be transformers' generate on the original model, calling the original
forward. `route_generate` gives it a generate that runs transformers' generate with the model's
forward compiled by solforge's backend (its graphs rewritten like the optimized model's), swapped
in for the call and put back after it, even on an error. transformers' own compilation of the
forward (static caches) is turned off for that call: solforge's compilation takes its place.

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
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

from solforge.capture import SolforgeBackend, compile_forward
from solforge.stepgraphs import step_graphs


class StaticCacheKeeper:
    """Stands in for the model's `_prepare_static_cache` (transformers) during a generate call:
    the previous call's cache, reset, for the same request; else transformers' own, kept."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.kept: tuple[tuple[Any, ...], Any] | None = None
        self.reused = 0
        self.made = 0

    def available(self) -> bool:
        return callable(getattr(type(self.model), "_prepare_static_cache", None))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = type(self.model)._prepare_static_cache  # type: ignore[attr-defined]
        bound = inspect.signature(original).bind(self.model, *args, **kwargs)
        first = next(self.model.parameters(), None)
        key = (*((k, v) for k, v in bound.arguments.items() if k not in ("self", "model_kwargs")),
               (first.dtype, first.device) if first is not None else None)  # a model moved or cast since
        if self.kept is not None and self.kept[0] == key and callable(getattr(self.kept[1], "reset", None)):
            cache = self.kept[1]
            cache.reset()
            self.reused += 1
            return cache
        cache = original(self.model, *args, **kwargs)
        if first is not None and self._initialize(cache, bound.arguments.get("batch_size"), first.device) is False:
            cache = original(self.model, *args, **kwargs)  # a half-initialized one: a new, lazy one
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
    if "return_dict_in_generate" in kwargs:
        return bool(kwargs["return_dict_in_generate"])
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return bool(getattr(config, "return_dict_in_generate", False))


def route_generate(optimized: Any, model: torch.nn.Module, backend: SolforgeBackend, *,
                   cuda_graphs: bool = True) -> None:
    """Give `optimized` a `generate` that runs solforge's graphs (see the module doc). A model
    without `generate` is left as it is."""
    if not callable(getattr(model, "generate", None)):
        return
    compiled: list[Callable[..., Any]] = []
    keeper = StaticCacheKeeper(model)
    busy = threading.Lock()

    def generate(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(compile_forward(model, backend))
        if hasattr(getattr(model, "generation_config", None), "disable_compile"):
            kwargs.setdefault("disable_compile", True)
        swapped: dict[str, Any] = {"forward": compiled[0]}
        keep = cuda_graphs and keeper.available() and not _returns_cache(model, kwargs) and busy.acquire(blocking=False)
        if keep:
            swapped["_prepare_static_cache"] = keeper
        own = {name: model.__dict__[name] for name in swapped if name in model.__dict__}
        for name, value in swapped.items():
            setattr(model, name, value)
        try:
            with step_graphs(cuda_graphs):
                return model.generate(*args, **kwargs)
        finally:
            for name in swapped:
                if name in own:
                    setattr(model, name, own[name])
                else:
                    delattr(model, name)
            if keep:
                busy.release()

    # what the CUDA graphs did, graph by graph (StepGraph.summary()), and the caches handed back
    generate.step_graphs = backend.step_graphs  # type: ignore[attr-defined]
    generate.static_caches = keeper  # type: ignore[attr-defined]
    # on the compiled module itself: its __setattr__ would set the attribute on the original module
    object.__setattr__(optimized, "generate", generate)
