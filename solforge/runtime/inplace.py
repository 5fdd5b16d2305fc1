"""The optimized model is the user's model: `optimize` installs solforge's compiled call in place.

`nn.Module.compile()` sets the module's `_compiled_call_impl`, which `Module.__call__` runs instead
of `_call_impl` when it is set; `install` sets it to a `SolforgeCall` (the capture's compiled
`_call_impl`, whose graphs the integration rewrote). Nothing else about the module changes: its
class, `forward` and its signature, `state_dict()` keys (no `_orig_mod.` prefix), hooks,
`save_pretrained`. Three more entries go into the module's `__dict__`:
- `generate` (transformers models): runtime/generation.py's route (static caches kept for CUDA
  graphs); transformers' generate calls `self(...)`, so the compiled call runs either way;
- `solforge_stats`: the integration's live stats (integrate.IntegrationStats);
- `__getstate__`: the state without these entries and without `_compiled_call_impl` (torch's own
  `Module.__getstate__` drops that one). Python looks `__getstate__` up on the instance, so
  pickling, `torch.save(model)`, `copy.copy` and `copy.deepcopy` give a plain copy of the model:
  its weights and code, not optimized (a compiled call holds dynamo's caches and CUDA graphs, which
  do not copy). Optimize the copy again to get its kernels (the kernel database makes that fast).

`restore(model)` takes all of it out again and puts back what was there before (a
`model.compile()` of the user's own). A SolforgeCall that an outer `torch.compile` or
`torch.export` traces warns once that it traces the original model: dynamo inlines the compiled
function it wraps, so the rewritten graphs (solforge's ops) are not what the outer trace sees.

A model optimized unsharded and then given to FSDP2's `fully_shard` (which swaps the module's class
for an FSDP subclass) runs as the original model from its first call after the swap, and says so
once: optimize's end-to-end check measured the unsharded model, so nothing vouches for the sharded
step, and the guarantee hands back no model it did not measure faster (on two H100s that order
gave a step 1.26-1.37x slower than eager FSDP2's, 2026-11-27; sharded first, the check measured
the slower step and returned the original). The call compares the model's class with the one it
had at install: one `type()` a call.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

# what install puts into the module's __dict__ (and restore takes out)
KEYS = ("_compiled_call_impl", "generate", "solforge_stats", "__getstate__")
_MISSING = object()

TRACED_WARNING = ("solforge: torch.compile/torch.export of a solforge-optimized model traces the original "
                  "model (solforge's kernels are not in its graph); call the model as it is, or use "
                  "torch.compile(model, backend='solforge')")
SHARDED_AFTER_WARNING = ("solforge: this model was optimized before fully_shard: optimize's end-to-end check "
                         "measured it unsharded and does not vouch for the sharded step (measured slower than "
                         "eager FSDP2 on two H100s), so it runs as the original model from here; call "
                         "fully_shard first, then solforge.optimize")


def _fsdp_units(model: torch.nn.Module) -> bool:
    """Whether any module of `model` is an FSDP2 unit (`fully_shard` made it one)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


class SolforgeCall:
    """The optimized call of a model: `fn` (the capture's compiled `_call_impl`, or any callable
    running the rewritten graphs). `solforge_stats` is the integration's stats and `generate` the
    routed generate where there is one (set by the integration); other attributes are the model's,
    so the object stands in for the model where `optimize(..., inplace=False)` returns it."""

    def __init__(self, fn: Callable[..., Any], model: torch.nn.Module, stats: Any = None) -> None:
        self.fn = fn
        self.model = model
        self.solforge_stats = stats
        # the class the model had when optimized, and whether FSDP2 had sharded it then (module doc)
        self._cls: type = type(model)
        self._sharded = _fsdp_units(model)
        self.unvouched = False  # sharded after optimize: the original call runs (module doc)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # dynamo traces through this object when an outer torch.compile/export compiles the model:
        # it inlines `fn`'s original function, so say that solforge's graphs are not in its trace
        if torch.compiler.is_compiling() or torch.compiler.is_exporting():
            warnings.warn(TRACED_WARNING, stacklevel=2)
        elif type(self.model) is not self._cls:
            self._cls = type(self.model)
            if not self._sharded and _fsdp_units(self.model):
                self._sharded = self.unvouched = True
                warnings.warn(SHARDED_AFTER_WARNING, stacklevel=2)
        if self.unvouched:
            return self.model._call_impl(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # only called for what the object itself lacks: the model's attributes (config, parameters)
        if name in ("fn", "model") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.model, name)


class _PlainState:
    """The model's `__getstate__` while it is optimized: its state without solforge's entries."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = weakref.ref(model)

    def __call__(self) -> dict[str, Any]:
        model = self.model()
        assert model is not None
        getstate = getattr(type(model), "__getstate__", None)
        state = dict(getstate(model) if getstate is not None else model.__dict__)
        for key in KEYS:
            state.pop(key, None)
        return state


def install(model: torch.nn.Module, call: SolforgeCall) -> torch.nn.Module:
    """Make `call` the model's call, in place (see the module doc); returns `model`."""
    if installed(model) is not None:
        restore(model)
    prior = {key: model.__dict__.get(key, _MISSING) for key in KEYS}
    d = model.__dict__
    d["_compiled_call_impl"] = call
    d["solforge_stats"] = call.solforge_stats
    routed = call.__dict__.get("generate")
    if routed is not None:
        d["generate"] = routed
    d["__getstate__"] = _PlainState(model)
    call._prior = prior  # type: ignore[attr-defined]
    return model


def installed(model: Any) -> SolforgeCall | None:
    """The SolforgeCall installed in `model`, or None."""
    d = getattr(model, "__dict__", {})
    call = d.get("_compiled_call_impl")
    return call if isinstance(call, SolforgeCall) else None


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Take solforge's optimization out of `model` (what `install` put in), putting back what was
    there before; a model that is not optimized is returned as it is. Returns `model`."""
    call = installed(model)
    if call is None:
        return model
    prior = getattr(call, "_prior", {})
    for key in KEYS:
        was = prior.get(key, _MISSING)
        if was is _MISSING:
            model.__dict__.pop(key, None)
        else:
            model.__dict__[key] = was
    return model


@contextlib.contextmanager
def modes_kept(model: torch.nn.Module) -> Iterator[None]:
    """The train/eval flag of the model and of every submodule put back on exit, whatever ran
    inside (optimize runs the model in eval for inference, in train for training)."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training
