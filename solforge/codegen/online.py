"""The online patterns of a kernel graph: max / sum-of-exp (softmax, log_softmax, logsumexp,
cross-entropy) and sum / sum of squared deviations (mean and variance: LayerNorm, GroupNorm,
InstanceNorm, BatchNorm statistics, var, std).

A `max` reduction M over the loop's reduced dims, and a `sum` reduction S one stage later over
exp(c * (A - B)) (or exp2), where
  A  does not depend on M (any value of the loop: the inputs, pointwise ops of them, reductions of
     earlier stages),
  B  is M's value per row, as the lowering writes it: M itself, a reshape of it, or M with a row of
     -inf (or, logsumexp's, a row whose max is +-inf) shifted by a constant (lower._max_shift's
     `where(M == -inf, 0, M)`, `where(|M| == inf, 0, M)`),
  c  a positive constant (1 unless the graph scales: exp((x - m) / T), exp2((x - m) * log2e)).
A looped schedule with `online` computes S in M's pass: each lane keeps a running max m and a sum s
of exp(c * (A - B(m))); when m grows, s is rescaled by exp(c * (B(m_old) - B(m_new))), so the row is
read once for both (torch.compile's and kernels/softmax.py's online softmax). A lane whose max is
still -inf sums relative to B(0): its terms are 0 (or NaN from a NaN) whatever the reference point.
The lanes are combined at the end of the pass: M = max m_i, S = sum s_i * exp(c * (B(m_i) - B(M))),
a lane with m_i = -inf keeping its s_i; a row of -inf gets the graph's own value: S + 0 * exp(c *
(-inf - B(M))), 0 when B(-inf) is finite (the lowering's shift: softmax NaN, logsumexp -inf as
torch) and NaN when B is M unshifted (as the graph computes exp(-inf - -inf)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from solforge.codegen.lower import KernelGraph, KNode, Lowered

VAR_DOC = """
A `sum` reduction S1 of A over the loop's reduced dims, and a `sum` reduction S2 one stage later of
D * D, where D = A - S1 / K (K the reduced extent: the mean as the lowering writes it, through
reshapes) and A depends on no reduction of S1's stage or later: S2 is the sum of squared deviations
from the mean (var = S2 / (K - correction)). A chunked schedule with `online` computes S2 in S1's
pass (Welford): each lane keeps its count n, running mean m and sum of squared deviations q, a new
value x adding d = x - m, m += d / n, q += d * (x - m); the lanes are combined with S1 (the plain
sum, as without the pair) as S2 = sum(q_i + n_i * (m_i - S1 / K)^2) (Chan et al.), so a GroupNorm
reads its input twice (statistics, then the normalized store), not three times. A split writes each
program's q (about its own mean) and the next phase combines the programs' (S1, q) the same way,
each program's count known from its share of the row.
"""


@dataclass(frozen=True)
class Pair:
    mx: int  # the max reduce node
    sm: int  # the sum reduce node
    fn: str  # exp | exp2
    scale: float  # c
    chain: tuple[int, ...]  # the sum's operand down to the sub (A - B): each one pointwise
    b: int  # B's node


def _const(g: KernelGraph, i: int) -> float | None:
    n = g.nodes[i]
    if n.kind == "const" and isinstance(n.params[0], (int, float)) and not isinstance(n.params[0], bool):
        return float(n.params[0])
    return None


def _unview(g: KernelGraph, i: int) -> int:
    """Node i past its reshapes."""
    while g.nodes[i].kind == "view" and g.nodes[i].fn == "reshape":
        i = g.nodes[i].inputs[0]
    return i


def _is_max(g: KernelGraph, i: int) -> bool:
    n = g.nodes[i]
    return n.kind == "reduce" and n.fn == "max"


def _shift_of(g: KernelGraph, b: int) -> int | None:
    """The max node B stands for (M, a reshape of it, where(M == -inf, const, M) or, logsumexp's,
    where(|M| == inf, const, M)); else None."""
    b = _unview(g, b)
    n = g.nodes[b]
    if _is_max(g, b):
        return b
    if n.kind == "pw" and n.fn == "where":
        cond, mx = g.nodes[n.inputs[0]], _unview(g, n.inputs[2])
        f = _const(g, n.inputs[1])
        if not (_is_max(g, mx) and f is not None and math.isfinite(f) and cond.kind == "pw" and cond.fn == "eq"):
            return None
        left, bound = _unview(g, cond.inputs[0]), _const(g, cond.inputs[1])
        ln = g.nodes[left]
        if (bound == float("-inf") and left == mx) or \
                (bound == float("inf") and ln.kind == "pw" and ln.fn == "abs" and _unview(g, ln.inputs[0]) == mx):
            return mx
    return None


def _reduce_deps(g: KernelGraph) -> list[frozenset[int]]:
    """Per node: the reduce nodes it depends on (itself included for a reduce)."""
    out: list[frozenset[int]] = []
    for i, n in enumerate(g.nodes):
        d = frozenset().union(*(out[j] for j in n.inputs)) if n.inputs else frozenset()
        out.append(d | {i} if n.kind == "reduce" else d)
    return out


def _scaled_sub(g: KernelGraph, z: int) -> tuple[float, tuple[int, ...]] | None:
    """(c, chain) for z = A - B, (A - B) * c, c * (A - B) or (A - B) / c with c > 0."""
    n = g.nodes[z]
    if n.kind != "pw":
        return None
    if n.fn == "sub":
        return 1.0, (z,)
    if n.fn in ("mul", "div") and len(n.inputs) == 2:
        a, b = n.inputs
        order = [(a, b), (b, a)] if n.fn == "mul" else [(a, b)]
        for inner, k in order:
            c = _const(g, k)
            if c is not None and math.isfinite(c) and c > 0 and g.nodes[inner].kind == "pw" and \
                    g.nodes[inner].fn == "sub":
                return (c if n.fn == "mul" else 1.0 / c), (z, inner)
    return None


def pairs(region: Lowered) -> list[Pair]:
    """The region's online (max, sum of exp) pairs, at most one per max and per sum."""
    g, an = region.graph, region.analysis
    if region.scans:  # the sum's operand is evaluated in a scope of its own: a scan's carry must advance once a chunk
        return []
    stages = an.stages
    deps = _reduce_deps(g)
    out: list[Pair] = []
    used: set[int] = set()
    for sm, n in enumerate(g.nodes):
        if n.kind != "reduce" or n.fn != "sum":
            continue
        e = n.inputs[0]
        en: KNode = g.nodes[e]
        if en.kind != "pw" or en.fn not in ("exp", "exp2"):
            continue
        sc = _scaled_sub(g, en.inputs[0])
        if sc is None:
            continue
        c, chain = sc
        sub = g.nodes[chain[-1]]
        a, b = sub.inputs
        mx = _shift_of(g, b)
        if mx is None or mx in used or g.nodes[mx].params[0] != n.params[0] or stages[sm] != stages[mx] + 1:
            continue
        # A and the max's operand may read reductions of earlier stages only (they are done by M's pass)
        if any(stages[r] >= stages[mx] for r in deps[a] | deps[g.nodes[mx].inputs[0]]):
            continue
        used.add(mx)
        out.append(Pair(mx, sm, en.fn, c, (e, *chain), b))
    return out


