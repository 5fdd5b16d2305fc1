"""The canonical IR of a fusible region: its ATen ops over numbered inputs, as plain data.

A region is read off live fx nodes once (`from_nodes`); after that nothing refers to a graph. Inputs
are numbered by first use, ops by graph order, and a `getitem` of a multi-output op (var_mean) is
folded into the reference to that op's item, so node names never appear. `text` is the canonical
form (ops, constants, input shapes/strides/dtypes, output shapes/dtypes, device) and `key` its
sha256: the same computation in another graph or model gets the same key, the database's key of a
generated region. The reference (reference.py) runs exactly these ops; lower.py turns them into the
kernel graph the generator emits.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from solforge.capture import op_name

# bump when the meaning of the text changes (keys made by older generators must not match)
IR_VERSION = 1


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def text(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True)
class Ref:
    """An operand: input `i` (src "in") or op `i`'s value (src "op"; `item` picks one of a tuple)."""

    src: str
    i: int
    item: int | None = None

    def text(self) -> str:
        return f"in{self.i}" if self.src == "in" else f"%{self.i}" + ("" if self.item is None else f".{self.item}")


@dataclass(frozen=True)
class Op:
    target: str  # capture.op_name form, e.g. "aten.add.Tensor"
    args: tuple[Any, ...]  # Refs, scalars, tuples of ints, dtypes
    kwargs: tuple[tuple[str, Any], ...]
    out: tuple[TensorMeta, ...]  # one per result (var_mean: two)

    @property
    def meta(self) -> TensorMeta:
        return self.out[0]


@dataclass(frozen=True)
class RegionIR:
    inputs: tuple[TensorMeta, ...]
    ops: tuple[Op, ...]
    outputs: tuple[Ref, ...]
    device: str = "cpu"

    def out_meta(self, ref: Ref) -> TensorMeta:
        if ref.src == "in":
            return self.inputs[ref.i]
        return self.ops[ref.i].out[ref.item or 0]

    @property
    def text(self) -> str:
        lines = [f"solforge-codegen-ir v{IR_VERSION} {self.device}"]
        lines += [f"in{i}: {m.text()} stride{list(m.stride)}" for i, m in enumerate(self.inputs)]
        for i, op in enumerate(self.ops):
            args = ", ".join(_arg_text(a) for a in op.args)
            kw = "".join(f", {k}={_arg_text(v)}" for k, v in op.kwargs)
            outs = ", ".join(m.text() for m in op.out)
            lines.append(f"%{i} = {op.target}({args}{kw}) -> {outs}")
        lines.append("return " + ", ".join(r.text() for r in self.outputs))
        return "\n".join(lines)

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def _arg_text(a: Any) -> str:
    if isinstance(a, Ref):
        return a.text()
    if isinstance(a, (tuple, list)):
        return "[" + ", ".join(_arg_text(x) for x in a) + "]"
    if isinstance(a, float):
        return repr(a)  # exact: 1e-05 and 1e-06 give different keys
    return str(a)


def tensor_meta(v: Any) -> TensorMeta | None:
    """The static meta of a node's value; None when it is not one tensor with plain int sizes."""
    if not isinstance(v, torch.Tensor) or any(type(d) is not int for d in (*v.shape, *v.stride())):
        return None
    return TensorMeta(tuple(v.shape), tuple(v.stride()), v.dtype)


def node_metas(node: fx.Node) -> tuple[TensorMeta, ...] | None:
    """One meta per result of a node (a tuple value gives several); None if any is not static."""
    v = node.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else (v,)
    metas = tuple(tensor_meta(x) for x in vals)
    return None if any(m is None for m in metas) else metas  # type: ignore[return-value]


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def from_nodes(nodes: Sequence[fx.Node], outputs: Sequence[fx.Node], device: str | None = None) -> RegionIR:
    """The IR of `nodes` (graph order; getitems of a member op allowed) returning `outputs`.
    Every node must have static metas (regions.py admits only such nodes)."""
    return build(nodes, outputs, device)[0]


def build(nodes: Sequence[fx.Node], outputs: Sequence[fx.Node],
          device: str | None = None) -> tuple[RegionIR, list[fx.Node]]:
    """`from_nodes`, and the input nodes in the IR's order (in0, in1, ...)."""
    members = set(nodes)
    index: dict[fx.Node, int] = {}
    inputs: list[fx.Node] = []
    in_index: dict[fx.Node, int] = {}
    ops: list[Op] = []

    def ref(a: fx.Node) -> Ref:
        if a in members:
            if _is_getitem(a):
                return Ref("op", index[a.args[0]], int(a.args[1]))  # type: ignore[index, arg-type]
            return Ref("op", index[a])
        if a not in in_index:
            in_index[a] = len(inputs)
            inputs.append(a)
        return Ref("in", in_index[a])

    def conv(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ref(a)
        if isinstance(a, (list, tuple)):
            return tuple(conv(x) for x in a)
        if isinstance(a, torch.SymInt):
            raise ValueError("symbolic size in a region")
        return a

    for node in nodes:
        if _is_getitem(node):
            continue
        args = tuple(conv(a) for a in node.args)
        kwargs = tuple(sorted((k, conv(v)) for k, v in node.kwargs.items()))
        metas = node_metas(node)
        if metas is None:
            raise ValueError(f"{node.name} has no static tensor value")
        index[node] = len(ops)
        ops.append(Op(op_name(node.target), args, kwargs, metas))
    outs = tuple(ref(o) for o in outputs)
    in_metas = []
    for n in inputs:
        m = tensor_meta(n.meta.get("val"))
        if m is None:
            raise ValueError(f"input {n.name} has no static tensor value")
        in_metas.append(m)
    if device is None:
        # a region on the GPU may hold a 0-dim CPU constant (`torch.tensor(0.5)` in forward): the
        # GPU is its device whatever its first value's is
        vals = [n.meta.get("val") for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        device = next((v.device.type for v in vals if v.device.type != "cpu"), "cpu")
    return RegionIR(tuple(in_metas), tuple(ops), outs, device), inputs


def resolve(target: str) -> Any:
    """The OpOverload named by an `Op.target` ("aten.add.Tensor" -> torch.ops.aten.add.Tensor)."""
    ns, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)
