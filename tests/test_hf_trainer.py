"""Hugging Face's Trainer with its default arguments trains a model solforge optimized in place
(issue 31): the losses and the trained weights are eager Trainer's, solforge's kernels run in the
steps, and `save_model` then `from_pretrained` gives the trained weights back under their own names."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import solforge

pytest.importorskip("accelerate")  # Trainer needs it
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 12


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    # one layer: the step graphs are dynamo traces (forward and backward) growing with the layers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(DEVICE)


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _train(model: torch.nn.Module, out: Path) -> tuple[object, list[float]]:
    """Two optimizer steps of Trainer, arguments left at their defaults but for the size of the run
    (gradient accumulation over two batches of two) and what a test must not do (report, save)."""
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, use_cpu=DEVICE == "cpu", report_to="none",
                                          save_strategy="no", logging_steps=1)
    if DEVICE == "cuda":  # one GPU: on a host of several, Trainer would wrap the model in DataParallel
        _ = args.device  # (sets n_gpu to the host's count, once)
        args._n_gpu = 1
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(8))
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _replays(model: torch.nn.Module) -> int:
    """The training-step replays of the optimized model's graphs so far (runtime/traingraphs.py)."""
    steps = model.solforge_stats.step_graphs  # type: ignore[union-attr]
    return sum(s.training.replays for s in steps if getattr(s, "training", None) is not None)


def test_trainer_trains_the_optimized_model(tmp_path: Path) -> None:
    ref = _tiny_llama()
    model = copy.deepcopy(ref)
    example = (_data(2)[0]["input_ids"].repeat(2, 1).to(DEVICE),)
    out, report = solforge.optimize(model, example, mode="train", budget=1, max_candidates=1, db=False,
                                    profile="off", keep_slower=True)
    assert out is model and report.e2e is not None and report.e2e.passed
    assert model.training  # a new model is in train mode: optimize left it so
    assert model.solforge_stats.total > 0  # type: ignore[union-attr]
    _, want = _train(ref, tmp_path / "eager")
    before = _replays(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer, got = _train(model, tmp_path / "solforge")
    # the kernels ran in the steps: as ops, or (on a GPU) inside a replayed CUDA graph of the step
    # (runtime/traingraphs.py), whose kernels the profiler sees as no op event
    ran = sum(1 for e in prof.events() if e.name.startswith("solforge::")) + _replays(model) - before
    assert ran > 0
    assert len(got) == len(want) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
    # Adam moves each weight by about the learning rate (5e-5 by default) whatever its gradient: the
    # updates themselves are compared, against eager's, as one vector per tensor
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), _tiny_llama().parameters(), strict=True):
        mine, eager = p.detach() - p0, q.detach() - p0
        assert float(eager.norm()) > 0, name  # every tensor trained
        err = float((mine - eager).norm() / eager.norm())
        assert err < 1e-3, (name, err)

    trainer.save_model(str(tmp_path / "saved"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    trained = model.state_dict()
    assert list(back.state_dict()) == list(trained)
    for name, p in back.state_dict().items():  # loaded on the CPU
        assert torch.equal(p, trained[name].cpu()), name
