"""The conformance suite: every registered drafter type (``drafter_node/types.py``) through the same checks, on the
tiny setup its spec's ``conformance`` factory builds (``testkit/conformance.py``). A new type is covered by its
registry line and that one declaration; a type that declares none fails here with what to declare.

- greedy (``cluster``): through real node processes the output is token-identical to transformers' own
  ``generate`` on the target alone, and the type really drafted: some drafted tokens accepted, some rejected;
- sampling: the joint distribution of the first two sampled tokens is within the bound of the target's exact one,
  with drafts accepted and rejected (``tests/sampling_check.py``). ``make test`` (``statistical``) runs it for one
  type per kind of draft distribution, :data:`KINDS` (one-hot, sparse, dense, hidden-state), and the accept-all
  negative control once, on the dense setup; CI (``ci``, ``make test-ci``) runs it for every other type too. Every
  model-based type draws its tokens and q through the same ``drafter_node.lm_drafter.choose``, whose q the
  in-process check of the acceptance rule uses (tests/test_sampling.py);
- refusals (``unit``): the setup's config loads, and the config errors every type must give name their key: an
  unknown ``drafter`` key, a block longer than the protocol takes, a missing model, a missing target checkpoint,
  ensemble verification without q.

One cluster per type runs every greedy prompt (the greedy checks share its results); a sampling check starts its
own (its sharpened 12-token target).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import greedy_outputs, tiny_config
from sampling_check import check_lossless_sampling, check_negative_control, exact_joint, point_joint

from drafter_node.types import DRAFTER_TYPES, drafter_spec
from runtime.config import ConfigError, load_config
from shared.protocol import MAX_DRAFT_TOKENS
from testkit.conformance import ConformanceSetup, NoConformanceSetup, conformance_factory
from testkit.tiny_models import reference_greedy

TYPES = list(DRAFTER_TYPES)
#: The ``drafter`` keys every type has that set a block's length.
COMMON_BLOCK_KEYS = ("num_draft_tokens", "max_draft_tokens")


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """``setups(name)`` → the type's :class:`ConformanceSetup`, built once per module (its factory's models)."""
    cache: dict[str, ConformanceSetup] = {}

    def get(name: str) -> ConformanceSetup:
        if name not in cache:
            try:
                factory = conformance_factory(drafter_spec(name))
            except NoConformanceSetup as e:
                pytest.fail(str(e), pytrace=False)
            setup = factory(tmp_path_factory.mktemp(f"conformance-{name}"))
            assert isinstance(setup, ConformanceSetup), f"{name}: its factory must return a ConformanceSetup"
            for section in (setup.drafter, setup.sampling.drafter):
                assert section.get("type") == name, f"{name}: the setup's drafter sections must say type: {name}"
            cache[name] = setup
        return cache[name]

    return get


def config_for(target: Path, drafter: dict[str, Any], verifier: dict[str, Any]) -> dict:
    """tests/conftest.py's tiny config with the type's sections laid over it (its ``model`` replaces the default)."""
    config = tiny_config(target, None)
    del config["drafter"]["model"]
    config["drafter"].update(drafter)
    config["verifier"].update(verifier)
    return config


def greedy_config(setup: ConformanceSetup) -> dict:
    return config_for(setup.target, setup.drafter, setup.verifier)


# ------------------------------------------------------------------------------------------------ greedy


@pytest.fixture(scope="module")
def greedy(setups):
    """``greedy(name)`` → the results of every greedy prompt of the type, sent at once to one cluster (once)."""
    cache: dict[str, list] = {}

    def get(name: str) -> list:
        if name not in cache:
            setup = setups(name)
            cache[name] = greedy_outputs(greedy_config(setup), setup.prompts, setup.max_new_tokens)
        return cache[name]

    return get


@pytest.mark.cluster
@pytest.mark.parametrize("kind", TYPES)
def test_greedy_output_is_transformers_own(kind, setups, greedy):
    setup = setups(kind)
    expected = [reference_greedy(setup.target, p, setup.max_new_tokens) for p in setup.prompts]
    assert [r.token_ids for r in greedy(kind)] == expected


@pytest.mark.cluster
@pytest.mark.parametrize("kind", TYPES)
def test_greedy_drafts_are_accepted_and_rejected(kind, setups, greedy):
    """The identity above would hold with drafting off: the type must have drafted, and both the accepting and the
    rolling-back paths must have run (the rolling-back one alone where the setup says its drafts cannot agree)."""
    results = greedy(kind)
    drafted = sum(r.metrics["draft_tokens"] for r in results)
    accepted = sum(r.metrics["accepted_tokens"] for r in results)
    least = 1 if setups(kind).drafts_accepted else 0
    assert least <= accepted < drafted, f"{kind}: need drafts accepted and rejected, got {accepted} of {drafted}"


# ---------------------------------------------------------------------------------------------- sampling


#: Kind of draft distribution → the type whose sampling check ``make test`` runs for it (``sparse``: the dense type
#: with ``drafter.q_top_k`` below the 12-token vocabulary, :data:`SPARSE_TOP_K`).
KINDS = {"one-hot": "prompt_lookup", "sparse": "assistant", "dense": "assistant", "hidden-state": "mtp"}
SPARSE_TOP_K = 4
#: Every type's sampling check runs in CI; the types of :data:`KINDS` in ``make test`` too.
SAMPLING_TYPES = [pytest.param(name, marks=pytest.mark.statistical if name in KINDS.values() else pytest.mark.ci)
                  for name in TYPES]
#: What accepting every draft gives on prompt_lookup's repeating prompt 2 5 7 2 5 7 2 5: the lookup's 7, 2.
LOOKUP_CONTINUATION = (7, 2)


def sampling_config(setup: ConformanceSetup, **drafter) -> dict:
    sampling = setup.sampling
    return config_for(sampling.target, {**sampling.drafter, **drafter}, sampling.verifier)


def wrong_joints(kind: str, setup: ConformanceSetup, top_k: int = 0) -> dict:
    """What accepting every draft of the type's sampling setup would give, where a test can compute it: the
    drafter's own joint (a model over the target's vocabulary), or the lookup's continuation."""
    sampling = setup.sampling
    if kind == "assistant":
        return {"the drafter's joint": exact_joint(Path(sampling.drafter["model"]), sampling.prompt, top_k=top_k)}
    if kind == "prompt_lookup":
        return {"the lookup's continuation": point_joint(*LOOKUP_CONTINUATION)}
    return {}


