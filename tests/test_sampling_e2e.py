"""Seeded sampling through the running cluster is reproducible: the same seed gives the same tokens, run after run.

(That sampling has the target's distribution, with its accept-all negative control, is checked for every drafter
type by tests/test_conformance.py with tests/sampling_check.py.)
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny_config
from sampling_check import PROMPT

from runtime.launch import cluster

pytestmark = pytest.mark.statistical


def test_sampling_is_reproducible_per_seed(sharp_pair):
    target, drafter = sharp_pair

    async def main():
        async with cluster(tiny_config(target, drafter, num_draft_tokens=3)) as client:
            runs = [await client.generate(token_ids=PROMPT, max_new_tokens=12, do_sample=True, seed=7,
                                          temperature=0.9, top_k=6, eos_token_ids=[]) for _ in range(3)]
        return [r.token_ids for r in runs]

    a, b, c = asyncio.run(main())
    assert a == b == c
