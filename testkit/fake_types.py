"""Registering a drafter type inside a test, the way a new type is registered: a module declaring ``SPEC`` and one
``DRAFTER_TYPES`` line naming it (both undone by ``monkeypatch`` when the test ends)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from drafter_node.spec import DrafterSpec
from drafter_node.types import DRAFTER_TYPES


def register_type(monkeypatch: pytest.MonkeyPatch, spec: DrafterSpec, **attrs: Any) -> None:
    """Register ``spec`` under its name; ``attrs`` become attributes of its module (its drafter class, say)."""
    module = types.ModuleType(f"toy_type_{spec.name}")
    module.SPEC = spec
    for name, value in attrs.items():
        setattr(module, name, value)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(DRAFTER_TYPES, spec.name, module.__name__)