@dataclass(frozen=True)
class VarPair:
    s1: int  # the sum node (the mean's numerator)
    s2: int  # the sum of squared deviations node
    a: int  # S1's operand


def _is_mean_of(g: KernelGraph, b: int, s1: int, count: int) -> bool:
    """Whether node b is S1 / count (through reshapes on either side)."""
    n = g.nodes[_unview(g, b)]
    return n.kind == "pw" and n.fn == "div" and len(n.inputs) == 2 and _unview(g, n.inputs[0]) == s1 and \
        _const(g, n.inputs[1]) == float(count)


def var_pairs(region: Lowered) -> list[VarPair]:
    """The region's (sum, sum of squared deviations) pairs (VAR_DOC), at most one per sum."""
    g, an = region.graph, region.analysis
    if region.scans:  # as `pairs`
        return []
    stages, deps, count = an.stages, _reduce_deps(g), region.space.cols
    out: list[VarPair] = []
    used: set[int] = set()
    for s2, n in enumerate(g.nodes):
        if n.kind != "reduce" or n.fn != "sum":
            continue
        sq = g.nodes[n.inputs[0]]
        if sq.kind != "pw" or sq.fn != "mul" or len(sq.inputs) != 2 or sq.inputs[0] != sq.inputs[1]:
            continue
        d = g.nodes[sq.inputs[0]]
        if d.kind != "pw" or d.fn != "sub" or len(d.inputs) != 2:
            continue
        a, b = d.inputs
        s1 = next((i for i in deps[b] if g.nodes[i].kind == "reduce" and g.nodes[i].fn == "sum"
                   and _is_mean_of(g, b, i, count)), None)
        if s1 is None or s1 in used or g.nodes[s1].inputs[0] != a or g.nodes[s1].params[0] != n.params[0] or \
                stages[s2] != stages[s1] + 1 or any(stages[r] >= stages[s1] for r in deps[a]):
            continue
        used.add(s1)
        out.append(VarPair(s1, s2, a))
    return out
