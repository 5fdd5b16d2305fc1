"""softmax against eager, torch.compile and Liger's softmax (when installed), forward and forward+
backward; run through bench/families.py --families softmax.

Shapes: eager attention scores of a Qwen3-4B-sized model (B2 x 32 heads x 1024 x 1024, and 4096 x
4096 at B1) in the upcast form transformers writes, `softmax(s, -1, dtype=float32).to(bf16)`, and a
vocabulary-wide row (4096 x 151936 bf16) for the online variant. solforge's side is a sweep of the
whole space (verified, then timed): the best config and the heuristic's are both reported, which is
what the heuristic should be fitted to. Effective TB/s: fwd reads x and writes y (2 tensors);
fwd+bwd adds dy and y read, dx written (5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from e2e import bench_us

DEVICE = "cuda"
SHAPES = [((2, 32, 1024, 1024), "Qwen3-4B eager attention, B2 S1024"),
          ((1, 32, 4096, 4096), "Qwen3-4B eager attention, B1 S4096"),
          ((4096, 151936), "vocabulary-wide rows (online variant)")]


def sweep(fam: Any, wl: Any, launch: Callable[[Any], Any], limit: int = 40) -> dict[str, Any]:
    """Verify and time the heuristic and (up to `limit` of) the space; the best verified config."""
    from solforge.tune.verify import verify

    times: dict[str, float] = {}
    failed: dict[str, str] = {}
    configs = [fam.heuristic(wl), *[c for c in fam.space(wl) if c != fam.heuristic(wl)]][:limit]
    for c in configs:
        v = verify(fam, wl, lambda *a, c=c, **k: getattr(fam, fam.FAMILY)(*a, config=c, **k), device=DEVICE)
        if not v.passed:
            failed[c.encode()] = v.reason or "?"
            continue
        times[c.encode()] = round(bench_us(lambda c=c: launch(c)), 2)
    best = min(times, key=times.__getitem__) if times else None
    return {"best_config": best, "best_us": times.get(best) if best else None,
            "heuristic": fam.heuristic(wl).encode(), "heuristic_us": times.get(fam.heuristic(wl).encode()),
            "space_us": times, "failed": failed}


def _liger() -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError:
        return None
    return LigerSoftmaxFunction.apply


def _row(shape: tuple[int, ...], label: str) -> dict[str, Any]:
    from solforge.kernels import softmax as fam

    torch.manual_seed(0)
    bf = torch.bfloat16
    x = (torch.randn(shape, device=DEVICE) * 3).to(bf)
    dy = torch.randn(shape, device=DEVICE).to(bf)
    elem = x.numel() * 2
    row: dict[str, Any] = {"family": "softmax", "shape": list(shape), "what": label, "dtype": "bf16 (fp32 math)",
                           "fwd_bytes": 2 * elem, "fwd_bwd_bytes": 5 * elem}
    wl = fam.workload_for(x, bf)
    row.update(sweep(fam, wl, lambda c: fam.softmax(x, config=c)))

    def eager(x: torch.Tensor) -> torch.Tensor:
        return F.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)

    enc = row["best_config"] or ""
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "eager": eager, "compile": torch.compile(eager, dynamic=False),
        "solforge": lambda x: fam.softmax_op(x, bf, enc)}
    liger = _liger()
    if liger is not None:
        fns["liger"] = liger  # bf16 in and out (its own upcast inside)
    ref = fam.softmax_ref(x)
    for name, f in fns.items():
        try:
            with torch.no_grad():
                f(x)
                row[f"fwd_{name}_us"] = round(bench_us(lambda f=f: f(x)), 2)
                row[f"max_abs_err_{name}"] = float((f(x).float() - ref.float()).abs().max())
            leaf = x.clone().requires_grad_(True)

            def step(f: Callable[..., Any] = f, leaf: torch.Tensor = leaf) -> Any:
                return torch.autograd.grad(f(leaf), [leaf], dy)

            step()
            row[f"fwd_bwd_{name}_us"] = round(bench_us(step), 2)
        except Exception as e:  # e.g. Liger refuses rows past 65536 columns: say so, go on
            row[f"error_{name}"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    for k in [k for k in row if k.endswith("_us") and k.startswith("fwd_")]:
        nbytes = row["fwd_bwd_bytes"] if k.startswith("fwd_bwd_") else row["fwd_bytes"]
        row[k.replace("_us", "_TBps")] = round(nbytes / (row[k] * 1e-6) / 1e12, 3)
    return row


def run() -> list[dict[str, Any]]:
    import json

    out = []
    for shape, label in SHAPES:
        out.append(_row(shape, label))
        print(json.dumps(out[-1]), flush=True)
    return out
