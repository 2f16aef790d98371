"""The ``pipespec`` command's parsing, in one process: each model flag lands on the config keys of
runtime.cli.MODEL_FLAGS, conflicting flags are one error line with exit code 2, ``--set`` wins, relative model paths
are taken against the caller's directory, every subcommand's help names ``pipespec``, and pyproject.toml ships every
package and the data they read. No node starts here (tests/test_cli_install.py runs an installed copy end to end)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from drafter_node.spec import DrafterSpec
from drafter_node.types import drafter_specs
from runtime import cli
from runtime.config import DEFAULTS, ConfigError, type_keys
from shared.settings import setting
from testkit.fake_types import register_type

pytestmark = pytest.mark.unit
tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The transformers ``generate()`` arguments the issue names, each an alias or refused with a reason.
TRANSFORMERS_NAMES = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp",
                      "assistant_tokenizer", "assistant_ensemble_weight")


def config_of(*argv: str, command: str = "generate") -> dict:
    extra = ["--prompt", "hi"] if command == "generate" else []
    return cli.build_config(cli.parser().parse_args([command, *extra, *argv]), serve=command == "serve")


@pytest.fixture
def pair(tiny, tmp_path, monkeypatch):
    """A tiny target and drafter as folders ``t`` and ``d`` of the current directory (relative names)."""
    for name, folder in (("t", tiny("llama")), ("d", tiny("llama", "random"))):
        (tmp_path / name).symlink_to(folder, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_flag_names_declared_keys():
    known = {f"{s}.{k}" for s, keys in DEFAULTS.items() for k in keys} | {f"drafter.{k}" for k in type_keys()}
    for flag, spec in cli.MODEL_FLAGS.items():
        assert set(spec.keys) <= known, (flag, set(spec.keys) - known)
    assert {f"drafter.{s.block_length_key}" for s in drafter_specs() if s.block_length_key} <= known
    named = {spec.transformers for spec in cli.MODEL_FLAGS.values() if spec.transformers}
    refused = {flag.lstrip("-").replace("-", "_") for flag in cli.NOT_ALIASED}
    assert named | refused == set(TRANSFORMERS_NAMES) and not named & refused
    for flag, spec in cli.MODEL_FLAGS.items():
        if spec.transformers:  # an alias is named after the generate() argument it stands for
            assert flag == "--" + spec.transformers.replace("_", "-")


def test_flag_table_for_the_docs_names_every_flag():
    table = cli.flags_markdown()
    for flag in [*cli.MODEL_FLAGS, *cli.NOT_ALIASED]:
        assert f"| `{flag}" in table
    assert "`drafter.draft_schedule=constant`" in table and "`verifier.model=VALUE`" in table


def test_model_flags_map_onto_config_keys_and_relative_paths_resolve(pair):
    config = config_of("--model", "t", "--draft-model", "./d")
    assert config["verifier"]["model"] == str(pair / "t")  # absolute: the nodes run in another directory
    assert config["drafter"]["model"] == str(pair / "d")
    assert config["drafter"]["type"] == "assistant"
    assert config["drafter"]["draft_schedule"] == "cost"  # no k on the command line: the cost model chooses it
    served = config_of("--model", "t", "--draft-model", "d", "--port", "8123", command="serve")
    assert (served["http"]["host"], served["http"]["port"]) == ("127.0.0.1", 8123)
    assert config_of("--model", "t", "--draft-model", "d", "--port", "9", "--host", "::1",
                     command="serve")["http"]["host"] == "::1"
    assert config["http"]["host"] is None  # generate serves no HTTP


def test_num_draft_tokens_selects_the_constant_schedule_and_says_so(pair, capsys):
    config = config_of("--model", "t", "--draft-model", "d", "--num-draft-tokens", "4")
    assert (config["drafter"]["draft_schedule"], config["drafter"]["num_draft_tokens"]) == ("constant", 4)
    assert "fixed k = 4 (constant schedule): the cost model does not choose k" in capsys.readouterr().err
    lookup = config_of("--model", "t", "--draft-type", "prompt_lookup", "--num-draft-tokens", "3")
    assert lookup["drafter"]["prompt_lookup_num_tokens"] == 3  # prompt_lookup's block length is its own key
    suffix = config_of("--model", "t", "--draft-type", "suffix", "--num-draft-tokens", "5")
    assert (suffix["drafter"]["suffix_num_draft_tokens"], suffix["drafter"]["draft_schedule"]) == (5, "constant")
    alias = config_of("--model", "t", "--prompt-lookup-num-tokens", "7")
    keys = ("type", "prompt_lookup_num_tokens", "num_draft_tokens", "draft_schedule")
    assert [alias["drafter"][k] for k in keys] == ["prompt_lookup", 7, 7, "constant"]


def test_set_wins_over_the_model_flags(pair, capsys):
    config = config_of("--model", "t", "--draft-model", "d", "--num-draft-tokens", "4",
                       "--set", "drafter.num_draft_tokens=6", "--set", "verifier.model=d")
    assert config["drafter"]["num_draft_tokens"] == 6
    assert config["verifier"]["model"] == str(pair / "d")
    assert "fixed k = 6" in capsys.readouterr().err
    config = config_of("--model", "t", "--draft-model", "d", "--num-draft-tokens", "4",
                       "--set", "drafter.draft_schedule=cost")
    assert config["drafter"]["draft_schedule"] == "cost"
    assert "k starts at 4: --set drafter.draft_schedule=cost wins over --num-draft-tokens" in capsys.readouterr().err


def test_transformers_aliases(pair):
    assistant = config_of("--model", "t", "--assistant-model", "d")
    assert (assistant["drafter"]["type"], assistant["drafter"]["model"]) == ("assistant", str(pair / "d"))
    early = config_of("--model", "t", "--assistant-early-exit", "1")
    assert (early["drafter"]["type"], early["drafter"]["assistant_early_exit"]) == ("early_exit", 1)
    assert early["drafter"]["model"] == str(pair / "t")  # not cpu.yaml's drafter: early exit runs the target
    ensemble = config_of("--model", "t", "--draft-model", "d", "--assistant-ensemble-weight", "0.5")
    assert ensemble["verification"]["ensemble_weight"] == 0.5


@pytest.mark.parametrize(("argv", "message"), [
    (["--assistant-model", "d", "--draft-type", "prompt_lookup"],
     "--assistant-model sets drafter.type=assistant but --draft-type sets drafter.type=prompt_lookup: give one"),
    (["--use-mtp", "--assistant-early-exit", "1"], "--use-mtp sets drafter.type=mtp but --assistant-early-exit sets"),
    (["--num-draft-tokens", "4", "--prompt-lookup-num-tokens", "6"],
     "--prompt-lookup-num-tokens sets drafter.num_draft_tokens=6 but --num-draft-tokens sets"),
    (["--draft-model", "d", "--assistant-model", "t"], "--assistant-model sets drafter.model=t but --draft-model"),
    (["--draft-type", "prompt_lookup", "--draft-model", "d"], "--draft-model: drafter type prompt_lookup uses no"),
    (["--assistant-tokenizer", "d", "--draft-model", "d"], "--assistant-tokenizer: not supported"),
    (["--draft-model", "./missing"], "drafter.model: folder './missing' does not exist"),
    (["--model", "./missing", "--draft-model", "d"], "verifier.model: folder './missing' does not exist"),
])
def test_conflicts_are_one_line_and_exit_2(pair, capsys, argv, message):
    full = argv if "--model" in argv else ["--model", "t", *argv]
    assert cli.main(["generate", "--prompt", "hi", *full]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipespec: error: ") and message in err[0], err


def test_model_without_a_drafter_on_the_default_config_is_refused(pair):
    with pytest.raises(ConfigError, match="name the drafter too"):
        config_of("--model", "t")
    assert config_of("--model", "t", "--config", "cpu.yaml")["drafter"]["model"] == "qwen2.5-coder-0.5b-instruct"


def test_mtp_refuses_a_fixed_k(tokenizer_dir, tmp_path):
    from testkit.tiny_mtp import build_mtp_model

    target = build_mtp_model(tmp_path / "mtp", "deepseek_v3", tokenizer_dir)
    assert config_of("--model", str(target), "--use-mtp")["drafter"]["model"] == str(target)
    with pytest.raises(ConfigError, match=r"--num-draft-tokens: drafter\.type mtp: mtp drafts one token per MTP layer"):
        config_of("--model", str(target), "--use-mtp", "--num-draft-tokens", "3")


def test_draft_type_help_lists_every_registered_type_with_its_title(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    for spec in drafter_specs():
        assert f"{spec.name}: {spec.title}" in out, spec.name


@dataclass(frozen=True)
class ToySettings:
    toy_block: int = setting(4, "Tokens per toy block.", kind="int", bounds=(1, 64))


def test_num_draft_tokens_follows_the_types_spec(pair, monkeypatch, capsys):
    """A type's block length key and a fixed k are read off its spec: a new type needs no line in the CLI."""
    register_type(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy drafting", settings=ToySettings,
                                           needs_model=False, block_length_key="toy_block"))
    config = config_of("--model", "t", "--set", "drafter.type=toy", "--num-draft-tokens", "5")
    assert (config["drafter"]["toy_block"], config["drafter"]["num_draft_tokens"]) == (5, 5)
    assert config_of("--model", "t", "--set", "drafter.type=toy")["drafter"]["toy_block"] == 4
    assert "toy: also `drafter.toy_block=VALUE`" in cli.flags_markdown()
    with pytest.raises(ConfigError, match=r"--model: name the drafter too .*needs no draft model: [a-z_, ]*\btoy\b"):
        config_of("--model", "t")  # the types that need no draft model, toy among them
    register_type(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy drafting", needs_model=False,
                                           fixed_k="toy drafts a fixed block"))
    with pytest.raises(ConfigError, match=r"--num-draft-tokens: drafter\.type toy: toy drafts a fixed block, so k"):
        config_of("--model", "t", "--set", "drafter.type=toy", "--num-draft-tokens", "5")


