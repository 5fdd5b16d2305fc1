"""solforge: find where a PyTorch model's GPU time goes, tune fused kernels for it, prove them
equal to the original, and swap them in without changing the model's code."""

from __future__ import annotations

from typing import Any

__all__ = ["optimize", "profile"]


def optimize(*args: Any, **kwargs: Any) -> Any:
    """See solforge.api.optimize (imported lazily so `import solforge` stays cheap)."""
    from solforge.api import optimize as _optimize

    return _optimize(*args, **kwargs)


def profile(*args: Any, **kwargs: Any) -> Any:
    """See solforge.api.profile."""
    from solforge.api import profile as _profile

    return _profile(*args, **kwargs)
