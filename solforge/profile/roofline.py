"""Roofline and Amdahl arithmetic (pure functions; units: bytes, FLOPs, microseconds).

speed of light (per repeat) = max(bytes / copy bandwidth, FLOPs / matmul rate)
saving (Amdahl)             = sum over repeats of (measured - speed of light) = time - count * sol
The ranking is by saving: the end-to-end time gone if that region ran at its speed of light.
"""

from __future__ import annotations

from solforge.records import Ceilings

# A region whose kernels average under this many microseconds is limited by launching them, not
# by its bytes or FLOPs (an H100 kernel launch costs ~2-5 us of host time; a 1 x 2560 RMSNorm
# runs in 4.9 us, BASELINES.md).
LAUNCH_US = 5.0
HALF_TYPES = ("bf16", "fp16", "fp8")


def matmul_tflops(ceil: Ceilings, dtype: str) -> float:
    return ceil.bf16_tflops if dtype in HALF_TYPES else ceil.fp32_tflops


def memory_us(nbytes: float, ceil: Ceilings) -> float:
    return nbytes / (ceil.copy_gbs * 1e3)  # GB/s = 1e3 bytes/us


def compute_us(flops: float, ceil: Ceilings, dtype: str) -> float:
    return flops / (matmul_tflops(ceil, dtype) * 1e6)  # TFLOP/s = 1e6 FLOP/us


def sol_us(nbytes: float, flops: float, ceil: Ceilings, dtype: str) -> float:
    return max(memory_us(nbytes, ceil), compute_us(flops, ceil, dtype))


def bound(nbytes: float, flops: float, per_kernel_us: float, ceil: Ceilings, dtype: str) -> str:
    """'launch' for tiny kernels, else whichever ceiling sets the speed of light."""
    if per_kernel_us < LAUNCH_US:
        return "launch"
    return "compute" if compute_us(flops, ceil, dtype) > memory_us(nbytes, ceil) else "memory"


def saving_us(time_us: float, count: int, sol: float) -> float:
    """Amdahl: the time saved end to end if each of `count` repeats took `sol` instead."""
    return max(0.0, time_us - count * sol)


def achieved(nbytes: float, flops: float, count: int, time_us: float) -> tuple[float, float]:
    """(GB/s, TFLOP/s) achieved over all repeats."""
    if time_us <= 0:
        return 0.0, 0.0
    return nbytes * count / time_us / 1e3, flops * count / time_us / 1e6


def pct_of_sol(sol: float, count: int, time_us: float) -> float:
    """How close the measured time is to the speed of light, in percent (100 = at the ceiling)."""
    return 100.0 * sol * count / time_us if time_us > 0 else 0.0
