"""A small cost model for the evolutionary search: ridge regression of log time on config features.

The search asks one question of it: of these unmeasured configs, which are likely fastest? So it
is judged by ranking (Spearman, top-k recall; tests/test_search.py), not by its error in µs.

Features of a config (a dict of knob -> value), fixed by the whole space at construction so every
fit sees the same columns:
  - one-hot of every knob value (the main effects, with no shape assumed: a block width that
    leaves masked lanes is slow however wide it is),
  - log2 of each numeric knob, and all pairwise products and squares of those logs (interactions:
    elements a thread = rows x block / warps is a sum of logs, and its optimum is a bowl, i.e. a
    quadratic form in the logs).
Columns are standardized over the space; the target is log time, centered. The ridge penalty is
chosen per fit by leave-one-out error over a small grid, computed in closed form from one SVD
(under 1 ms for 200 points x 50 features), so the model is cautious with 10 points and sharp
with 100 without a knob to set.

Failures are excluded from the fit: their time is undefined (inf) and any stand-in value would be
an outlier that bends a linear model. The search never re-proposes a failed config anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# ridge penalties tried per fit (features are standardized, so these are on the scale of n)
_LAMBDAS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
_MAX_ONE_HOT = 16  # a knob with more distinct values gets only its log feature


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


class CostModel:
    """Ridge regression of log(time) on one-hot + log + log-product features of a config."""

    def __init__(self, space: Sequence[Mapping[str, Any]]) -> None:
        """`space`: every config the model will be asked about (it fixes the feature columns)."""
        knobs = sorted({k for c in space for k in c})
        self._one_hot: list[tuple[str, Any]] = []
        self._logs: list[tuple[str, float]] = []  # (knob, offset added before log2)
        self._cats: list[tuple[str, Any]] = []  # values of non-numeric knobs (variant, backend)
        for k in knobs:
            values = sorted({c.get(k) for c in space}, key=lambda v: (str(type(v)), v))
            if len(values) < 2:
                continue  # a constant says nothing
            if len(values) <= _MAX_ONE_HOT:
                self._one_hot += [(k, v) for v in values]
            if _numeric(values):
                self._logs.append((k, 0.0 if min(values) > 0 else 1.0 - min(values)))
            elif len(values) <= _MAX_ONE_HOT:
                self._cats += [(k, v) for v in values]
        raw = self._raw(space)
        self._mean = raw.mean(axis=0) if len(raw) else np.zeros(raw.shape[1])
        std = raw.std(axis=0) if len(raw) else np.ones(raw.shape[1])
        self._std = np.where(std > 1e-12, std, 1.0)
        self._w: np.ndarray | None = None
        self._y0 = 0.0
        self.lam = math.nan  # the penalty the last fit chose
        self.n_fit = 0

    def _raw(self, configs: Sequence[Mapping[str, Any]]) -> np.ndarray:
        rows = []
        for c in configs:
            f = [1.0 if c.get(k) == v else 0.0 for k, v in self._one_hot]
            logs = [math.log2(float(c.get(k, 0)) + off) for k, off in self._logs]
            f += logs
            f += [logs[i] * logs[j] for i in range(len(logs)) for j in range(i, len(logs))]
            for k, v in self._cats:  # a variant may move the other knobs' optimum
                on = 1.0 if c.get(k) == v else 0.0
                f += [on * x for x in logs] + [on * x * x for x in logs]
            rows.append(f)
        nl = len(self._logs)
        width = len(self._one_hot) + nl + nl * (nl + 1) // 2 + 2 * nl * len(self._cats)
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), width)

    def features(self, configs: Sequence[Mapping[str, Any]]) -> np.ndarray:
        return (self._raw(configs) - self._mean) / self._std

    def fit(self, configs: Sequence[Mapping[str, Any]], times_us: Sequence[float]) -> CostModel:
        """Fit on the finite, positive times (failures, inf, are left out: see the module doc)."""
        pairs = [(c, t) for c, t in zip(configs, times_us, strict=True) if math.isfinite(t) and t > 0]
        self.n_fit = len(pairs)
        if not pairs:
            self._w, self._y0 = None, 0.0
            return self
        X = self.features([c for c, _ in pairs])
        y = np.log(np.asarray([t for _, t in pairs]))
        self._y0 = float(y.mean())
        y = y - self._y0
        if len(pairs) < 3 or X.shape[1] == 0:
            self._w = np.zeros(X.shape[1])
            return self
        U, s, Vt = np.linalg.svd(X, full_matrices=False)
        Uy = U.T @ y
        best = (math.inf, _LAMBDAS[0])
        for lam in _LAMBDAS:
            shrink = s * s / (s * s + lam)
            fitted = U @ (shrink * Uy)
            hat = (U * U) @ shrink  # diagonal of the hat matrix
            loo = (y - fitted) / np.maximum(1.0 - hat, 1e-6)
            err = float(np.mean(loo * loo))
            if err < best[0]:
                best = (err, lam)
        self.lam = best[1]
        self._w = Vt.T @ ((s / (s * s + self.lam)) * Uy)
        return self

    def predict(self, configs: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Predicted log time (µs) of each config; lower is faster. Before a fit: all equal."""
        if not configs:
            return np.zeros(0)
        if self._w is None:
            return np.full(len(configs), self._y0)
        return self.features(configs) @ self._w + self._y0
