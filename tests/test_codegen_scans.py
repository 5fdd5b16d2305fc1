"""Scans in generated regions (cumsum, cumprod; KernelBench level 1 problems 89-93): one region per
problem form, its kernels against the fp64 reference (and the reference against the graph's own
values) on odd shapes, fp32 and bf16; the looped schedule's carry over rows longer than a chunk,
forward and reversed; every valid schedule of one region; views after a scan that cannot be
written as a scan cut the region; training through a region with a scan."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from codegen_helpers import check_region, form_and_check, ops, trace, values

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
    """Uniform in [0, 1) as KernelBench draws them: a long cumsum of them grows, never cancels, so
    fp32's element tolerance against fp64 holds for eager and kernel alike."""
    torch.manual_seed(seed)
    return torch.rand(*shape).to(dtype)


def _near_one(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Factors around 1, of both signs of log: a long cumprod neither vanishes nor overflows."""
    torch.manual_seed(seed)
    return (1.0 + 0.05 * torch.randn(*shape)).to(dtype)


def _launching(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's ops that move data (views and getitems are index arithmetic)."""
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


# KernelBench level 1, problems 89-93 (dim 1)
def kb89(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, dim=1)


def kb90(x: torch.Tensor) -> torch.Tensor:
    return torch.cumprod(x, dim=1)


def kb91(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x.flip(1), 1).flip(1)


def kb92(x: torch.Tensor) -> torch.Tensor:
    cumsum = torch.cumsum(x.narrow(dim=1, start=0, length=x.size(1) - 1), dim=1)
    return torch.cat((torch.zeros_like(x.select(1, 0).unsqueeze(1)), cumsum), dim=1)


def kb93(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x * mask, dim=1)


KB: dict[str, Callable[..., Any]] = {"89_cumsum": kb89, "90_cumprod": kb90, "91_cumsum_reverse": kb91,
                                     "92_cumsum_exclusive": kb92, "93_masked_cumsum": kb93}


def _kb_inputs(name: str, rows: int, cols: int) -> list[torch.Tensor]:
    x = _near_one(rows, cols) if name == "90_cumprod" else _rand(rows, cols)
    if name == "93_masked_cumsum":
        torch.manual_seed(1)
        return [x, torch.randint(0, 2, x.shape).bool()]
    return [x]


@pytest.mark.parametrize("shape", [(5, 37), (3, 1030)], ids=["5x37", "3x1030"])
@pytest.mark.parametrize("name", list(KB))
def test_kernelbench_scan_problems_are_one_kernel(name: str, shape: tuple[int, int]) -> None:
    xs = _kb_inputs(name, *shape)
    r = _one_kernel(KB[name], *xs)
    assert r.lowered.scans and r.record.space.reduced == (1,)
    assert r.lowered.scan_reverse == (name == "91_cumsum_reverse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [2, 1], ids=["last", "middle"])
@pytest.mark.parametrize("fn", ["cumsum", "cumprod"])
def test_scan_along_last_and_middle_dim(fn: str, dim: int, dtype: torch.dtype) -> None:
    """Pointwise ops before and after fuse in; a middle dim's rows are strided in memory."""
    def f(x: torch.Tensor) -> torch.Tensor:
        y = getattr(torch, fn)(x * 0.5 + 0.5 if fn == "cumsum" else x, dim)
        return torch.sigmoid(y) + y

    x = (_rand if fn == "cumsum" else _near_one)(3, 37, 5, dtype=dtype)
    (r,) = form_and_check(f, x)
    assert fn in ops(r) and "sigmoid" in ops(r)
    assert r.record.space.shape == (3, 37, 5) and r.record.space.reduced == (dim,)


@pytest.mark.parametrize("name", ["89_cumsum", "90_cumprod", "91_cumsum_reverse", "92_cumsum_exclusive"])
def test_looped_carry_over_rows_longer_than_a_chunk(name: str) -> None:
    """3 x 1500 in 256-wide chunks (the last one a tail): the carry between chunks, forward and
    reversed; one row per program and two (a program's second row past the end)."""
    xs = _kb_inputs(name, 3, 1500)
    (r,) = RG.form_regions(trace(KB[name], *xs).graph)
    low = r.lowered
    ref = REF.reference(low.ir, xs)[0]
    for s in (SC.Schedule("looped", 256, 1, 4, 1), SC.Schedule("looped", 256, 2, 4, 1),
              SC.Schedule("rows", 2048, 2, 8, 1)):
        assert SC.is_valid(s, low), s
        (got,) = RT.run(low, s, xs)
        c = compare(got, ref)
        assert c.ok, f"{s.encode()}: {c.reason}"
    assert compare(got, KB[name](*xs)).ok


def test_scans_beside_reductions() -> None:
    """A cumsum of a softmax (top-p sampling's: two reduction stages, then the scan in the pass
    that stores) and a row sum of a cumprod (a reduction reading the scan): one region each, the
    scan recomputed with its own carry in every looped pass that reads it."""
    def top_p(x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(torch.softmax(x, -1), -1)

    def total(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cumprod(x, 1)
        return y, y.sum(1)

    for f, x, stages in ((top_p, _rand(3, 700) * 4, 2), (total, _near_one(3, 700), 1)):
        (r,) = form_and_check(f, x)
        low = r.lowered
        assert low.scans and low.space.stages == stages and low.space.reduced == (1,)
        ref = REF.reference(low.ir, [x])
        for s in (SC.Schedule("looped", 128, 2, 2, 1), SC.Schedule("rows", 1024, 1, 4, 1)):
            for k, (got, want) in enumerate(zip(RT.run(low, s, [x]), ref, strict=True)):
                c = compare(got, want)
                assert c.ok, f"{f.__name__} {s.encode()} output {k}: {c.reason}"


def test_every_schedule_of_a_reversed_scan() -> None:
    """The heuristic and the whole space (rows and looped only) of the reversed cumsum, at an odd
    middle dim of a 3-D tensor."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x.flip(1), 1).flip(1) * 2.0

    x = _rand(2, 150, 3)
    (r,) = RG.form_regions(trace(f, x).graph)
    low = r.lowered
    space = SC.space(low)
    assert {c.variant for c in space} == {"rows", "looped"}
    ref = REF.reference(low.ir, [x])[0]
    for s in [SC.heuristic(low), *space]:
        (got,) = RT.run(low, s, [x])
        c = compare(got, ref)
        assert c.ok, f"{s.encode()}: {c.reason}"


def test_no_split_or_tiles_for_scans() -> None:
    """A split row or a tile of neighbouring rows would need the carry across programs or lanes:
    invalid, and the heuristic keeps to rows/looped where it would pick them for a reduction."""
    few_long = RG.form_regions(trace(kb89, _rand(2, 20000)).graph)[0].lowered
    assert SC.heuristic(few_long).variant == "looped"
    assert not SC.is_valid(SC.Schedule("split", 2048, 1, 8, 1, 1, 4), few_long)
    middle = RG.form_regions(trace(lambda x: torch.cumsum(x, 1), _rand(4, 64, 33)).graph)[0].lowered
    assert SC.heuristic(middle).variant == "rows"
    assert not SC.is_valid(SC.Schedule("tiles", 32, 1, 4, 2, 64), middle)
    assert all(c.variant in ("rows", "looped") for c in SC.space(middle))


def test_views_a_scan_cannot_absorb_cut_the_region() -> None:
    """A slice that drops the scan's first element, a roll, and both directions in one sum read
    the scan at other points of its row than the loop's: the region is cut there, each part checked."""
    def shifted(x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, 1)[:, 1:] * 2.0

    def rolled(x: torch.Tensor) -> torch.Tensor:
        return torch.roll(torch.cumprod(x, 1), 1, 1) + 1.0

    def both_ways(x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, 1) + torch.cumsum(x.flip(1), 1).flip(1)

    for f in (shifted, rolled, both_ways):
        regions = form_and_check(f, _near_one(5, 37))
        assert len(regions) >= 2, (f.__name__, RG.describe(regions))
        for r in regions:
            assert r.lowered.analysis.ok


def test_integer_and_bool_scans_are_left_out() -> None:
    def f(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return x * torch.cumsum(m, 1) + 1.0

    torch.manual_seed(0)
    regions = form_and_check(f, _rand(5, 37), torch.randint(0, 2, (5, 37)).bool())
    assert all("cumsum" not in ops(r) for r in regions)


# training: name -> (function, inputs)
TRAIN: dict[str, tuple[Callable[..., Any], Callable[[torch.dtype], list[torch.Tensor]]]] = {
    "cumsum_reverse": (lambda x, w: torch.cumsum(x.flip(1) * w, 1).flip(1),
                       lambda d: [_rand(5, 37, dtype=d), _rand(37, seed=1, dtype=d)]),
    "cumprod": (lambda x, w: torch.cumprod(x * w, 1),
                lambda d: [_near_one(5, 37, dtype=d), _near_one(37, seed=1, dtype=d)]),
}


@pytest.mark.parametrize(("case", "dtype"), [("cumsum_reverse", torch.float32), ("cumsum_reverse", torch.bfloat16),
                                           ("cumprod", torch.float32)])
def test_training_through_a_region_with_a_scan(case: str, dtype: torch.dtype) -> None:
    """The op's backward, generated (cumsum's vjp: a reversed cumsum, itself one region) or the
    eager vjp where the vjp forms no regions (cumprod's), gives fp64 autograd's gradients."""
    f, make = TRAIN[case]
    xs = make(dtype)
    (fr,) = RG.form_regions(trace(f, *xs).graph)
    ir = fr.lowered.ir
    key = G.workload_for(ir).param("key")
    need = (True, True)
    p = BW.plan(key, need, (True,))
    if case == "cumsum_reverse":
        assert p.ok, p.error
    leaves = [x.clone().requires_grad_() for x in xs]
    (out,) = G.generated_op(leaves, key, "")
    torch.manual_seed(5)
    dy = torch.randn(out.shape).to(dtype)
    out.backward(dy)
    want = BW.fp64_vjp(ir, need, (True,), xs, [dy])
    for i, (x, w) in enumerate(zip(leaves, want, strict=True)):
        assert x.grad is not None and x.grad.dtype == dtype and w is not None
        c = compare(x.grad, w)
        assert c.ok, f"{case} grad {i}: {c.reason}"


class _ReverseCumsum(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kb91(x)


class _WeightedCumprod(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(1.0 + 0.05 * torch.randn(111))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(1.0 + 0.05 * x * self.w, 1).sin().sum()


@pytest.mark.parametrize(("model", "mode"), [(_ReverseCumsum, "inference"), (_WeightedCumprod, "train")],
                         ids=["reverse_cumsum", "cumprod_train"])
def test_optimize_swaps_in_the_scan_region(model: type[torch.nn.Module], mode: str) -> None:
    """optimize: the region with the scan becomes one tuned, verified generated kernel in the model,
    and the model's outputs (train: every gradient too) match eager's."""
    from solforge import optimize

    net = model()
    torch.manual_seed(3)
    x = torch.randn(13, 111).requires_grad_(mode == "train")  # past the generated family's byte floor

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(seed)
        return (torch.randn(13, 111).requires_grad_(mode == "train"),)

    opt, report = optimize(net, (x,), mode=mode, budget=1, max_candidates=1, db=False, profile="off",
                           families=("generated",), keep_slower=True, make_inputs=make)
    assert report.e2e is not None and report.e2e.passed, (report.e2e, report.notes)
    stats = opt.solforge_stats  # type: ignore[attr-defined]
    swapped = {k: n for k, n in {**stats.replaced, **stats.untuned, **stats.stored}.items()
               if k.startswith("generated[")}
    # train: the scan's region and the sin-sum after it (a region of its own: a scan ends a region),
    # whose backward takes a 0-dim gradient (verified since the verifier's odd rows handle it)
    assert sum(swapped.values()) == (2 if mode == "train" else 1), (stats, report.notes)
    if mode == "train":
        assert report.e2e.grads_compared == 1, report.e2e  # w's (through the eager vjp of the region)
    (fresh,) = make(7)
    with torch.no_grad():
        c = compare(opt(fresh), net(fresh))
    assert c.ok, c.reason
