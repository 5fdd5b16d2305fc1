"""The text form of a family's Config, as the custom ops receive it: "variant:key=value:...".

Each family names its fields' abbreviations; fields at their default are left out unless listed in
`always`. One encoder and parser for every family, so a config string means the same everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, TypeVar

C = TypeVar("C")


def items(config: Any) -> tuple[tuple[str, Any], ...]:
    return tuple((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))


def encode(config: Any, abbrev: Mapping[str, str], always: Collection[str] = ()) -> str:
    parts = [config.variant]
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.name != "variant" and (v != f.default or f.name in always):
            parts.append(f"{abbrev[f.name]}={v}")
    return ":".join(parts)


def decode(cls: type[C], text: str, *, family: str, variants: Collection[str], abbrev: Mapping[str, str]) -> C:
    """Parse `text`; a ValueError names what is wrong (a bad config string is a user's input)."""
    fields = {v: k for k, v in abbrev.items()}
    variant, *parts = text.split(":")
    if variant not in variants:
        raise ValueError(f"bad {family} config {text!r}: variant must be one of {tuple(variants)}")
    kw: dict[str, Any] = {}
    for p in parts:
        k, sep, v = p.partition("=")
        if not sep or k not in fields or not v.isdigit():
            raise ValueError(f"bad {family} config {text!r}: field {p!r} (keys: {', '.join(fields)})")
        kw[fields[k]] = int(v)
    return cls(variant, **kw)  # type: ignore[call-arg]


class Text:
    """Mixin for a family's frozen-dataclass Config: `items`, `encode` and a cached `decode`, from
    the class attributes `_family`, `_variants`, `_abbrev` and `_always` (not dataclass fields:
    they carry no annotation in the family's class)."""

    _family: ClassVar[str]
    _variants: ClassVar[Collection[str]]
    _abbrev: ClassVar[Mapping[str, str]]
    _always: ClassVar[Collection[str]] = ()

    def items(self) -> tuple[tuple[str, Any], ...]:
        return items(self)

    def encode(self) -> str:
        return encode(self, self._abbrev, self._always)

    @classmethod
    def decode(cls: type[C], text: str) -> C:
        return _decode_cached(cls, text)


@functools.lru_cache(maxsize=8192)
def _decode_cached(cls: type[C], text: str) -> C:
    # one parse per (family, text): the custom ops decode their config string on every call
    return decode(cls, text, family=cls._family, variants=cls._variants, abbrev=cls._abbrev)  # type: ignore[attr-defined]
