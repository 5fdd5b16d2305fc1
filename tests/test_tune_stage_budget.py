"""The tuning budget is shared among the searches by the bytes each workload's regions move."""

from __future__ import annotations

import pytest

from solforge.plan.match import WorkloadGroup
from solforge.records import Workload
from solforge.tune.stage import budget_share, weight


def _group(shape: tuple[int, ...], dtype: str = "fp32", regions: int = 1) -> WorkloadGroup:
    g = WorkloadGroup(Workload("generated", (shape, (shape[-1],)), (dtype, dtype)))
    g.regions.extend([object()] * regions)  # type: ignore[list-item]
    return g


def test_the_budget_goes_by_the_bytes_the_regions_move() -> None:
    big, mid, small = _group((128, 128, 130, 130)), _group((128, 64, 64, 64)), _group((64, 128, 4, 4))
    todo = [big, mid, small]
    first = budget_share(20.0, big, todo)
    assert first == pytest.approx(20.0 * weight(big) / sum(map(weight, todo)))
    assert first > 15.0  # the 3.7 ms region takes most of it (it had a third)
    assert weight(small) < 0.001 * weight(big)
    # what is left after the first is shared by the rest alike; the last takes all that is left
    assert budget_share(5.0, mid, todo) == pytest.approx(5.0 * weight(mid) / (weight(mid) + weight(small)))
    assert budget_share(0.5, small, todo) == 0.5
    # two regions of one workload weigh twice one; a bf16 workload half an fp32 one of its shape
    assert weight(_group((64, 64), regions=2)) == 2 * weight(_group((64, 64)))
    assert 2 * weight(_group((64, 64), "bf16")) == weight(_group((64, 64)))
    assert weight(_group((3,), "int64")) == 3 * 8 + 3 * 8
