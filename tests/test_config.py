"""Fast tests of runtime.config and the launcher's error path. No models are loaded or downloaded.

Every bad value must fail in validation, before any process starts, with a ConfigError that names the key.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from drafter_node.settings import DrafterConfig
from drafter_node.spec import DrafterSpec, positive_int
from drafter_node.types import DRAFTER_TYPES, drafter_class, drafter_spec
from runtime.config import (
    CONFIG_DIR,
    DEFAULTS,
    ConfigError,
    fill_run_dir,
    find_config,
    load_config,
    parse_overrides,
    typed,
)
from shared import named_models
from shared.protocol import MAX_DRAFT_TOKENS
from shared.settings import declared, setting
from testkit.fake_types import register_type
from weights import install

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
HUB_CONFIGS = {"mtp_drafter.yaml"}  # bundled configs that name hub ids (need hub access to run)


def _config_error(source: Any = "cpu.yaml", overrides: Any = None) -> str:
    """The message of the ConfigError load_config raises; fails the test (as a bug) on any other outcome."""
    try:
        config = load_config(source, overrides)
    except ConfigError as exc:
        return str(exc)
    except Exception as exc:
        pytest.fail(f"BUG: load_config raised {type(exc).__name__}: {exc} instead of ConfigError")
    pytest.fail(f"load_config accepted a bad config: {config!r:.300}")


@pytest.fixture(autouse=True)
def _no_downloads(monkeypatch):
    """Validation must never install, download or convert a model."""

    def forbidden(*args, **kwargs):
        raise AssertionError("load_config tried to fetch a model")

    monkeypatch.setattr(install, "ensure_model", forbidden)
    monkeypatch.setattr(install, "download_wheels", forbidden)


# ------------------------------------------------------------------------------------------ bundled configs


def test_bundled_configs_exist():
    assert {"cpu.yaml", "gpu.yaml", "multi_node.yaml", "two_gpu.yaml"} <= set(BUNDLED)


GPU_CONFIGS = {"gpu.yaml", "two_gpu.yaml", "mtp.yaml"}  # refused on a machine without GPUs (tested below)


@pytest.mark.parametrize("name", [n for n in BUNDLED if n not in GPU_CONFIGS])
def test_bundled_config_loads(name):
    config = load_config(name)
    assert set(config) == set(DEFAULTS)
    for section, keys in DEFAULTS.items():
        assert set(config[section]) == set(keys), section
    # Named offline models, or hub ids for models no registry package carries (Gemma 4 and its -assistant)
    assert config["verifier"]["model"] in named_models.NAMED_MODELS or name in HUB_CONFIGS
    if config["drafter"]["type"] not in ("prompt_lookup", "suffix"):  # the types without a drafter model
        assert config["drafter"]["model"] in named_models.NAMED_MODELS or name in HUB_CONFIGS
    assert config["verifier"]["device"] == "cpu"
    assert config["verifier"]["endpoint"] != config["client"]["endpoint"]


def test_default_config_is_cpu_yaml():
    assert load_config(None) == load_config("cpu.yaml") == load_config(CONFIG_DIR / "cpu.yaml")


def test_two_gpu_config_needs_two_gpus():
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        assert load_config("two_gpu.yaml")["drafter"]["device"] == "cuda:1"
        return
    message = _config_error("two_gpu.yaml")
    assert ("verifier.device" if gpus == 0 else "drafter.device") in message
    assert "cpu.yaml" in message


def test_gpu_config_puts_both_nodes_on_the_first_gpu():
    if torch.cuda.device_count() >= 1:
        config = load_config("gpu.yaml")
        assert config["verifier"]["device"] == config["drafter"]["device"] == "cuda:0"
        return
    message = _config_error("gpu.yaml")
    assert "verifier.device" in message and "cpu.yaml" in message


def test_mtp_config_reads_the_targets_own_checkpoint():
    if torch.cuda.device_count() == 0:
        assert "verifier.device" in _config_error("mtp.yaml")
        return
    config = load_config("mtp.yaml")
    assert config["drafter"]["type"] == "mtp"
    assert config["drafter"]["model"] == config["verifier"]["model"]


# ------------------------------------------------------------------------------------------ finding files


def test_bare_name_is_looked_up_in_configs_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config("cpu.yaml") == CONFIG_DIR / "cpu.yaml"
    assert load_config("multi_node.yaml")["verifier"]["endpoint"] == "tcp://127.0.0.1:5555"


def test_explicit_path_is_used_as_given(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((CONFIG_DIR / "cpu.yaml").read_text().replace("num_draft_tokens: 5", "num_draft_tokens: 9"))
    assert find_config(str(path)) == path
    assert load_config(path)["drafter"]["num_draft_tokens"] == 9


@pytest.mark.parametrize("name", ["nope.yaml", "configs/nope.yaml", "/nonexistent/cpu.yaml"])
def test_missing_file_lists_bundled_configs(name):
    with pytest.raises(ConfigError) as info:
        find_config(name)
    message = str(info.value)
    assert name in message
    for bundled in BUNDLED:
        assert bundled in message
    assert name in _config_error(name)


def test_invalid_yaml_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("verifier:\n  model: [unclosed\n  device: cpu\n")
    message = _config_error(path)
    assert "not valid YAML" in message and "broken.yaml" in message


@pytest.mark.parametrize("text", ["- verifier\n- drafter\n", "just a string\n", "42\n"])
def test_yaml_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    assert "mapping" in _config_error(path)


def test_empty_yaml_file_means_all_defaults_then_names_the_missing_model(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert "verifier.model" in _config_error(path)


def test_config_path_that_is_a_directory(tmp_path):
    """config.py:89 reads the file without catching OSError: `--config /some/dir` ends in a traceback."""
    _config_error(tmp_path)


def test_config_file_that_is_not_utf8(tmp_path):
    """config.py:89: a non-UTF-8 file raises UnicodeDecodeError instead of ConfigError."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("verifier:\n  model: caf\xe9\n".encode("latin-1"))
    _config_error(path)


