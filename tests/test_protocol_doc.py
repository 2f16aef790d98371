"""docs/protocol.md is what shared.protocol_doc generates from the message classes, and names every field."""

from __future__ import annotations

import dataclasses

import pytest

from shared.protocol import MESSAGE_TYPES
from shared.protocol_doc import DOC_PATH, LIMITS, generate

pytestmark = pytest.mark.unit


def test_reference_is_up_to_date() -> None:
    assert DOC_PATH.read_text(encoding="utf-8") == generate(), \
        "docs/protocol.md is stale: run `python -m shared.protocol_doc --write`"


def test_reference_names_every_type_and_field() -> None:
    text = generate()
    for name, cls in MESSAGE_TYPES.items():
        assert f"### `{name}`" in text, name
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"{name}.{f.name} missing from the reference"
    for name in LIMITS:
        assert f"| `{name}` |" in text


def test_a_new_field_changes_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table is read from the classes, not written by hand: a field added to a class appears."""
    import shared.protocol_doc as doc

    @dataclasses.dataclass
    class Probe:
        TYPE = "probe"
        DIRECTION = "client→verifier"
        request_id: int  # the request it names
        extra: int = 3  # a field only this test has

    monkeypatch.setitem(doc.MESSAGE_TYPES, "probe", Probe)
    text = doc.generate()
    assert "| `extra` | `int` | `3` | a field only this test has |" in text
    assert "| [`probe`](#probe) | client→verifier | `request_id` | `extra` | — |" in text
