"""The "generated" family end to end: regions no hand-written family claims get a generated, tuned,
verified kernel swapped into the model (KernelBench level-1/2 shapes, tiny), forward and training;
the op's backward against eager; regions found again by key in a fresh registry; the database hit
for the same region in another model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from codegen_helpers import trace
from conftest import DEVICE

from solforge import optimize, settings
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import store
from solforge.kernels import generated as G
from solforge.numerics import compare
from solforge.runtime.stepgraphs import step_graphs


@pytest.fixture(autouse=True)
def _private_codegen_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SOLFORGE_CODEGEN_DIR", str(tmp_path / "codegen"))


def _r(*shape: int, seed: int = 0, grad: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return x.requires_grad_(grad)


def _generated(opt: object) -> int:
    stats = opt.solforge_stats  # type: ignore[attr-defined]
    return sum(n for k, n in {**stats.replaced, **stats.untuned, **stats.stored}.items() if k.startswith("generated["))


def _run(model: nn.Module, *xs: torch.Tensor, mode: str = "inference", families: tuple[str, ...] | None = None,
         db: object = False, expect: int = 1) -> tuple[object, object]:
    model = model.to(DEVICE)
    # keep_slower: every verified kernel enters the model, on a GPU too, where at these tiny sizes a
    # kernel or the whole model may not beat eager (its check must pass all the same: asserted below)
    opt, report = optimize(model, xs, mode=mode, budget=1, max_candidates=1, db=db, profile="off",
                           families=families, keep_slower=True, make_inputs=lambda s: tuple(
                               _r(*x.shape, seed=s, grad=x.requires_grad) for x in xs))
    assert report.e2e is not None and report.e2e.passed, (report.e2e, report.notes)
    assert _generated(opt) == expect, (opt.solforge_stats, report.notes)  # type: ignore[attr-defined]
    fresh = tuple(_r(*x.shape, seed=7) for x in xs)
    with torch.no_grad():
        got, want = opt(*fresh), model(*fresh)
    c = compare(got, want)
    assert c.ok, c.reason
    return opt, report


class _L2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.norm(x, p=2, dim=1, keepdim=True)


class _MSE(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(a, b)


class _LogSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=1)


class _GemmGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 40, bias=False)
        self.bias = nn.Parameter(torch.randn(40))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.lin(x) + self.bias, approximate="tanh") * 0.75


class _ConvAddSigmoid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bias = nn.Parameter(torch.randn(8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv(x) + self.bias) * 2.0


class _PostNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(48, 48)
        self.norm = nn.LayerNorm(48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + 0.5 * self.lin(x))


def test_group_norm() -> None:
    _run(nn.GroupNorm(4, 8), _r(2, 8, 6, 7))


def test_batch_norm_eval() -> None:
    m = nn.BatchNorm2d(8)
    m.running_mean.uniform_(-1, 1)
    m.running_var.uniform_(0.5, 2)
    _run(m.eval(), _r(2, 8, 6, 7))


def test_mse_loss_and_log_softmax_and_l2() -> None:
    _run(_MSE(), _r(8, 161), _r(8, 161, seed=1))
    _run(_LogSoftmax(), _r(8, 161))
    _run(_L2(), _r(8, 161))


def test_gemm_bias_gelu_scale_chain() -> None:
    # the gelu family claims the bias add and the gelu; the generator the whole chain when it alone runs
    _run(_GemmGelu(), _r(37, 24), families=("generated",))


def test_conv_add_sigmoid_conv_stays() -> None:
    _run(_ConvAddSigmoid(), _r(2, 3, 9, 9))


def test_scaled_residual_post_layernorm() -> None:
    # alone, the generator takes the scaled residual add with the LayerNorm (decomposed) as one region
    _run(_PostNorm(), _r(3, 5, 48), families=("generated",))


def test_training_gradients_match() -> None:
    """Train mode: the conv's add, sigmoid and scale, the GroupNorm and the loss after it are one
    generated region (the pointwise ops are recomputed in the norm's passes); validate compares every
    parameter's gradient with eager's."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = _ConvAddSigmoid()
            self.norm = nn.GroupNorm(2, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv(x)).sin().sum()

    _, report = _run(Net(), _r(2, 3, 9, 9), mode="train")
    assert report.e2e.grads_compared == 5, report.e2e  # type: ignore[attr-defined]


def test_batch_norm_train_stays_whole() -> None:
    """BatchNorm in training updates its running statistics in place: its decomposition's copy_ is an
    anchor, so no region takes the op (it runs as the model ran it), and the statistics still move."""
    m = nn.BatchNorm2d(8).to(DEVICE)
    x = _r(2, 8, 6, 7)
    opt, report = optimize(m, (x,), mode="train", budget=1, max_candidates=1, db=False, profile="off")
    assert all(r.family != "generated" for r in report.regions)
    before = m.running_mean.clone()
    opt(_r(2, 8, 6, 7, seed=3)).sum().backward()
    assert not torch.equal(before, m.running_mean)


@pytest.mark.parametrize("case", ["norm_div", "softmax_mul", "var_mean"])
def test_op_backward_matches_eager(case: str) -> None:
    fns = {
        "norm_div": lambda x, w: F.gelu(x.t() * w[:, None]) / torch.norm(x.t(), dim=1, keepdim=True),  # strided
        "softmax_mul": lambda x, w: torch.softmax(x * w, -1) * x,
        "var_mean": lambda x, w: (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5) * w,
    }
    f = fns[case]
    x, w = _r(13, 24), _r(24, seed=1)
    (fr,) = RG.form_regions(trace(f, x, w).graph)
    key = G.workload_for(fr.lowered.ir).param("key")
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    (out,) = torch.ops.solforge.generated.default([xa, wa], key, "")
    dy = _r(*out.shape, seed=2)
    out.backward(dy)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    f(xe, we).backward(dy)
    for a, b in ((xa.grad, xe.grad), (wa.grad, we.grad)):
        c = compare(a, b)
        assert c.ok, c.reason


def test_region_from_key_alone(tmp_path: Path) -> None:
    """Another process has only the key: the region comes back from the file, checked against its key."""
    x = _r(6, 40).t()  # strided input: the key holds the strides
    (fr,) = RG.form_regions(trace(lambda t: torch.sigmoid(t) * t.amax(-1, keepdim=True), x).graph)
    wl = G.workload_for(fr.lowered.ir)
    key = wl.param("key")
    with settings.override(codegen_dir=tmp_path):  # the damaged copy below stays in tmp_path
        _key_alone(fr, wl, key, x)


def _key_alone(fr: RG.Formed, wl: Any, key: str, x: torch.Tensor) -> None:
    store.save(fr.lowered.ir)
    store._IRS.clear()
    store._LOWERED.clear()
    ir = store.load(key)
    assert ir == fr.lowered.ir and ir.key == key
    (xs, kw) = G.make_inputs(wl, seed=0)
    assert xs[0].stride() == x.stride()
    (got,) = G.generated(*xs, **kw)
    (ref,) = G.generated_ref(*xs, **kw)
    assert compare(got, ref).ok
    path = store.path_of(key)
    path.write_text(path.read_text().replace("aten.sigmoid", "aten.tanh"))
    store._IRS.clear()
    store._LOWERED.clear()
    with pytest.raises(ValueError, match="another region"):
        store.load(key)


def test_same_region_in_two_models_hits_the_database(tmp_path: Path) -> None:
    class A(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _L2()(x) * 3.0

    class B(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = 3.0

        def forward(self, y: torch.Tensor) -> torch.Tensor:
            return y / y.norm(dim=1, keepdim=True) * self.scale

    db = tmp_path / "k.db"
    _, first = _run(A(), _r(8, 161), db=db)
    _, second = _run(B(), _r(8, 161, seed=5), db=db)
    (r1,), (r2,) = first.regions, second.regions  # type: ignore[attr-defined]
    assert r1.family == r2.family == "generated" and r1.workload == r2.workload
    assert r1.source == "tuned" and r2.source == "database" and r2.candidates == 0


def test_training_runs_the_generated_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Train mode, a region whose vjp is one region: its backward is tuned and verified as a
    generated_bwd workload, the op's backward runs that kernel (its key's kernel is launched in
    the backward, not only the numbers agree) and every gradient matches eager's."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(24, 40, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return torch.log_softmax(h * 1.5, -1) * torch.sigmoid(h)

    net = Net()
    opt, report = _run(net, _r(37, 24), mode="train", families=("generated",))
    (bwd,) = [r for r in report.regions if r.family == "generated_bwd"]  # type: ignore[attr-defined]
    assert bwd.verified and bwd.integrated, bwd
    ran: list[str] = []
    real = RT.run
    monkeypatch.setattr(RT, "run", lambda region, *a, **k: ran.append(region.ir.key) or real(region, *a, **k))
    x, dy = _r(37, 24, seed=4), _r(37, 40, seed=5)
    with step_graphs(False):  # run as it is: a step replayed from a CUDA graph (a GPU) calls no launcher
        opt(x).backward(dy)  # type: ignore[operator]
    bwl = G.backward_workload(G.workload_for(store.load(ran[0])))
    assert bwl is not None and bwl.key == bwd.workload
    assert ran == [ran[0], bwl.param("key")], ran
    got = net.lin.weight.grad.clone()
    net.zero_grad()
    net(x).backward(dy)
    c = compare(got, net.lin.weight.grad)
    assert c.ok, c.reason


def test_region_without_inputs(tmp_path: Path) -> None:
    """A region computed from generators alone (a causal mask built from two aranges, as a traced
    transformers model builds it) has no inputs: it is tuned, stored in the database and verified
    like any other (its label once crashed the database write)."""
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[-1]
            i = torch.arange(n, device=x.device)
            bias = torch.where(i[:, None] >= i[None, :], 0.0, -1e4).to(x.dtype) * 0.5
            return x @ bias

    _, report = _run(Masked(), _r(3, 67), db=tmp_path / "k.db")
    (r,) = report.regions  # type: ignore[attr-defined]
    assert r.family == "generated" and r.label == "no inputs" and r.verified, r


@pytest.mark.parametrize("case", ["channels_last", "permuted_contiguous"])
def test_a_lone_copy_that_changes_the_memory_order_is_a_region(case: str) -> None:
    """A copy that changes which dim is contiguous (NCHW -> channels-last, contiguous() of a permuted
    view) alone is worth a kernel: eager's copy kernel is strided on one side. A plain copy, or one
    that keeps the innermost dim, is not."""
    class Relayout(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if case == "channels_last":
                return x.contiguous(memory_format=torch.channels_last)
            return x.permute(0, 2, 3, 1).contiguous()

    class Copy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

    class KeepsInner(nn.Module):  # attention's transpose: the innermost dim stays contiguous
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2).contiguous()

    x = _r(2, 65, 33, 31)  # past RELAYOUT_MIN_BYTES (a small one, a weight's copy, is not a region)
    opt, _ = _run(Relayout(), x)
    got = opt(x)
    want = Relayout()(x)
    assert got.stride() == want.stride()  # the kernel writes the copy's memory order
    for plain, y in ((Copy(), x), (KeepsInner(), x), (Relayout(), _r(3, 5, 7, 11))):
        _, report = optimize(plain, (y,), budget=1, max_candidates=1, db=False, profile="off")
        assert not report.regions and report.returned == "original", report.notes


def test_a_lone_max_pool_whose_indices_nothing_reads_is_a_region() -> None:
    """A max pool alone is worth a kernel when nothing reads its indices (eager's kernel writes them,
    int64, a generated one does not); a lone ReLU is not, nor is a pool whose indices are returned."""
    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.max_pool2d(x, 3, stride=2, padding=1)

    class PoolIndices(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)

    class Relu(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x)

    class Pool1d(nn.Module):  # its indices squeezed by a view nothing reads
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.max_pool1d(x, 4, stride=2)

    x = _r(2, 7, 37, 29)
    opt, _ = _run(Pool(), x)
    assert torch.equal(opt(x), Pool()(x))
    y = _r(3, 7, 301)
    opt, _ = _run(Pool1d(), y)
    assert torch.equal(opt(y), Pool1d()(y))
    for plain in (PoolIndices(), Relu()):
        _, report = optimize(plain, (x,), budget=1, max_candidates=1, db=False, profile="off")
        assert not report.regions and report.returned == "original", report.notes


@pytest.mark.parametrize("case", ["1d", "2d", "3d"])
def test_a_lone_average_pool_is_a_region(case: str) -> None:
    """An average pool alone is worth a kernel (eager's is not one pass at bandwidth where windows
    overlap): a padded 1-D pool at stride 1 (level 1's 44), a 2-D one that counts the padding and
    one with ceil_mode, a 3-D one that does not count it; odd sizes. Each matches eager."""
    pools = {
        "1d": (lambda x: F.avg_pool1d(x, 8, stride=1, padding=4), (2, 5, 301)),
        "2d": (lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True), (2, 7, 37, 29)),
        "3d": (lambda x: F.avg_pool3d(x, 3, stride=2, padding=1, count_include_pad=False), (2, 3, 9, 11, 13)),
    }
    fn, shape = pools[case]

    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(x)

    x = _r(*shape)
    opt, _ = _run(Pool(), x)
    torch.testing.assert_close(opt(x), Pool()(x), rtol=1e-5, atol=1e-6)


def test_edge_rows_verify_a_generated_region() -> None:
    """A generated region's verification has edge trials (an all-zero, a constant and a spike row of
    its largest floating input), drawn when they run: the real kernel passes them, a launcher that is
    right on random rows but drops an RMSNorm's eps (NaN on a zero row) is rejected by the zero row,
    and one that clamps a pointwise chain's output at 20 (random rows reach ~9) by the spike."""
    from solforge.tune.verify import verify

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.silu(x) * 2 + x * w

    def workload(f: Any) -> Any:
        (fr,) = RG.form_regions(trace(f, _r(6, 40), _r(40)).graph)
        return G.workload_for(fr.lowered.ir)

    wl = workload(norm)
    edges = G.edge_inputs(wl, seed=0, device=DEVICE)
    assert [label for label, _, _ in edges] == ["all-zero row", "constant row", "spike row"]
    assert all(callable(make) for _, make, _ in edges)  # drawn when the trial runs
    with torch.device("meta"):  # past LARGE_BYTES of inputs: the all-zero row alone
        (big,) = RG.form_regions(trace(norm, torch.empty(1 << 16, 1 << 13), torch.empty(1 << 13)).graph)
    assert [label for label, _, _ in G.edge_inputs(G.workload_for(big.lowered.ir), seed=0)] == ["all-zero row"]
    args, _ = edges[0][1]()
    assert bool((args[0][0] == 0).all()) and bool((args[0][1] != 0).all())  # x's first row, x the largest

    def no_eps(*ins: torch.Tensor, key: str, out: Any = None) -> Any:
        got = G.generated(*ins, key=key, out=out)
        zero = (ins[0] == 0).all(-1, keepdim=True)
        for o in got:
            o.copy_(torch.where(zero, float("nan"), o))
        return got

    def clamped(*ins: torch.Tensor, key: str, out: Any = None) -> Any:
        got = G.generated(*ins, key=key, out=out)
        for o in got:
            o.clamp_(-20, 20)
        return got

    for f, bad, case in ((norm, no_eps, "all-zero row"), (chain, clamped, "spike row")):
        wl = workload(f)
        v = verify(G, wl, G.generated, device=DEVICE)
        assert v.passed, v.reason
        v = verify(G, wl, bad, device=DEVICE)
        assert not v.passed and case in (v.reason or ""), (case, v.reason)


def test_edge_rows_skip_an_expanded_input() -> None:
    """An input expanded along its last dim (stride 0) has no row of its own to rewrite: the edge
    rows go to the next largest input, and the real kernel passes them."""
    from solforge.tune.verify import verify

    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + b) * 2

    x, b = _r(6, 1).expand(6, 40), _r(40)
    (fr,) = RG.form_regions(trace(f, x, b).graph)
    wl = G.workload_for(fr.lowered.ir)
    assert fr.lowered.ir.inputs[0].stride[-1] == 0
    edges = G.edge_inputs(wl, seed=0, device=DEVICE)
    args, _ = edges[0][1]()
    assert bool((args[1] == 0).all())  # b: the input rewritten
    v = verify(G, wl, G.generated, device=DEVICE)
    assert v.passed, v.reason
