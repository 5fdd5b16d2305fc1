"""cross_entropy family: forward against the reference for every config of the space at odd shapes
(chunks smaller than the vocabulary, so the online logsumexp runs over several), every reduction,
ignored targets, an all-ignored batch (as torch: mean NaN, sum 0, zero gradients); the backward
kernel and autograd through the op; the verifier; matching and integration of F.cross_entropy and
of Hugging Face's causal-LM loss (labels=) on tiny Llama, Qwen3 and GPT-2 models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import DEVICE, FULL_SWEEPS, large_gpu_memory, requires_gpu

from solforge.kernels import cross_entropy as C
from solforge.numerics import compare
from solforge.records import Workload

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _wl(rows: int, V: int, dtype: torch.dtype = BF16, reduction: str = "mean", out_dtype: torch.dtype = FP32,
        ignore_index: int = -100, tdtype: torch.dtype = torch.int64) -> Workload:
    x = torch.empty(rows, V, dtype=dtype, device="meta")
    t = torch.empty(rows, dtype=tdtype, device="meta")
    wl = C.workload_for(x, t, ignore_index=ignore_index, reduction=reduction, out_dtype=out_dtype)
    return dataclasses.replace(wl, device=DEVICE)


def _check(wl: Workload, config: C.Config | None = None, seed: int = 0) -> None:
    (x, t), kw = C.make_inputs(wl, seed=seed)
    before = (x.clone(), t.clone())
    ref = C.cross_entropy_ref(x, t, **kw)
    out = torch.full_like(ref, float("nan"))
    assert C.cross_entropy(x, t, config=config, out=out, **kw) is out
    assert torch.equal(x, before[0]) and torch.equal(t, before[1]), "an input was modified"
    c = compare(out, ref)
    assert c.ok, f"{config.encode() if config else 'heuristic'} on {wl.key}: {c.reason}"
    # the backward from the forward's saved logsumexp
    loss, lse = C.forward(x, t, config=config, **kw)
    dloss = torch.rand(loss.shape, device=DEVICE) + 0.5
    dx = C.cross_entropy_bwd(dloss, x, t, lse, ignore_index=kw["ignore_index"], reduction=kw["reduction"],
                             config=config)
    rdx = C.cross_entropy_bwd_ref(dloss, x, t, ignore_index=kw["ignore_index"], reduction=kw["reduction"])
    c = compare(dx, rdx.to(dx.dtype))
    assert c.ok, f"backward, {config.encode() if config else 'heuristic'} on {wl.key}: {c.reason}"


@pytest.mark.parametrize("rows,V", [(37, 96), (5, 2000)])
def test_every_config_in_space(rows: int, V: int) -> None:
    wl = _wl(rows, V)
    configs = C.space(wl)
    assert configs and len(set(configs)) == len(configs) and all(C.is_valid(c, wl) for c in configs)
    if V > 1024:
        assert any(c.block < V for c in configs)  # several chunks per row
    for c in configs:
        _check(wl, c)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype,out_dtype", [(BF16, FP32), (FP32, FP32), (BF16, BF16), (FP16, FP32)])
def test_reductions_dtypes_and_odd_chunks(reduction: str, dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    # 1000 = 3 x 256 + 232: an uneven last chunk; 1024: even chunks; a row of one class
    for rows, V, cfg in [(5, 1000, C.Config("online", 256, 2)), (3, 1024, C.Config("online", 256, 4)),
                         (4, 1, None), (9, 130, None)]:
        _check(_wl(rows, V, dtype, reduction, out_dtype), cfg, seed=rows)


def test_other_ignore_index_and_int32_targets() -> None:
    _check(_wl(11, 77, ignore_index=0))  # an ignore index inside the vocabulary (a pad token)
    _check(_wl(11, 77, tdtype=torch.int32, reduction="sum"))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_is_what_torch_gives(reduction: str) -> None:
    x = torch.randn(4, 50, device=DEVICE).requires_grad_()
    t = torch.full((4,), -100, device=DEVICE)
    ref = F.cross_entropy(x, t, reduction=reduction)
    loss, _lse = C.cross_entropy_op(x, t, -100, reduction, FP32, "")
    torch.testing.assert_close(loss, ref.detach(), equal_nan=True)  # mean: NaN (0 / 0), as torch
    loss.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))  # no NaN in the gradient


def test_config_text_and_bad_inputs() -> None:
    for c in C.space(_wl(8, 151936)):
        assert C.Config.decode(c.encode()) == c
    with pytest.raises(ValueError, match="cross_entropy"):
        C.Config.decode("row:b=1024")
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="targets"):
        C.cross_entropy(x, torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="int64"):
        C.cross_entropy(x, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="not valid"):
        C.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=DEVICE), config=C.Config("online", 64, 1))


def test_verifier_accepts_the_family_and_rejects_wrong_kernels() -> None:
    from solforge.tune import candidates, family_module, measure
    from solforge.tune.verify import verify

    wl = _wl(9, 300)
    fam = family_module(wl.family)
    for cand in candidates(fam, wl):
        rec = measure(fam, cand, device=DEVICE)
        assert rec.ok, (cand.config, rec.error)

    def mean_over_all_rows(x: torch.Tensor, t: torch.Tensor, **kw: object) -> None:
        out = kw.pop("out")
        rows = C.cross_entropy(x, t, **{**kw, "reduction": "none"})  # type: ignore[arg-type]
        out.copy_(rows.sum() / t.numel())  # type: ignore[union-attr]

    def ignores_nothing(x: torch.Tensor, t: torch.Tensor, **kw: object) -> None:
        out = kw.pop("out")
        out.copy_(F.cross_entropy(x.float(), t.clamp(min=0)))  # type: ignore[union-attr]

    assert not verify(C, wl, mean_over_all_rows).passed
    assert not verify(C, wl, ignores_nothing).passed


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_autograd_through_the_op(reduction: str) -> None:
    """bf16 logits through the op (the upcast inside) against F.cross_entropy(logits.float())."""
    torch.manual_seed(0)
    x = (torch.randn(2, 7, 300, device=DEVICE) * 3).to(BF16)
    t = torch.randint(0, 300, (14,), device=DEVICE)
    t[::4] = -100
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, _lse = C.cross_entropy_op(a, t, -100, reduction, FP32, "")
    ref = F.cross_entropy(b.float().view(-1, 300), t, reduction=reduction)
    torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
    g = torch.rand_like(ref) + 0.5
    loss.backward(g)
    ref.backward(g)
    assert a.grad is not None and b.grad is not None and a.grad.dtype == BF16 and a.grad.shape == x.shape
    assert compare(a.grad, b.grad).ok


@requires_gpu
@large_gpu_memory
def test_qwen3_vocab_on_gpu() -> None:
    """Qwen3's vocabulary: 4096 x 151936 bf16 logits, every reduction, a sample of the space."""
    for reduction in ("mean", "sum"):
        _check(_wl(4096, 151936, reduction=reduction))
    wl = _wl(4096, 151936)
    for c in C.space(wl)[::3]:
        _check(wl, c)


