"""The options of one `optimize` run, gathered in one frozen record (api.optimize's keyword
arguments, checked once): what the stages read instead of a long list of parameters."""

from __future__ import annotations

import math
import os
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
    skip_logits: bool = False

    @property
    def train(self) -> bool:
        return self.mode == "train"

    def check(self) -> None:
        """A UserError (one line) for a bad option; nothing else."""
        if self.mode not in MODES:
            raise UserError(f"mode {self.mode!r} is not supported: use --mode inference or --mode train")
        check_seconds("--budget", self.budget)
        if self.profile not in ("auto", "on", "off"):
            raise UserError(f"--profile must be auto, on or off (got {self.profile!r})")
        check_seconds("--timeout", self.timeout)
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


def check_seconds(flag: str, value: object) -> float:
    """A time limit (--budget, --timeout) as a positive finite number of seconds, or a UserError:
    nan compares false with everything, so `value <= 0` alone lets it (and inf) through."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise UserError(f"{flag} must be a positive, finite number of seconds (got {value!r})")
    return float(value)  # type: ignore[arg-type]


def check_interpreter() -> None:
    """A model on the CPU: solforge's kernels run there only in Triton's interpreter, which is
    decided when they are defined (`import solforge` switches it on where there is no GPU). Refused
    in one line where it is off, rather than every candidate failing."""
    from triton.language import standard

    from solforge.kernels.interp import INTERPRETED

    setting = os.environ.get("TRITON_INTERPRET")
    if not INTERPRETED:
        raise UserError("the model is on the CPU, where solforge's kernels run only in Triton's interpreter, and it "
                        f"is off (TRITON_INTERPRET={setting if setting is not None else 'unset'}): set "
                        "TRITON_INTERPRET=1 in the environment before solforge is imported, or put the model on a GPU")
    # Triton's own library (tl.cdiv, tl.sigmoid, ...) is made when triton is imported: imported
    # before the switch, it is compiled code the interpreted kernels cannot call
    probe = getattr(standard, "cdiv", None)
    if probe is not None and type(probe).__name__ != "InterpretedFunction":
        raise UserError("the model is on the CPU, where solforge's kernels run in Triton's interpreter, but triton "
                        "was imported before it was switched on: import solforge before triton, or set "
                        "TRITON_INTERPRET=1 in the environment")
