"""The verifier holds a generated region's kernel to the model's own accuracy: each output's
absolute tolerance is at least EAGER_FACTOR x the error of the region's ops run in their own dtypes
(eager) against the fp64 reference, so a long fp32 sum passes where eager's own error exceeds the
dtype's element tolerance, and a kernel much less accurate than eager still fails."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from codegen_helpers import trace
from conftest import DEVICE

from solforge.codegen import regions as RG
from solforge.kernels import generated as G
from solforge.numerics import tolerance
from solforge.tune.verify import verify

V = importlib.import_module("solforge.tune.verify")  # the module (solforge.tune exports the function)


def _sum_workload(rows: int, n: int) -> Any:
    x = torch.randn(rows, n, device=DEVICE)
    (fr,) = RG.form_regions(trace(lambda x: (x * 3.0).sum(-1) - 1.0, x).graph)
    return G.workload_for(fr.lowered.ir)


def test_tolerance_is_eager_error_times_the_factor() -> None:
    wl = _sum_workload(5, 3001)
    args, kwargs = G.make_inputs(wl, seed=3)
    ref = G.generated_ref(*args, **kwargs)
    eager = G.eager_outputs(*args, **kwargs)
    err = float((eager[0].double() - ref[0].double()).abs().max())
    (tol,) = V._eager_tolerance(G.eager_outputs, args, kwargs, ref, None)
    base = tolerance(torch.float32)
    assert tol.rtol == base.rtol and tol.atol == max(base.atol, V.EAGER_FACTOR * err)


def test_a_kernel_as_accurate_as_eager_passes_and_a_much_worse_one_fails(monkeypatch: Any) -> None:
    wl = _sum_workload(7, 2049)
    monkeypatch.setattr(V, "EAGER_FACTOR", 4.0)

    def shifted(by: float) -> Any:
        def launch(*a: Any, out: Any = None, **k: Any) -> Any:
            got = G.generated(*a, out=out, **k)
            ref = G.generated_ref(*a, **k)[0]
            eager = G.eager_outputs(*a, **k)[0]
            err = float((eager.double() - ref.double()).abs().max())
            # off by `by` x eager's error, or by `by` x the fp32 element tolerance where eager is exact
            delta = by * max(err, tolerance(torch.float32).atol)
            got[0].add_(delta)
            return got
        return launch

    assert verify(G, wl, G.generated).passed
    assert verify(G, wl, shifted(2.0)).passed  # within 4x eager's (or the dtype's) error
    bad = verify(G, wl, shifted(50.0))
    assert not bad.passed and "out of tolerance" in (bad.reason or ""), bad


def test_without_eager_outputs_the_dtype_tolerance_stands() -> None:
    """Families with hand-written references have no eager_outputs: nothing is widened for them."""
    from solforge.kernels import registry
    from solforge.kernels import rmsnorm as RN

    assert registry.eager_outputs(RN) is None
    assert registry.eager_outputs(G) is G.eager_outputs
