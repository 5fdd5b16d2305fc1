"""probe: where the host time of one solforge op call goes (cProfile over many calls).

Where the host (CPU) time of one solforge op call goes: cProfile over many calls on the GPU.

    python tools/host_profile.py [--family layernorm] [--rows 16384] [--hidden 2560] [--calls 200]

Prints host microseconds per call (wall clock, no synchronization inside the loop) of the op's
forward under no_grad, of forward + autograd.grad, and of eager torch for the same computation,
then the cProfile table (by internal time) of the forward + backward loop.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def host_us(fn: Callable[[], Any], calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="layernorm", choices=["layernorm", "rmsnorm", "swiglu"])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    import solforge.kernels.layernorm  # noqa: F401  (registers the ops)
    import solforge.kernels.rmsnorm  # noqa: F401
    import solforge.kernels.swiglu  # noqa: F401

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(a.rows, a.hidden, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(a.hidden, device=dev, dtype=bf, requires_grad=True)
    b = torch.randn(a.hidden, device=dev, dtype=bf, requires_grad=True)
    dy = torch.randn(a.rows, a.hidden, device=dev, dtype=bf)
    if a.family == "layernorm":
        ops = {"solforge": lambda: torch.ops.solforge.layernorm(x, w, b, 1e-5, bf, ""),
               "eager": lambda: F.layer_norm(x, (a.hidden,), w, b, 1e-5)}
        wrt = [x, w, b]
    elif a.family == "rmsnorm":
        ops = {"solforge": lambda: torch.ops.solforge.rmsnorm(x, w, 1e-6, bf, True, ""),
               "eager": lambda: F.rms_norm(x, (a.hidden,), w, 1e-6)}
        wrt = [x, w]
    else:
        up = torch.randn_like(dy)
        ops = {"solforge": lambda: torch.ops.solforge.swiglu(x, up, "silu", ""),
               "eager": lambda: F.silu(x) * up}
        wrt = [x]
    for name, f in ops.items():
        with torch.no_grad():
            fwd = host_us(f, a.calls)
        step = lambda f=f: torch.autograd.grad(f(), wrt, dy)  # noqa: E731
        both = host_us(step, a.calls)
        print(f"{a.family} {name}: host us per call: forward {fwd:.1f}, forward+backward {both:.1f}", flush=True)
    step = lambda: torch.autograd.grad(ops["solforge"](), wrt, dy)  # noqa: E731
    step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.calls):
        step()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
