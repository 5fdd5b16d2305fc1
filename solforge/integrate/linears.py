"""Training graphs: linear layers whose backward saves the gradient adds.

Two kinds of adds in a training step are not arithmetic the model asked for, only how autograd
combines the pieces of a gradient (Qwen3-4B B1 S4096: 507 bf16 add kernels, 10.0 ms of the
step's 186.6 ms of kernel time, -qwen3-4b-train-profile-s7.json):

- Gradient accumulation. When a weight's `.grad` already holds a tensor (gradient accumulation
  over micro-batches, `zero_grad(set_to_none=False)`, or BASELINES.md's timed step, which never
  zeroes it), autograd's AccumulateGrad computes dW = gᵀx into a new tensor, then adds it to
  `.grad`: 3 passes over a weight-sized tensor after the GEMM (398 of those 507 adds).
- Sibling linears on one input (q/k/v, gate/up): autograd sums their three or two input
  gradients with separate add kernels (108 more).

cuBLAS can do both inside the GEMM (C = A·B + C, beta = 1, as Megatron-LM's "gradient
accumulation fusion" does). `group_linears` rewrites each group of `aten.linear` calls that share
their input x (after compact.py made them one op each) into one `linears` call (an autograd
Function); its backward computes

    dx = g1·W1, then dx += g2·W2 ... in the GEMMs (addmm_)
    .grad += gᵀ·x in the GEMM (addmm_ into .grad), and hands autograd no gradient for W

The second happens only where the result is exactly what AccumulateGrad would have stored and
nothing else could tell the difference (`accumulates_in_place`): `.grad` is a plain dense
contiguous tensor of the weight's shape and dtype, the weight is a leaf with no tensor hooks
(those must see the gradient), no double backward (create_graph), autograd will run the weight's
AccumulateGrad in this backward (not `autograd.grad`, not `backward(inputs=...)` without it), and
torch.distributed is not initialized (DDP and FSDP hook parameters' gradients). Anywhere else the
gradient goes back to autograd as eager's linear would hand it. After `zero_grad()` (set_to_none,
PyTorch's default) `.grad` is None and the fused path never runs: nothing to add to.

What stays the same: autograd's hooks on the weight's AccumulateGrad node and the post-accumulate
hooks still run after the backward (they see `.grad` already updated; node pre-hooks see None as
the incoming gradient). Numerics: the sum is rounded to the weight's dtype once, after fp32
accumulation in the GEMM, instead of twice (dW, then .grad + dW), so it differs from eager's in
the last bits.

Measured on the H100 (bench/results/2026-11-22-h100-session8.md, BASELINES.md's Qwen3-4B step,
one machine): 204.03 ms without this pass, 196.11 with it; the step's non-GEMM, non-attention,
non-solforge kernel time went from 11.41 to 2.24 ms and its kernel count from 2366 to 2006.

SOLFORGE_LINEARS=0 in the environment (settings.linears) turns the rewrite off;
SOLFORGE_GRAD_IN_PLACE=0 keeps the rewrite but always hands dW back to autograd.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from solforge import settings
from solforge.runtime.accumulate import accumulates_in_place

aten = torch.ops.aten


@dataclass
class Counters:
    """How many weight gradients were accumulated into `.grad` by the GEMM, and how many went back
    to autograd (process-wide; tests and benchmarks read them)."""

    in_place: int = 0
    handed_back: int = 0


COUNTERS = Counters()


# ----------------------------------------------------------------------------------------------
# The call the graph makes. A torch.autograd.Function applied straight from the graph, not a
# torch.library op: the training forward is nearly host-bound (compact.py), and on the CPU box
# (2026-11-22, tools/linears_host.py) a forward of three linears took 55 µs as a custom op with
# register_autograd (pytree handling of Tensor[] on every call), 21 µs as a custom op with its own
# Autograd kernel, 15.5 µs as this Function, and 15.4 µs as three aten.linear calls. An opaque op
# would buy nothing here: what the backward does to `.grad` is outside any traced graph anyway,
# and a trace through this Function sees the aten.linear calls it makes.


class _Linears(torch.autograd.Function):
    """Forward: one aten.linear per weight. Backward: the module docstring's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n_bias: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = params[: len(params) - n_bias]
        if n_bias:
            outs = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, params[len(weights):], strict=True)]
        else:
            outs = [torch.nn.functional.linear(x, w) for w in weights]
        ctx.save_for_backward(x, *weights)
        ctx.n_bias = n_bias
        ctx.set_materialize_grads(False)  # an output nobody read gets None, not a GEMM on zeros
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad  # x, n_bias, each weight, each bias
        x2 = x.reshape(-1, x.shape[-1])
        g2 = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grads]
        dx = None
        if needs[0]:
            for g, w in zip(g2, weights, strict=True):
                if g is not None:  # the input gradients summed by the GEMMs (beta = 1), no add kernels
                    dx = torch.mm(g, w) if dx is None else dx.addmm_(g, w)
            dx = None if dx is None else dx.view(x.shape)
        dws: list[torch.Tensor | None] = []
        for i, (g, w) in enumerate(zip(g2, weights, strict=True)):
            if g is None or not needs[2 + i]:
                dws.append(None)
            elif accumulates_in_place(w, g.dtype):
                w.grad.addmm_(g.t(), x2)  # .grad += gᵀx in the GEMM; autograd gets no dW to add
                COUNTERS.in_place += 1
                dws.append(None)
            else:
                dws.append(torch.mm(g.t(), x2))
                COUNTERS.handed_back += 1
        n = len(weights)
        dbs = [None if g is None or not needs[2 + n + i] else g.sum(0) for i, g in enumerate(g2[: ctx.n_bias])]
        return (dx, None, *dws, *dbs)


