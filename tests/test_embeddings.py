"""embeddings.py: training embeddings whose backward adds the gradient into .grad only in the rows
of the tokens present. Every test compares with eager nn.Embedding / F.embedding (bit for bit
where the design says so), and the counters show which path the backward took."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE, requires_gpu
from torch.utils._python_dispatch import TorchDispatchMode

import solforge.integrate.embeddings
import solforge.integrate.linears
import solforge.runtime.accumulate
from solforge import settings
from solforge.integrate import IntegrationStats, integrate
from solforge.integrate.embeddings import COUNTERS, accumulate_rows, embedding

aten = torch.ops.aten
V, H = 37, 13  # odd table; ids drawn from a few values so that most tokens repeat one
ROOT = Path(__file__).resolve().parents[1]


class Lookup(nn.Module):
    """An embedding and a linear after it (the linear makes the graph a real one and gives
    `backward(inputs=...)` something else to differentiate)."""

    def __init__(self, padding_idx: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H, padding_idx=padding_idx, dtype=dtype)
        self.lin = nn.Linear(H, 5, bias=False, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.emb(ids)
        return e, self.lin(e)


def _integrate(model: nn.Module, train: bool = True) -> tuple[Callable[..., Any], IntegrationStats]:
    """Only the compact/linears/embeddings passes: no kernel family."""
    return integrate(model, {}, families=(), train=train)


def _pair(seed: int, **kw: Any) -> tuple[Lookup, Lookup, Callable[..., Any], IntegrationStats]:
    torch.manual_seed(seed)
    ref = Lookup(**kw)
    opt_model = copy.deepcopy(ref)
    return ref, opt_model, *_integrate(opt_model)


def _ids(seed: int, shape: tuple[int, ...] = (3, 7), high: int = 9) -> torch.Tensor:
    """N = 21 ids from 0..8 (many duplicates), a run of one id as well."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, high, shape, generator=g)
    ids.view(-1)[:5] = 4
    return ids


def _dy(seed: int, ids: torch.Tensor, dtype: torch.dtype, width: int = H) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(*ids.shape, width, generator=g).to(dtype)


def _counts() -> tuple[int, int]:
    return COUNTERS.in_place, COUNTERS.handed_back


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = (_bits(a) != _bits(b)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} elements differ, first at {diff[0].tolist()}: {a[tuple(diff[0])]} vs " \
                              f"{b[tuple(diff[0])]}"


def _step(ref: Lookup, optimized: Callable[..., Any], ids: torch.Tensor, dy: torch.Tensor) -> None:
    """One backward through the embedding alone, dy exactly the same for both."""
    ref(ids)[0].backward(dy)
    optimized(ids)[0].backward(dy)


# ---------------------------------------------------------------------------------------------
# bit for bit against eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_accumulated_steps_are_eager_bit_for_bit(dtype: torch.dtype) -> None:
    ref, opt_model, optimized, stats = _pair(0, dtype=dtype)
    before = _counts()
    for step in range(3):  # .grad never zeroed: steps 2 and 3 add into it
        ids = _ids(step)
        _step(ref, optimized, ids, _dy(step, ids, dtype))
        _same_bits(opt_model.emb.weight.grad, ref.emb.weight.grad)
    assert stats.embeddings == 1  # (the graph is compiled, and counted, at the first call)
    in_place, handed_back = (a - b for a, b in zip(_counts(), before, strict=True))
    assert (handed_back, in_place) == (1, 2)  # the first step has no .grad to add to


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [4, 0, -2])  # 4: the most frequent id; -2: nn.Embedding makes it V-2
def test_padding_row_gets_nothing_like_eager(dtype: torch.dtype, padding_idx: int) -> None:
    ref, opt_model, optimized, stats = _pair(1, padding_idx=padding_idx, dtype=dtype)
    pad = ref.emb.padding_idx
    assert pad is not None and pad >= 0
    # .grad held from the start (random, no zeros): every step takes the in-place path
    start = torch.randn(V, H).to(dtype)
    ref.emb.weight.grad, opt_model.emb.weight.grad = start.clone(), start.clone()
    before = _counts()
    for step in range(3):
        ids = _ids(10 + step)
        ids.view(-1)[[2, 7, 11, 20]] = pad  # the padding id present, several times
        _step(ref, optimized, ids, _dy(step, ids, dtype))
        _same_bits(opt_model.emb.weight.grad, ref.emb.weight.grad)
    assert _counts()[0] - before[0] == 3 and stats.embeddings == 1
    _same_bits(opt_model.emb.weight.grad[pad], start[pad])  # eager's +0.0: unchanged


