"""Kernel families: one file per family (reference, Triton kernels, launcher, custom op, config triad)."""
