"""Triton source of one generated region under one schedule: a single @triton.jit kernel.

Every value of the kernel graph is computed at an index: a tuple of index expressions, one per dim
of the value's shape. Loads read `ptr + sum(idx[d] * stride[d])` with the strides as kernel
arguments (so permuted, expanded and sliced inputs need no copy); views rewrite the index (a
permute permutes it, an expand zeroes broadcast dims, a slice scales and shifts it, a reshape goes
through the linear index, a pad shifts it and masks its input's loads to the range, its fill
elsewhere: concatenations, constant pads and pooling windows); pointwise ops evaluate their
operands at the broadcast index; a gather reads its source at an index taken from its index
operands' values (wrapped when negative, clamped into range: `_Gen.gather`); a reduction is an
accumulator of the current rows (an online pair, Schedule.online: a running max and a rescaled sum
of exp per lane, in one pass); a scan is
tl.cumsum / tl.cumprod of its input over the tile's reduced axis (identities in masked lanes),
combined, in a looped pass, with a carry: the running total of the row's earlier chunks, the
chunks walked in the scans' direction. Values are memoized per (node, index), so a value read at
one index is computed once per tile (a scan: once per tile, read only at the loop point).

The loop: the flat loop index (pointwise) or the pair (row, reduced index) (reductions), each
decomposed by div/mod over the loop shape S: the row index over the kept dims, the reduced index
over the reduced dims, in order, so any set of reduced dims works. A reduction's tile is
[rows, reduced] (rows, looped, split) or [reduced, rows] (tiles: the kept dim on the fast axis,
the row index decomposed with the schedule's `contig` dim innermost). A split schedule's kernel has
a constexpr PHASE: one launch per reduction stage, each writing fp32 partials to a workspace `ws`
after combining the earlier stages' partials, then one that stores. A transposing pointwise region
under `tiles` is indexed by two tile axes and the program id (`_pointwise_tiles`). Shapes are literals of the source
(a generated kernel is for one region, whose key holds its shapes); strides are arguments.
Where a tensor's memory is one linear range over a run of its dims (`linear_runs`: each dim's
stride is the next one's times its size; a contiguous (N, C, D, H, W) over C, D, H, W) and the
index along the run was cut from one linear index (`delin`: a reshape of the loop), the address is
that linear index times the run's last stride, not the sum of its div/mod digits times theirs:
Triton then sees the loads along the loop's fastest index as contiguous and vectorizes them (a
GroupNorm over (16, 128, 34, 34, 34) read its input through four digits per element). The runs
are part of the kernel (`generate`'s `runs`): the launcher builds one per runs of the tensors it is
given, so any strides still work.
Arithmetic is fp32 (loads upcast, stores cast to the output's dtype); explicit casts to bf16/fp16
round as the graph does. Every tail is masked; masks known to be all-true are left out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from solforge.codegen import layout, online
from solforge.codegen.lower import ARG_FNS, KNode, Lowered
from solforge.codegen.schedule import Schedule, split_chunk, tile_axes

KERNEL = "generated_kernel"
I32_MAX = 2**31 - 1


def _lit(v: object, kt: str) -> str:
    if isinstance(v, bool):
        return "1.0" if (v and kt == "f") else "0.0" if kt == "f" else str(v)
    if kt == "f" or isinstance(v, float):
        f = float(v)  # type: ignore[arg-type]
        if math.isnan(f):
            return 'float("nan")'
        if math.isinf(f):
            return 'float("inf")' if f > 0 else 'float("-inf")'
        return repr(f)
    return str(v)


def _p(e: str) -> str:
    return e if re.fullmatch(r"[\w.]+", e) else f"({e})"


# max and min keep a NaN, as torch's maximum, clamp, hardtanh and max pools do (Triton's default
# lets the GPU return the other operand: PTX's max.f32; the interpreter's np.maximum keeps it)
_NAN = "propagate_nan=tl.PropagateNan.ALL"

# pointwise templates: operand expressions (already in the op's kernel type) and params -> expression
PW: dict[str, Callable[[Sequence[str], Sequence[object]], str]] = {
    "add": lambda a, p: f"{a[0]} + {a[1]}",
    "sub": lambda a, p: f"{a[0]} - {_p(a[1])}",
    "mul": lambda a, p: f"{_p(a[0])} * {_p(a[1])}",
    # "rn": IEEE-rounded, where a decision reads the quotient (lower._exact_divisions); else the fast `/`
    "div": lambda a, p: f"tl.math.div_rn({a[0]}, {a[1]})" if p == ("rn",) else f"{_p(a[0])} / {_p(a[1])}",
    "neg": lambda a, p: f"-{_p(a[0])}",
    "abs": lambda a, p: f"tl.abs({a[0]})",
    "exp": lambda a, p: f"tl.exp({a[0]})",
    "exp2": lambda a, p: f"tl.exp2({a[0]})",
    # "rn": libdevice's logf (torch's on CUDA, correctly rounded to within 1 ulp) where a decision
    # reads the result (lower._exact_divisions); else tl.log (the GPU's approximate lg2 x ln 2)
    "log": lambda a, p: f"libdevice.log({a[0]})" if p == ("rn",) else f"tl.log({a[0]})",
    "log2": lambda a, p: f"tl.log2({a[0]})",
    "sqrt": lambda a, p: f"tl.sqrt({a[0]})",
    "rsqrt": lambda a, p: f"tl.rsqrt({a[0]})",
    "recip": lambda a, p: f"tl.math.div_rn(1.0, {a[0]})" if p == ("rn",) else f"1.0 / {_p(a[0])}",
    "sin": lambda a, p: f"tl.sin({a[0]})",
    "cos": lambda a, p: f"tl.cos({a[0]})",
    # tanh through the sigmoid: no libdevice (absent from the interpreter), exact in both tails
    "tanh": lambda a, p: f"2.0 * tl.sigmoid(2.0 * {_p(a[0])}) - 1.0",
    "sigmoid": lambda a, p: f"tl.sigmoid({a[0]})",
    "erf": lambda a, p: f"tl.erf({a[0]})",
    "floor": lambda a, p: f"tl.floor({a[0]})",
    "ceil": lambda a, p: f"tl.ceil({a[0]})",
    "trunc": lambda a, p: f"tl.where({_p(a[0])} < 0, tl.ceil({a[0]}), tl.floor({a[0]}))",
    "sign": lambda a, p: f"tl.where({_p(a[0])} > 0, 1.0, tl.where({_p(a[0])} < 0, -1.0, 0.0))",
    "log1p": lambda a, p: f"tl.log(1.0 + {_p(a[0])})",
    "expm1": lambda a, p: f"tl.exp({a[0]}) - 1.0",
    "relu": lambda a, p: f"tl.where({_p(a[0])} < 0, 0, {a[0]})",  # NaN stays NaN, as torch's
    "silu": lambda a, p: f"{_p(a[0])} * tl.sigmoid({a[0]})",
    "gelu": lambda a, p: f"0.5 * {_p(a[0])} * (1.0 + tl.erf({_p(a[0])} * 0.7071067811865476))",
    # 0.5 * (1 + tanh(z)) == sigmoid(2z)
    "gelu_tanh": lambda a, p: f"{_p(a[0])} * tl.sigmoid(1.5957691216057308 * ({a[0]} + 0.044715 * {_p(a[0])} * "
                              f"{_p(a[0])} * {_p(a[0])}))",
    "hardsigmoid": lambda a, p: f"tl.minimum(tl.maximum({_p(a[0])} / 6.0 + 0.5, 0.0, {_NAN}), 1.0, {_NAN})",
    "hardswish": lambda a, p: f"{_p(a[0])} * tl.minimum(tl.maximum({_p(a[0])} + 3.0, 0.0, {_NAN}), 6.0, {_NAN}) / 6.0",
    "mish": lambda a, p: f"{_p(a[0])} * (2.0 * tl.sigmoid(2.0 * tl.where({_p(a[0])} > 20.0, {a[0]}, "
                         f"tl.log(1.0 + tl.exp({a[0]})))) - 1.0)",
    "leaky": lambda a, p: f"tl.where({_p(a[0])} > 0, {a[0]}, {_p(a[0])} * {_lit(p[0], 'f')})",
    "elu": lambda a, p: f"tl.where({_p(a[0])} > 0, {_p(a[0])} * {_lit(p[1], 'f')}, "
                        f"(tl.exp({_p(a[0])} * {_lit(p[2], 'f')}) - 1.0) * {_lit(p[0] * p[1], 'f')})",  # type: ignore[operator]
    "softplus": lambda a, p: f"tl.where({_p(a[0])} * {_lit(p[0], 'f')} > {_lit(p[1], 'f')}, {a[0]}, "
                             f"tl.log(1.0 + tl.exp({_p(a[0])} * {_lit(p[0], 'f')})) / {_lit(p[0], 'f')})",
    "pow_int": lambda a, p: " * ".join([_p(a[0])] * int(p[0])) if p[0] else f"{_p(a[0])} * 0 + 1",  # type: ignore[call-overload]
    "powf": lambda a, p: f"tl.exp2({_lit(p[0], 'f')} * tl.log2({a[0]}))",
    "fmod": lambda a, p: f"{_p(a[0])} % {_p(a[1])}",  # floats: LLVM's frem, C's fmod (exact)
    "idiv": lambda a, p: f"{_p(a[0])} // {_p(a[1])}",  # integers: C's, truncated
    "irem": lambda a, p: f"{_p(a[0])} % {_p(a[1])}",  # integers: C's, the dividend's sign
    "max2": lambda a, p: f"tl.maximum({a[0]}, {a[1]}, {_NAN})",
    "min2": lambda a, p: f"tl.minimum({a[0]}, {a[1]}, {_NAN})",
    "where": lambda a, p: f"tl.where({a[0]}, {a[1]}, {a[2]})",
    "eq": lambda a, p: f"{_p(a[0])} == {_p(a[1])}",
    "ne": lambda a, p: f"{_p(a[0])} != {_p(a[1])}",
    "lt": lambda a, p: f"{_p(a[0])} < {_p(a[1])}",
    "le": lambda a, p: f"{_p(a[0])} <= {_p(a[1])}",
    "gt": lambda a, p: f"{_p(a[0])} > {_p(a[1])}",
    "ge": lambda a, p: f"{_p(a[0])} >= {_p(a[1])}",
    "and": lambda a, p: f"{_p(a[0])} & {_p(a[1])}",
    "or": lambda a, p: f"{_p(a[0])} | {_p(a[1])}",
    "not": lambda a, p: f"{_p(a[0])} == 0",
    "isnan": lambda a, p: f"{_p(a[0])} != {_p(a[0])}",
    "to_b": lambda a, p: f"{_p(a[0])} != 0",
    "to_f": lambda a, p: f"{_p(a[0])}.to(tl.float32)",
    "to_i": lambda a, p: f"{_p(a[0])}.to(tl.{p[0]})",
    "round": lambda a, p: f"{_p(a[0])}.to(tl.{p[0]}).to(tl.float32)",
    # fp32 -> bf16 -> fp32 rounded to nearest even in integer arithmetic: the same bits on the GPU
    # and in Triton's interpreter (whose bf16 cast truncates); an arg reduction's ties depend on it
    "round_bf16": lambda a, p: f"tl.where({_p(a[0])} != {_p(a[0])}, {a[0]}, (({_p(a[0])}.to(tl.uint32, "
                               f"bitcast=True) + 32767 + (({_p(a[0])}.to(tl.uint32, bitcast=True) >> 16) & 1)) "
                               f">> 16 << 16).to(tl.float32, bitcast=True))",
}
# ops whose operands keep their own kernel types (the template converts, or compares as they are)
_OWN_TYPES = {"to_b", "to_f", "to_i", "round", "round_bf16", "not", "isnan", "where", "and", "or"}
_IDENT = {"sum": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}
_IDENT_INT = {"sum": "0", "max": str(-(2**63)), "min": str(2**63 - 1)}  # int64 accumulators
_COMBINE = {"sum": "{a} + {v}", "max": "tl.maximum({a}, {v}, " + _NAN + ")",
            "min": "tl.minimum({a}, {v}, " + _NAN + ")"}
# max and min reduce through combine functions that keep a NaN (tl.max/tl.min, like tl.maximum by
# default, may drop it on the GPU: PTX's max.f32 returns the other operand), as torch's amax does
_REDUCE = {"sum": "tl.sum", "max": "_max_nan_reduce", "min": "_min_nan_reduce"}
_HELPERS = {
    f"_{d}_nan_reduce": (f"@triton.jit\ndef _{d}_nan(a, b):\n    return tl.{fn}(a, b, {_NAN})\n\n\n"
                         f"@triton.jit\ndef _{d}_nan_reduce(x, axis: tl.constexpr):\n"
                         f"    return tl.reduce(x, axis, _{d}_nan)\n")
    for d, fn in (("max", "maximum"), ("min", "minimum"))
}
_SCAN = {"sum": ("tl.cumsum", "+", "0.0"), "prod": ("tl.cumprod", "*", "1.0")}  # scan, combine, identity


def _ident(fn: str, ktype: str) -> str:
    """A reduction's identity for its accumulator's kernel type."""
    return _IDENT_INT[fn] if ktype == "i" else _IDENT[fn]


def _cstrides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


Runs = tuple[tuple[tuple[int, ...], ...], ...]  # per tensor (inputs, then outputs): its linear runs


def linear_runs(shape: Sequence[int], stride: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The maximal runs of consecutive dims of size > 1 over which a tensor's memory is one linear
    range (stride[a] == stride[b] * shape[b] for neighbours a < b), each of two dims or more."""
    dims = [d for d, n in enumerate(shape) if n != 1]
    out: list[tuple[int, ...]] = []
    run: list[int] = []
    for d in dims:
        if run and stride[run[-1]] == stride[d] * shape[d]:
            run.append(d)
            continue
        if len(run) > 1:
            out.append(tuple(run))
        run = [d]
    if len(run) > 1:
        out.append(tuple(run))
    return tuple(out)


