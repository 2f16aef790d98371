"""docs/configuration.md is what runtime.config_doc generates from the declarations, and names every key."""

from __future__ import annotations

import pytest

from drafter_node.types import drafter_specs
from runtime.config import DEFAULTS
from runtime.config_doc import DOC_PATH, generate

pytestmark = pytest.mark.unit


def test_reference_is_up_to_date() -> None:
    assert DOC_PATH.read_text(encoding="utf-8") == generate(), \
        "docs/configuration.md is stale: run `python -m runtime.config_doc --write`"


def test_reference_names_every_key() -> None:
    text = generate()
    for section, keys in DEFAULTS.items():
        assert f"## `{section}`" in text
        for key in keys:
            assert f"| `{key}` |" in text, f"{section}.{key} missing from the reference"
    for spec in drafter_specs():
        assert f"### `{spec.name}`" in text
