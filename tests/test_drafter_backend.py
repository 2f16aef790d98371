"""The drafter's KV backend (``drafter.backend``): a draft session on static slots drafts exactly what one on a
dynamic cache drafts — tokens identical, probabilities to float rounding — through chain steps, rollbacks, pre-draft
rows adopted and dropped, and batched steps over adjacent and gathered slots; a slot that would overflow skips
pre-drafting or moves the session onto a dynamic cache (never an error); a closed session gives its slot back; and a
running cluster with ``drafter.backend: static`` gives greedy output identical to transformers' ``generate``."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from conftest import greedy_outputs, tiny_config
from transformers import AutoModelForCausalLM

from drafter_node.base import DraftToken
from drafter_node.lm_drafter import LMDraftSession, drafter_backend, predraft_room
from drafter_node.settings import DrafterConfig
from runtime.config import load_typed
from shared.backend import CompiledBackend, DynamicBackend, StaticBackend, StaticHandle
from shared.kv import CachedLM
from shared.sampling import GenerationParams
from testkit.tiny_models import reference_greedy

PROMPTS = [[5, 17, 33], [100, 101, 7, 9, 9, 9, 9], [42] * 12 + [9, 8], list(range(3, 40))]
GREEDY = GenerationParams(max_new_tokens=40)
ATOL = 1e-5
MAX_K = 6


def load(folder, attn: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def pair(model, backend, prompt, params=GREEDY):
    """The same request on ``backend``'s slots and on a dynamic cache."""
    static = LMDraftSession(backend, prompt, len(prompt), params, 0, model.config.vocab_size, max_draft_tokens=MAX_K)
    dynamic = LMDraftSession(DynamicBackend(model), prompt, len(prompt), params, 0, model.config.vocab_size)
    return static, dynamic


def assert_same(a: list[DraftToken], b: list[DraftToken]) -> None:
    assert [t.token for t in a] == [t.token for t in b]
    assert [t.alt for t in a] == [t.alt for t in b]
    for x, y in zip(a, b):
        assert abs(x.prob - y.prob) <= ATOL and abs((x.alt_prob or 0) - (y.alt_prob or 0)) <= ATOL


def assert_sessions_same(static: LMDraftSession, dynamic: LMDraftSession) -> None:
    assert static.committed == dynamic.committed
    assert_same(static.chain, dynamic.chain)
    assert static.lm.length == dynamic.lm.length
    if static.branches is not None:
        assert dynamic.branches is not None and static.branches.rows == dynamic.branches.rows
        for a, b in zip(static.branches.drafted, dynamic.branches.drafted):
            assert_same(a, b)


def unpredicted(session: LMDraftSession, r: int) -> list[int]:
    """A commit that keeps ``r`` drafts, then a token no pre-draft row guessed at r."""
    guessed = {g for rr, g, _ in session.outcomes if rr == r} | {session.chain_tokens[r]}
    return [*session.chain_tokens[:r], next(t for t in range(3, 200) if t not in guessed)]


@pytest.mark.parametrize(("arch", "kind"), [
    *(pytest.param(arch, "static", marks=pytest.mark.unit) for arch in ("llama", "qwen2", "gpt2")),
    pytest.param("llama", "compiled", marks=pytest.mark.compile),  # a torch.compile warm-up: not the unit tier
])
def test_a_session_on_slots_drafts_what_a_dynamic_one_does(tiny, arch, kind):
    model = load(tiny(arch))
    if kind == "compiled":  # the drafter's chain steps through the compiled step (1 token: bucket 1; catch-ups: 2)
        backend = CompiledBackend(model, slots=2, slot_tokens=256, buckets=(1, 2), min_width=64)
        backend.warm_up()  # steps compile at start-up only (past width 64 they run eagerly)
    else:
        backend = StaticBackend(model, slots=2, slot_tokens=256)
    static, dynamic = pair(model, backend, PROMPTS[1])
    assert isinstance(static.lm, StaticHandle)

    def both(call):
        results = [call(s) for s in (static, dynamic)]
        assert results[0] == results[1]
        assert_sessions_same(static, dynamic)

    both(lambda s: s.propose(5))
    both(lambda s: s.observe_commit([*s.chain_tokens[:2], s.chain[2].alt]))  # a rejection at 2: rollback
    both(lambda s: s.propose(4))
    both(lambda s: s.begin_speculation(3))
    for _ in range(3):
        both(lambda s: s.speculate_step())
    hit = static.outcomes[1]  # a correction or the bonus, not only the likeliest row
    both(lambda s: s.observe_commit([*s.chain_tokens[: hit[0]], hit[1]]))  # adopted: a pre-draft hit
    assert len(static.chain) == 3
    both(lambda s: s.propose(2))
    both(lambda s: s.begin_speculation(4, max_rows=3))
    for _ in range(2):
        both(lambda s: s.speculate_step())
    both(lambda s: s.observe_commit(unpredicted(s, 1)))  # no row predicted it: rows dropped, rollback
    both(lambda s: s.propose(5))
    both(lambda s: s.begin_speculation(2))
    both(lambda s: s.speculate_step())
    both(lambda s: s.propose(1))  # drafting the chain again drops the rows
    assert isinstance(static.lm, StaticHandle)  # never left its slot
    if kind == "compiled":
        assert backend.failure is None and backend.compiled_steps > 0
    static.close()
    assert sorted(backend.free) == [0, 1]  # the slot went back
    static.close()  # idempotent


