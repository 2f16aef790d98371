"""Batched verification: ``shared.batch.feed_rows`` equals one forward per sequence, verifier rounds batched over
ragged rows commit exactly what each session commits alone, and a running cluster batches concurrent requests with
every greedy output equal to transformers' ``generate`` on the target alone (float32)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import tiny_config, wait_for_drafter
from node_entry import node_entry
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.launch import cluster
from shared.backend import DynamicBackend
from shared.batch import Row, feed_rows
from shared.kv import CachedLM
from shared.sampling import GenerationParams
from testkit.tiny_models import reference_greedy
from verifier_node.session import Session

pytestmark = pytest.mark.cluster

ARCHS = ["llama", "qwen2", "gpt2"]


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(2, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_feed_rows_equals_one_forward_per_sequence(tiny, arch):
    """Ragged rows (prefixes of 0, 4, 16 and 8 tokens; 3, 1, 6 and 2 new tokens), three rounds with rollbacks in
    between: logits, hidden states and the caches left behind match per-sequence forwards."""
    model = _load(tiny(arch))
    prefixes = [[], _ids(1, 4), _ids(2, 16), _ids(3, 8)]
    alone, batched = [CachedLM(model) for _ in prefixes], [CachedLM(model) for _ in prefixes]
    for lms in (alone, batched):
        for lm, prefix in zip(lms, prefixes):
            if prefix:
                lm.feed(prefix)
    assert batched[0].batchable
    for step in range(3):
        feeds = [_ids(10 * step + i, n) for i, n in enumerate((3, 1, 6, 2))]
        outs = feed_rows(model, [Row(lm, f) for lm, f in zip(batched, feeds)], want_hidden=True)
        for lm, f, out in zip(alone, feeds, outs):
            logits, hidden = lm.feed(f, want_hidden=True)
            assert out.logits.shape == logits.shape
            assert torch.allclose(out.logits, logits, atol=1e-4), (step, (out.logits - logits).abs().max())
            assert torch.allclose(out.hidden, hidden, atol=1e-4)
            assert torch.equal(out.logits.argmax(-1), logits.argmax(-1))
        for a, b, f in zip(alone, batched, feeds):
            assert a.length == b.length
            keep = a.length - len(f) // 2  # a rollback of part of what was just fed
            a.crop(keep)
            b.crop(keep)
            for la, lb in zip(a.cache.layers, b.cache.layers):
                assert torch.allclose(la.keys, lb.keys, atol=1e-5) and torch.allclose(la.values, lb.values, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_fed_in_one_forward_without_logits_equal_their_own_prefills(tiny, arch):
    """The batched prefill: prompts of 1, 7, 12 and 3 tokens from empty caches, LM head skipped; the caches and hidden
    states equal each prompt's own forward, and the next forward on top of them gives the same logits."""
    model = _load(tiny(arch))
    prompts = [_ids(30, 1), _ids(31, 7), _ids(32, 12), _ids(33, 3)]
    alone, batched = [CachedLM(model) for _ in prompts], [CachedLM(model) for _ in prompts]
    outs = feed_rows(model, [Row(lm, p) for lm, p in zip(batched, prompts)], want_hidden=True, logits=False)
    for lm, p, out in zip(alone, prompts, outs):
        _, hidden = lm.feed(p, want_hidden=True, last_logits_only=True)
        assert out.logits is None
        assert torch.allclose(out.hidden, hidden, atol=1e-4)
    for a, b, p in zip(alone, batched, prompts):
        assert a.length == b.length == len(p)
        nxt = _ids(40 + len(p), 2)
        assert torch.allclose(a.feed(nxt)[0], b.feed(nxt)[0], atol=1e-4)
    (single,) = feed_rows(model, [Row(CachedLM(model), prompts[1])], logits=False)
    assert single.logits is None


def test_feed_rows_custom_positions_and_visibility(tiny):
    """A row with its own visibility (the token skips one cached position) and positions equals the same forward
    alone with the same 4D mask; the other row of the batch is unaffected by it."""
    model = _load(tiny("llama"))
    prefix, new = _ids(5, 6), _ids(6, 2)
    visible = torch.ones(2, 8, dtype=torch.bool).tril(6)
    visible[:, 3] = False  # both new tokens skip cached position 3
    positions = [5, 6]  # as if position 3 were not there
    ref = CachedLM(model)
    ref.feed(prefix)
    mask = torch.zeros(1, 1, 2, 8)
    mask.masked_fill_(~visible[None, None], torch.finfo(torch.float32).min)
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([new]), attention_mask=mask, position_ids=torch.tensor([positions]),
                         cache=ref.cache, use_cache=True).logits[0]
    lm, other = CachedLM(model), CachedLM(model)
    lm.feed(prefix)
    other.feed(_ids(7, 11))
    other_alone = CachedLM(model)
    other_alone.feed(_ids(7, 11))
    out = feed_rows(model, [Row(lm, new, positions, visible), Row(other, [9])])
    assert torch.allclose(out[0].logits, expected.float(), atol=1e-4)
    assert torch.allclose(out[1].logits, other_alone.feed([9])[0], atol=1e-4)


