"""capture/layout.py: convolutions rewritten to channels-last compute the model's values, hand the
rest of the graph its original layout, and their copy back fuses into the generated region after
them. The timing decision is the GPU's (off the GPU nothing is rewritten); here `decide` is given."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import check_region, trace, values
from conftest import DEVICE

from solforge import settings
from solforge.capture import layout as L
from solforge.codegen import regions as RG

aten = torch.ops.aten


# cuDNN picks other algorithms for the two layouts (another order of the fp32 sums): a few ulps
CONV_TOL: dict[str, float] = {"rtol": 1e-5, "atol": 1e-5} if DEVICE == "cpu" else {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def _no_tf32() -> Any:
    """On a GPU cuDNN's fp32 convolutions may round through TF32, and the channels-last and NCHW
    ways pick different algorithms (differences near 1e-3): these tests check that the layouts
    compute the same values, so both ways run in full fp32 here (a rewritten fp32 convolution does
    anyway: test_a_rewritten_fp32_convolution_computes_in_fp32)."""
    with L.ieee_fp32():
        yield


def _r(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _strides_as_planned(gm: Any, env: dict[Any, Any]) -> None:
    """Every value's strides when the graph runs are its fake value's (what regions compile for),
    over the dims of size > 1."""
    for n, v in env.items():
        fake = n.meta.get("val")
        pairs = [(v, fake)] if isinstance(v, torch.Tensor) else list(zip(v, fake, strict=False)) \
            if isinstance(v, tuple) and isinstance(fake, tuple | list) else []
        for got, want in pairs:
            if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
                dims = [d for d in range(got.dim()) if got.shape[d] > 1]
                assert [got.stride(d) for d in dims] == [want.stride(d) for d in dims], n.format_node()


# times under which every island goes channels-last (the GPU measures them)
WINS = L.ConvTimes(plain=100.0, last=10.0, copy_in=1.0, copy_back=1.0)


def _convs(gm: Any) -> list[Any]:
    """The convolutions of `gm`, rewritten ones (L.convolution_fp32) too."""
    return [n for n in gm.graph.nodes if getattr(n.target, "solforge_op", n.target) is aten.convolution.default]


CASES: dict[str, tuple[Any, list[torch.Tensor]]] = {
    # conv + ReLU + bias add (KernelBench level 2's first problem, small): odd sizes
    "conv2d_relu_bias": (lambda x, w, b, c: torch.relu(F.conv2d(x, w, b)) + c,
                         [_r(2, 5, 9, 11), _r(6, 5, 3, 3, seed=1), _r(6, seed=2), _r(6, 1, 1, seed=3)]),
    # a strided, padded, grouped 3-D convolution, then a view of its result (needs its layout)
    "conv3d_grouped_view": (lambda x, w: F.conv3d(x, w, None, 2, 1, 1, 2).view(2, -1) * 0.5,
                            [_r(2, 4, 5, 6, 7), _r(6, 2, 3, 3, 3, seed=1)]),
    # a transposed convolution with groups and a bias, its output returned as the graph's output
    "conv_transpose2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, 2, 1, 1, 2),
                         [_r(2, 4, 7, 5), _r(4, 3, 3, 3, seed=1), _r(6, seed=2)]),
    # a reduction over the channels reads the result (KernelBench level 2's Conv2d_Min_Tanh_Tanh)
    "conv2d_min_tanh": (lambda x, w, b: torch.tanh(torch.tanh(torch.min(F.conv2d(x, w, b), dim=1, keepdim=True)[0])),
                        [_r(2, 3, 9, 7), _r(5, 3, 3, 3, seed=1), _r(5, seed=2)]),
    # a softmax over the channels of a 3-D convolution, then a scale (Conv3d_Softmax_...)
    "conv3d_softmax": (lambda x, w, b: torch.softmax(F.conv3d(x, w, b), dim=1) * 2.0,
                       [_r(2, 3, 5, 6, 7), _r(5, 3, 3, 3, 3, seed=1), _r(5, seed=2)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rewritten_graph_computes_eager_values_in_eager_layout(case: str) -> None:
    f, xs = CASES[case]
    gm = trace(f, *xs)
    want = f(*xs)
    assert len(_convs(gm)) == 1
    assert L.channels_last_convolutions(gm, decide=lambda n: True) == 1
    (conv,) = _convs(gm)
    fmt = torch.channels_last if xs[0].dim() == 4 else torch.channels_last_3d
    assert [a.target for a in conv.args[:2]] == [aten.clone.default] * 2
    assert all(a.kwargs["memory_format"] == fmt for a in conv.args[:2])
    assert conv.meta["val"].is_contiguous(memory_format=fmt)
    (back,) = conv.users
    assert back.target is aten.clone.default and back.meta["val"].is_contiguous()
    env = values(gm, *xs)
    assert env[conv].is_contiguous(memory_format=fmt)  # the convolution really ran channels-last
    got = gm(*xs)
    got = got[0] if isinstance(got, tuple | list) else got
    assert got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rewritten_fp32_convolution_computes_in_fp32(dtype: torch.dtype) -> None:
    """cuDNN may run an fp32 convolution on TF32 tensor cores (PyTorch's default allows it), and
    its channels-last kernels do: a rewritten fp32 convolution calls `convolution_fp32`, which turns
    TF32 off for the call and puts the setting back; a bf16 one calls the op as written."""
    f, xs = CASES["conv2d_relu_bias"]
    xs = [x.to(dtype) for x in xs]
    gm = trace(f, *xs)
    L.channels_last_convolutions(gm, decide=lambda n: True)
    (conv,) = _convs(gm)
    assert conv.target is (L.convolution_fp32 if dtype == torch.float32 else aten.convolution.default)
    precision = torch.backends.cudnn.conv.fp32_precision
    with L.ieee_fp32():
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    assert torch.backends.cudnn.conv.fp32_precision == precision
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(gm(*xs), f(*xs), **tol)


def test_a_convolution_that_rounds_through_tf32_as_written_may_do_so_rewritten(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the timing found that the convolution as written rounds through TF32 (the user's
    setting, cuDNN's pick), the rewrite calls the op as written: it is no less precise."""
    f, xs = CASES["conv2d_relu_bias"]
    gm = trace(f, *xs)
    monkeypatch.setattr(L, "node_times", lambda n: L.ConvTimes(100.0, 10.0, 1.0, 1.0, tf32=True))
    L.channels_last_convolutions(gm, decide=lambda n: True)
    (conv,) = _convs(gm)
    assert conv.target is aten.convolution.default
    torch.testing.assert_close(gm(*xs), f(*xs), rtol=1e-5, atol=1e-5)


def test_tf32_rounding_is_told_from_fp32_summation_order() -> None:
    exact = _r(64, 1000).double()
    fp32 = exact.float().double()  # fp32 rounding: 6e-8 relative
    tf32 = (exact.float().view(torch.int32) & ~0x1FFF).view(torch.float32).double()  # 10 mantissa bits
    assert not L._rounds_through_tf32(fp32, exact) and not L._rounds_through_tf32(exact, exact)
    assert L._rounds_through_tf32(tf32, exact)
    assert not L._rounds_through_tf32(torch.zeros(3), torch.zeros(3))


@pytest.mark.skipif(DEVICE != "cuda", reason="cuDNN's TF32 kernels need a GPU")
def test_a_channels_last_fp32_convolution_stays_fp32_under_the_default_tf32_setting() -> None:
    """At PyTorch's default (cuDNN may use TF32), a channels-last fp32 convolution of KernelBench
    level 2's 57_Conv2d_ReLU_HardSwish's shape (fewer images) ran TF32 (3e-4 from fp64, H200): the
    rewritten one is as close to fp64 as fp32 sums are."""
    x, w, b = _r(16, 8, 128, 128), _r(64, 8, 3, 3, seed=1), _r(64, seed=2)
    f = lambda x, w, b: torch.relu(F.conv2d(x, w, b))  # noqa: E731
    want = f(*(t.double() for t in (x, w, b)))
    gm = trace(f, x, w, b)
    L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: False)
    def err(t: torch.Tensor) -> float:
        return ((t.double() - want).abs().max() / want.abs().max()).item()

    before = torch.backends.cudnn.conv.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    try:
        got = gm(x, w, b)
        last = f(x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last), b)
    finally:
        torch.backends.cudnn.conv.fp32_precision = before
    if err(last) < 1e-5:
        pytest.skip("cuDNN ran this channels-last convolution in fp32 anyway: nothing to tell apart")
    assert err(got) < 2e-6, (err(got), err(last))


