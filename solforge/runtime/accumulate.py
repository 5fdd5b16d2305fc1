"""Whether a weight's gradient may be added to its `.grad` in place, inside the backward.

The training passes (integrate/linears.py: the GEMMs; integrate/embeddings.py: the rows of the
tokens present) and the training replays (runtime/traingraphs.py) add a new gradient into `.grad`
themselves where nothing could tell the difference from autograd's AccumulateGrad: see
`accumulates_in_place`. SOLFORGE_GRAD_IN_PLACE=0 turns it off (the gradient always goes back to
autograd; solforge/settings.py).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from solforge import settings

IN_PLACE = True  # settings.grad_in_place, kept here: read inside every backward


def _follow(s: settings.Settings) -> None:
    global IN_PLACE
    IN_PLACE = s.grad_in_place


settings.follow(_follow, "grad_in_place")


def accumulates_in_place(w: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `w.grad += dW` may be done here, with dW of `dtype`, instead of by autograd
    (module docstring). Called inside the backward."""
    if not IN_PLACE or not w.is_leaf or w._backward_hooks or torch.is_grad_enabled():
        return False
    grad = w.grad
    if grad is None or type(grad) is not torch.Tensor or grad.layout != torch.strided \
            or grad.requires_grad or grad.dtype != dtype or grad.dtype != w.dtype \
            or grad.shape != w.shape or grad.device != w.device or not grad.is_contiguous():
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    try:
        return bool(torch._C._will_engine_execute_node(get_gradient_edge(w).node))
    except RuntimeError:  # autograd.grad(): the gradient is returned to the caller, not accumulated
        return False
