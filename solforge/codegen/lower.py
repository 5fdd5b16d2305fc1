"""Lower a region's ATen ops (ir.RegionIR) to the kernel graph the generator emits, and find its loop.

The kernel graph has five kinds of node, each with its shape and kernel type ('f': computed in fp32,
'b': bool, 'i': integer):
  load    input i, read through its strides at whatever index its reader asks for
  const   a Python scalar
  pw      one pointwise function (the `PW` templates in triton_gen.py) of its operands, broadcast
  view    index arithmetic: reshape, permute, expand, slice, select (no data moves); pad (its input
          shifted along one dim, a fill outside it: concatenation, constant pads, pooling windows)
  reduce  sum/max/min over some dims of one operand; argmax/argmin (the first index of the max/min,
          NaN counting as both, flat over the reduced dims: integer) and maxv/minv (the value
          there, NaN where the row holds one), from one (value, index) accumulator per operand
  scan    the running sum/product of one operand along one dim (cumsum, cumprod), forward or
          reversed, the operand's shape
  index   the index along one dim of its shape (an integer: triu/tril's masks, arange)
  gather  an indirect load: its source (a value that depends on no reduction) read at an index
          whose dims come from the gather's own index (`params[0]` per source dim: k >= 0 the
          gather's dim k) or from the value of an index operand (-(j+1): inputs[1 + j], broadcast
          to the gather's shape as a pointwise operand is; `params[1]`: a negative index wraps, as
          in advanced indexing). aten.index.Tensor, gather, index_select and embedding (whose
          negative indices torch refuses: out of range here); an index out of range
          (torch raises, a kernel cannot) reads the clamped element, never memory outside the
          source, and gives NaN for a floating source (the verifier and the outputs show it)
Composite ATen ops are written out here: mean = sum / n, var = sum((x - mean)^2) / (n - correction),
softmax = exp(x - max) / sum(exp(x - max)), _safe_softmax (0 on a row of -inf: one more reduction, `all`),
log_softmax, logsumexp, vector norms.

`analyze` finds the region's one loop space (shape S, reduced dims D) and checks that every value
that depends on a reduction is evaluated at the row of the loop point that reads it:
  pre   depends on no reduction: a pure function of the inputs, correct at any index
  row   depends on reductions and holds one value per row (numel = rows; a linear-order view of the
        keepdim shape), read by the pass that follows the reduction
  loop  depends on reductions and is aligned with the loop: its element at linear index j is the
        loop point at linear index j of S (shape S, or a reshape of such a value)
Each reduction's stage is one more than the deepest reduction its input needs (LayerNorm's var,
which reads the mean, is stage 2): a looped schedule makes one pass per stage, then one to store.

A scan's loop space is its shape with the scanned dim as the reduced one (a row: every other dim
fixed); its value is `loop`, at the stage of its input: each pass that reads it walks the row in
order (a running carry between chunks), so a region's scans all run one way. A view of a scan is
written as a scan of the view of its input where that is the same value (a flip: the reversed scan
of the flipped input; a pad with the scan's identity before a forward scan: a cat of zeros and a
cumsum; a prefix; views along other dims), since `analyze` refuses any other view of a value that
depends on a scan or reduction (it would read the row at other points than the loop's): the
region is cut there. The original scan is then dead; `lower` prunes dead nodes of a graph with a
scan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from solforge.codegen.ir import Ref, RegionIR


@dataclass(frozen=True)
class KNode:
    kind: str  # load | const | pw | view | reduce | scan | index | gather
    fn: str  # pw: template; view: reshape/permute/expand/slice/select/pad; reduce: sum/max/min; scan: sum/prod
    inputs: tuple[int, ...]
    params: tuple[Any, ...]
    shape: tuple[int, ...]
    ktype: str  # 'f' | 'b' | 'i'


@dataclass(frozen=True)
class KernelGraph:
    nodes: tuple[KNode, ...]
    outputs: tuple[int, ...]  # one node per region output


@dataclass(frozen=True)
class LoopSpace:
    shape: tuple[int, ...]  # S: the shape every reduction reads (pointwise: the outputs' shape)
    reduced: tuple[int, ...]  # D: the dims reduced (sorted); () for a pointwise region
    stages: int  # reduction stages (0: pointwise)

    @property
    def row_dims(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d not in self.reduced)

    @property
    def rows(self) -> int:
        return math.prod(self.shape[d] for d in self.row_dims)

    @property
    def cols(self) -> int:
        return math.prod(self.shape[d] for d in self.reduced)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Analysis:
    """The loop of a kernel graph, or why it has none. `bad_outputs`: outputs the loop cannot store
    (regions.py moves them out of the region)."""

    space: LoopSpace | None
    kinds: tuple[str, ...] = ()  # per node: pre | row | loop
    stages: tuple[int, ...] = ()  # per node: reduction stages it needs (a reduce: its own)
    error: str | None = None
    bad_outputs: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None and self.space is not None and not self.bad_outputs


class LowerError(ValueError):
    pass


def ktype_of(dtype: torch.dtype) -> str:
    return "f" if dtype.is_floating_point else "b" if dtype == torch.bool else "i"


def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*[torch.Size(s) for s in shapes]))


@dataclass(frozen=True)
class V:
    """A kernel-graph value among an op's arguments (a plain int is a scalar)."""

    id: int


