"""Token trees end to end (``drafter.tree: true``): greedy output stays token-identical to transformers' ``generate``
on the target alone while the drafter sends its chain plus second-choice leaves and the verifier verifies them in one
forward (alone and batched with another session); malformed ``parents`` are refused and the verifier keeps serving;
sampled requests keep chains.

As in tests/test_cost_e2e.py, fixed cost curves (injected into the drafter process by tests/node_entry.py: a
verifier whose forward costs about the same over 1..17 tokens) make the plans deterministic enough: there a side leaf
costs next to nothing, so the planner adds some while acceptance is uncertain.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from conftest import hand_played, peer_messages, peer_socket, tiny_config, wait_for_drafter
from node_entry import costs_entry as costs

from runtime.launch import cluster
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7]]
FLAT_VERIFY = json.dumps({"verify": {"1": 0.010, "9": 0.012, "17": 0.014}, "draft": {"1": 0.001, "17": 0.004}})


@pytest.fixture(scope="module")
def noisy(tiny, tmp_path_factory):
    """The target with noise on its LM head: its top-1 often agrees with the target's, and where it does not its
    second choice often does (what side leaves are for)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny("llama", "target")
    folder = tmp_path_factory.mktemp("noisy")
    model = AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(5)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.add_(torch.randn_like(head) * 0.06)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(target).save_pretrained(folder)
    return folder


def run(config, entry, cases, **params):
    async def main():
        async with cluster(config, entry=entry) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=n, eos_token_ids=[], **params)
                                          for p, n in cases))
    return asyncio.run(main())


def tree_config(target, drafter):
    return tiny_config(target, drafter, num_draft_tokens=4, overlap=False, draft_schedule="cost", max_draft_tokens=8,
                       tree=True)


@pytest.mark.parametrize("drafter", ["random", "target", "noisy"])
def test_greedy_identity_with_token_trees(tiny, noisy, drafter):
    target = tiny("llama", "target")
    draft_model = noisy if drafter == "noisy" else tiny("llama", drafter)
    cases = [(PROMPTS[0], 60), (PROMPTS[1], 40)]  # two at once: tree rows in batched forwards too
    results = run(tree_config(target, draft_model), costs(FLAT_VERIFY), cases)
    for (prompt, n), result in zip(cases, results):
        assert result.token_ids == reference_greedy(target, prompt, n), f"prompt {prompt}"
    m = [r.metrics for r in results]
    assert sum(x["tree_rounds"] for x in m) > 0, "no token tree was verified"
    assert all(x["drafter_tree_blocks"] >= x["tree_rounds"] for x in m)
    assert sum(x["plans"].get("tree", 0) for x in m) > 0
    for x in m:
        # per position: how often it was drafted and accepted, by depth (a probability however wide the tree)
        assert all(0.0 <= a <= 1.0 for a in x["per_position_acceptance"])
        assert x["accepted_tokens"] <= x["draft_tokens"]
    if drafter == "noisy":
        assert sum(x["side_accepted"] for x in m) > 0, "no side leaf was ever accepted"
    if drafter == "target":
        assert all(x["side_accepted"] == 0 for x in m)  # the chain is always right


def test_sampled_requests_keep_chains(tiny, noisy):
    target = tiny("llama", "target")
    (result,) = run(tree_config(target, noisy), costs(FLAT_VERIFY), [(PROMPTS[0], 30)],
                    do_sample=True, temperature=0.9, seed=3)
    m = result.metrics
    assert len(result.token_ids) == 30 and m["drafts"] > 0
    assert m["tree_rounds"] == 0 and m["drafter_tree_blocks"] == 0 and m["plans"].get("tree", 0) == 0


BAD_PARENTS = [[-1], [-1, 1, 0], [-1, 3, 0], [-2, 0, 1], [-1, True, 0], "0,1", [-1, 0, 0.5]]


async def tree_peer(endpoint: str, tok_id: str, stop: asyncio.Event) -> dict:
    """A drafter played by hand: for every round it sends drafts with malformed ``parents``, then, for a greedy
    session, a valid tree of arbitrary tokens (two candidates at each of two positions) and, for a sampled one, a
    valid tree (refused: trees are for greedy requests) followed by an empty chain block."""
    from shared.protocol import Capabilities, Commit, Draft, Error, Hello, SessionStart, encode

    seen = {"errors": [], "trees": 0, "refused": 0}
    sampled: dict[int, bool] = {}
    async with peer_socket(endpoint) as sock:
        await sock.send_multipart(encode(Hello(drafter_type="hand", tokenizer_id=tok_id,
                                               capabilities=Capabilities())))
        async for msg in peer_messages(sock, stop):
            if isinstance(msg, Error):
                seen["errors"].append(msg.message)
                seen["refused"] += msg.code == "tree_refused"
                continue
            if isinstance(msg, SessionStart):
                sid, base = msg.session, len(msg.token_ids)
                sampled[sid] = bool(msg.params.get("do_sample"))
            elif isinstance(msg, Commit):
                sid, base = msg.session, msg.base_len + len(msg.tokens)
            else:
                continue
            for bad in BAD_PARENTS:  # malformed on purpose: the encoder does not check types, decode does
                await sock.send_multipart(encode(Draft(session=sid, base_len=base, tokens=[7, 8, 9],
                                                       parents=bad)))
            tree = Draft(session=sid, base_len=base, tokens=[7, 8, 9, 10], parents=[-1, -1, 0, 0])
            await sock.send_multipart(encode(tree))
            if sampled[sid]:
                await sock.send_multipart(encode(Draft(session=sid, base_len=base, tokens=[])))
            else:
                seen["trees"] += 1
    return seen


def test_malformed_parents_are_refused_and_the_verifier_keeps_serving(tiny):
    target = tiny("llama")
    config, tok_id = hand_played(target)

    async def main():
        async with cluster(config) as client:
            stop = asyncio.Event()
            peer = asyncio.create_task(tree_peer(client.config["verifier"]["endpoint"], tok_id, stop))
            await wait_for_drafter(client)
            greedy = await client.generate(token_ids=PROMPTS[0], max_new_tokens=12, eos_token_ids=[])
            sampled = await client.generate(token_ids=PROMPTS[1], max_new_tokens=6, eos_token_ids=[],
                                            do_sample=True, seed=1)
            again = await client.generate(token_ids=PROMPTS[1], max_new_tokens=8, eos_token_ids=[])
            alive = await client.ping()
            stop.set()
            return greedy, sampled, again, alive, await peer

    greedy, sampled, again, alive, seen = asyncio.run(main())
    assert greedy.token_ids == reference_greedy(target, PROMPTS[0], 12)
    assert again.token_ids == reference_greedy(target, PROMPTS[1], 8)
    assert len(sampled.token_ids) == 6 and sampled.metrics["tree_rounds"] == 0
    assert greedy.metrics["tree_rounds"] > 0 and alive["drafter_connected"]
    assert sum("parents" in e for e in seen["errors"]) >= len(BAD_PARENTS) * 3  # every round's, every request's
    assert seen["refused"] > 0  # the sampled request's trees, with their own code
