"""``prompt_lookup`` drafter: the n-gram lookup itself and greedy identity with transformers on more architectures
(tests/test_conformance.py runs the type's Llama case, its sampling check and its config refusals)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny_config

from drafter_node.prompt_lookup import lookup
from runtime.config import ConfigError, load_config
from runtime.launch import cluster
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster


def test_lookup_takes_the_most_recent_match_of_the_longest_ngram():
    ids = [1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2]
    assert lookup(ids, max_ngram=2, count=3) == [4, 5, 7]  # [1, 2] last seen before 4 5 7
    assert lookup([5, 6, 7, 6, 8, 3, 6], max_ngram=2, count=2) == [8, 3]  # no 2-gram match: the 1-gram [6]
    assert lookup([1, 2, 3], max_ngram=2, count=4) == []  # nothing to copy
    assert lookup([4, 4], max_ngram=3, count=5) == [4]
    assert lookup([7, 8, 7, 8], max_ngram=1, count=10) == [7, 8]  # the continuation stops at the end of the context


def prompt_lookup_config(target, **keys):
    config = tiny_config(target, None, **keys)
    config["drafter"]["type"] = "prompt_lookup"
    del config["drafter"]["model"]
    return config


REPEATING = [5, 17, 33, 2, 60, 5, 17, 33, 2, 61, 5, 17]


@pytest.mark.parametrize(("arch", "overlap"), [("qwen2", False), ("gpt2", True)])
def test_prompt_lookup_greedy_matches_transformers(tiny, arch, overlap):
    target = tiny(arch)
    prompts = [REPEATING, [9, 8, 7]]
    expected = [reference_greedy(target, p, 40) for p in prompts]
    config = prompt_lookup_config(target, overlap=overlap, prompt_lookup_num_tokens=4)

    async def main():
        async with cluster(config) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=40, eos_token_ids=[])
                                          for p in prompts))

    results = asyncio.run(main())
    assert [r.token_ids for r in results] == expected
    assert all(r.metrics["drafts"] > 0 for r in results)
    if arch != "gpt2":  # these tiny targets fall into loops that lookups predict; the tiny GPT-2 does not
        assert sum(r.metrics["accepted_tokens"] for r in results) > 0


def test_prompt_lookup_config_needs_no_model_and_checks_its_keys():
    config = load_config("prompt_lookup.yaml")
    assert config["drafter"]["type"] == "prompt_lookup" and config["drafter"]["model"] is None
    with pytest.raises(ConfigError, match=r"drafter\.max_matching_ngram_size"):
        load_config("prompt_lookup.yaml", ["drafter.max_matching_ngram_size=0"])
