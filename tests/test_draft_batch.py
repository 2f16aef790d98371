"""Batched drafting: many sessions' drafter steps (chain tokens and pre-draft rows) in one forward draft exactly
what each session's own steps draft — greedy and sampled, after rollbacks (rows of several tokens), with pre-draft
rows of several sessions in one forward, and after adopting a pre-drafted row; the node's batched loop gives
greedy output identical to transformers' ``generate``, and the request metrics count the sessions per forward.

Tokens must be identical; probabilities agree to float32 rounding (a batched forward pads and stacks, so its
matmuls are not bit-identical to a batch-1 forward's)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from conftest import tiny_config
from node_entry import node_entry
from transformers import AutoModelForCausalLM

from drafter_node.base import BatchStep, DraftToken
from drafter_node.lm_drafter import LMDraftSession
from drafter_node.node import DrafterNode
from runtime.config import ConfigError, load_config, typed
from runtime.launch import cluster
from runtime.security import drafter_links
from shared.backend import DynamicBackend, StaticHandle
from shared.batch import feed_rows
from shared.protocol import SessionEnd, SessionStart
from shared.sampling import GenerationParams
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.cluster

PROMPTS = [[5, 17, 33], [100, 101, 7, 9, 9, 9, 9], [42] * 12 + [9, 8], list(range(3, 40))]
ATOL = 1e-5


def load(folder, attn: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def open_sessions(model, params: GenerationParams, q_top_m: int = 0) -> list[LMDraftSession]:
    return [LMDraftSession(DynamicBackend(model), p, len(p), params, q_top_m, model.config.vocab_size) for p in PROMPTS]


def batched_step(model, sessions) -> int:
    """One batched forward over every session's next step; returns the forward's rows (new tokens)."""
    steps: list[BatchStep] = [s.batch_step() for s in sessions]
    assert all(step is not None for step in steps)
    rows = [row for step in steps for row in step.rows]
    outputs = feed_rows(model, rows)
    start = 0
    for step in steps:
        step.finish(outputs[start : start + len(step.rows)])
        start += len(step.rows)
    return sum(len(row.tokens) for row in rows)


def assert_same_tokens(a: list[DraftToken], b: list[DraftToken]) -> None:
    assert [t.token for t in a] == [t.token for t in b]
    for x, y in zip(a, b):
        assert x.alt == y.alt
        for name in ("prob", "alt_prob"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None) and (u is None or abs(u - v) < ATOL), name
        assert (x.q_idx is None) == (y.q_idx is None)
        if x.q_idx is not None:
            assert torch.equal(x.q_idx, y.q_idx)
            assert torch.allclose(x.q_prob, y.q_prob, atol=ATOL)


def assert_same_sessions(alone, together) -> None:
    for a, b in zip(alone, together):
        assert a.committed == b.committed
        assert_same_tokens(a.chain, b.chain)
        assert a.lm.length == b.lm.length == b.lm.cache.layers[0].keys.shape[-2]


GREEDY = GenerationParams(max_new_tokens=60, eos_token_ids=[])
SAMPLED = GenerationParams(max_new_tokens=60, do_sample=True, temperature=0.9, top_k=20, seed=7, eos_token_ids=[])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_chain_steps_draft_what_each_session_drafts_alone(tiny, arch, params):
    model = load(tiny(arch, "random"))
    alone, together = open_sessions(model, params, 16), open_sessions(model, params, 16)
    for s in together:
        s.want_q = params is GREEDY  # greedy q too: the top-m rows must agree as well
    for s in alone:
        s.want_q = params is GREEDY
    for _ in range(5):
        for s in alone:
            assert s.propose(1) == 1
        rows = batched_step(model, together)
    assert rows == len(PROMPTS)  # one token per session once the prompts are cached
    assert_same_sessions(alone, together)
    # Commits that reject: a correction at position 1 (1 chain token kept, 2 new tokens uncached), a rejection
    # at 0 (3 uncached), a full hit (nothing to undo), a bonus commit after a partial match.
    commits = [lambda c: [c[0], (c[1] + 1) % 160, 7], lambda c: [(c[0] + 1) % 160, 8, 9], lambda c: c[:3],
               lambda c: [*c[:2], (c[2] + 3) % 160]]
    for a, b, commit in zip(alone, together, commits):
        tokens = commit(a.chain_tokens)
        assert a.observe_commit(tokens) == b.observe_commit(tokens)
    widths = [step.width for step in (s.batch_step() for s in together)]
    assert widths == [2, 3, 1, 1]  # rows of several tokens: what the cache lacks after each rollback
    for _ in range(4):
        for s in alone:
            s.propose(1)
        batched_step(model, together)
    assert_same_sessions(alone, together)


def test_batched_steps_with_a_session_that_prefills_and_one_that_ended(tiny):
    model = load(tiny("llama"))
    params = GenerationParams(max_new_tokens=60, eos_token_ids=[])
    alone, together = open_sessions(model, params), open_sessions(model, params)
    for s in alone[1:]:
        s.propose(2)
    for _ in range(2):
        batched_step(model, together[1:])
    # session 0 joins with its prompt uncached (a row of 3 tokens on an empty cache, next to cached rows)
    for _ in range(3):
        for s in alone:
            s.propose(1)
        batched_step(model, together)
    assert_same_sessions(alone, together)
    ended = LMDraftSession(DynamicBackend(model), PROMPTS[0], 3,
                           GenerationParams(eos_token_ids=[together[0].chain_tokens[0]]), 0, model.config.vocab_size)
    ended.propose(1)
    assert ended.ended and ended.batch_step() is None  # nothing to add: it steps alone (propose returns 0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_pre_draft_rows_of_several_sessions_in_one_forward(tiny, arch, attn):
    model = load(tiny(arch, "random"), attn)
    params = GenerationParams(max_new_tokens=60, eos_token_ids=[])
    alone, together = open_sessions(model, params), open_sessions(model, params)
    blocks = [4, 2, 3, 4]
    max_rows = [None, 2, 1, 3]
    for group in (alone, together):
        for s, k, r in zip(group, blocks, max_rows):
            s.propose(k)
            assert s.begin_speculation(k, r)
    # one session stays on its chain (no speculation): chain rows and pre-draft rows share the forward
    plain_alone, plain_together = open_sessions(model, params)[:1], open_sessions(model, params)[:1]
    for s in (*plain_alone, *plain_together):
        s.propose(1)
    for _ in range(3):
        for s in alone:
            s.speculate_step()
        plain_alone[0].propose(1)
        rows = batched_step(model, [*together, *plain_together])
        assert rows == sum(len(s.branches.rows) for s in together) + 1
    for a, b in zip(alone, together):
        assert a.branches.rows == b.branches.rows
        for da, db in zip(a.branches.drafted, b.branches.drafted):
            assert_same_tokens(da, db)
        assert b.lm.length == b.lm.cache.layers[0].keys.shape[-2]  # the cache's every slot: stackable
    assert_same_sessions(plain_alone, plain_together)
    # Commits: a pre-drafted row confirmed (adopted), and one no row predicted (rolled back), then more steps.
    for i, (a, b) in enumerate(zip(alone, together)):
        if i % 2 == 0:
            r, guess = a.branches.rows[-1]
            tokens = [*a.chain_tokens[:r], guess]
        else:
            tokens = [(a.chain_tokens[0] + 1) % 160, 5]
        assert a.observe_commit(tokens) == b.observe_commit(tokens)
        assert (a.branches, b.branches) == (None, None)
    for _ in range(3):
        for s in (*alone, *plain_alone):
            s.propose(1)
        batched_step(model, [*together, *plain_together])
    assert_same_sessions(alone, together)
    assert_same_sessions(plain_alone, plain_together)


def test_sessions_that_cannot_batch_step_alone(tiny, model_dir, tokenizer_dir):
    from testkit.tiny_models import build_gemma4_pair

    gemma, _ = build_gemma4_pair(model_dir / "draftbatch", tokenizer_dir)
    model = load(gemma)
    session = LMDraftSession(DynamicBackend(model), PROMPTS[0], 3, GREEDY, 0, model.config.vocab_size)
    assert session.batch_step() is None  # sliding-window layers: no stacked cache
    assert session.propose(1) == 1


def test_config_max_batch_sessions(tiny):
    config = load_config(tiny_config(tiny("llama"), None))
    assert config["drafter"]["max_batch_sessions"] == 64 and config["drafter"]["batching"] is True
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ConfigError, match=r"drafter\.max_batch_sessions"):
            load_config(tiny_config(tiny("llama"), None, max_batch_sessions=bad))


# ---------------------------------------------------------------------------------------------------- the node
@pytest.fixture
def node_for(tiny, tmp_path):
    """``node_for(**drafter_keys)`` → a DrafterNode over the tiny random llama with one session per prompt, all
    wanting a step (no verifier: the loop's parts are called by hand)."""
    nodes = []

    def make(**keys):
        config = load_config(tiny_config(tiny("llama"), tiny("llama", "random"), num_draft_tokens=4, **keys))
        config["verifier"]["endpoint"] = f"ipc://{tmp_path}/nobody.ipc"
        node = DrafterNode.from_config(typed(config), links=drafter_links(config))
        nodes.append(node)
        for sid, prompt in enumerate(PROMPTS):
            node.handler.on_session_start(SessionStart(session=sid, token_ids=prompt, params=GREEDY.to_dict()))
        return node

    yield make
    for node in nodes:
        node.sock.close(linger=0)


def reference_chains(node, steps: int) -> list[list[int]]:
    model = node.drafter.model
    out = []
    for prompt in PROMPTS:
        s = LMDraftSession(DynamicBackend(model), prompt, len(prompt), GREEDY, 0, model.config.vocab_size)
        s.propose(steps)
        out.append(s.chain_tokens)
    return out


def test_node_batches_every_session_that_wants_a_step_up_to_the_cap(node_for):
    node = node_for(max_batch_sessions=3)
    s0, s1, s2, s3 = (node.picker.sessions[sid] for sid in range(4))
    # Prompts not cached yet: rows of 3, 7, 14 and 37 tokens. A row longer than max_draft_tokens + 1 (a prefill, a
    # long catch-up) steps alone; others join only with rows no longer than the work's (a forward pads to its
    # longest row), or 2 tokens.
    assert node._gather_steps(s3) is None
    assert [s.sid for s, _ in node._gather_steps(s1)] == [1, 0]
    for s in (s0, s1, s2, s3):
        s.step()
    assert [(s.stats.batch_steps, s.stats.batch_rows) for s in (s0, s1, s2, s3)] == [(1, 1)] * 4
    batch = node._gather_steps(s1)
    assert [s.sid for s, _ in batch] == [1, 0, 2]  # the work first, then round-robin order, up to the cap
    node._run_steps(batch)
    batch = node._gather_steps(s3)
    assert [s.sid for s, _ in batch] == [3, 0, 1]
    node._run_steps(batch)
    stats = [(s.stats.batch_steps, s.stats.batch_rows) for s in (s0, s1, s2, s3)]
    assert stats == [(3, 7), (3, 7), (2, 4), (2, 4)]
    reference = reference_chains(node, 3)
    for s in (s0, s1, s2, s3):
        assert s.draft.chain_tokens == reference[s.sid][: len(s.draft.chain)]
    assert [len(s.draft.chain) for s in (s0, s1, s2, s3)] == [3, 3, 2, 2]


def test_node_without_batching_steps_one_session(node_for):
    node = node_for(batching=False)
    assert node.picker.max_batch_sessions == 1 and node._gather_steps(node.picker.sessions[0]) is None


def prefilled(node):
    for s in node.picker.sessions.values():
        s.step()
    return node


def test_a_failing_batched_forward_steps_each_session_alone(node_for, monkeypatch):
    node = prefilled(node_for())
    batch = node._gather_steps(node.picker.sessions[0])
    assert len(batch) == len(PROMPTS)

    def broken(*args, **kwargs):
        raise RuntimeError("no batched forward today")

    monkeypatch.setattr(node, "_feed_rows", broken)  # the batched forward, whichever KV backend runs it
    node._run_steps(batch)
    reference = reference_chains(node, 2)
    assert [s.draft.chain_tokens for s in node.picker.sessions.values()] == reference
    assert all(s.stats.batch_steps == s.stats.batch_rows == 2 for s in node.picker.sessions.values())


def test_the_nodes_batched_steps_run_on_its_backends_static_slots(node_for, monkeypatch):
    node = prefilled(node_for())  # drafter.backend: auto → static slots for the tiny llama
    backend = node.drafter.backend
    assert backend.name == "static"
    assert all(isinstance(s.draft.lm, StaticHandle) for s in node.picker.sessions.values())
    forwards, feed = [], backend.feed_rows
    monkeypatch.setattr(backend, "feed_rows", lambda rows, **kw: forwards.append(len(rows)) or feed(rows, **kw))
    node._run_steps(node._gather_steps(node.picker.sessions[0]))
    assert forwards == [len(PROMPTS)]
    assert [s.draft.chain_tokens for s in node.picker.sessions.values()] == reference_chains(node, 2)
    node.handler.on_session_end(SessionEnd(session=0))
    assert len(backend.free) == backend.slots - len(PROMPTS) + 1  # its slot went back


def test_a_session_whose_finish_fails_is_dropped_alone(node_for, monkeypatch):
    node = prefilled(node_for())
    batch = node._gather_steps(node.picker.sessions[0])

    def broken(*args, **kwargs):
        raise RuntimeError("bad state")

    monkeypatch.setattr(node.picker.sessions[2].draft, "pick", broken)
    node._run_steps(batch)
    assert sorted(node.picker.sessions) == [0, 1, 3] and list(node.picker.order) == [0, 1, 3]
    reference = reference_chains(node, 2)
    assert [node.picker.sessions[sid].draft.chain_tokens for sid in (0, 1, 3)] == [reference[i] for i in (0, 1, 3)]
    assert all(s.stats.batch_rows == 1 + len(PROMPTS) for s in node.picker.sessions.values())


def test_a_session_whose_batch_step_fails_is_dropped_and_the_others_still_batch(node_for, monkeypatch):
    node = prefilled(node_for())

    def broken(*args, **kwargs):
        raise RuntimeError("bad state")

    monkeypatch.setattr(node.picker.sessions[1].draft, "batch_step", broken)
    batch = node._gather_steps(node.picker.sessions[0])
    assert [s.sid for s, _ in batch] == [0, 2, 3] and sorted(node.picker.sessions) == [0, 2, 3]


# ---------------------------------------------------------------------------------------------------- end to end
E2E_PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8], list(range(3, 30)), [9, 9], [70, 71, 72, 73]]
E2E_NEW = [30, 24, 28, 20, 32, 26]


