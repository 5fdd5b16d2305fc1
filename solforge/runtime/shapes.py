"""Sizes under dynamic shapes: one compiled graph for many input sizes.

dynamo compiles a graph for the first shape of an input it sees. When another shape comes, it
compiles one graph for every size of the dims that changed (sizes 0 and 1 stay apart), whose sizes
are symbols (`torch.SymInt`) with the sizes of the call that compiled it as their hints; that graph
then serves every later call, the first shape's too. `int(size)` on such a symbol would make the
graph valid for one size alone (dynamo adds a guard and compiles again for the next size).

- `hint` reads a size for a record or an estimate (a workload's key, a heuristic's choice) with
  no guard: the symbol's hint, or, inside `bound(values)`, its value for one call.
- `ShapeDispatch` is what dynamo calls for such a graph. The first call of a set of sizes runs
  the graph rewritten for all sizes, whose kernels take their family's heuristic for each call
  (config ""). The second call of the same sizes (sizes that come back: a decode step, a training
  shape, the shape the kernels were tuned for) makes the graph again for them, from the lowered
  graph before any rewrite, with their values bound: each region then gets the config for its own
  workload (this run's tuned winner, the database's, the heuristic: integrate/__init__.py) and the graph
  its own CUDA-graph replay (stepgraphs.py). Making one costs the rewrite's matching (no dynamo
  recompile, no lowering); a length seen once (a prompt) does not pay it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint as _optimization_hint
except ImportError:  # older torch
    _optimization_hint = None

_BOUND: contextvars.ContextVar[Mapping[Any, int] | None] = contextvars.ContextVar("solforge_sizes", default=None)


@contextlib.contextmanager
def bound(values: Mapping[Any, int]) -> Iterator[None]:
    """Within this block `hint` gives each symbol in `values` (sympy symbol -> int) that value."""
    token = _BOUND.set(values)
    try:
        yield
    finally:
        _BOUND.reset(token)


def binding() -> bool:
    """Whether sizes are bound (inside `bound`): a graph is being made for one call's sizes."""
    return _BOUND.get() is not None


def hint(size: Any) -> int:
    """A size as a plain int, with no guard: a SymInt's bound value or hint, an int as it is."""
    if isinstance(size, torch.SymInt):
        value = bound_value(size)
        if value is not None:
            return value
        if _optimization_hint is not None:
            return int(_optimization_hint(size, fallback=1))
        node_hint = getattr(size.node, "hint", None)
        return int(node_hint) if node_hint is not None else 1
    return int(size)


def bound_value(size: Any) -> int | None:
    """A SymInt's value for the call whose sizes are bound (inside `bound`), or None: outside
    `bound`, or when a symbol it depends on has no value there (a size read from data)."""
    values = _BOUND.get()
    if not values or not isinstance(size, torch.SymInt):
        return None
    v = size.node.expr.xreplace(values)
    return int(v) if isinstance(v, int) or not v.free_symbols else None  # (a plain symbol maps to the int itself)


def symbolic(value: Any) -> bool:
    """Whether a value (a SymInt, a tensor, a tuple of them) holds a symbolic size or stride."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))
    if isinstance(value, tuple | list):
        return any(symbolic(v) for v in value)
    return False


def symbolic_inputs(gm: fx.GraphModule) -> list[int]:
    """Indices of the graph's placeholders whose value is symbolic: the inputs whose sizes (or the
    sizes they are) differ from call to call of a dynamic-shape graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if symbolic(n.meta.get("val"))]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` that a rewrite of it leaves alone (nodes copied, meta shallow-copied, the
    module's meta too: the lowering's grad mode is read by the planner)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def _readers(gm: fx.GraphModule) -> list[tuple[int, int | None, Any]]:
    """How to read each size symbol from a call's arguments: (input index, dim or None for a
    SymInt input, symbol), the first place each symbol appears as a plain size of an input; none
    when a symbol is never such a size (its value per call could not be read)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    readers: list[tuple[int, int | None, Any]] = []
    seen: set[Any] = set()
    free: set[Any] = set()  # every symbol in the inputs' sizes and strides
    for i, n in enumerate(placeholders):
        val = n.meta.get("val")
        dims = [(None, val)] if isinstance(val, torch.SymInt) else \
            list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else []
        strides = val.stride() if isinstance(val, torch.Tensor) else ()
        for size in (*(s for _, s in dims), *strides):
            if isinstance(size, torch.SymInt):
                free |= size.node.expr.free_symbols
        for d, size in dims:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol and size.node.expr not in seen:
                seen.add(size.node.expr)
                readers.append((i, d, size.node.expr))
    return readers if free <= seen else []


class ShapeDispatch:
    """What dynamo calls for a dynamic-shape graph (see the module doc). `fallback` (the graph
    rewritten for all sizes) runs a set of sizes the first time, and whenever making a graph for
    them failed (`failures`); `specialize(values)` makes the graph for sizes seen before. Keeps the
    last `KEEP` graphs made and remembers the last `SEEN` sets of sizes."""

    KEEP = 32
    SEEN = 1024

    def __init__(self, gm: fx.GraphModule, fallback: Callable[..., Any],
                 specialize: Callable[[Mapping[Any, int]], Callable[..., Any]],
                 report: Callable[[str], None] | None = None,
                 evict: Callable[[Callable[..., Any]], None] | None = None) -> None:
        self.gm = gm
        self._report = report  # told of a failure to make a graph (the backend's errors)
        self._evict = evict  # given a graph made earlier that is no longer kept
        self.fallback = fallback
        self._specialize = specialize
        self._readers = _readers(gm)
        self._made: OrderedDict[tuple[int, ...], Callable[..., Any]] = OrderedDict()
        self._seen: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.failures: list[str] = []
        self.made = 0

    def __call__(self, *args: Any) -> Any:
        if not self._readers or self.failures:
            return self.fallback(*args)
        try:
            sizes = tuple(int(args[i] if d is None else args[i].shape[d]) for i, d, _ in self._readers)
        except (IndexError, AttributeError, TypeError):  # not the graph's inputs as it saw them
            return self.fallback(*args)
        fn = self._made.get(sizes)
        if fn is not None:
            self._made.move_to_end(sizes)
            return fn(*args)
        if sizes not in self._seen:
            self._seen[sizes] = None
            if len(self._seen) > self.SEEN:
                self._seen.popitem(last=False)
            return self.fallback(*args)
        try:
            fn = self._specialize({symbol: size for (_, _, symbol), size in zip(self._readers, sizes, strict=True)})
        except Exception as e:  # noqa: BLE001 - the graph for all sizes is correct, only slower
            self.failures.append(f"{type(e).__name__}: {str(e)[:200]}")
            if self._report is not None:
                self._report(f"making the graph for sizes {sizes} failed, the graph for all sizes runs: "
                             f"{self.failures[-1]}")
            return self.fallback(*args)
        self.made += 1
        self._made[sizes] = fn
        if len(self._made) > self.KEEP:
            _, old = self._made.popitem(last=False)
            if self._evict is not None:
                self._evict(old)
        return fn(*args)
