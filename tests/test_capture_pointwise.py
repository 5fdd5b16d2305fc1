"""capture/pointwise.py's answer does not depend on the torch version's tags: every op it names is
one codegen lowers, and every op codegen lowers that this torch tags pointwise is named."""

from __future__ import annotations

import torch

from solforge.capture.pointwise import ELEMENTWISE, is_pointwise
from solforge.codegen.lower import LOWERINGS

aten = torch.ops.aten


def _op(name: str) -> torch._ops.OpOverload | None:
    ns, packet, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), overload)
    except AttributeError:
        return None


def test_every_elementwise_op_is_one_codegen_lowers() -> None:
    assert ELEMENTWISE <= set(LOWERINGS), sorted(ELEMENTWISE - set(LOWERINGS))


def test_every_tagged_op_codegen_lowers_is_named() -> None:
    tagged = {n for n in LOWERINGS if (op := _op(n)) is not None and torch.Tag.pointwise in op.tags}
    assert tagged <= ELEMENTWISE, sorted(tagged - ELEMENTWISE)


def test_untagged_activations_and_anchors() -> None:
    # leaky_relu has no pointwise tag in torch 2.11, hardswish none in 2.11-2.13
    for op in (aten.leaky_relu.default, aten.hardswish.default, aten.gelu.default, aten.mul.Tensor,
               aten.where.ScalarOther, torch.ops.prims.convert_element_type.default):
        assert is_pointwise(op), op
    for op in (aten.convolution.default, aten.sum.dim_IntList, aten.max_pool2d_with_indices.default,
               aten.view.default, aten.mm.default, "aten.add.Tensor", None):
        assert not is_pointwise(op), op
