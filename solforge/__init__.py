"""solforge: find where a PyTorch model's GPU time goes, tune fused kernels for it, prove them
equal to the original, and swap them in without changing the model's code."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["backend", "optimize", "profile", "restore", "skip_logits", "step_graphs"]

# the device files of a GPU that Triton can compile for (NVIDIA, WSL's, AMD's)
_GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def has_gpu_device() -> bool:
    """Whether this machine has a GPU, judged without importing torch (and so triton)."""
    return any(Path(p).exists() for p in _GPU_DEVICE_FILES)


def _interpreter_without_gpu() -> None:
    """Without a GPU, solforge's kernels can only run in Triton's interpreter, and that must be
    switched on before any @triton.jit function is made (when solforge.kernels' modules are
    imported): here, the first thing `import solforge` does, for the CLI and the Python API alike.
    An explicit TRITON_INTERPRET is left as the user set it (api.optimize refuses a CPU model when
    it is not 1). On a machine with a GPU nothing is changed: --device cpu there sets it in the CLI
    before torch is imported (cli._device), and from Python the user sets it."""
    if "TRITON_INTERPRET" not in os.environ and not has_gpu_device():
        os.environ["TRITON_INTERPRET"] = "1"


_interpreter_without_gpu()


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


def skip_logits(model: Any) -> Any:
    """`optimize`'s skip_logits for a model run any other way (`torch.compile(model,
    backend="solforge")`, another backend, eager): a training call whose output has a loss returns
    `logits=None`, so under a compiler the LM head and the loss can fuse. Wraps the model's forward
    (an instance attribute; state_dict, signature, deepcopy and pickle unchanged); returns a handle
    (`handle.remove()` turns it off). See solforge.runtime.logits."""
    from solforge.runtime.logits import install

    return install(model)


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