@pytest.mark.parametrize(("drafter", "batching"), [("random", True), ("target", True), ("random", False)],
                         ids=["batched-rejecting", "batched-predrafting", "one-by-one"])
def test_concurrent_greedy_requests_match_transformers(tiny, drafter, batching):
    """A random drafter (mostly rejected: chain steps after rollbacks, the verifier waiting) and the target itself
    (everything accepted: pre-draft rows of several sessions in one forward; the verifier's forwards are slowed so
    that the drafter, as fast as the verifier on these tiny models, gets ahead however loaded the machine is)."""
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", drafter), num_draft_tokens=3, batching=batching)
    expected = [reference_greedy(target, p, n) for p, n in zip(E2E_PROMPTS, E2E_NEW)]
    entry = {"verifier": node_entry("forward_delay", "0.05")} if drafter == "target" else None

    async def main():
        async with cluster(copy.deepcopy(config), entry=entry) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=n, eos_token_ids=[])
                                          for p, n in zip(E2E_PROMPTS, E2E_NEW)))

    results = asyncio.run(main())
    for prompt, result, want in zip(E2E_PROMPTS, results, expected):
        assert result.token_ids == want, f"prompt {prompt}"
    means = [r.metrics["draft_batch_mean"] for r in results]
    assert all(r.metrics["drafts"] > 0 for r in results)
    if drafter == "target":
        assert all(r.metrics["acceptance_rate"] == 1.0 for r in results)
        assert sum(r.metrics["predraft_hits"] for r in results) > 0
    if batching:
        assert max(means) > 1, means
        assert all(m >= 1 for m in means), means
    else:
        assert means == [1.0] * len(results), means
