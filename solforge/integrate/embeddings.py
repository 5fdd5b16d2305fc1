"""Training graphs: an embedding whose backward adds its gradient into `.grad` row by row.

Eager's embedding backward (`aten.embedding_dense_backward`) returns a dense V x H gradient: a fill
of zeros over the whole table, then the rows of the N = B*S tokens. When the weight's `.grad`
already holds a tensor (gradient accumulation over micro-batches, `zero_grad(set_to_none=False)`,
or BASELINES.md's timed step, which never zeroes it), autograd's AccumulateGrad then adds that
whole dense tensor to `.grad`: 3 more passes over the table. For Qwen3-4B (V 151936 x H 2560 bf16,
778 MB, N = 4096 at B1 S4096) that is, estimated from the H100's bandwidth and not measured, about
0.24 ms of fill and 0.8 ms of add per step, for 4096 rows that change (at most 2.7% of the table).

`rewrite_embeddings` turns each `aten.embedding` of a training graph whose weight is a trainable
graph input into an `embedding` call (an autograd Function). Its backward, where
`accumulates_in_place` (runtime/accumulate.py) says that nothing could tell the difference (see
linears.py's module docstring: a plain dense `.grad` of the weight's dtype, no tensor hooks, AccumulateGrad will run,
no double backward, no torch.distributed), adds the gradient into `.grad` touching only the rows
of the tokens present and hands autograd None for the weight. Anywhere else it returns eager's
own gradient, `aten.embedding_backward` with the same arguments (what autograd's formula for
`aten.embedding` calls; `aten.embedding_dense_backward` for a dense weight).

The in-place path is bit for bit eager's, and it never waits for the device (no `.item()`, no
`nonzero`, no `unique` with a data-dependent size: the backward is device-bound and the host runs
far ahead there, a sync would stall it):

1. The ids are relabelled 0, 1, 2, ... in sorted order (stable sort; the first of each run of equal
   ids starts a group; group = cumsum(first) - 1, scattered back to each token's position). This
   keeps equal ids equal, distinct ids distinct, and the order of the ids.
2. `compact = aten.embedding_dense_backward(dy, relabelled, N, -1, False)`: N x H instead of V x H.
   Both ATen implementations compute each row from which tokens share it and in what order they come
   (CPU: a row's tokens added in token order; CUDA: a stable radix sort of the ids, then sums over
   each run of equal ids, or for N <= 3072 sums over chunks of 32 consecutive tokens; read in
   PyTorch's source, checked by the GPU test), never from the id's value, so each compact row is
   bit for bit the row eager's dense gradient has for that id. The rows past the last group are
   zeros and never read.
3. For each token in sorted order, `.grad[id] + compact[group]` (the add eager's AccumulateGrad
   does, one rounding in .grad's dtype), written back to row id with `index_copy_`. The tokens of
   one id compute the same bits from the same inputs, so a row written more than once gets the same
   value each time: the result does not depend on the order of the writes. (One entry per token,
   not per group: the number of groups is only known on the device.)
4. `padding_idx >= 0`: eager gives the padding row nothing. dy's rows of padding tokens are set to
   +0.0 first (a `where`), so the padding row becomes `.grad[p] + 0.0`, as eager's `+= dense` does.

The one difference: a row that no token uses is not touched at all, while eager adds +0.0 to it,
which turns a -0.0 stored in `.grad` into +0.0. The values are equal (torch.equal holds); the sign
of such a zero is the only bit that can differ. Estimated cost on the H100 (not measured): the
compact backward and about 9 passes over an N x H tensor (21 MB at Qwen3-4B's N = 4096), ~0.1 ms,
against ~1 ms of eager's fill and add.

SOLFORGE_EMBEDDING=0 in the environment (settings.embedding) turns the rewrite off;
SOLFORGE_GRAD_IN_PLACE=0 keeps it but always hands the gradient back (through accumulates_in_place).
Embeddings with `sparse=True` (their backward returns a sparse gradient) or `scale_grad_by_freq`
(nothing to gain: the Function would hand it back) are left to aten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from solforge import settings
from solforge.integrate.linears import _trainable_weight
from solforge.runtime.accumulate import accumulates_in_place

aten = torch.ops.aten


@dataclass
class Counters:
    """How many embedding gradients were added into `.grad` row by row, and how many went back to
    autograd (process-wide; tests and benchmarks read them)."""

    in_place: int = 0
    handed_back: int = 0


COUNTERS = Counters()


def accumulate_rows(grad: torch.Tensor, dy: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> None:
    """`grad += aten.embedding_dense_backward(dy, ids, V, padding_idx, False)`, bit for bit as eager
    computes it (module docstring, steps 1-4), touching only the rows of `ids`. No host sync."""
    n = ids.numel()
    flat = ids.reshape(-1)
    if padding_idx >= 0:  # eager skips padding tokens; a +0.0 row adds nothing to the padding group
        dy = torch.where((ids == padding_idx).unsqueeze(-1), torch.zeros((), dtype=dy.dtype, device=dy.device), dy)
    sorted_ids, perm = torch.sort(flat, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=flat.device)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    group = torch.cumsum(first, 0) - 1  # non-decreasing: 0 .. G-1 in sorted order
    relabelled = torch.empty_like(group).scatter_(0, perm, group)  # perm is a permutation: no clashes
    compact = aten.embedding_dense_backward(dy, relabelled.view(ids.shape), n, -1, False)
    # one entry per token in sorted order: its id's row, its group's compact row. The tokens of one
    # id compute the same bits and write them to the same row, so the order of the writes does not
    # matter; the compact rows past the last group (all zeros) are never read.
    rows = sorted_ids.long()
    new = grad.index_select(0, rows).add_(compact.index_select(0, group))
    grad.index_copy_(0, rows, new)


# ----------------------------------------------------------------------------------------------
# The call the graph makes: an autograd Function applied straight from the graph, as linears.py
# does (its comment says why a torch.library op would only add host time here).


class _Embedding(torch.autograd.Function):
    """Forward: `aten.embedding` exactly as the graph had it. Backward: the module docstring's."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int,
                scale_grad_by_freq: bool, sparse: bool) -> torch.Tensor:
        ctx.save_for_backward(ids)
        # the weight itself, not saved: eager's embedding saves only the ids, so an in-place update
        # of the weight between forward and backward (an EMA, say) must not fail the version check
        ctx.weight = weight
        ctx.args = (weight.shape[0], padding_idx, scale_grad_by_freq, sparse)
        ctx.set_materialize_grads(False)
        return aten.embedding(weight, ids, padding_idx, scale_grad_by_freq, sparse)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        num_weights, padding_idx, scale_grad_by_freq, sparse = ctx.args
        none = (None, None, None, None)
        if dy is None or not ctx.needs_input_grad[0]:
            return (None, *none)
        if not sparse and not scale_grad_by_freq and ids.numel() > 0 and accumulates_in_place(weight, dy.dtype):
            accumulate_rows(weight.grad, dy, ids, padding_idx)
            COUNTERS.in_place += 1
            return (None, *none)
        COUNTERS.handed_back += 1
        # eager's own gradient (aten.embedding_backward, what autograd's formula for embedding calls)
        dw = aten.embedding_backward(dy, ids, num_weights, padding_idx, scale_grad_by_freq, sparse)
        return (dw, *none)


def embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> torch.Tensor:
    """`aten.embedding(weight, ids, ...)` with the backward of the module docstring. What the
    rewritten graph calls."""
    return _Embedding.apply(weight, ids, padding_idx, scale_grad_by_freq, sparse)


embedding.solforge_pure = True  # type: ignore[attr-defined]  # writes no input, returns a new tensor (stepgraphs)


# ----------------------------------------------------------------------------------------------
# The graph pass

_DEFAULTS = (-1, False, False)  # padding_idx, scale_grad_by_freq, sparse


def _arguments(n: fx.Node) -> tuple[Any, Any, int, bool, bool] | None:
    """(weight, ids, padding_idx, scale_grad_by_freq, sparse) of an aten.embedding node, positional
    or keyword, or None where an argument is not a plain value."""
    names = ("padding_idx", "scale_grad_by_freq", "sparse")
    weight, ids, *rest = n.args
    extra = list(rest) + [n.kwargs.get(k, d) for k, d in zip(names[len(rest):], _DEFAULTS[len(rest):], strict=True)]
    if any(isinstance(a, fx.Node) for a in extra):
        return None
    padding_idx, scale, sparse = extra
    return weight, ids, int(padding_idx), bool(scale), bool(sparse)


def takes(gm: fx.GraphModule | None, n: fx.Node) -> bool:
    """Is `n` an aten.embedding of a training graph that `rewrite_embeddings` rewrites (its weight a
    trainable graph input, neither sparse nor scale_grad_by_freq; SOLFORGE_EMBEDDING on)? The
    generated regions leave such a node to it (plan/generated.py)."""
    if gm is None or not settings.current().embedding or not gm.meta.get("grad_enabled", False):
        return False
    if n.op != "call_function" or n.target != aten.embedding.default:
        return False
    parsed = _arguments(n)
    if parsed is None:
        return False
    weight, ids, _, scale, sparse = parsed
    return _trainable_weight(weight) and isinstance(ids, fx.Node) and not scale and not sparse


def rewrite_embeddings(gm: fx.GraphModule) -> int:
    """Rewrite the `aten.embedding` calls of a training graph whose weight is a trainable graph
    input (neither sparse nor scale_grad_by_freq) into `embedding` calls. Returns how many it
    rewrote; does nothing with SOLFORGE_EMBEDDING=0 or when the graph was captured without autograd."""
    graph = gm.graph
    done = 0
    for n in list(graph.nodes):
        if not takes(gm, n):
            continue
        weight, ids, padding_idx, _, _ = _arguments(n)  # type: ignore[misc]
        with graph.inserting_before(n):
            call = graph.call_function(embedding, (weight, ids, padding_idx))
        call.meta.update(n.meta)  # val, stack_trace, nn_module_stack: the profile and reports read them
        n.replace_all_uses_with(call)
        graph.erase_node(n)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
