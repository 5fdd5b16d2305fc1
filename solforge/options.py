"""The options of one `optimize` run, gathered in one frozen record (api.optimize's keyword
arguments, checked once): what the stages read instead of a long list of parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solforge.errors import UserError
from solforge.kernels import registry

MODES = ("inference", "train")


@dataclass(frozen=True)
class Options:
    """api.optimize's options (its docstring says what each does)."""

    mode: str = "inference"
    budget: float = 120.0
    out_dir: Path | None = None
    make_inputs: Callable[[int], Sequence[Any]] | None = None
    is_language_model: bool | None = None
    name: str | None = None
    families: tuple[str, ...] | None = None
    max_candidates: int | None = None
    command: str = ""
    db: str | Path | bool = True
    runner: str = "local"
    gpus: tuple[int, ...] | None = None
    strategy: str = "auto"
    build_workers: int = 0
    timeout: float = 120.0
    retune: bool = False
    resume: bool = False
    profile: str = "auto"
    cuda_graphs: bool = True
    keep_slower: bool = False

    @property
    def train(self) -> bool:
        return self.mode == "train"

    def check(self) -> None:
        """A UserError (one line) for a bad option; nothing else."""
        if self.mode not in MODES:
            raise UserError(f"mode {self.mode!r} is not supported: use --mode inference or --mode train")
        if self.budget <= 0:
            raise UserError(f"--budget must be positive (got {self.budget})")
        if self.profile not in ("auto", "on", "off"):
            raise UserError(f"--profile must be auto, on or off (got {self.profile!r})")
        if self.timeout <= 0:
            raise UserError(f"--timeout must be positive (got {self.timeout})")
        from solforge.tune.runners import check_spec

        check_spec(self.runner)


def check_families(families: Sequence[str] | None) -> tuple[str, ...] | None:
    """The kernel families asked for (None: all), or a UserError naming the unknown ones."""
    if families is None:
        return None
    known = registry.forward_names()
    unknown = [f for f in families if f not in known]
    if unknown or not families:
        raise UserError(f"unknown kernel families {unknown or '(none given)'}: choose from {', '.join(known)}")
    return tuple(families)
