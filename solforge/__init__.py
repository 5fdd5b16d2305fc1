"""solforge: find where a PyTorch model's GPU time goes, tune fused kernels for it, prove them
equal to the original, and swap them in without changing the model's code."""

from __future__ import annotations

from typing import Any

__all__ = ["backend", "optimize", "profile", "restore", "step_graphs"]


def optimize(*args: Any, **kwargs: Any) -> Any:
    """See solforge.api.optimize (imported lazily so `import solforge` stays cheap)."""
    from solforge.api import optimize as _optimize

    return _optimize(*args, **kwargs)


def profile(*args: Any, **kwargs: Any) -> Any:
    """See solforge.api.profile."""
    from solforge.api import profile as _profile

    return _profile(*args, **kwargs)


def step_graphs(enabled: bool = True) -> Any:
    """A context manager: inside it, the optimized model's launch-bound calls without autograd
    recording replay from CUDA graphs (`enabled`; solforge.runtime.stepgraphs), or never do
    (`step_graphs(False)`). Outside any such block they do when the model was optimized with
    cuda_graphs=True, the default. A call replays once its graph was captured, which needs a decode
    loop's cache (a static one) at the same addresses from call to call."""
    from solforge.runtime.stepgraphs import step_graphs as _step_graphs

    return _step_graphs(enabled)


def restore(model: Any) -> Any:
    """Take the optimization `optimize` installed in `model` out again (solforge.runtime.inplace):
    the model runs its own code once more. Returns `model`; a model not optimized is left as it is."""
    from solforge.runtime.inplace import restore as _restore

    return _restore(model)


def backend(**options: Any) -> Any:
    """solforge as a torch.compile backend with these options: `torch.compile(model,
    backend=solforge.backend(budget=10))` is `torch.compile(model, backend="solforge",
    options={"budget": 10})`. See solforge.dynamo for the options and what it does per graph."""
    from solforge.dynamo import backend as _backend

    return _backend(**options)


# torch.compile(model, backend="solforge"): registered once dynamo's registry is imported, without
# importing it here (registration.py)
from solforge.registration import register_lazily as _register_lazily  # noqa: E402

_register_lazily()
