"""PEFT LoRA (issue 31): a `get_peft_model` model optimized for training in place trains its
adapters with eager's gradients, the fused families still match inside the adapted layers, and the
frozen base gets no gradient. Two backward passes without zeroing: the second adds to `.grad`
(integrate/linears.py's in-place path), the first hands the gradient to autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE

import solforge
from solforge.integrate.linears import COUNTERS
from solforge.runtime.inplace import installed
from solforge.runtime.stepgraphs import step_graphs

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 96


def _lora_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(cfg)
    # init_lora_weights=False: B random too (PEFT's default zero B gives A a zero gradient, which
    # would compare nothing); adapters on a sibling of q/k/v, on the gated MLP and on a linear fed by
    # another trainable linear (lora_A -> lora_B in every adapted layer)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                           init_lora_weights=False)
    return peft.get_peft_model(base, lora).to(DEVICE)


def test_lora_adapter_gradients_match_eager() -> None:
    model = _lora_model()
    ref = copy.deepcopy(model)
    # one layer and 12 rows: the interpreter's kernels cost by the row tile; at these rows the graph's
    # LoRA B reads its grouped A's linear itself (integrate/linears.py's chained groups)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out, report = solforge.optimize(model, (ids,), mode="train", budget=1, max_candidates=1, db=False,
                                    profile="off", keep_slower=True)
    assert out is model and installed(model) is not None and report.e2e is not None and report.e2e.passed
    families = {r.family for r in report.regions}
    assert {"rmsnorm", "add_rmsnorm", "swiglu", "rope"} <= families, families
    in_place = COUNTERS.in_place
    # the graphs run as they are: on a GPU a step replayed from a CUDA graph adds into .grad in its
    # own backward (runtime/traingraphs.py), not through linears.py, whose path this test is about
    with step_graphs(False):
        for step in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            want = ref(input_ids=ids, labels=ids).loss
            torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5, msg=f"step {step}")
            loss.backward()
            want.backward()
    assert COUNTERS.in_place > in_place  # the second backward added to .grad in the GEMMs
    adapters = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if not p.requires_grad:
            assert p.grad is None and q.grad is None, name
            continue
        assert "lora_" in name
        adapters += 1
        err = float((p.grad - q.grad).norm() / q.grad.norm())
        assert float(q.grad.norm()) > 0 and err < 1e-4, (name, err)
    assert adapters == 2 * 4  # A and B, four targets (one layer)