def run_batch(backend, steps) -> None:
    """One forward of the backend over the steps' rows, then each step's finish."""
    rows = [row for step in steps for row in step.rows]
    outputs = backend.feed_rows(rows)
    start = 0
    for step in steps:
        step.finish(outputs[start : start + len(step.rows)])
        start += len(step.rows)


def alone(session: LMDraftSession) -> None:
    """The step ``batch_step`` stands for, taken alone."""
    if session.speculation_depth is not None:
        session.speculate_step()
    else:
        session.propose(1)


@pytest.mark.unit
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batched_steps_over_slots_draft_what_each_session_alone_does(tiny, arch):
    model = load(tiny(arch))
    backend = StaticBackend(model, slots=len(PROMPTS), slot_tokens=256)
    pairs = [pair(model, backend, p) for p in PROMPTS]
    statics = [s for s, _ in pairs]
    assert [s.lm.slot for s in statics] == [0, 1, 2, 3]

    def step_all(order):
        steps = [statics[i].batch_step() for i in order]
        assert all(step is not None for step in steps)
        run_batch(backend, steps)
        for i in order:
            alone(pairs[i][1])
        for s, d in pairs:
            assert_sessions_same(s, d)

    for _ in range(4):
        step_all([0, 1, 2, 3])  # adjacent slots in order: a view of the pool
    for s, d in pairs:  # rejections at different positions: rows of several tokens next
        for session in (s, d):
            session.observe_commit([*session.chain_tokens[: statics.index(s) % 3], 7])
    for _ in range(3):
        step_all([3, 1, 0, 2])  # gathered slots
    for s, d in pairs:
        for session in (s, d):
            assert session.begin_speculation(2, max_rows=2)
    for _ in range(3):
        step_all([2, 0, 3, 1])  # pre-draft rows of every session in one forward
    for i, (s, d) in enumerate(pairs):
        for session in (s, d):
            if i % 2:  # adopt the session's second row / drop them all
                r, guess, _ = session.outcomes[1]
                session.observe_commit([*session.chain_tokens[:r], guess])
            else:
                session.observe_commit(unpredicted(session, 0))
        assert_sessions_same(s, d)
    for _ in range(3):
        step_all([0, 1, 2, 3])
    assert all(isinstance(s.lm, StaticHandle) for s in statics)


@pytest.mark.unit
def test_a_full_slot_skips_pre_drafts_and_moves_the_session_to_a_dynamic_cache(tiny, caplog):
    model = load(tiny("llama"))
    prompt = PROMPTS[0]
    params = GenerationParams(max_new_tokens=1)
    # room for the prompt, one new token and max_draft_tokens = 1's pre-draft rows (3), plus 3
    backend = StaticBackend(model, slots=1, slot_tokens=len(prompt) + 1 + predraft_room(1) + 3)
    static = LMDraftSession(backend, prompt, len(prompt), params, 0, model.config.vocab_size, max_draft_tokens=1)
    dynamic = LMDraftSession(DynamicBackend(model), prompt, len(prompt), params, 0, model.config.vocab_size)
    assert isinstance(static.lm, StaticHandle) and static.lm.capacity == len(prompt) + 7
    static.propose(5)
    dynamic.propose(5)
    assert_same(static.chain, dynamic.chain)  # the cache holds 3 + 4 = 7 of 10
    assert not static.begin_speculation(4)  # five rows do not fit the last three positions
    assert static.branches is None
    assert static.begin_speculation(4, max_rows=2)  # two do, for one step
    static.speculate_step()
    with caplog.at_level(logging.INFO, logger="pipespec.drafter"):
        static.speculate_step()  # no room for another: the rows go, the single chain grows
        assert static.branches is None and isinstance(static.lm, StaticHandle)
        static.propose(10)  # until the slot is full: then on a dynamic cache
        assert type(static.lm) is CachedLM
    assert "outgrew its KV slot" in caplog.text
    dynamic.propose(11)
    assert_same(static.chain, dynamic.chain)
    assert backend.free == [0]  # the slot went back when the session left it
    static.close()
    # a request longer than a slot gets a dynamic cache at once
    long = LMDraftSession(backend, prompt, len(prompt), GenerationParams(max_new_tokens=40), 0,
                          model.config.vocab_size, max_draft_tokens=1)
    assert type(long.lm) is CachedLM and backend.fallbacks == 2  # the outgrown session's handle, and this one


