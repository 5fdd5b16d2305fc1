"""rmsnorm family: every kernel variant against rmsnorm_ref, the launcher's checks, the config triad
and the custom op. Without a GPU the kernels run in Triton's interpreter (see conftest.py), so
shapes stay small; the tests marked gpu run the BASELINES.md shapes on a real device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, covering, requires_gpu

from solforge.kernels import rmsnorm as R
from solforge.kernels.rmsnorm import Config, heuristic, is_valid, rmsnorm, rmsnorm_ref, space, workload_for
from solforge.numerics import compare, tolerance
from solforge.records import Workload
from solforge.tune.verify import odd_rows

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6


def _wl(rows: int, H: int, dtype: torch.dtype = BF16, wdtype: torch.dtype | None = BF16,
        out_dtype: torch.dtype | None = None, rbw: bool = False, device: str = DEVICE) -> Workload:
    x = torch.empty(rows, H, dtype=dtype, device="meta")
    w = torch.empty(H, dtype=wdtype, device="meta") if wdtype is not None else None
    return dataclasses.replace(workload_for(x, w, EPS, out_dtype, rbw), device=device)


def _check(wl: Workload, config: Config | None = None, *, seed: int = 0, rows: int | None = None) -> None:
    """Poisoned output, inputs unchanged, numbers within the dtype's tolerance of the reference."""
    (x, w, eps), kw = R.make_inputs(wl, seed=seed, rows=rows)
    before = (x.clone(), None if w is None else w.clone())
    ref = rmsnorm_ref(x, w, eps, **kw)
    out = torch.full_like(ref, float("nan"))
    got = rmsnorm(x, w, eps, config=config, out=out, **kw)
    assert got is out
    assert torch.equal(x, before[0]) and (w is None or torch.equal(w, before[1]))
    c = compare(out, ref, R.output_tolerance(wl))
    assert c.ok, f"{config.encode() if config else 'heuristic'} on {wl.key}: {c.reason}"


# ---------------------------------------------------------------------------------------------
# every variant of the space


@pytest.mark.parametrize("rows,H", [(64, 96), (40, 256), (5, 4160)])
def test_every_config_in_space(rows: int, H: int) -> None:
    wl = _wl(rows, H)
    configs = space(wl)
    variants = {c.variant for c in configs}
    assert variants >= ({"row", "rows", "persist"} if H <= 4096 else {"row", "loop"})
    # the whole space on a GPU (the warps only size the same program's work)
    for c in covering(configs, ignore=("num_warps",)):
        _check(wl, c)


def test_space_is_valid_unique_and_modest() -> None:
    for rows, H in [(1, 2560), (16384, 2560), (1048576, 128), (32768, 4096), (7, 96), (3, 130), (2, 70000)]:
        wl = _wl(rows, H)
        configs = space(wl)
        assert 1 <= len(configs) <= 64, (rows, H, len(configs))
        assert len(set(configs)) == len(configs)
        assert all(is_valid(c, wl) for c in configs)


@pytest.mark.parametrize("stages", [1, 2])
def test_persistent_loop_strides_over_many_tiles(stages: int) -> None:
    # 4 fake SMs x 1 program on the interpreter: 50 tiles of 2 rows -> 13 trips, the last one partial
    wl = _wl(99, 64)
    _check(wl, Config("persist", 64, 0, 2, 1, progs=1, stages=stages))
    _check(wl, Config("persist", 32, 32, 4, 2, progs=2, stages=stages), rows=37)


@pytest.mark.parametrize("H,chunk", [(8192, 2048), (5000, 1024), (4100, 4096)])
def test_loop_variant_even_and_ragged(H: int, chunk: int) -> None:
    _check(_wl(3, H), Config("loop", chunk, 0, 1, 4))


# ---------------------------------------------------------------------------------------------
# shapes, dtypes, options


