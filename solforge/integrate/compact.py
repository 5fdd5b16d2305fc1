"""Fewer ops for the host to dispatch: the integrated graph's linear layers as one `aten.linear` each.

The captured ATen graph spells every `nn.Linear` on a (B, S, in) input as four ops:

    t = aten.t(W);  a = aten.view(x, [B*S, in]);  m = aten.mm(a, t)   (aten.addmm(b, a, t) with a bias)
    y = aten._unsafe_view(m, [B, S, out])

and the optimized model runs its graph op by op from Python (integrate/__init__.py: dynamo calls the
rewritten GraphModule), each op paying Python, the dispatcher and, in training, autograd's
bookkeeping. Four ops per linear are 28 of the ~40 a layer keeps after the rewrite. Measured on
the H100 hosts (tools/host_train.py, Qwen3-4B training step B1 S4096, each step started on an
idle device as after a `loss.item()`):
- before: the optimized forward took 67.2 ms of host time for 67.3 ms of device time
  (-host-train-s7.json): the device waited on the host, so faster kernels could not shorten it;
- with this pass, in one process (-host-train-compact-s7.json): 56.6 ms host / 64.1 ms device
  and a 207.9 ms step, against 71.1 / 72.4 and 212.3, then 79.7 / 79.8 and 220.0, without it;
- under BASELINES.md's protocol (triton's do_bench, no sync between steps, so the host runs a
  step ahead) the step is unchanged: 204.8 and 203.8 ms with, 203.3 without
  (-qwen3-4b-train-compact-s7.json).

`recompose_linear` puts back the `aten.linear(x, W[, b])` that nn.Linear called in the first
place: one op from Python, whose decomposition into the same view/mm (or addmm) runs in C++ (as
in eager), so the values and gradients are those of the model as written. Only the exact pattern
is recomposed: `t` the transpose of a 2-D weight, default alpha/beta, and either `a` a view of x
flattening its leading dims with `y` the view back to them (linear(x, W)), or else the 2-D `a`
itself (linear(a, W), saving the `t`; also for `a @ b.t()` of two activations). Nodes the
pattern leaves without users are erased; one still read elsewhere (a flattening view that CSE
shared between q, k and v) stays. It runs after the kernel rewrite (the planners and the profiler
see the graph as captured: the linear_cross_entropy matcher looks for the mm).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from solforge import settings

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _shape(n: object) -> tuple[Any, ...] | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    # symbolic sizes stay symbols: the comparisons below hold for every size or add a guard, where
    # int() would pin the graph to one size
    return tuple(val.shape)


def _linear_parts(mm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, fx.Node] | None:
    """(x, W, bias or None, the node whose value the linear replaces) if `mm` is the matmul of a
    decomposed nn.Linear, else None."""
    if mm.target == aten.mm.default and len(mm.args) == 2 and not mm.kwargs:
        a, t = mm.args
        bias = None
    elif mm.target == aten.addmm.default and len(mm.args) == 3 and not mm.kwargs:
        bias, a, t = mm.args
    else:
        return None
    if not (isinstance(t, fx.Node) and t.target == aten.t.default and isinstance(a, fx.Node)):
        return None
    w = t.args[0]
    ws, as_ = _shape(w), _shape(a)
    if ws is None or as_ is None or len(ws) != 2 or len(as_) != 2 or as_[1] != ws[1]:
        return None
    if bias is not None and _shape(bias) != (ws[0],):  # a 1-D bias of the output width only
        return None
    # nn.Linear on an N-D x: a flattens x's leading dims, the result is viewed back to them
    x = a.args[0] if a.target in _VIEWS else None
    xs = _shape(x)
    if isinstance(x, fx.Node) and xs is not None and len(xs) >= 2 and xs[-1] == ws[1] \
            and math.prod(xs[:-1]) == as_[0] and len(mm.users) == 1:
        (y,) = mm.users
        if y.target in _VIEWS and _shape(y) == (*xs[:-1], ws[0]):
            return x, w, bias, y
    return a, w, bias, mm  # otherwise the 2-D a as it is: linear(a, W) is a @ W.t() all the same


def recompose_linear(gm: fx.GraphModule) -> int:
    """Replace each decomposed nn.Linear in `gm` by one aten.linear call (module docstring);
    returns how many. Recompiles `gm` when it changed anything. Does nothing with SOLFORGE_COMPACT=0
    (settings.compact), e.g. to measure the pass."""
    if not settings.current().compact:
        return 0
    graph = gm.graph
    done = 0
    for mm in [n for n in graph.nodes if n.op == "call_function" and n.target in (aten.mm.default,
                                                                                 aten.addmm.default)]:
        parts = _linear_parts(mm)
        if parts is None:
            continue
        x, w, bias, out = parts
        with graph.inserting_before(out):
            lin = graph.call_function(aten.linear.default, (x, w) if bias is None else (x, w, bias))
        lin.meta.update(out.meta)
        for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):  # where the matmul came from
            if k in mm.meta:
                lin.meta[k] = mm.meta[k]
        out.replace_all_uses_with(lin)
        # latest first, each only once nothing reads it: a view shared with other code stays
        for n in dict.fromkeys((out, mm, *mm.args)):
            if isinstance(n, fx.Node) and n.op == "call_function" and not n.users and n not in (x, w, bias):
                graph.erase_node(n)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