def recorded_runs(region: Lowered) -> Runs:
    """The linear runs of the region's inputs and outputs at the strides its IR recorded (outputs:
    as the launcher allocates them, dense as recorded or contiguous)."""
    ir = region.ir
    outs = []
    for r in ir.outputs:
        m = ir.out_meta(r)
        outs.append(linear_runs(m.shape, m.stride if layout.dense(m.shape, m.stride) else _cstrides(m.shape)))
    return tuple(linear_runs(m.shape, m.stride) for m in ir.inputs) + tuple(outs)


class _Gen:
    def __init__(self, region: Lowered, sched: Schedule, index64: bool, runs: Runs | None = None) -> None:
        self.r, self.s, self.g = region, sched, region.graph
        self.runs = runs if runs is not None else recorded_runs(region)
        # (index tuple, sizes) of a run of dims that `delin` cut from one linear index -> that index
        self.linear: dict[tuple[tuple[str, ...], tuple[int, ...]], str] = {}
        self.lines: list[str] = []
        self.depth = 1
        self.scopes: list[dict[tuple[int, tuple[str, ...]], tuple[str, str]]] = [{}]
        self.iscopes: list[dict[str, str]] = [{}]
        self.n = 0
        self.acc: dict[int, str] = {}  # reduce node -> its [ROWS, 1] result
        self.index64 = index64
        self.rmask: str | None = None
        self.kmask: str | None = None
        self.pmask: list[str] = []  # the in-range conditions of the pad views being evaluated (masks loads)
        self.red: _Reduction | None = None  # the reduction loop being emitted (a scan reads its tile)
        self.carry: dict[int, str] = {}  # scan node -> its running total over the chunks walked so far
        # the pass over memory a chunked reduction's loads are in (`_Reduction.walk`; None: not in
        # one): their eviction policy is settled once the kernel is written (`_evictions`)
        self.pass_id: int | None = None
        self.passes = 0

    # --- text

    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def push(self) -> None:
        self.scopes.append({})
        self.iscopes.append({})

    def pop(self) -> None:
        self.scopes.pop()
        self.iscopes.pop()

    # --- index expressions: strings over rr (rows), kk (reduced or flat index) and named temporaries

    def ivar(self, expr: str) -> str:
        if re.fullmatch(r"\w+", expr):
            return expr
        for sc in self.iscopes:
            if expr in sc:
                return sc[expr]
        name = self.fresh("ik" if self.cols_dep(expr) else "ir")
        self.line(f"{name} = {expr}")
        self.iscopes[-1][expr] = name
        return name

    @staticmethod
    def cols_dep(expr: str) -> bool:
        return re.search(r"\b(kk|ik\d+)\b", expr) is not None

    def delin(self, lin: str, shape: Sequence[int]) -> tuple[str, ...]:
        out = []
        cs = _cstrides(shape)
        for d, (n, c) in enumerate(zip(shape, cs, strict=True)):
            if n == 1:
                out.append("0")
                continue
            e = lin if c == 1 else f"{_p(lin)} // {c}"
            if d > 0:
                e = f"{_p(e)} % {n}"
            out.append(self.ivar(e))
        self._remember_runs(lin, out, shape)
        return tuple(out)

    def _remember_runs(self, lin: str, idx: Sequence[str], shape: Sequence[int]) -> None:
        """Each run of two or more dims of a `delin` (size-1 dims left out) -> its linear index."""
        dims = [d for d, n in enumerate(shape) if n != 1]
        for a in range(len(dims)):
            for b in range(a + 1, len(dims)):
                run = dims[a:b + 1]
                inner = math.prod(shape[d] for d in dims[b + 1:])
                e = lin if inner == 1 else f"{_p(lin)} // {inner}"
                if a > 0:
                    e = f"{_p(e)} % {math.prod(shape[d] for d in run)}"
                self.linear.setdefault((tuple(idx[d] for d in run), tuple(shape[d] for d in run)), e)

    def address(self, idx: Sequence[str], shape: Sequence[int], runs: tuple[tuple[int, ...], ...],
                stride: Callable[[int], str]) -> list[str]:
        """The terms of the offset of `idx` in a tensor of `shape` (stride name of dim d: stride(d)):
        along each of its linear runs, the longest pieces whose index came from one linear index
        (`delin`) as that index times the piece's last stride, every other dim as index x stride."""
        in_run = {d: run for run in runs for d in run}
        terms: list[str] = []
        d, n = 0, len(shape)
        while d < n:
            if shape[d] == 1 or idx[d] == "0":
                d += 1
                continue
            run = in_run.get(d, ())
            rest = [x for x in run if x >= d]
            for end in range(len(rest), 1, -1):
                piece = rest[:end]
                lin = self.linear.get((tuple(idx[x] for x in piece), tuple(shape[x] for x in piece)))
                if lin is not None:
                    terms.append(f"{_p(lin)} * {stride(piece[-1])}")
                    d = piece[-1] + 1
                    break
            else:
                terms.append(f"{_p(idx[d])} * {stride(d)}")
                d += 1
        return terms

    def lin(self, idx: Sequence[str], shape: Sequence[int]) -> str:
        """The linear index of `idx` in `shape`: the one `delin` cut it from where it did."""
        live = [d for d, n in enumerate(shape) if n != 1]
        if len(live) > 1:
            known = self.linear.get((tuple(idx[d] for d in live), tuple(shape[d] for d in live)))
            if known is not None:
                return known
        terms = [i if c == 1 else f"{_p(i)} * {c}" for i, c, n in zip(idx, _cstrides(shape), shape, strict=True)
                 if n != 1 and i != "0"]
        return " + ".join(terms) if terms else "0"

    def reshape_idx(self, idx: Sequence[str], frm: Sequence[int], to: Sequence[int]) -> tuple[str, ...]:
        """The index in `to` of the element at `idx` in `frm` (same numel, same linear order). Group by
        group (`_groups`: runs of dims whose sizes multiply to the same number on both sides), so
        a dim that passes through keeps its own index: viewing (B, H, W, C) as (B*H*W, C) reads C
        as the loop's C, not as the remainder of a linear index, which Triton's axis analysis
        could not see as contiguous (ConvNeXt's permuted residual read strided)."""
        a = [(i, n) for i, n in zip(idx, frm, strict=True) if n != 1]
        if [n for _, n in a] == [n for n in to if n != 1]:  # only size-1 dims differ
            it = iter(i for i, _ in a)
            return tuple("0" if n == 1 else next(it) for n in to)
        groups = _groups(frm, to)
        if groups is None:
            return self.delin(self.ivar(self.lin(idx, frm)), to)
        out = ["0"] * len(to)
        for fd, td in groups:
            sub = [idx[d] for d in fd]
            if not td:
                continue
            lin = self.lin(sub, [frm[d] for d in fd])
            parts = (lin,) if len(td) == 1 else self.delin(self.ivar(lin) if lin != "0" else "0", [to[d] for d in td])
            for d, e in zip(td, parts, strict=True):
                out[d] = e
        return tuple(out)

    # --- values

    def value(self, i: int, idx: tuple[str, ...]) -> tuple[str, str]:
        """(expression, kernel type) of node i at idx."""
        node = self.g.nodes[i]
        if node.kind == "reduce":
            return self.acc[i], node.ktype
        if node.kind == "scan":
            return self.scan(i, node), "f"
        if node.kind == "const":
            return _lit(node.params[0], node.ktype), node.ktype
        if node.kind == "index":  # the loop point's index along one dim of the value (triu's masks)
            j = idx[node.params[0]]
            return (f"tl.full([], {j}, tl.int32)" if re.fullmatch(r"-?\d+", j) else j), "i"
        if node.kind == "view" and node.fn == "pad":
            return self.pad(i, node, idx)
        if node.kind == "view":
            return self.value(node.inputs[0], self.view_idx(node, idx))
        # a value read under a pad's mask is its own (its masked-off lanes are not the value)
        key = (i, idx if not self.pmask else (*idx, "&", *self.pmask))
        for sc in self.scopes:
            if key in sc:
                return sc[key]
        if node.kind == "load":
            expr = self.load(node, idx)
        elif node.kind == "gather":
            expr = self.gather(node, idx)
        else:
            expr = self.pointwise(node, idx)
        name = self.fresh("v")
        self.line(f"{name} = {expr}")
        self.scopes[-1][key] = (name, node.ktype)
        return name, node.ktype

    def scan(self, i: int, node: KNode) -> str:
        """A scan at this tile's loop points (lower.analyze: a scan is only read there, so one
        value per tile whatever index it is asked at): its input over the tile, identities in the
        masked lanes, scanned along the reduced axis; looped: combined with the carry of the
        earlier chunks, the carry then the scan at the chunk's last lane in the walk's order."""
        key = (i, ("scan",))
        for sc in self.scopes:
            if key in sc:
                return sc[key][0]
        red = self.red
        assert red is not None and red.loop is not None, "a scan outside a row loop"
        dim, rev = node.params
        fn, comb, ident = _SCAN[node.fn]
        v, _ = self.value(node.inputs[0], red.loop)
        full = f"tl.broadcast_to({v}, {red.shape})"
        t = self.fresh("t")
        self.line(f"{t} = " + (f"tl.where(m, {full}, {ident})" if self.rmask or self.kmask else full))
        name = self.fresh("scan")
        self.line(f"{name} = {fn}({t}, axis={red.kax}{', reverse=True' if rev else ''})")
        if red.looped:
            c = self.carry[i]
            self.line(f"{name} = {name} {comb} {c}")
            last = 0 if rev else red.PK - 1
            # the chunk's last element in the walk's order (a sum of it and zeros: that element exactly)
            self.line(f"{c} = tl.sum(tl.where(tl.arange(0, {red.PK}){red.ksl} == {last}, {name}, 0.0), "
                      f"axis={red.kax}){red.rsl}")
        self.scopes[-1][key] = (name, "f")
        return name

    def pad(self, i: int, node: KNode, idx: tuple[str, ...]) -> tuple[str, str]:
        """A pad view: its input at idx[dim] - before where that is in range, else the fill; the
        input's loads are masked by the range (no memory is read for the padding)."""
        dim, before, fill = node.params
        src = node.inputs[0]
        n = self.g.nodes[src].shape[dim]
        j = idx[dim]
        if re.fullmatch(r"-?\d+", j):  # a literal index: in range or not is known here
            k = int(j) - before
            if 0 <= k < n:
                return self.value(src, (*idx[:dim], str(k), *idx[dim + 1:]))
            return _lit(fill, node.ktype), node.ktype
        key = (i, idx if not self.pmask else (*idx, "&", *self.pmask))
        for sc in self.scopes:
            if key in sc:
                return sc[key]
        sh = self.ivar(f"{j} - {before}") if before else j
        cond = self.ivar(f"({sh} >= 0) & ({sh} < {n})" if before else f"{sh} < {n}")
        sn, name = self.g.nodes[src], self.fresh("v")
        self.pmask.append(cond)
        if sn.kind == "load" and sn.ktype == node.ktype == "f":
            # the input itself: the load's masked-off lanes read the fill (a pool's -inf or 0)
            self.line(f"{name} = {self.load(sn, (*idx[:dim], sh, *idx[dim + 1:]), _lit(fill, 'f'))}")
            self.pmask.pop()
            self.scopes[-1][key] = (name, "f")
            return name, "f"
        v, kt = self.value(src, (*idx[:dim], sh, *idx[dim + 1:]))
        self.pmask.pop()
        self.line(f"{name} = tl.where({cond}, {v}, {_lit(fill, kt)})")
        self.scopes[-1][key] = (name, kt)
        return name, kt

    def view_idx(self, node: KNode, idx: tuple[str, ...]) -> tuple[str, ...]:
        src = self.g.nodes[node.inputs[0]].shape
        if node.fn == "reshape":
            return self.reshape_idx(idx, node.shape, src)
        if node.fn == "permute":
            out = ["0"] * len(src)
            for j, p in enumerate(node.params[0]):
                out[p] = idx[j]
            return tuple(out)
        if node.fn == "expand":
            return self.bcast(idx, node.shape, src)
        if node.fn == "slice":
            dim, start, step = node.params
            out = list(idx)
            e = idx[dim] if step == 1 else f"{_p(idx[dim])} * {step}"
            out[dim] = self.ivar(e if start == 0 else f"{e} + {start}")
            return tuple(out)
        if node.fn == "select":
            dim, at = node.params
            return (*idx[:dim], str(at), *idx[dim:])
        raise AssertionError(node.fn)

    @staticmethod
    def bcast(idx: Sequence[str], shape: Sequence[int], src: Sequence[int]) -> tuple[str, ...]:
        off = len(shape) - len(src)
        return tuple("0" if n == 1 else idx[k + off] for k, n in enumerate(src))

    def load(self, node: KNode, idx: tuple[str, ...], other: str = "0") -> str:
        """Input node's value at idx; `other`: what a masked-off lane reads (a pad's fill, where the
        pad reads its input directly: no select after the load)."""
        i = node.params[0]
        terms = self.address(idx, node.shape, self.runs[i], lambda d: f"s_in{i}_{d}")
        if not terms:
            e = f"tl.load(in{i})"
        else:
            off = " + ".join(terms)
            mask = self.mask_for(off)
            if self.pmask:
                mask = " & ".join([*self.pmask, *([mask] if mask else [])])
            e = f"tl.load(in{i} + {off}" + (f", mask={mask}, other={other}" if mask else "") + self.eviction(i) + ")"
        return f"{e}.to(tl.float32)" if node.ktype == "f" else e

    def eviction(self, i: int) -> str:
        """Input i's load's L2 eviction policy, as Inductor's kernels set it: an input smaller than
        the loop (a weight broadcast over the rows) is kept (`evict_last`); in a chunked reduction
        a load is kept where a later pass reads the input again, and marked to go first in its
        last pass (`_evictions` settles which, once every pass is written)."""
        if self.r.ir.inputs[i].numel < self.r.space.numel:
            return ", eviction_policy='evict_last'"
        return "" if self.pass_id is None else f", eviction_policy='<EP {i} {self.pass_id}>'"

    def gather(self, node: KNode, idx: tuple[str, ...]) -> str:
        """The source at the index the gather reads (lower.gather): a gathered dim's index is its
        index operand's value, a negative one wrapped (+ n) where the op wraps (advanced indexing),
        then clamped into [0, n) so no lane, masked or out of range, reads outside the source; an
        index out of range (torch raises) gives NaN for a floating source. The clamped index is
        named like the loop's index expressions (ik: varies along the reduced or flat index), so
        the source's load is masked as any other."""
        src = self.g.nodes[node.inputs[0]]
        spec, wrap = node.params
        at: list[str] = []
        bad: list[str] = []
        for d, k in enumerate(spec):
            if k >= 0:
                at.append(idx[k])
                continue
            j = node.inputs[-k]
            n = src.shape[d]
            at_j = self.bcast(idx, node.shape, self.g.nodes[j].shape)
            cols = any(self.cols_dep(x) for x in at_j)  # the index's value varies as its own index does
            v, _ = self.value(j, at_j)
            if re.fullmatch(r"-?\d+", v):  # a constant index (torch checked it when tracing)
                at.append(str(min(max(int(v) + n if int(v) < 0 and wrap else int(v), 0), n - 1)))
                continue
            if self.index64:
                v = f"{_p(v)}.to(tl.int64)"
            w, c = self.fresh("gw"), self.fresh("ik" if cols else "ir")
            self.line(f"{w} = tl.where({_p(v)} < 0, {_p(v)} + {n}, {v})" if wrap else f"{w} = {v}")
            self.line(f"{c} = tl.minimum(tl.maximum({w}, 0), {n - 1})")
            bad.append(f"({w} < 0) | ({w} >= {n})")
            at.append(c)
        e, kt = self.value(node.inputs[0], tuple(at))
        if kt == "f" and bad:
            return f"tl.where({' | '.join(bad)}, {_lit(float('nan'), 'f')}, {e})"
        return e

    def mask_for(self, expr: str) -> str | None:
        if self.cols_dep(expr):
            return "m" if (self.rmask or self.kmask) else None
        return self.rmask

    def pointwise(self, node: KNode, idx: tuple[str, ...]) -> str:
        ops = []
        for j in node.inputs:
            src = self.g.nodes[j]
            v, kt = self.value(j, self.bcast(idx, node.shape, src.shape))
            if node.fn not in _OWN_TYPES or (node.fn == "where" and j != node.inputs[0]):
                want = node.ktype if node.fn not in ("eq", "ne", "lt", "le", "gt", "ge") else \
                    ("f" if any(self.g.nodes[x].ktype == "f" for x in node.inputs) else kt)
                if want != kt:
                    v = _lit(src.params[0], want) if src.kind == "const" else \
                        f"{_p(v)}.to(tl.float32)" if want == "f" else f"{_p(v)}.to(tl.int64)" if want == "i" else \
                        f"{_p(v)} != 0"
            ops.append(v)
        if all(self.g.nodes[j].kind == "const" for j in node.inputs) and ops:
            dt = {"f": "tl.float32", "i": "tl.int64", "b": "tl.int1"}[self.g.nodes[node.inputs[0]].ktype]
            ops[0] = f"tl.full([], {ops[0]}, {dt})"
        return PW[node.fn](ops, node.params)

    # --- stores

    def store(self, k: int, o: int, idx: tuple[str, ...], base: str) -> None:
        node = self.g.nodes[o]
        v, _ = self.value(o, idx)
        terms = self.address(idx, node.shape, self.runs[len(self.r.ir.inputs) + k], lambda d: f"s_out{k}_{d}")
        off = " + ".join(terms) if terms else f"0 * {_p(base)}"
        mask = self.mask_for(off) if terms else (self.rmask if base == "rr" else "m" if (self.rmask or self.kmask)
                                                  else None)
        m = f", mask={mask}" if mask else ""
        self.line(f"tl.store(out{k} + {off}, {_p(v)}.to(out{k}.dtype.element_ty){m})")


