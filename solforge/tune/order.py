"""A large config space in an order worth walking under a budget: a spread, not the list's order.

The generated family's space (codegen/schedule.py) holds 250-340 schedules at GPU shapes, listed
variant by variant and block size by block size. Walked in that order under a budget or
`max_candidates`, the first N measured are all small-block configs of the first variant. `spread`
orders it instead so that any prefix covers the space: the variants in turn (round robin), and
within each variant a farthest-point order over its knobs, starting from the config nearest the
variant's middle (a middling block size and warp count), then the one farthest from everything
taken so far (the extremes), then the gaps between. Each knob counts by the rank of its value
among the variant's values, scaled to 0..1, so block 64 vs 128 weighs as 1024 vs 2048.

Deterministic (ties: the list's order). The database still stores every measured record; this
changes only which are measured first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _codes(configs: Sequence[Any]) -> np.ndarray:
    """Each config's knob values as ranks scaled to 0..1 (knobs with one value left out)."""
    rows = [dict(c.items()) for c in configs]
    knobs = sorted({k for r in rows for k in r if k != "variant"})
    cols = []
    for k in knobs:
        values = sorted({r.get(k) for r in rows}, key=lambda v: (str(type(v)), v))
        if len(values) < 2:
            continue
        rank = {v: i / (len(values) - 1) for i, v in enumerate(values)}
        cols.append([rank[r.get(k)] for r in rows])
    return np.asarray(cols, dtype=np.float64).T.reshape(len(configs), len(cols))


def _farthest_first(configs: Sequence[Any]) -> list[Any]:
    if len(configs) <= 2:
        return list(configs)
    x = _codes(configs)
    if x.shape[1] == 0:
        return list(configs)
    mid = np.median(x, axis=0)
    first = int(np.argmin(((x - mid) ** 2).sum(axis=1)))
    order = [first]
    dist = ((x - x[first]) ** 2).sum(axis=1)
    dist[first] = -1.0
    while len(order) < len(configs):
        nxt = int(np.argmax(dist))  # the first of equals: the list's order breaks ties
        order.append(nxt)
        dist = np.minimum(dist, ((x - x[nxt]) ** 2).sum(axis=1))
        dist[order] = -1.0
    return [configs[i] for i in order]


def spread(configs: Sequence[Any]) -> list[Any]:
    """`configs` (each with `variant` and `items()`) reordered so that every prefix is a spread:
    variants in turn, each one's configs farthest-first (module doc). Same members, same count."""
    by_variant: dict[Any, list[Any]] = {}
    for c in configs:
        by_variant.setdefault(c.variant, []).append(c)
    queues = [_farthest_first(v) for v in by_variant.values()]
    out: list[Any] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out
