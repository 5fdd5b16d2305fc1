"""What every way of loading a model shares: the LoadedModel record, device checks, casting, seeding,
and fresh inputs derived from example ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from solforge.errors import UserError


@dataclass
class LoadedModel:
    """A model ready to run: `model(*example_inputs)` works as is.

    Not frozen and not JSON: it holds live tensors and a module, so it never crosses a stage boundary
    as a record; stages pass it around in-process only.
    """

    name: str  # the spec it came from: "qwen3-4b", "path/to/file.py", "pkg.mod:fn"
    model: torch.nn.Module  # on the requested device and dtype, in eval mode
    example_inputs: tuple[Any, ...]  # positional args, on the device
    # Fresh inputs of the same shapes and dtypes for a seed: verification and validation must never
    # run on the very inputs the model was captured or tuned with.
    make_inputs: Callable[[int], tuple[Any, ...]]
    is_language_model: bool  # output has logits over a vocabulary, so an argmax check is meaningful


def one_line(exc: BaseException) -> str:
    """`TypeName: first line of the message`, short enough for a one-line CLI error."""
    text = str(exc).strip().splitlines()
    summary = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return summary if len(summary) <= 300 else summary[:297] + "..."


def resolve_device(device: str | torch.device) -> torch.device:
    """Check a device string before anything is built, so a typo fails in a second, not after a load."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"unknown device {str(device)!r}: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        # Kernels are Triton on NVIDIA GPUs; the CPU path exists for tests and the interpreter only.
        raise UserError(f"unsupported device {str(device)!r}: use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UserError("no CUDA device found: run with --device cpu, or on a machine with an NVIDIA GPU")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        valid = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise UserError(f"device '{dev}' does not exist: this machine has {count} GPU(s), use {valid}")
    return dev


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run a block under `torch.manual_seed(seed)` without disturbing the caller's random stream.

    fork_rng restores the CPU (and the touched CUDA) generators afterwards, so loading a model in a
    test or between tuner trials does not change what the caller's next torch.randn returns.
    """
    cuda_devices: list[int] = []
    if device.type == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        cuda_devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to every tensor inside nested tuples, lists and dicts; leave the rest alone."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(x, fn) for x in obj)
    if isinstance(obj, list):
        return [map_tensors(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def to_target(obj: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move tensors to `device`; cast floating ones to `dtype`. Integer tensors (token ids, indices)
    and bools (masks) keep their dtype: casting them would change what they mean."""

    def move(t: torch.Tensor) -> torch.Tensor:
        out = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        # .to() returns a non-leaf when it copies; keep "this input wants a gradient" for training checks.
        if t.requires_grad and out.is_floating_point() and not out.is_leaf:
            out = out.detach().requires_grad_(True)
        return out

    return map_tensors(obj, move)


def module_to_target(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move a module and cast only its floating parameters and buffers (`Module.to(dtype)` would also
    touch complex ones)."""
    model = model.to(device)
    model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    return model.eval()


def fresh_like(inputs: tuple[Any, ...], seed: int) -> tuple[Any, ...]:
    """New inputs with the same structure, shapes, dtypes and devices as `inputs`, and new values.

    Floating tensors: normal draws matched to the example's mean and std (so magnitudes, hence
    rounding errors, stay realistic). Integer tensors: uniform ints in the example's [min, max], so
    token ids and indices stay valid. Bool tensors (masks) and non-tensors are kept: they are
    structure, not data, and a random mask can turn a valid input into an all-masked row.
    Draws come from one CPU generator seeded with `seed`, so the values are the same on any device.
    """
    gen = torch.Generator().manual_seed(seed)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bool or t.numel() == 0:
            return t.clone()
        if t.is_floating_point() or t.is_complex():
            ref = t.detach().to("cpu", torch.complex64 if t.is_complex() else torch.float32)
            mean = ref.mean()
            std = ref.std() if ref.numel() > 1 else torch.tensor(0.0)
            # A constant example (ones, a scalar) has std 0: drawing with std 0 would return the
            # example itself, and verifying on the example is what fresh inputs exist to avoid.
            if not bool(torch.isfinite(std)) or float(std) == 0.0:
                std = torch.tensor(max(abs(complex(mean)), 1.0))
            if not bool(torch.isfinite(mean).all()):
                mean = torch.zeros((), dtype=ref.dtype)
            draw = torch.randn(t.shape, generator=gen, device="cpu", dtype=ref.dtype) * std + mean
            out = draw.to(device=t.device, dtype=t.dtype)
            return out.requires_grad_(True) if t.requires_grad else out
        lo, hi = int(t.min()), int(t.max())
        draw = torch.randint(lo, hi + 1, t.shape, generator=gen, device="cpu", dtype=torch.int64)
        return draw.to(device=t.device, dtype=t.dtype)

    return tuple(map_tensors(x, fresh) for x in inputs)