def _groups(frm: Sequence[int], to: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Two shapes of one numel cut into runs of dims with equal products, in order ((B, H, W, C) and
    (B*H*W, C): ([0, 1, 2], [0]), ([3], [1])); None where a size is 0 or the runs do not meet."""
    if 0 in frm or 0 in to:
        return None
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(frm) or j < len(to):
        fd: list[int] = []
        td: list[int] = []
        pf = pt = 1
        if i < len(frm):
            fd.append(i)
            pf *= frm[i]
            i += 1
        if j < len(to):
            td.append(j)
            pt *= to[j]
            j += 1
        while pf != pt:
            if pf < pt:
                if i >= len(frm):
                    return None
                fd.append(i)
                pf *= frm[i]
                i += 1
            else:
                if j >= len(to):
                    return None
                td.append(j)
                pt *= to[j]
                j += 1
        out.append((fd, td))
    return out


def _arg_names(region: Lowered, sched: Schedule | None = None) -> list[str]:
    ir = region.ir
    names = [f"in{i}" for i in range(len(ir.inputs))] + [f"out{k}" for k in range(len(ir.outputs))]
    for i, m in enumerate(ir.inputs):
        names += [f"s_in{i}_{d}" for d, n in enumerate(m.shape) if n != 1]
    for k, r in enumerate(ir.outputs):
        names += [f"s_out{k}_{d}" for d, n in enumerate(ir.out_meta(r).shape) if n != 1]
    if sched is not None and sched.splits > 1:
        names += ["ws", "PHASE: tl.constexpr"]  # fp32 partials; which stage (or the stores) this launch runs
    return names


def needs_index64(region: Lowered) -> bool:
    """Index math in int64: when the loop or any input's extent (at its recorded strides, with room
    for other strides at run time) passes int32. The launcher refuses inputs past what was chosen."""
    ir = region.ir
    ext = [sum((n - 1) * abs(s) for n, s in zip(m.shape, m.stride, strict=True)) for m in ir.inputs]
    return max([region.space.numel * 2, *(e * 2 for e in ext)]) > I32_MAX


def reductions(region: Lowered) -> list[int]:
    """The reduce nodes, in graph order: a split schedule's workspace holds their partials in this order."""
    return [i for i, n in enumerate(region.graph.nodes) if n.kind == "reduce"]


