"""The online max / sum-of-exp schedule option (codegen/online.py, Schedule.online): softmax,
log_softmax, logsumexp, a cross-entropy-like chain and a scaled user-written softmax over rows
longer than the chunk (several chunks and a tail), odd shapes, a transposed input, -inf entries and
rows, NaN, large offsets, fp32 and bf16. Each kernel against the region's fp64 reference (non-finite
values exactly), the online source's loop count against the multi-pass one's, and validity."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import trace
from conftest import alternating

from solforge.codegen import online
from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen.lower import Lowered
from solforge.codegen.triton_gen import generate, passes
from solforge.numerics import compare

pytestmark = pytest.mark.usefixtures("on_device")

DTYPES = [torch.float32, torch.bfloat16]


def _low(fn: Callable[..., Any], *xs: torch.Tensor) -> Lowered:
    (r,) = RG.form_regions(trace(fn, *xs).graph)
    return r.lowered


def _loops(src: str) -> int:
    return len(re.findall(r"^\s*for k0 in tl\.range", src, flags=re.M))


def _check(low: Lowered, ins: list[torch.Tensor], sched: SC.Schedule) -> None:
    """sched's kernel against the reference: finite values within tolerance, the rest exactly."""
    assert SC.is_valid(sched, low), sched.encode()
    ref = REF.reference(low.ir, ins)
    got = RT.run(low, sched, ins)
    for k, (g, r) in enumerate(zip(got, ref, strict=True)):
        c = compare(g, r)
        assert c.ok, f"{sched.encode()}, output {k}: {c.reason}"
        g64, r64 = g.double(), r.double()
        assert torch.equal(g64.isnan(), r64.isnan()), f"{sched.encode()}, output {k}: NaN where the reference has none"
        inf = r64.isinf()
        assert torch.equal(g64[inf], r64[inf]) and not g64[~inf & ~r64.isnan()].isinf().any(), \
            f"{sched.encode()}, output {k}: infinities differ"


def _online_vs_multipass(low: Lowered, ins: list[torch.Tensor], looped: SC.Schedule, loops: int) -> None:
    """The online forms of `looped` (a running max per lane; looped and split: per row too) and
    the multi-pass one, all against the reference; the online source has one loop fewer per pair
    (`loops` in all: its reduction passes and the store pass)."""
    _check(low, ins, looped)
    n_multi = _loops(generate(low, looped))
    for v in (1, 2) if looped.variant in ("looped", "split") else (1,):
        on = dataclasses.replace(looped, online=v)
        _check(low, ins, on)
        n_on = _loops(generate(low, on))
        assert n_on == loops and n_multi == loops + len(online.pairs(low)), (on.encode(), n_on, n_multi)


