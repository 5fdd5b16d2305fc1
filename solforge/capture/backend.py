"""The dynamo backend: every graph dynamo gives is lowered to ATen (lower.py), passed through the
canonicalizing passes (canonical.py, cse.py, noops.py), recorded, optionally rewritten (this is how
integration swaps kernels in), and run by the runtime (runtime/stepgraphs.py: CUDA-graph replay of
launch-bound calls; runtime/shapes.py: one graph for many sizes). `capture` runs a model once
through it; `compile_with` / `compile_forward` compile a model or its forward with it."""

from __future__ import annotations

import contextlib
import gc
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import checkpoint as _checkpoint
from solforge.capture.cache import LoweringCache
from solforge.capture.canonical import constant_value, mask_inputs, restore_causal_attention
from solforge.capture.canonical_torch import contiguous_masks, restore_attention
from solforge.capture.cse import eliminate_common_subexpressions
from solforge.capture.dense import contiguous_for_readers
from solforge.capture.inplace import functionalize_pointwise
from solforge.capture.layout import channels_last_convolutions
from solforge.capture.lower import CapturedGraph, lower_to_aten
from solforge.capture.noops import drop_empty_concats
from solforge.runtime.shapes import ShapeDispatch, bound, copy_graph, symbolic_inputs
from solforge.runtime.stepgraphs import StepGraph

Rewrite = Callable[[fx.GraphModule, int], fx.GraphModule]


