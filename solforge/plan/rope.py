"""Find rotary position embedding of a q/k pair in an ATen graph (and the per-head RMSNorm before it).

Canonical form (Hugging Face Llama/Qwen3/Mistral `apply_rotary_pos_emb`, and any model that writes
rotate_half the same way), for each of q and k:

    c   = unsqueeze(cos, 1)          cos: (B or 1, S, D); unsqueeze(.., 2) for token-major x
    s   = unsqueeze(sin, 1)
    a   = mul(x, c)                  either operand order, here and below
    x1  = slice(x, -1, 0, D/2);  x2 = slice(x, -1, D/2, end)
    r   = cat([neg(x2), x1], -1)     rotate_half
    out = add(a, mul(r, s))

x is either transpose(v, 1, 2) of a token-major v (B, S, H, D) with cos unsqueezed at 1 (HF's
layout: the op reads v and returns the same (B, H, S, D) view HF returns), or token-major itself
with cos unsqueezed at 2. When v (or x) is the output of an RMSNorm chain (found by
solforge/plan/rmsnorm.py's matcher) used only by the rope, the norm joins the region: Qwen3's
q_norm/k_norm. This matcher therefore runs before the rmsnorm one (plan._matchers).

Two ropes sharing cos and sin become one region (one launch for q and k), paired in graph order.
Phi-3's partial-rotary spelling with rotary_dim == D (alias(x), and a cat with an empty remainder)
is the same rope (`_unalias`; the cat stays). Not matched (left to eager): a rope with no partner (an odd one
out), a (B, H, S, D) x that is not a transpose of a token-major tensor, partial rotary (rotate_half
over part of D), GPT-J's interleaved form (stack/flatten of pairs), cos/sin with a head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from solforge.plan import rmsnorm as rmsnorm_plan
from solforge.plan.match import Match
from solforge.plan.sharing import kept_nodes

aten = torch.ops.aten

_MULS = {aten.mul.Tensor}
_END = 2**62  # a slice "to the end" is recorded as a huge end (sys.maxsize)


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _other(node: fx.Node, one: Any) -> Any:
    """The operand of a binary node that is not `one` (None if `one` is not an operand)."""
    a, b = node.args[0], node.args[1]
    return b if a is one else a if b is one else None


class _Rope:
    """One rotary embedding found for one tensor."""

    def __init__(self, out: fx.Node, x: fx.Node, cu: fx.Node, su: fx.Node, nodes: list[fx.Node]) -> None:
        self.out, self.x, self.cu, self.su, self.nodes = out, x, cu, su, nodes
        self.cos: fx.Node = cu.args[0]  # type: ignore[assignment]
        self.sin: fx.Node = su.args[0]  # type: ignore[assignment]
        self.heads_first = cu.args[1] == 1


def _unsqueezed(node: Any, x_shape: torch.Size) -> bool:
    """cos/sin as HF broadcasts them: unsqueeze((Bc, S, D), 1 or 2), Bc in {1, B}."""
    if not isinstance(node, fx.Node) or node.target != aten.unsqueeze.default or node.args[1] not in (1, 2):
        return False
    src = _val(node.args[0])
    if src is None or src.dim() != 3 or not src.dtype.is_floating_point:
        return False
    B, D = x_shape[0], x_shape[3]
    S = x_shape[2] if node.args[1] == 1 else x_shape[1]
    return src.shape[0] in (1, B) and tuple(src.shape[1:]) == (S, D)


def _is_half_slice(node: Any, x: fx.Node, D: int, first: bool) -> bool:
    if not isinstance(node, fx.Node) or node.target != aten.slice.Tensor or node.args[0] is not x:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = args[1], args[2], args[3], args[4]
    start, end, step = start or 0, D if end is None or end >= _END else end, step or 1
    return dim in (3, -1) and step == 1 and (start, end) == ((0, D // 2) if first else (D // 2, D))


def _match_one(add: fx.Node) -> _Rope | None:
    """out = x * c + rotate_half(x) * s, with `add` as out."""
    if add.target != aten.add.Tensor or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    for a, m in ((add.args[0], add.args[1]), (add.args[1], add.args[0])):
        if not (isinstance(a, fx.Node) and isinstance(m, fx.Node) and a.target in _MULS and m.target in _MULS):
            continue
        for cat, su in ((m.args[0], m.args[1]), (m.args[1], m.args[0])):
            if not isinstance(cat, fx.Node) or cat.target != aten.cat.default or len(cat.args[0]) != 2:
                continue
            neg, x1 = cat.args[0]
            if (cat.args[1] if len(cat.args) > 1 else 0) not in (-1, 3) or not isinstance(neg, fx.Node) \
                    or neg.target != aten.neg.default:
                continue
            x2 = neg.args[0]
            x = x2.args[0] if isinstance(x2, fx.Node) and x2.args else None
            xv = _val(x)
            if xv is None or xv.dim() != 4 or xv.shape[3] % 2 or tuple(_val(add).shape) != tuple(xv.shape):  # type: ignore[union-attr]
                continue
            D = int(xv.shape[3])
            cu = _other(a, x)
            if not (_is_half_slice(x1, x, D, True) and _is_half_slice(x2, x, D, False)):
                continue
            if not (_unsqueezed(cu, xv.shape) and _unsqueezed(su, xv.shape) and cu.args[1] == su.args[1]):
                continue
            # an intermediate read elsewhere too stays for that reader if plan/sharing.py allows it
            nodes = [a, x1, x2, neg, cat, m, add]
            out, x = _unalias(add, x, nodes)  # type: ignore[arg-type]
            return _Rope(out, x, cu, su, nodes)  # type: ignore[arg-type]
    return None


def _unalias(add: fx.Node, x: fx.Node, nodes: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """(output, rotated tensor), seeing through alias(x): Phi-3 writes the rope in its partial-rotary
    form, `cat([rope(q[..., :rotary_dim]), q[..., rotary_dim:]], -1)`, and with rotary_dim == D the
    full slice is traced as alias(q) (joining the region). The cat with the empty remainder stays:
    it copies the rope's output to a contiguous tensor, and the graph after it was traced with
    plain `view`s that need one (the op's heads-first output is a transposed view)."""
    if x.target != aten.alias.default or not set(x.users) <= set(nodes) or not isinstance(x.args[0], fx.Node):
        return add, x
    nodes.insert(0, x)
    return add, x.args[0]


def _source(r: _Rope, norms: dict[fx.Node, Match]) -> tuple[fx.Node, list[fx.Node], Match | None] | None:
    """(token-major tensor v, region nodes between v and the rope, RMSNorm match producing v that
    only the rope uses, or None)."""
    v, extra = r.x, []
    inside = set(r.nodes)
    if r.heads_first:
        if v.target != aten.transpose.int or sorted(d % 4 for d in v.args[1:3]) != [1, 2]:
            return None
        if set(v.users) <= inside:  # the transposed view is used by the rope only
            extra.append(v)
            inside.add(v)
        v = v.args[0]  # type: ignore[assignment]
    norm = norms.get(v)
    if norm is not None and set(v.users) <= inside \
            and tuple(_val(norm.args[0]).shape) == tuple(_val(v).shape):  # type: ignore[union-attr]
        return v, extra, norm
    return v, extra, None


def _fusable(nq: Match | None, nk: Match | None) -> bool:
    """Both norms found, with one eps and one round_before_weight, both with a weight or neither
    (rmsnorm Match args: x, weight, eps, out_dtype, round_before_weight)."""
    return nq is not None and nk is not None and nq.args[2] == nk.args[2] and nq.args[4] == nk.args[4] \
        and (nq.args[1] is None) == (nk.args[1] is None)


def _pair(q: _Rope, k: _Rope, norms: dict[fx.Node, Match], order: dict[fx.Node, int]) -> Match | None:
    from solforge.kernels import rope as family

    if q.x is k.x:  # one tensor rotated twice: not a q/k pair (and its nodes would be claimed twice)
        return None
    sq, sk = _source(q, norms), _source(k, norms)
    if sq is None or sk is None or sq[0] is sk[0]:
        return None
    (vq, eq, nq), (vk, ek, nk) = sq, sk
    nodes = [*eq, *ek, *q.nodes, *k.nodes]
    fused = _fusable(nq, nk)
    if fused:
        assert nq is not None and nk is not None
        # the norms join only if the rope would keep none of their nodes: an intermediate of the
        # rope read elsewhere (rotate_half(q)) keeps what it reads, up to the whole q norm, which
        # then runs unfused; the rope reading the norms' outputs keeps only its own few ops, and
        # the norms are rmsnorm regions of their own (plan/sharing.py)
        norm_nodes = {*nq.nodes, *nk.nodes}
        fused = norm_nodes.isdisjoint(kept_nodes([*nodes, *norm_nodes], (q.out, k.out)))
    if fused:
        assert nq is not None and nk is not None
        xq, xk = nq.args[0], nk.args[0]
        qw, kw, eps, rbw = nq.args[1], nk.args[1], float(nq.args[2]), bool(nq.args[4])
        nodes += [*nq.nodes, *nk.nodes]
    else:  # any norms stay for the rmsnorm matcher; the rope reads their outputs
        xq, xk, qw, kw, eps, rbw = vq, vk, None, None, 1e-6, False
    qv, kv, cv, sv = _val(xq), _val(xk), _val(q.cos), _val(q.sin)
    if qv is None or kv is None or cv is None or sv is None or qv.dtype != kv.dtype \
            or qv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if tuple(qv.shape[:2]) != tuple(kv.shape[:2]) or qv.shape[3] != kv.shape[3]:
        return None
    out_dtype = _val(q.out).dtype  # type: ignore[union-attr]
    if _val(k.out).dtype != out_dtype:  # type: ignore[union-attr]
        return None
    outs = (q.out, k.out)
    # cos/sin unsqueezes used by this pair only go too (dead after the rewrite otherwise)
    inside = set(nodes)
    for u in {q.cu, q.su, k.cu, k.su}:
        if set(u.users) <= inside:
            nodes.append(u)
    nodes.sort(key=order.__getitem__)
    args = (xq, xk, q.cos, q.sin, qw, kw, eps, fused, rbw, q.heads_first, out_dtype)
    # the op is called before the earlier output: every input must exist by then
    first = min(order[o] for o in outs)
    if any(order[a] >= first for a in args if isinstance(a, fx.Node)):
        return None
    workload = family.workload_for(qv, kv, cv, sv, _val(qw), _val(kw), eps, norm=fused, round_before_weight=rbw,
                                   heads_first=q.heads_first, out_dtype=out_dtype)
    return Match(family.FAMILY, family.rope_op.default, q.out, args, nodes, workload, outputs=outs)


def match(graph: fx.Graph) -> list[Match]:
    ropes = [r for n in graph.nodes if n.op == "call_function" and (r := _match_one(n)) is not None]
    if len(ropes) < 2:
        return []
    norms = {m.output: m for m in rmsnorm_plan.match(graph) if not m.views}  # a q/k norm: over the last dim
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple[fx.Node, fx.Node, bool], list[_Rope]] = {}
    for r in ropes:
        groups.setdefault((r.cos, r.sin, r.heads_first), []).append(r)
    found = []
    for group in groups.values():
        for i in range(0, len(group) - 1, 2):
            m = _pair(group[i], group[i + 1], norms, order)
            if m is not None:
                found.append(m)
    return found