# ---------------------------------------------------------------------------------------------
# matching and integration


class Head(nn.Module):
    """An LM head and its loss, written in several ways."""

    def __init__(self, d: int, V: int, form: str) -> None:
        super().__init__()
        self.lin = nn.Linear(d, V)
        self.form = form

    def forward(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = self.lin(h)
        flat, tt = logits.float().view(-1, logits.shape[-1]), t.view(-1)
        if self.form == "mean":
            return F.cross_entropy(flat, tt)
        if self.form == "sum":  # HF's num_items_in_batch form: the division stays outside
            return nn.CrossEntropyLoss(reduction="sum", ignore_index=-100)(flat, tt) / 3.0
        if self.form == "weight":
            return F.cross_entropy(flat, tt, weight=torch.ones(flat.shape[-1], device=flat.device))
        if self.form == "smoothing":
            return F.cross_entropy(flat, tt, label_smoothing=0.1)
        lp = F.log_softmax(flat, -1)  # log-probs used twice: left to eager
        return F.nll_loss(lp, tt) + lp.mean()


def _capture(m: nn.Module, *args: torch.Tensor, grad: bool = False) -> list:
    """Planned without linear_cross_entropy, which takes these heads (their logits are dead) with
    their projection: here the loss alone is under test."""
    from solforge import capture, plan

    fams = [f for f in plan._matchers() if f != "linear_cross_entropy"]
    return plan.plan(capture.capture(m, args, grad=grad).graphs, fams)


@pytest.mark.parametrize("form,found", [("mean", 1), ("sum", 1), ("weight", 0), ("smoothing", 0), ("reused", 0)])
def test_matching_forms(form: str, found: int) -> None:
    m = Head(16, 40, form).to(DEVICE)
    h, t = torch.randn(2, 5, 16, device=DEVICE), torch.randint(0, 40, (2, 5), device=DEVICE)
    groups = [g for g in _capture(m, h, t) if g.workload.family == "cross_entropy"]
    assert sum(g.count for g in groups) == found
    if found:
        assert groups[0].workload.param("reduction") == form


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_integration_and_training(dtype: torch.dtype) -> None:
    from solforge.integrate import integrate

    torch.manual_seed(0)
    m = Head(16, 70, "sum").to(dtype).to(DEVICE).train()
    h = torch.randn(3, 5, 16, device=DEVICE).to(dtype)
    t = torch.randint(0, 70, (3, 5), device=DEVICE)
    t[0, :2] = -100
    groups = _capture(m, h, t, grad=True)
    assert [(g.workload.family, g.count) for g in groups] == [("cross_entropy", 1)]
    # bf16: the op reads the bf16 logits; the .float() copy is part of the region
    assert groups[0].workload.dtypes[0] == C.dtype_name(dtype)
    opt, stats = integrate(m, {}, families=("cross_entropy",))
    loss = opt(h, t)
    loss.backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}  # type: ignore[union-attr]
    m.zero_grad()
    ref = m(h, t)
    ref.backward()
    assert sum(stats.untuned.values()) == 1
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    tol = 1e-5 if dtype == FP32 else 1e-2
    for n, p in m.named_parameters():
        assert p.grad is not None
        assert float((got[n].float() - p.grad.float()).norm() / p.grad.float().norm()) < tol, n