def test_the_copy_back_fuses_into_the_region_after_the_convolution() -> None:
    """The generated region after the convolution starts at the copy back: it reads the
    channels-last output once (strided) and writes the model's layout, checked against fp64."""
    f, xs = CASES["conv2d_relu_bias"]
    gm = trace(f, *xs)
    L.channels_last_convolutions(gm, decide=lambda n: True)
    (conv,) = _convs(gm)
    formed = RG.form_regions(gm.graph)
    after = [fr for fr in formed if conv in fr.inputs]
    assert len(after) == 1
    (back,) = conv.users
    assert back in after[0].nodes
    assert check_region(after[0], values(gm, *xs)) >= 1


def test_nothing_changes_without_a_decision_or_with_the_switch_off() -> None:
    f, xs = CASES["conv2d_relu_bias"]
    gm = trace(f, *xs)
    before = [n.format_node() for n in gm.graph.nodes]
    # (the bias's move, CUDA's default, is a change of its own: tested above)
    assert L.channels_last_convolutions(gm, decide=lambda n: False, strip=lambda n: False) == 0
    with settings.override(conv_layout=False):
        assert L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: True) == 0
    assert [n.format_node() for n in gm.graph.nodes] == before
    if DEVICE == "cpu":  # the default decision times on the GPU only
        assert L.channels_last_convolutions(gm) == 0