def linears(x: torch.Tensor, weights: Sequence[torch.Tensor],
            biases: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w, b)` for each weight (and bias: `biases` is empty or one per weight), with
    the backward of the module docstring. What the rewritten graph calls."""
    return _Linears.apply(x, len(biases), *weights, *biases)


linears.solforge_pure = True  # type: ignore[attr-defined]  # writes no input, returns new tensors (stepgraphs)


# ----------------------------------------------------------------------------------------------
# The graph pass


def _trainable_weight(n: object) -> bool:
    """A weight fed straight from a graph input that carries a gradient (a parameter)."""
    return isinstance(n, fx.Node) and n.op == "placeholder" and bool(n.meta.get("requires_grad"))


def _same_dtype(*nodes: fx.Node | None) -> bool:
    """x, weight and bias all of one known dtype: the backward's mm calls need it (a mixed-dtype
    linear, under autocast say, is left to aten)."""
    vals = [n.meta.get("val") for n in nodes if n is not None]
    return all(isinstance(v, torch.Tensor) for v in vals) and len({v.dtype for v in vals}) == 1


def group_linears(gm: fx.GraphModule) -> int:
    """Rewrite the `aten.linear` calls of a training graph whose weight is a trainable graph input
    into `linears` calls, one per group of linears that read the same x (and all have a
    bias or none has). Returns how many linears it rewrote; does nothing with SOLFORGE_LINEARS=0
    or when the graph was captured without autograd (inference)."""
    if not settings.current().linears or not gm.meta.get("grad_enabled", False):
        return 0
    graph = gm.graph
    # (a graph never switches grad mode inside where that would matter: capture.GradModeLost)
    groups: dict[tuple[fx.Node, bool], list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target != aten.linear.default or n.kwargs:
            continue
        x, w, *rest = n.args
        bias = rest[0] if rest else None
        if not isinstance(x, fx.Node) or not _trainable_weight(w) \
                or (bias is not None and not (isinstance(bias, fx.Node) and bias.op == "placeholder")) \
                or not _same_dtype(x, w, bias):
            continue
        groups.setdefault((x, bias is not None), []).append(n)
    done = 0
    for (_, has_bias), nodes in groups.items():
        # x as the group's first linear reads it now, not the key: an x made by a linear rewritten
        # above (LoRA's lora_B reads lora_A's output) is that rewrite's getitem, the key erased
        x = nodes[0].args[0]
        weights = [n.args[1] for n in nodes]
        biases = [n.args[2] for n in nodes] if has_bias else []
        with graph.inserting_before(nodes[0]):  # x and the weights are defined before the first
            call = graph.call_function(linears, (x, weights, biases))
            call.meta.update({k: nodes[0].meta[k] for k in ("nn_module_stack", "stack_trace")
                              if k in nodes[0].meta})
            vals = [n.meta.get("val") for n in nodes]
            if all(isinstance(v, torch.Tensor) for v in vals):
                call.meta["val"] = vals
        # each linear's value becomes one item of the call; getitems placed where the linears were
        for i, n in enumerate(nodes):
            with graph.inserting_before(n):
                item = graph.call_function(operator.getitem, (call, i))
            item.meta.update(n.meta)
            n.replace_all_uses_with(item)
            graph.erase_node(n)
        done += len(nodes)
    if done:
        graph.lint()
        gm.recompile()
    return done