@pytest.mark.unit
def test_the_drafter_backend_follows_its_config_keys(tiny):
    model = load(tiny("llama"))
    settings = load_typed(tiny_config(tiny("llama"), tiny("llama", "random"), backend="static")).drafter
    backend = drafter_backend(model, settings)
    assert isinstance(backend, StaticBackend) and backend.slots == 8  # the smaller of max_batch_sessions and 8
    assert backend.slot_tokens == min(4096, model.config.max_position_embeddings)
    settings = dataclasses.replace(settings, kv_slots=3, kv_slot_tokens=100, max_batch_sessions=2)
    backend = drafter_backend(model, settings)
    assert (backend.slots, backend.slot_tokens) == (3, 100)
    settings = dataclasses.replace(settings, kv_slots=None)
    assert drafter_backend(model, settings).slots == 2
    assert isinstance(drafter_backend(model, dataclasses.replace(settings, backend="dynamic")), DynamicBackend)


CLUSTER_PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [42] * 12 + [9, 8]]


def static_cluster_config(tiny) -> dict:
    """Two drafter slots of 128 tokens: a request (≤ 14 + 20 tokens) and its pre-draft room (6 · 8) fit one."""
    return tiny_config(tiny("llama"), tiny("llama", "random"), num_draft_tokens=4, max_draft_tokens=6,
                       backend="static", kv_slots=2, kv_slot_tokens=128)


@pytest.mark.unit
def test_the_clusters_drafter_sessions_get_slots(tiny):
    from drafter_node.assistant import AssistantDrafter

    drafter = AssistantDrafter(load_typed(static_cluster_config(tiny)).drafter)
    params = GenerationParams(max_new_tokens=20, eos_token_ids=[])
    sessions = [drafter.open_session(p, len(p), params, {}) for p in CLUSTER_PROMPTS]
    assert [type(s.lm) for s in sessions] == [StaticHandle, StaticHandle, CachedLM]  # two slots, then dynamic
    sessions[0].close()
    assert isinstance(drafter.open_session(CLUSTER_PROMPTS[0], 5, params, {}).lm, StaticHandle)


@pytest.mark.cluster
def test_cluster_with_a_static_drafter_backend_matches_transformers(tiny):
    """Three concurrent requests on two drafter slots (one on a dynamic cache, mixed batches, pre-draft rows in the
    slots): every greedy output equals ``generate``."""
    target = tiny("llama")
    config = static_cluster_config(tiny)
    prompts = CLUSTER_PROMPTS
    expected = [reference_greedy(target, p, 20) for p in prompts]
    results = greedy_outputs(config, prompts, 20)
    assert [r.token_ids for r in results] == expected


@pytest.mark.unit
def test_a_drafter_model_without_static_slots_gets_dynamic_caches(tmp_path, caplog):
    from testkit.tiny_hybrid import build_hybrid
    from testkit.tiny_models import build_tokenizer

    build_tokenizer(tmp_path / "tok")
    model = AutoModelForCausalLM.from_pretrained(
        build_hybrid(tmp_path / "qwen3_next", "qwen3_next", tmp_path / "tok", seed=3), dtype=torch.float32).eval()
    with caplog.at_level(logging.INFO, logger="pipespec.backend"):
        backend = drafter_backend(model, DrafterConfig(backend="auto", kv_slots=None, kv_slot_tokens=64,
                                                       max_batch_sessions=4))
    assert isinstance(backend, DynamicBackend)
    assert "drafter: KV backend auto falls back to dynamic caches" in caplog.text
    session = LMDraftSession(backend, PROMPTS[0], 3, GREEDY, 0, model.config.vocab_size)
    assert session.propose(2) == 2 and type(session.lm) is CachedLM
    session.close()
