"""kernels/launch.py: the direct launch path of compiled Triton kernels.

CPU: the cache key is at least as strict as Triton's own specialization (checked against Triton's
native specialize function on many values), the direct path's argument list (with a stand-in
compiled kernel), when it must not be taken (hooks, switched off, uncacheable arguments), the
bound on the cache, and that the interpreter never takes it. GPU: every family's op gives bitwise
the same forward and backward with the direct path as through Triton, also for another row count
and misaligned inputs, and profilers still see the kernels.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from conftest import requires_gpu
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from solforge.kernels import launch as L

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# The key


def _spec(a: Any) -> Any:
    """Triton 3.6's own specialization of one argument (what its kernel cache keys on)."""
    from triton._C.libtriton import native_specialize_impl

    return native_specialize_impl(BaseBackend, a, False, True, True)


def _values() -> list[Any]:
    ints = [0, 1, 2, 3, 15, 16, 17, 32, 48, 2**31 - 1, 2**31, 2**31 + 16, 2**32, 2**63 - 1, 2**63, -1, -16, -17]
    floats = [0.0, 1.0, -2.5, 1e-6, 1e300]
    tensors = []
    for dt in (torch.float32, torch.bfloat16, torch.int64):
        base = torch.zeros(64, dtype=dt)
        tensors += [base[i:] for i in range(0, 9)]
    return ints + floats + [True, False, None] + tensors


def test_key_never_merges_what_triton_specializes_apart() -> None:
    vals = _values()
    keys = [L.arg_key([v]) for v in vals]
    specs = [_spec(v) for v in vals]
    for i in range(len(vals)):
        for j in range(len(vals)):
            if keys[i] == keys[j]:
                assert specs[i] == specs[j], (vals[i], vals[j])
    # and it is not so strict that it never hits: same dtype and alignment, same value, any float
    base = torch.zeros(64)
    assert L.arg_key([base]) == L.arg_key([base[4:]])  # 16 bytes further: still aligned
    assert L.arg_key([1.5, 17]) == L.arg_key([3.25, 17])


def test_key_parts() -> None:
    x = torch.zeros(64)
    assert L.arg_key([x]) != L.arg_key([x[1:]])  # 4 bytes off: not 16-byte aligned
    assert L.arg_key([x]) != L.arg_key([x.to(torch.bfloat16)])
    assert L.arg_key([1]) != L.arg_key([2])  # Triton: 1 is a constexpr
    assert L.arg_key([16]) != L.arg_key([32])
    assert L.arg_key([True]) != L.arg_key([1]) and L.arg_key([1.0]) != L.arg_key([1])
    assert L.arg_key([None]) != L.arg_key([0])
    assert L.arg_key([x, 3, 0.5, None]) == L.arg_key([x, 3, 0.25, None])
    k = object()
    base = L.launch_key(k, (4,), [x, 7], {"A": True, "num_warps": 4}, 0)
    assert base == L.launch_key(k, (4,), [x, 7], {"A": True, "num_warps": 4}, 0)
    assert base != L.launch_key(k, (4,), [x, 7], {"A": 1, "num_warps": 4}, 0)  # True == 1 in Python
    assert base != L.launch_key(k, (4,), [x, 7], {"A": True, "num_warps": 8}, 0)
    assert base != L.launch_key(k, (5,), [x, 7], {"A": True, "num_warps": 4}, 0)
    assert base != L.launch_key(k, (4,), [x, 7], {"A": True, "num_warps": 4}, 1)  # another device
    assert base != L.launch_key(object(), (4,), [x, 7], {"A": True, "num_warps": 4}, 0)
    with pytest.raises(L._Uncacheable):
        L.arg_key([(1, 2)])  # tuples specialize per element: not keyed


def test_meta_is_frozen_and_keys_like_a_dict() -> None:
    m = L.Meta(A=True, B=64, num_warps=4)
    k = object()
    assert L.launch_key(k, (1,), [3], m, 0) == L.launch_key(k, (1,), [3], dict(m), 0)
    assert L.launch_key(k, (1,), [3], m, 0) != L.launch_key(k, (1,), [3], L.Meta(A=1, B=64, num_warps=4), 0)
    for mutate in (lambda: m.__setitem__("A", False), lambda: m.update(A=False), lambda: m.pop("A"),
                   lambda: m.clear(), lambda: m.setdefault("C", 1)):
        with pytest.raises(TypeError):
            mutate()
    m2 = m | {"C": "x"}
    assert type(m2) is L.Meta and m2 == {"A": True, "B": 64, "num_warps": 4, "C": "x"} and "C" not in m
    assert m2.key == L._kwargs_key(dict(m2))
    assert (lambda **kw: kw)(**m) == {"A": True, "B": 64, "num_warps": 4}


