"""The docs check, cheap part: every fenced block of README.md and docs/*.md has a marker, every shell command is
parsed by its real parser (configs built and validated), python blocks compile, yaml config fragments validate, and
relative links name files and headings that exist. The ``run`` blocks run in tests/test_docs_run.py (cluster)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import TIERS
from docs_check import (
    CHAT_JSON,
    CHECKED_LANGS,
    DOC_FILES,
    KINDS,
    NEEDS_REASON,
    ROOT,
    SHELL_LANGS,
    Block,
    all_blocks,
    anchors,
    chdir,
    checked_blocks,
    commands,
    compile_python,
    links,
    parse_command,
    parse_ray_start,
    ray_blocks,
    torch_pin,
)

pytestmark = pytest.mark.unit

BLOCKS = checked_blocks()
#: the markers each language may carry
ALLOWED = {**{lang: ("run", "parse-only", "ray") for lang in SHELL_LANGS}, "python": ("run", "compile-only"),
           "yaml": ("config", "ray")}


def test_the_check_sees_the_docs() -> None:
    """Guards the check itself: the files and blocks it walks are there (an empty walk would pass everything)."""
    assert ROOT / "README.md" in DOC_FILES and len(DOC_FILES) >= 12
    kinds = [b.kind for b in BLOCKS]
    assert kinds.count("run") >= 5 and kinds.count("parse-only") >= 10, kinds


def test_every_block_has_a_marker_and_a_reason() -> None:
    bad = []
    for b in BLOCKS:
        if b.kind not in KINDS:
            bad.append(f"{b.where}: ```{b.lang} block without a <!-- docs-check: KIND --> marker (kinds: {KINDS})")
        elif b.kind in NEEDS_REASON and not b.reason:
            bad.append(f"{b.where}: {b.kind} needs a reason")
        elif b.kind not in ALLOWED[b.lang]:
            bad.append(f"{b.where}: {b.kind} does not apply to a {b.lang} block (only {ALLOWED[b.lang]})")
    assert not bad, "\n".join(bad)


def test_unmarked_blocks_hold_no_commands() -> None:
    """A block in another language (a diagram, a file listing) must not hide a command the check would miss."""
    for b in all_blocks():
        if b.lang not in CHECKED_LANGS:
            assert not any(line.lstrip().startswith(("pipespec ", "python", ".venv/", "make ", "curl "))
                           for line in b.text.splitlines()), f"{b.where}: commands belong in a ```bash block"


def test_readme_starts_with_the_two_commands_ci_runs() -> None:
    """`make run` and `make test` come first, and .ci/run runs `make test-ci`: the README's test command and the ci
    tier, which the README's line names."""
    first = next(b for b in BLOCKS if b.path.name == "README.md")
    assert commands(first.text) == [["make", "run"], ["make", "test"]]
    assert "make test-ci" in first.text
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ci.splitlines()[-1] == "make test-ci"


def _selects(expression: str, tier: str) -> bool:
    """Whether pytest's ``-m`` expression (names joined by and / or / not) selects a test of ``tier`` alone."""
    return bool(eval(expression, {"__builtins__": {}}, {name: name == tier for name in TIERS}))


