"""Sampling through the running cluster has the target's distribution (TV bound), and a verifier that accepts
every draft (the negative control: tests/node_entry.py's ``accept_all`` hook) fails the same check.

Tiny sharpened models over a 12-token vocabulary; the exact joint distribution of the first two generated tokens is
computed from the target with transformers, so only the runtime's own sampling adds noise.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny_config
from sampling_check import PROMPT, check_lossless_sampling, exact_joint, tv

from runtime.launch import cluster

pytestmark = pytest.mark.statistical


def test_sampling_distribution_and_negative_control(sharp_pair):
    target, drafter = sharp_pair
    exact = exact_joint(target)
    assert tv(exact, exact_joint(drafter)) > 0.4, "the drafter must really differ from the target"
    config = tiny_config(target, drafter, num_draft_tokens=3, q_top_k=0)
    check_lossless_sampling(config, exact)


def test_sampling_is_reproducible_per_seed(sharp_pair):
    target, drafter = sharp_pair

    async def main():
        async with cluster(tiny_config(target, drafter, num_draft_tokens=3)) as client:
            runs = [await client.generate(token_ids=PROMPT, max_new_tokens=12, do_sample=True, seed=7,
                                          temperature=0.9, top_k=6, eos_token_ids=[]) for _ in range(3)]
        return [r.token_ids for r in runs]

    a, b, c = asyncio.run(main())
    assert a == b == c
