"""swiglu_bwd: the backward of the swiglu family (kernels/swiglu.py `swiglu_bwd`) as a tunable
family: dgate, dup of y = act(gate) * up for the incoming gradient dy, in one launch.

A backward family is an ordinary family module (see kernels/rope_bwd.py for the pattern): its
workload is swiglu's `backward_workload`, and the forward op's autograd backward runs the
`swiglu_bwd` op with the BWD part of the op's "FWD|BWD" config string (solforge/integrate/__init__.py).

The kernel tiles (rows, N) like the forward, so it is tuned over the forward's space (as
bench/families.py `bwd_sweep` sweeps it); its untuned default is the forward's heuristic, which
is what the op runs with config "". The kernel and its config live in kernels/swiglu.py (whose
source this family's template hash covers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from solforge.kernels import swiglu as _swiglu
from solforge.numerics import input_generator, parse_dtype
from solforge.records import Workload

FAMILY = "swiglu_bwd"

# the forward's Config, space, validity and heuristic (the op's "" runs `heuristic`)
Config = _swiglu.Config
space = _swiglu.space
is_valid = _swiglu.is_valid
heuristic = _swiglu.heuristic


def swiglu_bwd_ref(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) by autograd through `swiglu_ref`'s math in fp32 (fp64 for fp32 inputs)."""
    return _swiglu.swiglu_bwd_ref(dy, gate, up, act)


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str = "silu", *,
               config: Config | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher (swiglu.swiglu_bwd): (dgate, dup), into `out` when given."""
    return _swiglu.swiglu_bwd(dy, gate, up, act, config=config, out=out)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `swiglu_bwd` / `swiglu_bwd_ref`: swiglu's (gate, up) and a
    random contiguous dy of gate's dtype, as the down projection's backward hands it over
    (grad_output @ W: a fresh (rows, N) tensor)."""
    (gate, up), kwargs = _swiglu.make_inputs(dataclasses.replace(workload, family=_swiglu.FAMILY), seed=seed,
                                             rows=rows, device=device)
    g, where = input_generator(gate.numel(), gate.device, seed + 1)
    dy = torch.randn(gate.shape, generator=g, device=where).to(parse_dtype(workload.dtypes[0])).to(gate.device)
    return (dy, gate, up), kwargs
