"""What describes one drafter type: its name, its class, its own config keys and how its config is checked.

Each type's ``SPEC = DrafterSpec(...)`` lives in ``drafter_node/type_specs/<name>.py`` and ``drafter_node/types.py``
lists that module; the config loader (``runtime/config.py``), the CLI (``runtime/cli.py``), the profiler
(``runtime/profile.py``) and the generated docs (``runtime/config_doc.py``) read nothing else about a type. The
loader imports every registered spec module, so those stay light: at module scope they import this module only, and
their hooks import the type's implementation (torch, transformers) when they run.

The loader's hooks (``check``, ``check_model``) see a read-only view of the config it is validating (a hook cannot
change it behind the loader's back): ``check`` returns the ``drafter`` keys it normalised (e.g. a path made
absolute; the loader sets them), ``check_model`` only checks. Both raise :class:`ValueError` (any subclass) whose
message starts with the offending key (``drafter.KEY: ...``), which the loader turns into its ``ConfigError``.
The node's hook (``profile_variant``) gets the typed settings the type is built from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shared.protocol import MAX_DRAFT_TOKENS
from shared.settings import build, declared, defaults

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


#: What a type's ``check`` hook returns: the ``drafter`` keys it normalised, with their new values (empty: none).
Normalised = Mapping[str, Any]


def _no_check(config: Mapping[str, Mapping[str, Any]]) -> Normalised:
    return {}


def _no_model_check(config: Mapping[str, Mapping[str, Any]], local: LocalFolder) -> None:
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
    #: ``drafter.model`` is one model file (a GGUF), not a folder: a named model is installed as its file, not
    #: converted for torch, and the type's ``check`` hook checks the value (and makes a path absolute).
    model_file: bool = False
    #: The type's own key (declared in :attr:`settings` as an integer with an upper bound ≤
    #: :data:`shared.protocol.MAX_DRAFT_TOKENS`) that caps its draft block: ``--num-draft-tokens K`` sets it too.
    block_length_key: str | None = None
    #: Why the block length cannot be set (``--num-draft-tokens`` is refused), or None.
    fixed_k: str | None = None
    #: Optional Python packages the type needs: ``(import name, what to install)`` pairs; a config of this type
    #: fails at load time, saying what to install, when one is missing (looked up without importing it).
    requires: tuple[tuple[str, str], ...] = ()
    #: Why ``pipespec profile`` does not profile the type's model on its own (None: it does, when there is one).
    profile_skip: str | None = None
    #: For a type that profiles a reshaped model (early_exit: the first E layers): ``profile_model(drafter,
    #: path)``, given the validated ``drafter`` section and the model's resolved path, returns the architecture to
    #: load the checkpoint into and what the profile table adds to the model's name. None: the plain checkpoint.
    profile_model: Callable[[Mapping[str, Any], str], tuple[Any, str]] | None = None
    #: transformers' ``generate()`` equivalent, as Markdown, for the docs ("" when it has none).
    transformers: str = ""
    #: What the drafter drafts with, in a few words (the README's table).
    drafts_with: str = ""
    #: What the drafter holds and how it drafts (docs/drafter-types.md's table).
    holds: str = ""
    #: Config-time checks of the type's own keys (``check(config)`` on a read-only view; no model is loaded): returns
    #: the ``drafter`` keys it normalised (:data:`Normalised`), which the loader sets.
    check: Callable[[Mapping[str, Mapping[str, Any]]], Normalised] = _no_check
    #: Checks that need the model's config.json: ``check_model(config, local)``, see :data:`LocalFolder`.
    check_model: Callable[[Mapping[str, Mapping[str, Any]], LocalFolder], None] = _no_model_check
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
        if self.block_length_key is not None:
            self._check_block_length_key()
        if self.fixed_k is not None and self.block_length_key is not None:
            raise ValueError(f"drafter type {self.name!r}: a fixed k has no block length key")
        for item in self.requires:
            if not (isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) and x for x in item)):
                raise ValueError(f"drafter type {self.name!r}: requires holds (import name, what to install) "
                                 f"pairs, got {item!r}")

    def _check_block_length_key(self) -> None:
        """The block length key is a declared integer the config loader caps at what the verifier takes: a type
        cannot forget the cap (a block over it is refused by the verifier, mid-request)."""
        meta = {name: m for name, _, m in declared(self.settings)}.get(self.block_length_key) \
            if self.settings is not None else None
        if meta is None:
            raise ValueError(f"drafter type {self.name!r}: block_length_key {self.block_length_key!r} is not one of "
                             "its declared settings")
        high = (meta.bounds or (None, None))[1]
        if meta.kind != "int" or high is None or high > MAX_DRAFT_TOKENS:
            raise ValueError(f"drafter type {self.name!r}: block_length_key {self.block_length_key!r} must be "
                             f"declared kind='int' with an upper bound ≤ {MAX_DRAFT_TOKENS} (the verifier's "
                             f"largest block), got kind {meta.kind!r}, bounds {meta.bounds}")

    def own_settings(self, drafter: Mapping[str, Any]) -> Any:
        """This type's own keys out of a validated ``drafter`` section: an instance of :attr:`settings`, an
        :class:`OwnKeys` for a type declared with ``keys=``, or None for a type without keys of its own."""
        if self.settings is not None:
            return build(self.settings, drafter)
        return OwnKeys({key: drafter[key] for key in self.keys}) if self.keys else None


def positive_int(config: Mapping[str, Mapping[str, Any]], key: str, minimum: int = 1) -> Normalised:
    """``drafter.KEY`` is an integer ≥ ``minimum`` (a bool is not), else :class:`SpecError` naming it; nothing to
    normalise (a ``check`` hook may return this)."""
    value = config["drafter"][key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"drafter.{key}: must be an integer ≥ {minimum}, got {value!r}")
    return {}
