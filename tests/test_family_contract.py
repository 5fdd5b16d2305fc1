"""Every registered kernel family (kernels/registry.py) against the family contract: its module has
every required hook and names itself as the table does; its heuristic and every config of its space
are valid; its kernel (heuristic config) agrees with its reference on a small odd shape within the
family's tolerance; a forward family's backward workload is of the backward family its row names,
whose kernel agrees with its reference (autograd through the forward's reference); its profile
kind is known, and so is every op of the solforge namespace. Small shapes only (Triton's
interpreter off the GPU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import DEVICE

from solforge.kernels import registry
from solforge.numerics import compare
from solforge.profile.kinds import KINDS, node_kind
from solforge.records import Workload

BF16, FP32 = torch.bfloat16, torch.float32
META = dict(device="meta")


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, **META)


def _on_device(wl: Workload) -> Workload:
    return dataclasses.replace(wl, device=DEVICE)


def _rope() -> Workload:
    q, k, c, w = _t(1, 7, 3, 16), _t(1, 7, 1, 16), _t(1, 7, 16), _t(16)
    return registry.module("rope").workload_for(q, k, c, c, w, w, 1e-6, norm=True, round_before_weight=True,
                                                heads_first=True)


def _lce() -> Workload:
    L = registry.module("linear_cross_entropy")
    return L.workload_for(_t(13, 24), _t(37, 24), None, torch.empty(13, dtype=torch.int64, **META),
                          out_dtype=FP32, grads=L.GRAD_HIDDEN | L.GRAD_WEIGHT)


def _generated() -> Workload:
    """A LayerNorm-like region written out (mean, var, normalize, a bias) over 45 columns, formed by
    solforge's generator from a traced function. A per-row bias, no weight: its backward is one
    kernel (a weight's gradient, a sum over the rows, would make it two: test_codegen_backward.py)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from solforge.codegen.regions import form_regions

    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        m = x.float().mean(-1, keepdim=True)
        v = ((x.float() - m) ** 2).mean(-1, keepdim=True)
        return ((x.float() - m) * torch.rsqrt(v + 1e-5) + b).to(x.dtype)

    gm = make_fx(f, tracing_mode="fake")(torch.empty(13, 45, dtype=BF16), torch.empty(13, 1))
    (region,) = form_regions(gm.graph)
    return registry.module("generated").workload_for(region.lowered.ir)


# One small workload per forward family: rows not a power of two, hidden sizes odd where the
# family allows it (rope's head dim is even by construction). A family missing here fails
# test_every_family_has_a_case.
FORWARD: dict[str, Callable[[], Workload]] = {
    "rope": _rope,
    "add_rmsnorm": lambda: registry.module("add_rmsnorm").workload_for(_t(13, 45), _t(13, 45), _t(45), 1e-6,
                                                                       None, True),
    "rmsnorm": lambda: registry.module("rmsnorm").workload_for(_t(13, 45), _t(45), 1e-6, None, True),
    "add_layernorm": lambda: registry.module("add_layernorm").workload_for(_t(7, 45), _t(7, 45), _t(45), _t(45),
                                                                           1e-5),
    "layernorm": lambda: registry.module("layernorm").workload_for(_t(13, 45), _t(45), _t(45), 1e-5),
    "swiglu": lambda: registry.module("swiglu").workload_for(_t(13, 45), _t(13, 45), "silu"),
    "gelu": lambda: registry.module("gelu").workload_for(_t(13, 45), _t(45), "tanh"),
    "linear_cross_entropy": _lce,
    "cross_entropy": lambda: registry.module("cross_entropy").workload_for(
        _t(13, 37), torch.empty(13, dtype=torch.int64, **META), out_dtype=FP32),
    "softmax": lambda: registry.module("softmax").workload_for(_t(13, 45)),
    "generated": _generated,
}


def _cases() -> dict[str, tuple[str, Callable[[], Workload]]]:
    """case id -> (family, its small workload): every forward family's, and the backward
    workload of every forward family that has one (rmsnorm_bwd comes from rmsnorm and add_rmsnorm)."""
    out: dict[str, tuple[str, Callable[[], Workload]]] = {}
    for name in registry.forward_names():
        if name not in FORWARD:
            continue
        out[name] = (name, lambda name=name: _on_device(FORWARD[name]()))
        bwd = registry.get(name).backward
        if bwd is not None:
            out[f"{bwd}-of-{name}"] = (bwd, lambda name=name: _backward_of(name))
    return out


def _backward_of(name: str) -> Workload:
    wl = registry.backward_workload(name, _on_device(FORWARD[name]()))
    assert wl is not None, f"{name}: its row names backward family {registry.get(name).backward} but " \
                           "backward_workload gave None"
    return wl


CASES = _cases()


def test_every_family_has_a_case() -> None:
    assert set(FORWARD) == set(registry.forward_names())
    assert {fam for fam, _ in CASES.values()} == set(registry.names())


def test_table_is_consistent() -> None:
    names = registry.names()
    assert len(names) == len(set(names))
    assert set(registry.forward_names()) | set(registry.backward_names()) == set(names)
    for f in registry.FAMILIES:
        assert f.kind in KINDS, f"{f.name}: profile kind {f.kind!r} is not one of {KINDS}"
        assert f.module == f"solforge.kernels.{f.name}"
        if f.is_backward:
            assert f.matcher is None and f.backward is None
            # a backward region is the same kind of work as its forward's
            assert {registry.get(g).kind for g in registry.forward_names() if registry.get(g).backward == f.name} \
                == {f.kind}
        else:
            assert f.matcher is not None and callable(registry.matcher(f))
            assert f.backward is None or registry.get(f.backward).is_backward


@pytest.mark.parametrize("name", registry.names())
def test_module_has_every_hook(name: str) -> None:
    mod = registry.module(name)
    assert registry.missing_hooks(name) == []
    assert mod.FAMILY == name
    assert hasattr(mod, "backward_workload") == (registry.get(name).backward is not None)


@pytest.mark.parametrize("case", list(CASES))
def test_configs_are_valid(case: str) -> None:
    fam, make = CASES[case]
    wl = make()
    assert wl.family == fam
    space = registry.space(fam, wl)
    assert space, f"{fam}: empty space for {wl.key}"
    bad = [c.encode() for c in space if not registry.is_valid(fam, c, wl)]
    assert not bad, f"{fam}: invalid configs in its space for {wl.key}: {bad[:5]}"
    h = registry.heuristic(fam, wl)
    assert h in space or registry.is_valid(fam, h, wl)
    cls = registry.config_class(fam)
    assert cls(**dict(h.items())) == h  # what a Candidate's config rebuilds
    assert cls.decode(h.encode()) == h  # what the op runs for the config string it is given


def _items(x: Any) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case: str) -> None:
    """The heuristic config's kernel against the reference: outputs poisoned with NaN first, so an
    unwritten element fails."""
    fam, make = CASES[case]
    wl = make()
    args, kwargs = registry.make_inputs(fam, wl, seed=3, device=DEVICE)
    before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
    ref = registry.reference(fam)(*args, **kwargs)
    out = tuple(torch.full_like(r, float("nan")) for r in ref) if isinstance(ref, tuple) \
        else torch.full_like(ref, float("nan"))
    registry.launcher(fam)(*args, config=registry.heuristic(fam, wl), out=out, **kwargs)
    tol = registry.output_tolerance(fam, wl)
    for j, (o, r) in enumerate(zip(_items(out), _items(ref), strict=True)):
        c = compare(o, r, tol[j] if isinstance(tol, tuple) else tol)
        assert c.ok, f"{case} output {j} on {wl.key}: {c.reason}"
    for a, b in zip(args, before, strict=True):
        assert b is None or torch.equal(a, b), f"{case}: an input was modified"