def test_the_timing_counts_the_copy_back_only_where_no_region_takes_it() -> None:
    """A convolution followed by pointwise ops: its copy back is the next region's read, so the
    decision leaves it out; one whose result is the graph's output pays for the copy and the
    decision counts it. Two convolutions in a row are one island: the first's copy back cancels
    the second's copy in, so neither is counted, and the pair goes channels-last where neither
    alone would."""
    times = L.ConvTimes(plain=100.0, last=70.0, copy_in=10.0, copy_back=20.0)
    for case, fuses in (("conv2d_relu_bias", True), ("conv_transpose2d", False)):
        f, xs = CASES[case]
        gm = trace(f, *xs)
        (conv,) = _convs(gm)
        assert L.copy_back_fuses(conv) is fuses
        # 70 + 10 (+ 20 where the copy back stays) against 0.95 x 100
        assert L.islands(gm, lambda n: times) == ({conv} if fuses else set())
        (d,) = gm.meta[L.DECISIONS]  # the decision, for the report's notes
        assert (d.convolutions, d.written_us, d.channels_last_us, d.rewritten) == (1, 100.0, 80.0 + 20 * (not fuses),
                                                                                   fuses)
        assert d.text().startswith("1 convolution(s) channels-last: 100 µs as written, 80 µs" if fuses else
                                   "1 convolution(s) left as written: 100 µs as written, 100 µs")
    two = trace(lambda x, w1, w2: F.conv2d(F.conv2d(x, w1), w2), _r(2, 5, 9, 11), _r(6, 5, 3, 3, seed=1),
                _r(4, 6, 3, 3, seed=2))
    first, second = _convs(two)
    assert not L.copy_back_fuses(first)  # a convolution reads it: no region between them
    assert L.copy_back_cancels(first)  # ...and its copy in cancels the copy back: not a pass either
    assert L._groups(two.graph) == ([[first, second]], {second})
    # 2 x 70 + 10 (the first's copy in) + 20 (the second's copy back) = 170 <= 0.95 x 200; one of
    # them alone, both copies counted: 100 > 95
    assert L.islands(two, lambda n: times) == {first, second}
    assert L.islands(two, lambda n: times if n is first else None) == set()  # a failed timing: as written


def test_a_copy_back_that_reaches_only_convolutions_cancels() -> None:
    """conv -> eval BatchNorm -> ReLU -> conv, with a residual add into a third convolution: the
    first two results reach only convolutions through ops that keep the memory order (their copies
    back cancel, the timing leaves them out); the last one is viewed (a copy out there); a result
    that also goes to a view keeps its copy."""
    def f(x, w1, m, v, w2, w3):  # noqa: ANN001, ANN202
        a = F.conv2d(x, w1, padding=1)
        h = torch.relu(F.batch_norm(a, m, v, training=False))
        b = F.conv2d(h, w2, padding=1)
        c = F.conv2d(torch.relu(b + h), w3)
        return c.view(c.shape[0], -1)

    xs = [_r(2, 3, 9, 7), _r(6, 3, 3, 3, seed=1), _r(6, seed=2), _r(6, seed=3).abs() + 0.5,
          _r(6, 6, 3, 3, seed=4), _r(4, 6, 1, 1, seed=5)]
    gm = trace(f, *xs)
    assert [L.copy_back_cancels(c) for c in _convs(gm)] == [True, True, False]
    # on CUDA the lowering records cuDNN's BatchNorm: eval keeps the layout as native_batch_norm does
    graph = torch.fx.Graph()
    args = [graph.placeholder(n) for n in "xwbmv"]
    for op in (aten.cudnn_batch_norm.default, aten.native_batch_norm.default):
        for training in (False, True):
            bn = graph.call_function(op, (*args, training, 0.1, 1e-5))
            assert L._keeps_layout(bn) is (not training), (op, training)

    def g(x, w1, w2):  # noqa: ANN001, ANN202
        a = F.conv2d(x, w1)
        return F.conv2d(torch.relu(a), w2), a.sum(1)

    leak = trace(g, _r(2, 5, 9, 11), _r(6, 5, 3, 3, seed=1), _r(4, 6, 3, 3, seed=2))
    assert [L.copy_back_cancels(c) for c in _convs(leak)] == [False, False]


def test_already_channels_last_and_one_channel_inputs_are_left_alone() -> None:
    x = _r(2, 5, 9, 11).contiguous(memory_format=torch.channels_last)
    gm = trace(lambda x, w: F.conv2d(x, w), x, _r(6, 5, 3, 3, seed=1))
    assert L.channels_last_convolutions(gm, decide=lambda n: True) == 0
    gm = trace(lambda x, w: F.conv2d(x, w), _r(2, 1, 9, 11), _r(6, 1, 3, 3, seed=1))
    assert L.channels_last_convolutions(gm, decide=lambda n: True) == 0