transformers = pytest.importorskip("transformers")


def _hf(arch: str, dtype: torch.dtype) -> nn.Module:
    t = transformers
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, use_cache=False)
    cfg = t.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64, use_cache=False,
                       bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) \
        if arch == "gpt2" else \
        {"llama": t.LlamaConfig, "qwen3": t.Qwen3Config}[arch](head_dim=16, **common)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return t.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


class Loss(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lm(input_ids=ids, labels=labels)
        return out.loss, out.logits  # the logits stay a graph output: the region must not consume them


# off the GPU Llama (bf16) and Qwen3 (fp32): the loss's code is transformers' one ForCausalLMLoss;
# GPT-2's tied head (a different graph before the loss) runs on the GPU and in FULL_SWEEPS
HF_LOSS_CASES = [("llama", BF16), ("qwen3", FP32), ("gpt2", FP32)][: None if FULL_SWEEPS else 2]


@pytest.mark.parametrize("arch,dtype", HF_LOSS_CASES)
def test_hf_causal_lm_loss(arch: str, dtype: torch.dtype) -> None:
    """transformers' ForCausalLMLoss (logits.float(), labels padded with -100 and shifted) is one
    cross_entropy region; the optimized model's loss and gradients are eager's."""
    from solforge.integrate import integrate

    m = Loss(_hf(arch, dtype)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 7), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt not trained on
    with torch.no_grad():
        groups = _capture(m, ids, labels)
    ce = [grp for grp in groups if grp.workload.family == "cross_entropy"]
    assert sum(grp.count for grp in ce) == 1
    wl = ce[0].workload
    assert wl.shapes == ((14, 96), (14,)) and wl.dtypes == (C.dtype_name(dtype), "int64", "fp32")
    assert wl.param("reduction") == "mean" and wl.param("ignore_index") == -100
    opt, stats = integrate(m, {}, families=("cross_entropy",))
    loss, logits = opt(ids, labels)
    loss.backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    ref, ref_logits = m(ids, labels)
    ref.backward()
    assert sum(stats.untuned.values()) == 1
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=0, rtol=0)
    tol = 1e-5 if dtype == FP32 else 2e-2
    for n, p in m.named_parameters():
        if p.grad is not None:
            assert float((got[n].float() - p.grad.float()).norm() / p.grad.float().norm()) < tol, n


def test_ops_under_opcheck_and_torch_compile() -> None:
    """Schemas and fake impls agree with the real ops; aot_eager traces forward and backward through
    the fakes (no C++ compiler needed) and computes eager's loss and gradient."""
    x = torch.randn(6, 50, device=DEVICE)
    t = torch.randint(0, 50, (6,), device=DEVICE)
    t[1] = -100
    for red in ("mean", "none"):
        torch.library.opcheck(torch.ops.solforge.cross_entropy.default, (x, t, -100, red, FP32, ""),
                              test_utils=("test_schema", "test_faketensor"))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    f = torch.compile(lambda x, t: C.cross_entropy_op(x, t, -100, "mean", FP32, "")[0] * 2, backend="aot_eager",
                      fullgraph=True)
    f(a, t).backward()
    (F.cross_entropy(b, t) * 2).backward()
    assert a.grad is not None and b.grad is not None and compare(a.grad, b.grad).ok
