"""``suffix`` drafter through real nodes: greedy identity with transformers (Qwen2 without overlap, drafts accepted
and rejected; a hybrid target), and the cross-request effect end to end (a request that repeats an earlier
response's pattern drafts from it; with the cache off it does not). tests/test_conformance.py runs the Llama case
with overlap and the sampling check with its negative control; the suffix structure itself is tested in
tests/test_suffix_tree.py."""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny_config

from runtime.launch import cluster
from testkit.tiny_hybrid import build_hybrid
from testkit.tiny_models import reference_greedy

REPEATING = [5, 17, 33, 2, 60, 5, 17, 33, 2, 61, 5, 17]


def suffix_config(target, **keys):
    config = tiny_config(target, None, type="suffix", **keys)
    del config["drafter"]["model"]
    return config


async def run_in_order(config, prompts, new_tokens):
    """The prompts one after another through one cluster (so one drafter's cache sees them in order)."""
    async with cluster(config) as client:
        return [await client.generate(token_ids=p, max_new_tokens=new_tokens, eos_token_ids=[]) for p in prompts]


async def run_together(config, prompts, new_tokens):
    async with cluster(config) as client:
        return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=new_tokens, eos_token_ids=[])
                                      for p in prompts))


@pytest.mark.cluster
@pytest.mark.parametrize(("arch", "overlap"), [("qwen2", False)])
def test_suffix_greedy_matches_transformers(tiny, arch, overlap):
    target = tiny(arch)
    prompts = [REPEATING, [9, 8, 7], REPEATING[::-1]]
    expected = [reference_greedy(target, p, 40) for p in prompts]
    # an eager setting (no probability floor, long proposals) so that some drafts are rejected
    config = suffix_config(target, overlap=overlap, suffix_num_draft_tokens=6, suffix_min_token_prob=0.0,
                           suffix_max_spec_factor=4.0)
    results = asyncio.run(run_together(config, prompts, 40))
    assert [r.token_ids for r in results] == expected
    drafted = sum(r.metrics["draft_tokens"] for r in results)
    accepted = sum(r.metrics["accepted_tokens"] for r in results)
    assert 0 < accepted < drafted, f"need drafts accepted and rejected: {accepted}/{drafted}"


@pytest.mark.cluster
def test_suffix_greedy_on_a_hybrid_target(model_dir, tokenizer_dir):
    target = build_hybrid(model_dir / "hybrid-lfm2-suffix", "lfm2", tokenizer_dir, seed=4)
    config = suffix_config(target, suffix_num_draft_tokens=4, suffix_min_token_prob=0.0, suffix_max_spec_factor=4.0)
    results = asyncio.run(run_in_order(config, [REPEATING, REPEATING], 32))
    expected = reference_greedy(target, REPEATING, 32)
    assert [r.token_ids for r in results] == [expected, expected]
    assert sum(r.metrics["drafts"] for r in results) > 0
    assert sum(r.metrics["accepted_tokens"] for r in results) > 0


@pytest.mark.cluster
def test_a_later_request_drafts_from_an_earlier_response(tiny):
    """Request B repeats request A (an agent re-issuing the same call): with the cross-request cache B's drafts come
    from A's response and are accepted; with the cache off (max_cached_requests 0) B does no better than A."""
    target = tiny("gpt2")  # the tiny GPT-2 falls into no loop its own history would predict
    prompt = [9, 8, 7]
    expected = reference_greedy(target, prompt, 32)

    def accepted(cached: int) -> list[int]:
        config = suffix_config(target, suffix_num_draft_tokens=8, suffix_max_cached_requests=cached)
        results = asyncio.run(run_in_order(config, [prompt, prompt], 32))
        assert [r.token_ids for r in results] == [expected, expected]
        return [r.metrics["accepted_tokens"] for r in results]

    first, second = accepted(10)
    assert second >= 16 and second > 2 * first, (first, second)
    alone_first, alone_second = accepted(0)
    print(f"accepted tokens, request A then B: {first}, {second} (cache on); {alone_first}, {alone_second} (off)")
    # without the cache request B is request A again (drafts from its own tokens only; timing may move a block)
    assert abs(alone_second - alone_first) <= 2 and 2 * alone_second < second