def test_optimize_integrates_a_channels_last_convolution_where_no_region_matched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with a convolution and nothing to fuse still gets the layout the timing chose (here
    forced): optimize integrates and checks it end to end, and the model computes eager's values."""
    import torch.nn as nn

    from solforge import optimize

    monkeypatch.setattr(L, "node_times", lambda n: WINS)
    model = nn.Conv2d(3, 5, 3, padding=1).to(DEVICE)
    x = _r(2, 3, 7, 9)
    opt, report = optimize(model, (x,), budget=1, max_candidates=1, db=False, profile="off", keep_slower=True,
                           make_inputs=lambda s: (_r(2, 3, 7, 9, seed=s),))
    assert report.e2e is not None and report.e2e.passed, report.notes
    assert any("run channels-last" in n for n in report.notes), report.notes
    assert report.returned != "original", (report.returned, report.why)
    fresh = _r(2, 3, 7, 9, seed=11)
    with torch.no_grad():
        got, want = opt(fresh), model(fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()


@pytest.mark.parametrize("case", ["conv2d_relu_bias", "conv_transpose2d", "conv2d_min_tanh", "conv3d_softmax"])
def test_the_bias_moves_into_the_region_after_the_convolution(case: str) -> None:
    """A bias whose convolution's users are all pointwise, or reductions of it (a min or a softmax
    over the channels), becomes an add that region formation takes with them (one pass over the
    output instead of ATen's separate bias add); where the convolution's result is the graph's
    output the bias stays. Values as eager's."""
    f, xs = CASES[case]
    gm = trace(f, *xs)
    want = f(*xs)
    stripped = L.strip_bias(gm, where=lambda n: True)
    (conv,) = _convs(gm)
    if case == "conv_transpose2d":  # the result is the output: no region after it to take the add
        assert stripped == 0 and conv.args[2] is not None
        return
    assert stripped == 1 and conv.args[2] is None
    (add,) = conv.users
    assert add.target is aten.add.Tensor
    fr = next(fr for fr in RG.form_regions(gm.graph) if conv in fr.inputs)
    assert add in fr.nodes
    assert check_region(fr, values(gm, *xs)) >= 1
    got = gm(*xs)
    got = got[0] if isinstance(got, tuple | list) else got
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # then channels-last: the copy back and the bias add are in the one region after it
    gm = trace(f, *xs)
    assert L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: True) == 1
    (conv,) = _convs(gm)
    (back,) = conv.users
    fr = next(fr for fr in RG.form_regions(gm.graph) if conv in fr.inputs)
    adds = [n for n in fr.nodes
            if n.target is aten.add.Tensor and getattr(n.args[1], "target", None) is aten.view.default]
    assert back in fr.nodes and len(adds) == 1
    got = gm(*xs)
    torch.testing.assert_close(got[0] if isinstance(got, tuple | list) else got, want, rtol=1e-5, atol=1e-5)


POOLED: dict[str, tuple[Any, bool]] = {
    # (the graph after a biased convolution, whether the bias moves past its pool)
    "max_pool2d": (lambda y: torch.sigmoid(F.max_pool2d(y, 2)), True),
    "max_pool2d_ceil_strided": (lambda y: F.max_pool2d(y, 3, 2, 1, ceil_mode=True) * 2.0, True),
    "avg_pool2d_sum": (lambda y: torch.sigmoid(F.avg_pool2d(y, 2)).sum(dim=(1, 2, 3)), True),
    "avg_pool2d_ceil": (lambda y: F.avg_pool2d(y, 3, 2, ceil_mode=True) - 1.0, True),
    "avg_pool2d_padding_excluded": (lambda y: F.avg_pool2d(y, 3, 1, 1, count_include_pad=False) * 3.0, True),
    "adaptive_avg_pool2d": (lambda y: F.adaptive_avg_pool2d(y, (2, 3)).tanh(), True),
    # padded zeros counted: avg(x + b) is not avg(x) + b at the edges
    "avg_pool2d_padding_counted": (lambda y: F.avg_pool2d(y, 3, 1, 1) * 3.0, False),
    "avg_pool2d_divisor": (lambda y: F.avg_pool2d(y, 2, divisor_override=3) * 3.0, False),
}


@pytest.mark.parametrize("case", list(POOLED))
def test_the_bias_moves_past_a_pool_that_commutes_with_it(case: str) -> None:
    """A convolution read by a pool alone gets its bias added to the pooled result (k times
    fewer elements) where the pool commutes with a per-channel add; values as eager's."""
    after, moves = POOLED[case]
    x, w, b = _r(2, 3, 11, 9), _r(5, 3, 3, 3, seed=1), _r(5, seed=2)

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return after(F.conv2d(x, w, b))

    gm = trace(f, x, w, b)
    assert L.strip_bias(gm, where=lambda n: True) == int(moves)
    (conv,) = _convs(gm)
    assert (conv.args[2] is None) == moves
    if moves:
        (add,) = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
        pooled = add.args[0]
        assert pooled is not conv and (pooled.args[0] is conv or pooled.args[0].args[0] is conv)
    torch.testing.assert_close(gm(x, w, b), f(x, w, b), rtol=1e-5, atol=1e-5)


def _conv_bn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor, s: torch.Tensor, training: bool) -> torch.Tensor:
    return F.batch_norm(F.conv2d(x, w, b), m, v, g, s, training) * 2.0


def test_the_bias_moves_into_a_batch_norm() -> None:
    """nn.BatchNorm2d reads the convolution (native_batch_norm): in eval mode a reduction-like
    reader, in training a norm (an InstanceNorm is one over the (1, N*C, H, W) view): the bias goes
    to its region either way; values as eager's."""
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(3, 6, 3).to(DEVICE), torch.nn.BatchNorm2d(6).to(DEVICE)
    bn.running_mean.normal_()
    x = _r(2, 3, 9, 7)
    for training in (False, True):
        args = (x, conv.weight.detach(), conv.bias.detach(), bn.running_mean.clone(), bn.running_var.clone(),
                bn.weight.detach(), bn.bias.detach())
        gm = trace(functools.partial(_conv_bn, training=training), *args)
        want = gm(*[a.clone() for a in args])
        assert L.strip_bias(gm, where=lambda n: True) == 1
        torch.testing.assert_close(gm(*[a.clone() for a in args]), want, rtol=1e-5, atol=1e-5)


def _conv_gn_residual(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor,
                      s: torch.Tensor) -> torch.Tensor:
    y = F.conv2d(x, w, b)
    z = F.hardswish(torch.tanh(F.group_norm(y, 2, g, s)))
    return torch.logsumexp(y + z, dim=1, keepdim=True)