class _Builder:
    def __init__(self, device: str = "cpu") -> None:
        self.device = device  # where the kernel runs: a few lowerings follow what torch does there
        self.nodes: list[KNode] = []
        self.seen: dict[KNode, int] = {}  # identical nodes are one (var_mean next to mean: one sum)
        self.current = ""  # the ATen op being lowered (entries shared by several ops branch on it)
        self.arg_dtypes: list[torch.dtype] = []  # the dtypes of its tensor operands, in order

    def add(self, kind: str, fn: str, inputs: Sequence[int], params: Sequence[Any], shape: Sequence[int],
            ktype: str) -> V:
        node = KNode(kind, fn, tuple(inputs), tuple(params), tuple(shape), ktype)
        if node not in self.seen:
            self.seen[node] = len(self.nodes)
            self.nodes.append(node)
        return V(self.seen[node])

    def shape(self, v: V) -> tuple[int, ...]:
        return self.nodes[v.id].shape

    def ktype(self, v: Any) -> str:
        if isinstance(v, V):
            return self.nodes[v.id].ktype
        return "b" if isinstance(v, bool) else "i" if isinstance(v, int) else "f"

    def t(self, v: Any) -> V:
        if isinstance(v, V):
            return v
        if not isinstance(v, (int, float, bool)):
            raise LowerError(f"operand {v!r} is not a tensor or a scalar")
        return self.add("const", "", (), (v,), (), self.ktype(v))

    def pw(self, fn: str, *ops: Any, params: Sequence[Any] = (), ktype: str | None = None) -> V:
        vs = [self.t(o) for o in ops]
        kt = ktype or ("f" if any(self.ktype(v) == "f" for v in vs) else
                       "i" if any(self.ktype(v) == "i" for v in vs) else "b")
        # Exact identities, kept out of the kernel: a mean over one element divides by 1, and then
        # `x - mean` would read `a*b - a*b`, which the GPU compiler contracts to fma(a, b, -a*b) (the
        # product's rounding error, not 0; times rsqrt(eps) in a norm of one element per group).
        if fn in ("div", "mul") and len(ops) == 2 and _is_one(ops[1]) and kt == "f" and self.ktype(vs[0]) == "f":
            return vs[0]
        if fn == "sub" and len(vs) == 2 and vs[0].id == vs[1].id and kt == "f":
            # x - x is +0, or NaN where x is inf/NaN: so is 0*x + 0, with no product to contract
            return self.pw("add", self.pw("mul", vs[0], 0.0), 0.0)
        return self.add("pw", fn, [v.id for v in vs], params, broadcast(*[self.shape(v) for v in vs]), kt)

    def view(self, fn: str, x: V, params: Sequence[Any], shape: Sequence[int]) -> V:
        if fn == "reshape" and tuple(shape) == self.shape(x):
            return x
        if fn != "reshape" and self.nodes[x.id].kind == "scan":
            got = self._through_scan(fn, x, tuple(params), tuple(shape))
            if got is not None:
                return got
        return self.add("view", fn, (x.id,), params, shape, self.nodes[x.id].ktype)

    def scan(self, fn: str, x: V, dim: int, reverse: bool = False) -> V:
        """The running sum/prod of x along dim (reversed: from the end), in fp32."""
        if self.nodes[x.id].ktype != "f":
            x = self.pw("to_f", x, ktype="f")
        s = self.shape(x)
        if not s or s[dim] == 1:  # a scan of one element is that element
            return x
        return self.add("scan", fn, (x.id,), (dim, reverse), s, "f")

    def _flip(self, x: V, dim: int) -> V:
        n = self.nodes[x.id]
        s = n.shape
        if n.kind == "view" and n.fn == "slice" and n.params == (dim, s[dim] - 1, -1):
            return V(n.inputs[0])  # a flip of a flip
        return self.view("slice", x, (dim, s[dim] - 1, -1), s)

    def _through_scan(self, fn: str, x: V, params: tuple[Any, ...], shape: tuple[int, ...]) -> V | None:
        """A view of scan x written as a scan of the same view of x's input, where the two are the
        same value (module docstring); None where they are not."""
        n = self.nodes[x.id]
        dim, rev = n.params
        y, s = V(n.inputs[0]), n.shape
        if fn == "permute":
            return self.scan(n.fn, self.view(fn, y, params, shape), list(params[0]).index(dim), rev)
        if fn == "expand":
            return self.scan(n.fn, self.view(fn, y, params, shape), dim + len(shape) - len(s), rev)
        if fn == "select":
            e = params[0]
            return None if e == dim else self.scan(n.fn, self.view(fn, y, params, shape), dim - (e < dim), rev)
        if fn == "slice":
            e, start, step = params
            if e == dim:
                if step == -1 and start == s[dim] - 1 and shape[dim] == s[dim]:  # a flip: the other way round
                    return self.scan(n.fn, self._flip(y, dim), dim, not rev)
                # a prefix of a forward scan (a suffix of a reversed one) is the scan of that part
                if step != 1 or (start + shape[dim] != s[dim] if rev else start != 0):
                    return None
            return self.scan(n.fn, self.view(fn, y, params, shape), dim, rev)
        if fn == "pad":
            e, before, fill = params
            if isinstance(fill, bool):
                fill = float(fill)
            if not isinstance(fill, (int, float)) or float(fill) != _SCAN_IDENTITY[n.fn]:
                return None
            # along the scan's dim: identities ahead of a forward scan (behind a reversed one) keep
            # its values and give the identity where they are; identities after it would not
            if e == dim and (before != 0 if rev else before + s[dim] != shape[dim]):
                return None
            return self.scan(n.fn, self.view(fn, y, params, shape), dim, rev)
        return None

    def reshape(self, x: V, shape: Sequence[int]) -> V:
        if math.prod(shape) != math.prod(self.shape(x)):
            raise LowerError(f"reshape {self.shape(x)} -> {tuple(shape)}")
        return self.view("reshape", x, (tuple(shape),), shape)

    def pad(self, x: V, dim: int, before: int, size: int, fill: Any) -> V:
        """x shifted by `before` along dim into a value `size` long there, `fill` outside it."""
        s = self.shape(x)
        if before == 0 and size == s[dim]:
            return x
        shape = (*s[:dim], size, *s[dim + 1:])
        return self.view("pad", x, (dim, before, fill), shape)

    def slice(self, x: V, dim: int, start: int, step: int, size: int) -> V:
        s = self.shape(x)
        if start == 0 and step == 1 and size == s[dim]:
            return x
        return self.view("slice", x, (dim, start, step), (*s[:dim], size, *s[dim + 1:]))

    def reduce(self, fn: str, x: V, dims: Sequence[int] | None, keepdim: bool) -> V:
        s = self.shape(x)
        ds = _dims(dims, len(s))
        out = tuple(1 if d in ds else n for d, n in enumerate(s)) if keepdim else \
            tuple(n for d, n in enumerate(s) if d not in ds)
        if self.nodes[x.id].ktype != "f":  # integers and booleans accumulate in int64: exact
            x = self.pw("to_i", x, params=("int64",), ktype="i")
        if math.prod(s[d] for d in ds) == 1 and math.prod(s) > 0:
            # over dims of size 1 a sum, max or min is its input: no loop of its own (a logsumexp of
            # a (B, 1) row sum, after a GEMM, would otherwise reduce a per-row value)
            return self.reshape(x, out)
        return self.add("reduce", fn, (x.id,), (ds, keepdim), out, self.nodes[x.id].ktype)

    def arg_reduce(self, fn: str, x: V, dims: tuple[int, ...], out: Sequence[int]) -> V:
        """argmax/argmin (the first index of the max/min along the reduced dims, as a flat index
        over them; a NaN counts as the max and the min, as in torch: int64) or maxv/minv (the value
        there: NaN where the row holds one), over dims of x, `out` the result's shape."""
        if self.nodes[x.id].ktype != "f":  # int8/int16/uint8 values are exact in fp32
            x = self.pw("to_f", x, ktype="f")
        s = self.shape(x)
        index = fn.startswith("arg")
        if math.prod(s[d] for d in dims) == 1 and math.prod(s) > 0:
            # over dims of size 1: index 0, the value itself (no loop of its own)
            if not index:
                return self.reshape(x, out)
            return self.view("expand", self.t(0), (tuple(out),), out) if out else self.t(0)
        keepdim = len(out) == len(s)
        return self.add("reduce", fn, (x.id,), (dims, keepdim), out, "i" if index else "f")


def _is_one(o: Any) -> bool:
    return isinstance(o, (int, float)) and not isinstance(o, bool) and o == 1


_SCAN_IDENTITY = {"sum": 0.0, "prod": 1.0}
# reduce fns of the (value, index) accumulator: each -> the direction it reduces in
ARG_FNS = {"argmax": "max", "argmin": "min", "maxv": "max", "minv": "min"}


def _dims(dims: Any, rank: int) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    out = sorted({d % rank if rank else 0 for d in dims})
    return tuple(out)


def _count(shape: Sequence[int], dims: Sequence[int]) -> int:
    return math.prod(shape[d] for d in dims)


# ------------------------------------------------------------------------------------------------
# ATen op -> kernel graph. Each entry: (builder, args, kwargs dict, out meta shapes) -> V or tuple of V.

Lowering = Callable[[_Builder, list[Any], dict[str, Any], list[tuple[int, ...]]], Any]
LOWERINGS: dict[str, Lowering] = {}


def _reg(*names: str) -> Callable[[Lowering], Lowering]:
    def deco(fn: Lowering) -> Lowering:
        for n in names:
            LOWERINGS[n] = fn
        return fn
    return deco


