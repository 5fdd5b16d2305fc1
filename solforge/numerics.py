"""Dtypes, tolerances and error measures: one table for the tests, the verifier and validation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from solforge.errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()} | {torch.float64: "fp64"}


def parse_dtype(name: str) -> torch.dtype:
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
        name, name
    )
    if key not in DTYPES:
        raise UserError(f"unsupported dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Element-wise |out - ref| <= atol + rtol * |ref|, with ref computed in fp32 (fp64 for fp32 inputs)
# and rounded to the output dtype. bf16 keeps 8 mantissa bits (one ulp is 2**-8 = 0.4% to 0.8%
# relative), so two correct roundings of nearby fp32 values may differ by one ulp: rtol 1.6e-2
# leaves room for two. fp16 has 11 bits (one ulp <= 9.8e-4 relative).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
    torch.float16: Tolerance(atol=1e-3, rtol=2e-3),
    torch.float32: Tolerance(atol=1e-5, rtol=2e-5),
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The dtype's tolerance; an integer or bool output (argmax's indices, a mask) is compared exactly."""
    if not dtype.is_floating_point and not dtype.is_complex:
        return EXACT
    return TOLERANCES[dtype]


EXACT = Tolerance(atol=0.0, rtol=0.0)


@dataclass(frozen=True)
class Comparison:
    ok: bool
    max_abs_err: float
    max_rel_err: float  # max |out - ref| / max |ref|: relative to the output's scale
    reason: str | None = None


# compare() and the verifier's norms work through tensors this many elements at a time: fp64
# temporaries of a whole KernelBench-sized tensor (1.6e9 elements) would need tens of GB beside it.
CHUNK_NUMEL = 1 << 24


def chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` flattened (a copy only if it is not contiguous), in pieces of CHUNK_NUMEL elements."""
    flat = t.detach().reshape(-1)
    return [flat[i:i + CHUNK_NUMEL] for i in range(0, flat.numel(), CHUNK_NUMEL)] or [flat]


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance | None = None) -> Comparison:
    """Compare `out` with `ref` element-wise under `tol` (default: the table's for out.dtype).

    Also fails when `out` has NaN/Inf where `ref` has none, or a different shape or dtype. Works
    through large tensors in chunks (the same verdict and numbers as in one piece).
    """
    if out.shape != ref.shape:
        return Comparison(False, float("inf"), float("inf"), f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    tol = tol or tolerance(out.dtype)
    max_abs, scale, n_bad, n_nonfinite, n_finite = 0.0, 0.0, 0, 0, 0
    worst: tuple[float, float, float] | None = None  # (excess, |err|, |ref|) of the worst element
    for oc, rc in zip(chunks(out), chunks(ref), strict=True):
        o, r = oc.double(), rc.double()
        finite = torch.isfinite(r)
        n_nonfinite += int(((~torch.isfinite(o)) & finite).sum())
        if n_nonfinite:
            continue
        all_finite = bool(finite.all())
        diff = (o - r).abs() if all_finite else (o - r).abs()[finite]
        rr = r.abs() if all_finite else r.abs()[finite]
        del o, r, finite
        if diff.numel() == 0:
            continue
        n_finite += diff.numel()
        max_abs, scale = max(max_abs, float(diff.max())), max(scale, float(rr.max()))
        excess = diff - (tol.atol + tol.rtol * rr)
        bad = int((excess > 0).sum())
        if bad:
            n_bad += bad
            i = int(excess.argmax())
            if worst is None or float(excess[i]) > worst[0]:
                worst = (float(excess[i]), float(diff[i]), float(rr[i]))
    if n_nonfinite:
        return Comparison(False, float("inf"), float("inf"),
                          f"{n_nonfinite} NaN/Inf (or unwritten) values where the reference is finite")
    if n_finite == 0:
        return Comparison(True, 0.0, 0.0)
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    if worst is not None:
        return Comparison(
            False, max_abs, max_rel,
            f"{n_bad} elements out of tolerance (atol {tol.atol}, rtol {tol.rtol}); "
            f"worst |err| {worst[1]:.3g} at |ref| {worst[2]:.3g}",
        )
    return Comparison(True, max_abs, max_rel)


# Inputs above this many elements are drawn on the device: CPU draws of a Qwen3-4B-sized tensor
# (10^7 - 10^8 values) took seconds per verification trial, most of a tuning budget.
DEVICE_DRAW_NUMEL = 1 << 22


def input_generator(numel: int, device: str | torch.device, seed: int) -> tuple[torch.Generator, torch.device]:
    """A seeded generator for a family's `make_inputs` and the device to draw on: the CPU for small
    inputs (the same numbers on every machine, what the CPU tests see), the GPU for large ones."""
    dev = torch.device(device)
    where = dev if dev.type == "cuda" and numel > DEVICE_DRAW_NUMEL else torch.device("cpu")
    return torch.Generator(device=where).manual_seed(seed), where
