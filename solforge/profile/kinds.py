"""What a node is: its kind (gemm, attention, ...) and the pseudo-families the profiler names itself.

Kernel families (plan.find_matches) claim their regions first. For nodes no family claims, three
local patterns name the memory-bound work a kernel engineer looks for, so their counts can be
checked before a kernel family for them exists: `rope` (x*cos + rotate_half(x)*sin, rotate_half
being cat(-x2, x1)), `silu_mul` (silu(a) * b) and `residual_add` (a + b of two activations of the
same shape, no broadcasting). Everything else is grouped by (module path, kind). All the
classification lives in this file, but for a kernel family's kind: its row in kernels/registry.py.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from solforge.capture.pointwise import is_pointwise
from solforge.kernels import registry

aten = torch.ops.aten

KINDS = ("gemm", "attention", "normalization", "pointwise", "reduction", "copy", "other")
VIEW = "view"  # launches nothing: folded into a neighbour region

# pseudo-families -> kind (a family's region is one kind of work); a kernel family's kind is its
# row's in kernels/registry.py
PSEUDO_KIND = {"silu_mul": "pointwise", "rope": "pointwise", "residual_add": "pointwise"}


def family_kind(name: str) -> str | None:
    """The kind of a kernel family (the registry's, backward families included) or pseudo-family;
    None for a name neither knows (tests/test_family_contract.py checks every solforge op is known)."""
    return registry.kind(name) or PSEUDO_KIND.get(name)


_GEMM = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "_scaled_mm",
         "_int_mm", "convolution", "_convolution", "conv2d", "conv1d"}
_NORM = {"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_group_norm", "group_norm",
         "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "batch_norm"}
_COPY = {"_to_copy", "copy", "copy_", "clone", "cat", "stack", "reshape", "contiguous", "repeat",
         "repeat_interleave", "index_select", "embedding", "gather", "scatter", "index", "_unsafe_index",
         "constant_pad_nd", "flip", "roll", "slice_scatter", "select_scatter", "index_put", "index_put_",
         "masked_fill", "where_copy", "expand_copy", "tril", "triu"}
_REDUCTION = {"_softmax", "softmax", "_log_softmax", "log_softmax", "topk", "sort", "cumsum", "argmax", "argmin"}
# ops that alias their input (no kernel) but whose schema does not say so
_VIEWS = {"_unsafe_view", "alias", "detach", "lift_fresh", "lift_fresh_copy"}


def _packet(target: Any) -> str:
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", "") or str(target)


def node_kind(node: fx.Node) -> str:
    """One of KINDS, or VIEW for a node that launches no kernel."""
    t = getattr(node.target, "solforge_op", node.target)  # the op a direct call stands for (kernels/direct.py)
    if node.op != "call_function":
        return VIEW
    if t is operator.getitem:
        return VIEW
    name = _packet(t)
    ns = getattr(t, "namespace", "aten")
    if ns == "solforge":
        return registry.kind(name) or "other"
    if ns == "profiler" or getattr(t, "__module__", "") == __name__:
        return VIEW
    if name in _GEMM:
        return "gemm"
    if "attention" in name:
        return "attention"
    if name in _NORM:
        return "normalization"
    if name in _VIEWS or getattr(t, "is_view", False):
        return VIEW
    if name in _COPY:
        return "copy"
    tags = getattr(t, "tags", ())
    if name in _REDUCTION or torch.Tag.reduction in tags:
        return "reduction"
    if is_pointwise(t):
        return "pointwise"
    return "other"


# ----------------------------------------------------------------------------------------------
# pseudo-families


@dataclass
class PseudoMatch:
    family: str
    nodes: list[fx.Node]


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    v = _val(node)
    return tuple(int(d) for d in v.shape) if v is not None else None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


_MULS = {aten.mul.Tensor, aten.mul_.Tensor}
_ADDS = {aten.add.Tensor, aten.add_.Tensor}


def _last_dim(node: fx.Node, dim: Any) -> bool:
    s = _shape(node)
    return s is not None and dim in (-1, len(s) - 1)


def _half_slice(node: Any, x: fx.Node | None = None) -> tuple[fx.Node, int, int] | None:
    """slice(x, last dim, start, end) -> (x, start, end)."""
    if not isinstance(node, fx.Node) or node.target != aten.slice.Tensor:
        return None
    defaults = (None, 0, None, None, 1)  # slice.Tensor(self, dim=0, start=None, end=None, step=1)
    src, dim, start, end, step = (*node.args, *defaults[len(node.args):])
    if step != 1 or not isinstance(src, fx.Node) or (x is not None and src is not x) or not _last_dim(src, dim):
        return None
    n = _shape(src)[-1]  # type: ignore[index]
    start = 0 if start is None else int(start)
    end = n if end is None else min(int(end), n)
    return src, start, end


def match_rope(cat: fx.Node) -> PseudoMatch | None:
    """x*cos + cat(-x[..., h:], x[..., :h])*sin around the cat (the Hugging Face rotate_half form)."""
    if cat.target != aten.cat.default or len(cat.args[0]) != 2:
        return None
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    neg, second = cat.args[0]
    if not isinstance(neg, fx.Node) or neg.target != aten.neg.default or not _last_dim(cat, dim):
        return None
    a, b = _half_slice(neg.args[0]), _half_slice(second)
    if a is None or b is None or a[0] is not b[0]:
        return None
    x, n = a[0], _shape(a[0])[-1]  # type: ignore[index]
    if (a[1], a[2], b[1], b[2]) != (n // 2, n, 0, n // 2):
        return None
    nodes = [neg.args[0], second, neg, cat]
    mul_sin = _only_user(cat)
    if mul_sin is None or mul_sin.target not in _MULS:
        return PseudoMatch("rope", nodes)
    nodes.append(mul_sin)
    add = _only_user(mul_sin)
    if add is None or add.target not in _ADDS:
        return PseudoMatch("rope", nodes)
    other = add.args[0] if add.args[1] is mul_sin else add.args[1]
    if isinstance(other, fx.Node) and other.target in _MULS and x in other.args and len(other.users) == 1:
        nodes.insert(0, other)
    nodes.append(add)
    return PseudoMatch("rope", nodes)


def match_silu_mul(mul: fx.Node) -> PseudoMatch | None:
    """silu(a) * b with a and b of the output's shape (the SwiGLU MLP's gate)."""
    if mul.target not in _MULS:
        return None
    for act, other in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        if (isinstance(act, fx.Node) and act.target in (aten.silu.default, aten.silu_.default)
                and len(act.users) == 1 and isinstance(other, fx.Node) and _shape(act) == _shape(other) == _shape(mul)):
            return PseudoMatch("silu_mul", [act, mul])
    return None


def match_residual_add(add: fx.Node) -> PseudoMatch | None:
    """a + b of two floating activations of the same shape (rank >= 2, no broadcast, alpha 1)."""
    if add.target not in _ADDS or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    a, b = add.args
    va, vb, vo = _val(a), _val(b), _val(add)
    if va is None or vb is None or vo is None or not vo.dtype.is_floating_point or vo.dim() < 2:
        return None
    if not (tuple(va.shape) == tuple(vb.shape) == tuple(vo.shape)):
        return None
    return PseudoMatch("residual_add", [add])


PSEUDO_MATCHERS = (match_rope, match_silu_mul, match_residual_add)


def pseudo_matches(graph: fx.Graph, claimed: set[fx.Node]) -> list[PseudoMatch]:
    """Pseudo-family regions among the nodes no kernel family claimed (first matcher wins)."""
    found: list[PseudoMatch] = []
    for matcher in PSEUDO_MATCHERS:
        for node in graph.nodes:
            if node.op != "call_function" or node in claimed:
                continue
            m = matcher(node)
            if m is not None and claimed.isdisjoint(m.nodes):
                claimed.update(m.nodes)
                found.append(m)
    return found
