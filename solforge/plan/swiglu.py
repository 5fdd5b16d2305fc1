"""Find gated activations y = act(gate) * up in an ATen graph.

Canonical forms after capture (Qwen3/Llama `act_fn(gate_proj(x)) * up_proj(x)`, Gemma's
gelu_pytorch_tanh, Phi-3's `gate, up = gate_up.chunk(2, -1); up * act_fn(gate)`):

    a = silu(g)                       aten.silu
      | gelu(g, approximate="tanh")   -> act "gelu_tanh"
      | gelu(g[, approximate="none"]) -> act "gelu" (erf form)
      | mul(g, sigmoid(g))            silu written out (either operand order)
    y = mul(a, up)                    either operand order

g and up are whatever produced them (separate linears, or getitems of a chunk/split: the kernel
takes their row strides, so the views stay views). The region is the activation node(s) and the
mul; g and up stay in the graph.

What must stay correct, hence rejected: a broadcasting mul (up, or the result, shaped unlike g: the
kernel computes elementwise over one shape), mixed dtypes (the mul would promote), in-place muls
(they mutate a tensor the graph may read again), and `up` being part of the region itself. An
activation (or its sigmoid) read elsewhere too stays for that reader when plan/sharing.py allows
it: a shared sigmoid of a written-out silu does, a shared silu(g) does not (the kept silu and the
op are as many launches and bytes as silu and mul).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from solforge.plan.match import Match

aten = torch.ops.aten

_MUL = aten.mul.Tensor
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dead_detaches(node: fx.Node, user: fx.Node) -> list[fx.Node]:
    """`node`'s dead detach() users (autograd-enabled capture leaves `detach(sigmoid(g))` behind with
    no users): they go with the region. Other users make `node` a kept node (plan/sharing.py)."""
    return [u for u in node.users if u is not user and u.target == aten.detach.default and not u.users]


def _gelu_act(node: fx.Node) -> str | None:
    approx = node.args[1] if len(node.args) > 1 else node.kwargs.get("approximate", "none")
    return {"tanh": "gelu_tanh", "none": "gelu"}.get(approx)


def _activation(a: fx.Node, mul: fx.Node) -> tuple[fx.Node, str, list[fx.Node]] | None:
    """If `a` is act(g) used only by `mul`: (g, act name, region nodes in graph order, `a` last)."""
    if not isinstance(a, fx.Node) or a.op != "call_function":
        return None
    dead = _dead_detaches(a, mul)
    if a.target == aten.silu.default:
        return a.args[0], "silu", [a, *dead]
    if a.target == aten.gelu.default:
        act = _gelu_act(a)
        return (a.args[0], act, [a, *dead]) if act is not None else None
    if a.target == _MUL and len(a.args) == 2:  # g * sigmoid(g), either order
        for g, s in ((a.args[0], a.args[1]), (a.args[1], a.args[0])):
            if (isinstance(s, fx.Node) and s.target == aten.sigmoid.default and s.args[0] is g
                    and isinstance(g, fx.Node)):
                return g, "silu", [s, *_dead_detaches(s, a), a, *dead]
    return None


def _same(t: torch.Tensor, ref: torch.Tensor) -> bool:
    return tuple(t.shape) == tuple(ref.shape) and t.dtype == ref.dtype


def _match_mul(mul: fx.Node) -> Match | None:
    from solforge.kernels import swiglu as family

    if len(mul.args) != 2 or mul.kwargs:
        return None
    yv = _val(mul)
    if yv is None or yv.dtype not in _SUPPORTED or yv.dim() < 1:
        return None
    x0, x1 = mul.args
    for a, up in ((x0, x1), (x1, x0)):
        found = _activation(a, mul)
        if found is None:
            continue
        gate, act, act_nodes = found
        gv, uv, av = _val(gate), _val(up), _val(a)
        if gv is None or uv is None or av is None:
            continue
        # one shape and dtype everywhere: no broadcasting, no promotion
        if not (_same(gv, yv) and _same(uv, yv) and _same(av, yv)):
            continue
        nodes = [*act_nodes, mul]
        if up in nodes:
            continue
        workload = family.workload_for(gv, uv, act)
        return Match("swiglu", family.swiglu_op.default, mul, (gate, up, act), nodes, workload)
    return None


def match(graph: fx.Graph) -> list[Match]:
    found = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == _MUL:
            m = _match_mul(node)
            if m is not None:
                found.append(m)
    return found