def _rows(*shape: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def _specials(x: torch.Tensor) -> torch.Tensor:
    """-inf entries in row 0 (every 4th: lanes that stay -inf through the whole row; the first 300:
    the first chunk's lanes all -inf), a row of
    -inf (row 1, when there is one), +1e4 and -1e4 offsets on the others (no overflow allowed)."""
    x = x.clone()
    x[0, ::4] = float("-inf")
    x[0, :300] = float("-inf")
    if x.shape[0] > 1:
        x[1] = float("-inf")
    if x.shape[0] > 2:
        x[2] += 1e4
    if x.shape[0] > 3:
        x[3] -= 1e4
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_softmax_and_log_softmax(kind: str, dtype: torch.dtype) -> None:
    fn = (lambda x: torch.softmax(x, -1)) if kind == "softmax" else (lambda x: torch.log_softmax(x, -1))
    x = _specials(_rows(5, 1500, dtype=dtype))
    low = _low(fn, x)
    assert len(online.pairs(low)) == 1
    # 1500 in 256-wide chunks: 5 whole chunks and a tail; 5 rows, 1 and 2 a program (a row tail)
    _online_vs_multipass(low, [x], SC.Schedule("looped", 256, 1, 4, 1), loops=2)
    _check(low, [x], SC.Schedule("looped", 64, 2, 2, 1, online=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_logsumexp_keepdim_and_not(dtype: torch.dtype) -> None:
    x = _specials(_rows(4, 1500, dtype=dtype))
    for fn in (lambda x: torch.logsumexp(x, -1), lambda x: torch.logsumexp(x, -1, keepdim=True)):
        low = _low(fn, x)
        _online_vs_multipass(low, [x], SC.Schedule("looped", 256, 1, 4, 1), loops=1)  # one pass, no store loop
    _check(low, [x], SC.Schedule("looped", 128, 4, 4, 1, online=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_like_chain(dtype: torch.dtype) -> None:
    # per-row NLL of log_softmax through a one-hot (nll_loss's gather is not in the generator's ops)
    # and the log-probabilities stored too: max+sum in one pass, the NLL's pass, the store pass
    def f(x: torch.Tensor, onehot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(x.float(), -1)
        return -(logp * onehot).sum(-1), logp

    x = _specials(_rows(5, 1500, dtype=dtype)) if dtype == torch.float32 else _rows(5, 1500, dtype=dtype)
    target = torch.tensor([4, 1499, 700, 0, 1023])
    onehot = F.one_hot(target, 1500).float()
    low = _low(f, x, onehot)
    _online_vs_multipass(low, [x, onehot], SC.Schedule("looped", 256, 1, 4, 1), loops=3)
    ref = F.cross_entropy(x.float()[2:], target[2:], reduction="none")  # the finite rows, as torch computes them
    outs = RT.run(low, SC.Schedule("looped", 256, 2, 4, 1, online=1), [x, onehot])
    (nll,) = [o for o in outs if o.shape == (5,)]  # the region's outputs come in its own order
    assert compare(nll[2:], ref).ok


def test_odd_shapes_and_reduced_middle_dims() -> None:
    # softmax over dims 1 and 2 of (3, 37, 41): rows of 1517 with a tail, odd rows
    x = _rows(3, 37, 41, dtype=torch.float32)
    low = _low(lambda x: torch.softmax(x.reshape(3, -1), -1).reshape(3, 37, 41) * 2.0, x)
    _online_vs_multipass(low, [x], SC.Schedule("looped", 512, 2, 4, 1), loops=2)
    x = _rows(7, 3, 333, dtype=torch.bfloat16)
    low = _low(lambda x: torch.log_softmax(x, -1), x)
    _online_vs_multipass(low, [x], SC.Schedule("looped", 64, 4, 4, 2), loops=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_input(dtype: torch.dtype) -> None:
    # a (3, 1500) view of a (1500, 3) tensor: the kept dim is the contiguous one, so the chunked
    # tiles read along it; both looped rows and tiles with online pairs
    x = _specials(_rows(3, 1500, dtype=dtype).t().contiguous().t())
    assert x.stride() == (1, 3)
    low = _low(lambda x: torch.softmax(x, -1), x)
    h = SC.heuristic(low)
    _online_vs_multipass(low, [x], SC.Schedule("looped", 256, 2, 4, 1), loops=2)
    tiles = [c for c in SC.space(low) if c.variant == "tiles" and c.online]
    assert tiles and all(c.rblock < 2048 and c.splits == 1 for c in tiles)
    chosen = min(tiles, key=lambda c: (-c.rblock, -c.block))
    _online_vs_multipass(low, [x], dataclasses.replace(chosen, online=0), loops=2)
    if h.variant == "tiles" and h.rblock < 2048:
        assert h.online == 1, h


def test_scaled_user_written_softmax_and_exp2() -> None:
    # exp((x - amax) / T) / sum: B is the max unshifted, so a row of -inf is NaN (as the graph computes);
    # log2(sum(exp2((x - amax) * log2(e)))) * ln2 + amax: the exp2 form
    def soft(x: torch.Tensor) -> torch.Tensor:
        e = torch.exp((x - x.amax(-1, keepdim=True)) / 0.7)
        return e / e.sum(-1, keepdim=True)

    def lse2(x: torch.Tensor) -> torch.Tensor:
        m = x.amax(-1, keepdim=True)
        return torch.log2(torch.exp2((x - m) * 1.4426950408889634).sum(-1, keepdim=True)) * 0.6931471805599453 + m

    x = _specials(_rows(5, 1500, dtype=torch.float32))
    for fn, loops in ((soft, 2), (lse2, 1)):
        low = _low(fn, x)
        ps = online.pairs(low)
        assert len(ps) == 1 and ps[0].scale != 1.0
        _online_vs_multipass(low, [x], SC.Schedule("looped", 256, 1, 4, 1), loops=loops)
        (y,) = RT.run(low, SC.Schedule("looped", 64, 2, 4, 1, online=1), [x])
        assert y[1].isnan().all()  # the row of -inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_rows_and_split_tiles(dtype: torch.dtype) -> None:
    # 1500 over 4 programs of 384 (3 chunks of 128 each, the last program's share with a tail);
    # row 0's first share all -inf (a program whose partial max is -inf), row 1 all -inf
    x = _specials(_rows(5, 1500, dtype=dtype))
    x[0, :384] = float("-inf")

    def split_rows(fn: Callable[[torch.Tensor], torch.Tensor], loops: int) -> None:
        low = _low(fn, x)
        sched = SC.Schedule("split", 128, 2, 4, 1, 1, 4)
        _online_vs_multipass(low, [x], sched, loops=loops)
        assert len(passes(low, dataclasses.replace(sched, online=1))) == len(passes(low, sched)) - 1  # one launch fewer

    # a user-written softmax (the max unshifted: a share of -inf must not make its partial NaN)
    def soft(x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    def user_softmax() -> None:
        _online_vs_multipass(_low(soft, x), [x], SC.Schedule("split", 128, 1, 4, 1, 1, 4), loops=2)

    # split tiles of a transposed input: 4 rows x 32 of the row a tile, the row over 4 programs
    def split_tiles() -> None:
        xt = x.t().contiguous().t()
        low = _low(lambda x: torch.log_softmax(x, -1), xt)
        _online_vs_multipass(low, [xt], SC.Schedule("tiles", 4, 1, 4, 0, 32, 4), loops=2)

    cases = [lambda: split_rows(lambda x: torch.softmax(x, -1), 2),
             lambda: split_rows(lambda x: torch.logsumexp(x, -1), 1), user_softmax, split_tiles]
    # every case at both dtypes on a GPU; through the interpreter each case at one of them, in turn
    for case in alternating(cases, DTYPES.index(dtype), keep=0):
        case()


def test_nan_rows() -> None:
    x = _rows(3, 1500, dtype=torch.float32)
    x[0, 777] = float("nan")
    x[2, 5] = float("nan")
    x[2, 6:] = float("-inf")  # a NaN among -inf entries: the row is NaN, not 0
    for fn in (lambda x: torch.softmax(x, -1), lambda x: torch.logsumexp(x, -1)):
        low = _low(fn, x)
        _check(low, [x], SC.Schedule("looped", 256, 1, 4, 1, online=1))
        _check(low, [x], SC.Schedule("looped", 128, 2, 4, 1, online=1))
        _check(low, [x], SC.Schedule("looped", 128, 2, 4, 1, online=2))


def _ln(x: torch.Tensor) -> torch.Tensor:
    m = x.mean(-1, keepdim=True)
    return (x - m) * torch.rsqrt(((x - m) ** 2).mean(-1, keepdim=True) + 1e-5)


def test_validity_space_and_heuristic() -> None:
    # many long rows: the heuristic chunks them, the pair in one pass (only computed here, not run)
    big = _low(lambda x: torch.log_softmax(x, -1), _rows(300, 9000, dtype=torch.float32))
    h = SC.heuristic(big)
    assert h.variant == "looped" and h.online == 1, h
    assert h.encode().endswith(":o=1") and SC.Schedule.decode(h.encode()) == h
    assert SC.Schedule("looped", 2048, 1, 8, 1).encode() == "looped:b=2048:w=8:c=1"  # old strings unchanged
    sp = SC.space(big)
    assert any(c.online for c in sp) and any(c.variant == "looped" and not c.online for c in sp)
    assert all(c.variant in ("looped", "tiles", "split") for c in sp if c.online)
    assert {c.online for c in sp if c.variant == "looped"} == {0, 1, 2}
    assert all(c.variant in ("looped", "split") for c in sp if c.online == 2)
    # few long rows: split, the pair in one phase; whole rows do not take it
    few = _low(lambda x: torch.log_softmax(x, -1), _rows(2, 9000, dtype=torch.float32))
    h = SC.heuristic(few)
    assert h.variant == "split" and h.online == 1, h
    assert SC.is_valid(dataclasses.replace(h, online=0), few)
    short = _low(lambda x: torch.softmax(x, -1), _rows(4, 100, dtype=torch.float32))
    assert SC.is_valid(SC.Schedule("rows", 128, 1, 4, 1), short)
    assert not SC.is_valid(SC.Schedule("rows", 128, 1, 4, 1, online=1), short)
    # regions without the pattern: a LayerNorm (mean, var), a sum of exp without a max, a max alone,
    # exp of x minus twice the max (not the max's shift)
    for fn in (_ln, lambda x: torch.exp(x).sum(-1), lambda x: x - x.amax(-1, keepdim=True),
               lambda x: torch.exp(x - x.amax(-1, keepdim=True) * 2.0).sum(-1)):
        other = _low(fn, _rows(3, 1500, dtype=torch.float32))
        assert not online.pairs(other)
        looped = SC.Schedule("looped", 256, 1, 4, 1)
        assert SC.is_valid(looped, other) and not SC.is_valid(dataclasses.replace(looped, online=1), other)
        assert not any(c.online for c in SC.space(other)) and SC.heuristic(other).online == 0
