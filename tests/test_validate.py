"""End-to-end validation: errors, argmax agreement judged where it is decisive, wrong models fail."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from solforge.validate import argmax_agreement, flatten_tensors, output_error, validate


def test_near_ties_do_not_count_but_decisive_flips_do() -> None:
    ref = torch.tensor([[5.0, 0.0, 0.0], [1.0, 1.001, 0.0], [0.0, 0.0, 4.0]])
    near = ref.clone()
    near[1] = torch.tensor([1.001, 1.0, 0.0])  # flips a near-tie
    all_, decisive = argmax_agreement(near, ref)
    assert abs(all_ - 2 / 3) < 1e-6 and decisive == 1.0
    wrong = ref.clone()
    wrong[0] = torch.tensor([0.0, 5.0, 0.0])  # flips a decisive position
    all_, decisive = argmax_agreement(wrong, ref)
    assert abs(all_ - 2 / 3) < 1e-6 and decisive == 0.5


def test_output_error_is_chunked_and_exact() -> None:
    ref = torch.randn(1000)
    out = ref.clone()
    out[123] += 0.5
    e = output_error("y", out, ref, chunk=64)
    assert abs(e.max_abs_err - 0.5) < 1e-6
    assert abs(e.max_rel_err - 0.5 / float(ref.abs().max())) < 1e-6
    assert not e.nonfinite
    out[7] = float("nan")
    assert output_error("y", out, ref, chunk=64).nonfinite


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lin(x), "aux": x.sum(-1)}


def test_validate_passes_equal_and_fails_wrong_models() -> None:
    torch.manual_seed(0)
    m = Tiny()
    x = torch.randn(4, 5, 8)
    ok = validate(m, m, (x,), dtype=torch.float32, device="cpu", is_language_model=True, time_it=False)
    assert ok.passed and ok.argmax_agree == 1.0 and ok.outputs_compared == 2 and ok.max_abs_err == 0.0

    def wrong(x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = m(x)
        return {"logits": out["logits"].flip(-1), "aux": out["aux"]}

    bad = validate(m, wrong, (x,), dtype=torch.float32, device="cpu", is_language_model=True, time_it=False)
    assert not bad.passed and bad.note

    def restructured(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(m(x).values())

    r = validate(m, restructured, (x,), dtype=torch.float32, device="cpu", is_language_model=True, time_it=False)
    assert not r.passed and "structure" in (r.note or "")


def test_flatten_names_nested_outputs() -> None:
    t = torch.zeros(1)
    names = [n for n, _ in flatten_tensors({"a": (t, [t]), "b": t})]
    assert names == ["a[0]", "a[1][0]", "b"]


class Dropped(torch.nn.Module):
    """Dropout between two layers, in training mode: each call draws a new mask."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def test_models_with_dropout_are_compared_from_one_seed() -> None:
    """Training mode with dropout: both runs start from the same seed, so the same model passes
    and one that draws its numbers differently fails; the caller's RNG stream is left as it was."""
    torch.manual_seed(0)
    m = Dropped().train()
    x = torch.randn(4, 8)
    params = list(m.named_parameters())
    state = torch.get_rng_state()
    ok = validate(m, m, (x,), dtype=torch.float32, device="cpu", is_language_model=False, time_it=False,
                  params=params)
    assert ok.passed and ok.max_abs_err == 0.0 and ok.grad_max_rel_err == 0.0
    assert torch.equal(torch.get_rng_state(), state)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        torch.rand(1)  # one draw more: every later mask differs
        return m(x)

    bad = validate(m, shifted, (x,), dtype=torch.float32, device="cpu", is_language_model=False, time_it=False,
                   params=params)
    assert not bad.passed and bad.note


