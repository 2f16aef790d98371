"""Hybrid and state-space targets through real nodes: greedy output token-identical to transformers' ``generate`` on
the target alone for tiny Qwen3-Next, Mamba2, Falcon-H1 and LFM2 targets, with an assistant drafter (a perturbed
copy of the target: some drafts accepted, some rejected, so the verifier rolls its recurrent state back) and with
prompt lookup (accepted and rejected too)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny_config

from runtime.launch import cluster
from testkit.tiny_hybrid import HYBRID_FAMILIES, build_hybrid, perturbed_copy
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPT = [5, 17, 33, 2, 60, 5, 17, 33, 2, 60, 5, 17]  # repeats: prompt lookup finds n-grams to propose
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hybrid_pairs(model_dir, tokenizer_dir):
    pairs = {}
    for family in HYBRID_FAMILIES:
        target = build_hybrid(model_dir / f"hybrid-{family}", family, tokenizer_dir, seed=4)
        pairs[family] = (target, perturbed_copy(target, model_dir / f"hybrid-{family}-near", noise=0.6, seed=5))
    return pairs


async def generate(config, prompts):
    async with cluster(config) as client:
        return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=NEW_TOKENS, eos_token_ids=[])
                                      for p in prompts))


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_assistant_drafter_greedy_matches_transformers(hybrid_pairs, family):
    target, near = hybrid_pairs[family]
    prompts = [PROMPT, [100, 101, 7]]
    results = asyncio.run(generate(tiny_config(target, near, num_draft_tokens=4), prompts))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(target, prompt, NEW_TOKENS), f"prompt {prompt}"
    drafted = sum(r.metrics["draft_tokens"] for r in results)
    accepted = sum(r.metrics["accepted_tokens"] for r in results)
    assert 0 < accepted < drafted, f"need drafts accepted and rejected: {accepted}/{drafted}"


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_prompt_lookup_greedy_matches_transformers(hybrid_pairs, family):
    """The prompt holds the target's own continuation of PROMPT followed by PROMPT again, so lookups propose what the
    target said after PROMPT before: on these tiny targets some of it is said again (accepted), some not (rejected,
    and the recurrent state rolled back)."""
    target, _ = hybrid_pairs[family]
    prompt = PROMPT + reference_greedy(target, PROMPT, 24) + PROMPT
    config = tiny_config(target, None, type="prompt_lookup", num_draft_tokens=3, prompt_lookup_num_tokens=3,
                         max_matching_ngram_size=3)
    (result,) = asyncio.run(generate(config, [prompt]))
    assert result.token_ids == reference_greedy(target, prompt, NEW_TOKENS)
    drafted, accepted = result.metrics["draft_tokens"], result.metrics["accepted_tokens"]
    assert 0 < accepted < drafted, f"need drafts accepted and rejected: {accepted}/{drafted}"