def _conv_leaky_pool(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    y = F.leaky_relu(F.leaky_relu(F.conv_transpose3d(x, w, b, 2, 1, 1), 0.2) * m, 0.2)
    return F.max_pool3d(y, 2)


@pytest.mark.parametrize("case", ["gn_and_residual", "leaky_relu"])
def test_the_bias_moves_where_its_readers_are_of_several_kinds(case: str) -> None:
    """A convolution read by a GroupNorm and by a residual add (KernelBench level 2's
    Conv2d_GroupNorm_Tanh_HardSwish_ResidualAdd_LogSumExp), and one read by a LeakyReLU (no
    pointwise tag in torch 2.11: ConvTranspose3d_LeakyReLU_Multiply_LeakyReLU_Max): the bias moves
    to the regions after it (one add both read); values as eager's."""
    if case == "gn_and_residual":
        f, xs = _conv_gn_residual, [_r(2, 3, 9, 7), _r(4, 3, 3, 3, seed=1), _r(4, seed=2), _r(4, seed=3),
                                    _r(4, seed=4)]
    else:
        f, xs = _conv_leaky_pool, [_r(2, 3, 3, 4, 5), _r(3, 4, 3, 3, 3, seed=1), _r(4, seed=2),
                                   _r(4, 1, 1, 1, seed=3)]
    gm = trace(f, *xs)
    want = f(*xs)
    assert L.strip_bias(gm, where=lambda n: True) == 1
    (conv,) = _convs(gm)
    (add,) = conv.users
    assert conv.args[2] is None and add.target is aten.add.Tensor
    regions = RG.form_regions(gm.graph)
    assert any(add in fr.nodes for fr in regions)
    env = values(gm, *xs)
    assert sum(check_region(fr, env) for fr in regions) >= 1
    torch.testing.assert_close(gm(*xs), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_optimize_with_the_bias_moved_and_channels_last(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Conv2d with a bias, then ReLU and a scale: with the bias moved and the layout forced (the GPU
    decides both), optimize's end-to-end check passes and, in training, every gradient (the
    bias's too) matches eager's."""
    import torch.nn as nn

    from solforge import optimize

    monkeypatch.setattr(L, "node_times", lambda n: WINS)
    monkeypatch.setattr(L, "on_cuda", lambda n: True)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 5, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.conv(x)) * 0.5

    torch.manual_seed(0)
    model = Net().to(DEVICE)
    train = mode == "train"
    x = _r(2, 3, 7, 9).requires_grad_(train)
    opt, report = optimize(model, (x,), mode=mode, budget=1, max_candidates=1, db=False, profile="off",
                           keep_slower=True, make_inputs=lambda s: (_r(2, 3, 7, 9, seed=s).requires_grad_(train),))
    assert report.e2e is not None and report.e2e.passed, report.notes
    assert any("run channels-last" in n for n in report.notes), report.notes
    assert any("1 bias(es) added in the region after the convolution" in n for n in report.notes), report.notes
    assert any(n.startswith("convolution layout: 1 convolution(s) channels-last: 100 µs as written")
               for n in report.notes), report.notes  # the decision, with its times
    assert any(r.family == "generated" and r.verified for r in report.regions), report.regions
    if train:
        assert report.e2e.grads_compared == 2, report.e2e  # the weight's and the bias's
    fresh = _r(2, 3, 7, 9, seed=11)
    with torch.no_grad():
        torch.testing.assert_close(opt(fresh), model(fresh), rtol=1e-5, atol=1e-5)


def _chain(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """conv -> bias -> ReLU -> max-pool -> scale (a broadcast input) -> conv -> ReLU (AlexNet's shape)."""
    y = F.max_pool2d(torch.relu(F.conv2d(x, w1, b1, padding=1)), 3, 2) * s
    return torch.relu(F.conv2d(y, w2))


CHAIN = [_r(2, 3, 13, 11), _r(6, 3, 3, 3, seed=1), _r(6, seed=2), _r(5, 6, 3, 3, seed=3), _r(1, 6, 1, 1, seed=4)]


def test_copies_between_two_channels_last_convolutions_cancel() -> None:
    """Between two rewritten convolutions the copy back and the copy in go when every op on the way
    keeps the memory order: the pool and the pointwise ops run channels-last (their fake values
    say so), only the graph's first input and its output are copied, and the values are eager's."""
    gm = trace(_chain, *CHAIN)
    want = _chain(*CHAIN)
    first, second = _convs(gm)
    assert L._groups(gm.graph) == ([[first, second]], {second})  # one island: the second's copy in cancels
    assert L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: True) == 2
    first, second = _convs(gm)
    assert second.args[0].target is not aten.clone.default  # the copy in is gone
    copies = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    # the graph input's copy, two weights' copies, the copy back after the second convolution
    assert len(copies) == 4, [n.format_node() for n in copies]
    pool = next(n for n in gm.graph.nodes if n.target is aten.max_pool2d_with_indices.default)
    assert pool.meta["val"][0].is_contiguous(memory_format=torch.channels_last)
    env = values(gm, *CHAIN)
    assert env[pool][0].is_contiguous(memory_format=torch.channels_last)  # it really ran that way
    _strides_as_planned(gm, env)
    got = gm(*CHAIN)
    got = got[0] if isinstance(got, tuple | list) else got
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the regions on the way read and write channels-last, checked against fp64
    for fr in RG.form_regions(gm.graph):
        assert check_region(fr, env) >= 1


def test_a_value_read_elsewhere_keeps_its_copies() -> None:
    """A value on the way that a training graph returns (or saves for its backward) keeps the copy
    back: its layout is what the rest of the program expects. In an inference graph the island
    holds and the returned value gets a copy out of its own, before the output."""
    def f(x, w1, b1, w2, s):  # noqa: ANN001, ANN202
        r = torch.relu(F.conv2d(x, w1, b1, padding=1))
        return F.conv2d(r * s, w2), r

    want = f(*CHAIN)
    for training in (True, False):
        gm = trace(f, *CHAIN)
        gm.meta["grad_enabled"] = training
        assert L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: True) == 2
        second = _convs(gm)[1]
        assert (second.args[0].target is aten.clone.default) is training
        _strides_as_planned(gm, values(gm, *CHAIN))
        got = gm(*CHAIN)
        for g, w in zip(got, want, strict=True):
            assert g.stride() == w.stride()
            torch.testing.assert_close(g, w, **CONV_TOL)


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_optimize_a_channels_last_chain(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    import torch.nn as nn

    from solforge import optimize

    monkeypatch.setattr(L, "node_times", lambda n: WINS)
    monkeypatch.setattr(L, "on_cuda", lambda n: True)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.c2(F.max_pool2d(torch.relu(self.c1(x)), 3, 2) * 0.5))

    torch.manual_seed(0)
    model = Net().to(DEVICE)
    train = mode == "train"
    x = _r(2, 3, 13, 11).requires_grad_(train)
    opt, report = optimize(model, (x,), mode=mode, budget=1, max_candidates=1, db=False, profile="off",
                           keep_slower=True, make_inputs=lambda s: (_r(2, 3, 13, 11, seed=s).requires_grad_(train),))
    assert report.e2e is not None and report.e2e.passed, report.notes
    if train:
        assert report.e2e.grads_compared == 4, report.e2e
    fresh = _r(2, 3, 13, 11, seed=11)
    with torch.no_grad():
        got = opt(fresh)
        torch.testing.assert_close(got, model(fresh), rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()


class _Block(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        nn = torch.nn
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + x)


class _ResNet(torch.nn.Module):
    """A stem (conv, bias, ReLU, max-pool), two residual blocks with eval BatchNorm, a global
    average pool and a linear head: odd spatial sizes."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.stem, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 5)
        self.blocks = nn.Sequential(_Block(8), _Block(8))
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(F.max_pool2d(torch.relu(self.stem(x)), 2))
        return self.fc(F.adaptive_avg_pool2d(y, 1).flatten(1))


def test_a_resnet_runs_channels_last_between_its_input_and_its_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every convolution channels-last (forced), the residual adds and eval BatchNorms inside the
    island: one copy in at the graph's input, one copy out before the average pool, the weights'
    copies, and nothing else; optimize's end-to-end check passes and the outputs are eager's."""
    from solforge import capture, optimize

    # the stem alone is no faster channels-last (its input's copy counted); the blocks' convolutions
    # are: the island goes channels-last as a whole (5 x 100 against 100 + 10 + 4 x 60)
    seen: list[Any] = []

    def times(n: Any) -> L.ConvTimes:  # asked again for a node: the same answer (the pass's are cached)
        if n not in seen:
            seen.append(n)
        return L.ConvTimes(plain=100.0, last=100.0 if n is seen[0] else 60.0, copy_in=10.0, copy_back=10.0)

    monkeypatch.setattr(L, "node_times", times)
    monkeypatch.setattr(L, "on_cuda", lambda n: True)
    torch.manual_seed(0)
    model = _ResNet().to(DEVICE).eval()
    x = _r(2, 3, 15, 13)
    with torch.no_grad():
        b = capture.capture(model, (x,))
    (g,) = b.graphs
    assert g.conv_layouts == 5 and len(seen) == 5
    copies = [n for n in g.aten.graph.nodes if n.target is aten.clone.default]
    outs = [n for n in copies if n.kwargs.get("memory_format") == torch.contiguous_format]
    assert len(copies) == 1 + 5 + 1 and len(outs) == 1, [n.format_node() for n in copies]
    (pool,) = outs[0].users
    assert "pool" in str(pool.target) or pool.target is aten.mean.dim, pool.format_node()
    # the same net traced here (its weights and statistics inputs): every value runs with its
    # planned strides
    state = dict(model.state_dict())
    names = list(state)

    def net(t: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, dict(zip(names, ps, strict=True)), (t,))

    args = [x, *(state[k].detach() for k in names)]
    gm = trace(net, *args)
    assert L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: True) == 5
    assert sum(n.target is aten.clone.default and n.kwargs.get("memory_format") == torch.contiguous_format
               for n in gm.graph.nodes) == 1
    _strides_as_planned(gm, values(gm, *args))
    torch.compiler.reset()
    with torch.no_grad():
        opt, report = optimize(model, (x,), budget=1, max_candidates=1, db=False, profile="off", keep_slower=True,
                               make_inputs=lambda s: (_r(2, 3, 15, 13, seed=s),))
        assert report.e2e is not None and report.e2e.passed, report.notes
        fresh = _r(2, 3, 15, 13, seed=11)
        torch.testing.assert_close(opt(fresh), model(fresh), rtol=1e-5, atol=1e-5)


def test_an_island_whose_ends_would_not_be_channels_last_stays() -> None:
    """`y + conv(x)` with y an NCHW input: the sum comes out NCHW (the first operand's layout), so
    the next convolution would not read channels-last what its fake value says it reads: the copies
    stay, and every value runs with the strides it was planned with."""
    def f(x, w1, y, w2):  # noqa: ANN001, ANN202
        return F.conv2d(torch.relu(y + F.conv2d(x, w1, padding=1)), w2)

    xs = [_r(2, 3, 9, 7), _r(6, 3, 3, 3, seed=1), _r(2, 6, 9, 7, seed=2), _r(4, 6, 3, 3, seed=3)]
    gm = trace(f, *xs)
    assert L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: True) == 2
    second = _convs(gm)[1]
    assert second.args[0].target is aten.clone.default  # its copy in stayed
    env = values(gm, *xs)
    _strides_as_planned(gm, env)
    got = gm(*xs)
    torch.testing.assert_close(got[0] if isinstance(got, tuple | list) else got, f(*xs), rtol=1e-5, atol=1e-5)



class _Inception(torch.nn.Module):
    """An Inception module (KernelBench level 3's sixth problem, small): four branches read one
    input, two of them through a 1x1 reduction first, and their results are concatenated."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.b1 = nn.Conv2d(6, 4, 1)
        self.b3 = nn.Sequential(nn.Conv2d(6, 3, 1), nn.Conv2d(3, 5, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(6, 2, 1), nn.Conv2d(2, 3, 5, padding=2))
        self.bp = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(6, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1)


def test_an_inception_module_shares_its_input_copy_and_fuses_its_concatenation() -> None:
    """The three convolutions that read the module's input share one channels-last copy of it (the
    timing counts it once); the branches' copies back fuse into the concatenation's region (the
    timing leaves them out) and, going together, leave it channels-last with one copy out before
    the output, in the same region (the biases moved there too); values and strides are eager's."""
    torch.manual_seed(0)
    m = _Inception().to(DEVICE).eval()
    x = _r(2, 6, 9, 7)
    state = dict(m.state_dict())
    names = list(state)

    def net(t: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(m, dict(zip(names, ps, strict=True)), (t,))

    args = [x, *(state[k].detach() for k in names)]
    gm = trace(net, *args)
    fuses = {c.name: L.copy_back_fuses(c) for c in _convs(gm)}
    assert sum(fuses.values()) == 4, fuses  # the branches' last convolutions feed the cat
    # in graph order: b1 and b3's and b5's reductions read the input (one copy in for the three),
    # b3's 3x3 and b5's 5x5 are fed by them; the pool branch's reads the pool's result
    b1, b3r, b3, b5r, b5, bp = _convs(gm)
    assert L._groups(gm.graph) == ([[b1, b3r, b3, b5r, b5], [bp]], {b3, b5})
    assert L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: True) == 6
    cl = [n for n in gm.graph.nodes if n.target is aten.clone.default
          and n.kwargs.get("memory_format") == torch.channels_last and n.args[0].op == "placeholder"
          and n.args[0].name == gm.graph.find_nodes(op="placeholder")[0].name]
    assert len(cl) == 1 and len(cl[0].users) == 3  # one copy of the input, three readers
    env = values(gm, *args)
    _strides_as_planned(gm, env)
    got, want = gm(*args), m(x)
    got = got[0] if isinstance(got, tuple | list) else got
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, **CONV_TOL)
    # the branches' copies back went together (alone, each would have made the concatenation
    # contiguous): the cat runs channels-last, and one copy out before the output is in its region
    backs = [n for n in gm.graph.nodes if n.target is aten.clone.default
             and n.kwargs.get("memory_format") == torch.contiguous_format]
    assert len(backs) == 1 and backs[0].args[0].target is aten.cat.default, [n.format_node() for n in backs]
    regions = RG.form_regions(gm.graph)
    (catr,) = [fr for fr in regions if any(n.target is aten.cat.default for n in fr.nodes)]
    assert backs[0] in catr.nodes
    for fr in regions:
        assert check_region(fr, env) >= 1


