"""Models to optimize: the built-in zoo, KernelBench-style files, and user functions.

    load_model("qwen3-4b", device="cuda")            # zoo: seeded random weights (or weights=DIR)
    load_model("path/to/model.py")                   # KernelBench: Model, get_inputs, get_init_inputs
    load_model("pkg.mod:build")                      # build() -> (model, example_inputs)

Every form gives the same LoadedModel: a module on the device in the dtype, example inputs, and a
make_inputs(seed) for fresh inputs of the same shapes (verification never reuses the example).
"""

from __future__ import annotations

import torch

from solforge.errors import UserError
from solforge.numerics import parse_dtype
from solforge.zoo.base import LoadedModel, fresh_like, resolve_device
from solforge.zoo.hf import ZOO, ZooEntry, load_zoo, zoo_config
from solforge.zoo.loaders import load_file, load_function

__all__ = ["ZOO", "LoadedModel", "ZooEntry", "fresh_like", "load_model", "resolve_device", "zoo_config"]


def _check_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        return parse_dtype(dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UserError(f"unsupported dtype {dtype}: use a floating dtype such as bf16, fp16 or fp32")
    return dtype


def load_model(
    spec: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype | str = torch.bfloat16,
    batch: int | None = None,
    seq: int | None = None,
    weights: str | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Load a model by zoo name, `path/to/file.py`, or `package.module:function`.

    `batch`/`seq` shape the zoo's token inputs (default 1 x 128) and are ignored by the other forms,
    whose inputs come from the user. `weights` (a local Hugging Face directory) applies to zoo models.
    The same `seed` gives the same weights and example inputs (on the same device type).
    Raises UserError for anything the user must fix.
    """
    for flag, value in (("batch", batch), ("seq", seq)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"--{flag} must be a positive integer, got {value!r}")
    # Device and dtype first: a typo or a missing GPU should fail before a multi-second import/build.
    dev = resolve_device(device)
    dt = _check_dtype(dtype)
    spec = spec.strip()
    if spec.lower() in ZOO:
        return load_zoo(spec, device=dev, dtype=dt, batch=batch, seq=seq, weights=weights, seed=seed)
    if weights is not None:
        raise UserError(f"--weights applies only to zoo models ({', '.join(ZOO)}), not to {spec!r}")
    if spec.endswith(".py"):
        return load_file(spec, device=dev, dtype=dt, seed=seed)
    if ":" in spec:
        return load_function(spec, device=dev, dtype=dt, seed=seed)
    raise UserError(
        f"unknown model {spec!r}: use a zoo model ({', '.join(ZOO)}), a KernelBench-style file "
        "path/to/model.py (Model, get_inputs, get_init_inputs), or package.module:function "
        "returning (model, example_inputs)"
    )
