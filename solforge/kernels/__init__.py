"""Kernel families: one file per family (reference, Triton kernels, launcher, custom op, config triad)."""

import os as _os

# Under Triton's interpreter (the CPU tests) the kernels' runtime-bound loops need interp's fix of
# the interpreter, installed when interp is imported: here, so that it is in place whichever family
# is imported first. Without TRITON_INTERPRET nothing is imported (config_text needs no triton).
if _os.environ.get("TRITON_INTERPRET"):
    from solforge.kernels import interp as _interp  # noqa: F401
