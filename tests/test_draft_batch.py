"""Batched drafting: many sessions' drafter steps (chain tokens and pre-draft rows) in one forward draft exactly
what each session's own steps draft — greedy and sampled, after rollbacks (rows of several tokens), with pre-draft
rows of several sessions in one forward, and after adopting a pre-drafted row.

Tokens must be identical; probabilities agree to float32 rounding (a batched forward pads and stacks, so its
matmuls are not bit-identical to a batch-1 forward's)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_node.base import BatchStep, DraftToken
from drafter_node.lm_drafter import LMDraftSession
from shared.batch import feed_rows
from shared.sampling import GenerationParams

PROMPTS = [[5, 17, 33], [100, 101, 7, 9, 9, 9, 9], [42] * 12 + [9, 8], list(range(3, 40))]
ATOL = 1e-5


def load(folder, attn: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def open_sessions(model, params: GenerationParams, q_top_m: int = 0) -> list[LMDraftSession]:
    return [LMDraftSession(model, p, len(p), params, q_top_m, model.config.vocab_size) for p in PROMPTS]


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
    ended = LMDraftSession(model, PROMPTS[0], 3, GenerationParams(eos_token_ids=[together[0].chain_tokens[0]]), 0,
                           model.config.vocab_size)
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
    from tiny_models import build_gemma4_pair

    gemma, _ = build_gemma4_pair(model_dir / "draftbatch", tokenizer_dir)
    model = load(gemma)
    session = LMDraftSession(model, PROMPTS[0], 3, GREEDY, 0, model.config.vocab_size)
    assert session.batch_step() is None  # sliding-window layers: no stacked cache
    assert session.propose(1) == 1
