"""Index-returning reductions in generated regions (argmax, argmin, max.dim, min.dim; KernelBench
level 1 problems 51-53): one region per problem form, its kernels against the fp64 reference (and
the reference against the graph's own values) with the indices compared exactly; every schedule
kind that applies (a whole row per program, several rows, looped chunks with a running (value,
index) pair, tiles over a non-contiguous dim, one pass and looped) on ties and NaN, where torch
takes the first index of the max and counts NaN as the max (and the min); dims 0/1/2 of a 3-D
tensor, non-contiguous inputs, the flattened tensor (dim None); pointwise ops after the index; no
split schedules; training through max.dim (its vjp scatters: the eager vjp)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from codegen_helpers import check_region, form_and_check, ops, trace, values
from conftest import DEVICE, alternating

from solforge.capture import op_name
from solforge.codegen import backward as BW
from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.kernels import generated as G
from solforge.numerics import compare

pytestmark = pytest.mark.usefixtures("on_device")


@pytest.fixture(autouse=True)
def _private_codegen_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SOLFORGE_CODEGEN_DIR", str(tmp_path / "codegen"))


def _rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.rand(*shape).to(dtype)


def _ties(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Few distinct values (0..3): every row's max and min occur several times, at indices
    spread over the row (in different chunks and lanes of a looped or tiled schedule)."""
    torch.manual_seed(seed)
    return torch.randint(0, 4, shape).to(dtype)


