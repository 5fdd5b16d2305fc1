"""CUDA-graph replay of an optimized model, for launch-bound inference (a decode step).

A one-token step runs kernels of a few microseconds each, and the host's per-call work (dynamo's
guards, the graph's Python code, the dispatcher, each launch) then costs more than the GPU work:
on the H100 host, 125 us per call of a one-RMSNorm module against a 4.5 us kernel (measured
2026-11-22, bench/results/2026-11-22-h100-rmsnorm.json). Replaying a CUDA graph launches the whole
step at once.

`graphed(fn, example_inputs)` captures `fn` once for inputs shaped like `example_inputs` and
returns a callable with the same signature. A call whose tensors match the captured ones in shape,
stride, dtype and device, and whose other arguments are equal, copies the tensors into the graph's
input buffers and replays; any other call runs `fn` itself (counted in `.fallbacks`), as does any
call with autograd recording (the graph holds no backward). Outputs are fresh copies by default, so
a result stays valid after the next call.

The contract is that of every CUDA graph (`torch.cuda.graphs`): the step's control flow and the
model's parameters' storage must stay what they were at capture. Parameters updated in place are
seen by the replay; a model that branches on Python state changed after capture is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from solforge.errors import UserError
from solforge.runtime.stepgraphs import step_graphs


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    return ("V", value)


class Graphed:
    """`fn` replayed from a CUDA graph for inputs like the captured ones (see the module doc)."""

    def __init__(self, fn: Callable[..., Any], example_inputs: Sequence[Any], *, warmup: int = 3,
                 copy_outputs: bool = True) -> None:
        leaves, self._spec = pytree.tree_flatten(tuple(example_inputs))
        if not any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves):
            raise UserError("CUDA-graph replay needs CUDA inputs: move the model and inputs to the GPU "
                            "or leave CUDA graphs off")
        self.fn = fn
        self.copy_outputs = copy_outputs
        self.replays = 0
        self.fallbacks = 0
        self._sig = [_signature(x) for x in leaves]
        # the graph reads its inputs from these buffers: each call copies its tensors in
        self._static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        static_args = pytree.tree_unflatten(self._static, self._spec)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # warm up off the default stream (compilation, allocator, Triton's first launches), as
        # torch.cuda.graphs recommends, then capture; an optimized model's own step graphs
        # (stepgraphs.py) stay off: this graph holds the whole call
        with torch.no_grad(), torch.cuda.stream(side), step_graphs(False):
            for _ in range(warmup):
                fn(*static_args)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph), step_graphs(False):
            out = fn(*static_args)
        self._out_leaves, self._out_spec = pytree.tree_flatten(out)

    def matches(self, leaves: Sequence[Any]) -> bool:
        return len(leaves) == len(self._sig) and all(
            _signature(x) == s for x, s in zip(leaves, self._sig, strict=True))

    def __call__(self, *args: Any) -> Any:
        leaves, spec = pytree.tree_flatten(args)
        if spec != self._spec or torch.is_grad_enabled() or not self.matches(leaves):
            self.fallbacks += 1
            return self.fn(*args)
        for buf, x in zip(self._static, leaves, strict=True):
            if isinstance(buf, torch.Tensor) and buf.data_ptr() != x.data_ptr():
                buf.copy_(x)
        self.graph.replay()
        self.replays += 1
        outs = [o.clone() if self.copy_outputs and isinstance(o, torch.Tensor) else o for o in self._out_leaves]
        return pytree.tree_unflatten(outs, self._out_spec)


def graphed(fn: Callable[..., Any], example_inputs: Sequence[Any], **kwargs: Any) -> Graphed:
    return Graphed(fn, example_inputs, **kwargs)
