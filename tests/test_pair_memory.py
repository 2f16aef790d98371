"""A drafter node's memory of a pair's acceptance between runs (drafter_node/pair_memory.py)."""

from __future__ import annotations

import json

import pytest

from drafter_node import pair_memory
from drafter_node.cost_model import Acceptance

pytestmark = pytest.mark.unit


@pytest.fixture
def memory_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESPEC_PROFILE_DIR", str(tmp_path))
    return tmp_path


def _accepting(alpha: float) -> Acceptance:
    acc = Acceptance(6)
    for _ in range(60):
        acc.observe(6, 6 if alpha > 0.5 else 0)
    return acc


def test_a_pair_remembers_its_acceptance_and_a_new_node_starts_from_it(memory_dir):
    path = pair_memory.memory_path("assistant", "small", "big")
    assert path.parent.parent == memory_dir
    assert pair_memory.load(path, 8) is None  # nothing remembered yet: the plain prior
    memory = pair_memory.PairMemory(path)
    memory.session_ended(_accepting(0.9))
    prior, requests = pair_memory.load(path, 8)
    assert requests == 1 and prior.alpha(0) > 0.95 and prior.alpha(7) > 0.95
    assert prior.positions[0].trials == pair_memory.REMEMBERED_WEIGHT
    # another pair (another target, another drafter model) has its own file
    assert pair_memory.memory_path("assistant", "small", "other") != path
    assert pair_memory.memory_path("assistant", "tiny", "big") != path
    assert pair_memory.memory_path("assistant", "small", "big", "bfloat16/bfloat16") != \
        pair_memory.memory_path("assistant", "small", "big", "float32/float32")


def test_saves_are_rate_limited_but_forced_at_the_end(memory_dir):
    path = pair_memory.memory_path("assistant", "a", "b")
    memory = pair_memory.PairMemory(path)
    memory.session_ended(_accepting(0.9))
    memory.session_ended(_accepting(0.1))  # within SAVE_EVERY_S: counted, not written
    assert pair_memory.load(path, 8)[0].alpha(0) > 0.9
    memory.save(_accepting(0.1))
    prior, requests = pair_memory.load(path, 8)
    assert prior.alpha(0) < 0.1 and requests == 2


@pytest.mark.parametrize("content", [
    "not json", "[]", json.dumps({"alpha": []}), json.dumps({"alpha": [1.5]}), json.dumps({"alpha": ["x"]}),
    json.dumps({"alpha": [0.5], "bonus_guess": -1}), json.dumps({"alpha": [float("nan")]}),
    json.dumps({"alpha": [0.5] * 5000}),
])
def test_a_malformed_memory_file_means_the_plain_prior(memory_dir, content):
    path = pair_memory.memory_path("assistant", "a", "b")
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert pair_memory.load(path, 8) is None