def test_the_design_is_needed_for_bit_identity() -> None:
    """The test above can fail: adding each token's dy into .grad one by one (index_add_ of dy,
    the obvious sparse update) rounds after every token in bf16 and differs from eager."""
    ids = _ids(3, (5, 9))
    dy = _dy(3, ids, torch.bfloat16)
    grad = torch.randn(V, H).to(torch.bfloat16)
    eager = grad + aten.embedding_dense_backward(dy, ids, V, -1, False)
    naive = grad.clone().index_add_(0, ids.view(-1), dy.view(-1, H))
    ours = grad.clone()
    accumulate_rows(ours, dy, ids, -1)
    assert not torch.equal(_bits(naive), _bits(eager))
    _same_bits(ours, eager)


def test_int32_ids_one_token_and_all_distinct() -> None:
    for ids in (torch.tensor([[5]]), torch.randperm(V)[:11].view(1, 11), torch.tensor([[3, 3, 3]])):
        for idx_dtype in (torch.int64, torch.int32):
            i = ids.to(idx_dtype)
            dy = _dy(4, i, torch.bfloat16)
            grad = torch.randn(V, H).to(torch.bfloat16)
            eager = grad + aten.embedding_dense_backward(dy, i, V, -1, False)
            accumulate_rows(grad, dy, i, -1)
            _same_bits(grad, eager)


def test_untouched_rows_keep_a_negative_zero() -> None:
    """The one documented difference: eager adds +0.0 to every row, turning -0.0 into +0.0; rows
    of tokens not present are not touched here. Values equal, only that zero's sign differs."""
    ids = torch.tensor([[1, 2, 2]])
    dy = _dy(5, ids, torch.float32)
    grad = torch.randn(V, H)
    grad[7] = -0.0
    eager = grad + aten.embedding_dense_backward(dy, ids, V, -1, False)
    accumulate_rows(grad, dy, ids, -1)
    assert torch.equal(grad, eager)
    assert torch.signbit(grad[7]).all() and not torch.signbit(eager[7]).any()
    rest = torch.ones(V, dtype=torch.bool)
    rest[7] = False
    _same_bits(grad[rest], eager[rest])