@dataclass
class SolforgeBackend:
    """A torch.compile backend: lowers every graph to ATen, records it, optionally rewrites it.

    With `rewrite=None` it only captures (the graphs run as traced). With a rewrite function, each
    lowered graph is passed through it before it runs: this is how integration swaps in kernels.
    """

    rewrite: Rewrite | None = None
    cache: LoweringCache | None = None  # ATen lowerings kept across processes (cache.py)
    graphs: list[CapturedGraph] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    compiled: Callable[..., Any] | None = None  # the model's call compiled with this backend (capture())
    module: torch.nn.Module | None = None  # ... of this module (capture())
    # each graph as dynamo calls it: replays launch-bound calls from a CUDA graph where that is
    # on (stepgraphs.py), runs the ATen graph as it is elsewhere
    step_graphs: list[StepGraph] = field(default_factory=list)
    # their default outside stepgraphs.step_graphs(): replay launch-bound calls made without
    # autograd recording (the optimized model's, integrate's cuda_graphs), or not (a capture)
    auto_replay: bool = False
    # what the graphs' kept calls run (checkpoint.py: checkpoint bodies, custom Functions), held as
    # long as the backend
    bodies: list[Any] = field(default_factory=list)

    def _keep_calls(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
        """In a training graph, each custom autograd.Function becomes a call of checkpoint.py's
        `function` op (applied as dynamo traced it), and each checkpointed region a call of its
        `checkpoint` op, its body lowered, rewritten and recorded as a graph of its own (before this
        graph: it takes the lower index). Whether any was; one that cannot be kept leaves the graph
        to lower_to_aten's BackwardLost, with the reason noted."""
        if not _checkpoint.training(example_inputs):
            return False
        kept = False
        for what, found, split in (
                ("a custom autograd.Function", _checkpoint.is_function, _checkpoint.split_functions),
                ("a checkpointed region", _checkpoint.is_checkpoint, lambda g: _checkpoint.split(g, self._body))):
            if not any(found(n) for n in gm.graph.nodes):
                continue
            try:
                self.bodies += split(gm)
                kept = True
            except Exception as e:  # Unsupported, or a bug: what was not replaced leaves BackwardLost to act
                self.errors.append(f"graph {len(self.graphs)}: {what} not kept: {type(e).__name__}: {e}")
        return kept

    def _body(self, body: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """A checkpointed region's body, lowered and rewritten like a graph and recorded as one (its
        regions are planned, tuned and fused), but called by the checkpoint op, not by dynamo: no
        step graph. One that cannot be lowered runs as dynamo gave it, still checkpointed."""
        kept = self._keep_calls(body, example_inputs)  # Functions and checkpoints nested in this one
        index = len(self.graphs)
        early = self._torch_passes(body, index)
        try:
            aten = lower_to_aten(body, example_inputs, None if kept else self.cache)
        except Exception as e:
            self.errors.append(f"graph {index} (a checkpointed region): lowering failed: {type(e).__name__}: {e}")
            return body.forward
        restored, removed, concats, layouts, functional = self._passes(aten, index)
        restored += early
        if kept:
            self._causal_bodies(aten, index)  # nested checkpoints: their mask comes through this body
        if self.rewrite is not None:
            aten = self.rewrite(aten, index)
        self.graphs.append(CapturedGraph(index=index, aten=aten, attention_restored=restored,
                                        cse_removed=removed, empty_concats=concats,
                                        conv_layouts=layouts, functionalized=functional))
        return aten

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # a lowering whose kept calls name this process's bodies is not one to cache
        kept = self._keep_calls(gm, example_inputs)
        index = len(self.graphs)
        early = self._torch_passes(gm, index)
        try:
            aten = lower_to_aten(gm, example_inputs, None if kept else self.cache)
        except Exception as e:  # a graph we cannot lower still runs, as dynamo gave it (with `early`'s calls)
            self.errors.append(f"graph {index}: lowering failed: {type(e).__name__}: {e}")
            return gm.forward
        # a call rewritten here has no mask left for the ATen pass to count again
        restored, removed, concats, layouts, functional = self._passes(aten, index)
        restored += early
        if kept:
            self._causal_bodies(aten, index)
        # a graph for many sizes: made again per set of sizes that comes back (shapes.py), from
        # this copy, which no rewrite touches (integrate_captured rewrites `aten` in place later)
        pristine = copy_graph(aten) if symbolic_inputs(aten) else None
        if self.rewrite is not None:
            aten = self.rewrite(aten, index)
        self.graphs.append(CapturedGraph(index=index, aten=aten, attention_restored=restored,
                                        cse_removed=removed, empty_concats=concats,
                                        conv_layouts=layouts, functionalized=functional))
        if pristine is not None:
            return ShapeDispatch(aten, aten, lambda values: self._specialize(pristine, index, values),
                                 report=lambda text: self.errors.append(f"graph {index}: {text}"),
                                 evict=self._drop)
        step = StepGraph(aten, auto=self.auto_replay)
        self.step_graphs.append(step)
        return step

    def _torch_passes(self, gm: fx.GraphModule, index: int) -> int:
        """The attention passes on the graph dynamo gives, before the lowering picks SDPA's backend
        (canonical_torch.py: on a GPU, a traced all-allowed mask lowered to the math path, leaving
        no SDPA op for the ATen pass; a mask strided along the keys did too, and is made
        contiguous). Returns how many calls the first rewrote; a pass that fails does
        so before it changes a call, almost always (all are decided first), and the graph as
        traced is correct anyway."""
        try:
            restored = restore_attention(gm)
        except Exception as e:  # the graph as traced is still correct, only slower
            self.errors.append(f"graph {index}: torch-level attention pass failed: {type(e).__name__}: {e}")
            restored = 0
        try:
            # after it (a mask it drops needs no copy), before the lowering picks SDPA's backend
            contiguous_masks(gm)
        except Exception as e:  # the copy's value is made before the call changes
            self.errors.append(f"graph {index}: attention-mask layout pass failed: {type(e).__name__}: {e}")
        return restored

    def _passes(self, aten: fx.GraphModule, index: int) -> tuple[int, int, int, int, int]:
        """The passes every lowered graph gets before matching: (SDPA calls given back is_causal,
        subexpressions merged, empty concatenations dropped, convolutions made channels-last,
        in-place pointwise ops made out-of-place); a failed pass leaves the graph correct."""
        try:
            # first: the writes it removes would cut regions and islands in the passes after it
            functional = functionalize_pointwise(aten)
        except Exception as e:  # the graph as traced is still correct
            self.errors.append(f"graph {index}: in-place pass failed: {type(e).__name__}: {e}")
            functional = 0
        try:
            restored = restore_causal_attention(aten)
        except Exception as e:  # the graph as traced is still correct, only slower
            self.errors.append(f"graph {index}: attention pass failed: {type(e).__name__}: {e}")
            restored = 0
        try:
            # before matching (planning and the integration rewrite both see this graph): a model
            # that writes x.float() twice must match like one that writes it once
            removed = eliminate_common_subexpressions(aten)
        except Exception as e:  # the graph as traced is still correct
            self.errors.append(f"graph {index}: common-subexpression pass failed: {type(e).__name__}: {e}")
            removed = 0
        try:
            # before matching too: a region's output then feeds its consumers directly (noops.py)
            concats = drop_empty_concats(aten)
        except Exception as e:  # the graph as traced is still correct
            self.errors.append(f"graph {index}: empty-concatenation pass failed: {type(e).__name__}: {e}")
            concats = 0
        try:
            # before matching: the copy back to the model's layout fuses with the ops after it
            layouts = channels_last_convolutions(aten)
        except Exception as e:  # each convolution's new values are made before its graph changes
            self.errors.append(f"graph {index}: convolution layout pass failed: {type(e).__name__}: {e}")
            layouts = 0
        try:
            # after the layouts (a channels-last island's values keep theirs: their readers are not
            # contiguous), before matching: the copy fuses into the region that computes the value
            contiguous_for_readers(aten)
        except Exception as e:  # the copy's value is made before the graph changes
            self.errors.append(f"graph {index}: contiguous-readers pass failed: {type(e).__name__}: {e}")
        return restored, removed, concats, layouts, functional

    def _causal_bodies(self, aten: fx.GraphModule, index: int) -> int:
        """Checkpointed bodies called by `aten` whose SDPA mask is an argument that `aten` computes
        from sizes alone (transformers builds the causal mask once, outside the decoder layers that
        gradient checkpointing wraps): where its value is exactly causal, the body's calls get
        is_causal back as in a graph that builds its own mask (eager's flash call, not a masked one
        that took three times as long in Llama-3.2-1B's checkpointed step). Returns how many calls."""
        restored = 0
        values: dict[fx.Node, Any] = {}
        for node in aten.graph.nodes:
            if node.op != "call_function" or node.target is not _checkpoint.checkpoint_op:
                continue
            name, args = node.args
            body = _checkpoint.body_fn(name)
            if not isinstance(body, fx.GraphModule):
                continue
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            known = {}
            for mask in mask_inputs(body):
                arg = args[placeholders.index(mask)] if len(placeholders) == len(args) else None
                if isinstance(arg, fx.Node):
                    if arg not in values:
                        values[arg] = constant_value(aten, arg)
                    if values[arg] is not None:
                        known[mask] = values[arg]
            if not known:
                continue
            try:
                done = restore_causal_attention(body, known)
            except Exception as e:  # the body as traced is still correct, only slower
                self.errors.append(f"graph {index}: attention pass on a checkpointed body failed: "
                                   f"{type(e).__name__}: {e}")
                continue
            restored += done
            for g in self.graphs:
                if g.aten is body:
                    g.attention_restored += done
        return restored

    def _drop(self, step: Any) -> None:
        """A graph made for one set of sizes that its dispatch no longer keeps: its CUDA graph's
        memory goes, and so does its place in `step_graphs`."""
        if isinstance(step, StepGraph):
            step.release()
            self.step_graphs[:] = [s for s in self.step_graphs if s is not step]

    def _specialize(self, pristine: fx.GraphModule, index: int, values: Any) -> StepGraph:
        """Graph `index` (its lowering, before any rewrite) rewritten for the sizes `values`."""
        gm = copy_graph(pristine)
        with bound(values):
            # its causal mask has a value for these sizes: eager's is_causal call again (canonical.py)
            restore_causal_attention(gm)
            if self.rewrite is not None:
                gm = self.rewrite(gm, index)
        step = StepGraph(gm, sizes_fixed=True, auto=self.auto_replay)  # ShapeDispatch calls it with these sizes only
        self.step_graphs.append(step)
        return step


def compile_with(model: torch.nn.Module, backend: SolforgeBackend) -> Callable[..., Any]:
    # dynamic=None (dynamo's automatic dynamic shapes): the first shape of an input gets a static
    # graph, whose kernels are the ones tuned for that shape; the next shape gets one graph for
    # every size of the dims that changed (sizes 0 and 1 stay apart), whose kernels choose a config
    # per call (integrate/__init__.py, runtime/shapes.py). With dynamic=False every new length (a prompt, a batch)
    # compiled a graph of its own, seconds each, and past dynamo's recompile limit (8) the model's
    # own code ran.
    return torch.compile(model, backend=backend, dynamic=None)


def compile_call(model: torch.nn.Module, backend: SolforgeBackend, *, skip_logits: bool = False) -> Callable[..., Any]:
    """The module's `_call_impl` compiled like `compile_with` compiles the module, as
    `nn.Module.compile()` does: what runtime/inplace.py installs as the module's own call, so the
    optimized model is the module itself (its state_dict keys, forward and class unchanged). The
    graphs are those of `compile_with`: dynamo skips torch's own frames (`_call_impl`) and compiles
    the model's forward; where that forward is torch's own too (an nn.Sequential, an nn.RMSNorm),
    the call is wrapped in a frame of ours that dynamo compiles, inlining the rest (what
    torch.compile does for such a module; `model.compile()` compiles nothing there). `skip_logits`:
    a training call's logits are dropped from its output inside the compiled frame (runtime/logits.py)."""
    if not isinstance(model, torch.nn.Module):  # a plain function (tests, KernelBench-style callables)
        return compile_with(model, backend)
    fn = model._call_impl
    if skip_logits:  # a frame of ours, as below: dynamo inlines the call
        from solforge.runtime.logits import skipping

        fn = skipping(model, fn)
    elif _skipped_by_dynamo(model.forward):
        call_impl = fn

        def fn(*args: Any, **kwargs: Any) -> Any:
            return call_impl(*args, **kwargs)

    return torch.compile(fn, backend=backend, dynamic=None)


def _skipped_by_dynamo(forward: Any) -> bool:
    """Whether dynamo would run this forward's frame without compiling it (torch's own modules)."""
    try:
        from torch._dynamo import trace_rules

        return inspect.ismethod(forward) and bool(trace_rules.check(forward))
    except Exception:  # noqa: BLE001 - dynamo's private rules moved: judge by where forward is defined
        return getattr(forward, "__module__", "").startswith("torch.")


def compile_forward(model: torch.nn.Module, backend: SolforgeBackend) -> Callable[..., Any]:
    """The model's bound forward compiled like `compile_with` compiles the module: something to
    put in place of `model.forward` (generation.route_generate), where the compiled module itself
    would call it back."""
    return torch.compile(model.forward, backend=backend, dynamic=None)


@contextlib.contextmanager
def few_full_collections() -> Iterator[None]:
    """Keep Python's full garbage collections out of a capture.

    Tracing allocates hundreds of thousands of objects, and every so often CPython scans the whole
    heap for cycles: on Qwen3-4B (360k objects before the capture, 570k after) that was 1-3 full
    scans of 0.2-0.35 s each on the CPU dev box; the seven unexplained 1.2 s calls of torch.fx's
    schema-to-signature conversion under cProfile on the H100 hosts (0.1-0.3 ms when probed alone)
    fit full scans that landed there (not verified on those hosts). Everything alive before the capture
    (torch, the model) is frozen out of the scans, and the old generation's threshold is raised so
    no full scan runs during it; young garbage is still collected, and both settings are restored
    afterwards. A caller that froze objects itself keeps its own gc.freeze untouched."""
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(threshold[0], threshold[1], max(threshold[2], 1000))
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


def capture(model: torch.nn.Module, inputs: Sequence[Any], *, grad: bool = False,
            cache: LoweringCache | str | Path | None = None, skip_logits: bool = False) -> SolforgeBackend:
    """Run the model once through dynamo and return the backend holding the ATen graphs.

    `cache`: a LoweringCache or its directory, to reuse ATen lowerings across processes.
    `skip_logits`: compile_call's."""
    if cache is not None and not isinstance(cache, LoweringCache):
        cache = LoweringCache(Path(cache))
    backend = SolforgeBackend(cache=cache)
    backend.module = model
    compiled = backend.compiled = compile_call(model, backend, skip_logits=skip_logits)
    with static_shapes(), torch.set_grad_enabled(grad), few_full_collections():
        compiled(*inputs)
    return backend


def static_shapes() -> contextlib.AbstractContextManager[Any]:
    """Within this block dynamo compiles static graphs for the inputs it gets, whatever it
    remembers of the code: a function compiled before for another shape (another model sharing
    transformers' forward wrapper, an earlier optimize) would otherwise get a dynamic-shape graph
    from its first call. For a capture or a profile, which are of the example inputs; a model
    compiled in it still goes dynamic on a new shape later (the optimized model of
    integrate_captured)."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)