def test_an_optimized_model_with_dropout_passes_and_says_so() -> None:
    """The rewritten graph keeps the original's random ops in order: same seed, same masks, and
    the end-to-end check of a GPT-2 block with dropout in training passes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from solforge.api import random_ops
    from solforge.capture import capture
    from solforge.integrate import integrate

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    m = GPT2LMHeadModel(cfg).to(DEVICE).train()
    ids = torch.randint(0, 64, (2, 16), device=DEVICE)
    assert random_ops(g.aten for g in capture(m, (ids,), grad=True).graphs)  # dropout is in the graph
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    torch.compiler.reset()
    quiet = GPT2LMHeadModel(cfg).to(DEVICE).train()
    assert not random_ops(g.aten for g in capture(quiet, (ids,), grad=True).graphs)  # p = 0 draws nothing
    torch.compiler.reset()
    opt, stats = integrate(m, {}, train=True)
    params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    rep = validate(m, opt, (ids,), dtype=torch.float32, device=DEVICE, is_language_model=True, time_it=False,
                   params=params)
    assert stats.total > 0 and rep.passed, rep.note
    assert rep.max_rel_err < 1e-4


class Chaotic(torch.nn.Module):
    """32 tanh layers with a gain above 1 in bf16: rounding differences grow layer by layer, so
    the output is ~5.6% (norm-relative) from the same weights computed in fp32."""

    def __init__(self, depth: int = 32, width: int = 256) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width, width, generator=g) * 1.6 / width**0.5)
                                        for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.w:
            x = torch.tanh(x @ w)
        return x


class Fp32Inside(torch.nn.Module):
    """The same function computed in fp32 between bf16 input and output: more accurate than the
    original, and past E2E_REL_TOL from it."""

    def __init__(self, m: Chaotic) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        for w in self.m.w:
            y = torch.tanh(y @ w.float())
        return y.to(x.dtype)


def _chaotic_input() -> torch.Tensor:
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def test_past_the_bar_but_no_less_accurate_than_the_original_passes() -> None:
    """A bf16 model whose own rounding exceeds the bar (as Phi-3-mini's did on the H100): a more
    accurate optimized model passes, with both distances from the fp32 computation reported, and
    a wrong one (scaled by 1.15) still fails."""
    m = Chaotic().to(torch.bfloat16)
    x = _chaotic_input()
    kw = dict(dtype=torch.bfloat16, device="cpu", is_language_model=False, time_it=False)
    good = validate(m, Fp32Inside(m), (x,), **kw)
    direct = output_error("y", Fp32Inside(m)(x), m(x)).norm_rel_err
    assert direct > 0.05  # past E2E_REL_TOL[bf16]: the plain check alone would fail it
    assert good.passed and "no further from the original computed in fp32" in (good.note or "")
    assert good.fp32_err_original is not None and good.fp32_err_optimized is not None
    assert good.fp32_err_original > 0.05 > 0.01 > good.fp32_err_optimized
    # the fp32 reference is the original's bf16 weights computed in fp32
    ref32 = Chaotic().to(torch.bfloat16).float()(x.float())
    assert abs(good.fp32_err_original - output_error("y", m(x), ref32, any_dtype=True).norm_rel_err) < 1e-6
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())  # the original is left as it was

    bad = validate(m, lambda x: m(x) * 1.15, (x,), **kw)
    assert not bad.passed and "further from the original computed in fp32" in (bad.note or "")
    assert bad.fp32_err_optimized is not None and bad.fp32_err_optimized > 1.1 * bad.fp32_err_original


def test_within_the_bar_no_wide_run_and_a_wrong_fp32_model_fails_against_fp64() -> None:
    m = Chaotic(depth=8).to(torch.bfloat16)
    x = _chaotic_input()
    r = validate(m, Fp32Inside(m), (x,), dtype=torch.bfloat16, device="cpu", is_language_model=False, time_it=False)
    assert r.passed and r.fp32_err_original is None and r.note is None
    m32 = Chaotic()
    wrong = validate(m32, lambda x: m32(x) * 1.15, (_chaotic_input().float(),), dtype=torch.float32, device="cpu",
                     is_language_model=False, time_it=False)
    assert not wrong.passed and "further from the original computed in fp64" in (wrong.note or "")
    assert wrong.fp32_err_optimized is not None and wrong.fp32_err_optimized > 1.1 * wrong.fp32_err_original


class Cancels(torch.nn.Module):
    """(x + b) - b with |b| >> |x|: fp32 keeps x to about ulp(b), 1e-3 of it here."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.full((37,), 3e4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.b) - self.b


def test_an_fp32_model_past_its_bar_but_nearer_fp64_than_eager_passes() -> None:
    """fp32's bar (1e-4 from eager, norm-relative) is finer than an fp32 model's own rounding can
    be: an optimized model that computes (x + b) - b exactly is 1e-3 from eager, yet nearer the
    original computed in fp64 than eager is, and passes; one 0.5% off does not."""
    m = Cancels()
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(3))
    kw = dict(dtype=torch.float32, device="cpu", is_language_model=False, time_it=False)
    exact = lambda x: ((x.double() + m.b.double()) - m.b.double()).float()  # noqa: E731
    assert output_error("y", exact(x), m(x)).norm_rel_err > 1e-4  # past the plain bar
    good = validate(m, exact, (x,), **kw)
    assert good.passed and "no further from the original computed in fp64" in (good.note or ""), good.note
    assert good.fp32_err_optimized < 1e-6 < 1e-4 < good.fp32_err_original
    assert m.b.dtype == torch.float32  # the original is left as it was
    bad = validate(m, lambda x: exact(x) * 1.005, (x,), **kw)
    assert not bad.passed and bad.fp32_err_optimized > 1.1 * bad.fp32_err_original, bad.note


