"""Shared by the backward-family tests (test_bwd_families.py, test_norm_bwd.py,
test_ce_softmax_bwd.py): a forward workload's backward family, and its launcher bound to a config."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from solforge.records import Workload
from solforge.tune import family_module, launcher_of


def bwd_of(fwd: Workload) -> tuple[ModuleType, Workload]:
    """(the backward family's module, the backward workload) of a forward workload."""
    wl = family_module(fwd.family).backward_workload(fwd)
    assert wl is not None
    return family_module(wl.family), wl


def with_config(fam: ModuleType, config: Any) -> Callable[..., Any]:
    """The family's launcher with `config` bound, as the verifier calls a candidate."""
    launcher = launcher_of(fam)
    return lambda *a, **kw: launcher(*a, config=config, **kw)


def assert_sampled_configs_verify(fwd: Workload, device: str) -> None:
    """The backward family of `fwd` verifies with its heuristic and ~6 configs spread over its space."""
    from solforge.tune.verify import verify

    fam, wl = bwd_of(fwd)
    space = fam.space(wl)
    for c in [fam.heuristic(wl), *space[:: max(1, len(space) // 6)]]:
        v = verify(fam, wl, with_config(fam, c), device=device)
        assert v.passed, f"{c.encode()} on {wl.key}: {v.reason}"


def hashed_modules(fam: ModuleType) -> set[str]:
    """The solforge.kernels modules the database's template hash of `fam` reads: its own and every
    kernels module it imports, transitively (what db._source_hash walks)."""
    from solforge import db

    seen: set[str] = set()
    todo = [fam.__name__]
    while todo:
        name = todo.pop()
        path = db._module_file(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        todo += db._kernel_imports(path.read_text())
    return seen


def defined_in(fn: Any) -> str:
    """The module that defines `fn`, a function or a @triton.jit one (compiled or interpreted)."""
    return str(getattr(fn, "fn", fn).__module__)
