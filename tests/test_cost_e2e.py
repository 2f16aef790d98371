"""The ``cost`` schedule end to end: greedy output stays token-identical to transformers' ``generate`` and sampling
keeps the target's distribution while the plan moves between overlapped blocks, synchronous blocks, k = 0 (the
verifier stepping alone) and probes.

Tiny models cost about the same for any forward, so the plans are made deterministic with fixed cost curves
(injected into the drafter process by tests/node_entry.py): a verifier whose forward over 1..9 tokens costs about one
token's (drafting pays while acceptance is high), and a cheap drafter. A random drafter then drives the plan to
k = 0; an identical one keeps drafting.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import hand_played, peer_messages, peer_socket, tiny_config, wait_for_drafter
from node_entry import costs_entry as costs
from sampling_check import check_lossless_sampling, exact_joint

from runtime.launch import cluster
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7]]
FLAT_VERIFY = json.dumps({"verify": {"1": 0.010, "9": 0.012, "17": 0.014}, "draft": {"1": 0.001, "17": 0.004}})
# Flat up to 1024 tokens (a large GPU): drafting pays at every batch size, 50 sessions sharing a forward included.
FLAT_TO_1024 = json.dumps({"verify": {"1": 0.010, "17": 0.014, "1024": 0.016},
                           "draft": {"1": 0.001, "17": 0.004, "1024": 0.006}})
# A verifier whose cost grows with every token (emulated bf16 on a CPU): drafting cannot pay, whatever α.
LINEAR_VERIFY = json.dumps({"verify": {"1": 0.010, "17": 0.170}, "draft": {"1": 0.003, "17": 0.05}})


def run(config, entry, cases):
    async def main():
        async with cluster(config, entry=entry) as client:
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
                         max_draft_tokens=8, profile_s=2)  # the drafter measures itself (under the machine lock)
    config["verifier"]["profile_s"] = 2
    results = run(config, costs(FLAT_VERIFY), cases)
    for (prompt, n), result in zip(cases, results):
        assert result.token_ids == reference_greedy(target, prompt, n), f"prompt {prompt}"
    m = results[0].metrics
    assert m["drafts"] > 0
    assert m["verifier_dtype"] == "float32" and m["drafter_dtype"] == "float32"
    # where the round's time went, and per plan what the cost model predicted against what the rounds gave
    timing = m["round_timing"]
    assert timing["rounds"] == m["rounds"] and timing["ms_per_round"]["forward"] > 0
    parts = sum(timing["ms_per_round"].values())
    assert parts == pytest.approx(timing["wall_ms_per_round"], rel=0.01, abs=0.01)
    assert timing["overhead_ms_per_round"] < timing["wall_ms_per_round"]
    assert m["drafter_timing"]["step_ms_per_block"] > 0 and m["drafter_timing"]["roundtrip_ms"] > 0
    # each node's forwards against its own start-up profile (both nodes profiled themselves here)
    vs_profile = m["forward_vs_profile"]
    assert vs_profile and sum(v["forwards"] for v in vs_profile.values()) <= m["rounds"]
    assert all(v["forwards"] > 0 and v["ratio"] > 0 for v in vs_profile.values())
    assert m["drafter_timing"]["forward_vs_profile"] > 0
    rates = m["plan_rates"]
    # counted up to the last block the drafter sent (its stats travel with its blocks): every drafted round but
    # the first (its interval includes the prefills) and the last, and the rounds taken alone in between
    assert m["drafts"] - 2 <= sum(r["rounds"] for r in rates.values()) <= m["rounds"]
    assert all(r["predicted_tokens_per_s"] > 0 and r["realised_tokens_per_s"] > 0 for r in rates.values())
    # the start-up plan, confirmed or corrected by what the request realised best
    check = m["plan_check"]
    assert check["verdict"] in ("confirmed", "corrected") and check["realised_best"] in rates
    assert (check["verdict"] == "confirmed") == (check["startup"] == check["realised_best"])
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
    (result,) = run(config, costs(LINEAR_VERIFY), [(PROMPTS[0], 40)])
    assert result.token_ids == reference_greedy(target, PROMPTS[0], 40)
    m = result.metrics
    assert m["solo_rounds"] >= 30 and m["plans"]["solo"] > 0


@pytest.mark.ci  # a sampling check beside the one per kind of draft in make test (tests/test_conformance.py)
def test_sampling_stays_exact_with_the_cost_schedule(sharp_pair):
    target, drafter = sharp_pair
    config = tiny_config(target, drafter, num_draft_tokens=3, q_top_k=0, draft_schedule="cost")
    # FLAT_TO_1024: its 50 requests at once start planned at batch 50
    check_lossless_sampling(config, exact_joint(target), wrong={"the drafter's joint": exact_joint(drafter)},
                            hooks={"drafter": f"costs={FLAT_TO_1024}"})


BAD_IDLE = [-1, "many", 5000, True, 2.5]


async def idle_drafter(endpoint: str, tok_id: str, stop: asyncio.Event) -> dict:
    """A peer that says hello with a malformed cost profile, then a valid one, and answers every round first with
    malformed ``idle_rounds`` drafts and then with a valid k = 0 block of 4 rounds."""
    from shared.protocol import (
        Capabilities,
        Commit,
        Draft,
        Error,
        Hello,
        SessionStart,
        Welcome,
        encode,
    )

    seen = {"errors": [], "welcome": None, "idle_blocks": 0}
    bad_profile = {"model": "m", "device": "cpu", "dtype": "float32", "curves": {"1": {"sizes": ["x"]}}}
    caps = Capabilities(sends_q=False)
    async with peer_socket(endpoint) as sock:
        await sock.send_multipart(encode(Hello(drafter_type="hostile", tokenizer_id=tok_id, capabilities=caps,
                                               profile=bad_profile)))
        await sock.send_multipart(encode(Hello(drafter_type="hostile", tokenizer_id=tok_id, capabilities=caps)))
        async for msg in peer_messages(sock, stop):
            if isinstance(msg, Error):
                seen["errors"].append(msg.message)
                continue
            if isinstance(msg, Welcome):
                seen["welcome"] = msg
                continue
            if isinstance(msg, SessionStart):
                sid, base = msg.session, len(msg.token_ids)
            elif isinstance(msg, Commit):
                sid, base = msg.session, msg.base_len + len(msg.tokens)
                if msg.drafted or base % 4:  # only after a solo run ends (every 4th round)
                    continue
            else:
                continue
            for bad in BAD_IDLE:  # malformed on purpose: the encoder does not check types, decode does
                await sock.send_multipart(encode(Draft(session=sid, base_len=base, tokens=[],
                                                       idle_rounds=bad)))
            await sock.send_multipart(encode(Draft(session=sid, base_len=base, tokens=[3],
                                                   idle_rounds=2)))  # idle rounds with tokens: refused too
            await sock.send_multipart(encode(Draft(session=sid, base_len=base, tokens=[],
                                                   idle_rounds=4)))
            seen["idle_blocks"] += 1
    return seen


def test_malformed_idle_rounds_and_profiles_are_refused_and_solo_rounds_run(tiny):
    target = tiny("llama")
    config, tok_id = hand_played(target)
    config["verifier"]["profile_s"] = 2  # the welcome carries a measured profile

    async def main():
        async with cluster(config) as client:
            stop = asyncio.Event()
            peer = asyncio.create_task(idle_drafter(client.config["verifier"]["endpoint"], tok_id, stop))
            await wait_for_drafter(client)
            result = await client.generate(token_ids=PROMPTS[0], max_new_tokens=24, eos_token_ids=[])
            again = await client.generate(token_ids=PROMPTS[1], max_new_tokens=8, eos_token_ids=[])
            stop.set()
            return result, again, await peer

    result, again, seen = asyncio.run(main())
    assert result.token_ids == reference_greedy(target, PROMPTS[0], 24)
    assert again.token_ids == reference_greedy(target, PROMPTS[1], 8)
    assert any("cost profile" in e for e in seen["errors"])
    assert sum("idle_rounds" in e for e in seen["errors"]) >= len(BAD_IDLE) + 1
    from shared.protocol import ThreadCounts

    welcome = seen["welcome"]
    assert welcome.threads == ThreadCounts(share=1, full=1) and welcome.profile["dtype"] == "float32"
    assert seen["idle_blocks"] > 0 and result.metrics["solo_rounds"] >= 4


def test_prompt_lookup_is_planned_too_and_stops_drafting_where_verifying_costs(tiny):
    # no model on the drafter side: its curve is free, so only the verifier's cost decides (linear: k = 0)
    target = tiny("llama", "target")
    config = tiny_config(target, None, type="prompt_lookup", draft_schedule="cost")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # something to copy
    (result,) = run(config, costs(LINEAR_VERIFY), [(prompt, 30)])
    assert result.token_ids == reference_greedy(target, prompt, 30)
    assert result.metrics["solo_rounds"] >= 20


# Speculation pays for a session alone, not at batch 4+: the drafter's step grows with the rows it carries (4 sessions
# cost 4 rows), so past 4 sessions its k steps cost more than the verifier saves (see drafter_node/cost_model.py).
BATCH_BOUND = json.dumps({"verify": {"1": 0.011, "17": 0.027, "128": 0.138}, "draft": {"1": 0.005, "128": 0.64}})


def test_the_plan_follows_the_batch_size_without_splitting_batches(tiny):
    """One request alone drafts; six at once step plainly (k = 0: the batch makes drafting cost more than it saves)
    and stay in one forward per round while the plans switch; alone again, drafting comes back. Every output equals
    ``generate``."""
    target = tiny("llama")
    config = tiny_config(target, target, num_draft_tokens=3, draft_schedule="cost", max_draft_tokens=8)
    prompts = [[5, 17, 33, 2, 60], [100, 101, 7], [9, 8, 7, 6], [40, 41], [3, 4, 5, 6, 7, 8, 9], [60, 61, 62]]

    async def main():
        async with cluster(config, entry=costs(BATCH_BOUND)) as client:
            await wait_for_drafter(client)
            first = await client.generate(token_ids=prompts[0], max_new_tokens=30, eos_token_ids=[])
            before = await client.ping()
            crowd = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=40, eos_token_ids=[])
                                           for p in prompts))
            after = await client.ping()
            last = await client.generate(token_ids=prompts[1], max_new_tokens=60, eos_token_ids=[])
        return first, crowd, last, before, after

    first, crowd, last, before, after = asyncio.run(main())
    assert first.token_ids == reference_greedy(target, prompts[0], 30)
    for p, r in zip(prompts, crowd):
        assert r.token_ids == reference_greedy(target, p, 40)
    assert last.token_ids == reference_greedy(target, prompts[1], 60)
    assert first.metrics["drafts"] > 0 and first.metrics["solo_rounds"] == 0
    assert sum(r.metrics["solo_rounds"] for r in crowd) > sum(r.metrics["rounds"] for r in crowd) / 2
    forwards = after["forwards"] - before["forwards"]
    sessions = after["mean_batch_sessions"] * after["forwards"] - before["mean_batch_sessions"] * before["forwards"]
    assert sessions / forwards >= 3.0, "the six requests' rounds were split over many forwards"
    assert last.metrics["drafts"] > 0, "alone again, drafting did not come back"