def _specials(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with rows (along dim) holding NaN (one, two, first and last), all -inf, all +inf, +inf
    and -inf beside numbers: torch's argmax/argmin give the first NaN, else the first max/min."""
    x = x.clone().movedim(dim, -1)
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[-1]
    flat[0, n // 2] = float("nan")
    flat[1, 1], flat[1, n - 1] = float("nan"), float("nan")
    flat[2, 0] = float("nan")
    flat[3, :] = float("-inf")
    flat[4, :] = float("inf")
    flat[5, n // 3], flat[5, n - 2] = float("inf"), float("-inf")
    flat[6, n - 1] = float("nan")
    return flat.reshape(x.shape).movedim(-1, dim)


def _launching(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and not RG._is_view(n)]


def _one_kernel(fn: Callable[..., Any], *xs: torch.Tensor) -> RG.Formed:
    """fn's graph as one region holding every op that moves data, checked against the reference."""
    gm = trace(fn, *xs)
    regions = RG.form_regions(gm.graph)
    assert len(regions) == 1, RG.describe(regions)
    (r,) = regions
    assert set(_launching(gm)) <= set(r.nodes), [op_name(n.target) for n in _launching(gm) if n not in r.nodes]
    check_region(r, values(gm, *xs))
    return r


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Exactly equal, NaN where the other is NaN (indices: equal; values: the max is an element)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.is_floating_point():
        assert torch.equal(got.isnan(), want.isnan()), what
        got, want = got.nan_to_num(0.0), want.nan_to_num(0.0)
    assert torch.equal(got, want), f"{what}: {(got != want).sum()} of {got.numel()} differ"


# KernelBench level 1, problems 51-53 (dim 1 of (128, 4096, 4095); small odd shapes here)
def kb51(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=1)


def kb52(x: torch.Tensor) -> torch.Tensor:
    return torch.argmin(x, dim=1)


def kb53(x: torch.Tensor) -> torch.Tensor:
    return torch.min(x, dim=1)[0]


KB: dict[str, Callable[..., Any]] = {"51_argmax": kb51, "52_argmin": kb52, "53_min_reduction": kb53}


@pytest.mark.parametrize("shape", [(3, 37, 33), (2, 300, 5)], ids=["3x37x33", "2x300x5"])
@pytest.mark.parametrize("name", list(KB))
def test_kernelbench_arg_problems_are_one_kernel(name: str, shape: tuple[int, int, int]) -> None:
    """The reduction over the middle dim is strided in memory: the heuristic picks tiles along the last."""
    r = _one_kernel(KB[name], _rand(*shape))
    assert r.record.space.reduced == (1,) and r.lowered.arg_reduces
    assert SC.heuristic(r.lowered).variant == "tiles"


# every op at every dim; off the GPU each case in one dtype, the two alternating (FULL_SWEEPS: both)
_ARG_CASES = [(op, dim, dt) for i, (op, dim) in enumerate((o, d) for o in ("argmax", "argmin", "max", "min")
                                                          for d in (0, 1, 2))
              for dt in alternating([torch.float32, torch.bfloat16], i, keep=0)]


@pytest.mark.parametrize("op,dim,dtype", _ARG_CASES,
                         ids=[f"{o}-{d}-{'fp32' if t == torch.float32 else 'bf16'}" for o, d, t in _ARG_CASES])
def test_each_dim_of_a_3d_tensor(op: str, dim: int, dtype: torch.dtype) -> None:
    """Values and indices (max.dim: both outputs, keepdim), ties and NaN/inf rows, each dim."""
    def f(x: torch.Tensor) -> Any:
        if op in ("argmax", "argmin"):
            return getattr(torch, op)(x, dim)
        v, i = getattr(torch, op)(x, dim, keepdim=True)
        return v, i

    x = _specials(_ties(7, 9, 11, dtype=dtype), dim)
    (r,) = form_and_check(f, x)
    assert r.record.space.reduced == (dim,)
    low = r.lowered
    want = f(x)
    want = want if isinstance(want, tuple) else (want,)
    for s in [SC.heuristic(low), *SC.space(low)[:: max(1, len(SC.space(low)) // 3)]]:
        for k, (got, w) in enumerate(zip(RT.run(low, s, [x]), want, strict=True)):
            _same(got, w, f"{op} dim {dim} {s.encode()} output {k}")


# explicit schedules of a (5, 1500) row reduction: one whole row per program, several rows (a
# program's last rows past the end), looped chunks (the last one a tail) of one and two rows
_ROW_SCHEDULES = [SC.Schedule("rows", 2048, 1, 8, 1), SC.Schedule("rows", 2048, 4, 8, 1),
                  SC.Schedule("looped", 256, 1, 4, 1), SC.Schedule("looped", 128, 2, 4, 1)]


@pytest.mark.parametrize("op", ["argmax", "argmin", "max", "min"])
def test_row_schedules_ties_and_nan(op: str) -> None:
    """Ties spread over chunks: the running pair keeps the first index; a NaN in a later chunk
    than the max (or an earlier one) still wins; two NaN: the first."""
    def f(x: torch.Tensor) -> Any:
        return getattr(torch, op)(x, 1)

    x = _specials(_ties(9, 1500), 1)
    (r,) = RG.form_regions(trace(f, x).graph)
    low = r.lowered
    want = f(x)
    want = tuple(want) if not isinstance(want, torch.Tensor) else (want,)
    ref = REF.reference(low.ir, [x])
    for w, rf in zip(want, ref, strict=True):
        _same(rf, w, f"{op} reference")
    for s in _ROW_SCHEDULES:
        assert SC.is_valid(s, low), s
        for k, (got, w) in enumerate(zip(RT.run(low, s, [x]), want, strict=True)):
            _same(got, w, f"{op} {s.encode()} output {k}")


@pytest.mark.parametrize("op", ["argmax", "min"])
def test_tile_schedules_over_a_strided_dim(op: str) -> None:
    """A reduction over dim 1 of (3, 150, 37): tiles along dim 2, one pass (rblock >= 150) and
    looped (rblock 32: five chunks, the last a tail), rows not a multiple of the block."""
    def f(x: torch.Tensor) -> Any:
        return getattr(torch, op)(x, 1)

    x = _specials(_ties(3, 150, 37), 1)
    (r,) = RG.form_regions(trace(f, x).graph)
    low = r.lowered
    want = f(x)
    want = tuple(want) if not isinstance(want, torch.Tensor) else (want,)
    for s in (SC.Schedule("tiles", 16, 1, 4, 2, 256), SC.Schedule("tiles", 32, 1, 4, 2, 32),
              SC.Schedule("tiles", 64, 1, 2, 2, 16)):
        assert SC.is_valid(s, low), s
        for k, (got, w) in enumerate(zip(RT.run(low, s, [x]), want, strict=True)):
            _same(got, w, f"{op} {s.encode()} output {k}")


def test_non_contiguous_inputs() -> None:
    """A transposed input and a strided slice, read through their strides (no copy), and the
    reduction over a permuted view inside the region."""
    base = _ties(37, 5, seed=1)
    xt = base.t()  # (5, 37), strides (1, 5)
    assert not xt.is_contiguous()
    gm = trace(lambda x: torch.argmax(x, 1), xt)
    assert RG.form_regions(gm.graph)[0].lowered.ir.inputs[0].stride == (1, 5)
    for fn, x in ((lambda x: torch.argmax(x, 1), xt),
                  (lambda x: torch.argmin(x, -1), _ties(6, 80, seed=2)[:, ::2]),
                  (lambda x: torch.max(x.permute(2, 0, 1), 2), _specials(_ties(4, 33, 6, seed=3), 1))):
        (r,) = form_and_check(fn, x)
        want = fn(x)
        want = tuple(want) if not isinstance(want, torch.Tensor) else (want,)
        for got, w in zip(RT.run(r.lowered, SC.heuristic(r.lowered), [x]), want, strict=True):
            _same(got, w, "non-contiguous")


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("shape", [(7, 13, 5), (3000,)], ids=["7x13x5", "3000"])
def test_flattened_tensor(shape: tuple[int, ...], keepdim: bool) -> None:
    """dim None: the index into the flattened tensor; one row over every dim (looped past a chunk)."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x, keepdim=keepdim)

    n = _ties(*shape).numel()
    nan2 = _ties(*shape, seed=4).reshape(-1)
    nan2[n - 3], nan2[n // 2] = float("nan"), float("nan")
    for x in (_ties(*shape), nan2.reshape(shape), torch.full(shape, float("-inf"))):
        (r,) = form_and_check(f, x)
        assert r.record.space.rows == 1
        for s in (SC.heuristic(r.lowered), SC.Schedule("looped", 128, 1, 4, len(shape) - 1)):
            (got,) = RT.run(r.lowered, s, [x])
            _same(got, f(x), f"dim None {s.encode()}")


def test_pointwise_ops_around_the_index() -> None:
    """Ops before the reduction (a bf16 value computed in the region, rounded as the graph rounds
    it before comparing) and after it (a cast, a comparison, arithmetic on the index and the
    value): one region, the same indices as the graph."""
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = x * w + 1.0
        v, i = torch.max(y, -1)
        am = torch.argmin(y, -1)
        return (i == am), i.float() * 0.5 + v, (am + 1).to(torch.int32)

    for dtype in (torch.float32, torch.bfloat16):
        x, w = _ties(6, 45, dtype=dtype), _ties(45, seed=1, dtype=dtype)
        (r,) = form_and_check(f, x, w)
        assert {"aten.max.dim", "aten.argmin.default", "aten.eq.Tensor", "aten.add.Tensor"} <= \
            {op_name(n.target) for n in r.nodes}
        for got, want in zip(RT.run(r.lowered, SC.heuristic(r.lowered), [x, w]), f(x, w), strict=True):
            _same(got, want, f"{dtype}")


def test_bf16_operand_computed_in_the_region_ties_as_the_graph() -> None:
    """argmax of x * w in bf16: the graph rounds the product to bf16 before comparing, which ties
    values that differ in fp32 (on these rows the fp32 argmax differs from the graph's): the kernel
    rounds it too, and so does the reference, so the indices are the graph's exactly."""
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x * w, 1)

    g = torch.Generator().manual_seed(0)  # drawn on the host: the same values on any device
    x = torch.rand(8, 1000, generator=g, device="cpu").bfloat16().to(DEVICE)
    w = (torch.rand(1000, generator=g, device="cpu") * 0.5 + 0.75).bfloat16().to(DEVICE)
    assert not torch.equal(f(x, w), f(x.float(), w.float()))  # the case is one where rounding matters
    (r,) = form_and_check(f, x, w)
    for s in (SC.heuristic(r.lowered), SC.Schedule("looped", 128, 2, 4, 1)):
        (got,) = RT.run(r.lowered, s, [x, w])
        _same(got, f(x, w), s.encode())


def test_bf16_rounding_template_is_round_to_nearest_even(tmp_path: Path) -> None:
    """round_bf16 (an arg operand's rounding) gives torch's fp32 -> bf16 bits: halfway cases to
    even both ways, the largest finite values to inf, inf, NaN and subnormals kept."""
    import importlib.util

    from solforge.codegen.triton_gen import PW

    src = tmp_path / "rne.py"
    src.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                   "def k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):\n"
                   "    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
                   "    x = tl.load(x_ptr + i, mask=i < n, other=0.0)\n"
                   f"    tl.store(y_ptr + i, {PW['round_bf16'](['x'], ())}, mask=i < n)\n")
    spec = importlib.util.spec_from_file_location("rne_kernel", src)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3000,), dtype=torch.int64).to(torch.int32)
    half = (torch.randint(0, 2**16, (500,), dtype=torch.int32) << 16) | 0x8000  # exactly halfway
    x = torch.cat([bits.view(torch.float32), half.view(torch.float32), torch.randn(500),
                   torch.tensor([3.3895e38, -3.3895e38, float("inf"), float("-inf"), float("nan"), 1e-40, -0.0])])
    if torch.cuda.is_available():
        x = x.cuda()
    y = torch.empty_like(x)
    mod.k[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16).float()
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y.nan_to_num(0.0), want.nan_to_num(0.0))


def test_no_split_schedules() -> None:
    """Few long rows would split for a sum; an arg reduction keeps each row in one program
    (looped), and split tiles are invalid too."""
    few_long = RG.form_regions(trace(kb51, _rand(2, 20000)).graph)[0].lowered
    assert SC.heuristic(few_long).variant == "looped"
    assert not SC.is_valid(SC.Schedule("split", 2048, 1, 8, 1, 1, 4), few_long)
    assert all(c.splits == 1 for c in SC.space(few_long))
    tall = RG.form_regions(trace(lambda x: torch.argmax(x, 0), _rand(9000, 8)).graph)[0].lowered
    h = SC.heuristic(tall)
    assert h.variant == "tiles" and h.splits == 1
    assert all(c.splits == 1 for c in SC.space(tall))


def test_wide_integer_operands_are_left_out() -> None:
    """int32/int64 values are not exact in fp32 (the kernel's compare type): argmax of them stays
    eager; int16's are exact and fuse."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x + 1, 1)

    torch.manual_seed(0)
    for dtype, fused in ((torch.int64, False), (torch.int16, True)):
        x = torch.randint(-5, 5, (5, 37)).to(dtype)
        regions = form_and_check(f, x)
        assert any("argmax" in ops(r) for r in regions) == fused, (dtype, RG.describe(regions))


def test_integer_outputs_are_verified_exactly() -> None:
    """The verifier's comparison of an index is exact: an index off by one fails."""
    x = _ties(5, 37)
    (r,) = RG.form_regions(trace(kb51, x).graph)
    (ref,) = REF.reference(r.lowered.ir, [x])
    assert compare(ref.clone(), ref).ok
    off = ref.clone()
    off[2] += 1
    assert not compare(off, ref).ok


def test_training_through_max_dim() -> None:
    """max.dim's vjp scatters the gradient into the index (aten.scatter, no lowering): the op's
    backward is the eager vjp of the region's ops, giving fp64 autograd's gradients."""
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.max(x * w, 1)[0] * 2.0

    torch.manual_seed(0)
    xs = [torch.randn(5, 37), torch.randn(37)]
    (fr,) = RG.form_regions(trace(f, *xs).graph)
    ir = fr.lowered.ir
    key = G.workload_for(ir).param("key")
    need = (True, True)
    p = BW.plan(key, need, (True,))
    assert not p.ok and "scatter" in (p.error or "")
    leaves = [x.clone().requires_grad_() for x in xs]
    (out,) = G.generated_op(leaves, key, "")
    dy = torch.randn(out.shape)
    out.backward(dy)
    want = BW.fp64_vjp(ir, need, (True,), xs, [dy])
    for i, (x, w) in enumerate(zip(leaves, want, strict=True)):
        assert x.grad is not None and w is not None
        c = compare(x.grad, w)
        assert c.ok, f"grad {i}: {c.reason}"


class _Argmax(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kb51(x)


class _MinValues(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kb53(x) * 2.0


@pytest.mark.parametrize("model", [_Argmax, _MinValues], ids=["argmax", "min_values"])
def test_optimize_swaps_in_the_arg_region(model: type[torch.nn.Module]) -> None:
    """optimize (inference): the region becomes one tuned generated kernel, verified (its indices
    exactly, strided inputs with NaN padding among the trials), and the model's outputs are eager's."""
    from solforge import optimize

    net = model()

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(seed)
        return (torch.randn(6, 41, 23),)  # past the generated family's byte floor

    (x,) = make(3)
    opt, report = optimize(net, (x,), mode="inference", budget=1, max_candidates=1, db=False, profile="off",
                           families=("generated",), keep_slower=True, make_inputs=make)
    assert report.e2e is not None and report.e2e.passed, (report.e2e, report.notes)
    stats = opt.solforge_stats  # type: ignore[attr-defined]
    swapped = {k: n for k, n in {**stats.replaced, **stats.untuned, **stats.stored}.items()
               if k.startswith("generated[")}
    assert sum(swapped.values()) == 1, (stats, report.notes)
    fresh = _specials(_ties(6, 41, 23, seed=7), 1)
    with torch.no_grad():
        _same(opt(fresh), net(fresh), model.__name__)


class _MaxWithIndex(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(1.0 + 0.1 * torch.randn(23))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v, i = torch.max(x * self.w, 1)
        return torch.sin(v).sum() + (i == 3).float().mean()


def test_optimize_trains_through_a_region_with_indices() -> None:
    """train: the max.dim region (values and a comparison of its indices) is swapped in; its
    backward is the eager vjp (max.dim's scatter); loss and gradients match eager's."""
    from solforge import optimize

    torch.manual_seed(0)
    net = _MaxWithIndex()

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(seed)
        return (torch.randn(6, 41, 23).requires_grad_(),)

    opt, report = optimize(net, make(3), mode="train", budget=1, max_candidates=1, db=False, profile="off",
                           families=("generated",), keep_slower=True, make_inputs=make)
    assert report.e2e is not None and report.e2e.passed and report.e2e.grads_compared >= 1, (report.e2e, report.notes)
    stats = opt.solforge_stats  # type: ignore[attr-defined]
    assert sum(n for k, n in stats.replaced.items() if k.startswith("generated[")) == 1, (stats, report.notes)
