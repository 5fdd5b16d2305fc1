"""Find y = gelu(x [+ bias]) in an ATen graph, as one op or written out.

Canonical forms after capture:

    aten.gelu(x[, approximate="tanh"])   F.gelu, nn.GELU, HF GELUActivation / PytorchGELUTanh
    0.5 * x * (1 + tanh(c * (x + k * x^3)))   HF NewGELUActivation (GPT-2's gelu_new), FastGELU
                                              (x * c * (1 + k * x * x)), x*x*x for pow, any order
    0.5 * x * (1 + erf(x / sqrt(2)))     the erf form written out (HF's _gelu_python)

Written-out forms are matched by structure, then checked numerically: around each tanh (erf)
node, the region is the pointwise arithmetic from one tensor x to a node y such that y is a
function of x alone; it is evaluated in fp64 on points over [-8, 8] and must equal
F.gelu(x, approximate="tanh") ("none" for erf) within 1e-6. So the constants may be folded in any
order or rounded (0.7978845608), and a look-alike with another constant or shape is left alone.

Then an optional preceding `x = add(h, bias)` (bias 1-D of size x.shape[-1], same dtype, h of x's
shape) folds into the region when the add has no user outside it (it would be computed anyway).

Left alone: broadcasting or promoting arithmetic inside the region (every region node has x's
shape and dtype), unsupported dtypes, and regions whose inner nodes have other live users unless
plan/sharing.py lets the region keep them (a shared `pow(x, 3)` is kept; a tanh read elsewhere, or
any node whose keeping costs more than the fusion saves, makes the region smaller or absent). Order in
plan._matchers(): after swiglu, which claims gelu(gate) * up (a gelu it owns is not matched here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from solforge.plan.match import Match
from solforge.plan.sharing import Sharing

aten = torch.ops.aten

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
# pointwise arithmetic a written-out gelu is made of (evaluated on fp64 samples by `_evaluate`)
_ARITH = {aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
          aten.rsub.Scalar, aten.div.Tensor, aten.div.Scalar, aten.pow.Tensor_Scalar, aten.neg.default}
_PIVOTS = {aten.tanh.default: "tanh", aten.erf.default: "none"}
_DEPTH = 7  # how far back from the tanh x may sit: c * (x + k * pow(x, 3)) is 4 ops deep
_CHAIN = 5  # how far forward from the tanh y may sit: 0.5 * x * (1 + t) is 2 ops, some forms 3
_SAMPLES = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64)
_TOL = 1e-6


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _live_users(node: fx.Node) -> list[fx.Node]:
    """Users other than dead detach() calls (autograd-enabled capture can leave those behind)."""
    return [u for u in node.users if not (u.target == aten.detach.default and not u.users)]


def _dead_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target == aten.detach.default and not u.users]


def _approximate(node: fx.Node) -> str | None:
    approx = node.args[1] if len(node.args) > 1 else node.kwargs.get("approximate", "none")
    return approx if approx in ("none", "tanh") else None


def _region(y: fx.Node, x: fx.Node, pivot: fx.Node) -> set[fx.Node] | None:
    """The nodes computing y from x alone (pointwise arithmetic and the pivot, scalar operands), or
    None if y reads any other tensor or the pivot is not among them."""
    region: set[fx.Node] = set()
    stack = [y]
    while stack:
        n = stack.pop()
        if n is x or n in region:
            continue
        if n.op != "call_function" or (n.target not in _ARITH and n is not pivot):
            return None
        region.add(n)
        for a in (*n.args, *n.kwargs.values()):
            if isinstance(a, fx.Node):
                stack.append(a)
            elif not isinstance(a, (int, float)) or isinstance(a, bool):
                return None
    return region if pivot in region else None


def _evaluate(y: fx.Node, x: fx.Node, region: set[fx.Node], order: dict[fx.Node, int]) -> torch.Tensor:
    env: dict[fx.Node, torch.Tensor] = {x: _SAMPLES}

    def arg(a: Any) -> Any:
        return env[a] if isinstance(a, fx.Node) else a

    for n in sorted(region, key=order.__getitem__):
        env[n] = n.target(*[arg(a) for a in n.args], **{k: arg(v) for k, v in n.kwargs.items()})
    return env[y]


def _inner_users_ok(region: set[fx.Node], y: fx.Node, x: fx.Node, order: dict[fx.Node, int],
                    sharing: Sharing) -> bool:
    """Only y may be read outside the region, or inner nodes the region may keep (plan/sharing.py);
    dead detaches go with the region."""
    if all(n is y or all(u in region for u in _live_users(n)) for n in region):
        return True
    nodes = sorted(region | {d for n in region if n is not y for d in _dead_users(n)}, key=order.__getitem__)
    return sharing.allows(nodes, [y], [x])


def _same(node: fx.Node, ref: torch.Tensor) -> bool:
    v = _val(node)
    return v is not None and tuple(v.shape) == tuple(ref.shape) and v.dtype == ref.dtype


def _sources(pivot: fx.Node) -> list[fx.Node]:
    """Candidate x's: every node within _DEPTH steps back of the pivot through arithmetic, in
    graph order (the farthest, i.e. the earliest, first: x * 2 before a gelu must stay outside)."""
    seen: dict[fx.Node, None] = {}
    frontier = [a for a in pivot.args if isinstance(a, fx.Node)]
    for _ in range(_DEPTH):
        nxt = []
        for n in frontier:
            if n in seen:
                continue
            seen[n] = None
            if n.op == "call_function" and n.target in _ARITH:
                nxt += [a for a in n.args if isinstance(a, fx.Node)]
        frontier = nxt
    return list(seen)


def _sinks(pivot: fx.Node) -> list[fx.Node]:
    """Candidate y's: the chain of single live users after the pivot through arithmetic, longest
    first (0.5 * x * (1 + t) must not stop at 1 + t)."""
    chain: list[fx.Node] = []
    n = pivot
    for _ in range(_CHAIN):
        users = _live_users(n)
        if len(users) != 1 or users[0].op != "call_function" or users[0].target not in _ARITH:
            break
        n = users[0]
        chain.append(n)
    return chain[::-1]


def _written_out(pivot: fx.Node, order: dict[fx.Node, int],
                 sharing: Sharing) -> tuple[fx.Node, fx.Node, set[fx.Node], str] | None:
    """(x, y, region, approximate) of the written-out gelu around `pivot`, if there is one."""
    approximate = _PIVOTS[pivot.target]
    want = F.gelu(_SAMPLES, approximate=approximate)
    sources = sorted(_sources(pivot), key=order.__getitem__)
    for y in _sinks(pivot):
        yv = _val(y)
        if yv is None or yv.dtype not in _SUPPORTED or yv.dim() < 1:
            continue
        for x in sources:
            region = _region(y, x, pivot)
            if region is None or not all(_same(n, yv) for n in (x, *region)) \
                    or not _inner_users_ok(region, y, x, order, sharing):
                continue
            got = _evaluate(y, x, region, order)
            if got.shape == want.shape and bool(((got - want).abs() <= _TOL * (1 + want.abs())).all()):
                return x, y, region, approximate
    return None


def _bias_add(x: fx.Node, region: set[fx.Node]) -> tuple[fx.Node, fx.Node] | None:
    """(h, bias) if x = add(h, bias) with a 1-D bias of size x.shape[-1] and no user of x outside
    the region."""
    if x.op != "call_function" or x.target != aten.add.Tensor or len(x.args) != 2:
        return None
    if x.kwargs.get("alpha", 1) != 1 or not all(u in region for u in _live_users(x)):
        return None
    xv = _val(x)
    if xv is None or xv.dim() < 1:
        return None
    for h, b in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
        hv, bv = _val(h), _val(b)
        if hv is None or bv is None or h is b:
            continue
        if tuple(bv.shape) == (xv.shape[-1],) and bv.dtype == xv.dtype and _same(h, xv):
            return h, b
    return None


def _match(node: fx.Node, order: dict[fx.Node, int], sharing: Sharing) -> Match | None:
    from solforge.kernels import gelu as family

    if node.target == aten.gelu.default:
        approximate = _approximate(node)
        x, y, region = node.args[0], node, {node}
        yv = _val(node)
        if approximate is None or not isinstance(x, fx.Node) or yv is None or not _same(x, yv):
            return None
    else:
        found = _written_out(node, order, sharing)
        if found is None:
            return None
        x, y, region, approximate = found
    yv = _val(y)
    if yv is None or yv.dtype not in _SUPPORTED or yv.dim() < 1:
        return None
    region = region | {d for n in region if n is not y for d in _dead_users(n)}
    bias = None
    folded = _bias_add(x, region)
    if folded is not None:
        region = region | {x} | set(_dead_users(x))
        x, bias = folded
    nodes = sorted(region, key=order.__getitem__)
    bv = _val(bias)
    workload = family.workload_for(_val(x), bv, approximate)  # type: ignore[arg-type]
    return Match("gelu", family.gelu_op.default, y, (x, bias, approximate), nodes, workload)


def match(graph: fx.Graph) -> list[Match]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    sharing = Sharing(graph)
    found = []
    for node in list(graph.nodes):
        if node.op == "call_function" and (node.target == aten.gelu.default or node.target in _PIVOTS):
            m = _match(node, order, sharing)
            if m is not None:
                found.append(m)
    return found