# ----------------------------------------------------------------------------------------------
# The direct path, with a stand-in for Triton's launch and its CompiledKernel


def _body(x_ptr, y_ptr, n, eps, BLOCK: tl.constexpr, FLAG: tl.constexpr, MODE: tl.constexpr = "dflt"):  # noqa: N803
    pass


class _Compiled:
    def __init__(self) -> None:
        self.function, self.packed_metadata = 1234, (4, 1, 0)
        self.runs: list[tuple[Any, ...]] = []

    def run(self, *a: Any) -> None:
        self.runs.append(a)


class _Kernel:
    """Triton's launch recorded; the parameters are those of a real JITFunction."""

    def __init__(self) -> None:
        self.params = JITFunction(_body).params
        self.compiled = _Compiled()
        self.launches: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def go(*args: Any, **kw: Any) -> _Compiled:
            self.launches.append((grid, args, kw))
            return self.compiled
        return go


@pytest.fixture
def direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct path on as on a GPU, with a fake device and stream."""
    monkeypatch.setattr(L, "_ON", True)
    monkeypatch.setattr(L, "_get_device", lambda: 0)
    monkeypatch.setattr(L, "_get_stream", lambda dev: 99)
    L.clear()
    yield
    L.clear()


def test_direct_path_argument_list(direct: None) -> None:
    k = _Kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    meta = {"BLOCK": 64, "FLAG": True, "num_warps": 2}
    L.launch(k, (3,), (x, y, 50, 1e-5), meta)
    assert len(k.launches) == 1 and L.cache_size() == 1
    slow = L.slow_launches()
    L.launch(k, (3,), (x, y, 50, 2e-5), meta)  # a different float: same kernel
    assert len(k.launches) == 1 and L.slow_launches() == slow
    # Triton 3.6's JITFunction.run: grid x3, stream, function, metadata, launch metadata and hooks
    # (none), then every parameter: the args, the constexprs in signature order, then defaults.
    assert k.compiled.runs == [(3, 1, 1, 99, 1234, (4, 1, 0), None, None, None, x, y, 50, 2e-5, 64, True, "dflt")]
    L.launch(k, (3, 2), (x, y, 50, 1e-5), {**meta, "MODE": "m"})
    assert len(k.launches) == 2
    L.launch(k, (3, 2), (x, y, 50, 1e-5), {**meta, "MODE": "m"})
    assert k.compiled.runs[-1][:3] == (3, 2, 1) and k.compiled.runs[-1][-1] == "m"


class CudaLauncher:
    """A stand-in for Triton 3.6's launcher (the type `launch._runner` recognizes by name): its
    `__call__` would allocate scratch memory and call `launch`, the generated C launcher."""

    def __init__(self, scratch: int) -> None:
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.calls: list[tuple[Any, ...]] = []
        self.c_calls: list[tuple[Any, ...]] = []
        self.launch = lambda *a: self.c_calls.append(a)

    def __call__(self, *a: Any) -> None:
        self.calls.append(a)


@pytest.mark.parametrize("scratch", [0, 128])
def test_a_hit_calls_the_c_launcher_when_there_is_no_scratch_to_allocate(direct: None, scratch: int) -> None:
    k = _Kernel()
    launcher = CudaLauncher(scratch)
    k.compiled.run = launcher  # type: ignore[assignment,method-assign]
    x, y = torch.zeros(64), torch.zeros(64)
    meta = {"BLOCK": 64, "FLAG": True, "num_warps": 2}
    L.launch(k, (3,), (x, y, 50, 1e-5), meta)  # through Triton: fills the cache
    L.launch(k, (3,), (x, y, 50, 2e-5), meta)
    params = (x, y, 50, 2e-5, 64, True, "dflt")
    if scratch:  # Triton's __call__, which allocates it
        assert launcher.calls == [(3, 1, 1, 99, 1234, (4, 1, 0), None, None, None, *params)]
        assert launcher.c_calls == []
    else:  # the C launcher: cooperative grid, PDL, no scratch buffers, then as __call__ passes them on
        assert launcher.calls == []
        assert launcher.c_calls == [(3, 1, 1, 99, 1234, False, True, None, None, (4, 1, 0), None, None, None, *params)]


def test_direct_path_misses(direct: None, monkeypatch: pytest.MonkeyPatch) -> None:
    k = _Kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    meta = {"BLOCK": 64, "FLAG": True}

    def n_triton(*args: Any, m: dict[str, Any] = meta) -> int:
        L.launch(k, (3,), args, m)
        return len(k.launches)

    assert n_triton(x, y, 50, 0.1) == 1
    assert n_triton(x[1:], y, 50, 0.1) == 2  # misaligned: another specialization, through Triton
    assert n_triton(x[1:], y, 50, 0.1) == 2
    assert n_triton(x, y, 1, 0.1) == 3  # n == 1: another specialization
    assert n_triton(x, y, 50, 0.1, m={**meta, "FLAG": 1}) == 4  # same value, another type
    assert n_triton(x, y, (1, 2), 0.1) == 5 and n_triton(x, y, (1, 2), 0.1) == 6  # not keyed: Triton always
    assert n_triton(x, y, 50, 0.1, m={**meta, "FLAG": torch.ones(1)}) == 7  # a tensor among the kwargs
    assert n_triton(x, y, 50, 0.1, m={**meta, "FLAG": torch.ones(1)}) == 8
    hook_calls: list[Any] = []
    triton.knobs.runtime.launch_enter_hook.add(hook_calls.append)
    try:  # a profiler's hook: every launch through Triton, which calls it
        assert n_triton(x, y, 50, 0.1) == 9 and n_triton(x, y, 50, 0.1) == 10
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook_calls.append)
    assert n_triton(x, y, 50, 0.1) == 10
    prev = L.set_enabled(False)
    try:
        assert n_triton(x, y, 50, 0.1) == 11
    finally:
        L.set_enabled(prev)
        monkeypatch.setattr(L, "_ON", True)
    monkeypatch.setattr(L, "MAX_ENTRIES", 3)
    for n in range(100, 110):
        n_triton(x, y, n, 0.1)
        assert L.cache_size() <= 3


def test_positional_constexpr_float_not_cached(direct: None) -> None:
    k = _Kernel()
    x = torch.zeros(8)
    L.launch(k, (1,), (x, x, 5, 0.5, 64, 0.5), {})  # FLAG (a constexpr) given positionally as a float
    L.launch(k, (1,), (x, x, 5, 0.5, 64, 0.25), {})
    assert len(k.launches) == 2 and L.cache_size() == 0


def test_interpreter_never_takes_the_direct_path() -> None:
    if not triton.knobs.runtime.interpret:
        pytest.skip("the interpreter is off (GPU run)")
    from solforge.kernels import rmsnorm

    assert not L.enabled()
    prev = L.set_enabled(True)
    try:
        assert not L.enabled()  # not supported here: switching on changes nothing
        L.clear()
        x = torch.randn(5, 24)
        y = rmsnorm.rmsnorm(x, None, 1e-6)
        torch.testing.assert_close(y, rmsnorm.rmsnorm_ref(x, None, 1e-6))
        assert L.cache_size() == 0
    finally:
        L.set_enabled(prev)


def test_env_var_switches_it_off() -> None:
    code = "from solforge.kernels import launch as L; print(L._ENABLED)"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SOLFORGE_DIRECT_LAUNCH": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------
# GPU: every family, bitwise against Triton's own path


def _cases() -> Any:
    spec = importlib.util.spec_from_file_location("host_overhead", ROOT / "tools" / "host_overhead.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    # registered before it runs: its dataclasses look their module up in sys.modules
    sys.modules.setdefault("host_overhead", mod)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return sys.modules["host_overhead"]


# odd sizes: rows and columns that are not multiples of any block; offset 1 misaligns (bf16)
_SMALL = dict(hidden=200, inter=300, heads_q=4, heads_kv=2, head_dim=64, vocab=1000, softmax_n=300)
_FAMILIES = ("rmsnorm", "add_rmsnorm", "rope", "swiglu", "gelu", "layernorm", "add_layernorm", "softmax",
             "cross_entropy", "linear_cross_entropy")


def _run(HO: Any, case: Any) -> list[torch.Tensor]:
    """Forward outputs and the gradients of every differentiable input."""
    outs = case.pick(case.op(*case.leaves))
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(o.shape, generator=g, device="cuda").to(o.dtype) for o in outs]
    wrt = [t for t in case.leaves if t.requires_grad]
    return [o.detach().clone() for o in outs] + list(torch.autograd.grad(outs, wrt, grads))


@requires_gpu
@pytest.mark.parametrize("family", _FAMILIES)
def test_gpu_direct_equals_triton(family: str) -> None:
    HO = _cases()
    dims = HO.Dims(**_SMALL)
    prev = L.enabled()
    try:
        for rows, offset in ((37, 0), (53, 1), (37, 1)):
            case = HO.build(family, rows, "cuda", dims, offset=offset, seed=rows)
            L.set_enabled(False)
            ref = _run(HO, case)
            L.set_enabled(True)
            _run(HO, case)  # fills the cache where this specialization is new
            assert L.cache_size() > 0
            slow = L.slow_launches()
            got = _run(HO, case)
            assert L.slow_launches() == slow, "a repeated call went through Triton"
            for r, o in zip(ref, got, strict=True):
                assert torch.equal(r, o), (family, rows, offset)
    finally:
        L.set_enabled(prev)


@requires_gpu
def test_gpu_profilers_see_direct_launches() -> None:
    from torch.profiler import ProfilerActivity, profile

    HO = _cases()
    case = HO.build("rmsnorm", 37, "cuda", HO.Dims(**_SMALL))
    prev = L.set_enabled(True)
    try:
        with torch.no_grad():
            case.op(*case.leaves)  # compiled and cached
            slow = L.slow_launches()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    case.op(*case.leaves)
                torch.cuda.synchronize()
            # torch.profiler (CUPTI) records kernels however they were launched; it installs no
            # Triton launch hook, so the direct path ran (were one installed, Triton's would run)
            names = [e.name for e in prof.events() if "rmsnorm" in e.name]
            assert len([n for n in names if "kernel" in n]) >= 3, names
            print(f"direct launches under torch.profiler: {3 - (L.slow_launches() - slow)} of 3")
            slow = L.slow_launches()
            # launch hooks (proton and other Triton-level profilers): Triton's path, hook called
            seen: list[Any] = []
            triton.knobs.runtime.launch_enter_hook.add(seen.append)
            try:
                case.op(*case.leaves)
                case.op(*case.leaves)
            finally:
                triton.knobs.runtime.launch_enter_hook.remove(seen.append)
            assert len(seen) == 2 and L.slow_launches() == slow + 2
    finally:
        L.set_enabled(prev)


@requires_gpu
def test_gpu_a_bound_launch_equals_the_whole_path_and_checks_alignment() -> None:
    """rmsnorm's graph-node site binds its launch on the GPU (launch.bind): its later calls launch
    through the bound runner, with the whole path's values; a misaligned x (a view one element in)
    is another layout, and a bound call given a misaligned tensor goes through `launch`."""
    from solforge.kernels import rmsnorm as R

    prev = L.enabled()
    L.set_enabled(True)
    try:
        site = R._Site()
        w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
        site(x, w, 1e-6, torch.bfloat16, True, "")
        assert site.sig is not None and isinstance(site.sig[14], L.Bound)
        for seed in range(3):
            torch.manual_seed(seed)
            x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
            slow = L.slow_launches()
            y = site(x, w, 1e-6, torch.bfloat16, True, "")
            assert L.slow_launches() == slow
            assert torch.equal(y, R.rmsnorm(x, w, 1e-6, round_before_weight=True))
        bound = site.sig[14]
        wide = torch.randn(8 * 256 + 1, device="cuda", dtype=torch.bfloat16)
        odd = wide[1:].view(8, 256)  # 2 bytes past an aligned address
        y = torch.empty_like(odd)
        slow = L.slow_launches()
        bound(odd, w, y, *site.sig[15])  # a caller breaking alignment: through launch, as Triton would
        assert L.slow_launches() == slow + 1
        assert torch.equal(y, R.rmsnorm(odd, w, 1e-6, round_before_weight=True))
    finally:
        L.set_enabled(prev)
