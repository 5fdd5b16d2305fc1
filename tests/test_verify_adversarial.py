"""The verifier rejects every adversarial launcher (tests/adversarial.py), each by the check meant
for it, and still passes the real kernels' heuristic configs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from adversarial import ADVERSARIES
from conftest import DEVICE

from solforge.kernels import layernorm as LN
from solforge.kernels import rmsnorm as RN
from solforge.kernels import softmax as SM
from solforge.kernels import swiglu as SW
from solforge.records import Workload
from solforge.tune import family_module, launcher_of
from solforge.tune.guarded import guard_damage, guarded_like
from solforge.tune.verify import odd_rows, verify

BF16, FP32 = torch.bfloat16, torch.float32


def _meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


# 15 rows: an odd workload, whose odd-shape trial once had the same 15 rows
WORKLOADS: dict[str, Workload] = {name: dataclasses.replace(wl, device=DEVICE) for name, wl in {
    "rmsnorm": RN.workload_for(_meta(15, 96), _meta(96), 1e-6),
    "softmax": SM.workload_for(_meta(15, 80)),
    "layernorm": LN.workload_for(_meta(15, 96), _meta(96), _meta(96), 1e-5),
    "layernorm fp32": LN.workload_for(_meta(15, 96, dtype=FP32), _meta(96, dtype=FP32), _meta(96, dtype=FP32), 1e-5),
    "swiglu": SW.workload_for(_meta(15, 96), _meta(15, 96), "silu"),
}.items()}
CASES = [(wl, name, make, check) for wl, cases in ADVERSARIES.items() for name, make, check in cases]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_real_heuristic_config_passes(name: str) -> None:
    wl = WORKLOADS[name]
    fam = family_module(wl.family)
    real, config = launcher_of(fam), fam.heuristic(wl)
    v = verify(fam, wl, lambda *a, **k: real(*a, config=config, **k), device=DEVICE)
    assert v.passed, v.reason
    assert v.trials >= 3 + 1 + len(fam.edge_inputs(wl, seed=0, rows=5, device=DEVICE)) + 2
    assert v.max_norm_err <= fam.norm_error_bound(wl)


def test_every_adversary_is_rejected_by_its_check() -> None:
    """One test over all of them, so the count is reported: rejected N of M."""
    missed, wrong_check = [], []
    for wl_name, name, make, check in CASES:
        wl = WORKLOADS[wl_name]
        fam = family_module(wl.family)
        v = verify(fam, wl, make(fam, wl), device=DEVICE)
        if v.passed:
            missed.append(f"{wl_name}: {name}")
        elif not any(c in (v.reason or "") for c in check.split("|")):
            wrong_check.append(f"{wl_name}: {name}: expected {check!r}, got {v.reason!r}")
    print(f"rejected {len(CASES) - len(missed)} of {len(CASES)}")
    assert len(CASES) > 38
    assert not missed, missed
    assert not wrong_check, "\n".join(wrong_check)


def test_call_count_varies_with_the_seed() -> None:
    """The number of workload-shape trials is drawn per verification: a kernel cannot count on it."""
    fam = family_module("fakes.broken")
    wl = fam.workload(5, 8)
    verdicts = [verify(fam, wl, fam.broken, seed=s) for s in range(12)]
    assert all(v.passed for v in verdicts)
    assert len({v.trials for v in verdicts}) > 1


def test_odd_shape_differs_from_the_workload() -> None:
    for rows in (1, 2, 3, 5, 15, 16, 17, 4099, 4100, 10**6):
        r = odd_rows(rows)
        assert r != rows and r % 2 == 1 and r >= 3


def test_guard_catches_a_write_on_either_side() -> None:
    ref = torch.randn(5, 7)
    g = guarded_like(ref, seed=3)
    assert g.out.shape == ref.shape and g.out.stride() == ref.stride()
    assert bool(g.out.isnan().all()) and guard_damage(g) is None
    g.out.copy_(ref)
    assert guard_damage(g) is None
    g.buf[g.guard + g.span] = 0.0
    assert "past the end" in (guard_damage(g) or "")
    h = guarded_like(ref, seed=4)
    h.buf[h.guard - 1] = 0.0
    assert "before the output" in (guard_damage(h) or "")


def test_nan_reference_needs_the_same_nan() -> None:
    """A fully masked softmax row is NaN in the reference, as in eager, and in the real kernel (the
    adversaries that write 0 or 1/N there fail the verifier's NaN-pattern check)."""
    x = torch.full((2, 8), -float("inf"))
    x[0] = torch.randn(8)
    ref = SM.softmax_ref(x)
    assert bool(ref[1].isnan().all()) and bool(torch.softmax(x, -1)[1].isnan().all())
    y = SM.softmax(x.to(DEVICE)).cpu()
    assert bool(y[1].isnan().all())
