"""Declaring config keys: a :func:`setting` is a dataclass field that also carries its doc, bounds and choices.

The config sections (``runtime/config_schema.py``) and the drafter types' own keys are frozen dataclasses built from
these fields, so each key's default, its allowed values and its one-line doc are written once; the loader's generic
checks and the generated reference (``docs/configuration.md``) read them from here. Only the standard library is
imported, so drafter type specs may use this module at import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Metadata key under which a field's :class:`Setting` is stored.
META = "pipespec.setting"


@dataclass(frozen=True)
class Setting:
    """What a config key declares besides its default."""

    doc: str
    #: ``"int"``, ``"number"``, ``"bool"``, ``"str"`` or ``"any"`` (checked by hand in runtime/config.py).
    kind: str = "any"
    #: Inclusive ``(low, high)``; ``None`` on a side means unbounded.
    bounds: tuple[float | None, float | None] | None = None
    #: The allowed values, when the key is one of a fixed set.
    choices: tuple[Any, ...] | None = None
    #: ``null`` is allowed besides the kind's values.
    nullable: bool = False
    #: Extra values allowed besides the kind (e.g. ``"auto"`` for threads).
    also: tuple[Any, ...] = ()
    #: The lower bound itself is excluded (``(0, None)`` then reads "> 0").
    open_low: bool = False
    #: Appended to the error message (what to do instead).
    hint: str = ""

    def bounds_text(self) -> str:
        """The bounds as the reference prints them: ``[1, 64]``, ``≥ 0``, ``> 0`` or ``""``."""
        if self.bounds is None:
            return ""
        low, high = self.bounds
        if high is None:
            return f"{'>' if self.open_low else '≥'} {low}"
        return f"{'(' if self.open_low else '['}{low}, {high}]"


def setting(default: Any, doc: str, *, kind: str = "any", bounds: tuple[float | None, float | None] | None = None,
            choices: tuple[Any, ...] | None = None, nullable: bool = False, also: tuple[Any, ...] = (),
            open_low: bool = False, hint: str = "") -> Any:
    """A dataclass field with ``default`` and a :class:`Setting` in its metadata (a null default is nullable)."""
    meta = Setting(doc, kind, bounds, tuple(choices) if choices is not None else None,
                   nullable or default is None, tuple(also), open_low, hint)
    if isinstance(default, (dict, list, set)):
        raise TypeError("a setting's default must be immutable")
    return dataclasses.field(default=default, metadata={META: meta})


def declared(cls: type) -> tuple[tuple[str, Any, Setting], ...]:
    """``(name, default, Setting)`` for each field of a settings dataclass, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        if META not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
        out.append((f.name, f.default, f.metadata[META]))
    return tuple(out)


def defaults(cls: type) -> dict[str, Any]:
    """The declared defaults of a settings dataclass, as a plain dict in declaration order."""
    return {name: default for name, default, _ in declared(cls)}


def violation(meta: Setting, value: Any) -> str | None:
    """Why ``value`` does not fit ``meta`` (a phrase such as ``"must be true or false"``), or None when it does."""
    if value is None and meta.nullable:
        return None
    if value in meta.also and not isinstance(value, bool):
        return None
    if meta.choices is not None:
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool) and value in meta.choices
        return None if ok else f"one of {', '.join(map(str, meta.choices))}"
    if meta.kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if meta.kind in ("int", "number"):
        types = (int,) if meta.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, types):
            return f"must be {'an integer' if meta.kind == 'int' else 'a number'}"
        low, high = meta.bounds or (None, None)
        too_low = low is not None and (value <= low if meta.open_low else value < low)
        if too_low or (high is not None and value > high):
            text = meta.bounds_text()
            return f"must be {'an integer' if meta.kind == 'int' else 'a number'} {'in ' * (text[0] in '[(')}{text}"
    if meta.kind == "str" and not isinstance(value, str):
        return "must be a string"
    return None


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of ``cls`` from ``values`` (keys ``cls`` does not declare are ignored; missing ones default)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})