def test_train_mode_compares_gradients_with_the_fp32_run_too() -> None:
    m = Chaotic().to(torch.bfloat16)
    x = _chaotic_input()
    params = list(m.named_parameters())
    kw = dict(dtype=torch.bfloat16, device="cpu", is_language_model=False, time_it=False, params=params)
    good = validate(m, Fp32Inside(m), (x,), **kw)
    assert good.passed, good.note
    assert good.fp32_grad_err_original is not None and good.fp32_grad_err_optimized is not None
    assert good.fp32_grad_err_optimized < good.fp32_grad_err_original
    assert all(p.grad is None for p in m.parameters())

    def scaled_grads(x: torch.Tensor) -> torch.Tensor:  # right outputs, gradients scaled by 1.5
        y = Fp32Inside(m)(x)
        return y.detach() + 1.5 * (y - y.detach())

    bad = validate(m, scaled_grads, (x,), **kw)
    assert not bad.passed and "gradients" in (bad.note or "")


class Block(torch.nn.Module):
    fp32_calls = 0  # forwards run in fp32: the fp32 reference's (the models compared run in bf16)

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.fp32_calls += x.dtype == torch.float32
        return torch.tanh(x @ self.w)


class Blocks(torch.nn.Module):
    """Chaotic's function laid out as a transformer is: an nn.ModuleList of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(w) for w in Chaotic().w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x

    def fp32_inside(self, x: torch.Tensor) -> torch.Tensor:
        """The same function computed in fp32 between bf16 input and output (Fp32Inside's)."""
        y = x.float()
        for b in self.blocks:
            y = torch.tanh(y @ b.w.float())
        return y.to(x.dtype)


def _plain_fp32_run_out_of_memory(monkeypatch) -> list[bool]:
    """validate's fp32 run fails with out of memory unless lean; returns the runs' `lean` flags."""
    from solforge import validate as validation

    real, runs = validation._run_fp32, []

    def tight(*args, **kwargs):
        runs.append(args[-1])
        if not args[-1]:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(validation, "_run_fp32", tight)
    return runs


def test_an_fp32_step_that_does_not_fit_runs_again_checkpointed_with_the_same_numbers(monkeypatch) -> None:
    """A training step's fp32 reference that runs out of memory runs again block by block
    (activation checkpointing, each gradient compared as it is made): the same distances, and
    each block's forward runs twice (its recompute). Out of memory both ways: a failure that says so."""
    from solforge import validate as validation

    m = Blocks().to(torch.bfloat16)
    x = _chaotic_input()
    fp32_inside = m.fp32_inside
    kw = dict(dtype=torch.bfloat16, device="cpu", is_language_model=False, time_it=False,
              params=list(m.named_parameters()))
    Block.fp32_calls = 0
    plain = validate(m, fp32_inside, (x,), **kw)
    assert plain.passed and plain.fp32_grad_err_original is not None, plain.note
    assert Block.fp32_calls == 32

    lean_runs = _plain_fp32_run_out_of_memory(monkeypatch)
    Block.fp32_calls = 0
    lean = validate(m, fp32_inside, (x,), **kw)
    assert lean_runs == [False, True] and Block.fp32_calls == 64
    assert lean.passed and "block by block" in (lean.note or ""), lean.note
    assert "block by block" not in (plain.note or "")
    for field in ("fp32_err_original", "fp32_err_optimized", "fp32_grad_err_original", "fp32_grad_err_optimized"):
        assert getattr(lean, field) == pytest.approx(getattr(plain, field), rel=1e-6), field
    assert all(p.grad is None for p in m.parameters()) and all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert all(not hasattr(b, "__dict__") or "forward" not in vars(b) for b in m.blocks)  # the copy's, not these

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(validation, "_run_fp32", no_room)
    none = validate(m, fp32_inside, (x,), **kw)
    assert not none.passed and "even block by block" in (none.note or "")


def test_an_fp32_forward_that_does_not_fit_runs_again_one_blocks_weights_at_a_time(monkeypatch) -> None:
    """Without autograd, the fallback holds one block's fp32 weights at a time: the same distances
    from the fp32 computation as the whole fp32 copy."""
    m = Blocks().to(torch.bfloat16)
    x = _chaotic_input()
    fp32_inside = m.fp32_inside
    kw = dict(dtype=torch.bfloat16, device="cpu", is_language_model=False, time_it=False)
    plain = validate(m, fp32_inside, (x,), **kw)
    assert plain.passed and plain.fp32_err_original is not None and plain.fp32_err_original > 0.05, plain.note
    runs = _plain_fp32_run_out_of_memory(monkeypatch)
    lean = validate(m, fp32_inside, (x,), **kw)
    assert runs == [False, True] and lean.passed and "block by block" in (lean.note or ""), lean.note
    assert lean.fp32_err_original == pytest.approx(plain.fp32_err_original, rel=1e-6)
    assert lean.fp32_err_optimized == pytest.approx(plain.fp32_err_optimized, rel=1e-6)


class LogitsOnly(torch.nn.Module):
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(ids).logits


@pytest.mark.parametrize("train", [False, True], ids=["forward", "training-step"])
def test_a_transformers_models_fp32_check_block_by_block_gives_the_same_distances(monkeypatch, train: bool) -> None:
    """qwen3-tiny in bf16: its decoder layers are called with keyword arguments and its rotary
    buffer sits outside them. An optimized model 15% off is past the bar, so both are compared with
    the model computed in fp32; run block by block, that comparison gives the whole copy's numbers."""
    from solforge.zoo import load_model

    lm = load_model("qwen3-tiny", device=DEVICE, dtype=torch.bfloat16, batch=2, seq=8, weights=None, seed=0)
    original = LogitsOnly(lm.model.train() if train else lm.model.eval())
    kw = dict(dtype=torch.bfloat16, device=DEVICE, is_language_model=False, time_it=False,
              params=list(original.named_parameters()) if train else None)
    plain = validate(original, lambda ids: original(ids) * 1.15, lm.example_inputs, **kw)
    assert not plain.passed and "further from the original computed in fp32" in (plain.note or ""), plain.note
    runs = _plain_fp32_run_out_of_memory(monkeypatch)
    lean = validate(original, lambda ids: original(ids) * 1.15, lm.example_inputs, **kw)
    assert runs == [False, True] and "block by block" in (lean.note or ""), lean.note
    fields = ["fp32_err_original", "fp32_err_optimized"] + (["fp32_grad_err_original", "fp32_grad_err_optimized"]
                                                            if train else [])
    for field in fields:
        assert getattr(plain, field) is not None, field
        assert getattr(lean, field) == pytest.approx(getattr(plain, field), rel=1e-5, abs=1e-7), field
    assert all(p.dtype == torch.bfloat16 for p in original.parameters())


class Tied(torch.nn.Module):
    """Blocks whose first block's weight is also used after the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(w) for w in list(Chaotic(depth=4, width=64).w))
        self.out = self.blocks[0].w
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return (x @ self.out) * self.scale


def test_block_by_block_copy_computes_the_fp32_copys_function_with_one_block_upcast() -> None:
    from solforge.validate import _fp32_block_by_block, _fp32_copy

    m = Tied().to(torch.bfloat16)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    lean = _fp32_block_by_block(m)
    # the blocks' own weights are the original's (no copy); what the rest also uses is fp32 throughout
    assert lean.blocks[1].w is m.blocks[1].w and lean.blocks[0].w.dtype == torch.float32
    assert lean.out is lean.blocks[0].w and lean.scale.dtype == torch.float32
    upcast_blocks = []
    for b in lean.blocks:
        b.register_forward_pre_hook(lambda *_: upcast_blocks.append(
            sum(bb.w.dtype == torch.float32 for bb in lean.blocks[1:])))
    with torch.no_grad():
        got, want = lean(x), _fp32_copy(m, set())(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert upcast_blocks == [0, 1, 1, 1]  # block 0's (shared) weight is fp32 throughout; one other at a time
    assert all(b.w.dtype == torch.bfloat16 for b in lean.blocks[1:])
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


class TwoOutputs(torch.nn.Module):
    """A deep chaotic output (its own rounding past the bar) and a shallow one (a few ulps)."""

    def __init__(self) -> None:
        super().__init__()
        self.deep = Chaotic()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"deep": self.deep(x), "shallow": torch.tanh(x)}


def test_each_output_is_judged_on_its_own_against_fp32() -> None:
    """A 6% error in the shallow output, inside the deep output's own 5.6% rounding distance to
    fp32 but far outside the shallow one's, fails: the outputs are not judged by the largest."""
    m = TwoOutputs().to(torch.bfloat16)
    x = _chaotic_input()
    inner = Fp32Inside(m.deep)
    kw = dict(dtype=torch.bfloat16, device="cpu", is_language_model=False, time_it=False)
    good = validate(m, lambda x: {"deep": inner(x), "shallow": torch.tanh(x)}, (x,), **kw)
    assert good.passed, good.note
    bad = validate(m, lambda x: {"deep": inner(x), "shallow": torch.tanh(x) * 1.06}, (x,), **kw)
    assert not bad.passed and "shallow" in (bad.note or "")


def test_a_slow_result_says_what_the_graphs_timed_call_measured() -> None:
    """The note on an optimized model slower than the original gives the graphs' host and GPU time
    where they were measured (stepgraphs.py's timed call), and only guesses where they were not."""
    from types import SimpleNamespace

    from solforge.api import host_time

    host_bound = [SimpleNamespace(host_s=40e-6, gpu_s=21e-6), SimpleNamespace(host_s=None, gpu_s=None)]
    assert host_time(host_bound) == "its timed call took 40 us of host time for 21 us on the GPU: bound by the host"
    assert host_time([SimpleNamespace(host_s=30e-6, gpu_s=133e-6)]) == \
        "its timed call took 30 us of host time for 133 us on the GPU"
    assert "may be" in host_time([SimpleNamespace(host_s=None, gpu_s=None)]) and "may be" in host_time([])


class Silent(torch.nn.Module):
    """Computes into a buffer and returns None (or plain Python values): nothing to compare."""

    def __init__(self, returns: object = None) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))
        self.returns = returns

    def forward(self, x: torch.Tensor) -> object:
        self.seen.copy_(self.lin(x).sum(0))
        return self.returns


