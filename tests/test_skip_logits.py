"""`skip_logits` (runtime/logits.py): a training call with labels returns the loss and logits=None,
the loss and the parameters' gradients are eager's, and the fused LM head + cross-entropy op ran
(the logits are no graph output); eval calls and calls without labels return eager's logits; the
option's capture plans the fused op where the default capture plans cross_entropy alone; HF
Trainer trains with it as eagerly."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DEVICE

import solforge
from solforge.capture import capture
from solforge.plan import plan
from solforge.runtime.logits import without_logits

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 131, 9
LCE = "solforge::linear_cross_entropy"


def _qwen3() -> torch.nn.Module:
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # prompt tokens left out of the loss
    return ids.to(DEVICE), labels.to(DEVICE)


def _positional(seed: int) -> tuple[Any, ...]:
    """forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels)."""
    ids, labels = _batch(seed)
    return ids, None, None, None, None, labels


def _lce_calls(fn: Any) -> tuple[Any, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(1 for e in prof.events() if e.name == LCE)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return got


def test_without_logits_keeps_everything_else() -> None:
    out = transformers.modeling_outputs.CausalLMOutputWithPast(loss=torch.tensor(2.0), logits=torch.ones(2, 3))
    dropped = without_logits(out)
    assert type(dropped) is type(out) and dropped.logits is None and list(dropped.keys()) == ["loss"]
    assert float(dropped.loss) == 2.0 and out.logits is not None  # the model's own output is not changed
    no_loss = transformers.modeling_outputs.CausalLMOutputWithPast(logits=torch.ones(2, 3))
    assert without_logits(no_loss) is no_loss
    plain = (torch.tensor(2.0), torch.ones(2, 3))  # a tuple has no names: kept as it is
    assert without_logits(plain) is plain


def _families(model: torch.nn.Module, skip: bool) -> set[str]:
    captured = capture(model.train(), _positional(0), grad=True, skip_logits=skip)
    return {g.workload.family for g in plan(captured.graphs, ("linear_cross_entropy", "cross_entropy"))}


def test_the_option_lets_head_and_loss_fuse() -> None:
    """The logits returned are a graph output, materialized anyway: the loss alone is cross_entropy's.
    Dropped, nothing but the loss reads them, and the fused op takes head and loss."""
    model = _qwen3()
    assert _families(model, skip=False) == {"cross_entropy"}
    assert _families(model, skip=True) == {"linear_cross_entropy"}


def test_training_step_with_labels() -> None:
    ref = _qwen3()
    model = copy.deepcopy(ref)
    keys = list(model.state_dict())
    out, report = solforge.optimize(model, _positional(0), mode="train", budget=1, max_candidates=1, db=False,
                                    profile="off", families=("linear_cross_entropy", "rmsnorm"),
                                    make_inputs=_positional, skip_logits=True,
                                    keep_slower=True)  # on a GPU a tiny head may not be faster: integrated all the same
    assert out is model and type(model) is type(ref) and list(model.state_dict()) == keys
    assert report.e2e is not None and report.e2e.passed, report.e2e
    assert report.returned == "optimized", report.why
    assert any(r.family == "linear_cross_entropy" and r.integrated for r in report.regions)
    ids, labels = _batch(3)

    # a training step as a training loop makes it (keyword arguments: a graph of its own)
    model.train()
    got, calls = _lce_calls(lambda: model(input_ids=ids, labels=labels))
    assert got.logits is None and "logits" not in got
    assert calls >= 1
    got.loss.backward()
    got_g = _grads(model)
    ref.train()
    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    want_g = _grads(ref)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    assert set(got_g) == set(want_g) and len(want_g) == len(list(ref.parameters()))
    for n, g in want_g.items():
        err = float((got_g[n] - g).norm() / g.norm())
        assert err < 1e-4, (n, err)

    # without labels, or in eval: the logits, as eager returns them
    with torch.no_grad():
        no_labels = model(input_ids=ids)
        torch.testing.assert_close(no_labels.logits, ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        model.eval()
        ref.eval()
        evaluated = model(input_ids=ids, labels=labels)
        expected = ref(input_ids=ids, labels=labels)
        assert evaluated.logits is not None
        torch.testing.assert_close(evaluated.logits, expected.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(evaluated.loss, expected.loss, atol=1e-5, rtol=1e-5)


def test_integrate_with_the_option() -> None:
    """integrate (what optimize's check integrates again without some kernels) takes the option too:
    the model's own call compiled, the logits dropped in training, kept in eval."""
    from solforge.integrate import integrate
    from solforge.runtime.inplace import SolforgeCall

    model = _qwen3().train()
    ids, labels = _batch(1)
    call, stats = integrate(model, {}, families=("linear_cross_entropy",), train=True, skip_logits=True)
    assert isinstance(call, SolforgeCall)
    got, calls = _lce_calls(lambda: call(input_ids=ids, labels=labels))
    assert got.logits is None and calls >= 1 and sum(stats.untuned.values()) >= 1
    torch.testing.assert_close(got.loss, model(input_ids=ids, labels=labels).loss, atol=1e-5, rtol=1e-5)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(call(input_ids=ids, labels=labels).logits, model(input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    rows = []
    for i in range(n):
        ids, labels = _batch(10 + i)
        rows.append({"input_ids": ids[0].cpu(), "labels": labels[0].cpu()})
    return rows


def _train(model: torch.nn.Module, out: Path) -> list[float]:
    """Two optimizer steps of Trainer at its default arguments, but for the run's size and what a test
    must not do (report, save)."""
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                                          use_cpu=DEVICE == "cpu", report_to="none", save_strategy="no",
                                          logging_steps=1)
    if DEVICE == "cuda":  # one GPU: on a host of several, Trainer would wrap the model in DataParallel
        _ = args.device
        args._n_gpu = 1
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(4))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_with_the_option(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")  # Trainer needs it
    ref = _qwen3()
    model = copy.deepcopy(ref)
    # the example without labels, as a user with a Trainer may give it: the calls with labels
    # compile a graph of their own, rewritten with the same families
    example = (_batch(0)[0],)
    _, report = solforge.optimize(model, example, mode="train", budget=1, max_candidates=1, db=False,
                                  profile="off", families=("linear_cross_entropy", "rmsnorm"), skip_logits=True,
                                  keep_slower=True)
    assert report.e2e is not None and report.e2e.passed, report.e2e
    want = _train(ref, tmp_path / "eager")
    got, calls = _lce_calls(lambda: _train(model, tmp_path / "solforge"))
    assert calls >= 2  # one per step at least: the head and the loss fused in every step
    assert len(got) == len(want) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
    # Adam moves each weight by about the learning rate whatever its gradient: the updates are compared
    start = [t.detach() for t in _qwen3().parameters()]
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        mine, eager = p.detach() - p0, q.detach() - p0
        assert float(eager.norm()) > 0, name
        err = float((mine - eager).norm() / eager.norm())
        assert err < (1e-3 if DEVICE == "cpu" else 3e-3), (name, err)  # the GPU's bf16/TF32 matmuls: 1.1e-3 seen


def test_the_option_under_the_solforge_backend(tmp_path: Path) -> None:
    """`solforge.skip_logits(model)` then `torch.compile(model, backend="solforge")`: dynamo traces
    the wrapped forward, so the training graph has no logits output and the fused head + loss op
    runs in it; the loss and the gradients are eager's; eval calls keep their logits; the model's
    keys and signature are its own, a deepcopy's forward is the copy's, torch.save works; the
    handle takes the option off."""
    import inspect

    from solforge import dynamo

    torch._dynamo.reset()
    ref = _qwen3()
    model = copy.deepcopy(ref)
    keys, sig = list(model.state_dict()), inspect.signature(model.forward)
    handle = solforge.skip_logits(model)
    assert list(model.state_dict()) == keys and inspect.signature(model.forward) == sig
    twin = copy.deepcopy(model)
    assert twin.forward.model is twin
    torch.save(model, tmp_path / "m.pt")
    assert torch.load(tmp_path / "m.pt", weights_only=False).forward.model is not model
    before = len(dynamo.history)
    compiled = torch.compile(model, backend="solforge", options={"budget": 0, "db": False, "mode": "train",
                                                                  "families": ["linear_cross_entropy"]})
    ids, labels = _batch(4)
    model.train()
    ref.train()
    got, calls = _lce_calls(lambda: compiled(input_ids=ids, labels=labels))
    assert got.logits is None and calls >= 1
    assert any(r.solforge_calls() >= 1 and r.error is None for r in list(dynamo.history)[before:])
    got.loss.backward()
    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    got_g, want_g = _grads(model), _grads(ref)
    assert set(got_g) == set(want_g)
    for n, g in want_g.items():
        assert float((got_g[n] - g).norm() / g.norm()) < 1e-4, n
    with torch.no_grad():
        model.eval()
        assert model(input_ids=ids, labels=labels).logits is not None
        model.train()
        handle.remove()
        assert model(input_ids=ids, labels=labels).logits is not None
