"""cross_entropy_bwd: the backward of the cross_entropy family (kernels/cross_entropy.py
`cross_entropy_bwd`) as a tunable family: dlogits = (softmax(x) - onehot(t)) * scale from the
forward's saved per-row logsumexp, scale = dloss / #valid (mean), dloss (sum) or dloss_r (none),
0 on ignored rows; one more read of the logits and one write.

A backward family is an ordinary family module (see kernels/rope_bwd.py for the pattern): its
workload is cross_entropy's `backward_workload` (the forward's, renamed), and the forward op's
autograd backward runs the `cross_entropy_bwd` op with the BWD part of the op's "FWD|BWD" config
string (solforge/integrate/__init__.py). The kernel and its Config live in kernels/cross_entropy.py (whose
source this family's template hash covers). The backward streams BLOCK-wide chunks of a row like
the forward, so it is tuned over the forward's space; its untuned default is the forward's
heuristic, which is what the op runs with config "".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from solforge.kernels import cross_entropy as _ce
from solforge.numerics import Tolerance, input_generator, parse_dtype, tolerance
from solforge.records import Workload

FAMILY = "cross_entropy_bwd"

# the forward's Config, space, validity and heuristic (the op's "" runs `heuristic`: its launch
# plan is the forward's, which depends on V alone)
Config = _ce.Config
space = _ce.space
is_valid = _ce.is_valid
heuristic = _ce.heuristic


def cross_entropy_bwd_ref(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, *,
                          ignore_index: int = -100, reduction: str = "mean") -> tuple[torch.Tensor]:
    """(dlogits,) in the logits' dtype: autograd through `cross_entropy_ref` in fp32 (fp64 for fp32
    logits). `lse` (the kernel's saved input) is not used: the reference derives everything from
    the logits."""
    dx = _ce.cross_entropy_bwd_ref(dloss, logits, target, ignore_index=ignore_index, reduction=reduction)
    return (dx.to(logits.dtype).reshape(logits.shape).contiguous(),)


def cross_entropy_bwd(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, *,
                      ignore_index: int = -100, reduction: str = "mean", config: Config | None = None,
                      out: tuple[torch.Tensor] | None = None) -> tuple[torch.Tensor]:
    """The launcher (cross_entropy.cross_entropy_bwd, dlogits in the logits' dtype as the op runs
    it): (dlogits,), into out[0] when given."""
    return (_ce.cross_entropy_bwd(dloss, logits, target, lse, ignore_index=ignore_index, reduction=reduction,
                                  config=config, out=None if out is None else out[0]),)


def output_tolerance(workload: Workload) -> Tolerance:
    """The logits dtype's entry, its atol divided by the rows for the mean: that gradient carries a
    factor 1 / #valid rows (~0.8 rows in make_inputs), and an atol sized for values ~1 would accept
    any gradient of a few hundred rows (linear_cross_entropy.output_tolerance does the same)."""
    t = tolerance(parse_dtype(workload.dtypes[0]))
    if workload.param("reduction", "mean") == "mean":
        return Tolerance(t.atol / max(1, workload.shapes[0][0]), t.rtol)
    return t


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `cross_entropy_bwd` / `cross_entropy_bwd_ref`: the forward's
    (logits, target) (cross_entropy.make_inputs: offset rows, ~1 target in 5 ignored), their fp32
    logsumexp as the forward saves it (computed in fp64, rounded once), and the incoming gradient of
    the loss as autograd hands it over, in the loss's dtype (out_dtype): one value for mean and sum
    (0.5..1.5: a loss scale, or 1 / gradient-accumulation steps), one a row for 'none' (random signs
    too, so a kernel that mixes up rows fails)."""
    fwd = dataclasses.replace(workload, family=_ce.FAMILY)
    (x, t), kw = _ce.make_inputs(fwd, seed=seed, rows=rows, device=device)
    lse = torch.logsumexp(x.to(torch.float64), dim=-1).to(torch.float32)
    n = x.shape[0]
    g, where = input_generator(n, x.device, seed + 1)
    reduction, out_dtype = kw["reduction"], kw["out_dtype"]
    if reduction == "none":
        sign = torch.where(torch.rand(n, generator=g, device=where) < 0.5, -1.0, 1.0)
        dloss = sign * (0.5 + torch.rand(n, generator=g, device=where))
    else:
        dloss = 0.5 + torch.rand((), generator=g, device=where)
    return (dloss.to(out_dtype).to(x.device), x, t, lse), {"ignore_index": kw["ignore_index"],
                                                          "reduction": reduction}