def _binary(fn: str, alpha: bool = False) -> Lowering:
    def low(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
        y = a[1]
        al = kw.get("alpha", a[2] if len(a) > 2 else 1)
        if alpha and al != 1:
            y = b.pw("mul", y, al)
        return b.pw(fn, a[0], y)
    return low


for _name, _fn in (("add", "add"), ("sub", "sub")):
    _reg(f"aten.{_name}.Tensor", f"aten.{_name}.Scalar")(_binary(_fn, alpha=True))
_reg("aten.mul.Tensor", "aten.mul.Scalar")(_binary("mul"))
_reg("aten.maximum.default")(_binary("max2"))
_reg("aten.minimum.default")(_binary("min2"))
for _cmp in ("eq", "ne", "lt", "le", "gt", "ge"):
    _reg(f"aten.{_cmp}.Tensor", f"aten.{_cmp}.Scalar")(
        lambda b, a, kw, out, _c=_cmp: b.pw(_c, a[0], a[1], ktype="b"))
_reg("aten.logical_and.default")(lambda b, a, kw, out: b.pw("and", b.pw("to_b", a[0], ktype="b"),
                                                             b.pw("to_b", a[1], ktype="b"), ktype="b"))
_reg("aten.logical_or.default")(lambda b, a, kw, out: b.pw("or", b.pw("to_b", a[0], ktype="b"),
                                                            b.pw("to_b", a[1], ktype="b"), ktype="b"))
_reg("aten.logical_not.default")(lambda b, a, kw, out: b.pw("not", a[0], ktype="b"))
_reg("aten.isnan.default")(lambda b, a, kw, out: b.pw("isnan", a[0], ktype="b"))
_reg("aten.isneginf.default")(lambda b, a, kw, out: b.pw("eq", _f(b, a[0]), float("-inf"), ktype="b"))
_reg("aten.isposinf.default")(lambda b, a, kw, out: b.pw("eq", _f(b, a[0]), float("inf"), ktype="b"))
_reg("aten.isinf.default")(lambda b, a, kw, out: b.pw("eq", b.pw("abs", _f(b, a[0])), float("inf"), ktype="b"))


@_reg("aten.rsub.Scalar", "aten.rsub.Tensor")
def _rsub(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    al = kw.get("alpha", a[2] if len(a) > 2 else 1)
    x = a[0] if al == 1 else b.pw("mul", a[0], al)
    return b.pw("sub", a[1], x)


@_reg("aten.div.Tensor", "aten.div.Scalar")
def _div(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    if b.device == "cuda" and isinstance(a[1], (int, float)) and not isinstance(a[1], bool) and a[1] != 0 \
            and torch.float64 not in b.arg_dtypes:
        # torch on CUDA divides by a number as a product with its reciprocal, rounded to fp32
        # (ATen's div_true_kernel_cuda: opmath 1 / b): the same in the kernel, so a quotient that a
        # decision reads (T5's bucket, log(d / 8) / log(16) * 8 cast to int64) rounds as torch's does
        return b.pw("mul", a[0], float(torch.tensor(1.0) / torch.tensor(float(a[1]))), ktype="f")
    return b.pw("div", a[0], a[1], ktype="f")


# unary float functions: ATen name -> template
_UNARY = {"neg": "neg", "abs": "abs", "exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "sqrt": "sqrt",
          "rsqrt": "rsqrt", "reciprocal": "recip", "sin": "sin", "cos": "cos", "tanh": "tanh",
          "sigmoid": "sigmoid", "erf": "erf", "floor": "floor", "ceil": "ceil", "trunc": "trunc", "sign": "sign",
          "log1p": "log1p", "expm1": "expm1", "relu": "relu", "silu": "silu", "hardsigmoid": "hardsigmoid",
          "hardswish": "hardswish", "mish": "mish"}
for _aten, _t in _UNARY.items():
    _float = _t not in ("neg", "abs", "relu", "sign")
    _reg(f"aten.{_aten}.default")(lambda b, a, kw, out, _t=_t, _f=_float: b.pw(_t, a[0], ktype="f" if _f else None))


@_reg("aten.gelu.default")
def _gelu(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    approx = kw.get("approximate", a[1] if len(a) > 1 else "none")
    return b.pw("gelu_tanh" if approx == "tanh" else "gelu", a[0], ktype="f")


@_reg("aten.leaky_relu.default")
def _leaky(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    return b.pw("leaky", a[0], params=(float(a[1] if len(a) > 1 else 0.01),), ktype="f")


@_reg("aten.hardtanh.default")
def _hardtanh(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    lo, hi = (list(a[1:]) + [-1.0, 1.0][len(a) - 1:])[:2]
    return b.pw("min2", b.pw("max2", a[0], float(lo)), float(hi))


@_reg("aten.elu.default")
def _elu(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    alpha, scale, iscale = (list(a[1:]) + [1.0, 1.0, 1.0][len(a) - 1:])[:3]
    return b.pw("elu", a[0], params=(float(alpha), float(scale), float(iscale)), ktype="f")


@_reg("aten.softplus.default")
def _softplus(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    beta, th = (list(a[1:]) + [1.0, 20.0][len(a) - 1:])[:2]
    return b.pw("softplus", a[0], params=(float(beta), float(th)), ktype="f")


@_reg("aten.pow.Tensor_Scalar")
def _pow(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x, e = a[0], a[1]
    if isinstance(e, bool) or not isinstance(e, (int, float)):
        raise LowerError("pow with a non-number exponent")
    if float(e).is_integer() and abs(e) <= 8:
        y = b.pw("pow_int", x, params=(abs(int(e)),), ktype="f" if e < 0 or b.ktype(x) == "f" else None)
        return b.pw("recip", y, ktype="f") if e < 0 else y
    if e == 0.5:
        return b.pw("sqrt", x, ktype="f")
    if e == -0.5:
        return b.pw("rsqrt", x, ktype="f")
    y = b.pw("powf", x, params=(float(e),), ktype="f")  # exp2(e log2 x): NaN for x < 0, as torch's
    # but -inf ** e is inf (e > 0) or 0, as C's pow
    return b.pw("where", b.pw("eq", x, float("-inf"), ktype="b"), math.inf if e > 0 else 0.0, y, ktype="f")


@_reg("aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default", "aten.clamp.Tensor")
def _clamp(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = a[0]
    lo = kw.get("min", a[1] if len(a) > 1 else None)
    hi = kw.get("max", a[2] if len(a) > 2 else None)
    if len(a) == 2 and not kw and out:  # clamp_min / clamp_max: one bound, which one is in the name
        pass
    return x if lo is None and hi is None else _bounds(b, x, lo, hi)


def _bounds(b: _Builder, x: Any, lo: Any, hi: Any) -> V:
    if lo is not None:
        x = b.pw("max2", x, lo)
    if hi is not None:
        x = b.pw("min2", x, hi)
    return x


_reg("aten.clamp_min.default")(lambda b, a, kw, out: b.pw("max2", a[0], a[1]))
_reg("aten.clamp_max.default")(lambda b, a, kw, out: b.pw("min2", a[0], a[1]))


@_reg("aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.where.Scalar")
def _where(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    c = b.t(a[0])
    if b.ktype(c) != "b":
        c = b.pw("to_b", c, ktype="b")
    kt = "f" if "f" in (b.ktype(a[1]), b.ktype(a[2])) else None
    return b.pw("where", c, a[1], a[2], ktype=kt)


@_reg("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
def _masked_fill(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    return b.pw("where", a[1], a[2], a[0], ktype=b.ktype(a[0]))


def _cast(b: _Builder, x: Any, dtype: torch.dtype) -> V:
    """A cast: to bool (x != 0), to an integer, or to a float type (rounded to it when it is narrower
    than fp32, as the graph stores it; computed in fp32 after)."""
    x = b.t(x)
    kt = ktype_of(dtype)
    if kt == "b":
        return b.pw("to_b", x, ktype="b") if b.ktype(x) != "b" else x
    if kt == "i":
        return b.pw("to_i", x, params=(str(dtype).removeprefix("torch."),), ktype="i")
    if dtype == torch.float64:
        raise LowerError("fp64 values are computed in fp32 by the generator: not fused")
    if dtype in (torch.bfloat16, torch.float16):
        return b.pw("round", x, params=(str(dtype).removeprefix("torch."),), ktype="f")
    return b.pw("to_f", x, ktype="f") if b.ktype(x) != "f" else x


@_reg("aten._to_copy.default")
def _to_copy(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    if kw.get("layout") not in (None, torch.strided) or kw.get("memory_format") not in (None, torch.preserve_format,
                                                                                          torch.contiguous_format):
        raise LowerError("a _to_copy that changes layout")
    dtype = kw.get("dtype")
    return b.t(a[0]) if dtype is None else _cast(b, a[0], dtype)


_reg("prims.convert_element_type.default")(lambda b, a, kw, out: _cast(b, a[0], a[1]))
_reg("aten.clone.default", "aten.alias.default", "aten.detach.default", "aten.lift_fresh_copy.default",
     "aten.contiguous.default")(lambda b, a, kw, out: b.t(a[0]))


def _typed(value: Any, kt: str | None) -> Any:
    """A fill value as a constant of the tensor's kernel type (zeros_like of a float tensor: 0.0,
    not the integer 0, which a cast of it would write as an integer literal)."""
    if kt is None or not isinstance(value, (bool, int, float)):
        return value
    return float(value) if kt == "f" else bool(value) if kt == "b" else int(value)


@_reg("aten.full.default", "aten.scalar_tensor.default")
def _full(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    value = a[1] if len(a) > 1 else a[0]
    dtype = kw.get("dtype")
    c = b.t(_typed(value, ktype_of(dtype) if isinstance(dtype, torch.dtype) else None))
    return b.view("expand", c, (tuple(out[0]),), out[0]) if out[0] else c


@_reg("aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default")
def _full_like(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    value = a[1] if len(a) > 1 else 0 if "zeros" in b.current else 1
    dtype = kw.get("dtype")
    c = b.t(_typed(value, ktype_of(dtype) if isinstance(dtype, torch.dtype) else b.ktype(a[0])))
    return b.view("expand", c, (tuple(out[0]),), out[0]) if out[0] else c


# --- views: index arithmetic

_reg("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
     "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.flatten.using_ints",
     "aten.unflatten.int")(lambda b, a, kw, out: b.reshape(b.t(a[0]), out[0]))


@_reg("aten.expand.default")
def _expand(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    return x if b.shape(x) == tuple(out[0]) else b.view("expand", x, (tuple(out[0]),), out[0])


def _permute(b: _Builder, x: V, perm: Sequence[int]) -> V:
    perm = tuple(p % len(perm) for p in perm)
    if perm == tuple(range(len(perm))):
        return x
    s = b.shape(x)
    return b.view("permute", x, (perm,), tuple(s[p] for p in perm))


_reg("aten.permute.default")(lambda b, a, kw, out: _permute(b, b.t(a[0]), a[1]))


@_reg("aten.transpose.int")
def _transpose(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    n = len(b.shape(x))
    if n == 0:
        return x
    perm = list(range(n))
    d0, d1 = a[1] % n, a[2] % n
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute(b, x, perm)


@_reg("aten.t.default")
def _t(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    return _permute(b, x, (1, 0)) if len(b.shape(x)) == 2 else x


@_reg("aten.slice.Tensor")
def _slice(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    s = b.shape(x)
    dim = (a[1] if len(a) > 1 else 0) % len(s)
    start = a[2] if len(a) > 2 and a[2] is not None else 0
    step = a[4] if len(a) > 4 else 1
    if start < 0:
        start += s[dim]
    start = min(max(start, 0), s[dim])
    if tuple(out[0]) == s and start == 0 and step == 1:
        return x
    return b.view("slice", x, (dim, start, step), out[0])


@_reg("aten.select.int")
def _select(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    s = b.shape(x)
    dim = a[1] % len(s)
    return b.view("select", x, (dim, a[2] % s[dim]), out[0])


# --- more pointwise ops, written with the templates above (no generator change)


def _f(b: _Builder, x: Any) -> V:
    x = b.t(x)
    return x if b.ktype(x) == "f" else b.pw("to_f", x, ktype="f")


@_reg("aten.celu.default")
def _celu(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    alpha = float(kw.get("alpha", a[1] if len(a) > 1 else 1.0))
    if alpha == 0:
        raise LowerError("celu with alpha 0")
    return b.pw("elu", a[0], params=(alpha, 1.0, 1.0 / alpha), ktype="f")


@_reg("aten.log_sigmoid_forward.default")
def _log_sigmoid(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> tuple[V, None]:
    # min(x, 0) - log1p(exp(-|x|)): no overflow either side; the buffer (for the backward) is not computed
    x = _f(b, a[0])
    e = b.pw("log1p", b.pw("exp", b.pw("neg", b.pw("abs", x)), ktype="f"), ktype="f")
    return b.pw("sub", b.pw("min2", x, 0.0), e, ktype="f"), None


@_reg("aten.softshrink.default", "aten.hardshrink.default")
def _shrink(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = _f(b, a[0])
    lam = float(kw.get("lambd", a[1] if len(a) > 1 else 0.5))
    if "hardshrink" in b.current:
        return b.pw("where", b.pw("le", b.pw("abs", x), lam, ktype="b"), 0.0, x, ktype="f")  # NaN stays NaN
    inner = b.pw("where", b.pw("lt", x, -lam, ktype="b"), b.pw("add", x, lam), b.pw("mul", x, 0.0), ktype="f")
    return b.pw("where", b.pw("gt", x, lam, ktype="b"), b.pw("sub", x, lam), inner, ktype="f")


@_reg("aten.triu.default", "aten.tril.default")
def _triu(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    s = b.shape(x)
    k = int(kw.get("diagonal", a[1] if len(a) > 1 else 0))
    if len(s) < 2:
        raise LowerError("triu/tril of fewer than 2 dims")
    col = b.add("index", "", (), (len(s) - 1,), s, "i")
    row = b.add("index", "", (), (len(s) - 2,), s, "i")
    d = b.pw("sub", col, row, ktype="i")
    keep = b.pw("ge" if "triu" in b.current else "le", d, k, ktype="b")
    return b.pw("where", keep, x, False if b.ktype(x) == "b" else 0, ktype=b.ktype(x))


@_reg("aten.threshold.default")
def _threshold(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    return b.pw("where", b.pw("le", x, a[1], ktype="b"), a[2], x, ktype=b.ktype(x))  # NaN stays NaN


@_reg("aten._prelu_kernel.default")
def _prelu(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x, w = _f(b, a[0]), b.t(a[1])
    if broadcast(b.shape(x), b.shape(w)) != b.shape(x):
        raise LowerError("prelu weight does not broadcast to the input")
    return b.pw("where", b.pw("gt", x, 0.0, ktype="b"), x, b.pw("mul", w, x), ktype="f")


@_reg("aten.logit.default")
def _logit(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = _f(b, a[0])
    eps = kw.get("eps", a[1] if len(a) > 1 else None)
    if eps is not None:
        x = _bounds(b, x, float(eps), 1.0 - float(eps))
    return b.pw("log", b.pw("div", x, b.pw("sub", 1.0, x), ktype="f"), ktype="f")


def _pw1(expr: Callable[[_Builder, V], V]) -> Lowering:
    return lambda b, a, kw, out: expr(b, _f(b, a[0]))


_LN10, _LN2 = math.log(10.0), math.log(2.0)
_reg("aten.erfc.default")(_pw1(lambda b, x: b.pw("sub", 1.0, b.pw("erf", x, ktype="f"))))
_reg("aten.sgn.default")(lambda b, a, kw, out: b.pw("sign", a[0]))
_reg("aten.frac.default")(_pw1(lambda b, x: b.pw("sub", x, b.pw("trunc", x, ktype="f"))))
_reg("aten.log10.default")(_pw1(lambda b, x: b.pw("mul", b.pw("log", x, ktype="f"), 1.0 / _LN10)))
_reg("aten.tan.default")(_pw1(lambda b, x: b.pw("div", b.pw("sin", x, ktype="f"), b.pw("cos", x, ktype="f"))))
_reg("aten.cosh.default")(_pw1(lambda b, x: b.pw("mul", b.pw("add", b.pw("exp", x, ktype="f"), b.pw(
    "exp", b.pw("neg", x), ktype="f")), 0.5)))
# sinh through expm1 of |x| keeps small arguments accurate: sinh = sign(x) * (e - 1/e) / 2, e = exp(|x|)
_reg("aten.sinh.default")(_pw1(lambda b, x: b.pw("mul", b.pw("sign", x), b.pw("mul", b.pw(
    "sub", b.pw("exp", b.pw("abs", x), ktype="f"), b.pw("exp", b.pw("neg", b.pw("abs", x)), ktype="f")), 0.5))))
# asinh = sign(x) log(|x| + sqrt(x^2 + 1)); past 2^28 (where x^2 + 1 is x^2 in fp32, and x^2 would
# overflow past 1.8e19) log(|x|) + log(2)
_reg("aten.asinh.default")(_pw1(lambda b, x: b.pw("mul", b.pw("sign", x), b.pw(
    "where", b.pw("gt", b.pw("abs", x), 268435456.0, ktype="b"),
    b.pw("add", b.pw("log", b.pw("abs", x), ktype="f"), _LN2),
    b.pw("log", b.pw("add", b.pw("abs", x), b.pw("sqrt", b.pw("add", b.pw("mul", x, x), 1.0), ktype="f")), ktype="f"),
    ktype="f"))))


@_reg("aten.round.default")
def _round_half_even(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = _f(b, a[0])
    r = b.pw("floor", b.pw("add", x, 0.5), ktype="f")
    # a tie (x + 0.5 whole) rounds to the even neighbour
    tie = b.pw("eq", b.pw("sub", r, x), 0.5, ktype="b")
    odd = b.pw("ne", b.pw("sub", r, b.pw("mul", b.pw("floor", b.pw("mul", r, 0.5), ktype="f"), 2.0)), 0.0, ktype="b")
    return b.pw("where", b.pw("and", tie, odd, ktype="b"), b.pw("sub", r, 1.0), r, ktype="f")


def _floored(b: _Builder, x: Any, y: Any) -> tuple[V, V]:
    """(fmod(x, y), whether the remainder's sign differs from y's): C's fmod is exact (Triton's
    float % is LLVM's frem), where x - y * floor(x / y) is not (1.0 and 0.1: the quotient rounds
    to 10, the remainder to -1.5e-8; torch's is 0.1), and NaN for an infinite x, as torch's."""
    m = b.pw("fmod", x, y, ktype="f")
    flip = b.pw("and", b.pw("ne", m, 0.0, ktype="b"),
                b.pw("ne", b.pw("lt", y, 0.0, ktype="b"), b.pw("lt", m, 0.0, ktype="b"), ktype="b"), ktype="b")
    return m, flip


def _int_floored(b: _Builder, x: Any, y: Any) -> tuple[V, V, V]:
    """(x // y truncated, x % y with x's sign, whether that remainder's sign differs from y's) in
    integer arithmetic (Triton's integer // and % are C's): exact for int64, where fp32 is not past
    2^24. A zero divisor is undefined in a kernel (torch raises on the CPU)."""
    for v in (x, y):
        if b.ktype(v) == "b":
            raise LowerError("an integer division of booleans")
    q = b.pw("idiv", x, y, ktype="i")
    r = b.pw("irem", x, y, ktype="i")
    flip = b.pw("and", b.pw("ne", r, 0, ktype="b"),
                b.pw("ne", b.pw("lt", r, 0, ktype="b"), b.pw("lt", y, 0, ktype="b"), ktype="b"), ktype="b")
    return q, r, flip


@_reg("aten.remainder.Scalar", "aten.remainder.Tensor", "aten.fmod.Scalar", "aten.fmod.Tensor")
def _remainder(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    if b.ktype(a[0]) != "f" and b.ktype(a[1]) != "f":
        _, r, flip = _int_floored(b, a[0], a[1])
        return r if "fmod" in b.current else b.pw("where", flip, b.pw("add", r, a[1], ktype="i"), r, ktype="i")
    m, flip = _floored(b, a[0], a[1])
    if "fmod" in b.current:
        return m
    return b.pw("where", flip, b.pw("add", m, a[1], ktype="f"), m, ktype="f")  # the divisor's sign


def _floor_div(b: _Builder, x: Any, y: Any) -> V:
    """torch's floor division of floats: (x - fmod(x, y)) / y, one less where the remainder's sign
    differs from y's, rounded to the nearest whole (so 1.0 // 0.1 is 9, as in torch and Python,
    where floor(1.0 / 0.1) is 10); a signed zero where that is 0, x / y for y = 0."""
    m, flip = _floored(b, x, y)
    d = b.pw("div", b.pw("sub", x, m, ktype="f"), y, ktype="f")
    d = b.pw("where", flip, b.pw("sub", d, 1.0, ktype="f"), d, ktype="f")
    f = b.pw("floor", d, ktype="f")
    f = b.pw("where", b.pw("gt", b.pw("sub", d, f, ktype="f"), 0.5, ktype="b"), b.pw("add", f, 1.0, ktype="f"), f,
             ktype="f")
    q = b.pw("div", x, y, ktype="f")
    f = b.pw("where", b.pw("eq", d, 0.0, ktype="b"), b.pw("mul", q, 0.0, ktype="f"), f, ktype="f")
    return b.pw("where", b.pw("eq", y, 0.0, ktype="b"), q, f, ktype="f")


@_reg("aten.floor_divide.default", "aten.div.Tensor_mode", "aten.div.Scalar_mode")
def _div_mode(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    mode = kw.get("rounding_mode", a[2] if len(a) > 2 else "floor" if "floor_divide" in b.current else None)
    ints = b.ktype(a[0]) != "f" and b.ktype(a[1]) != "f"
    if mode == "floor" and not ints:
        return _floor_div(b, a[0], a[1])
    if ints and mode is not None:  # in integer arithmetic: exact
        q, _, flip = _int_floored(b, a[0], a[1])
        return q if mode == "trunc" else b.pw("where", flip, b.pw("sub", q, 1, ktype="i"), q, ktype="i")
    q = b.pw("div", a[0], a[1], ktype="f")
    if mode is not None:
        q = b.pw("trunc", q, ktype="f")
    return q


def _pow_ff(b: _Builder, x: Any, y: Any) -> V:
    """x ** y for float tensors: |x| ** y, negated for a negative x and an odd whole y, NaN for a
    finite negative x and a fractional y; 1 where y is 0 (0 ** 0 too)."""
    xf, yf = _f(b, x), _f(b, y)
    mag = b.pw("exp2", b.pw("mul", yf, b.pw("log2", b.pw("abs", xf), ktype="f")), ktype="f")
    whole = b.pw("eq", b.pw("floor", yf, ktype="f"), yf, ktype="b")
    half = b.pw("mul", yf, 0.5)
    odd = b.pw("and", whole, b.pw("ne", b.pw("floor", half, ktype="f"), half, ktype="b"), ktype="b")
    # a fractional power of -inf is |x| ** y, as C's pow (inf, or 0 for y < 0); of a finite negative x NaN
    frac = b.pw("where", b.pw("eq", xf, float("-inf"), ktype="b"), mag, float("nan"), ktype="f")
    neg = b.pw("where", whole, b.pw("where", odd, b.pw("neg", mag), mag, ktype="f"), frac, ktype="f")
    r = b.pw("where", b.pw("lt", xf, 0.0, ktype="b"), neg, mag, ktype="f")
    return b.pw("where", b.pw("eq", yf, 0.0, ktype="b"), 1.0, r, ktype="f")


@_reg("aten.pow.Tensor_Tensor", "aten.pow.Scalar")
def _pow_t(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    if b.ktype(a[0]) != "f" and b.ktype(a[1]) != "f":
        raise LowerError("an integer power")
    return _pow_ff(b, a[0], a[1])


@_reg("aten.fmax.default", "aten.fmin.default")
def _fmax(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x, y = _f(b, a[0]), _f(b, a[1])
    m = b.pw("max2" if "fmax" in b.current else "min2", x, y, ktype="f")
    m = b.pw("where", b.pw("isnan", y, ktype="b"), x, m, ktype="f")  # a NaN loses to a number
    return b.pw("where", b.pw("isnan", x, ktype="b"), y, m, ktype="f")


_reg("aten.logical_xor.default")(lambda b, a, kw, out: b.pw("ne", b.pw("to_b", a[0], ktype="b"),
                                                             b.pw("to_b", a[1], ktype="b"), ktype="b"))


@_reg("aten.bitwise_not.default")
def _bitwise_not(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    if b.ktype(a[0]) != "b":
        raise LowerError("bitwise_not of an integer")
    return b.pw("not", a[0], ktype="b")


@_reg("aten.any.dim", "aten.any.dims", "aten.any.default", "aten.all.dim", "aten.all.dims", "aten.all.default")
def _any(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    dims = _dims(a[1] if len(a) > 1 else None, len(b.shape(x)))
    keepdim = bool(kw.get("keepdim", a[2] if len(a) > 2 else False))
    nz = b.pw("to_f", b.pw("to_b", x, ktype="b"), ktype="f")
    r = b.reduce("max" if ".any" in b.current else "min", nz, dims, keepdim)
    return b.pw("gt", r, 0.0, ktype="b")


# --- pads, concatenation, flips, rolls, pooling windows: pad and slice views

# ops whose list-of-tensors argument lower() passes as a tuple of values (index.Tensor's: None for a dim not indexed)
_LIST_OPS = {"aten.cat.default", "aten.index.Tensor"}


@_reg("aten.constant_pad_nd.default")
def _constant_pad(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    pads = list(a[1])
    value = kw.get("value", a[2] if len(a) > 2 else 0)
    rank = len(b.shape(x))
    for k in range(len(pads) // 2):  # pairs (before, after), from the last dim backwards
        dim = rank - 1 - k
        lo, hi = int(pads[2 * k]), int(pads[2 * k + 1])
        n = b.shape(x)[dim]
        # a negative pad crops
        start, stop = max(-lo, 0), n - max(-hi, 0)
        x = b.slice(x, dim, start, 1, stop - start)
        x = b.pad(x, dim, max(lo, 0), max(lo, 0) + (stop - start) + max(hi, 0), value)
    return x


@_reg("aten.cat.default")
def _cat(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    pieces = [b.t(x) for x in a[0]]
    shape = tuple(out[0])
    dim = kw.get("dim", a[1] if len(a) > 1 else 0) % len(shape)
    # torch skips 1-D empty pieces of a cat of other ranks
    pieces = [x for x in pieces if not (len(b.shape(x)) == 1 and b.shape(x)[0] == 0 and len(shape) > 1)]
    kt = "f" if any(b.ktype(x) == "f" for x in pieces) else "i" if any(b.ktype(x) == "i" for x in pieces) else "b"
    acc: V | None = None
    off = 0
    for x in pieces:
        n = b.shape(x)[dim]
        if n == 0:
            continue
        if kt != b.ktype(x):
            x = b.pw("to_f" if kt == "f" else "to_i", x, params=() if kt == "f" else ("int64",), ktype=kt)
        p = b.pad(x, dim, off, shape[dim], False if kt == "b" else 0)
        acc = p if acc is None else b.pw("or" if kt == "b" else "add", acc, p, ktype=kt)
        off += n
    if acc is None or off != shape[dim]:
        raise LowerError("cat of empty pieces")
    return acc


@_reg("aten.flip.default")
def _flip(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    s = b.shape(x)
    for d in _dims(a[1], len(s)) if a[1] else ():
        if s[d] > 1:
            x = b.view("slice", x, (d, s[d] - 1, -1), b.shape(x))
    return x


@_reg("aten.roll.default")
def _roll(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    shifts = list(a[1]) if isinstance(a[1], (list, tuple)) else [a[1]]
    dims = list(a[2]) if len(a) > 2 and isinstance(a[2], (list, tuple)) else [a[2]] if len(a) > 2 else []
    shape = b.shape(x)
    if not dims:  # a roll of the flattened tensor
        flat = _roll_dim(b, b.reshape(x, (math.prod(shape),)), 0, shifts[0])
        return b.reshape(flat, shape)
    for sh, d in zip(shifts, dims, strict=True):
        x = _roll_dim(b, x, d % len(shape), sh)
    return x


def _roll_dim(b: _Builder, x: V, dim: int, shift: int) -> V:
    n = b.shape(x)[dim]
    k = shift % n if n else 0
    if k == 0:
        return x
    # out[:k] = x[n-k:], out[k:] = x[:n-k]
    head = b.pad(b.slice(x, dim, n - k, 1, k), dim, 0, n, 0)
    tail = b.pad(b.slice(x, dim, 0, 1, n - k), dim, k, n, 0)
    return b.pw("or" if b.ktype(x) == "b" else "add", head, tail, ktype=b.ktype(x))


def _ints(v: Any, n: int, default: Sequence[int]) -> list[int]:
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return list(default)
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return [int(x) for x in (v * n if len(v) == 1 else v)]


def _windows(b: _Builder, x: V, out_sp: Sequence[int], k: Sequence[int], st: Sequence[int], pad: Sequence[int],
             dil: Sequence[int], fill: float) -> list[V]:
    """The taps of a pooling window over the last len(k) dims of x: one value of the output's shape
    per window offset (x padded with `fill`, then a strided slice per offset)."""
    rank, nd = len(b.shape(x)), len(k)
    taps = [x]
    for d in range(nd):
        dim = rank - nd + d
        n = b.shape(x)[dim]
        need = (out_sp[d] - 1) * st[d] + (k[d] - 1) * dil[d] + 1
        new = []
        for t in taps:
            tp = b.pad(t, dim, pad[d], max(need, 1), fill) if pad[d] or need > n else t
            new += [b.slice(tp, dim, j * dil[d], st[d], out_sp[d]) for j in range(k[d])]
        taps = new
    return taps


def _pool_args(b: _Builder, a: list[Any], x: V, nd: int) -> tuple[list[int], list[int], list[int]]:
    k = _ints(a[1], nd, ())
    st = _ints(a[2] if len(a) > 2 else None, nd, k)
    pad = _ints(a[3] if len(a) > 3 else None, nd, [0] * nd)
    if len(k) != nd or len(st) != nd or len(pad) != nd or b.ktype(x) != "f":
        raise LowerError("pooling arguments")
    return k, st, pad


@_reg("aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default", "aten.max_pool2d.default",
      "aten.max_pool3d.default")
def _max_pool(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> Any:
    x = b.t(a[0])
    nd = 3 if "3d" in b.current else 2
    k, st, pad = _pool_args(b, a, x, nd)
    dil = _ints(a[4] if len(a) > 4 else None, nd, [1] * nd)
    taps = _windows(b, x, out[0][-nd:], k, st, pad, dil, float("-inf"))
    r = taps[0]
    for t in taps[1:]:
        r = b.pw("max2", r, t, ktype="f")
    # the indices (what max_pool's backward reads) are not computed: a region may not return them
    return (r, None) if "with_indices" in b.current else r


@_reg("aten.avg_pool2d.default", "aten.avg_pool3d.default")
def _avg_pool(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    nd = 3 if "3d" in b.current else 2
    k, st, pad = _pool_args(b, a, x, nd)
    include = bool(a[5] if len(a) > 5 else kw.get("count_include_pad", True))
    override = a[6] if len(a) > 6 else kw.get("divisor_override")
    out_sp = out[0][-nd:]
    taps = _windows(b, x, out_sp, k, st, pad, [1] * nd, 0.0)
    total = taps[0]
    for t in taps[1:]:
        total = b.pw("add", total, t, ktype="f")
    if override:
        return b.pw("div", total, float(override), ktype="f")
    sp = b.shape(x)[-nd:]
    needs = [(o - 1) * s + kk for o, s, kk in zip(out_sp, st, k, strict=True)]
    if include and all(n <= m + 2 * p for n, m, p in zip(needs, sp, pad, strict=True)):
        return b.pw("div", total, float(math.prod(k)), ktype="f")
    # the divisor per output point: the window's size within the input (within the padded input
    # when count_include_pad), counted over a value of ones of the spatial shape
    ones = b.view("expand", b.t(1.0), (tuple(sp),), sp)
    if include:  # ones over the padded extent, zero past it (ceil_mode's last windows)
        for d in range(nd):
            ones = b.pad(ones, d, pad[d], sp[d] + 2 * pad[d], 1.0)
        pad = [0] * nd
    count = _windows(b, ones, out_sp, k, st, pad, [1] * nd, 0.0)
    c = count[0]
    for t in count[1:]:
        c = b.pw("add", c, t, ktype="f")
    return b.pw("div", total, c, ktype="f")


# --- indexing loads: x[idx] at an index read from a tensor (aten.index.Tensor, gather, index_select, embedding)

_INDEX_DTYPES = (torch.int32, torch.int64)


def _index_operands(b: _Builder, idxs: Sequence[Any]) -> list[V]:
    """The index tensors of an indexing op as values; int32/int64 only (a bool or uint8 index is a
    mask, whose result's shape depends on the data; int8/int16 torch refuses)."""
    out = [b.t(t) for t in idxs]
    dts = b.arg_dtypes[1:]
    if len(dts) != len(out) or any(dt not in _INDEX_DTYPES for dt in dts):
        raise LowerError(f"{b.current}: an index of dtype {dts} (int32/int64 only)")
    return out


def gather(b: _Builder, x: V, spec: Sequence[int], idxs: Sequence[V], shape: Sequence[int], wrap: bool) -> V:
    """x read at, per dim d of x, the gather's own index along dim spec[d] (>= 0) or the value of
    idxs[-spec[d] - 1] (broadcast to `shape` from the right, as a pointwise operand). `wrap`: a
    negative index counts from the end (advanced indexing); else it is out of range (torch's
    gather, index_select and embedding raise on it)."""
    for t in idxs:
        ts = b.shape(t)
        if len(ts) > len(shape) or any(n not in (1, m) for n, m in zip(ts[::-1], tuple(shape)[::-1], strict=False)):
            raise LowerError(f"{b.current}: an index of shape {b.shape(t)} does not broadcast to {tuple(shape)}")
    return b.add("gather", "", (x.id, *[t.id for t in idxs]), (tuple(spec), wrap), shape, b.ktype(x))


@_reg("aten.index.Tensor")
def _index(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    s = b.shape(x)
    idxs = list(a[1]) + [None] * (len(s) - len(a[1]))
    at = [d for d, t in enumerate(idxs) if t is not None]
    if not at or len(idxs) != len(s):
        raise LowerError("aten.index.Tensor without an index tensor")
    ts = _index_operands(b, [idxs[d] for d in at])
    B = broadcast(*[b.shape(t) for t in ts])
    rest = [d for d in range(len(s)) if d not in at]
    # torch: adjacent indexed dims are replaced in place by the index's broadcast shape; indexed
    # dims apart put it first. `dims`: per gather dim, the dim of x it walks (None: one of B's)
    b0 = at[0] if at == list(range(at[0], at[-1] + 1)) else 0
    dims: list[int | None] = [d for d in rest if d < b0] + [None] * len(B) + [d for d in rest if d >= b0]
    shape = tuple(B[k - b0] if d is None else s[d] for k, d in enumerate(dims))
    spec = [-(at.index(d) + 1) if d in at else dims.index(d) for d in range(len(s))]
    trail = len(shape) - b0 - len(B)
    ts = [b.reshape(t, (*b.shape(t), *([1] * trail))) for t in ts]
    return gather(b, x, spec, ts, shape, True)


@_reg("aten.gather.default")
def _gather(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    rank = len(b.shape(x))
    if rank == 0:
        raise LowerError("gather of a 0-d tensor")
    dim = a[1] % rank
    (t,) = _index_operands(b, [a[2]])
    if len(b.shape(t)) != rank:
        raise LowerError("gather with an index of another rank")
    return gather(b, x, [-1 if d == dim else d for d in range(rank)], [t], b.shape(t), False)


@_reg("aten.index_select.default")
def _index_select(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    s = b.shape(x)
    if not s:
        raise LowerError("index_select of a 0-d tensor")
    dim = a[1] % len(s)
    (t,) = _index_operands(b, [a[2]])
    n = math.prod(b.shape(t))
    t = b.reshape(t, (n, *[1] * (len(s) - dim - 1)))
    return gather(b, x, [-1 if d == dim else d for d in range(len(s))], [t], (*s[:dim], n, *s[dim + 1:]), False)


@_reg("aten.embedding.default")
def _embedding(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    # padding_idx and scale_grad_by_freq change only the backward (the padding row gets no
    # gradient): the forward is weight[ids] whatever they are
    w = b.t(a[0])
    if len(b.shape(w)) != 2:
        raise LowerError("embedding of a weight that is not 2-d")
    (t,) = _index_operands(b, [a[1]])
    ids = b.shape(t)
    return gather(b, w, [-1, len(ids)], [b.reshape(t, (*ids, 1))], (*ids, b.shape(w)[1]), False)


@_reg("aten.arange.default", "aten.arange.start", "aten.arange.start_step")
def _arange(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    """start + i * step along its one dim: an integer index (position ids), or a float in fp32."""
    start = a[0] if len(a) > 1 else 0
    step = a[2] if len(a) > 2 else 1
    dtype = kw.get("dtype")
    if dtype == torch.float64 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                         for v in (start, step)):
        raise LowerError("arange of fp64 or of non-number bounds")
    (n,) = out[0]
    i = b.add("index", "", (), (0,), (n,), "i")
    if dtype is not None and dtype.is_floating_point:
        v = b.pw("add", b.pw("mul", b.pw("to_f", i, ktype="f"), float(step)), float(start))
        return b.pw("round", v, params=(str(dtype).removeprefix("torch."),), ktype="f") \
            if dtype in (torch.bfloat16, torch.float16) else v
    if dtype is not None and dtype not in _INDEX_DTYPES:
        raise LowerError(f"arange of {dtype}")
    v = i if step == 1 else b.pw("mul", i, int(step), ktype="i")
    return v if start == 0 else b.pw("add", v, int(start), ktype="i")


# --- reductions


def _keep(b: _Builder, x: V, dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(1 if d in dims else n for d, n in enumerate(b.shape(x)))


def _mean(b: _Builder, x: V, dims: tuple[int, ...], keepdim: bool) -> V:
    return b.pw("div", b.reduce("sum", x, dims, keepdim), float(_count(b.shape(x), dims)), ktype="f")


@_reg("aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default")
def _sum(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    dims = _dims(a[1] if len(a) > 1 else None, len(b.shape(x)))
    keepdim = bool(kw.get("keepdim", a[2] if len(a) > 2 else False))
    if b.current.startswith("aten.mean"):
        return _mean(b, x, dims, keepdim)
    return b.reduce("sum", x, dims, keepdim)


@_reg("aten.amax.default", "aten.amin.default")
def _amax(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    dims = _dims(a[1] if len(a) > 1 else None, len(b.shape(x)))
    keepdim = bool(kw.get("keepdim", a[2] if len(a) > 2 else False))
    return b.reduce("max" if "amax" in b.current else "min", x, dims, keepdim)


def _arg_input(b: _Builder, x: Any) -> V:
    """The operand of an index-returning reduction, as the graph holds it: an integer wider than
    16 bits is refused (fp32, in which the kernel compares, would tie distinct values), and a
    computed bf16/fp16 value is rounded to its dtype (the kernel computes it in fp32, the graph
    compares it rounded: its ties are the graph's)."""
    x = b.t(x)
    dt = b.arg_dtypes[0] if b.arg_dtypes else None
    if dt in (torch.int32, torch.int64):
        raise LowerError(f"{b.current} of {dt}: not exact in fp32")
    if dt in (torch.bfloat16, torch.float16) and b.nodes[x.id].kind != "load":
        if dt == torch.bfloat16:  # to nearest even in integer arithmetic (the interpreter's cast truncates)
            x = b.pw("round_bf16", x, ktype="f")
        else:
            x = b.pw("round", x, params=("float16",), ktype="f")
    return x


@_reg("aten.argmax.default", "aten.argmin.default")
def _argmax(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = _arg_input(b, a[0])
    # dim None: over the flattened tensor (the reduced index walks every dim in order: a flat index)
    dims = _dims(kw.get("dim", a[1] if len(a) > 1 else None), len(b.shape(x)))
    return b.arg_reduce("argmax" if "argmax" in b.current else "argmin", x, dims, out[0])


@_reg("aten.max.dim", "aten.min.dim")
def _max_dim(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> tuple[V, V]:
    x = _arg_input(b, a[0])
    dims = _dims(a[1], len(b.shape(x)))
    fn = "max" if "max" in b.current else "min"
    # values and indices from one (value, index) accumulator: the value at the first max, NaN where
    # the row holds one (torch's max.dim propagates NaN; tl.max need not)
    return b.arg_reduce(fn + "v", x, dims, out[0]), b.arg_reduce("arg" + fn, x, dims, out[1])


@_reg("aten.cumsum.default", "aten.cumprod.default")
def _cumsum(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    dtype = kw.get("dtype")
    # an integer or bool input scans to int64 (exact past 2^24): left out, as is an integer dtype asked for
    if (dtype is None and b.ktype(x) != "f") or (dtype is not None and not dtype.is_floating_point):
        raise LowerError(f"{b.current} to an integer type")
    if dtype == torch.float64:
        raise LowerError("fp64 values are computed in fp32 by the generator: not fused")
    rank = len(b.shape(x))
    dim = kw.get("dim", a[1] if len(a) > 1 else 0)
    return b.scan("prod" if "cumprod" in b.current else "sum", x, dim % rank if rank else 0)


@_reg("aten.xlogy.Tensor", "aten.xlogy.Scalar_Other")
def _xlogy(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x, y = a[0], a[1]
    v = b.pw("where", b.pw("eq", x, 0.0, ktype="b"), 0.0, b.pw("mul", x, b.pw("log", y, ktype="f")), ktype="f")
    return b.pw("where", b.pw("isnan", y, ktype="b"), float("nan"), v, ktype="f")


def _var_parts(b: _Builder, a: list[Any], kw: dict[str, Any]) -> tuple[V, V, tuple[int, ...], bool]:
    """(var keepdim, mean keepdim, dims, keepdim) of var/std/var_mean's arguments."""
    x = b.t(a[0])
    if b.ktype(x) != "f":
        x = b.pw("to_f", x, ktype="f")
    dims = _dims(kw.get("dim", a[1] if len(a) > 1 else None), len(b.shape(x)))
    corr = kw.get("correction", a[2] if len(a) > 2 and not isinstance(a[2], bool) else None)
    if b.current.endswith(".dim"):  # var.dim(x, dims, unbiased, keepdim)
        corr = 1 if (a[2] if len(a) > 2 else kw.get("unbiased", True)) else 0
    corr = 1 if corr is None else corr
    keepdim = bool(kw.get("keepdim", a[3] if len(a) > 3 else False))
    n = _count(b.shape(x), dims)
    mean = _mean(b, x, dims, True)
    d = b.pw("sub", x, mean)
    var = b.pw("div", b.reduce("sum", b.pw("mul", d, d), dims, True), float(max(n - corr, 0)), ktype="f")
    return var, mean, dims, keepdim


def _unkeep(b: _Builder, v: V, x_shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> V:
    return v if keepdim else b.reshape(v, tuple(n for d, n in enumerate(x_shape) if d not in dims))


@_reg("aten.var.correction", "aten.var.dim", "aten.std.correction", "aten.std.dim", "aten.var_mean.correction")
def _var(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> Any:
    var, mean, dims, keepdim = _var_parts(b, a, kw)
    shape = b.shape(b.t(a[0]))
    if b.current.startswith("aten.std"):
        var = b.pw("sqrt", var, ktype="f")
    if b.current.startswith("aten.var_mean"):
        return _unkeep(b, var, shape, dims, keepdim), _unkeep(b, mean, shape, dims, keepdim)
    return _unkeep(b, var, shape, dims, keepdim)


def _max_shift(b: _Builder, x: V, dims: tuple[int, ...], infinite: bool = False) -> tuple[V, V]:
    """(x - m, m) with m the max over dims, kept; a row of -inf shifts by 0 (torch gives such a
    softmax NaN and its logsumexp -inf: both follow from the shifted sums); `infinite`: a max of
    +inf shifts by 0 too (torch's logsumexp: inf where the row holds +inf and no NaN)."""
    m = b.reduce("max", x, dims, True)
    test = b.pw("abs", m, ktype="f") if infinite else m
    m = b.pw("where", b.pw("eq", test, float("inf") if infinite else float("-inf"), ktype="b"), 0.0, m, ktype="f")
    return b.pw("sub", x, m), m


@_reg("aten._softmax.default", "aten._log_softmax.default")
def _softmax(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    if b.ktype(x) != "f":
        x = b.pw("to_f", x, ktype="f")
    dims = _dims(a[1], len(b.shape(x)))
    z, _ = _max_shift(b, x, dims)
    e = b.pw("exp", z, ktype="f")
    s = b.reduce("sum", e, dims, True)
    if "log_softmax" in b.current:
        return b.pw("sub", z, b.pw("log", s, ktype="f"))
    return b.pw("div", e, s, ktype="f")


@_reg("aten._safe_softmax.default")
def _safe_softmax(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    """softmax, 0 on a row of -inf only (attention with every key masked), as ATen's composite:
    where(all(isneginf(x), dim), 0, softmax(x)); a NaN in the row keeps it NaN. The `all` is one more
    reduction of the max's stage, so the row is still read once per stage."""
    x = b.t(a[0])
    dtype = kw.get("dtype", a[2] if len(a) > 2 else None)
    x = _cast(b, x, dtype) if dtype is not None else _f(b, x)
    dims = _dims(a[1], len(b.shape(x)))
    z, _ = _max_shift(b, x, dims)
    e = b.pw("exp", z, ktype="f")
    sm = b.pw("div", e, b.reduce("sum", e, dims, True), ktype="f")
    inf = b.pw("to_f", b.pw("eq", x, float("-inf"), ktype="b"), ktype="f")
    masked = b.pw("gt", b.reduce("min", inf, dims, True), 0.0, ktype="b")
    return b.pw("where", masked, 0.0, sm, ktype="f")


@_reg("aten.logsumexp.default")
def _logsumexp(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    if b.ktype(x) != "f":
        x = b.pw("to_f", x, ktype="f")
    dims = _dims(a[1], len(b.shape(x)))
    keepdim = bool(kw.get("keepdim", a[2] if len(a) > 2 else False))
    z, m = _max_shift(b, x, dims, infinite=True)
    r = b.pw("add", b.pw("log", b.reduce("sum", b.pw("exp", z, ktype="f"), dims, True), ktype="f"), m)
    return _unkeep(b, r, b.shape(x), dims, keepdim)


@_reg("aten.linalg_vector_norm.default")
def _vector_norm(b: _Builder, a: list[Any], kw: dict[str, Any], out: list[tuple[int, ...]]) -> V:
    x = b.t(a[0])
    if b.ktype(x) != "f":
        x = b.pw("to_f", x, ktype="f")
    order = kw.get("ord", a[1] if len(a) > 1 else 2)
    dims = _dims(kw.get("dim", a[2] if len(a) > 2 else None), len(b.shape(x)))
    keepdim = bool(kw.get("keepdim", a[3] if len(a) > 3 else False))
    if order == 2:
        r = b.pw("sqrt", b.reduce("sum", b.pw("mul", x, x), dims, keepdim), ktype="f")
    elif order == 1:
        r = b.reduce("sum", b.pw("abs", x), dims, keepdim)
    elif order == float("inf"):
        r = b.reduce("max", b.pw("abs", x), dims, keepdim)
    else:
        raise LowerError(f"vector norm of order {order}")
    return r


def lower(ir: RegionIR) -> KernelGraph:
    """The kernel graph of a region (raises LowerError for an op or argument it cannot write)."""
    b = _Builder(ir.device)
    loads: dict[int, V] = {}
    results: list[tuple[V | None, ...]] = []

    def val(r: Ref) -> V:
        if r.src == "in":
            if r.i not in loads:
                m = ir.inputs[r.i]
                loads[r.i] = b.add("load", "", (), (r.i,), m.shape, ktype_of(m.dtype))
            return loads[r.i]
        got = results[r.i][r.item or 0]
        if got is None:  # an item the lowering does not compute (max_pool's indices): only if nothing reads it
            raise LowerError(f"{ir.ops[r.i].target}: item {r.item} is not computed by the generator")
        return got

    def conv(a: Any) -> Any:
        if isinstance(a, Ref):
            return val(a)
        if isinstance(a, tuple) and any(isinstance(x, Ref) for x in a):
            if b.current not in _LIST_OPS:
                raise LowerError("a list of tensors as an argument")
            return tuple(conv(x) for x in a)
        return a

    def missing(a: Any) -> bool:
        if isinstance(a, Ref):
            return a.src == "op" and results[a.i][a.item or 0] is None
        return isinstance(a, tuple) and any(missing(x) for x in a)

    for op in ir.ops:
        low = LOWERINGS.get(op.target)
        if low is None:
            raise LowerError(f"no lowering for {op.target}")
        if any(missing(a) for a in op.args) or any(missing(v) for _, v in op.kwargs):
            # reads an item not computed (max_pool's indices, through a dead squeeze): so is its
            # result; an error only if the region returns it
            results.append((None,) * len(op.out))
            continue
        b.current = op.target
        b.arg_dtypes = [ir.out_meta(x).dtype for x in _flat(op.args) if isinstance(x, Ref)]
        got = low(b, [conv(a) for a in op.args], {k: conv(v) for k, v in op.kwargs}, [m.shape for m in op.out])
        got = got if isinstance(got, tuple) else (got,)
        got = tuple(None if g is None else b.t(g) for g in got)
        for g, m in zip(got, op.out, strict=True):
            if g is not None and b.shape(g) != m.shape:
                raise LowerError(f"{op.target}: lowered shape {b.shape(g)} != {m.shape}")
        results.append(got)
    kg = _exact_divisions(KernelGraph(tuple(b.nodes), tuple(val(r).id for r in ir.outputs)), ir.device == "cuda")
    # a view of a scan rewritten as a scan leaves the original behind, whose loop space (a cat's
    # piece is shorter than the cat) or direction (a flip's) is not the region's
    return _prune(kg) if any(n.kind == "scan" for n in kg.nodes) else kg


# pointwise fns that take a discrete decision on a float operand
_DECISIONS = {"to_i", "to_b", "floor", "ceil", "trunc", "sign", "eq", "ne", "lt", "le", "gt", "ge"}


def _exact_divisions(kg: KernelGraph, gpu: bool = True) -> KernelGraph:
    """Each division (and reciprocal) whose quotient reaches, through pointwise ops and views, a node
    that decides on it (a cast to an integer or bool, floor/ceil/trunc, a comparison) marked "rn":
    the generator writes it IEEE-rounded (tl.math.div_rn). Triton's fp32 `/` is the GPU's
    approximate division (div.full.f32, within 2 ulp): a quotient that is exactly whole may come out
    just below it and truncate to the integer below, where torch and the fp64 reference do not (T5's
    relative position buckets: log(16 / 8) / log(16) * 8 = 2 exactly; an integer output is verified
    exactly). A logarithm there likewise becomes libdevice's logf, torch's own on CUDA (tl.log is
    the approximate lg2 times ln 2: an ulp off at other than powers of two, which moved T5's buckets
    at distances up to 130 on an H200; on the GPU only: Triton's interpreter has no libdevice, and
    its tl.log is numpy's). The others keep the fast instructions."""
    reaches = [False] * len(kg.nodes)
    users: dict[int, list[int]] = {}
    for i, n in enumerate(kg.nodes):
        for j in n.inputs:
            users.setdefault(j, []).append(i)
    for i in range(len(kg.nodes) - 1, -1, -1):  # nodes come in topological order
        reaches[i] = any(kg.nodes[u].kind == "pw" and kg.nodes[u].fn in _DECISIONS or
                         kg.nodes[u].kind in ("pw", "view") and reaches[u] for u in users.get(i, ()))
    exact = ("div", "recip", "log") if gpu else ("div", "recip")
    nodes = tuple(replace(n, params=("rn",)) if n.kind == "pw" and n.fn in exact and
                  n.ktype == "f" and reaches[i] else n for i, n in enumerate(kg.nodes))
    return KernelGraph(nodes, kg.outputs) if nodes != kg.nodes else kg


def _flat(args: Sequence[Any]) -> list[Any]:
    """The arguments with list arguments spliced in (a cat's pieces, index.Tensor's indices)."""
    return [y for x in args for y in (x if isinstance(x, tuple) else (x,))]


def _prune(kg: KernelGraph) -> KernelGraph:
    """The graph without the nodes no output reads (node order kept)."""
    live: set[int] = set()
    todo = list(kg.outputs)
    while todo:
        i = todo.pop()
        if i not in live:
            live.add(i)
            todo += kg.nodes[i].inputs
    new = {i: k for k, i in enumerate(sorted(live))}
    nodes = tuple(KNode(n.kind, n.fn, tuple(new[j] for j in n.inputs), n.params, n.shape, n.ktype)
                  for i, n in enumerate(kg.nodes) if i in live)
    return KernelGraph(nodes, tuple(new[o] for o in kg.outputs))


# ------------------------------------------------------------------------------------------------
# The loop space


def _strip(shape: Sequence[int]) -> tuple[int, ...]:
    """A shape without its leading 1s (broadcasting lines shapes up from the right)."""
    s = list(shape)
    while s and s[0] == 1:
        s.pop(0)
    return tuple(s)


def analyze(kg: KernelGraph) -> Analysis:
    """The loop space of a kernel graph and each node's kind (see the module docstring)."""
    nodes = kg.nodes
    kinds: list[str] = []
    stages: list[int] = []
    S: tuple[int, ...] | None = None
    D: tuple[int, ...] = ()
    numel_s = rows = 0

    def fail(msg: str) -> Analysis:
        return Analysis(None, error=msg)

    ways = {n.params[1] for n in nodes if n.kind == "scan"}
    if len(ways) > 1:
        return fail("scans in both directions: no one order to walk the rows in")
    for n in nodes:
        dep = [j for j in n.inputs if kinds[j] != "pre"]
        st = max((stages[j] for j in n.inputs), default=0)
        if n.kind == "scan":  # a loop-aligned value over the scanned dim's rows, at its input's stage
            dims = (n.params[0],)
            if S is None:
                S, D = n.shape, dims
                numel_s = math.prod(S)
                rows = math.prod(S[d] for d in range(len(S)) if d not in D)
            elif n.shape != S or dims != D:
                return fail(f"a scan over {n.shape} dim {dims[0]} and the loop {S} over dims {D}: two loop spaces")
            if dep and kinds[dep[0]] != "loop":
                return fail("a scan of a per-row value")
            kinds.append("loop")
            stages.append(st)
            continue
        if n.kind == "reduce":
            dims, _keep = n.params
            src = nodes[n.inputs[0]]
            if S is None:
                S, D = src.shape, dims
                numel_s = math.prod(S)
                rows = math.prod(S[d] for d in range(len(S)) if d not in D)
            elif src.shape != S or dims != D:
                return fail(f"reductions over {S} dims {D} and {src.shape} dims {dims}: two loop spaces")
            if dep and kinds[dep[0]] != "loop":
                return fail("a reduction of a per-row value")
            kinds.append("row")
            stages.append(st + 1)
            continue
        if n.kind == "gather" and kinds[n.inputs[0]] != "pre":
            # its source is read at data-dependent points, not at the loop's: only a value correct
            # at any index can be (its index operands are read at the gather's own points)
            return fail("a gather from a value that depends on a reduction or scan")
        if not dep:
            kinds.append("pre")
            stages.append(0)
            continue
        assert S is not None
        stages.append(st)
        numel = math.prod(n.shape)
        if n.kind == "view":
            if n.fn != "reshape":
                return fail(f"a {n.fn} of a value that depends on a reduction")
            kinds.append(kinds[dep[0]])
            continue
        # pw, or a gather (as a pointwise op of its index operands)
        dk = {kinds[j] for j in dep}
        keep = tuple(1 if d in D else s for d, s in enumerate(S))
        if dk == {"row"} and numel == rows and all(_strip(nodes[j].shape) == _strip(n.shape) or
                                                   math.prod(nodes[j].shape) == 1 for j in dep):
            kinds.append("row")
        elif numel == numel_s and all(
                _strip(nodes[j].shape) == _strip(n.shape) if kinds[j] == "loop" else
                (math.prod(nodes[j].shape) == 1 or (_strip(n.shape) == _strip(S) and
                                                    _strip(nodes[j].shape) == _strip(keep)))
                for j in dep):
            kinds.append("loop")
        else:
            return fail(f"a pointwise op of shape {n.shape} over values of rows and loop points that do not line up")
    if S is None:  # pointwise: the loop is the largest output's shape
        if not kg.outputs:
            return fail("no outputs")
        S = max((nodes[o].shape for o in kg.outputs), key=math.prod)
        numel_s, rows = math.prod(S), math.prod(S)
    bad = []
    for k, o in enumerate(kg.outputs):
        numel = math.prod(nodes[o].shape)
        ok = numel == rows if kinds[o] == "row" else numel == numel_s if kinds[o] == "loop" else \
            numel in (numel_s, rows)
        if not ok:
            bad.append(k)
    space = LoopSpace(S, D, max(stages, default=0))
    return Analysis(space, tuple(kinds), tuple(stages), None, tuple(bad))


@dataclass(frozen=True)
class Lowered:
    """A region ready for schedules: its IR, kernel graph and loop analysis."""

    ir: RegionIR
    graph: KernelGraph
    analysis: Analysis

    @property
    def space(self) -> LoopSpace:
        assert self.analysis.space is not None
        return self.analysis.space

    @property
    def reduces(self) -> bool:
        """A loop of rows (reductions or scans), not a pointwise one."""
        return any(n.kind in ("reduce", "scan") for n in self.graph.nodes)

    @property
    def scans(self) -> bool:
        """Holds a scan: its passes walk each row in order within one program (rows, looped)."""
        return any(n.kind == "scan" for n in self.graph.nodes)

    @property
    def scan_reverse(self) -> bool:
        """Its scans run from the end of the row (analyze admits one direction per region)."""
        return any(n.kind == "scan" and n.params[1] for n in self.graph.nodes)

    @property
    def arg_reduces(self) -> bool:
        """Holds an index-returning reduction (argmax, max.dim): no split schedule (its partials
        would be (value, index) pairs the fp32 workspace does not hold)."""
        return any(n.kind == "reduce" and n.fn in ARG_FNS for n in self.graph.nodes)

    @property
    def int_reduces(self) -> bool:
        """Holds a sum, max or min of integers (int64 accumulators: exact, where fp32 is not past
        2^24): no split schedule (the workspace holds fp32 partials)."""
        return any(n.kind == "reduce" and n.fn not in ARG_FNS and n.ktype == "i" for n in self.graph.nodes)


def prepare(ir: RegionIR) -> Lowered:
    """Lower and analyze a region; raises LowerError when the generator cannot take it."""
    kg = lower(ir)
    an = analyze(kg)
    if not an.ok:
        raise LowerError(an.error or f"outputs {an.bad_outputs} cannot be stored by the region's loop")
    return Lowered(ir, kg, an)