@pytest.mark.parametrize("command", ["serve", "generate", "node", "models", "keys", "profile", "bench"])
def test_every_subcommand_help_says_pipespec(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert re.match(rf"usage: pipespec {command}\b", out), out[:200]
    assert "python -m runtime.launch" not in out


@pytest.mark.process
def test_top_level_help_and_launch_help_unchanged(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: pipespec") and all(c in out for c in ("serve", "generate", "node", "models",
                                                                        "keys", "profile", "bench"))
    proc = subprocess.run([sys.executable, "-m", "runtime.launch", "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m runtime.launch"), proc.stdout[:200]
    assert "--http HOST:PORT" in proc.stdout and "--role" in proc.stdout


@pytest.mark.process
def test_argparse_errors_exit_2_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--prompt", "x", "--draft-type", "nope"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "invalid choice: 'nope'" in proc.stderr


def test_pyproject_ships_every_package_and_its_data():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    assert project["project"]["scripts"]["pipespec"] == "runtime.cli:main"
    mapped = tool["package-dir"]
    assert mapped == {"runtime.configs": "configs", "benchmarks.prompt_files": "scripts/prompts"}
    not_packages = {"tests", "scripts", "docs", "results", "build", ".venv"}
    found = {
        ".".join(p.parent.relative_to(REPO_ROOT).parts)
        for p in REPO_ROOT.rglob("*.py")
        if p.relative_to(REPO_ROOT).parts[0] not in not_packages and len(p.relative_to(REPO_ROOT).parts) > 1
        and "__pycache__" not in p.parts
    }
    assert set(tool["packages"]) == found | set(mapped), set(tool["packages"]) ^ (found | set(mapped))
    data = tool["package-data"]
    assert data == {"runtime.configs": ["*.yaml"], "benchmarks.prompt_files": ["*.json", "LICENSE-*.txt"]}
    # the data the code reads from those folders (and the licenses of the vendored prompts) is all there is in them
    assert {p.suffix for p in (REPO_ROOT / "configs").iterdir()} == {".yaml"}
    prompts = [p.name for p in (REPO_ROOT / "scripts" / "prompts").iterdir()]
    shipped = data["benchmarks.prompt_files"]
    assert all(any(fnmatch.fnmatch(n, pattern) for pattern in shipped) for n in prompts), prompts
