"""Find a residual add feeding an RMSNorm: s = a + b; y = rmsnorm(s), where s is also used later
(the residual stream). Both become one add_rmsnorm call returning (s, y).

Built on the rmsnorm matcher: every RMSNorm whose input is an out-of-place add of two tensors of
its own shape and dtype (no broadcasting, no alpha) grows to include that add. The op is called
where the add was, so a weight computed later (Gemma's `1.0 + weight`, inside the norm) must be
movable before it (plan.late_inputs; the rewrite moves it).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from solforge.plan import rmsnorm as _rms
from solforge.plan.match import Match, late_inputs, viewed

aten = torch.ops.aten


def match(graph: fx.Graph) -> list[Match]:
    from solforge.kernels import add_rmsnorm as family

    found = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for m in _rms.match(graph):
        s = m.args[0]
        if not isinstance(s, fx.Node) or s.target != aten.add.Tensor or s.kwargs.get("alpha", 1) != 1:
            continue
        a, b = s.args[0], s.args[1]
        sv, av, bv = _rms._val(s), _rms._val(a), _rms._val(b)
        if sv is None or av is None or bv is None:
            continue
        if not (av.shape == bv.shape == sv.shape and av.dtype == bv.dtype == sv.dtype):
            continue
        _x, weight, eps, out_dtype, rbw = m.args
        if weight is not None and late_inputs(weight, s, order) is None:
            continue
        # a norm over several trailing dims: the add's terms are merged like x; over a middle dim
        # (moved last): add_rmsnorm has no kernels for that layout, the norm stays an rmsnorm
        if m.out_view is not None and m.out_view[0] is not aten.unflatten.int:
            continue
        vx, vw = m.views[:2] if m.views else (None, None)
        wl = family.workload_for(viewed(av, vx), viewed(bv, vx), viewed(_rms._val(weight), vw), eps, out_dtype, rbw)
        if not family.supported(wl):
            continue
        views = (vx, vx, vw, None, None, None) if m.views else ()
        found.append(Match("add_rmsnorm", family.add_rmsnorm_op, s, (a, b, weight, eps, out_dtype, rbw),
                           [s, *m.nodes], wl, outputs=(s, m.output), views=views, out_view=m.out_view))
    return found
