"""Schedules of a generated region: the search space the tuner walks, with the config triad.

  pointwise  a 1-D tile of `block` loop points per program over the flat loop index
  rows       `rows` rows per program x the whole reduced extent in one `block` (a power of two >= it):
             everything stays in registers, every stage and the stores in one pass over memory
  looped     `rows` rows per program, the reduced extent in `block`-wide chunks: one pass per
             reduction stage (a running per-lane accumulator), then one pass that stores
`contig` records the dim of the loop treated as contiguous (the last dim of the loop, or of the
reduced dims for a reduction: the one the flat index walks fastest); the first generator reads it
only as a record, later tilings (2-D tiles, channels-last reads) will pick other dims.
`is_valid` admits exactly what the generator handles: every tail is masked, so any shape works.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from solforge.codegen.lower import Lowered
from solforge.kernels import config_text

VARIANTS = ("pointwise", "rows", "looped")
_WARPS = (1, 2, 4, 8, 16, 32)
# fp32 values of one tile a thread holds at once: past this the compiler spills (kernels/softmax.py)
_MAX_PER_THREAD = 64
_MAX_TILE = 16384  # elements of a rows tile
_SINGLE_PASS_MAX = 16384  # widest reduced extent held whole in registers
_ABBREV = {"block": "b", "rows": "r", "num_warps": "w", "contig": "c"}


@dataclass(frozen=True)
class Schedule(config_text.Text):
    variant: str = "pointwise"
    block: int = 1024
    rows: int = 1
    num_warps: int = 4
    contig: int = 0

    _family, _variants, _abbrev = "generated", VARIANTS, _ABBREV
    _always = ("block", "num_warps")

    @classmethod
    def decode(cls, text: str) -> Schedule:
        return config_text.decode(cls, text, family="generated", variants=VARIANTS, abbrev=_ABBREV)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def contig_dim(region: Lowered) -> int:
    s = region.space
    dims = s.reduced if region.reduces and s.reduced else tuple(range(len(s.shape)))
    return dims[-1] if dims else 0


def is_valid(schedule: Schedule, region: Lowered) -> bool:
    c, s = schedule, region.space
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or not (_pow2(c.block) and _pow2(c.rows)):
        return False
    if c.contig != contig_dim(region):
        return False
    if not region.reduces:
        return c.variant == "pointwise" and c.rows == 1 and c.block <= 16384 and \
            c.block // (32 * c.num_warps) <= _MAX_PER_THREAD
    if c.variant == "pointwise" or c.rows > triton.next_power_of_2(max(s.rows, 1)):
        return False
    width = triton.next_power_of_2(max(s.cols, 1))
    if c.variant == "rows":
        return c.block == width and c.rows * c.block <= _MAX_TILE and \
            c.rows * c.block // (32 * c.num_warps) <= _MAX_PER_THREAD
    return c.block < width and c.rows * c.block <= _MAX_TILE and \
        c.rows * c.block // (32 * c.num_warps) <= _MAX_PER_THREAD


def _warps_for(elems: int, per_thread: int) -> int:
    return max(1, min(32, triton.next_power_of_2(elems // (32 * per_thread) + 1) // 2))


def space(region: Lowered) -> list[Schedule]:
    s, cd = region.space, contig_dim(region)
    out: list[Schedule] = []
    if not region.reduces:
        n = triton.next_power_of_2(max(s.numel, 1))
        for block in (128, 256, 512, 1024, 2048, 4096, 8192):
            if block > max(n, 128):
                break
            out += [Schedule("pointwise", block, 1, w, cd) for w in (1, 2, 4, 8) if 1 <= block // (32 * w) <= 16]
    else:
        width = triton.next_power_of_2(max(s.cols, 1))
        rows_max = triton.next_power_of_2(max(s.rows, 1))
        if width <= _SINGLE_PASS_MAX:
            r = 1
            while r <= rows_max and r * width <= _MAX_TILE:
                for ept in (4, 8, 16, 32):
                    out.append(Schedule("rows", width, r, _warps_for(r * width, ept), cd))
                r *= 2
        for block in (64, 128, 256, 512, 1024, 2048, 4096):
            if block >= width:
                break
            for r in (1, 2, 4, 8):
                if r <= rows_max:
                    out += [Schedule("looped", block, r, w, cd) for w in (1, 2, 4, 8)
                            if 1 <= r * block // (32 * w) <= 32]
    seen: set[Schedule] = set()
    return [c for c in out if is_valid(c, region) and not (c in seen or seen.add(c))]  # type: ignore[func-returns-value]


def heuristic(region: Lowered) -> Schedule:
    """Untuned default. Pointwise: 1024-wide tiles, 4 warps (smaller regions: one tile). Reductions:
    the whole reduced extent in registers up to 8K wide (several short rows per program so a tile
    holds ~4K elements; off the GPU, the interpreter pays per program: as many rows as fit 16K),
    else 2048-wide chunks. Not yet measured on a GPU."""
    s, cd = region.space, contig_dim(region)
    gpu = region.ir.device == "cuda"
    if not region.reduces:
        n = triton.next_power_of_2(max(s.numel, 1))
        block = min(1024 if gpu else 8192, max(n, 128))
        return Schedule("pointwise", block, 1, _warps_for(block, 8) if gpu else 4, cd)
    width = triton.next_power_of_2(max(s.cols, 1))
    rows_max = triton.next_power_of_2(max(s.rows, 1))
    if width <= 8192:
        r = max(1, min(rows_max, (4096 if gpu else _MAX_TILE) // width))
        c = Schedule("rows", width, r, _warps_for(r * width, 16), cd)
    else:
        c = Schedule("looped", 2048, 1, 8, cd)
    while not is_valid(c, region) and c.num_warps < 32:
        c = Schedule(c.variant, c.block, c.rows, c.num_warps * 2, cd)
    return c
