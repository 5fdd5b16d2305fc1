"""Benchmark kernel families on a GPU: eager vs torch.compile vs Liger-Kernel (when installed) vs
solforge, forward and forward+backward, at the Qwen3-4B shapes.

    python bench/families.py [--families swiglu] [--budget 120] [--out bench/results/NAME.json]

Each family in FAMILIES times its shapes with triton.testing.do_bench medians (L2 flushed between
runs; bench/e2e.py's helpers). solforge's kernel is first tuned for each shape with
solforge.tune.tune (heuristic first, then the space, within --budget seconds per shape), then timed
through its custom op, the way an integrated model calls it. Effective TB/s counts the bytes a
fused kernel must move (inputs read once, outputs written once); the device-to-device copy ceiling
is measured in the same run. RMSNorm lives in bench/e2e.py.

swiglu (y = act(gate) * up, bf16, gate/up (rows, 9728)):
  16384 x 9728  inference, B2 S8192      4096 x 9728  training, B1 S4096
  fwd reads gate, up and writes y (3 tensors); fwd+bwd adds dy, gate, up read and dgate, dup
  written (5 more). Eager is Hugging Face's `act_fn(gate) * up`; fwd+bwd runs autograd.grad (no
  .grad accumulation kernels). Liger (silu only): LigerSiLUMulFunction, whose backward writes the
  gradients into its saved inputs, so it gets its own copies (their values drift over the runs;
  memory-bound timings do not depend on values).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import bench_us, provenance, write_json  # noqa: E402  (bench/ is a folder of scripts, not a package)

DEVICE = "cuda"  # a module constant so a CPU smoke run (interpreter) can swap it
COPY_GB = 1.0  # the copy ceiling is measured with 1 GiB read + 1 GiB written: far past L2


def copy_ceiling_TBps() -> float:  # noqa: N802
    n = int(COPY_GB * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (us * 1e-6) / 1e12


def _tbps(nbytes: int, us: float) -> float:
    return round(nbytes / (us * 1e-6) / 1e12, 3)


# ---------------------------------------------------------------------------------------------
# swiglu

SWIGLU_SHAPES = [(16384, 9728, "Qwen3-4B inference, B2 S8192"), (4096, 9728, "Qwen3-4B training, B1 S4096")]


def _hf_act(act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if act == "silu":
        return F.silu
    if act == "gelu_tanh":
        return lambda g: F.gelu(g, approximate="tanh")
    return F.gelu


def _liger_fn(act: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    if act != "silu":
        return None
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return LigerSiLUMulFunction.apply


def _fwd_bwd(f: Callable[..., torch.Tensor], g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor) -> Callable[[], Any]:
    def step() -> Any:
        return torch.autograd.grad(f(g, u), (g, u), dy)

    return step


def bwd_sweep(fam: Any, wl: Any, dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str,
              elem: int) -> list[tuple[float, float, str]]:
    """The backward kernel over the forward's space (the tune loop verifies one output per call,
    the backward has two): each config checked against swiglu_bwd_ref once, then timed.
    Returns (us, TB/s, config) for the fastest 10, the heuristic marked with '*'."""
    from solforge.numerics import compare

    rg, ru = fam.swiglu_bwd_ref(dy, g, u, act)
    heur = fam.heuristic(wl)
    out = []
    for c in [heur, *[c for c in fam.space(wl) if c != heur]]:
        with torch.no_grad():
            dg, du = fam.swiglu_bwd(dy, g, u, act, config=c)
            if not (compare(dg, rg).ok and compare(du, ru).ok):
                out.append((float("inf"), 0.0, c.encode() + " FAILED"))
                continue
            us = bench_us(lambda c=c: fam.swiglu_bwd(dy, g, u, act, config=c))
        out.append((round(us, 2), _tbps(5 * elem, us), c.encode() + ("*" if c == heur else "")))
    top = sorted(out)[:10]
    return top + [r for r in out if r[2].endswith("*") and r not in top]


def swiglu_row(rows: int, N: int, label: str, act: str, budget: float, sweep_bwd: bool) -> dict[str, Any]:
    from solforge.kernels import swiglu as fam
    from solforge.records import RunResult
    from solforge.tune import tune

    torch.manual_seed(0)
    dtype = torch.bfloat16
    g = (2 * torch.randn(rows, N, device=DEVICE)).to(dtype)
    u = torch.randn(rows, N, device=DEVICE).to(dtype)
    dy = torch.randn(rows, N, device=DEVICE).to(dtype)
    elem = g.numel() * g.element_size()
    fwd_bytes, train_bytes = 3 * elem, 8 * elem
    row: dict[str, Any] = {"shape": [rows, N], "what": label, "act": act, "dtype": "bf16",
                           "fwd_bytes": fwd_bytes, "fwd_bwd_bytes": train_bytes}
    hf = _hf_act(act)

    def eager(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return hf(g) * u

    comp = torch.compile(eager, dynamic=False)
    fns: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"eager": eager, "compile": comp}
    lig = _liger_fn(act)
    if lig is not None:
        fns["liger"] = lig

    wl = fam.workload_for(g, u, act)
    t0 = time.perf_counter()
    res = tune(wl, RunResult(), device=DEVICE, budget_s=budget)
    row["tune_s"] = round(time.perf_counter() - t0, 1)
    row["candidates"] = len(res.records)
    row["rejected"] = [f"{r.candidate.label}: {r.error}" for r in res.records if not r.ok][:5]
    assert res.best is not None, [r.error for r in res.records]
    cfg = fam.Config(**res.best.candidate.config_dict)
    enc = cfg.encode()
    row["solforge_config"] = enc
    row["solforge_heuristic"] = fam.heuristic(wl).encode()
    row["solforge_tuned_p50_us"] = round(res.best.time_us, 2)
    row["tuned"] = sorted((round(r.time_us, 2), fam.Config(**r.candidate.config_dict).encode())
                           for r in res.records if r.ok)[:8]
    op = fam.swiglu_op.default
    fns["solforge"] = lambda g, u: op(g, u, act, enc)

    # forward: no autograd graph
    with torch.no_grad():
        for name, f in fns.items():
            a, b = (g.clone(), u.clone()) if name == "liger" else (g, u)
            f(a, b)
            row[f"fwd_{name}_us"] = bench_us(lambda f=f, a=a, b=b: f(a, b))
        gu = torch.cat([g, u], dim=-1)  # Phi-3's fused gate_up, chunked: strided views, no copies
        gc, uc = gu.chunk(2, dim=-1)
        row["fwd_solforge_chunked_us"] = bench_us(lambda: op(gc, uc, act, enc))
        row["fwd_solforge_heuristic_us"] = bench_us(lambda: op(g, u, act, ""))
        row["bwd_solforge_kernel_us"] = bench_us(lambda: fam.swiglu_bwd_op(dy, g, u, act, ""))
    if sweep_bwd:
        row["bwd_sweep"] = bwd_sweep(fam, wl, dy, g, u, act, elem)
    # forward + backward through autograd
    for name, f in fns.items():
        a = (g.clone() if name == "liger" else g).requires_grad_(True)
        b = (u.clone() if name == "liger" else u).requires_grad_(True)
        step = _fwd_bwd(f, a, b, dy)
        step()
        row[f"fwd_bwd_{name}_us"] = bench_us(step)
        a.requires_grad_(False)
        b.requires_grad_(False)
    # correctness of what was timed (one fresh call each), against the fp32 reference
    ref = fam.swiglu_ref(g, u, act)
    for name, f in fns.items():
        if name != "liger":
            with torch.no_grad():
                row[f"max_abs_err_{name}"] = float((f(g, u).float() - ref.float()).abs().max())
    for k in [k for k in row if k.endswith("_us") and k.startswith(("fwd_", "bwd_"))]:
        nbytes = train_bytes if k.startswith("fwd_bwd_") else 5 * elem if k.startswith("bwd_") else fwd_bytes
        row[k.replace("_us", "_TBps")] = _tbps(nbytes, row[k])
        row[k] = round(row[k], 2)
    row["speed_of_light_fwd_us_at_3.02TBps"] = round(fwd_bytes / 3.02e12 * 1e6, 2)
    row["speed_of_light_fwd_bwd_us_at_3.02TBps"] = round(train_bytes / 3.02e12 * 1e6, 2)
    return row


def swiglu_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for act in args.acts.split(","):
        for rows, N, label in SWIGLU_SHAPES:
            out.append(swiglu_row(rows, N, label, act, args.budget, not args.no_bwd_sweep))
            print(json.dumps(out[-1]), flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# add_rmsnorm: s = x + residual; y = rmsnorm(s) -> (s, y), Hugging Face's rounding (bf16, eps 1e-6)

ADD_RMSNORM_SHAPES = [(16384, 2560, "Qwen3-4B inference, B2 S8192"), (4096, 2560, "Qwen3-4B training, B1 S4096")]


def _hf_add_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = r + x
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return s, w * h.to(s.dtype)


def add_rmsnorm_row(rows: int, H: int, label: str, budget: float) -> dict[str, Any]:
    from solforge.kernels import add_rmsnorm as fam
    from solforge.records import RunResult
    from solforge.tune import tune

    torch.manual_seed(0)
    dt_ = torch.bfloat16
    x, r, ds, dy = (torch.randn(rows, H, device=DEVICE).to(dt_) for _ in range(4))
    w = (1 + 0.1 * torch.randn(H, device=DEVICE)).to(dt_)
    elem = x.numel() * x.element_size()
    # forward reads x, r and writes s, y; backward reads dy, ds, s and writes dx (dr is the same tensor)
    fwd_bytes, train_bytes = 4 * elem, 8 * elem
    row: dict[str, Any] = {"shape": [rows, H], "what": label, "dtype": "bf16", "fwd_bytes": fwd_bytes,
                           "fwd_bwd_bytes": train_bytes}
    fns: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
        "eager": _hf_add_norm, "compile": torch.compile(_hf_add_norm, dynamic=False)}
    try:
        from liger_kernel.ops import LigerFusedAddRMSNormFunction

        fns["liger"] = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 0.0, "llama", False)[::-1]
    except ImportError:
        pass
    wl = fam.workload_for(x, r, w, 1e-6, dt_, True)
    t0 = time.perf_counter()
    res = tune(wl, RunResult(), device=DEVICE, budget_s=budget)
    row["tune_s"] = round(time.perf_counter() - t0, 1)
    row["candidates"] = len(res.records)
    assert res.best is not None, [r.error for r in res.records]
    enc = fam.Config(**res.best.candidate.config_dict).encode()
    row["solforge_config"] = enc
    row["solforge_heuristic"] = fam.heuristic(wl).encode()
    fns["solforge"] = lambda x, r, w: fam.add_rmsnorm_op(x, r, w, 1e-6, dt_, True, enc)
    with torch.no_grad():
        ref = fam.add_rmsnorm_ref(x, r, w, 1e-6, round_before_weight=True)
        for name, f in fns.items():
            f(x, r, w)
            row[f"fwd_{name}_us"] = bench_us(lambda f=f: f(x, r, w))
            got = f(x, r, w)
            row[f"max_abs_err_{name}"] = max(float((a.float() - b.float()).abs().max())
                                             for a, b in zip(got, ref, strict=True))
    for name, f in fns.items():
        leaves = [t.clone().requires_grad_(True) for t in (x, r, w)]

        def step(f: Callable[..., Any] = f, leaves: list[torch.Tensor] = leaves) -> Any:
            s, y = f(*leaves)
            return torch.autograd.grad((s, y), leaves, (ds, dy))

        step()
        row[f"fwd_bwd_{name}_us"] = bench_us(step)
    for k in [k for k in row if k.endswith("_us") and k.startswith("fwd_")]:
        row[k.replace("_us", "_TBps")] = _tbps(train_bytes if k.startswith("fwd_bwd_") else fwd_bytes, row[k])
        row[k] = round(row[k], 2)
    row["speed_of_light_fwd_us_at_3.02TBps"] = round(fwd_bytes / 3.02e12 * 1e6, 2)
    return row


def add_rmsnorm_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for rows, H, label in ADD_RMSNORM_SHAPES:
        out.append(add_rmsnorm_row(rows, H, label, args.budget))
        print(json.dumps(out[-1]), flush=True)
    return out


def rope_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import family_rope

    return family_rope.run(args.budget)


def layernorm_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import family_layernorm  # layernorm and add_layernorm (bench/family_layernorm.py)

    return family_layernorm.run(args.budget)


# ---------------------------------------------------------------------------------------------

def softmax_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import family_softmax  # bench/family_softmax.py: a sweep of the space, not tune()

    return family_softmax.run()


def gelu_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import family_gelu  # bench/family_gelu.py: gelu(x + b) at GPT-2-like shapes

    return family_gelu.run(args.budget, args.gelu_approx, not args.no_bwd_sweep)


def cross_entropy_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import family_cross_entropy

    return family_cross_entropy.run()


def linear_cross_entropy_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import family_linear_ce

    return family_linear_ce.run()


FAMILIES: dict[str, Callable[[argparse.Namespace], list[dict[str, Any]]]] = {
    "swiglu": swiglu_rows, "add_rmsnorm": add_rmsnorm_rows, "rope": rope_rows, "layernorm": layernorm_rows,
    "softmax": softmax_rows, "cross_entropy": cross_entropy_rows, "gelu": gelu_rows,
    "linear_cross_entropy": linear_cross_entropy_rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of: {', '.join(FAMILIES)}")
    p.add_argument("--budget", type=float, default=120.0, help="solforge tuning budget per shape (s)")
    p.add_argument("--acts", default="silu", help="swiglu activations: silu,gelu_tanh,gelu")
    p.add_argument("--gelu-approx", default="tanh", help="gelu approximations: tanh,none")
    p.add_argument("--no-bwd-sweep", action="store_true",
                   help="skip timing the backward kernel over the space (swiglu, gelu)")
    p.add_argument("--out", default=None, help="JSON file to write")
    a = p.parse_args(argv)
    unknown = [f for f in a.families.split(",") if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if not torch.cuda.is_available():
        print("bench/families.py needs a CUDA GPU", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        **provenance(), "copy_ceiling_TBps": round(copy_ceiling_TBps(), 3),
    }
    print(json.dumps(result), flush=True)
    for fam in a.families.split(","):
        result[fam] = FAMILIES[fam](a)
    write_json(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
