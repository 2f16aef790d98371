"""The typed config: setting() declarations, bounds, frozen sections and typed(load_config(...)) round-trips."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest

from drafter_node.types import drafter_spec, drafter_specs
from runtime.config import CONFIG_DIR, DEFAULTS, DRAFTER_COMMON, ConfigError, load_config, typed
from runtime.config_schema import SECTIONS, Config, DrafterConfig, HttpConfig
from shared.settings import Setting, declared, defaults, setting, violation

pytestmark = pytest.mark.unit


def test_setting_carries_doc_and_bounds() -> None:
    @dataclasses.dataclass(frozen=True)
    class Toy:
        width: int = setting(3, "How wide.", kind="int", bounds=(1, 10))

    ((name, default, meta),) = declared(Toy)
    assert (name, default) == ("width", 3)
    assert meta == Setting("How wide.", "int", (1, 10), None, False, ())
    assert defaults(Toy) == {"width": 3}


def test_bounds_kinds_and_choices_are_enforced() -> None:
    meta = Setting("x", "int", (1, 10))
    assert violation(meta, 1) is None and violation(meta, 10) is None
    for bad in (0, 11, 2.5, True, "3", None):  # the phrase states the kind and the bounds
        assert violation(meta, bad) == "must be an integer in [1, 10]", bad
    assert violation(Setting("x", "bool"), 1) == "must be true or false"
    assert violation(Setting("x", "str", choices=("a", "b")), "c") == "must be one of a, b"
    assert violation(Setting("x", "int", (1, None), also=("auto",)), "auto") is None
    assert violation(Setting("x", "number", nullable=True), None) is None


def test_open_bounds_nan_and_extra_values_in_violation() -> None:
    weight = Setting("w", "number", (0, 1), open_low=True, open_high=True)
    assert violation(weight, 0.5) is None
    for bad in (0, 1, 1.5, -0.1, math.nan, math.inf, "0.5", True):
        assert violation(weight, bad) == "must be a number in the open interval (0, 1)", bad
    timeout = Setting("t", "number", (0, None), open_low=True, unit="seconds")
    assert violation(timeout, math.nan) == "must be a number of seconds > 0"  # nan passes every comparison
    threads = Setting("n", "int", (1, None), also=("auto",))
    assert violation(threads, "two") == "must be auto or an integer ≥ 1"
    assert violation(Setting("c", "str", choices=("a", "b")), ["a"]) == "must be one of a, b"


def test_mutable_default_is_refused() -> None:
    with pytest.raises(TypeError):
        setting([], "a list")


def test_frozen_sections_cannot_be_mutated() -> None:
    config = typed(load_config("cpu.yaml"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.http.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.drafter = DrafterConfig()  # type: ignore[misc]


def test_defaults_are_the_declarations() -> None:
    assert list(DEFAULTS) == list(SECTIONS)
    assert defaults(DrafterConfig) == DRAFTER_COMMON
    assert DEFAULTS["http"] == defaults(HttpConfig)
    for spec in drafter_specs():
        for key, default in spec.keys.items():
            assert key in DEFAULTS["drafter"]
            if spec.settings is not None:
                assert defaults(spec.settings)[key] == default


def test_every_section_key_is_declared_with_a_doc() -> None:
    for cls in SECTIONS.values():
        for name, _, meta in declared(cls):
            assert meta.doc.strip(), f"{cls.__name__}.{name} has no doc"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_typed_round_trips_every_bundled_config(path) -> None:
    try:
        config = load_config(path)
    except ConfigError as exc:  # a bundled GPU config on a machine without one: the same config on the CPU
        if "CUDA device" not in str(exc):
            raise
        config = load_config(path, {"verifier.device": "cpu", "drafter.device": "cpu"})
    t = typed(config)
    assert isinstance(t, Config)
    for name, cls in SECTIONS.items():
        section = dataclasses.asdict(getattr(t, name))
        assert section == {k: config[name][k] for k in section}, name
        assert set(section) == {f.name for f in dataclasses.fields(cls)}
    spec = drafter_spec(config["drafter"]["type"])
    own = dataclasses.asdict(t.drafter_type) if spec.settings is not None else dict(t.drafter_type or {})
    assert own == {k: config["drafter"][k] for k in spec.keys}
    assert (t.drafter_type is None) == (not spec.keys)
    assert pickle.loads(pickle.dumps(t)) == t  # a node on a Ray cluster gets it as a call argument


@pytest.mark.parametrize(("override", "message"), [
    ({"http.port": 0}, "http.port: must be an integer in [1, 65535], got 0"),
    ({"verifier.max_sessions": 0}, "verifier.max_sessions: must be an integer ≥ 1, got 0"),
    ({"drafter.q_top_k": -1}, "drafter.q_top_k: must be an integer ≥ 0, got -1"),
    ({"drafter.num_draft_tokens": 100}, "drafter.num_draft_tokens: must be an integer in [1, 64], got 100"),
    ({"launch.drafters": 17},
     "launch.drafters: must be an integer in [1, 16], got 17 (more can join with --role drafter)"),
    ({"drafter.overlap": 1}, "drafter.overlap: must be true or false, got 1"),
    ({"verifier.threads": 0}, "verifier.threads: must be auto or an integer ≥ 1, got 0"),
    ({"drafter.dtype": "float64"}, "drafter.dtype: must be one of auto, float32, bfloat16, float16, got 'float64'"),
    ({"drafter.draft_schedule": "fastest"},
     "drafter.draft_schedule: must be one of cost, pipeline, adaptive, heuristic, constant, got 'fastest'"),
    ({"verifier.profile_s": 601},
     "verifier.profile_s: must be a number of seconds in [0, 600], got 601 (0: no profile)"),
    ({"client.timeout_s": 0}, "client.timeout_s: must be a number of seconds > 0, got 0"),
    ({"http.scrape_timeout_s": 61}, "http.scrape_timeout_s: must be a number of seconds in (0, 60], got 61"),
    ({"security.curve": "maybe"}, "security.curve: must be one of auto, on, off, got 'maybe'"),
    ({"verification.ensemble_weight": 1}, "verification.ensemble_weight: must be a number in the open interval "
     "(0, 1), got 1 (leave it unset, null, for standard, lossless verification)"),
    ({"drafter.type": "prompt_lookup", "drafter.max_matching_ngram_size": 0},
     "drafter.max_matching_ngram_size: must be an integer ≥ 1, got 0"),
    ({"drafter.type": "suffix", "drafter.suffix_max_tree_depth": 1},
     "drafter.suffix_max_tree_depth: must be an integer ≥ 2, got 1"),
    ({"drafter.type": "suffix", "drafter.suffix_num_draft_tokens": 65},
     "drafter.suffix_num_draft_tokens: must be an integer in [1, 64], got 65"),
    ({"drafter.type": "suffix", "drafter.suffix_max_spec_factor": 0},
     "drafter.suffix_max_spec_factor: must be a number > 0, got 0"),
    ({"drafter.type": "suffix", "drafter.suffix_min_token_prob": 1.5},
     "drafter.suffix_min_token_prob: must be a number in [0, 1], got 1.5"),
    ({"drafter.type": "suffix", "drafter.suffix_min_token_prob": "high"},
     "drafter.suffix_min_token_prob: must be a number in [0, 1], got 'high'"),
    ({"drafter.type": "suffix", "drafter.suffix_max_cached_requests": -1},
     "drafter.suffix_max_cached_requests: must be an integer ≥ 0, got -1"),
    ({"drafter.type": "suffix", "drafter.suffix_max_cached_tokens": 1.5},
     "drafter.suffix_max_cached_tokens: must be an integer ≥ 0, got 1.5"),
])
def test_declared_bounds_are_checked_on_load(override, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("cpu.yaml", override)
    assert str(info.value) == message