# ------------------------------------------------------------------------------------------ errors name the key

BAD: list[tuple[str, Any, Any, str]] = [
    # (id, source, overrides, key the error must name)
    ("unknown section", {"verifyer": {"model": "x"}}, None, "verifyer"),
    ("unknown section via --set", "cpu.yaml", ["verifyer.model=x"], "verifyer"),
    ("section not a mapping", {"drafter": 5}, None, "drafter"),
    ("unknown key", {"drafter": {"colour": "red"}}, None, "drafter.colour"),
    ("unknown key via --set", "cpu.yaml", ["drafter.colour=red"], "drafter.colour"),
    ("unknown key via dict override", "cpu.yaml", {"drafter.colour": "red"}, "drafter.colour"),
    ("unknown drafter type", "cpu.yaml", {"drafter.type": "eagle9"}, "drafter.type"),
    ("missing verifier model", "cpu.yaml", {"verifier.model": None}, "verifier.model"),
    ("empty verifier model", "cpu.yaml", {"verifier.model": ""}, "verifier.model"),
    ("verifier model not a string", "cpu.yaml", {"verifier.model": 5}, "verifier.model"),
    ("missing drafter model", "cpu.yaml", {"drafter.model": None}, "drafter.model"),
    ("drafter model folder missing", "cpu.yaml", {"drafter.model": "./nope"}, "drafter.model"),
    ("absolute model folder missing", "cpu.yaml", {"verifier.model": "/nonexistent/model"}, "verifier.model"),
    ("not a model name", "cpu.yaml", {"verifier.model": "not a model!"}, "verifier.model"),
    ("bad device", "cpu.yaml", {"verifier.device": "gpu"}, "verifier.device"),
    ("bad drafter device", "cpu.yaml", {"drafter.device": "cuda:x"}, "drafter.device"),
    ("device not a string", "cpu.yaml", {"verifier.device": 0}, "verifier.device"),
    ("cuda device beyond count", "cpu.yaml", {"verifier.device": "cuda:64"}, "verifier.device"),
    ("bad verifier dtype", "cpu.yaml", {"verifier.dtype": "int8"}, "verifier.dtype"),
    ("bad drafter dtype", "cpu.yaml", {"drafter.dtype": "float64"}, "drafter.dtype"),
    ("threads 0", "cpu.yaml", {"verifier.threads": 0}, "verifier.threads"),
    ("threads string", "cpu.yaml", {"verifier.threads": "two"}, "verifier.threads"),
    ("threads bool", "cpu.yaml", {"drafter.threads": True}, "drafter.threads"),
    ("threads float", "cpu.yaml", {"drafter.threads": 1.5}, "drafter.threads"),
    ("num_draft_tokens 0", "cpu.yaml", {"drafter.num_draft_tokens": 0}, "drafter.num_draft_tokens"),
    ("num_draft_tokens 65", "cpu.yaml", {"drafter.num_draft_tokens": 65}, "drafter.num_draft_tokens"),
    ("num_draft_tokens -3", "cpu.yaml", ["drafter.num_draft_tokens=-3"], "drafter.num_draft_tokens"),
    ("max_draft_tokens 0", "cpu.yaml", {"drafter.max_draft_tokens": 0}, "drafter.max_draft_tokens"),
    ("q_top_k negative", "cpu.yaml", {"drafter.q_top_k": -1}, "drafter.q_top_k"),
    ("max_sessions 0", "cpu.yaml", {"verifier.max_sessions": 0}, "verifier.max_sessions"),
    ("max_message_bytes 0", "cpu.yaml", {"verifier.max_message_bytes": 0}, "verifier.max_message_bytes"),
    ("draft_timeout_ms string", "cpu.yaml", {"verifier.draft_timeout_ms": "1s"}, "verifier.draft_timeout_ms"),
    ("bad draft_schedule", "cpu.yaml", {"drafter.draft_schedule": "fastest"}, "drafter.draft_schedule"),
    ("overlap string", "cpu.yaml", {"drafter.overlap": "yes"}, "drafter.overlap"),
    ("overlap int", "cpu.yaml", {"drafter.overlap": 1}, "drafter.overlap"),
    ("tree string", "cpu.yaml", {"drafter.tree": "yes"}, "drafter.tree"),
    ("allow_remote string", "cpu.yaml", {"verifier.allow_remote": "no"}, "verifier.allow_remote"),
    ("start_drafter None", "cpu.yaml", {"launch.start_drafter": None}, "launch.start_drafter"),
    ("ensemble_weight zero", "cpu.yaml", ["verification.ensemble_weight=0"], "verification.ensemble_weight"),
    ("ensemble_weight one", "cpu.yaml", {"verification.ensemble_weight": 1}, "verification.ensemble_weight"),
    ("ensemble_weight above one", "cpu.yaml", {"verification.ensemble_weight": 1.5}, "verification.ensemble_weight"),
    ("ensemble_weight negative", "cpu.yaml", ["verification.ensemble_weight=-0.2"], "verification.ensemble_weight"),
    ("ensemble_weight string", "cpu.yaml", {"verification.ensemble_weight": "0.7"}, "verification.ensemble_weight"),
    ("ensemble_weight bool", "cpu.yaml", {"verification.ensemble_weight": True}, "verification.ensemble_weight"),
    ("ensemble_weight nan", "cpu.yaml", ["verification.ensemble_weight=.nan"], "verification.ensemble_weight"),
    ("ensemble with prompt lookup", "prompt_lookup.yaml", {"verification.ensemble_weight": 0.7},
     "verification.ensemble_weight"),
    ("malformed verifier endpoint", "cpu.yaml", {"verifier.endpoint": "localhost:5555"}, "verifier.endpoint"),
    ("verifier endpoint None", "cpu.yaml", {"verifier.endpoint": None}, "verifier.endpoint"),
    ("client endpoint without port", "cpu.yaml", {"client.endpoint": "tcp://127.0.0.1"}, "client.endpoint"),
    ("drafter endpoint http", "cpu.yaml", {"drafter.verifier_endpoint": "http://x:1"}, "drafter.verifier_endpoint"),
    ("client endpoint equals verifier endpoint", "cpu.yaml",
     {"client.endpoint": "ipc://{run_dir}/verifier.ipc"}, "client.endpoint"),
    ("ready_timeout_s 0", "cpu.yaml", {"launch.ready_timeout_s": 0}, "launch.ready_timeout_s"),
    ("ready_timeout_s None", "cpu.yaml", {"launch.ready_timeout_s": None}, "launch.ready_timeout_s"),
    ("drafters 0", "cpu.yaml", {"launch.drafters": 0}, "launch.drafters"),
    ("drafters 17", "cpu.yaml", {"launch.drafters": 17}, "launch.drafters"),
    ("drafters string", "cpu.yaml", ["launch.drafters=two"], "launch.drafters"),
    ("client heartbeat_timeout_s 0", "cpu.yaml", {"client.heartbeat_timeout_s": 0}, "client.heartbeat_timeout_s"),
    ("client heartbeat_timeout_s below a ping period", "cpu.yaml", {"client.heartbeat_timeout_s": 0.4},
     "client.heartbeat_timeout_s"),
    ("client heartbeat_timeout_s string", "cpu.yaml", {"client.heartbeat_timeout_s": "5"},
     "client.heartbeat_timeout_s"),
]