class _Dense(torch.nn.Module):
    """Two DenseNet layers (BatchNorm, ReLU, convolution, then the features concatenated with the
    input), a transition's average pool: odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layers = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(4 + 3 * i), nn.ReLU(), nn.Conv2d(4 + 3 * i, 3, 3,
                                                                                                   padding=1))
                                    for i in range(2))
        for mod in self.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return F.avg_pool2d(x, 2)


def test_a_dense_block_runs_channels_last_through_its_concatenations() -> None:
    """The concatenations of channels-last features stay channels-last: after the stem's input
    copy, no copy until the graph's output (the pool, then the one copy back); values and strides
    are eager's."""
    torch.manual_seed(0)
    m = _Dense().to(DEVICE).eval()
    x = _r(2, 3, 9, 7)
    state = dict(m.state_dict())
    names = list(state)

    def net(t: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(m, dict(zip(names, ps, strict=True)), (t,))

    args = [x, *(state[k].detach() for k in names if state[k].is_floating_point())]
    names = [k for k in names if state[k].is_floating_point()]
    gm = trace(net, *args)
    assert L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: True) == 3
    copies = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    backs = [n for n in copies if n.kwargs.get("memory_format") == torch.contiguous_format]
    assert len(copies) == 1 + 3 + 1 and len(backs) == 1, [n.format_node() for n in copies]
    env = values(gm, *args)
    _strides_as_planned(gm, env)
    cats = [n for n in gm.graph.nodes if n.target is aten.cat.default]
    assert all(env[c].is_contiguous(memory_format=torch.channels_last) for c in cats)
    got, want = gm(*args), m(x)
    got = got[0] if isinstance(got, tuple | list) else got
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, **CONV_TOL)


