"""Checkpointed regions of a training graph, kept checkpointed through the ATen lowering.

`torch.utils.checkpoint` (and transformers' gradient checkpointing, which calls it on every decoder
layer) reaches a dynamo graph as a `tag_activation_checkpoint` higher-order op around a body
subgraph. An ATen lowering would inline the body, and every activation the user chose to recompute
would be kept for the backward. So in a training graph each such op is replaced, before the
lowering, by one call of `solforge_capture::checkpoint(body, args)`: `body` names the body, lowered
and rewritten on its own (the backend records it as a graph of its own, so its regions are planned,
tuned and fused like any other), and the op runs it under `torch.utils.checkpoint.checkpoint`
(non-reentrant), which saves only the body's inputs and runs it again in the backward, with
torch's own handling of the random state. While something traces the call (make_fx lowering the
outer graph, a fake-tensor pass), the op is one node and its fake implementation runs the body on
fake tensors.

A selective checkpointing policy (`context_fn`, which dynamo keeps on the body) is passed on to
torch.utils.checkpoint: it sees the lowered body's ATen ops and solforge's fused ops.

Not handled (the graph then runs as dynamo gave it, capture.BackwardLost): options other than
those, arguments that are not tensors, graphs for many sizes (symbolic shapes), and a body whose
output is used other than item by item.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _get_current_dispatch_mode

from solforge.shapes import symbolic


class Body:
    """A checkpointed region's body as the op runs it. Whoever holds the graph that calls it holds
    this too (the backend's `bodies`): the registry below refers to it weakly."""

    __slots__ = ("__weakref__", "context_fn", "fn", "name", "rng")

    def __init__(self, name: str, fn: Callable[..., Any], rng: bool, context_fn: Callable[[], Any] | None) -> None:
        self.name, self.fn, self.rng = name, fn, rng  # rng: preserve_rng_state (it draws random numbers)
        self.context_fn = context_fn  # a selective checkpointing policy, or None


_BODIES: weakref.WeakValueDictionary[str, Body] = weakref.WeakValueDictionary()
_NAMES = itertools.count()

_LIB = torch.library.Library("solforge_capture", "FRAGMENT")
_LIB.define("checkpoint(str body, Tensor[] args) -> Tensor[]")


def _outputs(out: Any, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The body's outputs as the op's list; an output that is one of its inputs is copied (an op's
    outputs may not alias its inputs)."""
    items = list(out) if isinstance(out, tuple | list) else [out]
    ids = {id(a) for a in args}
    return [t.clone() if id(t) in ids else t for t in items]


def _below_autograd(body: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """The body run as it is (no checkpoint): what a trace records as one call, and what runs where
    nothing needs a gradient."""
    return _outputs(_BODIES[body].fn(*args), args)


_LIB.impl("checkpoint", _below_autograd, "CompositeExplicitAutograd")
torch.library.register_fake("solforge_capture::checkpoint")(_below_autograd)


def _tracing() -> bool:
    """A dispatch mode (make_fx, a fake-tensor pass) or dynamo sees the call: it must stay one op.
    Not torch.profiler, which only records: a profiled training step still needs the checkpoint."""
    return _get_current_dispatch_mode() is not None or torch.compiler.is_compiling()


def _autograd(body: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    if _tracing():
        with torch._C._AutoDispatchBelowAutograd():
            return checkpoint_op(body, args)
    if not (torch.is_grad_enabled() and any(a.requires_grad for a in args)):
        return _below_autograd(body, args)
    b = _BODIES[body]
    fn = b.fn
    policy = {} if b.context_fn is None else {"context_fn": b.context_fn}
    out = torch.utils.checkpoint.checkpoint(lambda *a: tuple(_outputs(fn(*a), a)), *args, use_reentrant=False,
                                            preserve_rng_state=b.rng, **policy)
    return list(out)


_LIB.impl("checkpoint", _autograd, "Autograd")
checkpoint_op = torch.ops.solforge_capture.checkpoint.default


def is_checkpoint(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator) \
        and node.target.name() == "tag_activation_checkpoint"


class Unsupported(Exception):
    """A checkpoint this module does not keep (see the module docstring)."""


def _random(gm: fx.GraphModule) -> bool:
    """Whether the body draws random numbers (dropout): then the recomputation must see the same."""
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and torch.Tag.nondeterministic_seeded in n.target.tags for n in gm.graph.nodes)


def split(gm: fx.GraphModule, prepare: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]) -> list[Body]:
    """Replace each checkpoint in `gm` (a dynamo graph) by a `checkpoint_op` call in place; each body
    goes through `prepare(body, example_inputs)` (the backend's lowering and rewrite, which record it),
    whose result the op runs. Returns the bodies (the caller keeps them alive as long as `gm`'s
    lowering); raises Unsupported, leaving `gm` as it was, for a checkpoint it cannot keep."""
    found = [n for n in gm.graph.nodes if is_checkpoint(n)]
    plans = []
    for n in found:
        body_ref, *args = n.args
        if set(n.kwargs) - {"use_reentrant", "preserve_rng_state"}:
            raise Unsupported(f"checkpoint options {sorted(set(n.kwargs) - {'use_reentrant', 'preserve_rng_state'})}")
        values = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in args]
        if not all(isinstance(v, torch.Tensor) for v in values) or symbolic(values):
            raise Unsupported("a checkpointed region with arguments other than tensors of fixed shapes")
        if not all(u.target is operator.getitem for u in n.users):
            raise Unsupported("a checkpointed region whose output is used whole")
        plans.append((n, body_ref, args, values))
    bodies = []
    for n, body_ref, args, values in plans:
        body = gm.get_submodule(body_ref.target)
        run = prepare(body, values)
        b = Body(f"ckpt{next(_NAMES)}", run, bool(n.kwargs.get("preserve_rng_state", True)) and _random_of(run),
                 getattr(body, "meta", {}).get("_checkpoint_context_fn"))
        _BODIES[b.name] = b
        bodies.append(b)
        with gm.graph.inserting_before(n):
            call = gm.graph.call_function(checkpoint_op, (b.name, list(args)))
        call.meta.update(n.meta)
        n.replace_all_uses_with(call)
        gm.graph.erase_node(n)
        if not body_ref.users:
            gm.graph.erase_node(body_ref)
    if plans:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return bodies


def _random_of(run: Any) -> bool:
    """Random ops in the lowered body (an ATen graph); a body that was not lowered may draw (torch's
    default, preserve_rng_state=True)."""
    return _random(run) if isinstance(run, fx.GraphModule) else True
