"""What describes one drafter type: its name, its class, its own config keys and how its config is checked.

Each type's ``SPEC = DrafterSpec(...)`` lives in ``drafter_node/type_specs/<name>.py`` and ``drafter_node/types.py``
lists that module; the config loader (``runtime/config.py``) reads nothing else about a type. The loader imports
every registered spec module, so those stay light: at module scope they import this module only, and their hooks
import the type's implementation (torch, transformers) when they run.

The loader's hooks (``check``, ``check_model``) see the config dict it is validating; they raise
:class:`ValueError` (any subclass) whose message starts with the offending key (``drafter.KEY: ...``), which the
loader turns into its ``ConfigError``. The node's hook (``profile_variant``) gets the typed settings the type is
built from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shared.settings import build, defaults

#: ``local(name)``: the local folder (with a config.json) a model name stands for, or None (a named model not
#: converted yet, a hub id): a ``check_model`` hook then skips its check (the drafter checks when it starts).
LocalFolder = Callable[[str], Path | None]


class SpecError(ValueError):
    """A drafter type's config check failed; the message names the key."""


class OwnKeys(Mapping[str, Any]):
    """The own keys of a type declared with ``keys=`` (no settings class), as the node gets them: read-only, and
    picklable like the rest of a config's frozen sections (a ``MappingProxyType`` is not)."""

    def __init__(self, values: Mapping[str, Any]):
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"OwnKeys({self._values!r})"


def _no_check(config: dict[str, Any]) -> None:
    return None


def _no_model_check(config: dict[str, Any], local: LocalFolder) -> None:
    return None


def _no_variant(settings: Any, own: Any) -> str:
    return ""


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter type, as the config loader and the node see it."""

    #: ``drafter.type`` value (the key of this type's line in ``drafter_node/types.py``).
    name: str
    #: The implementing class, ``"module:Class"``, imported only when a drafter of this type is built.
    cls: str
    #: What the type is called in messages ("prompt lookup decoding").
    title: str
    #: The type's own ``drafter.*`` keys: a frozen dataclass of :func:`shared.settings.setting` fields (the keys
    #: every type shares are declared in drafter_node/settings.py).
    settings: type | None = None
    #: The type's own keys and their defaults: derived from :attr:`settings`; given directly only by a type
    #: without declarations (its keys then have no doc and only its ``check`` hook checks them).
    keys: Mapping[str, Any] = field(default_factory=dict)
    #: ``drafter.model`` must name a model.
    needs_model: bool = True
    #: The drafter drafts with the target checkpoint itself: ``drafter.model`` defaults to ``verifier.model``.
    model_defaults_to_target: bool = False
    #: The drafter reads part of the target checkpoint: ``drafter.target_model`` defaults to ``verifier.model``.
    reads_target: bool = False
    #: The drafter sends a draft distribution q (without it, static ensemble verification is refused).
    sends_q: bool = True
    #: Config-time checks of the type's own keys (``check(config)``; no files are read).
    check: Callable[[dict[str, Any]], None] = _no_check
    #: Checks that need the model's config.json: ``check_model(config, local)``, see :data:`LocalFolder`.
    check_model: Callable[[dict[str, Any], LocalFolder], None] = _no_model_check
    #: What distinguishes this type's cost profile from another's on the same model ("" when nothing does):
    #: ``profile_variant(settings, own)``, given what the type is built from (the typed ``drafter`` section and the
    #: type's own settings, see :class:`drafter_node.base.Drafter`).
    profile_variant: Callable[[Any, Any], str] = _no_variant
    #: ``"module:function"`` building the type's tiny test setup (``testkit.conformance``, tests/test_conformance.py).
    conformance: str | None = None

    def __post_init__(self) -> None:
        module, sep, cls = self.cls.partition(":")
        if not (module and sep and cls):
            raise ValueError(f"drafter type {self.name!r}: cls must be 'module:Class', got {self.cls!r}")
        if self.model_defaults_to_target and not self.needs_model:
            raise ValueError(f"drafter type {self.name!r}: model_defaults_to_target needs needs_model")
        if self.keys and self.settings is not None:
            raise ValueError(f"drafter type {self.name!r}: give settings= or keys=, not both")
        # one place for each default: the mapping is read off the declarations
        own = defaults(self.settings) if self.settings is not None else dict(self.keys)
        object.__setattr__(self, "keys", MappingProxyType(own))

    def own_settings(self, drafter: Mapping[str, Any]) -> Any:
        """This type's own keys out of a validated ``drafter`` section: an instance of :attr:`settings`, an
        :class:`OwnKeys` for a type declared with ``keys=``, or None for a type without keys of its own."""
        if self.settings is not None:
            return build(self.settings, drafter)
        return OwnKeys({key: drafter[key] for key in self.keys}) if self.keys else None


def positive_int(config: dict[str, Any], key: str, minimum: int = 1) -> None:
    """``drafter.KEY`` is an integer ≥ ``minimum`` (a bool is not), else :class:`SpecError` naming it."""
    value = config["drafter"][key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"drafter.{key}: must be an integer ≥ {minimum}, got {value!r}")
