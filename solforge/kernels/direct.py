"""Direct calls: the integrated graph calls each solforge op's implementation without torch.library's
dispatch, when nothing traces it.

Every family op is a `torch.library` op (so torch.compile, export and FakeTensor see an opaque op
with a fake implementation), and its backward is wired in with `register_autograd`. Each call of
such an op from the optimized model's graph pays, on top of the kernel launch, the dispatcher
twice (Autograd, then the implementation) and torch.library's generated autograd wrapper, whose
`fill_defaults` rebuilds the schema's argument list once per argument. Measured on the H100 host
(tools/host_step.py, `calibration`, 2026-11-25): 110.7 µs of host time for one rmsnorm call with
autograd recording, against 72.0 µs through an autograd.Function calling the same implementation
and 22.8 µs for the implementation alone. In Llama-3.2-1B's training forward (B1 S4096) the
wrappers of rope, add_rmsnorm and swiglu took ~13 ms of the forward's 25.7 ms of host time, which
made the step host-bound.

`register` records, next to each op's torch.library registration, its implementation and its
autograd formula (the same `setup_context` and `backward` functions register_autograd got).
`direct_calls(gm)` (integrate/__init__.py, last of its passes) retargets the graph's calls of those ops to
a plain function that
- calls the op through torch.ops, as before, whenever something may be tracing, transforming or
  recording the call: dynamo compiling, a TorchDispatchMode (FakeTensorMode, make_fx, a debug
  mode), a functorch transform (vmap, grad), or torch.profiler (its trace then names the ops, and
  the host time it shows is torch.ops's);
- else, with autograd recording (grad mode on and an input that requires grad), applies an
  autograd.Function made of the op's implementation and its registered formula: the values, the
  saved tensors and the gradients are the op's;
- else calls the implementation: for ops that registered a `site` maker (rmsnorm), one of the
  node's own, which keeps the plan of the node's first call for its later ones.

The ops' backward kernels (`<family>_bwd`, no autograd formula of their own) are called the same
way from the backward formulas (`plain`): directly, unless something traces, or autograd records
(a double backward, `create_graph=True`: through torch.ops the missing formula is reported).

SOLFORGE_DIRECT_CALLS=0 in the environment (settings.direct_calls, kept in `ENABLED`: read on every call;
or `ENABLED = False`) leaves every call on torch.ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from solforge import settings

ENABLED = True


def _follow(s: settings.Settings) -> None:
    global ENABLED
    ENABLED = s.direct_calls


settings.follow(_follow, "direct_calls")

_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_level = torch._C._functorch.peek_interpreter_stack
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_profiling = torch._C._autograd._profiler_enabled

# op overload -> the function the graph calls instead
_DIRECT: dict[Any, Callable[..., Any]] = {}
# op overload -> (a maker of one node's implementation, the op's autograd.Function's apply or None)
_SITES: dict[Any, tuple[Callable[[], Callable[..., Any]], Callable[..., Any] | None]] = {}


def _traced() -> bool:
    """Whether a call may be traced, transformed or recorded rather than only run: then it goes
    through torch.ops (under torch.profiler too, so a profile names the op as before)."""
    return bool(_dispatch_modes()) or _functorch_level() is not None or _is_compiling() or _profiling()


def register(op: Any, impl: Callable[..., Any], setup: Callable[..., None] | None = None,
             backward: Callable[..., Any] | None = None,
             site: Callable[[], Callable[..., Any]] | None = None) -> Callable[..., Any]:
    """Record `op`'s implementation (and its autograd formula, as given to register_autograd):
    the function `direct_calls` puts in the graph in its place. Returns that function.

    `site`, where given, makes an implementation for one node of a graph (called like `impl`, with
    the same results), which may keep what it worked out from its first call's layout for the
    node's later calls (rmsnorm's `_Site`): `direct_calls` gives each node of the op its own, used
    for the calls without autograd recording."""
    schema = op._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        raise ValueError(f"{op}: direct calls are for functional ops only")
    name = str(op).replace(".", "_").replace("::", "_")
    if backward is None:
        call = plain(op, impl)
    else:
        assert setup is not None
        fn = type(f"{name}_function", (torch.autograd.Function,), {
            "forward": staticmethod(impl),
            "setup_context": staticmethod(setup),
            "backward": staticmethod(backward),
        })
        apply = fn.apply

        def call(*args: Any) -> Any:
            if _traced():
                return op(*args)
            if _grad_enabled() and _any_requires_grad(*args):
                return apply(*args)
            return impl(*args)

    _label(call, op, name, fn if backward is not None else None)
    _DIRECT[op] = call
    globals()[call.__name__] = call  # importable by name: what a pickled GraphModule refers to
    if site is not None:
        _SITES[op] = (site, apply if backward is not None else None)
    return call


def _label(call: Any, op: Any, name: str, function: Any) -> None:
    call.__name__ = call.__qualname__ = f"direct_{name}"
    call._schema = op._schema  # stepgraphs.written_inputs reads alias info
    call.solforge_op = op  # the op it stands for (profile, tests)
    call.function = function  # the autograd.Function, or None (benchmarks)


def node_call(op: Any) -> Callable[..., Any]:
    """The function one node of `op` calls: with a site of its own where the op registered a maker
    of them (register's `site`), else the op's shared direct function."""
    made = _SITES.get(op)
    if made is None:
        return _DIRECT[op]
    site, apply = made[0](), made[1]
    shared = _DIRECT[op]

    def call(*args: Any) -> Any:
        if _traced():
            return op(*args)
        if apply is not None and _grad_enabled() and _any_requires_grad(*args):
            return apply(*args)
        return site(*args)

    _label(call, op, shared.__name__[len("direct_"):], shared.function)  # type: ignore[attr-defined]
    call.site = site  # type: ignore[attr-defined]  # (tests)
    return call


def plain(op: Any, impl: Callable[..., Any]) -> Callable[..., Any]:
    """`op` (no autograd formula: a backward kernel) called directly unless traced or recorded."""

    def call(*args: Any) -> Any:
        if not ENABLED or _traced() or (_grad_enabled() and _any_requires_grad(*args)):
            return op(*args)
        return impl(*args)

    return call


def direct_calls(gm: fx.GraphModule) -> int:
    """Retarget `gm`'s calls of registered ops to their direct functions (module docstring).
    A call with keyword arguments is left on torch.ops; missing trailing arguments get the
    schema's defaults. Returns how many calls were retargeted."""
    if not ENABLED:
        return 0
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target not in _DIRECT:
            continue
        arguments = node.target._schema.arguments
        if any(a.kwarg_only for a in arguments) or len(node.args) > len(arguments):
            continue
        missing = arguments[len(node.args):]
        if not all(a.has_default_value() for a in missing):
            continue
        node.args = (*node.args, *(a.default_value for a in missing))
        node.target = node_call(node.target)
        n += 1
    if n:
        gm.recompile()
    return n