@pytest.mark.parametrize(("source", "overrides", "key"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_error_names_the_key(source, overrides, key):
    assert key in _config_error(source, overrides)


def test_two_gpu_device_error_points_at_cpu_yaml():
    message = _config_error("cpu.yaml", {"drafter.device": "cuda:64"})
    assert "drafter.device" in message and "cpu.yaml" in message


def test_model_folder_without_config_json(tmp_path):
    message = _config_error("cpu.yaml", {"drafter.model": str(tmp_path)})
    assert "drafter.model" in message and "config.json" in message


def test_model_folder_with_config_json_and_hub_ids_are_accepted(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    config = load_config("cpu.yaml", {"drafter.model": str(tmp_path), "verifier.model": "SomeOrg/some-model_1.5B"})
    assert config["drafter"]["model"] == str(tmp_path)


@pytest.mark.parametrize("value", [1, 64])
def test_num_draft_tokens_bounds_are_inclusive(value):
    assert load_config("cpu.yaml", {"drafter.num_draft_tokens": value})["drafter"]["num_draft_tokens"] == value


def test_dict_source_is_not_mutated():
    source = {"verifier": {"model": "qwen2.5-coder-1.5b-instruct"}, "drafter": {"model": "qwen2.5-coder-0.5b-instruct"}}
    snapshot = repr(source)
    config = load_config(source, {"drafter.num_draft_tokens": 3})
    assert repr(source) == snapshot
    assert config["drafter"]["num_draft_tokens"] == 3
    assert config["verifier"]["threads"] == DEFAULTS["verifier"]["threads"]
    config["verifier"]["threads"] = 99
    assert DEFAULTS["verifier"]["threads"] == "auto"  # defaults are copied, not shared


# ---------------------------------------------------------------------------------- bugs: non-ConfigError escapes


@pytest.mark.parametrize(
    "overrides",
    [{"verifier.dtype": ["bfloat16"]}, {"drafter.dtype": {}}, {"drafter.type": ["assistant"]}],
    ids=["verifier.dtype-list", "drafter.dtype-map", "drafter.type-list"],
)
def test_unhashable_values_give_config_error(overrides):
    """config.py:187 (`d["type"] not in DRAFTER_TYPES`) and :194 (`not in DTYPES`) raise TypeError on a list/map."""
    (key,) = overrides
    assert key in _config_error("cpu.yaml", overrides)


def test_ready_timeout_string_gives_config_error():
    """config.py:224 compares with `<= 0` unchecked: `--set launch.ready_timeout_s=soon` raises TypeError."""
    assert "launch.ready_timeout_s" in _config_error("cpu.yaml", ["launch.ready_timeout_s=soon"])


@pytest.mark.parametrize("value", [-5, 0, "soon", True], ids=repr)
def test_client_timeout_is_validated(value):
    """validate() never checks client.timeout_s; a bad one only fails later, inside the client."""
    assert "client.timeout_s" in _config_error("cpu.yaml", {"client.timeout_s": value})


# ------------------------------------------------------------------------------------------------ --set overrides


def test_set_list_form_parses_yaml_values():
    config = load_config("cpu.yaml", ["drafter.overlap=false", "drafter.num_draft_tokens=7"])
    assert config["drafter"]["overlap"] is False
    assert config["drafter"]["num_draft_tokens"] == 7 and isinstance(config["drafter"]["num_draft_tokens"], int)


def test_parse_overrides_values():
    assert parse_overrides(
        [
            "drafter.overlap=true",
            "verifier.threads= 3 ",
            "verifier.model=org/name",
            "drafter.max_memory=",
            "client.endpoint=ipc:///tmp/a=b.ipc",
            " drafter.type =assistant",
        ]
    ) == {
        "drafter.overlap": True,
        "verifier.threads": 3,
        "verifier.model": "org/name",
        "drafter.max_memory": None,
        "client.endpoint": "ipc:///tmp/a=b.ipc",
        "drafter.type": "assistant",
    }
    assert parse_overrides(None) == {} == parse_overrides([]) == parse_overrides({})


@pytest.mark.parametrize("item", ["novalue", "=5", ""])
def test_set_without_key_value_is_an_error(item):
    message = _config_error("cpu.yaml", [item])
    assert "--set" in message and repr(item) in message


def test_set_dict_form():
    config = load_config("cpu.yaml", {"drafter.overlap": False, "drafter.num_draft_tokens": 7, "verifier.threads": 2})
    assert (config["drafter"]["overlap"], config["drafter"]["num_draft_tokens"], config["verifier"]["threads"]) == (
        False,
        7,
        2,
    )


def test_overrides_win_over_the_file_and_are_validated():
    assert load_config("cpu.yaml")["drafter"]["num_draft_tokens"] == 5
    assert load_config("cpu.yaml", ["drafter.num_draft_tokens=9"])["drafter"]["num_draft_tokens"] == 9
    assert "drafter.num_draft_tokens" in _config_error("cpu.yaml", ["drafter.num_draft_tokens=100"])


# ------------------------------------------------------------------------------------------------ fill_run_dir


def test_fill_run_dir_replaces_placeholder_in_every_endpoint():
    config = load_config("cpu.yaml", {"drafter.verifier_endpoint": "ipc://{run_dir}/verifier.ipc"})
    filled = fill_run_dir(config, "/tmp/run-1")
    assert filled["verifier"]["endpoint"] == "ipc:///tmp/run-1/verifier.ipc"
    assert filled["client"]["endpoint"] == "ipc:///tmp/run-1/client.ipc"
    assert filled["drafter"]["verifier_endpoint"] == "ipc:///tmp/run-1/verifier.ipc"
    assert config["verifier"]["endpoint"] == "ipc://{run_dir}/verifier.ipc"  # the input is not changed
    assert "{run_dir}" not in repr(filled)


def test_fill_run_dir_leaves_tcp_and_unset_endpoints_alone():
    config = load_config("multi_node.yaml")
    filled = fill_run_dir(config, "/tmp/run-2")
    assert filled == config
    assert fill_run_dir(load_config("cpu.yaml"), "/x")["drafter"]["verifier_endpoint"] is None


# ---------------------------------------------------------------------------------------------------------- CLI


def test_cli_main_returns_2_on_config_error(capsys):
    from runtime.launch import main

    assert main(["--config", "cpu.yaml", "--set", "drafter.type=nope", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipespec: error: ") and "drafter.type" in err


@pytest.mark.process
def test_cli_subprocess_config_error_is_one_line_and_exit_2():
    start = time.monotonic()
    argv = ["--config", "cpu.yaml", "--set", "drafter.type=nope", "--prompt", "hi"]
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.launch", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pipespec: error: ") and "drafter.type" in lines[0]
    assert proc.stdout == ""
    assert elapsed < 60, f"a config error took {elapsed:.1f} s to report"


# ------------------------------------------------------------------------------------------------ drafter types


_register = register_type


def test_a_new_drafter_type_is_one_spec_and_one_registry_line(monkeypatch, tmp_path):
    checked: list[Any] = []
    looked_up: list[Any] = []

    def check(config):
        checked.append(config["drafter"]["toy_width"])
        positive_int(config, "toy_width")

    def check_model(config, local):
        looked_up.append(local(config["drafter"]["model"]))
        if config["drafter"]["toy_width"] > 100:
            raise ValueError(f"drafter.toy_width: at most 100 for this model, got {config['drafter']['toy_width']}")

    class ToyDrafter:
        pass

    spec = DrafterSpec(name="toy", cls="toy_type_toy:ToyDrafter", title="toy drafting",
                       keys={"toy_width": 3, "max_matching_ngram_size": 5}, sends_q=False,
                       check=check, check_model=check_model,
                       profile_variant=lambda settings, own: f"toy:{own['toy_width']}")
    _register(monkeypatch, spec, ToyDrafter=ToyDrafter)
    (tmp_path / "config.json").write_text("{}")
    toy = {"drafter.type": "toy", "drafter.model": str(tmp_path)}

    config = load_config("cpu.yaml", toy)
    d = config["drafter"]
    assert d["toy_width"] == 3 and checked == [3] and looked_up == [tmp_path]
    assert d["max_matching_ngram_size"] == 5  # a key two types declare: the configured type's default
    assert d["prompt_lookup_num_tokens"] == 10  # every other type's keys are present, at their defaults
    sections = typed(config)
    assert drafter_spec("toy").profile_variant(sections.drafter, sections.drafter_type) == "toy:3"
    assert drafter_class("toy") is ToyDrafter
    own = sections.drafter_type  # a type declared with keys=: its own keys, read-only, and they pickle
    assert dict(own) == {"toy_width": 3, "max_matching_ngram_size": 5} and pickle.loads(pickle.dumps(own)) == own
    with pytest.raises(TypeError):
        own["toy_width"] = 4  # type: ignore[index]
    assert load_config("cpu.yaml", {**toy, "drafter.toy_width": 7})["drafter"]["toy_width"] == 7
    assert checked == [3, 7] and looked_up == [tmp_path, tmp_path]
    message = _config_error("cpu.yaml", {**toy, "drafter.toy_width": 0})  # the check hook's error, as ConfigError
    assert message.startswith("drafter.toy_width: must be an integer ≥ 1, got 0")
    assert "drafter.toy_width: at most 100" in _config_error("cpu.yaml", {**toy, "drafter.toy_width": 101})
    message = _config_error("cpu.yaml", {**toy, "verification.ensemble_weight": 0.5})  # sends_q=False
    assert "verification.ensemble_weight" in message and "toy drafting (drafter.type: toy)" in message
    assert "drafter.model" in _config_error("cpu.yaml", {**toy, "drafter.model": None})  # needs_model (default)
    assert "toy" in _config_error("cpu.yaml", {"drafter.type": "nope"})  # listed among the known types

    calls = len(checked), len(looked_up)
    other = load_config("cpu.yaml")["drafter"]  # the key exists under every type, at its default
    assert other["toy_width"] == 3 and other["max_matching_ngram_size"] == 2  # the first declaring type's default
    assert load_config("cpu.yaml", {"drafter.toy_width": 0})["drafter"]["toy_width"] == 0  # checked only for toy
    assert (len(checked), len(looked_up)) == calls  # the hooks run for their own type only


def test_a_spec_that_does_not_match_its_registry_line_is_refused(monkeypatch):
    _register(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy"))
    monkeypatch.setitem(DRAFTER_TYPES, "other_toy", "toy_type_toy")
    with pytest.raises(TypeError, match="other_toy"):
        drafter_spec("other_toy")
    monkeypatch.delitem(DRAFTER_TYPES, "other_toy")
    with pytest.raises(ValueError, match="module:Class"):
        DrafterSpec(name="toy", cls="no_class", title="toy")
    _register(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy", keys={"num_draft_tokens": 1}))
    with pytest.raises(TypeError, match=r"drafter\.num_draft_tokens"):
        load_config("cpu.yaml")


def test_every_registered_type_declares_a_consistent_spec():
    for name in DRAFTER_TYPES:
        spec = drafter_spec(name)
        assert spec.name == name and drafter_class(name).type_name == name
        assert not set(spec.keys) & {"type", "model", "target_model", "q_top_k", "num_draft_tokens"}
        assert spec.needs_model or not spec.model_defaults_to_target
        assert DEFAULTS["drafter"].keys() >= spec.keys.keys()
    early_exit = drafter_spec("early_exit")
    own = early_exit.settings(assistant_early_exit=8)
    assert early_exit.profile_variant(DrafterConfig(type="early_exit"), own) == "early_exit:8"
    assert all(drafter_spec(name).profile_variant(DrafterConfig(type=name), drafter_spec(name).own_settings({}))
               == "" for name in DRAFTER_TYPES if name != "early_exit")  # own_settings({}): the defaults
    assert [name for name in DRAFTER_TYPES if not drafter_spec(name).sends_q] == ["prompt_lookup", "suffix"]
    assert [name for name in DRAFTER_TYPES if not drafter_spec(name).needs_model] == ["prompt_lookup", "suffix"]


def test_config_module_names_no_drafter_type():
    """runtime/config.py learns every type from its spec: no type name appears in it, not even in a comment."""
    import runtime.config

    text = Path(runtime.config.__file__).read_text(encoding="utf-8").lower()
    names = {*DRAFTER_TYPES, "assistant", "early_exit", "early exit", "prompt_lookup", "prompt lookup", "mtp", "suffix",
             "universal"}
    assert [name for name in sorted(names) if name in text] == []


@pytest.mark.process
def test_loading_a_config_imports_no_model_code():
    """The config loader imports every type's spec module, never a type's implementation or transformers (slow to
    import: the type modules pull it in through drafter_node.base)."""
    heavy = sorted({drafter_spec(name).cls.partition(":")[0] for name in DRAFTER_TYPES} | {"drafter_node.base"})
    code = ("import sys, runtime.config as c; c.load_config('cpu.yaml'); c.load_config('prompt_lookup.yaml'); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or m in {heavy!r}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", "a drafter spec module imports model code at module scope"


def test_prompt_lookup_blocks_are_bounded_by_what_the_verifier_takes():
    """A block longer than the verifier's 64-token limit would pass the config and have every draft refused."""
    from shared.protocol import MAX_DRAFT_TOKENS

    assert load_config("prompt_lookup.yaml", {"drafter.prompt_lookup_num_tokens": MAX_DRAFT_TOKENS})
    with pytest.raises(ConfigError, match=r"drafter.prompt_lookup_num_tokens: must be an integer in \[1, 64\]"):
        load_config("prompt_lookup.yaml", {"drafter.prompt_lookup_num_tokens": MAX_DRAFT_TOKENS + 1})


def test_a_secret_is_refused_on_the_command_line():
    """``--set http.api_key=…`` would put the key in argv, which ``ps`` shows to every user of the host."""
    with pytest.raises(ConfigError, match=r"PIPESPEC_HTTP_API_KEY"):
        parse_overrides(["http.api_key=0123456789abcdef0123"])
    assert parse_overrides({"http.api_key": "0123456789abcdef0123"}) == {"http.api_key": "0123456789abcdef0123"}
    assert parse_overrides(["http.api_key="]) == {"http.api_key": None}  # unsetting it reveals nothing


def test_a_type_that_needs_a_missing_package_says_what_to_install(monkeypatch):
    """``requires``: looked up when a config of the type loads; a missing package is a config error naming it."""
    install = "make setup-nothing (pip install 'pipespec[nothing]')"
    _register(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy drafting", needs_model=False,
                                       requires=(("yaml", "pip install pyyaml"),
                                                 ("pipespec_no_such_module_x", install))))
    message = _config_error("cpu.yaml", {"drafter.type": "toy"})
    assert message.startswith("drafter.type: toy") and "'pipespec_no_such_module_x'" in message
    assert message.endswith(install) and "yaml" not in message.replace(install, "")
    _register(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy drafting", needs_model=False,
                                       requires=(("pipespec_no_such_module_x.sub", install),)))
    assert _config_error("cpu.yaml", {"drafter.type": "toy"}).startswith("drafter.type: toy")  # dotted: no crash
    _register(monkeypatch, DrafterSpec(name="toy", cls="x:Y", title="toy drafting", needs_model=False,
                                       requires=(("yaml", "pip install pyyaml"),)))
    assert load_config("cpu.yaml", {"drafter.type": "toy"})["drafter"]["type"] == "toy"  # installed: loads
    # another type's requirement is not checked
    assert load_config("cpu.yaml", {"drafter.type": "assistant"})["drafter"]["type"] == "assistant"
    with pytest.raises(ValueError, match="requires"):
        DrafterSpec(name="toy", cls="x:Y", title="toy", requires=(("llama_cpp",),))  # type: ignore[arg-type]


@pytest.mark.parametrize("bounds, kind, error", [
    ((1, None), "int", "upper bound"),  # unbounded: a block over the verifier's largest is refused mid-request
    ((1, MAX_DRAFT_TOKENS + 1), "int", "upper bound"),
    ((1, 8), "number", "kind='int'"),
    ((1, MAX_DRAFT_TOKENS), "int", None),
])
def test_a_block_length_key_is_capped_at_the_verifiers_largest_block(bounds, kind, error):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ToySettings:
        toy_block: int = setting(4, "Tokens per block.", kind=kind, bounds=bounds)

    make = lambda key="toy_block": DrafterSpec(name="toy", cls="x:Y", title="toy", settings=ToySettings,  # noqa: E731
                                               block_length_key=key)
    if error is None:
        assert make().block_length_key == "toy_block"
    else:
        with pytest.raises(ValueError, match=error):
            make()
    with pytest.raises(ValueError, match="not one of its declared settings"):
        make("toy_width")


def test_every_registered_block_length_key_is_capped():
    keyed = {}
    for name in DRAFTER_TYPES:
        spec = drafter_spec(name)
        if spec.block_length_key is not None:
            meta = {key: m for key, _, m in declared(spec.settings)}[spec.block_length_key]
            keyed[name] = meta.bounds[1]
            assert meta.kind == "int" and meta.bounds[1] <= MAX_DRAFT_TOKENS
        assert spec.fixed_k is None or spec.block_length_key is None
    assert keyed == {"prompt_lookup": MAX_DRAFT_TOKENS, "suffix": MAX_DRAFT_TOKENS}
    assert [name for name in DRAFTER_TYPES if drafter_spec(name).fixed_k] == ["mtp"]


def test_a_type_hook_returns_what_it_normalised_and_cannot_change_the_config(monkeypatch, tmp_path):
    """A spec's ``check`` sees a read-only view; the keys it returns are what the loader sets (e.g. a path made
    absolute), and a hook that tries to write is a bug said as such, not a silent change."""
    (tmp_path / "config.json").write_text("{}")

    def normalise(config):
        return {"toy_path": str(Path(config["drafter"]["toy_path"]).expanduser().resolve())}

    def writes(config):
        config["drafter"]["toy_path"] = "elsewhere"
        return {}

    spec = DrafterSpec(name="toy", cls="toy_type_toy:ToyDrafter", title="toy drafting", sends_q=False,
                       keys={"toy_path": "."}, check=normalise)
    _register(monkeypatch, spec)
    toy = {"drafter.type": "toy", "drafter.model": str(tmp_path)}
    monkeypatch.chdir(tmp_path)
    assert load_config("cpu.yaml", toy)["drafter"]["toy_path"] == str(tmp_path.resolve())
    _register(monkeypatch, DrafterSpec(name="toy", cls="toy_type_toy:ToyDrafter", title="toy drafting",
                                       sends_q=False, keys={"toy_path": "."}, check=writes))
    with pytest.raises(TypeError):
        load_config("cpu.yaml", toy)


def test_the_gguf_check_returns_the_absolute_path(tmp_path, monkeypatch):
    import struct

    from drafter_node.type_specs.gguf import SPEC

    arch = b"general.architecture"  # the smallest header the bounded reader passes: one key, no tensors
    (tmp_path / "d.gguf").write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(arch)) + arch
                                      + struct.pack("<IQ", 8, 5) + b"llama")
    monkeypatch.chdir(tmp_path)
    view = {"drafter": {"model": "d.gguf", "device": "cpu"}}
    assert SPEC.check(view) == {"model": str(tmp_path / "d.gguf")}
    assert view["drafter"]["model"] == "d.gguf"  # the view it read is untouched
    named = next(iter(named_models.NAMED_MODELS))
    assert SPEC.check({"drafter": {"model": named, "device": "cpu"}}) == {}  # a named model stays a name