def _session(model, tokenizer, sid: int, prompt: list[int], **params) -> Session:
    s = Session(sid, DynamicBackend(model), tokenizer, prompt,
                GenerationParams.from_dict({"eos_token_ids": [], **params}, 160), b"c", sid)
    s.prefill()
    return s


def _batched_round(model, sessions: list[Session], drafts: dict[int, list[int]]) -> None:
    plans = [s.plan_round(drafts.get(s.sid, []), None) for s in sessions]
    outs = feed_rows(model, [Row(s.lm, p.fed) for s, p in zip(sessions, plans)])
    for s, p, o in zip(sessions, plans, outs):
        s.finish_round(p, o.logits, None, 0.0, batch_sessions=len(sessions))


def test_batched_rounds_commit_what_each_session_commits_alone(tiny):
    """Ragged verifier rounds: mixed prompt lengths, mixed draft lengths (right, partly right, wrong, none), greedy and
    sampled sessions in one forward, an EOS inside a block and a max_new_tokens that cuts a block, sessions leaving
    when done and one joining mid-flight. Greedy sessions equal ``generate``; the sampled one equals itself run
    alone with the same seed."""
    folder = tiny("llama")
    model, tokenizer = _load(folder), AutoTokenizer.from_pretrained(folder)
    prompts = {1: _ids(20, 5), 2: _ids(21, 1), 3: _ids(22, 14), 4: _ids(23, 9), 5: _ids(24, 3)}
    truth = {sid: reference_greedy(folder, p, 30) for sid, p in prompts.items()}
    eos = truth[3][7]
    truth_eos = reference_greedy(folder, prompts[3], 30, eos=[eos])
    sampled = {"do_sample": True, "seed": 11, "temperature": 0.8, "max_new_tokens": 20}


    def sampled_draft(rnd: int) -> list[int]:  # one-hot drafts (q = None), the same in both runs
        return [7, 8, 9][: rnd % 4]

    alone = _session(model, tokenizer, 9, prompts[4], **sampled)
    for rnd in range(60):
        if alone.finished:
            break
        alone.verify(sampled_draft(rnd), None)
    sessions = {1: _session(model, tokenizer, 1, prompts[1], max_new_tokens=30),
                2: _session(model, tokenizer, 2, prompts[2], max_new_tokens=13),
                3: _session(model, tokenizer, 3, prompts[3], max_new_tokens=30, eos_token_ids=[eos]),
                4: _session(model, tokenizer, 4, prompts[4], **sampled)}
    rnd = 0
    while any(not s.finished for s in sessions.values()):
        if rnd == 3:
            sessions[5] = _session(model, tokenizer, 5, prompts[5], max_new_tokens=25)  # joins mid-flight
        live = [s for s in sessions.values() if not s.finished]
        drafts = {}
        for s in live:
            done = len(s.generated)
            right = (truth_eos if s.sid == 3 else truth.get(s.sid, []))[done:]
            kind = (s.sid + rnd) % 4
            mixed = [right[:4], [*right[:2], 3, 4, 5], [7, 7, 7, 7, 7, 7], []][kind]  # right, half, wrong, none
            drafts[s.sid] = sampled_draft(rnd) if s.sid == 4 else mixed
        _batched_round(model, live, drafts)
        rnd += 1
        assert rnd < 60
    assert sessions[1].generated == truth[1]
    assert sessions[2].generated == truth[2][:13] and sessions[2].finished == "length"
    assert sessions[3].generated == truth_eos and sessions[3].finished == "stop"
    assert sessions[5].generated == truth[5][:25]
    assert sessions[4].generated == alone.generated
    assert sessions[1].metrics.accepted_tokens > 0  # the right drafts were really accepted
    assert sessions[1].metrics.verify_batch_sum > sessions[1].metrics.rounds  # it shared forwards


PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8], [3, 4], [77, 78, 79, 80, 81, 82, 83, 84, 85]]


