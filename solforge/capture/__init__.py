"""Capture: torch.compile backend (dynamo) -> FX graph -> ATen graph with shapes, dtypes, module paths.

Dynamo gives one FX graph per traceable piece of the model and splits at graph breaks instead of
failing. Each graph is lowered to ATen with make_fx under dynamo's own fake mode, so every way of
writing an op (`x.pow(2)`, `x*x`, `nn.RMSNorm`, `.to(float32)`) becomes the same canonical ops,
and every node carries `meta["val"]` (a fake tensor: shape, dtype, device).
"""

from solforge.capture.backend import (
    Rewrite,
    SolforgeBackend,
    capture,
    compile_call,
    compile_forward,
    compile_with,
    few_full_collections,
    static_shapes,
)
from solforge.capture.cache import LoweringCache
from solforge.capture.lower import (
    BackwardLost,
    CapturedGraph,
    GradModeLost,
    backward_lost,
    lower_to_aten,
    module_path,
    op_name,
)

__all__ = ["BackwardLost", "CapturedGraph", "GradModeLost", "LoweringCache", "Rewrite", "SolforgeBackend",
           "backward_lost", "capture", "compile_call", "compile_forward", "compile_with", "few_full_collections",
           "lower_to_aten", "module_path", "op_name", "static_shapes"]