@pytest.mark.parametrize("kind", SAMPLING_TYPES)
def test_sampling_is_lossless(kind, setups):
    setup = setups(kind)
    sampling = setup.sampling
    check_lossless_sampling(sampling_config(setup), exact_joint(sampling.target, sampling.prompt), sampling.prompt,
                            wrong=wrong_joints(kind, setup))


@pytest.mark.statistical
def test_sampling_with_a_sparse_q_is_lossless(setups):
    """The dense type's setup with q sent as its top-m entries (m below the vocabulary): the verifier rebuilds q
    from (q_idx, q_prob) and the drafter draws from the same renormalised top-m."""
    kind = KINDS["sparse"]
    setup = setups(kind)
    sampling = setup.sampling
    assert drafter_spec(kind).sends_q
    check_lossless_sampling(sampling_config(setup, q_top_k=SPARSE_TOP_K),
                            exact_joint(sampling.target, sampling.prompt), sampling.prompt,
                            wrong=wrong_joints(kind, setup, top_k=SPARSE_TOP_K))


@pytest.mark.statistical
def test_the_negative_control_is_caught(setups):
    """The suite's one end-to-end negative control: on the dense setup, a verifier that accepts every draft
    (tests/node_entry.py) lands far outside the bound the checks above use (tests/test_sampling.py runs the same
    control in-process, for full and one-hot q)."""
    sampling = setups(KINDS["dense"]).sampling
    check_negative_control(config_for(sampling.target, sampling.drafter, sampling.verifier),
                           exact_joint(sampling.target, sampling.prompt), sampling.prompt)


@pytest.mark.unit
def test_the_kinds_name_types_of_their_kind(setups):
    """The one-hot type sends no q, the others do (the dense one in full: its setup sets q_top_k 0); the
    hidden-state type drafts from the target's hidden states with the target checkpoint's own MTP layers."""
    assert not drafter_spec(KINDS["one-hot"]).sends_q
    assert all(drafter_spec(KINDS[kind]).sends_q for kind in ("sparse", "dense", "hidden-state"))
    assert drafter_spec(KINDS["hidden-state"]).model_defaults_to_target
    assert setups(KINDS["dense"]).sampling.drafter["q_top_k"] == 0
    assert SPARSE_TOP_K < 12  # below build_small_vocab_tokenizer's vocabulary, or q would go whole


# ---------------------------------------------------------------------------------------------- refusals


def _refused(config: dict, key: str) -> str:
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}: ") as info:
        load_config(config)
    return str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize("kind", TYPES)
