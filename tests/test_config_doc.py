"""docs/configuration.md and the generated tables of other docs (the drafter types, the model flags) are what
runtime.config_doc generates from the declarations; the reference names every key."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from drafter_node.spec import DrafterSpec
from drafter_node.types import drafter_specs
from runtime import config_doc
from runtime.config import DEFAULTS
from runtime.config_doc import BLOCKS, DOC_PATH, ROOT, block_text, generate
from shared.settings import setting
from testkit.fake_types import register_type

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


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_generated_tables_are_up_to_date(name: str) -> None:
    file, make = BLOCKS[name]
    committed = block_text(name, (ROOT / file).read_text(encoding="utf-8"))
    assert committed is not None, f"{file} lost its generated {name} table (markers: runtime/config_doc.py)"
    assert committed == make(), f"{file}'s {name} table is stale: run `python -m runtime.config_doc --write`"


@dataclass(frozen=True)
class ToySettings:
    toy_block: int = setting(4, "Tokens per toy block.", kind="int", bounds=(1, 32))
    toy_width: int = setting(2, "Width.", kind="int", bounds=(1, None))


def test_a_new_type_is_in_every_drafter_table(monkeypatch) -> None:
    register_type(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy drafting", settings=ToySettings,
                                           needs_model=False, sends_q=False, block_length_key="toy_block",
                                           transformers="`toy=K`", drafts_with="toys", holds="a | toy"))
    row = next(line for line in config_doc.drafter_types_table().splitlines() if line.startswith("| `toy`"))
    assert row == ("| `toy` (toy drafting) | `toy=K` | a \\| toy | none | no (one-hot drafts) | `toy_block` [1, 32] "
                   "| `toy_block`, `toy_width` |  |")
    assert "| `toy` | toys | `toy=K` |" in config_doc.readme_types_table()
    assert "toy: also `drafter.toy_block=VALUE`" in config_doc.BLOCKS["model-flags"][1]()


def test_refresh_rewrites_only_the_table(tmp_path, monkeypatch) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- generated: t (python -m runtime.config_doc --write) -->\nold\n"
                   "<!-- end generated: t -->\nafter\n", encoding="utf-8")
    monkeypatch.setattr(config_doc, "ROOT", tmp_path)
    monkeypatch.setitem(BLOCKS, "t", ("doc.md", lambda: "| new |"))
    config_doc.refresh("t")
    assert doc.read_text(encoding="utf-8") == ("intro\n<!-- generated: t (python -m runtime.config_doc --write) -->\n"
                                               "| new |\n<!-- end generated: t -->\nafter\n")
    doc.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="generated: t"):
        config_doc.refresh("t")
