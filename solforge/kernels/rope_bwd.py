"""rope_bwd: the backward of the rope family (kernels/rope.py `rope_bwd`) as a tunable family.

The pattern (swiglu_bwd.py and gelu_bwd.py follow it; wire another family the same way):

  kernels/<family>_bwd.py, an ordinary family module (the interface of solforge/tune/__init__.py
  and tune/verify.py): FAMILY = "<family>_bwd"; Config (the forward's class will do: the op
  decodes the BWD string with it); space(wl), is_valid(c, wl), heuristic(wl) (exactly what the
  backward op runs with config ""); make_inputs(wl, *, seed, rows=None, device=None) -> (args,
  kwargs) with random incoming gradients laid out as the model hands them over; the launcher
  `<family>_bwd(*args, config=, out=, **kwargs)` returning a tuple of tensors and writing into
  `out` when given; `<family>_bwd_ref` (fp32/fp64, e.g. autograd through the forward's reference)
  returning the same tuple, no None items. Optional: output_tolerance(wl) (one per output; a
  reduction such as a weight gradient needs a wider atol), verify_rows(wl) (which size the odd
  shape replaces), baseline_leaves(wl) (which of the region's tensor inputs eager's backward is
  timed for; default every floating-point one). Import the forward module, so the database's
  template hash covers its kernel source.
  kernels/<family>.py: backward_workload(wl) -> Workload | None (family "<family>_bwd" and
  everything the backward kernel depends on); the op impl decodes config.partition("|")[0];
  setup_context keeps config.partition("|")[2]; the backward passes it to the <family>_bwd op.
  Nothing else: plan.backward_groups, api.optimize (train mode) and integrate.Integrator(train=
  True) find families by `backward_workload`.

The kernel, its config, space and heuristic live in kernels/rope.py (its template hash covers
that file: importing it makes it part of this family's source). Here: the fp32 reference (autograd
through `rope_ref`), random inputs with the incoming gradients laid out as the model hands them
over, and the launcher with `out=`.

Gradients: dq, dk (B, S, H, D) like q and k, and with norm weights dq_weight, dk_weight (D,).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from solforge.kernels import rope as _rope
from solforge.numerics import Tolerance, input_generator, parse_dtype, tolerance
from solforge.records import Workload

FAMILY = "rope_bwd"

# the forward's Config: the BWD part of the op's string is decoded by rope.py's backward op
Config = _rope.Config
is_valid = _rope.is_valid
verify_rows = _rope.verify_rows  # the odd shape replaces the sequence length S


def space(workload: Workload) -> list[Config]:
    """The forward's tiles x programs per SM of the weight-gradient loop (rope.bwd_space)."""
    return _rope.bwd_space(workload)


def heuristic(workload: Workload) -> Config:
    """What the op runs with config "" (rope.bwd_heuristic, swept on the H100)."""
    return _rope.bwd_heuristic(workload)


def baseline_leaves(workload: Workload) -> tuple[int, ...]:
    """The region's tensor inputs (q, k, cos, sin[, q_weight, k_weight]) whose gradients the kernel
    computes: eager's backward, the baseline, is timed for the same ones (not cos/sin, which HF
    builds under no_grad)."""
    return (0, 1, 4, 5) if len(workload.shapes) > 4 else (0, 1)


def rope_bwd_ref(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, *, norm: bool = False, round_before_weight: bool = False,
                 heads_first: bool = True) -> tuple[torch.Tensor, ...]:
    """(dq, dk[, dq_weight, dk_weight]) by autograd through `rope_ref` (fp32 inside, fp64 for fp32
    inputs), contiguous, in the inputs' dtypes. cos/sin get no gradient (HF builds them under
    no_grad; the kernel computes none)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, q_weight, k_weight) if t is not None]
    ws = leaves[2:] if q_weight is not None else [None, None]
    with torch.enable_grad():
        out = _rope.rope_ref(leaves[0], leaves[1], cos, sin, ws[0], ws[1], eps, norm=norm,
                             round_before_weight=round_before_weight, heads_first=heads_first,
                             out_dtype=grad_q.dtype)
        grads = torch.autograd.grad(out, leaves, (grad_q, grad_k))
    return tuple(g.contiguous() for g in grads)


def rope_bwd(grad_q: torch.Tensor, grad_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
             eps: float = 1e-6, *, norm: bool = False, round_before_weight: bool = False, heads_first: bool = True,
             config: Config | None = None, out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The launcher: rope.rope_bwd's gradients as `rope_bwd_ref` returns them (no None items)."""
    dq, dk, dqw, dkw = _rope.rope_bwd(grad_q, grad_k, q, k, cos, sin, q_weight, k_weight, eps, norm=norm,
                                      round_before_weight=round_before_weight, heads_first=heads_first,
                                      config=config, out=out)
    return (dq, dk) if dqw is None else (dq, dk, dqw, dkw)


def output_tolerance(workload: Workload) -> tuple[Tolerance, ...]:
    """dq, dk: their dtype's entry (rope.output_tolerance's rounding case does not apply: the
    gradient through a rounding is the identity in both). A weight gradient sums B*S*H products
    whose factors agree to the dtype's tolerance; those errors have random signs, so the sum's
    absolute error grows like sqrt(terms): atol scaled by it (the kernel's fp32 partial sums in
    another order add ~1e-7 x sqrt(terms) relative, far less)."""
    dx = tolerance(parse_dtype(workload.dtypes[0]))
    if len(workload.shapes) <= 4:
        return (dx, dx)
    (B, S, Hq, _), (_, _, Hk, _) = workload.shapes[0], workload.shapes[1]
    out = []
    for H, name in ((Hq, workload.dtypes[4]), (Hk, workload.dtypes[5])):
        t = tolerance(parse_dtype(name))
        out.append(Tolerance(t.atol * math.sqrt(B * S * H), t.rtol))
    return (dx, dx, *out)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `rope_bwd` / `rope_bwd_ref`: rope's inputs (make_inputs of
    the forward workload; `rows` replaces S) after random incoming gradients of the outputs' dtype
    and layout: with heads_first, (B, H, S, D) views of (B, S, H, D)-contiguous memory, the
    forward's output strides, which is what SDPA's backward hands over (as bench/rope_bwd_sweep.py
    measures it); else (B, S, H, D) contiguous."""
    fwd = dataclasses.replace(workload, family=_rope.FAMILY)
    (q, k, cos, sin, qw, kw, eps), opts = _rope.make_inputs(fwd, seed=seed, rows=rows, device=device)
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    out_dtype, heads_first = opts.pop("out_dtype"), opts["heads_first"]
    g, where = input_generator(q.numel(), q.device, seed + 1)
    grads = []
    for H in (Hq, Hk):
        t = _rope._new_out(B, S, H, D, out_dtype, q.device, heads_first)
        t.copy_(torch.randn(t.shape, generator=g, device=where).to(out_dtype))
        grads.append(t)
    return (grads[0], grads[1], q, k, cos, sin, qw, kw, eps), opts