def test_the_copy_size_that_makes_a_region_is_the_planners() -> None:
    """A copy the layout decision times as a plain copy is one plan/generated.py makes a region of."""
    from solforge.plan import generated

    assert L.RELAYOUT_BYTES == generated.RELAYOUT_MIN_BYTES


def test_hardswish_is_pointwise_for_the_capture_passes() -> None:
    """aten.hardswish carries no pointwise tag: a convolution read by it still gets its bias moved."""
    f = lambda x, w, b: F.hardswish(F.conv2d(x, w, b)) * 2.0  # noqa: E731
    xs = [_r(2, 3, 9, 7), _r(5, 3, 3, 3, seed=1), _r(5, seed=2)]
    gm = trace(f, *xs)
    assert L.strip_bias(gm, where=lambda n: True) == 1
    torch.testing.assert_close(gm(*xs), f(*xs), rtol=1e-5, atol=1e-5)


CHANNEL_REDUCTIONS: dict[str, tuple[Any, bool]] = {
    # (what reads the convolution, whether it reduces across the channels)
    "group_norm": (lambda y: F.group_norm(F.silu(y), 2) * 2.0, True),
    "layer_norm_chw": (lambda y: F.layer_norm(torch.relu(y), y.shape[1:]), True),
    "mean_chw": (lambda y: torch.sigmoid(y).mean((1, 2, 3)), True),
    "instance_like": (lambda y: F.group_norm(torch.relu(y), 6), False),  # one group per channel: H, W only
    "mean_hw": (lambda y: torch.tanh(y).mean((2, 3)), False),
    "softmax_c": (lambda y: torch.softmax(torch.relu(y), 1), False),
}


