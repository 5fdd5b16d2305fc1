"""Settings: every SOLFORGE_* environment switch, read in one place, parsed one way, recorded.

`current()` reads the environment once per process (the first call) and keeps the `Settings`;
`override(**changes)` replaces some of them for a `with` block (tests, the API). report.json keeps
`as_dict()` of the run's settings; the switches marked "kernels" below are part of the kernel
database's key (`kernel_key()`, db/__init__.py), so a measurement taken under one value is never
served to a run under another.

Switches: "1", "true", "on", "yes" turn one on, "0", "false", "off", "no" and the empty string
turn it off (any case, surrounding spaces ignored); anything else is an error naming the variable.
A SOLFORGE_* variable that names no setting (but the test suite's own two) is warned about once.
Paths: the empty string is the default.

| variable                  | default | kernels | read      | what it does                                             |
|---------------------------|---------|---------|-----------|----------------------------------------------------------|
| SOLFORGE_TORCH_ORDER      | 1       | yes     | import    | the norms sum a row's squares in eager PyTorch's order   |
|                           |         |         |           | (kernels/torch_order.py); 0: tl.sum, a little faster,    |
|                           |         |         |           | off eager's bits by a rounding now and then              |
| SOLFORGE_PDL              | 1       | yes     | first use | programmatic dependent launch (Hopper and later) for the |
|                           |         |         |           | reduce, rmsnorm_bwd and layernorm_bwd kernels            |
| SOLFORGE_DIRECT_LAUNCH    | 1       | no      | import    | launches call Triton's compiled launcher directly        |
|                           |         |         |           | (kernels/launch.py); 0: every launch through Triton      |
| SOLFORGE_DIRECT_CALLS     | 1       | no      | import    | the graph calls the ops' implementations without         |
|                           |         |         |           | torch.library's dispatch (kernels/direct.py)             |
| SOLFORGE_COMPACT          | 1       | no      | use       | integrate/compact.py: decomposed linears recomposed      |
| SOLFORGE_TIDY             | 1       | no      | use       | integrate/tidy.py: views of views, slices into one split |
| SOLFORGE_CONV_LAYOUT      | 1       | no      | use       | capture/layout.py: convolutions in channels-last where   |
|                           |         |         |           | timed faster on the GPU                                  |
| SOLFORGE_LINEARS          | 1       | no      | use       | integrate/linears.py: the training linears' backward     |
| SOLFORGE_EMBEDDING        | 1       | no      | use       | integrate/embeddings.py: the embeddings' backward        |
| SOLFORGE_GRAD_IN_PLACE    | 1       | no      | import    | runtime/accumulate.py: gradients added into .grad in     |
|                           |         |         |           | place; 0: always handed back to autograd                 |
| SOLFORGE_TRAIN_GRAPHS     | 1       | no      | import    | runtime/traingraphs.py: training steps as CUDA graphs    |
| SOLFORGE_TRAIN_ACCUMULATE | 1       | no      | import    | runtime/traingraphs.py: the accumulating backward        |
| SOLFORGE_TRAIN_MEMORY_RULE | 1      | no      | import    | runtime/traingraphs.py: a training capture that raises a |
|                           |         |         |           | step's peak reserved memory by over 10% is dropped; 0:   |
|                           |         |         |           | kept whatever memory it adds                             |
| SOLFORGE_GENERATED_ALTERNATIVES | 1 | no    | use       | plan/alternatives.py: a family's region is also tuned as |
|                           |         |         |           | a generated region; the faster verified one is used      |
| SOLFORGE_LOWERING_CACHE   | 1       | no      | use       | the ATen lowering cache (`lowered/` beside the database) |
| SOLFORGE_LOWERING_DIR     | unset   | no      | use       | the lowering cache's folder (`lowered/` beside the       |
|                           |         |         |           | database)                                                |
| SOLFORGE_DB               | unset   | no      | use       | the kernel database file (~/.cache/solforge/kernels.db)  |
| SOLFORGE_CEILINGS_DIR     | unset   | no      | use       | the device ceilings' cache (~/.cache/solforge/ceilings)  |
| SOLFORGE_CODEGEN_DIR      | unset   | no      | use       | generated kernels' sources (~/.cache/solforge/codegen)   |

"kernels": the switch changes the code of a kernel the database times, or how it is launched, so
it is part of the database key (each field's comment says why or why not). "read": `use` reads
`current()` each time (an override applies at once); `import` and `first use` keep a module-level
value on a hot path (the launch path, the replays, a row kernel's constexpr), which follows an
override through `follow()`, except SOLFORGE_TORCH_ORDER: rope.py compiles it into its kernels as
a global, so it is fixed once the kernels are imported (set it in the environment; `override`
refuses to change it then).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solforge.errors import UserError

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no", "")


def _switch(env: str, default: Any, doc: str, *, kernels: bool = False) -> Any:
    return field(default=default, metadata={"env": env, "doc": doc, "kernels": kernels})


@dataclass(frozen=True)
class Settings:
    """One value per switch (module docstring). Fields' metadata: `env` (the variable), `doc`,
    `kernels` (part of the kernel database key)."""

    # Changes kernel code: the row kernels' W/K constexprs (torch_order.sum_meta) and rope's
    # _TORCH_ORDER global choose another summation, with other bits and another speed.
    torch_order: bool = _switch("SOLFORGE_TORCH_ORDER", True, "the norms sum in eager PyTorch's order",
                                kernels=True)
    # Changes kernel code and launch semantics: the PDL constexpr compiles a gdc_wait into
    # reduce/rmsnorm_bwd/layernorm_bwd and they launch with launch_pdl=True, so they may start
    # under the kernel ahead of them: rmsnorm_bwd with its sum took 99.01 us without, 97.28 with it
    # on an H100 (bench/results/2026-11-23-h100-session9.md).
    pdl: bool = _switch("SOLFORGE_PDL", True, "programmatic dependent launch on Hopper and later", kernels=True)
    # Not in the key: a direct launch runs exactly the kernel Triton would pick (launch.py's key is
    # at least as strict as Triton's specialization); only host time changes, and the tuner times
    # device time behind a sleep gate that covers the host's queueing (tune/timing.py).
    direct_launch: bool = _switch("SOLFORGE_DIRECT_LAUNCH", True,
                                  "launches call Triton's compiled launcher directly")
    # Not in the key: which Python path reaches the same implementation; host time only.
    direct_calls: bool = _switch("SOLFORGE_DIRECT_CALLS", True,
                                 "the graph calls the ops' implementations without torch.library's dispatch")
    # The graph passes and the runtime below decide which ops the model runs and how its steps are
    # replayed, not how a family's kernel is built or timed: none is in the key.
    compact: bool = _switch("SOLFORGE_COMPACT", True, "integrate/compact.py's pass (linears recomposed)")
    tidy: bool = _switch("SOLFORGE_TIDY", True, "integrate/tidy.py's passes (views and slices)")
    conv_layout: bool = _switch("SOLFORGE_CONV_LAYOUT", True,
                                "capture/layout.py: convolutions in channels-last where timed faster")
    linears: bool = _switch("SOLFORGE_LINEARS", True, "integrate/linears.py's training linears")
    embedding: bool = _switch("SOLFORGE_EMBEDDING", True, "integrate/embeddings.py's embedding backward")
    grad_in_place: bool = _switch("SOLFORGE_GRAD_IN_PLACE", True, "gradients added into .grad in place")
    train_graphs: bool = _switch("SOLFORGE_TRAIN_GRAPHS", True, "training steps replayed as CUDA graphs")
    train_accumulate: bool = _switch("SOLFORGE_TRAIN_ACCUMULATE", True,
                                     "the training replays' accumulating backward")
    train_memory_rule: bool = _switch("SOLFORGE_TRAIN_MEMORY_RULE", True,
                                      "training replays dropped where they raise a step's peak reserved memory "
                                      "by more than 10%")
    # Which candidates compete, not how a kernel is built: each is keyed by its own workload.
    generated_alternatives: bool = _switch("SOLFORGE_GENERATED_ALTERNATIVES", True,
                                           "a family's region is also generated and tuned; the faster "
                                           "verified kernel is integrated")
    lowering_cache: bool = _switch("SOLFORGE_LOWERING_CACHE", True, "the ATen lowering cache beside the database")
    lowering_dir: Path | None = _switch("SOLFORGE_LOWERING_DIR", None,
                                        "the lowering cache's folder (None: lowered/ beside the database)")
    db: Path | None = _switch("SOLFORGE_DB", None, "the kernel database file (None: ~/.cache/solforge/kernels.db)")
    ceilings_dir: Path | None = _switch("SOLFORGE_CEILINGS_DIR", None,
                                        "the device ceilings' cache folder (None: ~/.cache/solforge/ceilings)")
    codegen_dir: Path | None = _switch("SOLFORGE_CODEGEN_DIR", None,
                                       "generated kernels' source files (None: ~/.cache/solforge/codegen)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        """The settings `environ` asks for (unset variables: the defaults). A value that is not one
        of a switch's spellings -> UserError naming the variable and the accepted values."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            text = environ.get(f.metadata["env"])
            if text is None:
                continue
            values[f.name] = _parse(f, text)
        unknown(environ)
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """{field name: value} as JSON data (paths as text): report.json's `settings`."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Settings:
        """The inverse of `as_dict`; names this solforge does not know (a newer report) are ignored."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        return cls(**{k: _coerce(names[k], v) for k, v in data.items() if k in names})

    def as_env(self, *, kernels_only: bool = False) -> dict[str, str]:
        """{variable: text} that `from_env` reads back as these settings (with `kernels_only`, those
        in the database key): what a worker process gets, so that it builds kernels under the
        settings its parent keys them by."""
        return {f.metadata["env"]: _text(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.metadata["kernels"] or not kernels_only}

    def kernel_key(self) -> str:
        """The switches that change kernels, as one stable text for the database key:
        "pdl=1 torch_order=1"."""
        return " ".join(f"{f.name}={_text(getattr(self, f.name))}" for f in sorted(
            dataclasses.fields(self), key=lambda f: f.name) if f.metadata["kernels"])


from_env = Settings.from_env  # the one parser, also by its module-level name


def switches() -> tuple[dataclasses.Field[Any], ...]:
    """Every switch's field (name, default, metadata env/doc/kernels), in table order."""
    return dataclasses.fields(Settings)


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return "" if value is None else str(value)


def _parse(f: dataclasses.Field[Any], text: str) -> Any:
    env = f.metadata["env"]
    if f.type in (bool, "bool"):
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise UserError(f"{env}={text!r} is not a switch value: use 1, true, on, yes or 0, false, off, no "
                        "(or leave it empty)")
    return Path(text).expanduser() if text.strip() else None


def _coerce(f: dataclasses.Field[Any], value: Any) -> Any:
    """A value given to `override` or `from_dict`, checked against the field's type."""
    if f.type in (bool, "bool"):
        if not isinstance(value, bool):
            raise TypeError(f"setting {f.name} ({f.metadata['env']}) is a bool, got {value!r}")
        return value
    if value is None or isinstance(value, Path):
        return value
    if isinstance(value, str):
        return Path(value).expanduser() if value else None
    raise TypeError(f"setting {f.name} ({f.metadata['env']}) is a path or None, got {value!r}")


# ----------------------------------------------------------------------------------------------
# The process's settings

_read: Settings | None = None  # from the environment, at the first current()
_active: Settings | None = None  # inside override()
# (the names a follower reads, their values at its last call, the follower)
_followers: list[tuple[tuple[str, ...], list[tuple[Any, ...]], Callable[[Settings], None]]] = []


# SOLFORGE_* variables that are not settings of the package: the test suite's own switches
TEST_VARIABLES = frozenset({"SOLFORGE_CODEGEN_FULL", "SOLFORGE_FULL_SWEEPS"})


def unknown(environ: Mapping[str, str]) -> list[str]:
    """SOLFORGE_* variables in `environ` that name no setting (a misspelled switch would otherwise
    be ignored without a word), each warned about once per process; returned for tests."""
    known = {f.metadata["env"] for f in dataclasses.fields(Settings)} | TEST_VARIABLES
    names = sorted(k for k in environ if k.startswith("SOLFORGE_") and k not in known)
    for name in names:
        if name not in _warned:
            _warned.add(name)
            close = difflib.get_close_matches(name, sorted(known), n=1)
            warnings.warn(f"{name} is not a solforge setting, so it changes nothing"
                          + (f" (did you mean {close[0]}?)" if close else "")
                          + "; the settings are listed in solforge/settings.py and docs/design.md",
                          stacklevel=3)
    return names


_warned: set[str] = set()


def current() -> Settings:
    """The settings in force: the innermost `override`'s, else the environment's, read once."""
    global _read
    if _active is not None:
        return _active
    if _read is None:
        _read = Settings.from_env(os.environ)
    return _read


def reload() -> Settings:
    """Read the environment again (a test that set a variable after the first read)."""
    global _read
    _read = None
    s = current()
    _notify(s)
    return s


def follow(apply: Callable[[Settings], None], *names: str) -> None:
    """Call `apply(current())` now, and again whenever one of the settings `names` changes (an
    override begins or ends, a reload): for a module that keeps a setting in a module-level name
    because a hot path reads it. Only those names: an override of another setting leaves the
    module's value alone (a test may have set it, or `launch.set_enabled`)."""
    unknown = set(names) - {f.name for f in dataclasses.fields(Settings)}
    if not names or unknown:
        raise ValueError(f"follow needs setting names (unknown: {sorted(unknown)})")
    s = current()
    apply(s)
    _followers.append((names, [tuple(getattr(s, n) for n in names)], apply))


def _notify(s: Settings) -> None:
    for names, last, apply in _followers:
        values = tuple(getattr(s, n) for n in names)
        if values != last[0]:
            last[0] = values
            apply(s)


# modules that compile a setting into their kernels as a Triton global at import (module doc)
_FIXED_AT_IMPORT = {"torch_order": "solforge.kernels.torch_order"}


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """Run a block under changed settings: `with override(linears=False, db=path): ...`.
    Unknown names -> TypeError; a value of the wrong type -> TypeError."""
    global _active
    names = {f.name: f for f in dataclasses.fields(Settings)}
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise TypeError(f"no setting {', '.join(unknown)} (settings: {', '.join(names)})")
    before = current()
    new = dataclasses.replace(before, **{k: _coerce(names[k], v) for k, v in changes.items()})
    for name, module in _FIXED_AT_IMPORT.items():
        if getattr(new, name) != getattr(before, name) and module in sys.modules:
            raise ValueError(f"{names[name].metadata['env']} is fixed once {module} is imported (its kernels "
                             "compile it in): set it in the environment of a new process")
    previous = _active
    _active = new
    _notify(new)
    try:
        yield new
    finally:
        _active = previous
        _notify(current())


def describe(data: Mapping[str, Any]) -> str:
    """One line naming a report's non-default settings ("SOLFORGE_LINEARS=0, SOLFORGE_PDL=0"), ""
    when all are defaults. `data` is report.json's `settings`: names this solforge does not know are
    left out, a value of the wrong type is shown as it is."""
    default = Settings()
    out = []
    for f in dataclasses.fields(Settings):
        if f.name not in data:
            continue
        try:
            value = _coerce(f, data[f.name])
        except TypeError:
            out.append(f"{f.metadata['env']}={data[f.name]!r}")
            continue
        if value != getattr(default, f.name):
            out.append(f"{f.metadata['env']}={_text(value)}")
    return ", ".join(out)
