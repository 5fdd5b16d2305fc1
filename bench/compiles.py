"""Counting Triton's compiles from a bench script: which kernels a call compiled and the time it
took (a compile Triton finds in its on-disk cache counts too, at a few milliseconds)."""

from __future__ import annotations

import collections
import time
from typing import Any


class CompileCounter:
    """Wraps triton's JITFunction._do_compile while installed; `take()` returns what was counted
    since the last take and starts again."""

    def __init__(self) -> None:
        self.kernels: collections.Counter[str] = collections.Counter()
        self.seconds = 0.0
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # no triton: nothing to count
            return
        original = JITFunction._do_compile

        def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(fn, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.kernels[fn.fn.__name__] += 1

        JITFunction._do_compile = counted  # type: ignore[method-assign]

    def take(self) -> dict[str, Any]:
        out = {"triton_compiles": sum(self.kernels.values()), "compile_ms": round(self.seconds * 1e3),
               "compiled": dict(self.kernels)}
        self.kernels.clear()
        self.seconds = 0.0
        return out