@pytest.mark.parametrize("case", list(CHANNEL_REDUCTIONS))
def test_a_copy_back_into_a_reduction_across_the_channels_is_materialized(case: str) -> None:
    """A GroupNorm (or LayerNorm, mean) over C and H, W after a channels-last convolution would read
    it strided by C: the decision counts the copy back (it does not fuse), and the reduction's
    input (the pointwise op after the copy back) is marked, so the copy back and that op are one
    region writing NCHW and the reduction reads it from memory; a reduction over H, W alone (or
    over C alone) reads a channels-last tensor well and takes the copy in. Values as eager's."""
    after, across = CHANNEL_REDUCTIONS[case]
    x, w = _r(2, 3, 9, 7), _r(6, 3, 3, 3, seed=1)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return after(F.conv2d(x, w))

    gm = trace(f, x, w)
    (conv,) = _convs(gm)
    assert L.into_a_channel_reduction(conv) is across
    # channels-last wins by 5 + 1 against 100 when the copy back fuses, loses by 5 + 1 + 95 when not
    times = L.ConvTimes(plain=100.0, last=5.0, copy_in=1.0, copy_back=95.0)
    assert L.islands(gm, lambda n: times) == (set() if across else {conv})
    L.channels_last_convolutions(gm, decide=lambda n: True, strip=lambda n: False)
    marked = [n for n in gm.graph.nodes if n.meta.get(L.MATERIALIZE)]
    regions = RG.form_regions(gm.graph)
    if across:  # the reduction's input: a region's output (the copy back and the pointwise op), read from memory
        (a,) = marked
        assert any(a in fr.outputs for fr in regions) and not any(a in fr.nodes and a not in fr.outputs
                                                                  for fr in regions)
        assert any(n.target is aten.clone.default for fr in regions if a in fr.nodes for n in fr.nodes)
    else:
        assert not marked
    env = values(gm, x, w)
    for fr in regions:
        check_region(fr, env)
    torch.testing.assert_close(gm(x, w), f(x, w), rtol=1e-5, atol=1e-5)


def test_optimize_a_channels_last_convolution_into_a_group_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conv2d -> SiLU -> GroupNorm (fewer groups than channels), the layout forced: the GroupNorm's
    generated region reads the NCHW SiLU output the copy back's region writes (not the
    channels-last convolution), and optimize's end-to-end check passes with eager's values."""
    import torch.nn as nn

    from solforge import optimize

    monkeypatch.setattr(L, "node_times", lambda n: WINS)
    monkeypatch.setattr(L, "on_cuda", lambda n: True)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(F.silu(self.conv(x))) * 2.0

    torch.manual_seed(0)
    model = Net().to(DEVICE).eval()
    x = _r(2, 3, 7, 9)
    opt, report = optimize(model, (x,), budget=1, max_candidates=1, db=False, profile="off", keep_slower=True,
                           make_inputs=lambda s: (_r(2, 3, 7, 9, seed=s),))
    assert report.e2e is not None and report.e2e.passed, report.notes
    assert any("run channels-last" in n for n in report.notes), report.notes
    generated = [r for r in report.regions if r.family == "generated"]
    assert len(generated) >= 2 and all(r.verified for r in generated), report.regions
    with torch.no_grad():
        fresh = _r(2, 3, 7, 9, seed=11)
        torch.testing.assert_close(opt(fresh), model(fresh), rtol=1e-5, atol=1e-5)
