"""add_layernorm family: s = x + residual; y = layernorm(s) -> (s, y) in one pass.

GPT-2-style blocks add each sublayer's output to the residual stream and normalize the sum for the
next sublayer; the sum is also the next residual. Eager runs an add (read 2, write 1) and a norm
(read 1, write 1); fused, the sum is normalized from registers: read 2, write 2, one launch.

A family of its own rather than a flag of `layernorm`, as add_rmsnorm is for rmsnorm: its op
returns two tensors, its workload has two row inputs and its reference a tuple, and the tuner,
verifier and database key everything on the family name. The kernels, config triad and backward are
layernorm's (kernels/layernorm.py, HAS_RES); this file is the family's interface to them.
"""

from __future__ import annotations

from typing import Any

import torch

from solforge.kernels import direct
from solforge.kernels import layernorm as _ln
from solforge.kernels.layernorm import (  # noqa: F401
    VARIANTS,
    Config,
    backward_workload,
    heuristic,
    is_valid,
    space,
    supported,
)
from solforge.records import Workload

FAMILY = "add_layernorm"


def add_layernorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, eps: float, *, out_dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual  # in x's dtype, as the model adds
    return s, _ln.layernorm_ref(s, weight, bias, eps, out_dtype=out_dtype)


def add_layernorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  eps: float, *, out_dtype: torch.dtype | None = None, config: Config | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, layernorm(x + residual)) with one kernel; `out` = (s, y) to write in place."""
    s, y = _ln.launch(x, residual, weight, bias, eps, out_dtype, config, out or (None, None), FAMILY)
    assert s is not None
    return s, y


def workload_for(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float, out_dtype: torch.dtype | None = None) -> Workload:
    return _ln._workload(x, weight, bias, eps, out_dtype, x.device.type, residual=True)


def make_inputs(workload: Workload, *, seed: int, rows: int | None = None,
                device: str | torch.device | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random (args, kwargs) for `add_layernorm` / `add_layernorm_ref` on this workload."""
    (x, residual), weight, bias, kwargs = _ln.draw(workload, seed=seed, rows=rows, device=device)
    return (x, residual, weight, bias, float(workload.param("eps", 1e-5))), kwargs


# ----------------------------------------------------------------------------------------------
# Custom op and autograd (the residual stream's gradient joins the norm's in layernorm's backward)

_LIB = torch.library.Library("solforge", "FRAGMENT")
_LIB.define("add_layernorm(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, ScalarType out_dtype, "
            "str config) -> (Tensor, Tensor)")


def _op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
        eps: float, out_dtype: torch.dtype, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    fwd = config.partition("|")[0]  # "FWD|BWD" in training (integrate/__init__.py): the forward's part
    return add_layernorm(x, residual, weight, bias, eps, out_dtype=out_dtype,
                         config=Config.decode(fwd) if fwd else None)


_LIB.impl("add_layernorm", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("solforge::add_layernorm")
def _fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
          eps: float, out_dtype: torch.dtype, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=out_dtype)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    _x, _r, weight, bias, eps, _out_dtype, config = inputs
    ctx.save_for_backward(output[0], weight)  # the sum: the norm's input
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.bwd_config = config.partition("|")[2]  # tuned as family layernorm_bwd with ds; "" = its heuristic


def _backward(ctx: Any, ds: torch.Tensor | None, dy: torch.Tensor | None) -> tuple[Any, ...]:
    s, weight = ctx.saved_tensors
    dw = db = None
    if dy is None:  # only the sum was used downstream
        dsum = ds if ds is not None else torch.zeros_like(s)
    else:
        dsum, dw32, db32 = _ln.layernorm_bwd_call(dy, s, weight, ctx.eps, ds, ctx.bias_dtype is not None,
                                                    ctx.bwd_config)
        dw, db = _ln.param_grads(dw32, db32, weight, ctx.bias_dtype)
    return dsum, dsum, dw, db, None, None, None


torch.library.register_autograd("solforge::add_layernorm", _backward, setup_context=_setup)
direct.register(torch.ops.solforge.add_layernorm.default, _op, _setup, _backward)
add_layernorm_op = torch.ops.solforge.add_layernorm.default