class _SyncOps(TorchDispatchMode):
    """Records the ATen ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append((func, args))
        return func(*args, **(kwargs or {}))


def test_backward_has_no_op_that_waits_for_the_device() -> None:
    """No .item(), nonzero, unique, masked_select or boolean-mask indexing in the in-place backward
    (each makes the host wait for the device on a GPU). The GPU test checks the same with CUDA's
    sync debug mode."""
    w = torch.randn(V, H, requires_grad=True)
    w.grad = torch.randn(V, H)
    ids = _ids(6)
    out = embedding(w, ids, 4)
    with _SyncOps() as mode:
        out.backward(_dy(6, ids, torch.float32))
    names = [str(f) for f, _ in mode.ops]
    assert "aten.embedding_dense_backward.default" in names and "aten.index_copy_.default" in names
    banned = ("nonzero", "_local_scalar_dense", "unique", "masked_select", "item")
    assert not [n for n in names if any(b in n for b in banned)], names
    for f, args in mode.ops:
        if f is aten.index.Tensor:
            assert all(i is None or i.dtype != torch.bool for i in args[1]), "boolean-mask indexing"


def test_weight_changed_in_place_before_backward_like_eager() -> None:
    """Eager's embedding saves only the ids: updating the weight in place between forward and
    backward is allowed there, so it must be here too."""
    w = torch.randn(V, H, requires_grad=True)
    ref = w.detach().clone().requires_grad_(True)
    w.grad = torch.randn(V, H)
    ref.grad = w.grad.clone()
    ids = _ids(92)
    dy = _dy(92, ids, torch.float32)
    outs = embedding(w, ids), F.embedding(ids, ref)
    with torch.no_grad():
        w.mul_(0.5)
        ref.mul_(0.5)
    outs[0].backward(dy)
    outs[1].backward(dy)
    _same_bits(w.grad, ref.grad)


# ---------------------------------------------------------------------------------------------
# where the gradient must go back to autograd


def test_zero_grad_hands_back_then_adds_in_place() -> None:
    ref, opt_model, optimized, _ = _pair(7)
    before = _counts()
    seen = []
    for step in range(4):
        if step % 2 == 0:  # set_to_none (PyTorch's default): nothing to add to
            ref.zero_grad()
            opt_model.zero_grad()
        ids = _ids(20 + step)
        _step(ref, optimized, ids, _dy(step, ids, torch.float32))
        _same_bits(opt_model.emb.weight.grad, ref.emb.weight.grad)
        seen.append(tuple(a - b for a, b in zip(_counts(), before, strict=True)))
    assert seen == [(0, 1), (1, 1), (1, 2), (2, 2)]


def test_autograd_grad_and_backward_inputs_leave_grad_alone() -> None:
    ref, opt_model, optimized, _ = _pair(8)
    ids = _ids(30)
    dy = _dy(30, ids, torch.float32)
    _step(ref, optimized, ids, dy)
    held = opt_model.emb.weight.grad.clone()
    before = _counts()
    # autograd.grad: the weight's gradient goes to the caller, as eager's
    got = torch.autograd.grad(optimized(ids)[0], [opt_model.emb.weight], dy)[0]
    exp = torch.autograd.grad(ref(ids)[0], [ref.emb.weight], dy)[0]
    _same_bits(got, exp)
    # backward(inputs=[the linear's weight]): the embedding's .grad must stay as it was
    optimized(ids)[1].sum().backward(inputs=[opt_model.lin.weight])
    _same_bits(opt_model.emb.weight.grad, held)
    in_place, handed_back = (a - b for a, b in zip(_counts(), before, strict=True))
    assert in_place == 0 and handed_back == 1  # the second call never needed the weight's gradient


def test_a_tensor_hook_sees_eager_gradient() -> None:
    ref, opt_model, optimized, _ = _pair(9)
    seen: dict[str, list[torch.Tensor]] = {"ref": [], "opt": []}
    ref.emb.weight.register_hook(lambda g: seen["ref"].append(g.clone()))
    opt_model.emb.weight.register_hook(lambda g: seen["opt"].append(g.clone()))
    before = _counts()
    for step in range(2):
        ids = _ids(40 + step)
        _step(ref, optimized, ids, _dy(step, ids, torch.float32))
    assert _counts()[0] == before[0] and _counts()[1] - before[1] == 2
    assert len(seen["opt"]) == 2
    for a, b in zip(seen["opt"], seen["ref"], strict=True):
        _same_bits(a, b)
    _same_bits(opt_model.emb.weight.grad, ref.emb.weight.grad)


class Tied(nn.Module):
    """tie_word_embeddings: the head is the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def test_tied_weight_gets_both_gradients() -> None:
    """Eager sums the lookup's and the head's gradients, then adds that sum to .grad; here the
    head's goes into .grad in its GEMM (linears.py) and the lookup's rows after it: the same terms
    summed in another order, so equal within rounding, not bit for bit."""
    torch.manual_seed(10)
    ref = Tied()
    opt_model = copy.deepcopy(ref)
    optimized, stats = _integrate(opt_model)
    before = _counts()
    for step in range(3):
        ids = _ids(50 + step)
        ref(ids).square().mean().backward()
        optimized(ids).square().mean().backward()
        torch.testing.assert_close(opt_model.emb.weight.grad, ref.emb.weight.grad, rtol=1e-6, atol=1e-7)
    assert _counts()[0] - before[0] == 2 and stats.embeddings == 1 and stats.grouped == 1
    assert opt_model.head.weight is opt_model.emb.weight


