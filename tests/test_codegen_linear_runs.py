"""codegen/triton_gen.py's linear runs: where a tensor's memory is one linear range over a run of
its dims and the loop's index along the run was cut from one linear index, a load or store
addresses it as that index times the run's last stride (Triton sees the contiguity), and a kernel
is built per runs of the tensors it is given, so other strides of the same shapes still compute
the region's values (checked against the fp64 reference)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from codegen_helpers import trace
from conftest import DEVICE

from solforge.codegen import reference as REF
from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen import triton_gen as TG
from solforge.numerics import compare
from solforge.plan.generated import _group_norm


@pytest.mark.parametrize(("shape", "stride", "want"), [
    ((2, 3, 4, 5), (60, 20, 5, 1), ((0, 1, 2, 3),)),  # contiguous: one run
    ((2, 3, 4, 5), (60, 1, 15, 3), ((2, 3),)),  # channels-last: H, W
    ((2, 3, 4, 5), (120, 40, 10, 2), ((0, 1, 2, 3),)),  # every other element: one run of stride 2
    ((2, 3, 4, 5), (60, 20, 5, 2), ((0, 1, 2),)),  # the last dim strided: it is no neighbour's
    ((2, 1, 4, 5), (20, 99, 5, 1), ((0, 2, 3),)),  # a size-1 dim's stride does not matter
    ((2, 3, 4), (0, 4, 1), ((1, 2),)),  # an expanded dim is not part of the run after it
    ((7,), (1,), ()),  # one dim: no run
])
def test_linear_runs(shape: tuple[int, ...], stride: tuple[int, ...], want: tuple[tuple[int, ...], ...]) -> None:
    assert TG.linear_runs(shape, stride) == want


def _gn(n: int, c: int, hw: tuple[int, ...], groups: int) -> tuple[RG.Formed, list[torch.Tensor]]:
    """A GroupNorm region (ReLU, then the statistics per (N, G) and the affine per channel) over
    (n, c, *hw), as plan/generated.py writes native_group_norm."""
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _group_norm(torch.relu(x), w, b, n, c, math.prod(hw), groups, 1e-5)[0]

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=g, device="cpu").to(DEVICE) for s in ((n, c, *hw), (c,), (c,))]
    (fr,) = RG.form_regions(trace(f, *xs).graph)
    return fr, xs


def _check(fr: RG.Formed, sched: SC.Schedule, xs: list[torch.Tensor]) -> None:
    ref = REF.reference(fr.lowered.ir, [x.contiguous() for x in xs])
    for got, want in zip(RT.run(fr.lowered, sched, xs), ref, strict=True):
        c = compare(got, want)
        assert c.ok, c.reason


def test_a_contiguous_input_is_addressed_by_the_loops_linear_index() -> None:
    """(N, C, D, H, W) contiguous, GroupNorm over (N, G): the loads and the store read the input at
    the loop's (group, reduced) linear index times the last stride, with no digit of C, D, H, W."""
    fr, xs = _gn(2, 6, (3, 5, 7), 3)
    low = fr.lowered
    for sched in (SC.Schedule("looped", 64, 1, 2, SC.contig_dim(low)), SC.heuristic(low)):
        src = TG.generate(low, sched)
        loads = re.findall(r"tl\.load\(in0 \+ ([^,)]*)", src)
        stores = re.findall(r"tl\.store\(out0 \+ ([^,]*),", src)
        assert loads and stores
        for off in loads + stores:
            assert re.fullmatch(r"\w+ \* s_(in|out)0_0 \+ \w+ \* s_(in|out)0_4", off), off
        _check(fr, sched, xs)


@pytest.mark.parametrize("view", ["sliced", "channels_last_3d", "every_other"])
def test_other_strides_of_the_same_shapes_get_a_kernel_of_their_own(view: str) -> None:
    """A region recorded contiguous, run on an input of the same shape laid out otherwise: the
    launcher builds the kernel for the runs of the tensors it is given (every other element: the
    same runs, the recorded kernel, its last stride 2), and the values are the reference's (odd sizes)."""
    fr, xs = _gn(2, 6, (3, 5, 7), 3)
    x = xs[0]
    if view == "sliced":  # a slice along W: D, H, W are no linear range
        x = torch.randn(2, 6, 3, 5, 9, device=DEVICE)[..., 1:8]
    elif view == "channels_last_3d":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    else:
        x = torch.randn(2, 6, 3, 5, 14, device=DEVICE)[..., ::2]
    same = TG.linear_runs(x.shape, x.stride()) == TG.linear_runs(x.shape, xs[0].stride())
    assert x.shape == xs[0].shape and same == (view == "every_other")
    low = fr.lowered
    for sched in (SC.Schedule("looped", 64, 1, 2, SC.contig_dim(low)), SC.Schedule("split", 64, 1, 2,
                                                                                  SC.contig_dim(low), 1, 4)):
        assert SC.is_valid(sched, low)
        _check(fr, sched, [x, *xs[1:]])
        _check(fr, sched, xs)


def test_a_reshape_back_to_the_inputs_shape_reads_the_same_linear_index() -> None:
    """The normalize pass views the loop point back as (N, C, D, H, W) and the statistics' loop as
    (N, G, C/G * DHW): the index is the loop's linear one again, not its digits recomposed."""
    fr, _ = _gn(2, 6, (3, 5, 7), 3)
    low = fr.lowered
    src = TG.generate(low, SC.Schedule("split", 64, 1, 2, SC.contig_dim(low), 1, 4))
    assert not re.search(r"= \w+ \* 105 \+ \w+ \* 35 \+ \w+ \* 7 \+ \w+", src), src