@pytest.mark.parametrize("rows,H", [(7, 96), (3, 130), (1, 1), (5, 1000), (33, 64), (2, 3), (1, 2560)])
def test_odd_shapes(rows: int, H: int) -> None:
    wl = _wl(rows, H)
    _check(wl)  # heuristic
    for c in space(wl)[:: max(1, len(space(wl)) // 4)]:  # a spread of the space
        _check(wl, c, seed=1)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("rbw", [False, True])
def test_dtypes_weight_and_rounding(dtype: torch.dtype, weight: bool, rbw: bool) -> None:
    wl = _wl(6, 160, dtype, dtype if weight else None, rbw=rbw)
    _check(wl)
    _check(wl, Config("rows", 128, 32, 2, 1))


@pytest.mark.parametrize("dtype,wdtype,out_dtype", [(BF16, FP32, FP32), (FP32, FP32, BF16), (FP16, BF16, FP16),
                                                    (BF16, BF16, FP16)])
@pytest.mark.parametrize("rbw", [False, True])
def test_out_dtype_differs_from_input(dtype: torch.dtype, wdtype: torch.dtype, out_dtype: torch.dtype,
                                      rbw: bool) -> None:
    wl = _wl(5, 96, dtype, wdtype, out_dtype, rbw)
    (x, w, eps), kw = R.make_inputs(wl, seed=3)
    y = rmsnorm(x, w, eps, **kw)
    assert y.dtype == out_dtype
    _check(wl)


def test_output_tolerance() -> None:
    assert R.output_tolerance(_wl(4, 64, BF16, FP32, FP32)) == tolerance(FP32)
    assert R.output_tolerance(_wl(4, 64, BF16, FP32, FP32, rbw=True)) == tolerance(BF16)
    assert R.output_tolerance(_wl(4, 64, FP32, FP32, BF16, rbw=True)) == tolerance(BF16)
    assert R.output_tolerance(_wl(4, 64, FP16, None)) == tolerance(FP16)


def test_round_before_weight_matches_hugging_face_formula() -> None:
    x = torch.randn(4, 64, dtype=BF16, device=DEVICE)
    w = (1 + 0.1 * torch.randn(64, device=DEVICE)).to(BF16)
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(BF16)
    assert compare(rmsnorm(x, w, EPS, round_before_weight=True), hf).ok
    assert compare(rmsnorm_ref(x, w, EPS, round_before_weight=True), hf).ok


def test_strided_and_nd_inputs() -> None:
    w = (1 + 0.1 * torch.randn(96, device=DEVICE)).to(BF16)
    wide = torch.randn(9, 200, dtype=BF16, device=DEVICE)
    x = wide[:, 10:106]  # a 2-D slice of a wider tensor: row stride 200
    assert x.stride() == (200, 1)
    assert compare(rmsnorm(x, w, EPS), rmsnorm_ref(x, w, EPS)).ok
    x3 = torch.randn(2, 5, 300, dtype=BF16, device=DEVICE)[..., 100:196]  # 3-D, mergeable rows
    y3 = rmsnorm(x3, w, EPS)
    assert y3.shape == x3.shape and compare(y3, rmsnorm_ref(x3, w, EPS)).ok
    xt = torch.randn(96, 7, dtype=BF16, device=DEVICE).t()  # last dim strided: copied
    assert compare(rmsnorm(xt, w, EPS), rmsnorm_ref(xt, w, EPS)).ok
    x1 = torch.randn(96, dtype=BF16, device=DEVICE)  # a single vector
    assert compare(rmsnorm(x1, w, EPS), rmsnorm_ref(x1, w, EPS)).ok
    ws = torch.randn(192, dtype=BF16, device=DEVICE)[::2]  # strided weight
    assert compare(rmsnorm(x, ws, EPS), rmsnorm_ref(x, ws, EPS)).ok


def test_out_argument_and_empty_inputs() -> None:
    x = torch.randn(2, 3, 64, dtype=FP16, device=DEVICE)
    out = torch.full((2, 3, 64), float("nan"), dtype=FP32, device=DEVICE)
    assert rmsnorm(x, None, EPS, out_dtype=FP32, out=out) is out
    assert compare(out, rmsnorm_ref(x, None, EPS, out_dtype=FP32)).ok
    e = rmsnorm(torch.empty(0, 64, dtype=BF16, device=DEVICE), None, EPS)
    assert e.shape == (0, 64) and e.dtype == BF16
    e = rmsnorm(torch.empty(3, 0, dtype=BF16, device=DEVICE), torch.empty(0, dtype=BF16, device=DEVICE), EPS,
                out_dtype=FP32)
    assert e.shape == (3, 0) and e.dtype == FP32


def test_repeated_calls_reuse_cached_launch() -> None:
    wl = _wl(12, 128)
    for seed in range(3):  # same shape: the second and third calls take the cached plan
        _check(wl, seed=seed)
    _check(wl, Config("row", 128, 0, 1, 1), seed=9)  # same shape, another config


def test_a_graph_nodes_site_keeps_its_first_calls_plan_and_refills_on_anything_else(monkeypatch) -> None:  # noqa: ANN001
    """rmsnorm's `_Site` (one node of an optimized graph, called without autograd): the first call
    takes the whole path; later calls with x and weight of the same layout skip it, with the
    values the whole path gives; a call with another shape, a strided x, another weight layout or
    another constant takes the whole path again."""
    whole = [0]
    real = R.rmsnorm

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        whole[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(R, "rmsnorm", counted)
    site = R._Site()
    w = (1 + 0.1 * torch.randn(96, device=DEVICE)).to(BF16)

    def check(x: torch.Tensor, weight: torch.Tensor | None, eps: float = EPS, out_dtype: torch.dtype = BF16,
              rnd: bool = True, config: str = "") -> None:
        y = site(x, weight, eps, out_dtype, rnd, config)
        ref = rmsnorm_ref(x, weight, eps, out_dtype=out_dtype, round_before_weight=rnd)
        assert y.shape == x.shape and y.dtype == out_dtype and y.is_contiguous()
        assert compare(y, ref, R.output_tolerance(workload_for(x, weight, eps, out_dtype, rnd))).ok
        cfg = Config.decode(config) if config else None  # the whole path's own result, bit for bit
        assert torch.equal(y, real(x, weight, eps, out_dtype=out_dtype, round_before_weight=rnd, config=cfg))

    x = torch.randn(2, 5, 96, dtype=BF16, device=DEVICE)
    check(x, w)
    assert whole[0] == 1 and site.sig is not None
    for seed in range(3):  # new values, the same layout: no whole path
        torch.manual_seed(seed)
        check(torch.randn(2, 5, 96, dtype=BF16, device=DEVICE), w)
        check(x, (1 + 0.1 * torch.randn(96, device=DEVICE)).to(BF16))  # another weight of that layout
    assert whole[0] == 1
    calls = 1
    for other in (
        lambda: check(torch.randn(3, 5, 96, dtype=BF16, device=DEVICE), w),  # another shape
        lambda: check(torch.randn(2, 5, 200, dtype=BF16, device=DEVICE)[..., :96], w),  # strided rows
        lambda: check(x.float(), w),  # another dtype
        lambda: check(x, torch.randn(192, dtype=BF16, device=DEVICE)[::2]),  # a strided weight
        lambda: check(x, None),  # no weight
        lambda: check(x, w.float()),  # another weight dtype
        lambda: check(x, w, eps=1e-5),
        lambda: check(x, w, out_dtype=torch.float32),
        lambda: check(x, w, rnd=False),
        lambda: check(x, w, config="row:bh=128:w=2"),
    ):
        other()
        calls += 1
        assert whole[0] == calls
    check(x, w, config="row:bh=128:w=2")  # the last call's layout is the one kept now
    assert whole[0] == calls
    strided = torch.randn(2, 5, 200, dtype=BF16, device=DEVICE)[..., :96]
    check(strided, w)
    check(strided, w)  # a strided x is never recorded: the whole path each time
    assert whole[0] == calls + 2 and site.sig is None


def test_launcher_errors() -> None:
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    cases = [
        (lambda: rmsnorm(x.to(torch.int32), None, EPS), "dtype"),
        (lambda: rmsnorm(x.double(), None, EPS), "dtype"),
        (lambda: rmsnorm(x, None, EPS, out_dtype=torch.float64), "dtype"),
        (lambda: rmsnorm(x, torch.randn(32, device=DEVICE), EPS), "size 64"),
        (lambda: rmsnorm(x, torch.randn(2, 64, device=DEVICE), EPS), "1-D"),
        (lambda: rmsnorm(x, w.to(torch.int64), EPS), "weight has dtype"),
        (lambda: rmsnorm(x, torch.empty(64, device="meta"), EPS), "device"),
        (lambda: rmsnorm(torch.tensor(1.0, device=DEVICE), None, EPS), "at least one dimension"),
        (lambda: rmsnorm(x, w, EPS, out=torch.empty(4, 32, device=DEVICE)), "out must have shape"),
        (lambda: rmsnorm(x, w, EPS, out=torch.empty(4, 64, dtype=BF16, device=DEVICE)), "out must have"),
        (lambda: rmsnorm(x, w, EPS, out=torch.empty(64, 4, device=DEVICE).t()), "contiguous"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


# ---------------------------------------------------------------------------------------------
# config triad, workload records, inputs


def test_config_encode_decode_round_trip() -> None:
    for rows, H in [(1, 2560), (16384, 2560), (1048576, 128), (64, 96), (2, 70000)]:
        wl = _wl(rows, H)
        for c in [*space(wl), heuristic(wl)]:
            s = c.encode()
            assert Config.decode(s) == c and ":" in s and s.startswith(c.variant)
            assert Config(**dict(c.items())) == c
    assert Config("rows", 4096, 0, 4, 8).encode() == "rows:bh=4096:r=4:w=8"
    assert Config.decode("persist:bh=128:r=32:w=4:p=8:s=2") == Config("persist", 128, 0, 32, 4, 8, 2)
    assert Config("row", 4096, 0, 1, 8, evict=1).encode() == "row:bh=4096:w=8:e=1"
    for bad in ["", "nope:bh=4", "row:bh", "row:zz=3", "row:bh=x"]:
        with pytest.raises(ValueError):
            Config.decode(bad)


@pytest.mark.parametrize("rows,H", [(1, 2560), (16384, 2560), (1048576, 128), (32768, 4096), (1, 128), (32, 128),
                                    (7, 96), (3, 130), (1, 1), (4, 100000), (65536, 512), (2, 70000)])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_heuristic_is_valid(rows: int, H: int, dtype: torch.dtype) -> None:
    wl = _wl(rows, H, dtype, dtype)
    assert is_valid(heuristic(wl), wl)


def test_heuristic_picks_the_measured_winners() -> None:
    assert heuristic(_wl(16384, 2560)).encode() == "row:bh=4096:w=8"
    assert heuristic(_wl(32768, 4096)).encode() == "row:bh=4096:w=8"
    assert heuristic(_wl(1048576, 128)).encode() == "rows:bh=128:r=32:w=16"


def test_is_valid_rejects_broken_configs() -> None:
    wl = _wl(64, 2560)
    assert is_valid(Config("row", 4096, 0, 1, 8), wl)
    assert is_valid(Config("row", 2048, 512, 1, 8), wl)
    for c in [Config("row", 2048, 0, 1, 8),  # block shorter than the row
              Config("row", 2048, 256, 1, 8),  # main + tail still short
              Config("row", 4096, 512, 1, 8),  # tail past a block that already covers the row
              Config("row", 3000, 0, 1, 8),  # not a power of two
              Config("row", 4096, 0, 2, 8),  # row means one row
              Config("rows", 4096, 0, 64, 1),  # 8192 values per thread: would spill
              Config("persist", 4096, 0, 2, 8),  # persist needs programs per SM
              Config("rows", 4096, 0, 2, 8, progs=4),  # and only persist has them
              Config("row", 4096, 0, 1, 3),  # warps
              Config("loop", 1024, 0, 2, 4),  # loop is one row per program
              Config("loop", 1024, 0, 1, 4, evict=1),  # loop has no eviction knob
              Config("rows", 4096, 0, 2, 8, stages=2),  # only persist prefetches
              Config("persist", 4096, 0, 2, 8, progs=4, stages=3),
              Config("row", 4096, 0, 1, 8, evict=2),
              Config("nope", 4096, 0, 1, 8)]:
        assert not is_valid(c, wl), c


def test_workload_for_fields() -> None:
    x = torch.empty(2, 8, 2560, dtype=BF16, device="meta")
    wl = workload_for(x, torch.empty(2560, dtype=FP32, device="meta"), 1e-6, FP32, True)
    assert wl.family == R.FAMILY == "rmsnorm"
    assert wl.shapes == ((16, 2560), (2560,))
    assert wl.dtypes == ("bf16", "fp32", "fp32")
    assert wl.params == (("eps", 1e-6), ("out_dtype", "fp32"), ("round_before_weight", True))
    assert [k for k, _ in wl.params] == sorted(k for k, _ in wl.params)
    assert wl.device == "meta"
    wl2 = workload_for(torch.empty(16, 2560, dtype=BF16, device="meta"), None, 1e-5)
    assert wl2.shapes == ((16, 2560),) and wl2.dtypes == ("bf16", "bf16")
    assert wl2.param("out_dtype") == "bf16" and wl2.param("round_before_weight") is False


def test_make_inputs() -> None:
    wl = _wl(16, 64, BF16, FP32, FP32, True)
    (x, w, eps), kw = R.make_inputs(wl, seed=5)
    (x2, w2, _), _ = R.make_inputs(wl, seed=5)
    (x3, _, _), _ = R.make_inputs(wl, seed=6, rows=3)
    assert x.shape == (16, 64) and x.dtype == BF16 and x.device.type == DEVICE
    assert w is not None and w.shape == (64,) and w.dtype == FP32 and w2 is not None
    assert torch.equal(x, x2) and torch.equal(w, w2) and x3.shape == (3, 64)
    assert not torch.equal(x[:3], x3) and bool((x != 0).all())
    assert 0.5 < float(w.float().mean()) < 1.5 and float(w.float().std()) > 0.01
    assert eps == EPS and kw == {"out_dtype": FP32, "round_before_weight": True}
    (_, w0, _), _ = R.make_inputs(_wl(4, 64, wdtype=None), seed=0)
    assert w0 is None


# ---------------------------------------------------------------------------------------------
# custom op


def test_custom_op_matches_reference() -> None:
    x = torch.randn(3, 5, 96, dtype=BF16, device=DEVICE)
    w = (1 + 0.1 * torch.randn(96, device=DEVICE)).to(BF16)
    ref = rmsnorm_ref(x, w, EPS, out_dtype=FP32, round_before_weight=True)
    assert R.rmsnorm_op is torch.ops.solforge.rmsnorm
    for config in ["", "rows:bh=64:bt=32:r=4:w=1", "persist:bh=128:r=2:w=1:p=1:s=2"]:
        y = torch.ops.solforge.rmsnorm(x, w, EPS, FP32, True, config)
        # bf16 rounding inside, fp32 out: compared at bf16 tolerance (see output_tolerance)
        assert y.shape == x.shape and y.dtype == FP32 and compare(y, ref, tolerance(BF16)).ok, config
    y = torch.ops.solforge.rmsnorm.default(x, None, EPS, BF16, False, "")
    assert compare(y, rmsnorm_ref(x, None, EPS)).ok


def test_custom_op_fake_impl() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 7, 2560, dtype=BF16, device=DEVICE)
        w = torch.empty(2560, dtype=BF16, device=DEVICE)
        y = torch.ops.solforge.rmsnorm(x, w, EPS, FP32, False, "row:bh=4096:w=8")
        assert y.shape == (4, 7, 2560) and y.dtype == FP32 and y.device == x.device
    torch.library.opcheck(torch.ops.solforge.rmsnorm.default,
                          (torch.randn(3, 64, device=DEVICE), None, EPS, FP32, False, ""),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# rows that are columns (kernels/rmsnorm_cols.py): a norm over a middle dim, moved last


def _cols_wl(outer: int, H: int, inner: int, dtype: torch.dtype = BF16, weight: bool = True,
             rbw: bool = False) -> Workload:
    x = torch.empty(outer, H, inner, dtype=dtype, device="meta").movedim(1, -1)
    w = torch.empty(H, dtype=dtype, device="meta") if weight else None
    return dataclasses.replace(workload_for(x, w, EPS, None, rbw), device=DEVICE)


@pytest.mark.parametrize("outer,H,inner,dtype,weight,rbw", [
    (3, 16, 35, FP32, True, False),  # H a power of two, inner ragged
    (2, 40, 99, BF16, True, True),  # H ragged, HF's rounding
    (2, 300, 9, BF16, False, False),  # colsloop's chunks, a ragged last chunk
    (1, 7, 1000, FP16, True, False),
])
def test_cols_every_config(outer: int, H: int, inner: int, dtype: torch.dtype, weight: bool, rbw: bool) -> None:
    wl = _cols_wl(outer, H, inner, dtype, weight, rbw)
    assert wl.param("inner") == inner and wl.shapes[0] == (outer * inner, H)
    configs = space(wl)
    assert configs and is_valid(heuristic(wl), wl)
    assert {c.variant for c in configs} <= {"cols", "colsloop"}
    for c in [None, *covering(configs, ignore=("num_warps",))]:  # the whole space on a GPU
        _check(wl, c)
    _check(wl, rows=odd_rows(outer * inner))  # the verifier's odd shape: one outer index, odd inner


def test_cols_layout_is_its_own_workload() -> None:
    """Row kernels are not valid for columns and cols kernels not for rows: a config tuned for one
    layout is never launched on the other."""
    rows_wl, cols_wl = _wl(60, 48), _cols_wl(2, 48, 30)
    assert rows_wl.shapes == cols_wl.shapes and rows_wl.key != cols_wl.key
    assert all(c.variant in ("cols", "colsloop") for c in space(cols_wl))
    assert not any(is_valid(c, rows_wl) for c in space(cols_wl))
    assert not any(is_valid(c, cols_wl) for c in space(rows_wl))
    x = torch.randn(2, 48, 30, device=DEVICE).movedim(1, -1)
    with pytest.raises(ValueError, match="not valid"):
        rmsnorm(x, None, EPS, config=heuristic(rows_wl))


def test_cols_output_layout_and_out_argument() -> None:
    """y has x's strides (the moved-back output is contiguous, as eager's); an `out` of other strides
    is filled too; a strided x that is not such a view takes the row kernels on a copy."""
    torch.manual_seed(0)
    x0 = torch.randn(2, 24, 5, 6, device=DEVICE)
    w = 1 + 0.1 * torch.randn(24, device=DEVICE)
    x = x0.movedim(1, -1)
    ref = rmsnorm_ref(x, w, EPS)
    y = rmsnorm(x, w, EPS)
    assert y.stride() == x.stride() and y.movedim(-1, 1).is_contiguous()
    assert compare(y, ref).ok
    out = torch.full(x.shape, float("nan"), device=DEVICE)  # contiguous: not x's strides
    assert rmsnorm(x, w, EPS, out=out) is out and compare(out, ref).ok
    xs = torch.randn(2, 24, 5, 12, device=DEVICE)[..., ::2].movedim(1, -1)  # not dense: no columns layout
    assert R._cols.cols_inner(xs) == 0
    assert compare(rmsnorm(xs, w, EPS), rmsnorm_ref(xs, w, EPS)).ok


def test_cols_workload_verifies_and_its_backward_is_the_rows_one() -> None:
    from solforge.tune import candidates, measure

    wl = _cols_wl(2, 40, 17)
    rec = measure(R, candidates(R, wl)[0], device=DEVICE)
    assert rec.ok, rec.error
    bwd = R.backward_workload(wl)
    assert bwd is not None and bwd.param("inner") is None and bwd.shapes == wl.shapes


# ---------------------------------------------------------------------------------------------
# GPU: the BASELINES.md shapes (bf16, weight, eps 1e-6), every config of each space

BASELINE_SHAPES = [(16384, 2560), (1048576, 128), (1, 2560), (32768, 4096)]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("rows,H", BASELINE_SHAPES)
def test_gpu_every_config_on_baseline_shapes(rows: int, H: int) -> None:
    wl = _wl(rows, H, device="cuda")
    small = min(rows, 4096 if H >= 1024 else 65536)  # fewer rows: compile-bound, still fills the GPU
    for c in space(wl):
        _check(wl, c, rows=small)
        _check(wl, c, rows=min(rows, 1237), seed=2)  # odd row count


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("rows,H", BASELINE_SHAPES)
def test_gpu_heuristic_at_full_baseline_shape(rows: int, H: int) -> None:
    wl = _wl(rows, H, device="cuda")
    for seed in range(2):  # the second call takes the cached direct launch
        _check(wl, seed=seed)


@pytest.mark.gpu
@requires_gpu
def test_gpu_direct_launch_respects_alignment_and_strides() -> None:
    w = (1 + 0.1 * torch.randn(2560, device="cuda")).to(BF16)
    base = torch.randn(8 * 2560 + 1, dtype=BF16, device="cuda")
    for _ in range(2):
        aligned = base[: 8 * 2560].view(8, 2560)
        shifted = base[1:].view(8, 2560)  # data pointer 2 bytes off 16-byte alignment
        strided = torch.randn(8, 3000, dtype=BF16, device="cuda")[:, :2560]
        for x in (aligned, shifted, strided, aligned):
            assert compare(rmsnorm(x, w, EPS), rmsnorm_ref(x, w, EPS)).ok


@pytest.mark.gpu
@requires_gpu
def test_gpu_cpu_tensor_rejected_and_compiled_op() -> None:
    if not R._INTERPRETED:
        with pytest.raises(ValueError, match="CUDA"):
            rmsnorm(torch.randn(2, 64), None, EPS)
    x = torch.randn(2, 128, 2560, dtype=BF16, device="cuda")
    w = (1 + 0.1 * torch.randn(2560, device="cuda")).to(BF16)
    f = torch.compile(lambda x, w: torch.ops.solforge.rmsnorm(x, w, EPS, BF16, True, "rows:bh=4096:r=2:w=8") * 2,
                      fullgraph=True)
    assert compare(f(x, w), 2 * rmsnorm_ref(x, w, EPS, round_before_weight=True)).ok


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("outer,H,inner,dtype", [(16, 64, 65536, FP32), (8, 512, 4096, BF16)])
def test_gpu_cols_every_config(outer: int, H: int, inner: int, dtype: torch.dtype) -> None:
    """KernelBench's RMSNorm over features (16 x 64 x 256 x 256 fp32) and a 512-channel norm: every
    config of the cols space, at the full shape, against the reference (poisoned output)."""
    x = torch.empty(outer, H, inner, dtype=dtype, device="meta").movedim(1, -1)
    wl = workload_for(x, None if H == 64 else torch.empty(H, dtype=dtype, device="meta"), EPS)
    wl = dataclasses.replace(wl, device="cuda")
    for c in space(wl):
        _check(wl, c)