@pytest.mark.parametrize("returns", [None, (1, "a", None)])
@pytest.mark.parametrize("train", [False, True])
def test_a_model_returning_no_tensor_is_nothing_to_validate_never_passed(returns: object, train: bool) -> None:
    from rich.console import Console

    from solforge.records import RegionReport, Report, from_json, to_json
    from solforge.report.html import render
    from solforge.report.terminal import print_report
    from solforge.validate import NOTHING

    torch.manual_seed(0)
    m = Silent(returns)
    x = torch.randn(3, 8)
    params = list(m.named_parameters()) if train else None
    r = validate(m, m, (x,), dtype=torch.float32, device="cpu", is_language_model=False, time_it=False,
                 params=params)
    assert r.status == NOTHING and not r.passed and r.outputs_compared == 0
    assert "nothing to compare" in (r.note or "")
    assert from_json(type(r), to_json(r)) == r  # the record keeps it
    region = RegionReport("rmsnorm", "rmsnorm 3x8", 1, 1.0, 1.0, 1.0, "triton", {}, True, 0.0)
    rep = Report(model="m", device="cpu", dtype="fp32", mode="train" if train else "inference", versions={},
                 regions=(region,), e2e=r, timings_meaningful=False, notes=(), created="", command="")
    html = render(rep).split("End to end")[1]
    assert "nothing to validate" in html and "passed" not in html
    console = Console(record=True, width=300)
    print_report(rep, console)
    (line,) = [ln for ln in console.export_text().splitlines() if ln.startswith("end to end")]
    assert "nothing to validate" in line and "passed" not in line
    # a model that returns tensors still gets a verdict
    ok = validate(Tiny(), Tiny(), (torch.randn(2, 8),), dtype=torch.float32, device="cpu", is_language_model=False,
                  time_it=False)
    assert ok.status == "failed" and not ok.passed  # two differently initialised models