def passes(region: Lowered, sched: Schedule) -> list[int]:
    """The reduction stages a schedule makes a pass for (split: a launch each, then one that
    stores): every stage, less one whose reductions are all online pairs' sums (run in their max's)."""
    stages = region.analysis.stages
    fused = {p.sm for p in online.pairs(region)} | {v.s2 for v in online.var_pairs(region)} if sched.online \
        else set()
    return sorted({stages[i] for i in reductions(region) if i not in fused})


def generate(region: Lowered, sched: Schedule, runs: Runs | None = None,
             aligns: Sequence[int] | None = None) -> str:
    """The module source: imports, then one kernel `generated_kernel(*_arg_names)`, for tensors of
    linear runs `runs` (inputs, then outputs; default: `recorded_runs`) and, with `aligns` (one per
    stride argument, runtime.stride_aligns), stride arguments divisible by those powers of two:
    each one of 2, 4 or 8 is rounded down to its multiple at the kernel's top (`s // 4 * 4`, the
    same value), which Triton's alignment analysis reads, so loads and stores along a dim whose
    neighbour's stride is such a multiple vectorize (`tl.multiple_of` on a scalar argument did not
    change the code; 16 Triton's own specialization marks)."""
    g = _Gen(region, sched, needs_index64(region), runs)
    sp = region.space
    pid = "tl.program_id(0).to(tl.int64)" if g.index64 else "tl.program_id(0)"
    g.line(f"pid = {pid}")
    outs = list(zip(range(len(region.graph.outputs)), region.graph.outputs, strict=True))
    kinds = region.analysis.kinds
    if not region.reduces and sched.variant == "tiles":
        _pointwise_tiles(g, region, sched, outs)
    elif not region.reduces:
        g.line(f"kk = pid * {sched.block} + tl.arange(0, {sched.block})")
        if sp.numel % sched.block:
            g.kmask = "m"
            g.line(f"m = kk < {sp.numel}")
        # the flat index walks the schedule's `contig` dim fastest (the outputs' contiguous dim)
        order = [d for d in range(len(sp.shape)) if d != sched.contig] + \
            ([sched.contig] if sched.contig < len(sp.shape) else [])
        walked = g.delin("kk", [sp.shape[d] for d in order])
        at = dict(zip(order, walked, strict=True))
        idx = tuple(at[d] for d in range(len(sp.shape)))
        for k, o in outs:
            g.store(k, o, g.reshape_idx(idx, sp.shape, g.g.nodes[o].shape), "kk")
    else:
        _Reduction(g, region, sched, outs, kinds).emit()
    head = f"def {KERNEL}({', '.join(_arg_names(region, sched))}):"
    doc = f'    """Generated by solforge.codegen for region {region.ir.key[:16]}, schedule {sched.encode()}."""'
    imports = ["import triton", "import triton.language as tl"]
    if any("libdevice." in line for line in g.lines):
        imports.append("from triton.language.extra import libdevice")
    for name, text in _HELPERS.items():  # the combine functions a NaN-keeping max or min reduces with
        if any(name + "(" in line for line in g.lines):
            imports += ["", "", text.rstrip("\n")]
    hints = []
    if aligns is not None:
        strides = [n for n in _arg_names(region, sched) if n.startswith("s_")]
        if len(strides) != len(aligns):
            raise ValueError(f"{len(aligns)} stride alignments for a kernel of {len(strides)} stride arguments")
        hints = [f"    {n} = {n} // {a} * {a}" for n, a in zip(strides, aligns, strict=True) if a in (2, 4, 8)]
    return "\n".join([*imports, "", "", "@triton.jit", head, doc, *hints, *_evictions(g.lines), ""])


