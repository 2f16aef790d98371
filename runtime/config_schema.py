"""The config's sections as frozen dataclasses: every key's default, bounds and one-line doc, declared once.

``runtime/config.py`` derives its ``DEFAULTS`` and ``DRAFTER_COMMON`` from these classes and validates loaded YAML
against them; :func:`runtime.config.typed` turns a validated config dict into a :class:`Config`, the object the
nodes take. The classes are declared below ``runtime/``, where the nodes may import them (tests/test_layers.py):
the ``drafter`` section's common keys and :class:`Config` in ``shared/config.py``, the other sections in
``shared/config_sections.py``, the keys both nodes have in ``shared/node_keys.py``, and a drafter type's own keys
in its spec (``drafter_node/type_specs/<name>.py``). This module lists them in the reference's order. The
reference in ``docs/configuration.md`` is generated from here (``python -m runtime.config_doc``).
"""

from __future__ import annotations

from shared.config import Config, DrafterConfig
from shared.config_sections import (
    LAUNCH_BACKENDS,
    MAX_LAUNCHED_DRAFTERS,
    PLACEMENT_STRATEGIES,
    ClientConfig,
    HttpConfig,
    LaunchConfig,
    SecurityConfig,
    VerificationConfig,
    VerifierConfig,
)

__all__ = ["LAUNCH_BACKENDS", "MAX_LAUNCHED_DRAFTERS", "PLACEMENT_STRATEGIES", "SECTIONS", "ClientConfig", "Config",
           "DrafterConfig", "HttpConfig", "LaunchConfig", "SecurityConfig", "VerificationConfig", "VerifierConfig"]

#: Section name → its dataclass, in the order of the config reference.
SECTIONS: dict[str, type] = {
    "verifier": VerifierConfig,
    "drafter": DrafterConfig,
    "verification": VerificationConfig,
    "client": ClientConfig,
    "launch": LaunchConfig,
    "security": SecurityConfig,
    "http": HttpConfig,
}