def test_ci_runs_every_tier_make_test_runs_and_the_ci_tier() -> None:
    """`make test` is pytest with pyproject.toml's addopts; `make test-ci` runs the same tiers and ci besides, in one
    session; `make test-fast` is the unit tier alone."""
    addopts = re.search(r"^addopts = \"-m '([^']+)'\"$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    makefile = (ROOT / "Makefile").read_text()
    targets = {name: recipe for name, recipe in re.findall(r"^([a-z-]+): setup\n\t([^\n]+)", makefile, re.M)}
    assert targets["test"] == "$(PY) -m pytest -q $(XDIST)"
    assert targets["test-fast"] == "$(PY) -m pytest -q $(XDIST) -m unit"
    test_ci = re.fullmatch(r"\$\(PY\) -m pytest -q \$\(XDIST\) -m '([^']+)'", targets["test-ci"]).group(1)
    in_test = {tier for tier in TIERS if _selects(addopts, tier)}
    assert in_test == {"unit", "process", "compile", "cluster", "statistical", "netns"}
    assert {tier for tier in TIERS if _selects(test_ci, tier)} == in_test | {"ci"}


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"


def test_docs_name_the_torch_the_makefile_installs() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"pip install {torch_pin()}" in text


@pytest.fixture(scope="module")
def models(tiny, tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny models placeholder paths stand for (docs/development.md, "Docs")."""
    from testkit.tiny_mtp import build_mtp_model

    mtp = build_mtp_model(tmp_path_factory.mktemp("mtp") / "deepseek", "deepseek_v3", tokenizer_dir)
    return {"target": tiny("llama"), "drafter": tiny("llama", "random"), "mtp": mtp}


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in SHELL_LANGS and b.kind in ("run", "parse-only")],
                         ids=lambda b: b.where)
def test_shell_block_parses(block: Block, models, tmp_path: Path) -> None:
    """Each command through its real parser; configs built by the real CLI and validated. Commands run in a
    temporary folder with the files the docs assume (chat.json), so `pipespec keys` writes there."""
    (tmp_path / "chat.json").write_text(json.dumps(CHAT_JSON), encoding="utf-8")
    cmds = commands(block.text.replace("/tmp/pipespec-keys", str(tmp_path / "keys")))
    assert cmds, f"{block.where}: a shell block without commands"
    with chdir(tmp_path):
        for tokens in cmds:
            try:
                parse_command(tokens, block, models)
            except BaseException as exc:
                raise AssertionError(f"{block.where}: `{' '.join(tokens)}`: {type(exc).__name__}: {exc}") from exc


@pytest.mark.parametrize("path", [p for p in DOC_FILES if ray_blocks(p)], ids=lambda p: p.name)
def test_ray_recipe_parses(path: Path, models, tmp_path: Path) -> None:
    """A Ray recipe (``ray`` blocks, run by the Ray tier): its config validates, its `ray start` lines name a head
    and hosts, its `pipespec` commands parse with that config saved as the file they name."""
    recipe = ray_blocks(path)
    configs = [yaml.safe_load(b.text) for b in recipe if b.lang == "yaml"]
    assert len(configs) == 1, f"{path.name}: a Ray recipe has one config block"
    from runtime.config import load_config

    assert load_config(configs[0])["launch"]["backend"] == "ray"
    starts, pipespec = [], []
    for block in (b for b in recipe if b.lang in SHELL_LANGS):
        for tokens in commands(block.text):
            (starts if tokens[0] == "ray" else pipespec).append((tokens, block))
    assert [parse_ray_start(t[1:])["head"] for t, _ in starts][:1] == [True], "the recipe starts a head first"
    config_files = {t[t.index("--config") + 1] for t, _ in pipespec if "--config" in t}
    assert len(config_files) == 1, config_files
    (tmp_path / config_files.pop()).write_text(yaml.safe_dump(configs[0]), encoding="utf-8")
    with chdir(tmp_path):
        for tokens, block in pipespec:
            parse_command(tokens, block, models)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_python_block_compiles(block: Block) -> None:
    compile_python(block)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "config"], ids=lambda b: b.where)
def test_config_fragment_validates(block: Block) -> None:
    from runtime.config import DEFAULT_CONFIG, find_config, load_config

    base = yaml.safe_load(find_config(DEFAULT_CONFIG).read_text(encoding="utf-8"))
    fragment = yaml.safe_load(block.text)
    assert isinstance(fragment, dict) and fragment
    for section, keys in fragment.items():
        base.setdefault(section, {}).update(keys)
    load_config(base)


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_links_name_files_and_headings_that_exist(path: Path) -> None:
    bad = []
    for link, target, anchor in links(path):
        if not target.exists():
            bad.append(f"{link}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not bad, f"{path.name}:\n" + "\n".join(bad)


def test_docs_use_no_lab_notebook_language() -> None:
    """A figure states its machine; a limit is stated as a limit (issue 19)."""
    phrases = ("the aim is not met", "the previous readme", "this cpu", "this vm", "not met",
               "the aim (", "today")
    found = [f"{p.name}: {phrase!r}" for p in DOC_FILES for phrase in phrases
             if phrase in p.read_text(encoding="utf-8").lower()]
    assert not found, found


def test_flags_the_readme_maps_to_exist() -> None:
    """Every pipespec flag in the README's "coming from" table is one the CLI accepts (or refuses by name)."""
    from runtime.cli import NOT_ALIASED, parser

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Coming from"):text.index("## Documentation")]
    known = {*NOT_ALIASED}
    for action in parser()._subparsers._group_actions[0].choices["serve"]._actions:  # the serve subcommand's flags
        known.update(action.option_strings)
    for action in parser()._subparsers._group_actions[0].choices["generate"]._actions:
        known.update(action.option_strings)
    rows = [line.split("|")[2] for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    used = {flag for cell in rows for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", cell)}
    assert used and not used - known, f"flags the CLI does not have: {sorted(used - known)}"