@pytest.mark.parametrize("case", list(CASES))
def test_odd_rows_draw_that_size(case: str) -> None:
    """make_inputs(rows=) replaces the size verify_rows names (the verifier's odd shape)."""
    fam, make = CASES[case]
    wl = make()
    rows = registry.verify_rows(fam, wl)
    a, _ = registry.make_inputs(fam, wl, seed=0, device=DEVICE)
    b, _ = registry.make_inputs(fam, wl, seed=0, rows=5, device=DEVICE)
    sizes_a = [x.shape for x in a if isinstance(x, torch.Tensor)]
    sizes_b = [x.shape for x in b if isinstance(x, torch.Tensor)]
    assert rows in {d for s in sizes_a for d in s}
    # a family built for exact sizes keeps them; any other draws the size it is given
    assert (sizes_a == sizes_b) if registry.shape_fixed(fam) else (sizes_a != sizes_b)


def _solforge_ops() -> list[str]:
    for name in registry.names():
        registry.module(name)  # each family's module defines its ops
    return sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("solforge::")})


def test_every_solforge_op_is_a_family_with_a_kind() -> None:
    """A solforge op outside the table would be profiled as "other" silently: none may exist."""
    ops = _solforge_ops()
    assert ops and set(ops) <= set(registry.names()), set(ops) - set(registry.names())
    g = torch.fx.Graph()
    for op in ops:
        node = g.call_function(getattr(torch.ops.solforge, op).default, ())
        assert node_kind(node) == registry.get(op).kind


def test_dotted_name_is_an_ad_hoc_family() -> None:
    rec = registry.get("fakes.broken")
    assert rec.module == "fakes.broken" and rec.matcher is None and rec.backward is None
    mod = registry.module("fakes.broken")
    assert registry.launcher(mod) is mod.broken and registry.reference(rec) is mod.broken_ref
    assert registry.backward_workload(mod, mod.workload()) is None
    assert registry.verify_rows(mod, mod.workload(rows=9)) == 9
    assert registry.output_tolerance(mod, mod.workload()) is None
    with pytest.raises(LookupError, match="unknown kernel family"):
        registry.get("no_such_family")
