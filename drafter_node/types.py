"""The registry of drafter types: one line per type, config name → the module that declares its ``SPEC``
(a :class:`drafter_node.spec.DrafterSpec`; the bundled types' are in ``drafter_node/type_specs/``).

The config loader imports every module listed (to know every type's keys), so these modules stay light (see
``drafter_node/type_specs/__init__.py``). The implementing class is imported only when used (:func:`drafter_class`).
"""

from __future__ import annotations

import importlib

from drafter_node.spec import DrafterSpec
from shared.config import DEFAULT_DRAFTER_TYPE, DRAFTER_TYPE_NAMES

DRAFTER_TYPES: dict[str, str] = {
    "assistant": "drafter_node.type_specs.assistant",
    "prompt_lookup": "drafter_node.type_specs.prompt_lookup",
    "early_exit": "drafter_node.type_specs.early_exit",
    "mtp": "drafter_node.type_specs.mtp",
    "mtp_drafter": "drafter_node.type_specs.mtp_drafter",
    "universal": "drafter_node.type_specs.universal",
    "suffix": "drafter_node.type_specs.suffix",
    "gguf": "drafter_node.type_specs.gguf",
}
if tuple(DRAFTER_TYPES) != DRAFTER_TYPE_NAMES:  # the verifier knows the names from shared/ alone
    raise TypeError(f"shared.config.DRAFTER_TYPE_NAMES {DRAFTER_TYPE_NAMES} must list DRAFTER_TYPES' names in order")
__all__ = ["DEFAULT_DRAFTER_TYPE", "DRAFTER_TYPES", "drafter_class", "drafter_spec", "drafter_specs"]


def drafter_spec(name: str) -> DrafterSpec:
    """The declaration of the registered type ``name`` (KeyError for an unknown one)."""
    spec = getattr(importlib.import_module(DRAFTER_TYPES[name]), "SPEC", None)
    if not isinstance(spec, DrafterSpec) or spec.name != name:
        raise TypeError(f"drafter type {name!r}: {DRAFTER_TYPES[name]} must declare "
                        f"SPEC = DrafterSpec(name={name!r}, ...)")
    return spec


def drafter_specs() -> list[DrafterSpec]:
    """Every registered type's declaration, in registry order."""
    return [drafter_spec(name) for name in DRAFTER_TYPES]


def drafter_class(name: str):
    module, _, cls = drafter_spec(name).cls.partition(":")
    return getattr(importlib.import_module(module), cls)