def test_the_setup_config_loads(kind, setups):
    """The baseline of the refusals below: without the fault each injects, the config is valid."""
    config = load_config(greedy_config(setups(kind)))
    assert config["drafter"]["type"] == kind


@pytest.mark.unit
@pytest.mark.parametrize("kind", TYPES)
def test_an_unknown_drafter_key_is_refused(kind, setups):
    config = greedy_config(setups(kind))
    config["drafter"]["no_such_key"] = 1
    assert "unknown key" in _refused(config, "drafter.no_such_key")


@pytest.mark.unit
@pytest.mark.parametrize("kind", TYPES)
def test_a_block_longer_than_the_protocol_takes_is_refused(kind, setups):
    """Every key that sets a block's length takes MAX_DRAFT_TOKENS and refuses one more (the verifier refuses a
    longer block as a protocol error: the config must catch it first)."""
    setup = setups(kind)
    spec = drafter_spec(kind)
    for key in (*COMMON_BLOCK_KEYS, *setup.block_keys):
        assert key in COMMON_BLOCK_KEYS or key in spec.keys, f"{kind}: block key drafter.{key} is not its own key"
        config = greedy_config(setup)
        config["drafter"][key] = MAX_DRAFT_TOKENS
        assert load_config(config)["drafter"][key] == MAX_DRAFT_TOKENS
        config["drafter"][key] = MAX_DRAFT_TOKENS + 1
        _refused(config, f"drafter.{key}")


@pytest.mark.unit
@pytest.mark.parametrize("kind", TYPES)
def test_a_missing_model_is_refused_or_defaults_as_declared(kind, setups):
    spec, setup = drafter_spec(kind), setups(kind)
    config = greedy_config(setup)
    config["drafter"]["model"] = None
    if spec.needs_model and not spec.model_defaults_to_target:
        _refused(config, "drafter.model")
    else:  # drafts with the target checkpoint, or without a model: None is fine
        loaded = load_config(config)["drafter"]["model"]
        assert loaded == (str(setup.target) if spec.model_defaults_to_target else None)
    if spec.needs_model:
        config["drafter"]["model"] = str(setup.target.parent / "no-such-model")
        _refused(config, "drafter.model")


@pytest.mark.unit
@pytest.mark.parametrize("kind", [name for name in TYPES if drafter_spec(name).reads_target])
def test_a_type_reading_the_target_defaults_to_it_and_refuses_a_missing_one(kind, setups):
    setup = setups(kind)
    config = greedy_config(setup)
    config["drafter"]["target_model"] = None
    assert load_config(config)["drafter"]["target_model"] == str(setup.target)
    config["drafter"]["target_model"] = str(setup.target.parent / "no-such-model")
    _refused(config, "drafter.target_model")


@pytest.mark.unit
@pytest.mark.parametrize("kind", TYPES)
def test_ensemble_verification_needs_q(kind, setups):
    spec = drafter_spec(kind)
    config = greedy_config(setups(kind))
    config["verification"] = {"ensemble_weight": 0.7}
    if spec.sends_q:
        assert load_config(config)["verification"]["ensemble_weight"] == 0.7
    else:
        message = _refused(config, "verification.ensemble_weight")
        assert f"not supported with {spec.title}" in message and "requires the draft distribution q" in message


# ------------------------------------------------------------------------------------------ the registry


@pytest.mark.unit
def test_a_type_without_a_conformance_setup_fails_saying_what_to_declare():
    """A registered type whose spec declares no ``conformance`` cannot pass the suite: its checks fail with a
    message naming the field, the spec module and the factory's signature (the setups fixture fails every check
    of the type with it)."""
    bare = dataclasses.replace(drafter_spec("assistant"), name="bare", conformance=None)
    with pytest.raises(NoConformanceSetup) as info:
        conformance_factory(bare)
    message = str(info.value)
    assert "'bare'" in message and 'conformance="module:function"' in message
    assert "drafter_node/type_specs/bare.py" in message and "ConformanceSetup" in message
    for wrong in ("testkit.conformance", "testkit.conformance:no_such_factory", "no_such_module:f"):
        with pytest.raises(NoConformanceSetup, match="conformance="):
            conformance_factory(dataclasses.replace(bare, conformance=wrong))


@pytest.mark.unit
@pytest.mark.parametrize("kind", TYPES)
def test_every_registered_type_declares_its_setup(kind):
    conformance_factory(drafter_spec(kind))
