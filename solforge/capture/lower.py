"""ATen lowering of one dynamo graph: make_fx under dynamo's fake mode, every node with meta["val"];
the records of a captured graph; what a lowering must refuse (grad-mode blocks, lost backward hooks)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.traceback import preserve_node_meta

from solforge.capture import checkpoint as _checkpoint
from solforge.capture.cache import LoweringCache
from solforge.runtime.shapes import symbolic


@dataclass
class CapturedGraph:
    """One dynamo graph and its ATen lowering. Not a record: it holds live graph objects."""

    index: int
    aten: fx.GraphModule
    attention_restored: int = 0  # SDPA calls given back is_causal, or no mask (see canonical.py)
    cse_removed: int = 0  # repeated identical ops merged into their first copy (see cse.py)
    empty_concats: int = 0  # concatenations of one non-empty piece, replaced by it (see noops.py)
    conv_layouts: int = 0  # convolutions run channels-last, timed faster (see layout.py)
    functionalized: int = 0  # in-place pointwise ops made out-of-place (see inplace.py)


def op_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or str(target)
    overload = getattr(target, "_overloadname", None)
    packet = getattr(getattr(target, "_overloadpacket", None), "__name__", None)
    if packet and overload is not None:
        ns = getattr(target, "namespace", "aten")
        return f"{ns}.{packet}.{overload}"
    return name


class GradModeLost(Exception):
    """The graph switches grad mode (a `torch.no_grad()` or `enable_grad()` block inside it) around
    ops on tensors that require grad. An ATen lowering keeps no trace of the switch (make_fx records
    ops, not grad mode), so the lowered graph would record gradients the model does not: such a
    graph runs as dynamo gave it."""


class BackwardLost(Exception):
    """A training graph registers a hook on a tensor it computes, or holds a custom
    `torch.autograd.Function` (a straight-through estimator, a gradient reversal) or a checkpointed
    region (`torch.utils.checkpoint`, transformers' gradient checkpointing) that checkpoint.py could
    not keep as one call. Dynamo keeps them as higher-order ops; an ATen lowering runs the hook
    registration on a tracing tensor, so the hook never fires, traces the Function's forward into
    plain ops, whose autograd derivative then replaces its backward (zero for a rounding STE), and
    inlines the checkpointed region, so its activations are kept for the backward instead of
    recomputed (the memory the user asked to save). Such a graph runs as dynamo gave it. Without
    autograd recording (inference) only the forward counts, and the graph is lowered as usual."""


# higher-order ops whose meaning is in the backward (see BackwardLost), and what a lowering does to it
_BACKWARD_HOPS = {
    "autograd_function_apply": "a custom autograd.Function, whose backward the lowering would replace by "
                               "autograd's derivative of its forward",
    "register_hook": "a tensor hook, which the lowering would drop",
    "tag_activation_checkpoint": "a checkpointed region (torch.utils.checkpoint), whose activations the "
                                 "lowering would keep instead of recomputing them",
}


def backward_lost(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
    """The first node (in `gm` or a subgraph of it) that an ATen lowering of this training graph
    would lose the backward of, or None (see BackwardLost)."""
    if not _checkpoint.training(example_inputs):
        return None
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for n in mod.graph.nodes:
            what = _BACKWARD_HOPS.get(_checkpoint.hop_name(n) or "")
            if what is not None:
                where = module_path(n)
                return what + (f" (in {where})" if where else "")
    return None


class _GradModeInterpreter(fx.Interpreter):
    """Runs a dynamo graph while make_fx traces it, noting whether any op runs in another grad
    mode than the graph's own with a floating result computed from a tensor that requires grad
    (`lost`): there the two modes differ. A no_grad block over buffers only (a rotary embedding's
    cos/sin) or one that only compares (`x > 0`) changes nothing and is not noted."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.mode = torch.is_grad_enabled()
        self.lost: str | None = None

    def run_node(self, n: fx.Node) -> Any:
        switched = self.lost is None and n.op in ("call_function", "call_method", "call_module") \
            and torch.is_grad_enabled() != self.mode
        if switched:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            switched = any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
        result = super().run_node(n)
        if switched and any(isinstance(t, torch.Tensor) and t.dtype.is_floating_point
                            for t in torch.utils._pytree.tree_leaves(result)):
            self.lost = n.format_node() or n.name
        return result


def lower_to_aten(gm: fx.GraphModule, example_inputs: Sequence[Any],
                  cache: LoweringCache | None = None) -> fx.GraphModule:
    """Trace a dynamo graph down to ATen ops (below autograd, no decompositions of core ops).

    Executed eagerly, the result is still differentiable: each ATen op goes through autograd.
    With a `cache`, a graph lowered before (by any process, same key: see cache.py) is read back
    instead of traced again; any cache problem falls back to tracing. Raises GradModeLost for a
    graph whose grad-mode switches matter (the lowering would lose them), and BackwardLost for a
    training graph with a tensor hook, or a custom autograd.Function or checkpoint the backend did
    not keep as one call (before the cache: an entry written before this check existed must not
    serve such a graph).
    """
    lost = backward_lost(gm, example_inputs)
    if lost is not None:
        raise BackwardLost(f"the graph holds {lost}: it runs as dynamo gave it")
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    key = cache.key(gm, example_inputs) if cache is not None else None
    aten = cache.load(key, fake_mode) if cache is not None and key is not None else None
    if aten is None:
        fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        # preserve_node_meta carries nn_module_stack / stack_trace from dynamo's nodes to ATen nodes,
        # so a region can be named by its module path (model.layers.3.self_attn.q_norm).
        interp = _GradModeInterpreter(gm)
        # Sizes that vary (a dynamic-shape graph): ops without a symbolic C++ path (matmul's on
        # CUDA, reached by the rotary embedding's fp32 matmul) read a fake tensor's sizes as ints,
        # which pins the length to this call's and makes dynamo compile again at every length.
        # Their Python decompositions, run by the Python dispatcher, keep sizes symbolic (make_fx's
        # symbolic mode turns it on for the same reason). Static graphs are traced as before.
        varying = any(symbolic(x) for x in example_inputs)
        with fake_mode, preserve_node_meta(), enable_python_dispatcher() if varying else contextlib.nullcontext():
            # run through an Interpreter: it sets the current node's meta for each op it traces
            aten = make_fx(lambda *a: interp.run(*a), tracing_mode="real")(*fake_inputs)
        if interp.lost is not None:
            raise GradModeLost(f"a grad-mode switch inside the graph (torch.no_grad / enable_grad) covers "
                               f"ops on tensors that require grad ({interp.lost[:120]}); the lowering would "
                               "lose it")
        if cache is not None and key is not None:
            cache.save(key, aten)
    # Which inputs carry a gradient and whether autograd was on: make_fx's values lose both, and a
    # family that computes its gradients inside its forward (linear_cross_entropy) must know them.
    # Dynamo guards on grad mode and on each input's requires_grad, so they hold for every call of
    # this graph (a call with other values compiles another graph).
    placeholders = [n for n in aten.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, example_inputs, strict=False):
        if isinstance(x, torch.Tensor):
            node.meta["requires_grad"] = bool(x.requires_grad)
    aten.meta["grad_enabled"] = torch.is_grad_enabled()
    return aten


def module_path(node: fx.Node) -> str | None:
    """The innermost module path dynamo recorded for a node ("model.layers.0.input_layernorm")."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    # dynamo spells paths from the compiled frame's local naming the model: L['self'].model.layers[0]
    # (a forward compiled as it is), L['fn'].0 (torch.compile of a torch-defined module) or
    # L['call_impl'].__self__.0 (capture's wrapper frame, capture/backend.py compile_call). The root
    # is the model itself whatever its local's name, so the paths are the model's own attribute paths
    # (what `model.get_submodule` takes), the same for every way of compiling it.
    path = _ROOT.sub("", path)
    for a, b in (("._modules['", "."), ("['", "."), ("']", ""), ("[", "."), ("]", "")):
        path = path.replace(a, b)
    return path.strip(".") or None


_ROOT = re.compile(r"^L\['[^']*'\](\.__self__)?")