@pytest.mark.parametrize("batching", [True, False])
def test_cluster_batches_concurrent_requests_exactly(tiny, batching):
    """Eight concurrent requests through real nodes (mixed prompts, budgets, an EOS, a sampled one, one cancelled
    mid-flight, two joining later): every greedy one equals ``generate``; with batching on they shared forwards
    (``verify_batch_mean`` > 1, ping's ``mean_batch_sessions`` > 1), with it off every forward had one session."""
    target = tiny("qwen2")
    drafter = tiny("qwen2", "random")
    eos = reference_greedy(target, PROMPTS[0], 30)[6]
    cases = [(PROMPTS[i % 5], {"max_new_tokens": n, "eos_token_ids": []}) for i, n in enumerate((30, 12, 25, 7, 30))]
    cases.append((PROMPTS[0], {"max_new_tokens": 30, "eos_token_ids": [eos]}))
    config = tiny_config(target, drafter, num_draft_tokens=4, batching=batching)
    config["verifier"]["batching"] = batching

    async def cancelled(client):
        async for i, _ in _enumerate(client.stream(token_ids=PROMPTS[2], max_new_tokens=200, eos_token_ids=[])):
            if i == 2:
                return "left"  # leaving the stream cancels the request on the verifier

    async def late(client, prompt, params):
        await asyncio.sleep(0.3)
        return await client.generate(token_ids=prompt, **params)

    async def main():
        async with cluster(config) as client:
            await wait_for_drafter(client)
            results = await asyncio.gather(
                *(client.generate(token_ids=p, **params) for p, params in cases),
                client.generate(token_ids=PROMPTS[1], max_new_tokens=20, do_sample=True, seed=3, eos_token_ids=[]),
                cancelled(client),
                *(late(client, p, params) for p, params in cases[:2]),
            )
            pong = await client.ping()
        return results, pong

    results, pong = asyncio.run(main())
    greedy = [*results[: len(cases)], *results[-2:]]
    for (prompt, params), result in zip([*cases, *cases[:2]], greedy):
        expected = reference_greedy(target, prompt, params["max_new_tokens"], eos=params["eos_token_ids"])
        assert result.token_ids == expected, (prompt, params)
    assert len(results[len(cases)].token_ids) == 20
    assert results[len(cases) + 1] == "left"
    means = [r.metrics["verify_batch_mean"] for r in greedy]
    assert pong["forwards"] > 0 and pong["batching"] is batching
    if batching:
        assert max(means) > 1.0 and pong["mean_batch_sessions"] > 1.0
        assert pong["mean_batch_tokens"] > pong["mean_batch_sessions"]
    else:
        assert means == [1.0] * len(means) and pong["mean_batch_sessions"] == 1.0


async def _enumerate(aiter):
    i = 0
    async for item in aiter:
        yield i, item
        i += 1


def test_prompts_arriving_together_are_prefilled_in_shared_forwards(tiny):
    """Six requests at once (five prompts of 8 to 10 tokens and one of 1; one of 27 that waits for its own turn):
    their prompts are cached in fewer forwards than prompts (each forward is slowed so that they arrive while one
    runs), and every greedy output equals ``generate``."""
    target = tiny("llama")
    prompts = [[5, 17, 33, 2, 60, 6, 7, 8], [100], list(range(3, 30)), [9, 9, 8, 7, 6, 5, 4, 3, 2], list(range(70, 80)),
               [42] * 6 + [9, 8]]
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=2)

    async def main():
        async with cluster(config, entry={"verifier": node_entry("forward_delay", "0.05")}) as client:
            await wait_for_drafter(client)
            results = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=12, eos_token_ids=[])
                                             for p in prompts))
            return results, await client.ping()

    results, pong = asyncio.run(main())
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(target, prompt, 12), prompt
    assert 1 <= pong["prefill_forwards"] <= 3  # at best two: the four short ones together, the long one alone
    assert pong["mean_prefill_sessions"] > 1


def test_a_burst_of_requests_shares_one_prefill(tiny):
    """Six requests sent 5 ms apart (a client's burst): the verifier reads the burst before its first prefill, so
    the six prompts (8 tokens each) share one or two forwards instead of the first ones being prefilled alone (with
    the gather off: 3 to 5 forwards); outputs equal ``generate``."""
    target = tiny("llama")
    prompts = [[5 + i, 17, 33, 2, 60, 6, 7, 8] for i in range(6)]
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=2)

    async def main():
        async with cluster(config) as client:
            await wait_for_drafter(client)
            before = await client.ping()

            async def send(i: int, prompt: list[int]):
                await asyncio.sleep(0.005 * i)  # arrivals spread over 25 ms
                return await client.generate(token_ids=prompt, max_new_tokens=6, eos_token_ids=[])

            results = await asyncio.gather(*(send(i, p) for i, p in enumerate(prompts)))
            return results, before, await client.ping()

    results, before, after = asyncio.run(main())
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(target, prompt, 6), prompt
    forwards = after["prefill_forwards"] - before["prefill_forwards"]
    assert forwards <= 2, f"{forwards} prefill forwards for a burst of six prompts"