_EP = re.compile(r"<EP (\d+) (\d+)>")


def _evictions(lines: list[str]) -> list[str]:
    """The chunked passes' loads (`_Gen.eviction`): in each input's last pass `evict_first`, in
    the passes before it `evict_last` (the next pass reads it again)."""
    last: dict[str, int] = {}
    for line in lines:
        for i, p in _EP.findall(line):
            last[i] = max(last.get(i, 0), int(p))
    return [_EP.sub(lambda m: "evict_first" if int(m.group(2)) == last[m.group(1)] else "evict_last", line)
            for line in lines]


def _pointwise_tiles(g: _Gen, region: Lowered, sched: Schedule, outs: list[tuple[int, int]]) -> None:
    """A 2-D tile of a transposing pointwise region: `block` points along the fast dim (the big
    input's contiguous one) x `rblock` along the slow dim (the outputs' contiguous one); each
    program one tile of those two dims at one point of the others. The load is coalesced along
    one axis, the store along the other (Triton moves the tile between layouts on chip)."""
    S = region.space.shape
    fast, slow = tile_axes(sched, region)
    A, B = sched.block, sched.rblock
    ext = math.prod(S[d] for d in slow)  # the slow dims walked as one flat dim
    na, nb = -(-S[fast] // A), -(-ext // B)
    rest = [d for d in range(len(S)) if d != fast and d not in slow]
    pa = "pid" if nb == 1 and not rest else f"(pid % {na})"
    pb = f"(pid // {na})" if not rest else f"(pid // {na} % {nb})"
    g.line(f"ia = {pa} * {A} + tl.arange(0, {A})[None, :]" if na > 1 else f"ia = tl.arange(0, {A})[None, :]")
    g.line(f"ib = {pb} * {B} + tl.arange(0, {B})[:, None]" if nb > 1 else f"ib = tl.arange(0, {B})[:, None]")
    masks = [m for m in (f"(ia < {S[fast]})" if S[fast] % A else "", f"(ib < {ext})" if ext % B else "") if m]
    if masks:
        g.rmask = "m"
        g.line(f"m = {' & '.join(masks)}")
    loop = ["0"] * len(S)
    loop[fast] = "ia"
    # several slow dims: their indices cut from ib (delin remembers ib as their linear index, so an
    # output laid out along them is addressed by ib itself: stores Triton sees as contiguous)
    for d, e in zip(slow, ("ib",) if len(slow) == 1 else g.delin("ib", [S[d] for d in slow]), strict=True):
        loop[d] = e
    if any(S[d] != 1 for d in rest):
        g.line(f"pr = pid // {na * nb}" if na * nb > 1 else "pr = pid")
        for d, e in zip(rest, g.delin("pr", [S[d] for d in rest]), strict=True):
            loop[d] = e
    for k, o in outs:
        g.store(k, o, g.reshape_idx(tuple(loop), S, g.g.nodes[o].shape), "ia + ib")


class _Reduction:
    """The body of a reduction kernel. A tile is [rows, cols] (rows, looped, split) or [cols, rows]
    (tiles: the kept dim on the fastest axis, so its loads coalesce); `rr` is the row index and
    `kk` the reduced index, each broadcast along the other axis."""

    def __init__(self, g: _Gen, region: Lowered, sched: Schedule, outs: list[tuple[int, int]],
                 kinds: Sequence[str]) -> None:
        self.g, self.region, self.sched, self.kinds = g, region, sched, kinds
        sp = self.sp = region.space
        self.R, self.K = sp.rows, sp.cols
        self.tiles = sched.variant == "tiles"
        self.split = sched.splits > 1  # split, or split tiles
        self.PR, self.PK = (sched.block, sched.rblock) if self.tiles else (sched.rows, sched.block)
        self.shape = f"[{self.PK}, {self.PR}]" if self.tiles else f"[{self.PR}, {self.PK}]"
        self.rsl, self.ksl = ("[None, :]", "[:, None]") if self.tiles else ("[:, None]", "[None, :]")
        self.kax = 0 if self.tiles else 1
        self.looped = sched.variant in ("looped", "split") or \
            (self.tiles and (self.split or self.PK < _next_pow2(self.K)))
        # no tail to mask: the chunks tile the row exactly (a split's last program may reach past
        # its end even where the chunk width divides it: 5120 in 3 splits of 2048)
        self.even = self.K % self.PK == 0 and (not self.split or sched.splits * split_chunk(sched, region) == self.K)
        # the row index's decomposition: kept dims in order, a tile's `contig` dim moved innermost
        rd = sp.row_dims
        self.order = [d for d in rd if d != sched.contig] + [sched.contig] if self.tiles else list(rd)
        self.reduces = reductions(region)
        self.loop: tuple[str, ...] | None = None  # the loop point of the open tile (a scan's input is read there)
        self.reverse = region.scan_reverse  # chunks walked from the end of the row
        self.uniform: set[str] = set()  # Welford counts known without counting (`_counts`)
        self.counted: dict[str, str] = {}  # ... the lanes' counts computed after the loop
        self.kvar = "k0"  # the open chunk's first column (`walk`'s tail: kt)
        self.itype = "tl.int64" if g.index64 else "tl.int32"  # an arg reduction's running index
        g.red = self
        self.loop_outs = [(k, o) for k, o in outs if not (kinds[o] == "row" or (
            kinds[o] == "pre" and _numel(g, o) == self.R and self.R != sp.numel))]
        self.row_outs = [(k, o) for k, o in outs if (k, o) not in self.loop_outs]
        # online (schedule.online): max node -> its pair; the pair's sum is computed in the max's pass
        self.pairs = {p.mx: p for p in online.pairs(region)} if sched.online and self.looped else {}
        # online: sum node -> its (sum, sum of squared deviations) pair, the second in the first's pass
        self.vpairs = {v.s1: v for v in online.var_pairs(region)} if sched.online and self.looped else {}
        # a pair's second reduction -> its first (in whose pass it is computed)
        self.fused = {p.sm: p.mx for p in self.pairs.values()} | {v.s2: v.s1 for v in self.vpairs.values()}

    def emit(self) -> None:
        g, s = self.g, self.sched
        if self.split:
            g.line(f"sp = pid % {s.splits}")
            g.line(f"pr = pid // {s.splits}")
            g.line(f"k_lo = sp * {split_chunk(s, self.region)}")
        g.line(f"rr = {'pr' if self.split else 'pid'} * {self.PR} + tl.arange(0, {self.PR}){self.rsl}")
        if self.R % self.PR:
            g.rmask = "rmask"
            g.line(f"rmask = rr < {self.R}")
        ridx = g.delin("rr", [self.sp.shape[d] for d in self.order])
        self.ridx = dict(zip(self.order, ridx, strict=True))
        if not self.split:
            self.body(range(1, self.sp.stages + 1), store=True)
            return
        # one launch per pass's stage (PHASE = its place), then one that stores (PHASE = passes + 1)
        stages = passes(self.region, s)
        for phase in range(1, len(stages) + 2):
            g.line(f"if PHASE == {phase}:")
            g.depth += 1
            # the stores of row values only: the row's first program combines the partials and
            # stores them, the others load nothing (all of them would read every partial)
            first = phase > len(stages) and not self.loop_outs
            if first:
                g.line("if sp == 0:")
                g.depth += 1
            g.push()
            acc = dict(g.acc)
            self.combine(stages[phase - 1] if phase <= len(stages) else self.sp.stages + 1)
            if phase <= len(stages):
                self.body([stages[phase - 1]], store=False)
            else:
                self.body([], store=True)
            g.acc = acc
            g.pop()
            g.depth -= 2 if first else 1

    def open_cols(self, start: str, tail: bool | None = None) -> tuple[str, ...]:
        """The columns of one chunk from `start`; `tail`: whether they may pass the row's end
        (default: unless the chunks tile it exactly), masked then."""
        g, sp = self.g, self.sp
        g.line(f"kk = {start}tl.arange(0, {self.PK}){self.ksl}")
        tail = not self.even if tail is None else tail
        g.kmask = "kmask" if tail else None
        if tail:
            g.line(f"kmask = kk < {self.K}")
        if g.rmask or g.kmask:
            g.line(f"m = {' & '.join(x for x in (g.rmask, g.kmask) if x)}")
        kidx = g.delin("kk", [sp.shape[d] for d in sp.reduced])
        loop = ["0"] * len(sp.shape)
        for d, e in self.ridx.items():
            loop[d] = e
        for d, e in zip(sp.reduced, kidx, strict=True):
            loop[d] = e
        self.loop = tuple(loop)
        return self.loop

    def open_loop(self, end: int | None = None) -> tuple[str, ...]:
        """The loop over this program's chunks (`end`: up to there, no column masked), opened."""
        g = self.g
        for i, node in enumerate(g.g.nodes):  # each pass walks its rows anew: scans start from the identity
            if node.kind == "scan":
                g.carry[i] = g.fresh("carry")
                g.line(f"{g.carry[i]} = tl.full([{self.PR}, 1], {_SCAN[node.fn][2]}, tl.float32)")
        if self.split:
            g.line(f"for k0 in tl.range(k_lo, k_lo + {split_chunk(self.sched, self.region)}, {self.PK}):")
        else:
            g.line(f"for k0 in tl.range(0, {self.K if end is None else end}, {self.PK}):")
        g.depth += 1
        g.push()
        if self.reverse:  # the chunks from the last one (its tail masked) to the first
            return self.open_cols(f"{(self.K - 1) // self.PK * self.PK} - k0 + ")
        return self.open_cols("k0 + ", tail=None if end is None else False)

    def close_loop(self) -> None:
        self.g.pop()
        self.g.depth -= 1

    def peeled(self) -> bool:
        """Whether `walk` runs the full chunks with no column mask and the row's tail after them:
        a chunked row that the chunks do not tile, walked from its first chunk in one program (a
        split's programs end anywhere; a scan's carry is set up once per loop), no row masked
        (else a later loop's `m = rmask` would carry the tail's `m`, of another shape, through it:
        Triton refuses a loop-carried value whose type changes)."""
        return self.looped and not (self.even or self.split or self.reverse or self.region.scans) \
            and self.K > self.PK and self.R % self.PR == 0

    def walk(self, chunk: Callable[[tuple[str, ...]], None]) -> None:
        """`chunk(loop)`'s statements for every chunk of this program's columns: one loop; peeled
        (`peeled`), a loop over the full chunks, whose loads, selects and counts need no column
        mask (a GroupNorm of 258064 values a group in chunks of 2048 masked every one of its 126
        chunks for the last 16 values), then the tail once, masked."""
        g = self.g
        g.passes += 1
        g.pass_id = g.passes  # one pass over memory, the peeled tail with it
        if not self.peeled():
            loop = self.open_loop()
            chunk(loop)
            self.close_loop()
            g.pass_id = None
            return
        full = self.K // self.PK * self.PK
        chunk(self.open_loop(end=full))
        self.close_loop()
        g.line(f"kt = {full}")  # the tail's first column
        g.push()
        self.kvar = "kt"
        chunk(self.open_cols("kt + ", tail=True))
        self.kvar = "k0"
        g.pop()
        g.pass_id = None

    def body(self, stage_list: Sequence[int], store: bool) -> None:
        """The passes of `stage_list` (each reduction of a stage accumulated over this program's
        columns; split: its partial written to the workspace), then, with `store`, the stores."""
        g, sp = self.g, self.sp
        stages = self.region.analysis.stages
        if not self.looped:
            loop = self.open_cols("")
        for st in stage_list:
            mine = [i for i in self.reduces if stages[i] == st and i not in self.fused]
            if not mine:  # every reduction of the stage ran in an earlier pass (online pairs)
                continue
            ons = {i: (g.fresh("om"), g.fresh("os")) for i in mine if i in self.pairs}
            mine = [i for i in mine if i not in ons]
            pairs: dict[tuple[int, str], list[int]] = {}  # (operand, max|min) -> its arg reduce nodes
            for i in mine:
                node = g.g.nodes[i]
                if node.fn in ARG_FNS:
                    pairs.setdefault((node.inputs[0], ARG_FNS[node.fn]), []).append(i)
            mine = [i for i in mine if g.g.nodes[i].fn not in ARG_FNS]
            paccs = {key: (g.fresh("av"), g.fresh("ai")) for key in pairs}
            if self.looped:
                accs = {i: g.fresh("a") for i in mine}
                for i, a in accs.items():
                    n = g.g.nodes[i]
                    g.line(f"{a} = tl.full({self.shape}, {_ident(n.fn, n.ktype)}, "
                           f"{'tl.int64' if n.ktype == 'i' else 'tl.float32'})")
                for (_, d), (av, ai) in paccs.items():
                    g.line(f"{av} = tl.full({self.shape}, {_IDENT[d]}, tl.float32)")
                    g.line(f"{ai} = tl.full({self.shape}, {self.K}, {self.itype})")
                # online = 2: one running max per row (each chunk's max reduced across lanes)
                mshape = (f"[1, {self.PR}]" if self.tiles else f"[{self.PR}, 1]") if self.sched.online == 2 \
                    else self.shape
                for om, os_ in ons.values():
                    g.line(f'{om} = tl.full({mshape}, float("-inf"), tl.float32)')
                    g.line(f"{os_} = tl.full({self.shape}, 0.0, tl.float32)")
                for state in (wel := {i: tuple(g.fresh(x) for x in ("wn", "wm", "wq")) for i in mine
                                      if i in self.vpairs}).values():
                    for x in state:
                        g.line(f"{x} = tl.full({self.shape}, 0.0, tl.float32)")
            else:
                accs, wel = {}, {}

            def chunk(loop: tuple[str, ...], mine: list[int] = mine, accs: dict[int, str] = accs,
                      wel: dict[int, tuple[str, str, str]] = wel, paccs: dict[tuple[int, str], tuple[str, str]] = paccs,
                      ons: dict[int, tuple[str, str]] = ons) -> None:
                for i in mine:
                    node = g.g.nodes[i]
                    v, _ = g.value(node.inputs[0], loop)
                    full = f"tl.broadcast_to({v}, {self.shape})"
                    if g.rmask or g.kmask:
                        full = f"tl.where(m, {full}, {_ident(node.fn, node.ktype)})"
                    if self.looped:
                        a = accs[i]
                        # the pair's sum keeps its own accumulator: as the lanes' counts x running
                        # means it read up to twice the error of eager's sum (rows offset by 1000)
                        g.line(f"{a} = " + _COMBINE[node.fn].format(a=a, v=full))
                        if i in wel:
                            self.welford_step(wel[i], v)
                    else:
                        a = g.fresh("c")
                        g.line(f"{a} = {full}")
                    g.acc[i] = a
                for key, acc in paccs.items():
                    paccs[key] = self.arg_step(key, acc, loop)
                for i, acc in ons.items():
                    self.online_step(self.pairs[i], acc, loop)

            if self.looped:
                self.walk(chunk)
            else:
                chunk(loop)
            for i, acc in ons.items():
                self.online_final(self.pairs[i], acc, partial=self.split, row=self.sched.online == 2)
            for i in mine:
                res = g.fresh("red")
                g.line(f"{res} = {_REDUCE[g.g.nodes[i].fn]}({g.acc[i]}, axis={self.kax}){self.rsl}")
                g.acc[i] = res
                if self.split:
                    m = f", mask={g.rmask}" if g.rmask else ""
                    g.line(f"tl.store(ws + {self._ws(i, 'sp')}, {res}{m})")
                if self.looped and i in wel:
                    self.welford_final(self.vpairs[i], wel[i], res)
            for key, acc in paccs.items():
                val, idx = self.arg_final(key[1], acc)
                for i in pairs[key]:
                    g.acc[i] = idx if g.g.nodes[i].fn.startswith("arg") else val
        if not store:
            return
        if self.loop_outs:
            def stores(loop: tuple[str, ...]) -> None:
                for k, o in self.loop_outs:
                    g.store(k, o, g.reshape_idx(loop, sp.shape, g.g.nodes[o].shape), "rr + kk")

            if self.looped:
                self.walk(stores)
            else:
                stores(loop)
        if self.split and self.row_outs:  # one program of a row's splits stores its row values
            g.line(f"smask = (rr < {self.R}) & (sp == 0)")
            g.rmask = "smask"
        for k, o in self.row_outs:
            g.store(k, o, self.row_index(o), "rr")

    def arg_step(self, key: tuple[int, str], acc: tuple[str, str], loop: tuple[str, ...]) -> tuple[str, str]:
        """The (value, index) tiles of one arg reduction's operand over this tile (masked lanes: the
        identity at index K, which no real lane's index reaches); looped: combined per lane with the
        running pair, the new element taken where it is larger (argmin: smaller), a NaN over a
        number, or equal (both NaN too) at a smaller index, so the order chunks are walked in does
        not matter. Returns the names holding the pair."""
        g = self.g
        src, d = key
        v, _ = g.value(src, loop)
        full = f"tl.broadcast_to({v}, {self.shape})"
        kidx = "kk" if self.itype == "tl.int32" else "kk.to(tl.int64)"
        kfull = f"tl.broadcast_to({kidx}, {self.shape})"
        if g.rmask or g.kmask:
            full, kfull = f"tl.where(m, {full}, {_IDENT[d]})", f"tl.where(m, {kfull}, {self.K})"
        if not self.looped:
            cv, ci = g.fresh("cv"), g.fresh("ci")
            g.line(f"{cv} = {full}")
            g.line(f"{ci} = {kfull}")
            return cv, ci
        av, ai = acc
        nv, ni, take = g.fresh("nv"), g.fresh("ni"), g.fresh("take")
        g.line(f"{nv} = {full}")
        g.line(f"{ni} = {kfull}")
        better = f"{nv} > {av}" if d == "max" else f"{nv} < {av}"
        g.line(f"{take} = ({better}) | (({nv} != {nv}) & ({av} == {av})) | "
               f"((({nv} == {av}) | (({nv} != {nv}) & ({av} != {av}))) & ({ni} < {ai}))")
        g.line(f"{av} = tl.where({take}, {nv}, {av})")
        g.line(f"{ai} = tl.where({take}, {ni}, {ai})")
        return av, ai

    def _b_at(self, p: online.Pair, m: str, idx: tuple[str, ...]) -> str:
        """The pair's B with its max taken as `m` (a lane tile or a row), in a scope of its own."""
        g = self.g
        g.push()
        g.acc[p.mx] = m
        v, _ = g.value(p.b, idx)
        g.pop()
        return v

    def _exp(self, p: online.Pair, arg: str) -> str:
        fn = "tl.exp2" if p.fn == "exp2" else "tl.exp"
        return f"{fn}({arg})" if p.scale == 1.0 else f"{fn}(({arg}) * {_lit(p.scale, 'f')})"

    def _b_idx(self, p: online.Pair) -> tuple[str, ...]:
        """The index the pair's B (a value per row) is read at in this program's rows."""
        g, nodes = self.g, self.g.g.nodes
        idx = tuple(self.ridx.get(d, "0") for d in range(len(self.sp.shape)))  # the sum's operand: shape S
        for parent, child in zip(p.chain, (*p.chain[1:], p.b), strict=True):
            idx = g.bcast(idx, nodes[parent].shape, nodes[child].shape)
        return idx

    def online_step(self, p: online.Pair, acc: tuple[str, str], loop: tuple[str, ...]) -> None:
        """One chunk of an online pair (online.py): the lanes' running max `om` (online = 2: the
        row's, the chunk's max reduced across lanes) and their sum `os` of exp(c * (A - B(om))),
        rescaled where the max grew; a lane still at -inf sums relative to B(0) (its terms are 0,
        or NaN from a NaN, whatever the reference) and is not rescaled."""
        g, nodes = self.g, self.g.g.nodes
        om, os_ = acc
        b_idx = self._b_idx(p)
        masked = g.rmask or g.kmask
        x, _ = g.value(nodes[p.mx].inputs[0], loop)
        full = f"tl.broadcast_to({x}, {self.shape})"
        mn, so, sn = g.fresh("mn"), g.fresh("so"), g.fresh("sn")
        if masked:
            full = f'tl.where(m, {full}, float("-inf"))'
        if self.sched.online == 2:
            full = f"tl.max({full}, axis={self.kax}){self.rsl}"
        g.line(f"{mn} = tl.maximum({om}, {full})")
        g.line(f'{so} = tl.where({om} == float("-inf"), 0.0, {om})')
        g.line(f'{sn} = tl.where({mn} == float("-inf"), 0.0, {mn})')
        b_old = self._b_at(p, so, b_idx)
        g.push()  # B and the sum's operand at the new max: not the values of the row (dropped after)
        g.acc[p.mx] = sn
        b_new, _ = g.value(p.b, b_idx)
        e, _ = g.value(nodes[p.sm].inputs[0], loop)
        g.pop()
        efull = f"tl.broadcast_to({e}, {self.shape})"
        if masked:
            efull = f"tl.where(m, {efull}, 0.0)"
        g.line(f'{os_} = tl.where({om} == float("-inf"), {os_}, {os_} * {self._exp(p, f"{b_old} - {b_new}")}) + '
               f"{efull}")
        g.line(f"{om} = {mn}")

    def online_final(self, p: online.Pair, acc: tuple[str, str], partial: bool = False, row: bool = False) -> None:
        """The lanes of an online pair (or a split's partials, along the same axis) combined per
        row: M = max m_i, S = sum s_i * exp(c * (B(m_i) - B(M))) (a lane at -inf keeps s_i); a row
        of -inf gets the graph's own sum (online.py), except in a split's `partial`: the program's
        (M, S) written to the workspace, S relative to B(M), for the next phase to combine. `row`:
        `om` is the row's max already (online = 2), every lane's sum relative to B(M)."""
        g = self.g
        om, os_ = acc
        b_idx = self._b_idx(p)
        sm = g.fresh("red")
        if row:
            mx = om
            g.acc[p.mx] = mx
            bm, _ = g.value(p.b, b_idx)
            g.line(f"{sm} = tl.sum({os_}, axis={self.kax}){self.rsl}")
        else:
            mx, sl, ct = g.fresh("red"), g.fresh("sl"), g.fresh("ct")
            g.line(f"{mx} = tl.max({om}, axis={self.kax}){self.rsl}")
            g.line(f'{sl} = tl.where({om} == float("-inf"), 0.0, {om})')
            bl = self._b_at(p, sl, b_idx)
            g.acc[p.mx] = mx  # the row's max from here on: B(M) is the row's B, kept for the passes after
            bm, _ = g.value(p.b, b_idx)
            g.line(f'{ct} = tl.where({om} == float("-inf"), {os_}, {os_} * {self._exp(p, f"{bl} - {_p(bm)}")})')
            g.line(f"{sm} = tl.sum({ct}, axis={self.kax}){self.rsl}")
        if partial:
            m = f", mask={g.rmask}" if g.rmask else ""
            g.line(f"tl.store(ws + {self._ws(p.mx, 'sp')}, {mx}{m})")
            g.line(f"tl.store(ws + {self._ws(p.sm, 'sp')}, {sm}{m})")
        else:
            inf_sum = self._exp(p, f'float("-inf") - {_p(bm)}')
            g.line(f'{sm} = tl.where({mx} == float("-inf"), {sm} + 0.0 * {inf_sum}, {sm})')
        g.acc[p.sm] = sm

    def welford_step(self, state: tuple[str, str, str], v: str) -> None:
        """One chunk of a (sum, sum of squared deviations) pair (online.VAR_DOC): each lane's count
        `wn`, running mean `wm` and sum of squared deviations `wq` take the chunk's value (masked
        lanes: unchanged). Where no lane is masked and chunks are walked from the first, every
        lane's count is the number of chunks walked: no count is kept (`_counts`)."""
        g = self.g
        wn, wm, wq = state
        x, dl = g.fresh("wx"), g.fresh("wd")
        g.line(f"{x} = tl.broadcast_to({v}, {self.shape})")
        masked = bool(g.rmask or g.kmask)
        if self.reverse:
            g.line(f"{wn} = {wn} + " + ("tl.where(m, 1.0, 0.0)" if masked else "1.0"))
        else:
            self.uniform.add(wn)
        g.line(f"{dl} = {x} - {wm}")
        if not self.reverse:
            # chunks walked from the first, only the last one's tail masked: a lane that takes this
            # chunk took every one before it, so its count is the chunk's number, one per program
            # (a reciprocal per chunk, not a division per element: the same looped GroupNorm
            # regions ran 9-15% faster so, KernelBench level 2's 19, 21, 85, H200 2026-11-28)
            wi = g.fresh("wi")
            lo = f"{self.kvar} - k_lo" if self.split else self.kvar
            g.line(f"{wi} = 1.0 / (({lo}) // {self.PK} + 1)")
            step = f"{dl} * {wi}"
        else:
            step = f"{dl} / tl.maximum({wn}, 1.0)" if masked else f"{dl} / {wn}"
        sq = f"{dl} * ({x} - {wm})"
        g.line(f"{wm} = {wm} + " + (f"tl.where(m, {step}, 0.0)" if masked else step))
        g.line(f"{wq} = {wq} + " + (f"tl.where(m, {sq}, 0.0)" if masked else sq))

    def _counts(self, wn: str) -> str:
        """Each lane's count of a pair: its `wn` where chunks were walked from the last; else the
        chunks of this program's columns the lane fell inside the row in, known without counting:
        every one where the chunks divide the row (and a split's share), else, lane l of chunks of
        width PK from `start`, min(chunks, max(0, ceil((K - start - l) / PK)))."""
        if wn not in self.uniform:
            return wn
        width = split_chunk(self.sched, self.region) if self.split else self.K
        chunks = -(-width // self.PK)
        if self.even:
            return f"{float(chunks)}"
        if wn not in self.counted:
            g, c = self.g, self.g.fresh("wl")
            start = "k_lo" if self.split else "0"
            g.line(f"{c} = tl.minimum(tl.maximum(({self.K} - {start} - tl.arange(0, {self.PK}){self.ksl} + "
                   f"{self.PK - 1}) // {self.PK}, 0), {chunks}).to(tl.float32)")
            self.counted[wn] = c
        return self.counted[wn]

    def welford_final(self, vp: online.VarPair, state: tuple[str, str, str], total: str) -> None:
        """The lanes of a pair combined per row with its sum `total` (Chan et al.): S2 = sum(q_i +
        n_i * (m_i - mean)^2), mean = total / count; a split's program writes its own (about its
        own mean, its count the lanes' counts) to S2's place in the workspace."""
        g = self.g
        wn, wm, wq = state
        cnt, mean, q = g.fresh("wc"), g.fresh("wmean"), g.fresh("red")
        counts = self._counts(wn)
        if self.split and not (wn in self.uniform and self.even):
            lanes = f"tl.broadcast_to({counts}, {self.shape})"
            g.line(f"{cnt} = tl.maximum(tl.sum({lanes}, axis={self.kax}){self.rsl}, 1.0)")
        else:  # the row's count; a split's program where every lane took every chunk of its columns
            g.line(f"{cnt} = {float(split_chunk(self.sched, self.region) if self.split else self.K)}")
        g.line(f"{mean} = {total} / {cnt}")
        g.line(f"{q} = tl.sum({wq} + {counts} * ({wm} - {mean}) * ({wm} - {mean}), axis={self.kax}){self.rsl}")
        if self.split:
            m = f", mask={g.rmask}" if g.rmask else ""
            g.line(f"tl.store(ws + {self._ws(vp.s2, 'sp')}, {q}{m})")
        g.acc[vp.s2] = q

    def welford_combine(self, vp: online.VarPair, parts: str, total: str, masks: list[str]) -> None:
        """A split's programs' (sum, S2) partials of a pair combined per row, in a fixed order: each
        program's count is its share of the row (clamped: programs past the row's end hold none)."""
        g = self.g
        qs, ns, q = g.fresh("part"), g.fresh("wns"), g.fresh("red")
        m = ", mask=wm, other=0.0" if masks else ""
        g.line(f"{qs} = tl.load(ws + {self._ws(vp.s2, 'si')}{m})")
        chunk = split_chunk(self.sched, self.region)
        g.line(f"{ns} = tl.minimum(tl.maximum({self.K} - si * {chunk}, 0), {chunk}).to(tl.float32)")
        dev = f"({parts} / tl.maximum({ns}, 1.0) - {total} / {float(self.K)})"
        g.line(f"{q} = tl.sum({qs} + {ns} * {dev} * {dev}, axis={self.kax}){self.rsl}")
        g.acc[vp.s2] = q

    def arg_final(self, d: str, acc: tuple[str, str]) -> tuple[str, str]:
        """(value, index) of each row from a pair tile: a row holding a NaN gives NaN at its first
        NaN's index, else the max (min) at the smallest index holding it."""
        g = self.g
        av, ai = acc
        isn, hasn, mx, cand, idx, val = (g.fresh(p) for p in ("isn", "hasn", "mx", "cand", "idx", "val"))
        red = _REDUCE[d]
        g.line(f"{isn} = {av} != {av}")
        g.line(f"{hasn} = tl.max(tl.where({isn}, 1, 0), axis={self.kax}){self.rsl} > 0")
        g.line(f"{mx} = {red}(tl.where({isn}, {_IDENT[d]}, {av}), axis={self.kax}){self.rsl}")
        g.line(f"{cand} = tl.where({hasn}, {isn}, {av} == {mx})")
        g.line(f"{idx} = tl.min(tl.where({cand}, {ai}, {self.K}), axis={self.kax}){self.rsl}")
        g.line(f'{val} = tl.where({hasn}, float("nan"), {mx})')
        return val, idx

    def _ws(self, i: int, split: str) -> str:
        j = self.reduces.index(i)
        return f"({j * self.sched.splits} + {split}) * {self.R} + rr"

    def combine(self, stage: int) -> None:
        """A split's phase first combines the partials of every stage before its own, always in the
        same order, so each program holds the same row values (an online pair's sum: in its max's
        stage, combined with it)."""
        g, s = self.g, self.sched
        stages = self.region.analysis.stages
        earlier = [i for i in self.reduces if stages[self.fused.get(i, i)] < stage]
        if not earlier:
            return
        sp2 = _next_pow2(s.splits)
        g.line(f"si = tl.arange(0, {sp2}){self.ksl}")
        masks = [x for x in (g.rmask, f"si < {s.splits}" if sp2 != s.splits else None) if x]
        if masks:
            g.line(f"wm = {' & '.join(_p(x) for x in masks)}")
        for i in earlier:
            if i in self.fused:  # with its max
                continue
            fn = g.g.nodes[i].fn
            p = g.fresh("part")
            m = f", mask=wm, other={_IDENT[fn]}" if masks else ""
            g.line(f"{p} = tl.load(ws + {self._ws(i, 'si')}{m})")
            if i in self.pairs:
                ps = g.fresh("part")
                m = ", mask=wm, other=0.0" if masks else ""
                g.line(f"{ps} = tl.load(ws + {self._ws(self.pairs[i].sm, 'si')}{m})")
                self.online_final(self.pairs[i], (p, ps))
                continue
            res = g.fresh("red")
            g.line(f"{res} = {_REDUCE[fn]}({p}, axis={self.kax}){self.rsl}")
            g.acc[i] = res
            if i in self.vpairs:
                self.welford_combine(self.vpairs[i], p, res, masks)

    def row_index(self, o: int) -> tuple[str, ...]:
        """The index in output node o (numel = rows) of this program's rows."""
        g, sp = self.g, self.sp
        shape = g.g.nodes[o].shape
        if self.order == list(sp.row_dims):  # rr is the linear index of the kept dims, in order
            return g.delin("rr", shape)
        keep = tuple(1 if d in sp.reduced else n for d, n in enumerate(sp.shape))
        idx = tuple(self.ridx.get(d, "0") for d in range(len(sp.shape)))
        return g.reshape_idx(idx, keep, shape)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _numel(g: _Gen, o: int) -> int:
    return math.prod(g.g.nodes[o].shape)