# ---------------------------------------------------------------------------------------------
# where nothing is rewritten


def test_switched_off_leaves_the_graph_to_aten() -> None:
    with settings.override(embedding=False):  # the whole test: the backend rewrites at the first call
        ref, opt_model, optimized, stats = _pair(11)
        before = _counts()
        for step in range(2):
            ids = _ids(60 + step)
            _step(ref, optimized, ids, _dy(step, ids, torch.float32))
    _same_bits(opt_model.emb.weight.grad, ref.emb.weight.grad)
    assert stats.embeddings == 0 and _counts() == before


def test_environment_switch_turns_the_rewrite_off() -> None:
    """SOLFORGE_EMBEDDING=0 in a new process's environment: rewrite_embeddings leaves a training
    graph's embedding to aten (1: it rewrites it)."""
    code = ("import torch, torch.fx as fx\n"
            "from solforge.integrate.embeddings import rewrite_embeddings\n"
            "g = fx.Graph(); w = g.placeholder('w'); i = g.placeholder('i')\n"
            "w.meta['requires_grad'] = True\n"
            "g.output(g.call_function(torch.ops.aten.embedding.default, (w, i)))\n"
            "gm = fx.GraphModule({}, g); gm.meta['grad_enabled'] = True\n"
            "print(rewrite_embeddings(gm))")
    for value, rewritten in (("0", "0"), ("1", "1")):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SOLFORGE_EMBEDDING": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == rewritten


def test_grad_in_place_off_hands_every_gradient_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(solforge.runtime.accumulate, "IN_PLACE", False)
    ref, opt_model, optimized, stats = _pair(12)
    before = _counts()
    for step in range(3):
        ids = _ids(70 + step)
        _step(ref, optimized, ids, _dy(step, ids, torch.float32))
    _same_bits(opt_model.emb.weight.grad, ref.emb.weight.grad)
    assert stats.embeddings == 1 and _counts()[0] == before[0] and _counts()[1] - before[1] == 3


def test_frozen_weight_and_inference_graph_are_not_rewritten() -> None:
    torch.manual_seed(13)
    ref = Lookup()
    ref.emb.weight.requires_grad_(False)
    opt_model = copy.deepcopy(ref)
    optimized, stats = _integrate(opt_model)
    ids = _ids(80)
    ref(ids)[1].sum().backward()
    optimized(ids)[1].sum().backward()
    _same_bits(opt_model.lin.weight.grad, ref.lin.weight.grad)
    assert stats.embeddings == 0 and stats.grouped == 1 and opt_model.emb.weight.grad is None

    optimized, stats = _integrate(copy.deepcopy(ref).requires_grad_(True), train=False)
    with torch.no_grad():
        _same_bits(optimized(ids)[0], ref(ids)[0])
    assert stats.graphs == 1 and stats.embeddings == 0


def test_sparse_and_scale_grad_by_freq_are_not_rewritten() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Embedding(V, H, sparse=True)
            self.b = nn.Embedding(V, H, scale_grad_by_freq=True)
            self.c = nn.Embedding(V, H)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.a(ids) + self.b(ids) + self.c(ids)

    torch.manual_seed(14)
    ref = Two()
    opt_model = copy.deepcopy(ref)
    optimized, stats = _integrate(opt_model)
    ids = _ids(90)
    for _ in range(2):
        dy = _dy(90, ids, torch.float32)
        ref(ids).backward(dy)
        optimized(ids).backward(dy)
    assert stats.embeddings == 1  # only c
    assert opt_model.a.weight.grad.is_sparse
    torch.testing.assert_close(opt_model.a.weight.grad.to_dense(), ref.a.weight.grad.to_dense(), rtol=0, atol=0)
    for name in ("b", "c"):
        _same_bits(getattr(opt_model, name).weight.grad, getattr(ref, name).weight.grad)


