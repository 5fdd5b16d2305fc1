"""Find a residual add feeding a LayerNorm: s = a + b; y = layernorm(s), where s is usually also the
next residual (GPT-2: `hidden = attn_output + residual; residual = hidden; ln_2(hidden)`). Both
become one add_layernorm call returning (s, y).

Built on the layernorm matcher, as add_rmsnorm is on rmsnorm's: every LayerNorm whose input is an
out-of-place add of two tensors of its own shape and dtype (no broadcasting, no alpha) grows to
include that add. GPT-2's first add (token + position embeddings) broadcasts the position rows over
the batch when batch > 1: that norm stays a plain layernorm. The op is called where the add was, so
weight and bias must exist by then or be movable there (plan.late_inputs).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from solforge.plan import layernorm as _ln
from solforge.plan.match import Match, late_inputs, viewed

aten = torch.ops.aten


def match(graph: fx.Graph) -> list[Match]:
    from solforge.kernels import add_layernorm as family

    found = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for m in _ln.match(graph):
        s = m.args[0]
        if not isinstance(s, fx.Node) or s.target != aten.add.Tensor or s.kwargs.get("alpha", 1) != 1 \
                or len(s.args) != 2:
            continue
        a, b = s.args
        sv, av, bv = _ln._val(s), _ln._val(a), _ln._val(b)
        if sv is None or av is None or bv is None:
            continue
        if not (av.shape == bv.shape == sv.shape and av.dtype == bv.dtype == sv.dtype):
            continue
        _x, weight, bias, eps, out_dtype = m.args
        if any(p is not None and late_inputs(p, s, order) is None for p in (weight, bias)):
            continue
        # a norm over several trailing dims (plan/layernorm.py): the add's terms are merged like x
        vx, vw, vb = m.views[:3] if m.views else (None, None, None)
        wl = family.workload_for(viewed(av, vx), viewed(bv, vx), viewed(_ln._val(weight), vw),
                                 viewed(_ln._val(bias), vb), eps, out_dtype)
        if not family.supported(wl):
            continue
        views = (vx, vx, vw, vb, None, None) if m.views else ()
        found.append(Match(family.FAMILY, family.add_layernorm_op, s, (a, b, weight, bias, eps, out_dtype),
                           [s, *m.nodes], wl, outputs=(s, m.output), views=views, out_view=m.out_view))
    return found
