"""Which ATen ops are pointwise: ATen's `pointwise` tag, or one of ELEMENTWISE.

The capture passes ask this to know what the generated region after a value will take (a
convolution's bias add, its copy back to NCHW); they must not import codegen, whose lowering table
is the full answer. ATen's tags differ between torch versions: `aten.hardswish` has none in 2.11-2.13,
`aten.leaky_relu` none in 2.11 (tagged in 2.13), so on the GPU's torch 2.11 a convolution followed
by a LeakyReLU kept ATen's separate bias pass (KernelBench level 2's 74: 213 µs of 742, H200,
2026-11-28) although the CPU tests, on 2.13, saw it moved. ELEMENTWISE names every elementwise op
codegen lowers (tests/test_capture_pointwise.py checks it against codegen's table and the tags of
the torch it runs on), so the answer does not depend on the torch version.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

ELEMENTWISE = frozenset({
    "aten._prelu_kernel.default", "aten._to_copy.default", "aten.abs.default", "aten.add.Scalar",
    "aten.add.Tensor", "aten.asinh.default", "aten.bitwise_not.default", "aten.ceil.default",
    "aten.celu.default", "aten.clamp.Tensor", "aten.clamp.default", "aten.clamp_max.default",
    "aten.clamp_min.default", "aten.clone.default", "aten.cos.default", "aten.cosh.default", "aten.div.Scalar",
    "aten.div.Scalar_mode", "aten.div.Tensor", "aten.div.Tensor_mode", "aten.elu.default", "aten.eq.Scalar",
    "aten.eq.Tensor", "aten.erf.default", "aten.erfc.default", "aten.exp.default", "aten.exp2.default",
    "aten.expm1.default", "aten.floor.default", "aten.floor_divide.default", "aten.fmax.default",
    "aten.fmin.default", "aten.fmod.Scalar", "aten.fmod.Tensor", "aten.frac.default", "aten.ge.Scalar",
    "aten.ge.Tensor", "aten.gelu.default", "aten.gt.Scalar", "aten.gt.Tensor", "aten.hardshrink.default",
    "aten.hardsigmoid.default", "aten.hardswish.default", "aten.hardtanh.default", "aten.isinf.default",
    "aten.isnan.default", "aten.isneginf.default", "aten.isposinf.default", "aten.le.Scalar", "aten.le.Tensor",
    "aten.leaky_relu.default", "aten.log.default", "aten.log10.default", "aten.log1p.default",
    "aten.log2.default", "aten.log_sigmoid_forward.default", "aten.logical_and.default",
    "aten.logical_not.default", "aten.logical_or.default", "aten.logical_xor.default", "aten.logit.default",
    "aten.lt.Scalar", "aten.lt.Tensor", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
    "aten.maximum.default", "aten.minimum.default", "aten.mish.default", "aten.mul.Scalar", "aten.mul.Tensor",
    "aten.ne.Scalar", "aten.ne.Tensor", "aten.neg.default", "aten.pow.Scalar", "aten.pow.Tensor_Scalar",
    "aten.pow.Tensor_Tensor", "aten.reciprocal.default", "aten.relu.default", "aten.remainder.Scalar",
    "aten.remainder.Tensor", "aten.round.default", "aten.rsqrt.default", "aten.rsub.Scalar",
    "aten.rsub.Tensor", "aten.sgn.default", "aten.sigmoid.default", "aten.sign.default", "aten.silu.default",
    "aten.sin.default", "aten.sinh.default", "aten.softplus.default", "aten.softshrink.default",
    "aten.sqrt.default", "aten.sub.Scalar", "aten.sub.Tensor", "aten.tan.default", "aten.tanh.default",
    "aten.threshold.default", "aten.trunc.default", "aten.where.Scalar", "aten.where.ScalarOther",
    "aten.where.ScalarSelf", "aten.where.self", "aten.xlogy.Scalar_Other", "aten.xlogy.Tensor",
    "prims.convert_element_type.default",
})


def _name(target: torch._ops.OpOverload) -> str:
    return f"{target.namespace}.{target._overloadpacket.__name__}.{target._overloadname}"


def is_pointwise(target: Any) -> bool:
    """Whether an FX node's target is a pointwise ATen op (tagged, or one of ELEMENTWISE)."""
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or _name(target) in ELEMENTWISE)
