"""The ``cost`` schedule end to end: greedy output stays token-identical to transformers' ``generate`` and sampling
keeps the target's distribution while the plan moves between overlapped blocks, synchronous blocks, k = 0 (the
verifier stepping alone) and probes.

Tiny models cost about the same for any forward, so the plans are made deterministic with fixed cost curves
(``PIPESPEC_TEST_COSTS``): a verifier whose forward over 1..9 tokens costs about one token's (drafting pays while
acceptance is high), and a cheap drafter. A random drafter then drives the plan to k = 0; an identical one keeps
drafting.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import tiny_config
from sampling_check import check_lossless_sampling, exact_joint
from tiny_models import reference_greedy

from runtime.launch import cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7]]
FLAT_VERIFY = json.dumps({"verify": {"1": 0.010, "9": 0.012, "17": 0.014}, "draft": {"1": 0.001, "17": 0.004}})
# A verifier whose cost grows with every token (emulated bf16 on a CPU): drafting cannot pay, whatever α.
LINEAR_VERIFY = json.dumps({"verify": {"1": 0.010, "17": 0.170}, "draft": {"1": 0.003, "17": 0.05}})


def run(config, env, cases):
    async def main():
        async with cluster(config, env=env) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=n, eos_token_ids=[])
                                          for p, n in cases))
    return asyncio.run(main())


@pytest.mark.parametrize(("arch", "drafter", "overlap"), [
    ("llama", "random", True), ("llama", "target", True), ("qwen2", "random", False), ("gpt2", "target", False),
])
def test_greedy_identity_with_the_cost_schedule(tiny, arch, drafter, overlap):
    target, draft_model = tiny(arch, "target"), tiny(arch, drafter)
    cases = [(PROMPTS[0], 60), (PROMPTS[1], 25)]
    config = tiny_config(target, draft_model, num_draft_tokens=4, overlap=overlap, draft_schedule="cost",
                         max_draft_tokens=8)
    results = run(config, {"PIPESPEC_TEST_COSTS": FLAT_VERIFY}, cases)
    for (prompt, n), result in zip(cases, results):
        assert result.token_ids == reference_greedy(target, prompt, n), f"prompt {prompt}"
    m = results[0].metrics
    assert m["drafts"] > 0
    assert m["verifier_dtype"] == "float32" and m["drafter_dtype"] == "float32"
    if drafter == "random":
        # acceptance falls to about 0: the plan goes to k = 0 (the verifier alone) and probes now and then
        assert m["solo_rounds"] > 0 and m["plans"]["solo"] > 0
        assert m["solo_rounds"] > m["drafts"]
    else:
        assert m["acceptance_rate"] == 1.0 and m["solo_rounds"] == 0
        assert m["plans"]["overlap" if overlap else "sync"] > 0


def test_linear_verify_costs_switch_drafting_off_even_for_a_perfect_drafter(tiny):
    target = tiny("llama", "target")
    config = tiny_config(target, target, num_draft_tokens=4, draft_schedule="cost", threads="auto")
    (result,) = run(config, {"PIPESPEC_TEST_COSTS": LINEAR_VERIFY}, [(PROMPTS[0], 40)])
    assert result.token_ids == reference_greedy(target, PROMPTS[0], 40)
    m = result.metrics
    assert m["solo_rounds"] >= 30 and m["plans"]["solo"] > 0


def test_sampling_stays_exact_with_the_cost_schedule(sharp_pair, monkeypatch):
    target, drafter = sharp_pair
    monkeypatch.setenv("PIPESPEC_TEST_COSTS", FLAT_VERIFY)
    config = tiny_config(target, drafter, num_draft_tokens=3, q_top_k=0, draft_schedule="cost")
    check_lossless_sampling(config, exact_joint(target))
