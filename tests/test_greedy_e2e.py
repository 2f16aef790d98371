"""Greedy output of the running cluster is token-identical to transformers' ``generate`` on the target alone.

Real nodes over real ZeroMQ sockets, tiny models loaded with ``from_pretrained``: the matrix on the in-process
launcher (tests/conftest.py ``start_cluster``: both nodes as threads, ``inproc://``), the entry and static-slot
checks below as node processes. The matrix covers Llama,
Qwen2 and GPT-2 style models, draft lengths 1..8, an identical drafter (everything accepted) and a random one
(mostly rejected), overlap on and off, EOS inside a block and max_new_tokens cutting a block.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import greedy_outputs, start_cluster, tiny_config

from runtime.launch import cluster
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8]]

# (arch, drafter, overlap, k): every drafter × overlap combination for each architecture, k = 1..8 on Llama (k = 3
# with overlap: the assistant type's case of tests/test_conformance.py, a drafter of the target's first layer).
CASES = [
    ("llama", "target", True, 1), ("llama", "random", False, 2),
    ("llama", "target", False, 4), ("llama", "target", True, 5), ("llama", "random", False, 6),
    ("llama", "random", True, 7), ("llama", "target", False, 8),
    ("qwen2", "target", True, 3), ("qwen2", "random", False, 5), ("qwen2", "random", True, 8),
    ("qwen2", "target", False, 2),
    ("gpt2", "target", False, 3), ("gpt2", "random", True, 5), ("gpt2", "random", False, 8),
    ("gpt2", "target", True, 4),
]


def expectations(target) -> list[tuple[list[int], dict, list[int]]]:
    """(prompt, request params, expected tokens): a plain run, EOS inside a block, and a short max_new_tokens."""
    plain = reference_greedy(target, PROMPTS[0], 40)
    eos = plain[9]  # a token the target really produces: generation must stop there, mid-block
    with_eos = reference_greedy(target, PROMPTS[0], 40, eos=[eos])
    assert len(with_eos) < 40 and with_eos[-1] == eos
    return [
        (PROMPTS[0], {"max_new_tokens": 40, "eos_token_ids": []}, plain),
        (PROMPTS[0], {"max_new_tokens": 40, "eos_token_ids": [eos]}, with_eos),
        (PROMPTS[1], {"max_new_tokens": 11, "eos_token_ids": []}, reference_greedy(target, PROMPTS[1], 11)),
        (PROMPTS[2], {"max_new_tokens": 23, "eos_token_ids": []}, reference_greedy(target, PROMPTS[2], 23)),
    ]


@pytest.mark.parametrize(("arch", "drafter", "overlap", "k"), CASES)
def test_greedy_matches_transformers(tiny, arch, drafter, overlap, k):
    target = tiny(arch, "target")
    draft_model = tiny(arch, drafter)
    cases = expectations(target)
    config = tiny_config(target, draft_model, num_draft_tokens=k, overlap=overlap)

    async def main():
        async with start_cluster(config) as client:
            results = await asyncio.gather(
                *(client.generate(token_ids=prompt, **params) for prompt, params, _ in cases)
            )
        return results

    results = asyncio.run(main())
    for (prompt, params, expected), result in zip(cases, results):
        assert result.token_ids == expected, f"prompt {prompt} params {params}"
    plain = results[0].metrics
    assert plain["drafts"] > 0, "the drafter never contributed a block"
    if drafter == "target":
        assert plain["acceptance_rate"] == 1.0
    else:
        assert plain["acceptance_rate"] < 0.9


def test_nodes_started_through_a_test_entry_behave_the_same(tiny):
    """``Cluster(entry=...)`` (how tests inject behaviour into node processes) runs the same nodes."""
    from node_entry import node_entry

    target = tiny("llama", "target")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    entry = {role: node_entry("none") for role in ("verifier", "drafter")}

    async def main():
        async with cluster(config, entry=entry) as client:
            cmdlines = [" ".join(p.args) for p in client.cluster.processes.values()]
            return cmdlines, await client.generate(token_ids=PROMPTS[0], max_new_tokens=20, eos_token_ids=[])

    cmdlines, result = asyncio.run(main())
    assert all("node_entry.py none" in line for line in cmdlines)
    assert result.token_ids == reference_greedy(target, PROMPTS[0], 20)


def test_cluster_on_static_slots_matches_transformers(tiny):
    """A running cluster with ``verifier.backend: static`` and two slots for three concurrent requests (one in a
    dynamic cache, mixed batches): every greedy output equals ``generate``."""
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=4)
    config["verifier"].update(backend="static", kv_slots=2, kv_slot_tokens=64)
    prompts = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8]]
    expected = [reference_greedy(target, p, 20) for p in prompts]
    results = greedy_outputs(config, prompts, 20, launcher="process")
    assert [r.token_ids for r in results] == expected