def test_the_function_hands_back_scale_grad_by_freq_as_eager() -> None:
    """The Function itself (not rewritten for it by the pass) returns eager's gradient there."""
    w = torch.randn(V, H, requires_grad=True)
    w.grad = torch.randn(V, H)
    ref = w.detach().clone().requires_grad_(True)
    ref.grad = w.grad.clone()
    ids = _ids(91)
    dy = _dy(91, ids, torch.float32)
    before = _counts()
    embedding(w, ids, -1, True).backward(dy)
    F.embedding(ids, ref, scale_grad_by_freq=True).backward(dy)
    _same_bits(w.grad, ref.grad)
    assert _counts()[1] - before[1] == 1 and _counts()[0] == before[0]


# ---------------------------------------------------------------------------------------------
# the whole pipeline


def test_optimize_train_mode_on_qwen3_tiny() -> None:
    """solforge.optimize in train mode on qwen3-tiny (tied embeddings): the end-to-end check passes
    and its note counts the embedding; then two steps without zeroing (the second adds in place)
    match eager's gradients."""
    from solforge import optimize, step_graphs
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device=DEVICE, dtype=torch.float32, batch=2, seq=7, weights=None, seed=0)
    model = lm.model.train()
    ref = copy.deepcopy(model)
    vocab = model.config.vocab_size

    def make(seed: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab // 8, (2, 7), generator=g).to(DEVICE),)  # few ids: duplicates

    optimized, report = optimize(model, make(0), mode="train", budget=1, max_candidates=1, make_inputs=make,
                                 families=("rmsnorm",), is_language_model=True, db=False)
    assert report.e2e is not None and report.e2e.passed, report.e2e
    notes = [n for n in report.notes if "embeddings.py" in n]
    assert len(notes) == 1 and int(notes[0].split()[0]) > 0, report.notes
    model.zero_grad()
    before = _counts()
    # the graph run as it is: a training call replayed from a CUDA graph (traingraphs.py, on a GPU)
    # takes its gradients from the captured backward, where no parameter has a .grad to add into
    with step_graphs(False):
        for step in range(2):
            (ids,) = make(100 + step)
            ref(ids).logits.float().square().mean().backward()
            optimized(ids).logits.float().square().mean().backward()
    assert _counts()[0] - before[0] >= 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = float((p.grad - q.grad).norm() / q.grad.norm())
        assert err < 1e-4, (name, err)


# ---------------------------------------------------------------------------------------------
# GPU: CUDA's embedding_dense_backward is another implementation than the CPU's (a feature kernel
# for N <= 3072, a sort and segment sums above): both paths, bf16, many duplicate ids


@requires_gpu
@pytest.mark.parametrize("shape", [(3, 1001), (2, 4093)])  # N = 3003 (feature kernel), 8186 (sort)
@pytest.mark.parametrize("padding_idx", [None, 17])
def test_cuda_bf16_bit_for_bit(shape: tuple[int, int], padding_idx: int | None) -> None:
    vocab, width = 50021, 2563
    torch.manual_seed(15)
    ref = nn.Embedding(vocab, width, padding_idx=padding_idx, device="cuda", dtype=torch.bfloat16)
    w = ref.weight.detach().clone().requires_grad_(True)
    before = _counts()
    for step in range(3):
        g = torch.Generator(device="cuda").manual_seed(step)
        ids = torch.randint(0, 300, shape, device="cuda", generator=g)  # ~30 tokens per id
        ids[0, :500] = 17
        dy = torch.randn(*shape, width, device="cuda", generator=g).to(torch.bfloat16)
        ref(ids).backward(dy)
        out = embedding(w, ids, -1 if padding_idx is None else padding_idx)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a host sync in the backward raises
        try:
            out.backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _same_bits(w.grad, ref.weight.grad)
    assert _counts()[0] - before[0] == 2
