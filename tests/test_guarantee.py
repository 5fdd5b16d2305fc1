"""The model-level guarantee (validate/guarantee.py): what optimize returns. The rule is driven with
stand-in models and end-to-end results (the GPU's clock faked); optimize() itself runs on the CPU,
its check faked to fail, and, with the speed rule forced on, its subsets integrated for real."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from conftest import DEVICE

from solforge.records import BuildResult, Candidate, E2EReport, RunResult, TuneResult, TuningRecord, Verdict, Workload
from solforge.runtime.inplace import installed
from solforge.validate import guarantee
from solforge.validate.guarantee import MAX_SUBSETS, choose, gains, subsets


def _w(i: int) -> Workload:
    return Workload("rmsnorm", ((8, 16 * (i + 1)),), ("fp32",))


def _e2e(speedup: float | None, passed: bool = True) -> E2EReport:
    base = 10.0
    return E2EReport(base, None if speedup is None else base / speedup, speedup, 0.0, 0.0, None, passed,
                     note=None if passed else "output: relative error 0.3 > 0.05")


class Runs:
    """Stand-in models: the result of each set of workloads left out, and the sets asked for."""

    def __init__(self, results: dict[frozenset[Workload], E2EReport]) -> None:
        self.results, self.asked = results, []

    def __call__(self, dropped: frozenset[Workload]) -> tuple[Any, E2EReport]:
        self.asked.append(dropped)
        return f"model without {sorted(w.key for w in dropped)}", self.results.get(dropped, _e2e(0.9))


SAVED = {_w(0): 5.0, _w(1): 40.0, _w(2): 1.0, _w(3): 12.0}  # µs saved per call, by workload


def test_subsets_leave_out_the_smallest_savings_first() -> None:
    order = [_w(2), _w(0), _w(3), _w(1)]  # smallest saving first
    assert subsets(SAVED) == [frozenset(order[:1]), frozenset(order[:2]), frozenset(order[:3])]
    assert subsets({_w(0): 1.0, _w(1): 2.0}) == [frozenset({_w(0)})]
    assert subsets({_w(0): 1.0}) == [] and subsets({}) == []
    many = {_w(i): float(i) for i in range(9)}
    assert [len(s) for s in subsets(many)] == [1, 4, 8] and len(subsets(many)) <= MAX_SUBSETS


def test_a_faster_verified_model_is_returned_as_it_is() -> None:
    runs = Runs({})
    c = choose("original", ("full", _e2e(1.3)), runs, SAVED, meaningful=True)
    assert (c.model, c.returned, c.dropped, runs.asked) == ("full", "optimized", frozenset(), [])
    assert "1.30x" in c.why and len(c.attempts) == 1 and c.attempts[0].regions == 4


def test_a_slower_model_gives_the_first_faster_subset() -> None:
    """Slower with every kernel; without the smallest saving still slower; without the smaller half
    faster: that one is returned, and every attempt is in the report with its numbers."""
    half = frozenset({_w(2), _w(0)})
    runs = Runs({frozenset({_w(2)}): _e2e(0.95), half: _e2e(1.08)})
    c = choose("original", ("full", _e2e(0.86)), runs, SAVED, meaningful=True, hint="bound by the host")
    assert c.returned == "subset" and c.dropped == half and c.e2e is not None and c.e2e.speedup == 1.08
    assert c.model == runs(half)[0] and runs.asked[:2] == [frozenset({_w(2)}), half]
    assert "slower end to end than the original (0.86x: 11.63 ms against 10.00 ms)" in c.why
    assert "bound by the host" in c.why and "2 of its 4 workloads" in c.why and "1.08x" in c.why
    assert [(a.regions, a.speedup, a.dropped) for a in c.attempts] == [
        (4, 0.86, ()), (3, 0.95, (_w(2).key,)), (2, 1.08, tuple(sorted(w.key for w in half)))]


def test_when_no_subset_is_faster_the_original_object_comes_back() -> None:
    original = object()
    runs = Runs({})
    c = choose(original, ("full", _e2e(0.5)), runs, SAVED, meaningful=True)
    assert c.model is original and c.returned == "original" and c.dropped == frozenset(SAVED)
    assert len(runs.asked) == MAX_SUBSETS and len(c.attempts) == 1 + MAX_SUBSETS
    assert "none of 3 subsets tried was verified and not slower" in c.why and c.e2e is not None
    assert c.e2e.speedup == 0.5  # the full model's result: what was wrong with it


def test_a_failed_check_on_the_gpu_tries_subsets_and_a_subset_that_fails_is_not_taken() -> None:
    runs = Runs({frozenset({_w(2)}): _e2e(1.4, passed=False), frozenset({_w(2), _w(0)}): _e2e(1.1)})
    c = choose("original", ("full", _e2e(1.5, passed=False)), runs, SAVED, meaningful=True)
    assert c.returned == "subset" and c.dropped == frozenset({_w(2), _w(0)})
    assert c.why.startswith("the end-to-end check failed (output: relative error 0.3 > 0.05)")


def test_an_untimed_model_on_the_gpu_is_not_taken_for_faster() -> None:
    c = choose("original", ("full", _e2e(None)), Runs({}), {_w(0): 1.0}, meaningful=True)
    assert c.returned == "original" and "could not be timed" in c.why


def test_off_the_gpu_speed_is_not_judged_and_a_failed_check_gives_the_original_without_subsets() -> None:
    runs = Runs({})
    slow = choose("original", ("full", _e2e(0.2)), runs, SAVED, meaningful=False)
    assert slow.returned == "optimized" and slow.model == "full" and "not judged" in slow.why
    failed = choose("original", ("full", _e2e(0.2, passed=False)), runs, SAVED, meaningful=False)
    assert failed.returned == "original" and failed.model == "original" and runs.asked == []


@pytest.mark.parametrize("meaningful", [True, False])
def test_keep_slower_returns_the_full_model_and_says_what_is_wrong(meaningful: bool) -> None:
    runs = Runs({})
    for e2e in (_e2e(0.7), _e2e(1.2, passed=False)):
        c = choose("original", ("full", e2e), runs, SAVED, meaningful=meaningful, keep_slower=True)
        if not e2e.passed or meaningful:
            assert c.model == "full" and c.returned == "optimized" and "keep_slower" in c.why
    assert runs.asked == []


def test_gains_are_the_measured_savings_times_the_count_with_the_backward() -> None:
    from solforge.plan import Region, WorkloadGroup

    def result(w: Workload, base: float, best: float | None) -> TuneResult:
        if best is None:
            return TuneResult(w, RunResult(base, base, base))
        rec = TuningRecord(Candidate(w, "triton", "v", ()), BuildResult(True), Verdict(True, 4, 0.0, 0.0),
                           RunResult(best, best, best))
        return TuneResult(w, RunResult(base, base, base), (rec,), rec)

    def regions(w: Workload, n: int) -> list[Any]:
        return [Region("rmsnorm", 0, f"out{i}", (), (), w) for i in range(n)]

    fwd, other, bwd = _w(0), _w(1), Workload("rmsnorm_bwd", ((8, 16),), ("fp32",))
    groups = [WorkloadGroup(fwd, regions(fwd, 3)), WorkloadGroup(other, regions(other, 1)),
              WorkloadGroup(bwd, regions(fwd, 3), forward=fwd)]
    results = [result(fwd, 10.0, 6.0), result(other, 5.0, None), result(bwd, 20.0, 22.0)]
    saved = gains(groups, results, {fwd, other})
    assert saved == {fwd: pytest.approx(3 * 4.0 - 3 * 2.0), other: 0.0}


# ------------------------------------------------------------------------------------------------
# optimize() on the CPU


class TwoNorms(torch.nn.Module):
    """Two rmsnorm workloads (hidden sizes 48 and 32)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 48), torch.nn.Linear(48, 32)
        self.n1, self.n2 = torch.nn.RMSNorm(48, eps=1e-6), torch.nn.RMSNorm(32, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n2(self.down(self.n1(self.up(x))))


def _optimize(m: torch.nn.Module, **kw: Any) -> tuple[Any, Any]:
    from solforge.api import optimize

    torch.manual_seed(0)
    x = torch.randn(5, 32, device=DEVICE)
    return optimize(m, (x,), budget=30, max_candidates=1, db=False, profile="off", families=["rmsnorm"], **kw)


def _failing_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from solforge import api

    real = api.validate

    def validate(*args: Any, **kwargs: Any) -> E2EReport:
        e2e = real(*args, **kwargs)
        return E2EReport(**{**e2e.__dict__, "passed": False, "note": "output: relative error 0.3 > 0.05 (faked)"})

    monkeypatch.setattr(api, "validate", validate)


@pytest.mark.parametrize("keep_slower", [False, True])
def test_optimize_returns_the_original_when_the_check_fails(monkeypatch: pytest.MonkeyPatch, keep_slower: bool) -> None:
    """A failed check gives the model itself back, its regions reported as left, the why in the
    report: off the GPU at once, on a GPU after the subsets (guarantee.subsets) failed too;
    keep_slower returns the optimized model all the same, no subset tried."""
    from solforge import api

    _failing_check(monkeypatch)
    # both kernels enter the full model, on a GPU too (where one not faster than its tiny region
    # would stay out): the subsets tried are known
    real_kept_out = api.kept_out
    monkeypatch.setattr(api, "kept_out", lambda *a, **k: real_kept_out(*a, **{**k, "keep_slower": True}))
    m = TwoNorms().to(DEVICE).eval()
    plain = copy.deepcopy(m)  # optimize works in place: the reference is a copy made before
    x = torch.randn(3, 32, device=DEVICE)
    opt, report = _optimize(m, keep_slower=keep_slower)
    assert report.e2e is not None and not report.e2e.passed and report.attempts[0].regions == 2
    tried = len(subsets({_w(0): 1.0, _w(1): 2.0})) if DEVICE == "cuda" and not keep_slower else 0
    assert len(report.attempts) == 1 + tried and not any(a.passed for a in report.attempts)
    assert opt is m  # the user's model object either way
    if keep_slower:
        assert installed(m) is not None and report.returned == "optimized" and "keep_slower" in report.why
        assert all(r.integrated for r in report.regions) and sum(opt.solforge_stats.replaced.values()) == 2
        with torch.no_grad():
            torch.testing.assert_close(opt(x), plain(x), rtol=1e-5, atol=1e-5)
    else:
        assert installed(m) is None and report.returned == "original"
        assert report.why.startswith("the end-to-end check failed (output: relative error 0.3 > 0.05 (faked))")
        assert not any(r.integrated for r in report.regions) and all(r.verified for r in report.regions)
        assert any(n.startswith("returned the original model: the end-to-end check failed") for n in report.notes)


def test_optimize_returns_a_faster_subset_integrated_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The speed rule forced on (the GPU's): the end-to-end time is faked slower while both kernels
    run, faster with one. optimize integrates the model again without the smaller saving, checks it
    for real, and returns it: one rmsnorm kernel in it, its outputs the original's."""
    from solforge import api

    real_validate, real_choose = api.validate, api.choose

    def validate(original: Any, optimized: Any, *args: Any, **kwargs: Any) -> E2EReport:
        e2e = real_validate(original, optimized, *args, **kwargs)
        replaced = sum(optimized.solforge_stats.replaced.values())
        return E2EReport(**{**e2e.__dict__, "baseline_ms": 10.0, "optimized_ms": 10.0 / (0.9 if replaced == 2 else 1.2),
                            "speedup": 0.9 if replaced == 2 else 1.2})

    monkeypatch.setattr(api, "validate", validate)
    monkeypatch.setattr(api, "choose", lambda *a, **k: real_choose(*a, **{**k, "meaningful": True}))
    m = TwoNorms().to(DEVICE).eval()
    opt, report = _optimize(m)
    assert report.returned == "subset" and opt is not m, report.why
    assert [(a.regions, a.speedup) for a in report.attempts] == [(2, 0.9), (1, 1.2)]
    (dropped,) = report.attempts[1].dropped
    assert sum(opt.solforge_stats.replaced.values()) == 1 and dropped not in opt.solforge_stats.replaced
    assert {r.workload: r.integrated for r in report.regions} == {r.workload: r.workload != dropped
                                                                   for r in report.regions}
    assert report.e2e is not None and report.e2e.speedup == 1.2 and report.e2e.passed
    assert "0.90x" in report.why and "1.20x" in report.why and math.isfinite(report.e2e.max_rel_err)
    x = torch.randn(3, 32, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), rtol=1e-5, atol=1e-5)


def test_train_mode_returns_a_faster_subset_whose_gradients_are_eagers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Train mode: the same rule on whole training steps. The subset is integrated again with its
    forward ops' backward kernels (FWD|BWD) and checked on gradients too; a training step through
    it gives the original's gradients."""
    from solforge import api

    real_validate, real_choose = api.validate, api.choose

    def validate(original: Any, optimized: Any, *args: Any, **kwargs: Any) -> E2EReport:
        e2e = real_validate(original, optimized, *args, **kwargs)
        assert e2e.grads_compared > 0
        replaced = sum(optimized.solforge_stats.replaced.values())
        return E2EReport(**{**e2e.__dict__, "speedup": 0.8 if replaced == 2 else 1.1})

    monkeypatch.setattr(api, "validate", validate)
    monkeypatch.setattr(api, "choose", lambda *a, **k: real_choose(*a, **{**k, "meaningful": True}))
    m = TwoNorms().to(DEVICE)
    opt, report = _optimize(m, mode="train")
    assert report.returned == "subset" and [a.speedup for a in report.attempts] == [0.8, 1.1], report.why
    assert report.e2e is not None and report.e2e.passed and report.e2e.grads_compared > 0
    assert sum(opt.solforge_stats.replaced.values()) == 1
    ref = TwoNorms().to(DEVICE)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(3, 32, device=DEVICE)
    opt(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_a_model_that_raises_while_checked_is_a_failed_check() -> None:
    e = guarantee.failed_run(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not e.passed
    assert e.note == "running it raised OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert not guarantee.acceptable(e, meaningful=False)
