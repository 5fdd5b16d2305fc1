"""End-to-end validation: errors, argmax agreement judged where it is decisive, wrong models fail."""

from __future__ import annotations

import torch

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
