"""Declaring config keys: a :func:`setting` is a dataclass field that also carries its doc, bounds and choices.

The config sections (listed in ``runtime/config_schema.py``) and the drafter types' own keys are frozen dataclasses
built from these fields, so each key's default, its allowed values and its one-line doc are written once; the
loader's generic checks and the generated reference (``docs/configuration.md``) read them from here. Only the
standard library is imported, so drafter type specs may use this module at import time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Metadata key under which a field's :class:`Setting` is stored.
META = "pipespec.setting"


@dataclass(frozen=True)
class Setting:
    """What a config key declares besides its default."""

    doc: str
    #: ``"int"``, ``"number"``, ``"bool"``, ``"str"`` or ``"any"``; :func:`violation` checks every kind but
    #: ``"any"`` and a ``"str"`` without choices (runtime/config.py checks those by hand: models, devices, ...).
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
    #: The upper bound itself is excluded (with ``open_low``: the open interval ``(low, high)``).
    open_high: bool = False
    #: What a number counts, for error messages (``"seconds"``: "must be a number of seconds > 0").
    unit: str = ""

    def bounds_text(self) -> str:
        """The bounds as the reference prints them: ``[1, 64]``, ``≥ 0``, ``> 0``, ``(0, 1)`` or ``""``."""
        if self.bounds is None:
            return ""
        low, high = self.bounds
        if high is None:
            return f"{'>' if self.open_low else '≥'} {low}"
        if low is None:
            return f"{'<' if self.open_high else '≤'} {high}"
        return f"{'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"

    def allowed_text(self) -> str:
        """The allowed values in words, as an error message says them: ``auto or an integer ≥ 1``, ``one of a,
        b``, ``a number in the open interval (0, 1)``, ``true or false``."""
        if self.choices is not None:
            allowed = f"one of {', '.join(map(str, self.choices))}"
        elif self.kind in ("int", "number"):
            allowed = ("an integer" if self.kind == "int" else "a number") + (f" of {self.unit}" if self.unit else "")
            text = self.bounds_text()
            if text:
                both_open = self.open_low and self.open_high and None not in (self.bounds or (None,))
                allowed += f" in the open interval {text}" if both_open else f" {'in ' * (text[0] in '[(')}{text}"
        else:
            allowed = {"bool": "true or false", "str": "a string"}.get(self.kind, "any value")
        return " or ".join([*map(str, self.also), allowed])


def setting(default: Any, doc: str, *, kind: str = "any", bounds: tuple[float | None, float | None] | None = None,
            choices: tuple[Any, ...] | None = None, nullable: bool = False, also: tuple[Any, ...] = (),
            open_low: bool = False, open_high: bool = False, unit: str = "", hint: str = "") -> Any:
    """A dataclass field with ``default`` and a :class:`Setting` in its metadata (a null default is nullable)."""
    meta = Setting(doc, kind, bounds, tuple(choices) if choices is not None else None,
                   nullable or default is None, tuple(also), open_low, hint, open_high, unit)
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


def checked(meta: Setting) -> bool:
    """Whether :func:`violation` checks values of ``meta`` (a free-form string or an ``any`` has checks by hand)."""
    return meta.kind in ("int", "number", "bool") or meta.choices is not None


def violation(meta: Setting, value: Any) -> str | None:
    """Why ``value`` does not fit ``meta`` (a phrase such as ``"must be true or false"``), or None when it does."""
    if value is None and meta.nullable:
        return None
    if value in meta.also and not isinstance(value, bool):
        return None
    if meta.choices is not None:
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool) and value in meta.choices
    elif meta.kind == "bool":
        ok = isinstance(value, bool)
    elif meta.kind in ("int", "number"):
        ok = not isinstance(value, bool) and isinstance(value, int if meta.kind == "int" else (int, float)) \
            and _in_bounds(meta, value)
    elif meta.kind == "str":
        ok = isinstance(value, str)
    else:
        ok = True
    return None if ok else f"must be {meta.allowed_text()}"


def _in_bounds(meta: Setting, value: float) -> bool:
    if math.isnan(value):  # compares false with every bound, so it would pass them all
        return False
    low, high = meta.bounds or (None, None)
    too_low = low is not None and (value <= low if meta.open_low else value < low)
    too_high = high is not None and (value >= high if meta.open_high else value > high)
    return not (too_low or too_high)


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of ``cls`` from ``values`` (keys ``cls`` does not declare are ignored; missing ones default)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})
