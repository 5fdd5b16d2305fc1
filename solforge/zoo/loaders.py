"""User models: a KernelBench-style file, or a `package.module:function` that returns (model, inputs)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from solforge.errors import UserError
from solforge.zoo.base import LoadedModel, fresh_like, module_to_target, one_line, seeded, to_target

KERNELBENCH_NAMES = ("Model", "get_inputs", "get_init_inputs")


def import_file(path_text: str) -> ModuleType:
    """Import a .py file by path under a unique module name.

    Registered in sys.modules because dynamo, inspect and pickling look modules up there; the name
    carries a hash of the absolute path so two files both called model.py do not clash.
    """
    path = Path(path_text).expanduser()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "not found"
        raise UserError(f"model file {path_text!r} {what}: pass the path of an existing .py file")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    mod_name = f"solforge_user_{resolved.stem.replace('-', '_').replace('.', '_')}_{digest}"
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec is None or spec.loader is None:
        raise UserError(f"cannot import {path_text!r} as Python: pass a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # SystemExit/KeyboardInterrupt in user code included: report, don't die
        sys.modules.pop(mod_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise UserError(f"importing {path_text!r} raised {one_line(exc)}: fix the file and retry") from None
    return module


def _as_args(value: Any, what: str, source: str) -> tuple[Any, ...]:
    """Positional args from a list/tuple (or one lone tensor, the obvious intent)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise UserError(f"{source}: {what} returned {type(value).__name__}; it must return a list of inputs")


def load_file(
    path_text: str, *, device: torch.device, dtype: torch.dtype, seed: int
) -> LoadedModel:
    """KernelBench format: `class Model(nn.Module)`, `get_inputs()`, `get_init_inputs()`."""
    module = import_file(path_text)
    missing = [n for n in KERNELBENCH_NAMES if not hasattr(module, n)]
    if missing:
        raise UserError(
            f"{path_text!r} lacks {', '.join(missing)}: a model file must define class Model(nn.Module), "
            "get_inputs() and get_init_inputs() (the KernelBench format)"
        )
    with seeded(seed, device):
        try:
            init_args = _as_args(module.get_init_inputs(), "get_init_inputs()", path_text)
            model = module.Model(*init_args)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{path_text!r}: Model(*get_init_inputs()) raised {one_line(exc)}") from None
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"{path_text!r}: Model is not an nn.Module subclass (got {type(model).__name__})")
    model = module_to_target(model, device, dtype)

    def make_inputs(s: int) -> tuple[Any, ...]:
        # get_inputs() draws from torch's global generator: seeding it makes inputs a function of s.
        with seeded(s, device):
            try:
                raw = module.get_inputs()
            except Exception as exc:
                raise UserError(f"{path_text!r}: get_inputs() raised {one_line(exc)}") from None
        return to_target(_as_args(raw, "get_inputs()", path_text), device, dtype)

    return LoadedModel(
        name=path_text,
        model=model,
        example_inputs=make_inputs(seed),
        make_inputs=make_inputs,
        is_language_model=False,
    )


def _import_module(mod_text: str, spec: str) -> ModuleType:
    if mod_text.endswith(".py"):
        return import_file(mod_text)  # path/to/file.py:function, for a script outside any package
    try:
        return importlib.import_module(mod_text)
    except ModuleNotFoundError as exc:
        raise UserError(
            f"cannot import module {mod_text!r} (from {spec!r}): {one_line(exc)}; "
            "install it or add its folder to PYTHONPATH"
        ) from None
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise UserError(f"importing module {mod_text!r} raised {one_line(exc)}: fix it and retry") from None


def load_function(spec: str, *, device: torch.device, dtype: torch.dtype, seed: int) -> LoadedModel:
    """`package.module:function` (or `file.py:function`) returning (model, example_inputs)."""
    mod_text, _, fn_name = spec.rpartition(":")
    if not mod_text or not fn_name.isidentifier():
        raise UserError(f"bad model spec {spec!r}: write package.module:function")
    module = _import_module(mod_text, spec)
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        what = "has no function" if fn is None else "has a non-callable"
        raise UserError(f"module {mod_text!r} {what} {fn_name!r}: name a function returning (model, inputs)")
    shape = "a pair (model: nn.Module, example_inputs: tuple or list of positional args)"
    with seeded(seed, device):  # seeded so a function that builds random weights is reproducible
        try:
            result = fn()
        except Exception as exc:
            raise UserError(f"{spec}() raised {one_line(exc)}") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise UserError(f"{spec} returned {type(result).__name__}: it must return {shape}")
    model, raw_inputs = result
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"{spec} returned a {type(model).__name__} as the model: it must return {shape}")
    if not isinstance(raw_inputs, (tuple, list, torch.Tensor)):
        raise UserError(f"{spec} returned {type(raw_inputs).__name__} as the inputs: it must return {shape}")
    model = module_to_target(model, device, dtype)
    example = to_target(_as_args(raw_inputs, spec, spec), device, dtype)
    config = getattr(model, "config", None)

    def make_inputs(s: int) -> tuple[Any, ...]:
        return fresh_like(example, s)

    return LoadedModel(
        name=spec,
        model=model,
        example_inputs=example,
        make_inputs=make_inputs,
        is_language_model=config is not None and hasattr(config, "vocab_size"),
    )
