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

A custom `torch.autograd.Function` in a training graph (a straight-through estimator, a gradient
reversal) is kept the same way by `split_functions`: dynamo's `autograd_function_apply` (its forward
and backward subgraphs) becomes one call of `solforge_capture::function(call, args)`, which applies
it as dynamo traced it, with its own backward, while the rest of the graph is lowered and fused.
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

from solforge.runtime.shapes import symbolic


class Body:
    """What a kept call runs: a checkpointed region's body, or a custom Function's application.
    Whoever holds the graph that calls it holds this too (the backend's `bodies`): the registry
    below refers to it weakly."""

    __slots__ = ("__weakref__", "context_fn", "fn", "name", "rng")

    def __init__(self, name: str, fn: Callable[..., Any], rng: bool, context_fn: Callable[[], Any] | None) -> None:
        self.name, self.fn, self.rng = name, fn, rng  # rng: preserve_rng_state (it draws random numbers)
        self.context_fn = context_fn  # a selective checkpointing policy, or None


_BODIES: weakref.WeakValueDictionary[str, Body] = weakref.WeakValueDictionary()


def body_fn(name: str) -> Callable[..., Any] | None:
    """What the kept call `name` runs (a lowered body is an fx.GraphModule), None once it is gone."""
    body = _BODIES.get(name)
    return None if body is None else body.fn
_NAMES = itertools.count()

_LIB = torch.library.Library("solforge_capture", "FRAGMENT")
_LIB.define("checkpoint(str body, Tensor[] args) -> Tensor[]")
_LIB.define("function(str call, Tensor[] args) -> Tensor[]")


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


def _function_autograd(call: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """The kept autograd.Function applied as dynamo traced it (its backward recorded where autograd
    records); one op while something traces the call."""
    if _tracing():
        with torch._C._AutoDispatchBelowAutograd():
            return function_op(call, args)
    return _below_autograd(call, args)


_LIB.impl("function", _below_autograd, "CompositeExplicitAutograd")
_LIB.impl("function", _function_autograd, "Autograd")
torch.library.register_fake("solforge_capture::function")(_below_autograd)
function_op = torch.ops.solforge_capture.function.default


def training(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph compiled for these inputs records a backward (grad mode on, an input that
    requires grad): where a call's backward matters."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def hop_name(node: fx.Node) -> str | None:
    """The name of the higher-order op a node calls (tag_activation_checkpoint, ...), else None."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
        return node.target.name()
    return None


def is_checkpoint(node: fx.Node) -> bool:
    return hop_name(node) == "tag_activation_checkpoint"


def is_function(node: fx.Node) -> bool:
    return hop_name(node) == "autograd_function_apply"


class Unsupported(Exception):
    """A call this module does not keep (see the module docstring)."""


def _random(gm: fx.GraphModule) -> bool:
    """Whether the body draws random numbers (dropout): then the recomputation must see the same. A
    kept call inside it (a Function, a nested checkpoint) counts as drawing: its ops are not seen."""
    return any(n.op == "call_function" and (n.target in (checkpoint_op, function_op) or (
        isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags))
        for n in gm.graph.nodes)


def _tensor_args(n: fx.Node, args: Sequence[Any]) -> list[Any]:
    """The example values of a kept call's arguments; Unsupported unless they are tensors of fixed
    shapes and the call's output is used item by item."""
    values = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in args]
    if not all(isinstance(v, torch.Tensor) for v in values) or symbolic(values):
        raise Unsupported(f"{n.target.name()} with arguments other than tensors of fixed shapes")  # type: ignore[union-attr]
    if not all(u.target is operator.getitem for u in n.users):
        raise Unsupported(f"{n.target.name()} whose output is used whole")  # type: ignore[union-attr]
    return values


def _replace(gm: fx.GraphModule, n: fx.Node, op: Any, name: str, args: Sequence[Any],
             refs: Sequence[fx.Node]) -> None:
    with gm.graph.inserting_before(n):
        call = gm.graph.call_function(op, (name, list(args)))
    call.meta.update(n.meta)
    n.replace_all_uses_with(call)
    gm.graph.erase_node(n)
    for ref in refs:  # the subgraphs' get_attr nodes, once nothing else reads them
        if not ref.users:
            gm.graph.erase_node(ref)


def split_functions(gm: fx.GraphModule) -> list[Body]:
    """Replace each custom autograd.Function application in `gm` (a dynamo training graph) by a
    `function_op` call that applies it as dynamo traced it; returns their bodies (the caller keeps
    them alive). Raises Unsupported, leaving `gm` as it was, for one it cannot keep."""
    found = [n for n in gm.graph.nodes if is_function(n)]
    plans = []
    for n in found:
        fwd, bwd, *args = n.args
        if not (isinstance(fwd, fx.Node) and isinstance(bwd, fx.Node) and fwd.op == bwd.op == "get_attr"):
            raise Unsupported("autograd_function_apply without its subgraphs")
        _tensor_args(n, args)
        plans.append((n, fwd, bwd, args))
    bodies = []
    for n, fwd, bwd, args in plans:
        hop, kwargs = n.target, dict(n.kwargs)
        fwd_mod, bwd_mod = gm.get_submodule(fwd.target), gm.get_submodule(bwd.target)

        def apply(*a: Any, hop: Any = hop, f: Any = fwd_mod, b: Any = bwd_mod, kw: Any = kwargs) -> Any:
            return hop(f, b, *a, **kw)

        body = Body(f"fn{next(_NAMES)}", apply, False, None)  # (apply holds the subgraphs)
        _BODIES[body.name] = body
        bodies.append(body)
        _replace(gm, n, function_op, body.name, args, (fwd, bwd))
    if plans:
        gm.recompile()
    return bodies


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
        plans.append((n, body_ref, args, _tensor_args(n, args)))
    bodies = []
    for n, body_ref, args, values in plans:
        body = gm.get_submodule(body_ref.target)
        run = prepare(body, values)
        b = Body(f"ckpt{next(_NAMES)}", run, bool(n.kwargs.get("preserve_rng_state", True)) and _random_of(run),
                 getattr(body, "meta", {}).get("_checkpoint_context_fn"))
        _BODIES[b.name] = b
        bodies.append(b)
        _replace(gm, n, checkpoint_op, b.name, args, (body_ref,))
    if plans:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return bodies


def _random_of(run: Any) -> bool:
    """Random ops in the lowered body (an ATen graph); a body that was not lowered may draw (torch's
    default, preserve_rng_state=True)."""
    return _random(run) if isinstance(run, fx.GraphModule) else True
