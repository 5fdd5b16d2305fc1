"""A division whose quotient is truncated or compared is IEEE-rounded in the generated kernel.

Triton's fp32 `/` is the GPU's approximate division (div.full.f32): T5's relative position buckets
(a region with no inputs: arange, abs, log, div, a cast to int64, minimum, where) hold quotients that
are exactly whole (log(16 / 8) / log(16) * 8 = 2), which that division may leave just below 2, so
the int64 bucket came out one less than torch's and the fp64 reference's at those distances, and
the region's kernel failed verification on an H200. The kernel is checked here against torch's
buckets exactly, and its source for which divisions are rounded (the interpreter divides exactly
either way, so only the source tells them apart off the GPU)."""

from __future__ import annotations

import math

import pytest
import torch
from codegen_helpers import check_region, schedules, trace, values

from solforge.codegen import regions as RG
from solforge.codegen import runtime as RT
from solforge.codegen import schedule as SC
from solforge.codegen.triton_gen import generate

pytestmark = pytest.mark.usefixtures("on_device")


def _buckets(q: int, k: int, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """Bidirectional relative position buckets of q query and k key positions, written as T5 writes them."""
    rel = torch.arange(k, dtype=torch.long)[None, :] - torch.arange(q, dtype=torch.long)[:, None]
    n = num_buckets // 2
    out = (rel > 0).to(torch.long) * n
    rel = torch.abs(rel)
    exact = n // 2
    small = rel < exact
    large = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact) * (n - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, n - 1))
    return out + torch.where(small, rel, large)


def _scores(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The buckets' lookup into a bias table, added to scores: the divisions of a softmax too."""
    b = _buckets(x.shape[-2], x.shape[-1])
    return torch.softmax(x + torch.nn.functional.embedding(b, table).permute(2, 0, 1), -1)


@pytest.mark.parametrize("q,k", [(33, 33), (1, 131)])
def test_relative_position_buckets_match_torch_exactly(q: int, k: int) -> None:
    gm = trace(lambda: _buckets(q, k))
    env = values(gm)
    (r,) = RG.form_regions(gm.graph)
    assert r.inputs == [] and r.outputs[0].meta["val"].dtype == torch.int64
    want = env[r.outputs[0]]
    if want.is_cuda:
        # torch on CUDA rounds its fp32 steps its own way (a division by a number is a product with
        # the fp32 reciprocal): at 1 x 131 one bucket differs from the fp64 reference's (H100,
        # 2026-11-27), so the kernels are held to the graph's values, element for element
        for sched in schedules(r.lowered):
            (got,) = RT.run(r.lowered, sched, [])
            assert torch.equal(got, want), sched.encode()
    else:
        assert check_region(r, env) >= 1  # every sampled schedule equal to the reference and the graph
    (got,) = RT.run(r.lowered, None, [])
    assert torch.equal(got, _buckets(q, k))  # distances 16, 32 (and 64, 128): whole quotients


def test_only_the_divisions_a_decision_reads_are_rounded() -> None:
    x = torch.randn(4, 33, 33)
    table = torch.randn(32, 4)
    gm = trace(_scores, x, table)
    regions = RG.form_regions(gm.graph)
    env = values(gm, x, table)
    for fr in regions:
        check_region(fr, env)
    src = "\n".join(generate(fr.lowered, SC.heuristic(fr.lowered)) for fr in regions)
    divs = [n for fr in regions for n in fr.lowered.graph.nodes if n.kind == "pw" and n.fn == "div"]
    rounded = [n for n in divs if n.params == ("rn",)]
    # the bucket's log quotient (before its cast to int64) and the float cast's division by 8;
    # the softmax's normalization stays the fast division. On CUDA both bucket divisions are by
    # numbers: products with the fp32 reciprocal, as torch computes them there (the next test)
    want = (0, 1) if x.is_cuda else (2, 3)
    assert (len(rounded), len(divs)) == want, [(n.fn, n.params) for n in divs]
    assert src.count("tl.math.div_rn(") == want[0]


def test_on_a_gpu_the_logarithm_a_decision_reads_is_libdevices() -> None:
    """The bucket's log, lowered for CUDA, is libdevice's logf (torch's own on CUDA: tl.log is the
    approximate lg2 x ln 2, an ulp off away from powers of two); the softmax's exp and its
    normalization keep the fast instructions. (Triton's interpreter has no libdevice: on the CPU
    the kernels keep tl.log, as the test above runs them.)"""
    import dataclasses

    from solforge.codegen.lower import prepare

    x = torch.randn(4, 33, 33)
    table = torch.randn(32, 4)
    gm = trace(_scores, x, table)
    regions = RG.form_regions(gm.graph)
    cpu = [prepare(dataclasses.replace(fr.lowered.ir, device="cpu")) for fr in regions]
    src = "\n".join(generate(low, SC.heuristic(low)) for low in cpu)
    assert "libdevice" not in src and src.count("tl.math.div_rn(") == 2
    gpu = [prepare(dataclasses.replace(fr.lowered.ir, device="cuda")) for fr in regions]
    src = "\n".join(generate(low, SC.heuristic(low)) for low in gpu)
    assert src.count("libdevice.log(") == 1 and "from triton.language.extra import libdevice" in src
    assert "tl.exp" in src and src.count(" / ") == 1  # the softmax's normalization: a tensor divisor
    # the bucket's divisions by numbers (8, log(16)) are products with fp32 reciprocals, torch's on
    # CUDA (1 / 8 exactly, and 1 / log(16) rounded to fp32)
    recip = float(torch.tensor(1.0) / torch.tensor(math.log(16)))
    assert "tl.math.div_rn(" not in src and repr(recip) in src and "0.125" in src, src
