"""Outputs for the verifier: poisoned, inside a larger buffer whose guard regions catch stray writes.

A kernel that writes one element past its output (a tail mask off by one, a row too many) corrupts
whatever the allocator put next; on the GPU that is another tensor, on the CPU interpreter it can
kill the process. The verifier hands such a kernel an output that lies inside a buffer with guard
regions of seeded random bytes on both sides, so the stray write lands in memory the verifier owns
and shows as changed guard bytes. Random bytes, not NaN: a kernel that stores its masked lanes'
NaN past the end would write exactly NaN's bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Guard elements on each side: at least this many, and two rows of the output's last dim (an extra
# row written past the end), rounded up to a multiple of ALIGN so the output keeps the 16-byte
# alignment Triton specializes kernels on (a misaligned output would compile another kernel than
# the one the model runs).
GUARD_MIN = 256
ALIGN = 128
# Written where the reference is NaN/Inf, so an element the kernel never writes cannot pass as the
# reference's NaN. Finite and odd, so no kernel computes it by chance.
SENTINEL = -1234.5


@dataclass(frozen=True)
class Guarded:
    """`out` (shaped and strided like the reference) inside `buf`, with `guard` elements before and
    after its span holding the bytes `before` and `after`."""

    out: torch.Tensor
    buf: torch.Tensor
    guard: int
    span: int
    before: torch.Tensor
    after: torch.Tensor


def _span(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element of `t` in its storage."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


def guarded_like(ref: torch.Tensor, seed: int) -> Guarded:
    """An output shaped, strided and typed like `ref`, NaN where `ref` is finite and SENTINEL where
    it is not (an integer or bool one: ~ref, unequal to it everywhere), inside guard regions of
    random bytes (from `seed`)."""
    last = ref.shape[-1] if ref.dim() else 1
    guard = -(-max(GUARD_MIN, 2 * last) // ALIGN) * ALIGN
    span = _span(ref)
    buf = torch.empty(span + 2 * guard, dtype=ref.dtype, device=ref.device)
    size = ref.element_size() * guard
    g = torch.Generator().manual_seed(seed)
    before = torch.randint(0, 256, (size,), generator=g, device="cpu", dtype=torch.uint8).to(ref.device)
    after = torch.randint(0, 256, (size,), generator=g, device="cpu", dtype=torch.uint8).to(ref.device)
    raw = buf.view(torch.uint8)
    raw[:size] = before
    raw[raw.numel() - size:] = after
    out = buf.as_strided(ref.shape, ref.stride(), guard)
    if ref.dtype.is_floating_point:
        buf[guard:guard + span].fill_(float("nan"))
    else:  # an integer or bool output (indices, a mask): each element the reference's complement
        buf[guard:guard + span].zero_()
        out.copy_(~ref)
    bad = ~torch.isfinite(ref)
    if bool(bad.any()):
        out[bad] = SENTINEL
    return Guarded(out, buf, guard, span, before, after)


def guard_damage(g: Guarded) -> str | None:
    """None when both guard regions hold their bytes, else what changed."""
    raw = g.buf.view(torch.uint8)
    size = g.before.numel()
    hit_before = int((raw[:size] != g.before).sum())
    hit_after = int((raw[raw.numel() - size:] != g.after).sum())
    if not hit_before and not hit_after:
        return None
    where = [f"{n} byte(s) {side} the output" for n, side in ((hit_before, "before"), (hit_after, "past the end of"))
             if n]
    return "wrote outside its output: " + ", ".join(where) + " changed (guard region)"
