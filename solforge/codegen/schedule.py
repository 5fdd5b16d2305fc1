"""Schedules of a generated region: the search space the tuner walks, with the config triad.

  pointwise  a 1-D tile of `block` loop points per program over the flat loop index, which walks
             `contig` fastest: the dim the outputs are stored along contiguously (a channels-last
             region walks C), the loop's last dim for a contiguous one
  rows       `rows` rows per program x the whole reduced extent in one `block` (a power of two >= it):
             everything stays in registers, every stage and the stores in one pass over memory
  looped     `rows` rows per program, the reduced extent in `block`-wide chunks: one pass per
             reduction stage (a running per-lane accumulator), then one pass that stores
  tiles      a reduction over dims that are not the inputs' innermost (a sum over C of (B, C, H*W),
             stats over N, H, W of a channels-last tensor, a mean over dim 0): a 2-D tile of
             `block` neighbouring rows, walked along the kept dim `contig` (the inputs' contiguous
             one), x `rblock` of the reduced extent. Loads are coalesced along the kept dim and
             each lane accumulates its own row; the epilogue (the pointwise ops that use the
             reduced values) runs in a second loop over the same tiles. `rblock` covering the
             whole reduced extent: one pass, in registers, as `rows`. `splits` > 1 (few tiles, long
             reductions: BatchNorm statistics of a channels-last tensor with few channels, a mean
             over dim 0 of a tall tensor): the tiles' reduced extent split across programs, with
             the phases and workspace of `split`.
             For a pointwise region that transposes (a permuted or channels-last input into an
             output laid out otherwise; layout.transpose_dims): a 2-D tile of `block` points along
             `contig`, one of the two dims, x `rblock` along the other, the rest of the loop from
             the program id: the input is read along its contiguous dim, the output written along
             its own.
  split      few, long rows (a loss, a full-tensor sum, 16 rows of 1M): each row's reduced extent
             split across `splits` programs (`rows` rows and `block`-wide chunks each, as `looped`).
             Launched once per reduction stage, then once to store (a constexpr PHASE): each
             phase writes fp32 partials of its stage's reductions to a workspace, the next phase
             first combines the earlier stages' partials in a fixed order (no atomics: the same
             result every run). Any number of stages (var's mean then squares, softmax's max then
             sum) splits this way, at one launch per stage.
`online` (looped, split, and tiles whose `rblock` is narrower than the reduced extent or split):
each (sum, sum of squared deviations) pair (online.py's VAR_DOC: a mean and a variance, Welford's
way) in one pass, and each online pair of the region (online.py: a `max` and, one stage later, a `sum` of exp(c * (A -
max)) over the same dims: softmax, log_softmax, logsumexp, cross-entropy) in one pass, a running
max and a rescaled sum per lane, so a chunked softmax reads its row twice (max and sum, then the
store), not three times; a split writes each program's (max, sum) partials and the next phase
combines them the same way, one launch fewer per pair. `is_valid` admits it only where the region
has a pair and the schedule is chunked (not `rows`, which reads once anyway). The space holds
every chunked schedule with and without it (the tuner measures both); the heuristic takes it
where its pick is chunked. `online` = 2 keeps the running max per row instead of per lane: each
chunk's max is reduced across lanes first (a cross-lane reduction per chunk for one rescaling exp per
row instead of one per element; softmax pairs only); in the space for looped and split.
`contig` is the dim of the loop whose index the tile walks fastest: for `tiles` a kept dim (the
row index is decomposed with it innermost) or one of a transpose's two dims; for the others the
last dim of the loop, or of the reduced dims for a reduction (what the flat index walks fastest),
as `contig_dim` says. Which dim the inputs are contiguous along is layout.py's analysis.
`is_valid` admits exactly what the generator handles: every tail is masked, so any shape works.
A region with a scan (cumsum, cumprod) runs only `rows` and `looped`: each row walked in order
within one program (a split or a tile of neighbouring rows would need the scan's carry across
programs or lanes). A region with an index-returning reduction (argmax, max.dim) runs every
schedule but a split one (`split`, split tiles): its partials would be (value, index) pairs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import triton

from solforge.codegen import layout, online
from solforge.codegen.lower import Lowered
from solforge.kernels import config_text

VARIANTS = ("pointwise", "rows", "looped", "tiles", "split")
_WARPS = (1, 2, 4, 8, 16, 32)
# fp32 values of one tile a thread holds at once: past this the compiler spills (kernels/softmax.py)
_MAX_PER_THREAD = 64
_MAX_TILE = 16384  # elements of a rows tile
_SINGLE_PASS_MAX = 16384  # widest reduced extent held whole in registers
# The H100 SXM's SM count. A split reduction pays off while the rows alone give fewer than about
# two programs per SM; the split heuristic aims at that many programs (more for huge rows, below).
SMS = 132
# split tiles enter the space from this reduced extent: below it a split's share of a row is too
# short to pay for the extra launch per stage
_SPLIT_TILES_COLS = 4096
# partials a program combines per reduction (a power of two >= splits of them, rows x that many a
# tile, within _MAX_PER_THREAD a thread)
_MAX_SPLITS = 8192
# Rows of this many columns or more, few of them (a loss's mean over 1G values), split into about
# _FILL_SPLIT programs an SM at least: 256 programs of 8 warps leave 3/4 of an H100's warp slots
# empty on a pass that only streams memory; and into programs of about _SPLIT_VALUES values each
# where that makes more (Inductor's split reduction makes 8192 blocks of 256 threads for
# sum(x[1G]): 512 values a thread; 1024 programs of 1M values each measured 4.5% slower than it on
# KernelBench's MSELoss, H200 2026-11-28: with many short programs the SMs that stream faster take
# more of them). Splits past _FEW_SPLITS hold at least _SPLIT_MIN_COLS columns.
_HUGE_COLS = 1 << 24
_FILL_SPLIT = 8
_SPLIT_VALUES = 1 << 17
_FEW_SPLITS = 128
_SPLIT_MIN_COLS = 1 << 15
# rows this long get split schedules in the space however many rows there are (`_split_space`)
_SPLIT_LONG_COLS = 1 << 16
# a `tiles` heuristic holds reduced extents up to this whole (fewer neighbouring rows, 32 at least
# for coalesced loads): KernelBench level 2's LayerNorm over W = 64 of a channels-last tensor was
# tuned to 128 rows x 32 in two chunks (two passes over its 537 MB input, 1477 µs, H200 2026-11-28)
_WHOLE_TILE_COLS = 128
_MAX_UNROLLED_LOADS = 128  # loads a thread's code unrolls (`_code_ok`)
_ABBREV = {"block": "b", "rows": "r", "num_warps": "w", "contig": "c", "rblock": "rb", "splits": "s", "online": "o"}


@dataclass(frozen=True)
class Schedule(config_text.Text):
    variant: str = "pointwise"
    block: int = 1024
    rows: int = 1
    num_warps: int = 4
    contig: int = 0
    rblock: int = 1  # tiles: reduced elements per tile (a transposing pointwise region: points along the slow dim)
    splits: int = 1  # split (and split tiles): programs per row
    # 1: each online (max, sum of exp) pair in one pass (online.py), a running max per lane; 2: per
    # row (each chunk's max reduced across lanes: one rescaling exp per row, not per element); chunked only
    online: int = 0

    _family, _variants, _abbrev = "generated", VARIANTS, _ABBREV
    _always = ("block", "num_warps")

    @classmethod
    def decode(cls, text: str) -> Schedule:
        return config_text.decode(cls, text, family="generated", variants=VARIANTS, abbrev=_ABBREV)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def contig_dim(region: Lowered) -> int:
    """The loop dim a schedule's flat index walks fastest (`Schedule.contig`): for a reduction the
    last reduced dim; for a pointwise region the dim its outputs are stored along contiguously
    (the inputs' when no output has the loop's shape), so a channels-last region (a BatchNorm and
    ReLU between channels-last convolutions) is read and written along C, not strided by C along
    W: timm's ResNet-50 regions ran 2.7x slower than ATen's that way (H200, 2026-11-27). A region
    laid out as its loop (contiguous) keeps the last dim."""
    s = region.space
    if region.reduces:
        dims = s.reduced if s.reduced else tuple(range(len(s.shape)))
        return dims[-1] if dims else 0
    if not s.shape:
        return 0
    inner = layout.store_inner_dim(region)
    if inner is None:
        inner = layout.inner_dim(region)
    return inner if inner is not None else len(s.shape) - 1


def split_chunk(schedule: Schedule, region: Lowered) -> int:
    """Reduced elements one program of a split schedule (or split tiles) covers: a whole number of
    its chunks (`block`; tiles: `rblock`)."""
    k, b = region.space.cols, schedule.rblock if schedule.variant == "tiles" else schedule.block
    return triton.cdiv(triton.cdiv(k, schedule.splits), b) * b


def splits_ok(schedule: Schedule, region: Lowered) -> bool:
    """Every split holds at least one column (an empty one would only add identities)."""
    return 2 <= schedule.splits <= _MAX_SPLITS and (schedule.splits - 1) * split_chunk(schedule, region) < \
        region.space.cols and (schedule.variant != "split" or _combine_ok(schedule))


def _row_values_only(region: Lowered) -> bool:
    """One reduction stage and row values alone to store (a loss's mean): a split's only later
    phase is its row's first program combining the partials. Otherwise every program of each later
    phase reads every partial of its row (splits^2 loads), which many short programs would make
    count."""
    an = region.analysis
    return region.space.stages == 1 and all(an.kinds[o] == "row" for o in region.graph.outputs)


def _combine_ok(schedule: Schedule) -> bool:
    """A split's combining phase holds its rows' partials (a power of two of them) as one tile."""
    return _tile_ok(schedule.rows * triton.next_power_of_2(schedule.splits), schedule.num_warps)


def _tile_ok(elems: int, warps: int) -> bool:
    return elems <= _MAX_TILE and elems // (32 * warps) <= _MAX_PER_THREAD


def tile_elems(c: Schedule) -> int:
    """Elements of one program's tile."""
    return {"pointwise": c.block, "tiles": c.block * c.rblock}.get(c.variant, c.rows * c.block)


def _code_ok(c: Schedule, region: Lowered) -> bool:
    """The loads a thread's code unrolls (its elements of the tile x the loads of a loop point)
    stay within _MAX_UNROLLED_LOADS (one element a thread always may): two chained 3-D max pools
    (216 loads a point) in tiles of 256 x 32 on 16 warps made 93K lines of PTX that ptxas had not
    compiled after 6 minutes; an Inception block's chained pools (34-40 loads) in 8192-wide tiles
    on 32 warps (8 a thread, under a cap of 512) took tens of seconds each, a batch of 50 past 10
    minutes; at 256, 8 a thread x 31 loads still took about half a minute (tools/compile_sweep.py,
    2026-11-28)."""
    per_thread = max(1, tile_elems(c) // (32 * c.num_warps))
    return per_thread == 1 or per_thread * layout.loads_per_point(region) <= _MAX_UNROLLED_LOADS


def online_ok(schedule: Schedule, region: Lowered) -> bool:
    """`online` = 1 or 2 where a chunked pass runs the reductions (looped, split; tiles whose `rblock`
    is narrower than the reduced extent, or split) and the region has an online pair."""
    c = schedule
    chunked = c.variant in ("looped", "split") or (c.variant == "tiles" and (
        c.splits > 1 or c.rblock < triton.next_power_of_2(max(region.space.cols, 1))))
    return c.online in (1, 2) and region.reduces and chunked and bool(online.pairs(region) or (
        c.online == 1 and online.var_pairs(region)))


def is_valid(schedule: Schedule, region: Lowered) -> bool:
    c, s = schedule, region.space
    if c.online and not online_ok(c, region):
        return False
    if c.variant not in VARIANTS or c.num_warps not in _WARPS or not (_pow2(c.block) and _pow2(c.rows)):
        return False
    if not _code_ok(c, region):
        return False
    if region.scans and c.variant not in ("rows", "looped"):
        return False
    if (region.arg_reduces or region.int_reduces) and c.splits != 1:
        return False
    if not (_pow2(c.rblock) and c.splits >= 1) or (c.variant != "tiles" and c.rblock != 1) or \
            (c.variant not in ("split", "tiles") and c.splits != 1):
        return False
    if c.variant == "tiles":
        if not region.reduces:
            return c.rows == 1 and c.splits == 1 and _pointwise_tiles_ok(c, region)
        return c.contig in s.row_dims and c.rows == 1 and _tiles_ok(c, region) and \
            (c.splits == 1 or (c.rblock < triton.next_power_of_2(s.cols) and splits_ok(c, region)))
    if c.contig != contig_dim(region):
        return False
    if not region.reduces:
        return c.variant == "pointwise" and c.rows == 1 and c.block <= 16384 and \
            c.block // (32 * c.num_warps) <= _MAX_PER_THREAD
    if c.variant == "pointwise" or c.rows > triton.next_power_of_2(max(s.rows, 1)):
        return False
    width = triton.next_power_of_2(max(s.cols, 1))
    if c.variant == "rows":
        return c.block == width and _tile_ok(c.rows * c.block, c.num_warps)
    if c.variant == "split":
        return c.block < width and splits_ok(c, region) and _tile_ok(c.rows * c.block, c.num_warps)
    return c.block < width and _tile_ok(c.rows * c.block, c.num_warps)


def _tiles_ok(c: Schedule, region: Lowered) -> bool:
    s = region.space
    return c.block <= triton.next_power_of_2(max(s.rows, 1)) and \
        c.rblock <= triton.next_power_of_2(max(s.cols, 1)) and _tile_ok(c.block * c.rblock, c.num_warps)


def tile_axes(schedule: Schedule, region: Lowered) -> tuple[int, tuple[int, ...]]:
    """A pointwise `tiles` schedule's fast loop dim and its slow loop dims: `block` elements along
    `contig`, the fast axis, x `rblock` along the other dim of layout.transpose_dims, walked with the
    dims before it over which the outputs are one linear range (layout.store_run: H and W of an
    NCHW output) as one flat dim."""
    pair = layout.transpose_dims(region)
    assert pair is not None and schedule.contig in pair
    slow = pair[1] if schedule.contig == pair[0] else pair[0]
    return schedule.contig, layout.store_run(region, slow, schedule.contig) if slow == pair[0] else (slow,)


def tile_extent(region: Lowered, dims: tuple[int, ...]) -> int:
    return math.prod(region.space.shape[d] for d in dims)


def _pointwise_tiles_ok(c: Schedule, region: Lowered) -> bool:
    pair = layout.transpose_dims(region)
    if pair is None or c.contig not in pair:
        return False
    fast, slow = tile_axes(c, region)
    S = region.space.shape
    return c.block <= triton.next_power_of_2(S[fast]) and \
        c.rblock <= triton.next_power_of_2(tile_extent(region, slow)) and _tile_ok(c.block * c.rblock, c.num_warps)


def _warps_for(elems: int, per_thread: int) -> int:
    return max(1, min(32, triton.next_power_of_2(elems // (32 * per_thread) + 1) // 2))


def tile_dims(region: Lowered) -> list[int]:
    """Kept dims a `tiles` schedule walks fastest in the space: the one the inputs are contiguous
    along, when it is kept (when a reduced dim is, the row schedules read coalesced already)."""
    s = region.space
    inner = layout.inner_dim(region) if region.reduces and not region.scans else None
    return [inner] if inner is not None and inner in s.row_dims else []


def space(region: Lowered) -> list[Schedule]:
    s, cd = region.space, contig_dim(region)
    out: list[Schedule] = []
    if not region.reduces:
        n = triton.next_power_of_2(max(s.numel, 1))
        for block in (128, 256, 512, 1024, 2048, 4096, 8192):
            if block > max(n, 128):
                break
            out += [Schedule("pointwise", block, 1, w, cd) for w in (1, 2, 4, 8) if 1 <= block // (32 * w) <= 16]
        pair = layout.transpose_dims(region)
        for fast, _ in (pair, pair[::-1]) if pair else ():
            _, slow = tile_axes(Schedule("tiles", 1, 1, 1, fast, 1), region)
            cap_a, cap_b = triton.next_power_of_2(s.shape[fast]), triton.next_power_of_2(tile_extent(region, slow))
            for block in dict.fromkeys(min(b, cap_a) for b in (16, 32, 64, 128)):
                for rblock in dict.fromkeys(min(b, cap_b) for b in (16, 32, 64, 128)):
                    out += [Schedule("tiles", block, 1, w, fast, rblock) for w in (1, 2, 4, 8)
                            if 1 <= block * rblock // (32 * w) <= 32]
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
        out += _tiles_space(region) + _split_space(region)
        if online.pairs(region) or online.var_pairs(region):  # each chunked schedule also with its pairs in one pass
            out += [dataclasses.replace(c, online=1) for c in out if c.variant in ("looped", "tiles", "split")] + \
                [dataclasses.replace(c, online=2) for c in out if c.variant in ("looped", "split")]
    seen: set[Schedule] = set()
    return [c for c in out if is_valid(c, region) and not (c in seen or seen.add(c))]  # type: ignore[func-returns-value]


def _tiles_space(region: Lowered) -> list[Schedule]:
    s = region.space
    rows_p2, width = triton.next_power_of_2(max(s.rows, 1)), triton.next_power_of_2(max(s.cols, 1))
    out = []
    for cd in tile_dims(region):
        for block in dict.fromkeys(min(b, rows_p2) for b in (16, 32, 64, 128, 256)):
            for rblock in dict.fromkeys(min(rb, width) for rb in (8, 16, 32, 64, 128, width)):
                out += [Schedule("tiles", block, 1, w, cd, rblock) for w in (1, 2, 4, 8)
                        if 2 <= block * rblock // (32 * w) <= 32]
                # split tiles while the tiles alone leave SMs idle and the reductions are long
                if triton.cdiv(s.rows, block) < 2 * SMS and s.cols >= _SPLIT_TILES_COLS:
                    out += [Schedule("tiles", block, 1, w, cd, rblock, splits) for w in (4, 8)
                            for splits in (2, 8, 32, 128) if 2 <= block * rblock // (32 * w) <= 32]
    return out


def _split_space(region: Lowered) -> list[Schedule]:
    """Split schedules while the rows alone leave SMs idle (past that a split mostly adds launches),
    up to 128 programs a row and, for rows long enough that each split keeps `_SPLIT_MIN_COLS`
    columns, up to 2 x `_FILL_SPLIT` programs an SM in all, or as many as give each program
    `_SPLIT_VALUES` values (up to `_MAX_SPLITS`); and, in 2 or 4, for rows of
    `_SPLIT_LONG_COLS` or more however many (a GroupNorm of 1024 groups of 258K values: each
    program streams a row alone, twice; the tuner weighs the extra launch)."""
    s, cd = region.space, contig_dim(region)
    many = s.rows >= 2 * SMS
    if many and s.cols < _SPLIT_LONG_COLS:
        return []
    out = []
    more = [k for k in (256, 512, 1024, 2048, 4096, 8192) if s.cols // k >= _SPLIT_MIN_COLS
            and (s.rows * k <= 2 * _FILL_SPLIT * SMS or s.cols // k >= _SPLIT_VALUES)]
    for block in (256, 512, 1024, 2048, 4096):
        for r in (1, 2):
            for splits in (2, 4) if many else (2, 4, 8, 16, 32, 64, _FEW_SPLITS, *more):
                out += [Schedule("split", block, r, w, cd, 1, splits) for w in (2, 4, 8)
                        if 2 <= r * block // (32 * w) <= 32]
    return out


def _fewest_valid_splits(c: Schedule, region: Lowered, otherwise: Schedule) -> Schedule:
    """c with its splits (at most _MAX_SPLITS) halved until every split has columns; `otherwise` if none do."""
    c = dataclasses.replace(c, splits=min(c.splits, _MAX_SPLITS))
    while c.splits > 2 and not is_valid(c, region):
        c = dataclasses.replace(c, splits=c.splits // 2)
    return c if is_valid(c, region) else otherwise


def _fit(c: Schedule, region: Lowered) -> Schedule:
    """`c` made valid: more warps, then a smaller tile (fewer rows; a row too wide for the code cap
    chunked instead; the wider side of a 2-D tile halved), as far as that goes."""
    while not is_valid(c, region) and c.num_warps < 32:
        c = dataclasses.replace(c, num_warps=c.num_warps * 2)
    for _ in range(32):
        if is_valid(c, region):
            break
        if c.variant == "rows":
            c = dataclasses.replace(c, rows=c.rows // 2) if c.rows > 1 else \
                Schedule("looped", max(16, min(2048, c.block // 2)), 1, c.num_warps, c.contig)
        elif c.variant == "tiles" and c.rblock > 1 and (c.rblock >= c.block or c.block <= 16):
            c = dataclasses.replace(c, rblock=c.rblock // 2)
        elif c.variant == "tiles" and c.block > 1:
            c = dataclasses.replace(c, block=c.block // 2)
        elif c.block > 16:
            c = dataclasses.replace(c, block=c.block // 2)
        elif c.rows > 1:
            c = dataclasses.replace(c, rows=c.rows // 2)
        else:
            break
    return c


def heuristic(region: Lowered) -> Schedule:
    """Untuned default. Pointwise: 1024-wide tiles, 4 warps (smaller regions: one tile); one that
    transposes: 64 x 64 `tiles` read along the input's contiguous dim. Reductions over dims that
    are not the inputs' innermost: `tiles` along the innermost kept dim (128 rows x 32 reduced on
    a GPU, a reduced extent up to 128 whole with fewer rows, at least 32; off it, tiles of up to 16K
    elements since the interpreter pays per program), split
    like `split` when the tiles are fewer than two per SM and the reduced extent is past 8K. Few
    long rows (fewer rows than two per SM, reduced extent past 8K): `split` into enough programs
    for about two per SM (about eight for rows of 16M or more: not yet measured on a GPU),
    2048-wide chunks. Otherwise the whole reduced extent in registers up to 8K wide (several short
    rows per program so a tile holds ~4K elements; off the GPU as many rows as fit 16K), else
    2048-wide chunks; a region with a scan always so."""
    s, cd = region.space, contig_dim(region)
    gpu = region.ir.device == "cuda"
    if not region.reduces:
        pair = layout.transpose_dims(region)
        if pair is not None:  # read along the input's contiguous dim, 64 x 64 tiles (off the GPU: up to 128 x 128)
            side = 64 if gpu else 128
            _, slow = tile_axes(Schedule("tiles", 1, 1, 1, pair[1], 1), region)
            block = min(side, triton.next_power_of_2(s.shape[pair[1]]))
            rblock = min(side, triton.next_power_of_2(tile_extent(region, slow)))
            c = Schedule("tiles", block, 1, _warps_for(block * rblock, 16), pair[1], rblock)
            if is_valid(c, region):
                return c
        n = triton.next_power_of_2(max(s.numel, 1))
        block = min(1024 if gpu else 8192, max(n, 128))
        return _fit(Schedule("pointwise", block, 1, _warps_for(block, 8) if gpu else 4, cd), region)
    width = triton.next_power_of_2(max(s.cols, 1))
    rows_max = triton.next_power_of_2(max(s.rows, 1))
    inner = None if region.scans else layout.inner_dim(region)
    if inner is not None and inner in s.row_dims:
        block = min(rows_max, 128 if gpu else 256)
        rblock = min(width, (4096 if gpu else _MAX_TILE) // block)
        if gpu and rblock < width <= _WHOLE_TILE_COLS:  # short rows whole: one pass over memory, not two
            rblock, block = width, min(rows_max, max(32, 4096 // width))
        c = Schedule("tiles", block, 1, _warps_for(block * rblock, 16), inner, rblock)
        programs = triton.cdiv(s.rows, block)
        if width > 8192 and programs < 2 * SMS:  # few tiles, long reductions: split them too
            rblock = min(rblock, 32)
            c = _fewest_valid_splits(Schedule("tiles", block, 1, c.num_warps, inner, rblock,
                                              triton.next_power_of_2(triton.cdiv(2 * SMS, programs))), region, c)
    elif width > 8192 and s.rows < 2 * SMS and not region.scans:
        splits = triton.next_power_of_2(triton.cdiv(2 * SMS, max(s.rows, 1)))
        if s.cols >= _HUGE_COLS:  # about _FILL_SPLIT programs an SM (a power of two, not above)
            splits = max(splits, triton.next_power_of_2(triton.cdiv(_FILL_SPLIT * SMS, max(s.rows, 1))) // 2)
            if _row_values_only(region):  # or more: programs of _SPLIT_VALUES values
                splits = max(splits, triton.next_power_of_2(s.cols // _SPLIT_VALUES))
        c = _fewest_valid_splits(Schedule("split", 2048, 1, 8, cd, 1, splits), region,
                                 Schedule("looped", 2048, 1, 8, cd))
    elif width <= 8192:
        r = max(1, min(rows_max, (4096 if gpu else _MAX_TILE) // width))
        c = Schedule("rows", width, r, _warps_for(r * width, 16), cd)
    else:
        c = Schedule("looped", 2048, 1, 8, cd)
    c = _fit(c, region)
    if online_ok(dataclasses.replace(c, online=1), region) and is_valid(dataclasses.replace(c, online=1), region):
        c = dataclasses.replace(c, online=1)  # a chunked softmax's max and sum of exp, a mean and variance: one pass
    return c
