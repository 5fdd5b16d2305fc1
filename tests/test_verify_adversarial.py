"""The verifier rejects every adversarial launcher (tests/adversarial.py), each by the check meant
for it, and still passes the real kernels' heuristic configs."""

from __future__ import annotations

import dataclasses
import importlib

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


def test_large_workloads_share_trial_inputs_and_still_reject_every_adversary(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every workload counted as large (trials at the workload shape reuse trial 1's inputs
    and reference, snapshots may live on the host), the real configs still pass and no adversary
    does: a kernel wrong after some calls is caught on the reused inputs as on fresh ones."""
    V = importlib.import_module("solforge.tune.verify")  # the module (solforge.tune exports the function)

    monkeypatch.setattr(V, "LARGE_BYTES", 1)
    for name, wl in WORKLOADS.items():
        fam = family_module(wl.family)
        real, config = launcher_of(fam), fam.heuristic(wl)
        v = verify(fam, wl, lambda *a, real=real, config=config, **k: real(*a, config=config, **k), device=DEVICE)
        assert v.passed, (name, v.reason)
    missed = [f"{w}: {n}" for w, n, make, _ in CASES
              if verify(family_module(WORKLOADS[w].family), WORKLOADS[w],
                        make(family_module(WORKLOADS[w].family), WORKLOADS[w]), device=DEVICE).passed]
    assert not missed, missed


def test_large_workloads_draw_one_set_of_inputs_at_the_workload_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from solforge.kernels import registry
    V = importlib.import_module("solforge.tune.verify")  # the module (solforge.tune exports the function)

    wl = WORKLOADS["softmax"]
    fam = family_module(wl.family)
    real, config = launcher_of(fam), fam.heuristic(wl)
    calls: list[int | None] = []
    draw = registry.make_inputs

    def counting(family, workload, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append(kw.get("rows"))
        return draw(family, workload, **kw)

    monkeypatch.setattr(registry, "make_inputs", counting)
    v_small = verify(fam, wl, lambda *a, **k: real(*a, config=config, **k), device=DEVICE)
    small = calls.count(None)
    calls.clear()
    monkeypatch.setattr(V, "LARGE_BYTES", 1)
    v_large = verify(fam, wl, lambda *a, **k: real(*a, config=config, **k), device=DEVICE)
    assert v_small.passed and v_large.passed
    assert v_large.trials == v_small.trials  # the same checks, the same count of calls
    assert small >= 4 and calls.count(None) == 1


def test_compare_in_chunks_gives_the_verdict_of_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    from solforge import numerics as N

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(37, 29, generator=g)
    ref[3, 4] = float("nan")
    cases = {"equal": ref.clone(), "close": ref + 1e-7, "one off": ref.clone(), "nan": ref.clone()}
    cases["one off"][30, 1] += 0.5
    cases["nan"][11, 2] = float("nan")
    whole = {k: N.compare(v, ref) for k, v in cases.items()}
    monkeypatch.setattr(N, "CHUNK_NUMEL", 7)
    for k, v in cases.items():
        assert N.compare(v, ref) == whole[k], k
    assert whole["equal"].ok and whole["close"].ok and not whole["one off"].ok and not whole["nan"].ok


def test_a_reference_out_of_device_memory_runs_on_the_host() -> None:
    from solforge.tune.verify import _reference

    seen: list[str] = []

    def ref(x: torch.Tensor, *, scale: float) -> torch.Tensor:
        seen.append(x.device.type)
        if len(seen) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return x * scale

    x = torch.arange(6.0, device=DEVICE)
    got = _reference(ref, (x,), {"scale": 2.0})
    assert seen == [x.device.type, "cpu"]
    assert got.device == x.device and torch.equal(got, x * 2)


def test_a_large_workloads_model_path_runs_before_the_calls_that_reuse_its_inputs() -> None:
    """Large workloads: the model's path (no out=) at the workload shape is the first trial, so no
    earlier call has left the right answer for its inputs in freed memory (a launcher that skips a
    row there found it: the softmax adversary passed about one CPU run in three when it ran after
    the out= trials), and the workload-shape out= trials after it reuse its inputs."""
    V = importlib.import_module("solforge.tune.verify")
    wl = WORKLOADS["softmax"]
    fam = family_module(wl.family)
    small, large = V._plan(fam, wl, 3, 1234, DEVICE), V._plan(fam, wl, 3, 1234, DEVICE, large=True)
    assert large[0].model and large[0].rows is None and not large[0].reuse
    shaped = [t for t in large[1:] if t.rows is None and t.edge is None and not t.model]
    assert shaped and all(t.reuse for t in shaped)
    assert sorted(t.label for t in small) == sorted(t.label for t in large)  # the same trials, reordered
    assert not any(t.reuse for t in small) and small[0].label == "trial 1"
