"""The name "solforge" in dynamo's backend registry, without importing dynamo at `import solforge`.

`import torch._dynamo` costs seconds (10 s on the loaded CPU dev box, against 0.05 s for
`import solforge`), so `import solforge` does not register the backend itself: where dynamo's
registry module is already imported it registers now, else a finder on `sys.meta_path` waits for
that module's import and registers right after it runs, then takes itself off. An installed
solforge is also found through its `torch_dynamo_backends` entry point (pyproject.toml), which
dynamo reads when a name is not registered.
"""

from __future__ import annotations

import importlib.machinery
import sys
from types import ModuleType
from typing import Any

REGISTRY = "torch._dynamo.backends.registry"
NAME = "solforge"


def _backend(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """The registered function: solforge.dynamo imported on the first graph."""
    from solforge.dynamo import solforge_backend

    return solforge_backend(gm, example_inputs, **kwargs)


def _register(registry: ModuleType) -> None:
    if NAME not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=_backend, name=NAME)


class _OnImport:
    """Registers the backend once dynamo's registry module has run (a meta path finder: only
    `find_spec` is needed; importlib.abc is not imported for its base class)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != REGISTRY:
            return None
        _remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                _register(module)
            except Exception:  # noqa: BLE001 - dynamo's registry changed: the entry point remains
                pass

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finder = _OnImport()


def _remove() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def register_lazily() -> None:
    """Register now if dynamo's registry is imported, else when it is (see the module doc)."""
    registry = sys.modules.get(REGISTRY)
    if registry is not None:
        _register(registry)
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
