"""`skip_logits`: a training call with labels returns the loss and `logits=None`, as Liger's
`skip_logits` does, so the LM head's logits are not materialized.

A Hugging Face ForCausalLM forward returns the logits beside the loss, so in the captured graph
the logits are an output: they must exist in full (batch x seq x vocab, fp32 after the loss's
upcast: 2.5 GB at 4096 tokens and a 151936 vocabulary) and the fused head + cross-entropy op
(kernels/linear_cross_entropy.py), which never makes them, cannot take the region
(plan/linear_cross_entropy.py matches only where nothing but the loss reads them). With the
option, the compiled call is the model's call followed by `shown`, which drops the logits of a
training call's output that has a loss; dynamo traces both, so the logits are no longer a graph
output and the head and the loss fuse.

Only a ModelOutput (transformers' `return_dict`, the default) is changed: a plain tuple has no
names to say which entry the logits are. In eval mode, or without a loss (no labels), the output
is the model's own."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch


def without_logits(out: Any) -> Any:
    """`out` with its logits dropped where it is a ModelOutput holding both a loss and logits;
    anything else as it is."""
    if not isinstance(out, dict) or out.get("loss") is None or out.get("logits") is None:
        return out
    # a new output of the same class: ModelOutput's own setattr keeps a dropped key in its dict
    # (it skips None), and its __delitem__ raises; building one is also what dynamo traces plainly
    return type(out)(**{k: v for k, v in out.items() if k != "logits"})


def shown(model: torch.nn.Module, out: Any) -> Any:
    """What a call of `model` returns with the option on: the logits dropped in training."""
    return without_logits(out) if model.training else out


def skipping(model: torch.nn.Module, call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (the model's `_call_impl`) followed by `shown`: the function solforge compiles in its
    place. Dynamo traces this frame and inlines `call`, and guards on `model.training`, so a train
    call and an eval call get graphs of their own."""

    def skipping_logits(*args: Any, **kwargs: Any) -> Any:
        return shown(model, call(*args, **kwargs))

    return skipping_logits


class SkipLogitsForward:
    """`model.forward` with the option on (`install`): the model's own forward, then `shown`. An
    instance attribute, so every way of calling the model goes through it (`torch.compile` traces
    `forward`, not the module's hooks), dynamo inlines it, and it shows the forward's signature
    (HF Trainer reads it). A deepcopy or pickle of the model carries it, bound to the copy."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any]) -> None:
        self.model, self.forward = model, forward
        self.__signature__ = inspect.signature(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return shown(self.model, self.forward(*args, **kwargs))

    def __deepcopy__(self, memo: dict[int, Any]) -> SkipLogitsForward:
        model = copy.deepcopy(self.model, memo)  # the copy being made: deepcopy put it in memo first
        return SkipLogitsForward(model, type(model).forward.__get__(model))

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebind, (self.model,)


def _rebind(model: torch.nn.Module) -> SkipLogitsForward:
    return SkipLogitsForward(model, type(model).forward.__get__(model))


class Installed:
    """What `install` returns: `remove()` gives the model its own forward back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def remove(self) -> None:
        if isinstance(self.model.__dict__.get("forward"), SkipLogitsForward):
            del self.model.forward


def install(model: torch.nn.Module) -> Installed:
    """The option for any way of running `model` (eager, `torch.compile(model)` with any backend,
    `backend="solforge"`, Trainer): its forward becomes `SkipLogitsForward`, which dynamo traces
    with the model, so under a compiler the logits are no graph output either. Returns a handle
    (`.remove()` turns it off). The model's own forward (its class's) is what runs inside."""
    if not isinstance(model.__dict__.get("forward"), SkipLogitsForward):
        model.forward = SkipLogitsForward(model, type(model).forward.__get__(model))
    return Installed(model)
