"""Memory layout of a region's loop: the stride at which each input is walked along each loop dim.

The schedules need to know which dim of the loop space S the inputs are contiguous along: a row
reduction reads coalesced only when the reduced dims are the inputs' innermost; otherwise a 2-D
tile along the innermost KEPT dim does (schedule.py's "tiles"). The inputs' strides are in the IR,
but a load reaches its input through views (permute, reshape, expand, slice, select, pad) and
gathers (a gathered dim's index is data: taken as fixed), so the map
from loop dims to input strides is found by walking the kernel graph with concrete indices: the
loop's origin and one unit step along each dim, evaluated together (a reshape is div/mod, so the
step at the origin stands for the dim's stride, exact for every view but a reshape that splits a
dim). The walk is the generator's own index arithmetic (triton_gen.py `_Gen.view_idx`) on ints.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from solforge.codegen.lower import KNode, Lowered

Idx = tuple[tuple[int, ...], ...]  # per dim of a value: its index at each walked point
T = TypeVar("T")
_MEMO: dict[tuple[str, int], tuple[Lowered, Any]] = {}


def _per_region(fn: Callable[[Lowered], T]) -> Callable[[Lowered], T]:
    """Memoized per region object: schedule.is_valid asks on every launch (runtime.run)."""
    @functools.wraps(fn)
    def wrapped(region: Lowered) -> T:
        key = (fn.__name__, id(region))
        hit = _MEMO.get(key)
        if hit is None or hit[0] is not region:
            if len(_MEMO) > 4096:  # bounded: regions are few, but ids of dead ones are never reused here
                _MEMO.clear()
            hit = _MEMO[key] = (region, fn(region))
        return hit[1]  # type: ignore[no-any-return]
    return wrapped


@dataclass(frozen=True)
class LoadWalk:
    input: int  # the region input read
    numel: int  # its element count (the big inputs decide the layout)
    strides: tuple[int, ...]  # per loop dim: elements of the input moved by one step (0: not moved)


def _cstrides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _reshape(idx: Idx, frm: Sequence[int], to: Sequence[int], points: int) -> Idx:
    cs_f, cs_t = _cstrides(frm), _cstrides(to)
    lin = [sum(idx[d][p] * cs_f[d] for d in range(len(frm))) for p in range(points)]
    return tuple(tuple((lin[p] // c) % n for p in range(points)) for c, n in zip(cs_t, to, strict=True))


def _bcast(idx: Idx, shape: Sequence[int], src: Sequence[int], points: int) -> Idx:
    off = len(shape) - len(src)
    return tuple((0,) * points if n == 1 else idx[k + off] for k, n in enumerate(src))


def _view(node: KNode, src: Sequence[int], idx: Idx, points: int) -> Idx:
    if node.fn == "reshape":
        return _reshape(idx, node.shape, src, points)
    if node.fn == "permute":
        out: list[tuple[int, ...]] = [(0,) * points] * len(src)
        for j, p in enumerate(node.params[0]):
            out[p] = idx[j]
        return tuple(out)
    if node.fn == "expand":
        return _bcast(idx, node.shape, src, points)
    if node.fn == "slice":
        dim, start, step = node.params
        return tuple(tuple(v * step + start for v in x) if d == dim else x for d, x in enumerate(idx))
    if node.fn == "select":
        dim, at = node.params
        return (*idx[:dim], (at,) * points, *idx[dim:])
    if node.fn == "pad":
        dim, before, _fill = node.params
        return tuple(tuple(v - before for v in x) if d == dim else x for d, x in enumerate(idx))
    raise AssertionError(node.fn)


def walk(region: Lowered) -> list[LoadWalk]:
    """Every load the loop reaches (through reductions' inputs and the loop-shaped outputs), with
    the stride of its input along each loop dim."""
    g, S, ir = region.graph, region.space.shape, region.ir
    dims = [d for d, n in enumerate(S) if n > 1]
    points = 1 + len(dims)
    # point 0: the loop's middle point; point 1 + k: one step along dims[k]. Not the origin: a
    # padded view (a pool's or a conv's zero border) maps the origin outside its input, where the
    # index arithmetic wraps into the row before (a 1-D average pool padded by 4 read as if its
    # taps ran along the batch dim, and was tiled as a transpose)
    mid = [(n - 1) // 2 for n in S]
    start: Idx = tuple(tuple(mid[d] + (1 if p > 0 and dims[p - 1] == d else 0) for p in range(points))
                       for d in range(len(S)))
    seen: set[tuple[int, Idx]] = set()
    found: list[LoadWalk] = []
    numel_s = math.prod(S)

    def visit(i: int, idx: Idx) -> None:
        if (i, idx) in seen:
            return
        seen.add((i, idx))
        node = g.nodes[i]
        if node.kind == "load":
            k = node.params[0]
            m = ir.inputs[k]
            off = [sum(idx[d][p] * m.stride[d] for d in range(len(m.shape)) if m.shape[d] != 1) for p in range(points)]
            st = [0] * len(S)
            for q, d in enumerate(dims):
                st[d] = off[1 + q] - off[0]
            found.append(LoadWalk(k, m.numel, tuple(st)))
        elif node.kind == "view":
            visit(node.inputs[0], _view(node, g.nodes[node.inputs[0]].shape, idx, points))
        elif node.kind == "pw":
            for j in node.inputs:
                visit(j, _bcast(idx, node.shape, g.nodes[j].shape, points))
        elif node.kind == "gather":
            # the index operands as a pointwise op's; the source along the dims the gather walks
            # (a gathered dim's index is data: taken as fixed, so an embedding's rows read along D)
            for j in node.inputs[1:]:
                visit(j, _bcast(idx, node.shape, g.nodes[j].shape, points))
            visit(node.inputs[0], tuple(idx[k] if k >= 0 else (0,) * points for k in node.params[0]))
        elif node.kind == "scan":  # its input, at the same loop point
            visit(node.inputs[0], idx)
        # const: nothing; reduce: a per-row value, its input is walked from the loop below

    for node in g.nodes:
        if node.kind == "reduce":
            visit(node.inputs[0], start)
    for o in g.outputs:
        if math.prod(g.nodes[o].shape) == numel_s and region.analysis.kinds[o] != "row":
            visit(o, _reshape(start, S, g.nodes[o].shape, points))
    return found


_MAX_COUNTED = 1 << 16


@_per_region
def loads_per_point(region: Lowered) -> int:
    """The loads the generated code makes for one loop point: one per load node for each distinct
    chain of views it is read through (the generator writes a view's index anew for each chain,
    so a pool's window loads once per tap, and the taps of chained pools multiply, 9 x 9 for two
    3 x 3 pools, even where two chains reach one position: `walk`, which counts positions, saw 25
    in an Inception block's pools where the kernel made 90 loads). Counted up to 65536."""
    g = region.graph
    seen: set[tuple[int, tuple[int, ...]]] = set()
    count = 0
    stack: list[tuple[int, tuple[int, ...]]] = [(n.inputs[0], ()) for n in g.nodes if n.kind == "reduce"]
    stack += [(o, ()) for o in g.outputs]
    while stack and count < _MAX_COUNTED:
        i, path = stack.pop()
        if (i, path) in seen:
            continue
        seen.add((i, path))
        node = g.nodes[i]
        if node.kind == "load":
            count += 1
        elif node.kind in ("view", "gather"):
            stack += [(j, path + (i,)) for j in node.inputs]
        elif node.kind in ("pw", "scan"):
            stack += [(j, path) for j in node.inputs]
    return max(1, count)


def dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """The strides lay the shape out without holes or overlaps (some permutation of contiguous)."""
    dims = sorted((s, n) for n, s in zip(shape, stride, strict=True) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def out_strides(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The strides an output is allocated with (runtime.empty_outputs): the graph's when dense, else contiguous."""
    return tuple(stride) if dense(shape, stride) else tuple(_cstrides(shape))


@_per_region
def store_steps(region: Lowered) -> tuple[tuple[int, ...], ...]:
    """Per loop-shaped output (as allocated: `out_strides`): the elements its memory moves by for
    one step along each loop dim (0 along a dim of size 1)."""
    S, ir, g = region.space.shape, region.ir, region.graph
    dims = [d for d, n in enumerate(S) if n > 1]
    points = 1 + len(dims)
    start: Idx = tuple(tuple(1 if p > 0 and dims[p - 1] == d else 0 for p in range(points)) for d in range(len(S)))
    out = []
    for k, o in enumerate(g.outputs):
        shape = g.nodes[o].shape
        if math.prod(shape) != math.prod(S):
            continue
        m = ir.out_meta(ir.outputs[k])
        st = out_strides(m.shape, m.stride)
        idx = _reshape(start, S, shape, points)
        off = [sum(idx[d][p] * st[d] for d in range(len(shape))) for p in range(points)]
        steps = [0] * len(S)
        for q, d in enumerate(dims):
            steps[d] = off[1 + q] - off[0]
        out.append(tuple(steps))
    return tuple(out)


@_per_region
def store_inner_dim(region: Lowered) -> int | None:
    """The loop dim along which the loop-shaped outputs are written with the smallest stride."""
    best: tuple[int, int] | None = None
    for steps in store_steps(region):
        for d, step in enumerate(steps):
            if step and (best is None or abs(step) < best[0]):
                best = (abs(step), d)
    return None if best is None else best[1]


def store_run(region: Lowered, dim: int, stop: int) -> tuple[int, ...]:
    """`dim` and the loop dims before it (size-1 dims skipped, never `stop`) over which every
    loop-shaped output is one linear range: an NCHW output stored along W is one range over H and
    W, so a transposing tile walks H*W as one dim (as Inductor's tiles do), not W alone with a
    masked tail per row of H."""
    S, steps = region.space.shape, store_steps(region)
    group = [dim]
    for d in range(dim - 1, -1, -1):
        if S[d] == 1:
            continue
        inner = group[0]
        if d == stop or not steps or not all(st[inner] and st[d] == st[inner] * S[inner] for st in steps):
            break
        group.insert(0, d)
    return tuple(group)


def _inner(w: LoadWalk) -> int | None:
    best = min(((abs(s), d) for d, s in enumerate(w.strides) if s != 0), default=None)
    return None if best is None else best[1]


@_per_region
def inner_dim(region: Lowered) -> int | None:
    """The loop dim the biggest inputs are walked along with the smallest stride (their
    contiguous dim, as the loop sees it); None when no load moves along any dim."""
    loads = walk(region)
    if not loads:
        return None
    big = max(w.numel for w in loads)
    best: tuple[int, int] | None = None
    for w in loads:
        if w.numel != big:
            continue
        for d, s in enumerate(w.strides):
            if s != 0 and (best is None or abs(s) < best[0]):
                best = (abs(s), d)
    return None if best is None else best[1]


@_per_region
def transpose_dims(region: Lowered) -> tuple[int, int] | None:
    """(the loop dim the outputs are stored along contiguously, the loop dim a big input, half the
    loop's size or more, is read along contiguously) when the two differ: a pointwise region that
    transposes (a permuted or channels-last input into a contiguous output), whose 1-D tiles would
    read or write strided."""
    if region.reduces:
        return None
    a = store_inner_dim(region)
    if a is None:
        return None
    for w in walk(region):
        b = _inner(w)
        if 2 * w.numel >= region.space.numel and b is not None and b != a:
            return a, b
    return None
