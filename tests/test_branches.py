"""Multi-outcome pre-drafting: every outcome row, flattened into the session's batch-1 cache, drafts exactly what a
from-scratch run on that row's sequence would; an adopted row's cache continues exactly like a fresh cache of its
sequence; the cache is never copied or repeated (adoption touches only the tail, whatever the context length); and
outcomes are ranked by the drafter's own probabilities."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from drafter_node.base import DraftToken
from drafter_node.branches import Branches, rank_outcomes
from drafter_node.lm_drafter import LMDraftSession, choose
from shared.backend import DynamicBackend
from shared.kv import CachedLM
from shared.sampling import GenerationParams
from testkit.tiny_models import build_gemma4_pair

pytestmark = pytest.mark.unit

COMMITTED = [5, 17, 33, 2, 60, 7]
BLOCK = [11, 12, 13, 14]
ALL_ROWS = [(0, 40), (1, 41), (2, 42), (3, 43), (4, 44)]  # a different assumed verifier token for each outcome
# A plan: a subset in no particular order, with two guesses for one outcome.
SOME_ROWS = [(3, 43), (0, 40), (3, 90), (4, 44)]
STEPS = 3


def load(folder, attn: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def scratch_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def greedy_rows(logits: torch.Tensor, contexts) -> list[DraftToken]:
    return [DraftToken(int(row.argmax())) for row in logits]


def cache_len(lm: CachedLM) -> int:
    return lm.cache.layers[0].keys.shape[-2]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("rows", [ALL_ROWS, SOME_ROWS], ids=["all", "subset"])
def test_rows_match_from_scratch_and_adopted_cache_continues(tiny, arch, attn, rows):
    model = load(tiny(arch), attn)
    for index, (r, guess) in enumerate(rows):
        lm = CachedLM(model)
        lm.feed(COMMITTED + BLOCK)
        branches = Branches(DynamicBackend(model), lm, len(COMMITTED), BLOCK, rows)
        for _ in range(STEPS):
            seen = []
            branches.step(lambda logits, contexts, seen=seen: seen.append(logits) or greedy_rows(logits, contexts))
            assert lm.cache.layers[0].keys.shape[0] == 1  # one sequence: rows are slots, not batch rows
            expected = scratch_logits(model, COMMITTED + branches.context(index)[:-1])
            assert torch.allclose(seen[0][index], expected, atol=1e-4), f"row {index}"
        seq = [*COMMITTED, *BLOCK[:r], guess]
        for _ in range(STEPS):
            seq.append(int(scratch_logits(model, seq).argmax()))
        assert [*COMMITTED, *branches.context(index)] == seq, f"row {index}"
        chain = branches.adopt(index, lm)
        assert [t.token for t in chain] == seq[-STEPS:]
        assert lm.length == len(seq) - 1 == cache_len(lm)  # the last drafted token is not cached yet
        logits, _ = lm.feed([seq[-1]])
        assert torch.allclose(logits[-1], scratch_logits(model, seq), atol=1e-4), f"row {index}"


def test_match_names_the_confirmed_row(tiny):
    model = load(tiny("llama"))
    lm = CachedLM(model)
    lm.feed(COMMITTED + BLOCK)
    branches = Branches(DynamicBackend(model), lm, len(COMMITTED), BLOCK, SOME_ROWS)
    assert branches.match([40]) == 1
    assert branches.match([11, 12, 13, 90]) == 2
    assert branches.match([11, 12, 13, 14, 44]) == 3
    assert branches.match([11, 12, 41]) is None  # outcome 2 is not in the plan
    assert branches.match([11, 99, 13, 43]) is None  # the kept drafts differ
    assert branches.match([]) is None


def test_discard_returns_to_committed_plus_block_and_drafting_continues(tiny):
    model = load(tiny("llama"))
    lm = CachedLM(model)
    lm.feed(COMMITTED + BLOCK)
    branches = Branches(DynamicBackend(model), lm, len(COMMITTED), BLOCK, ALL_ROWS)
    for _ in range(2):
        branches.step(greedy_rows)
    branches.discard(lm)
    assert lm.length == cache_len(lm) == len(COMMITTED + BLOCK)
    lm.crop(len(COMMITTED) + 1)  # the rollback a rejection at position 1 does
    logits, _ = lm.feed([77])
    assert torch.allclose(logits[-1], scratch_logits(model, [*COMMITTED, BLOCK[0], 77]), atol=1e-4)


def test_commit_matching_a_row_is_a_hit_and_others_roll_back(tiny):
    model = load(tiny("llama"))
    params = GenerationParams(max_new_tokens=50)
    session = LMDraftSession(DynamicBackend(model), COMMITTED, len(COMMITTED), params, q_top_m=0,
                             vocab_size=model.config.vocab_size)
    session.propose(4)
    block = session.chain_tokens[:3]
    assert session.begin_speculation(3)
    for _ in range(2):
        session.speculate_step()
    alt = session.chain[1].alt
    # the verifier accepted one draft and corrected the second to the drafter's next-best guess
    assert session.observe_commit([block[0], alt]) == 2
    expected = [*COMMITTED, block[0], alt]
    for _ in range(2):
        expected.append(int(scratch_logits(model, expected).argmax()))
    assert session.committed + session.chain_tokens == expected
    # a commit no row predicted: everything speculative is dropped, and drafting resumes from the commit
    session.begin_speculation(1)
    wrong = (session.chain[0].alt + 1) % 160
    if wrong == session.chain[0].token:
        wrong = (wrong + 1) % 160
    assert session.observe_commit([wrong]) == 0
    assert session.chain == [] and session.speculation_depth is None
    session.propose(1)
    assert session.chain_tokens == [int(scratch_logits(model, session.committed).argmax())]


def test_a_plan_of_the_likeliest_rows(tiny):
    model = load(tiny("qwen2"))
    session = LMDraftSession(DynamicBackend(model), COMMITTED, len(COMMITTED), GenerationParams(max_new_tokens=50), 0,
                             model.config.vocab_size)
    session.propose(4)
    assert session.begin_speculation(3)  # max_rows=None: every outcome, the same guesses as before plans
    every = session.branches
    assert sorted(every.rows) == [(r, session.chain[r].alt) for r in range(3)] + [(3, session.chain[3].token)]
    ranked = session.outcome_weights()
    assert [(r, g) for r, g, _ in ranked] == every.rows
    assert every.hit_weight == pytest.approx(sum(w for *_, w in ranked))
    assert session.begin_speculation(3, max_rows=2)
    assert session.branches.rows == [(r, g) for r, g, _ in ranked[:2]]
    assert session.branches.hit_weight == pytest.approx(ranked[0][2] + ranked[1][2])
    assert cache_len(session.lm) == session.lm.length == len(COMMITTED) + 3  # the earlier plan's slots are gone
    session.speculate_step()
    # the second likeliest outcome happens: a hit with the pre-drafted token ready
    r, guess, _ = ranked[1]
    tokens = [*session.chain_tokens[:r], guess]
    assert session.observe_commit(tokens) == len(tokens)
    expected = [*COMMITTED, *tokens]
    assert session.chain_tokens == [int(scratch_logits(model, expected).argmax())]


# ------------------------------------------------------------------------------------------- no copy of the cache


class FreshElements(TorchDispatchMode):
    """Counts the elements of every tensor an op writes into new storage (views and in-place writes are free)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.count += t.numel()
        return out


def _lifecycle_allocations(model, committed: list[int]) -> dict[str, int]:
    """Fresh elements allocated by building the rows, by one step, by adopting a row, and by discarding them; and
    by a plain forward of as many tokens as there are rows, on a cache of the same length (the reference)."""
    counts = {}
    for action in ("adopt", "discard"):
        lm = CachedLM(model)
        lm.feed(committed + BLOCK)
        with FreshElements() as built:
            branches = Branches(DynamicBackend(model), lm, len(committed), BLOCK, ALL_ROWS)
        counts["build"] = built.count
        for _ in range(STEPS - 1):
            branches.step(greedy_rows)
        with FreshElements() as stepped:
            branches.step(greedy_rows)
        counts["step"] = stepped.count
        keys = [layer.keys.data_ptr() for layer in lm.cache.layers]
        with FreshElements() as done:
            if action == "adopt":
                branches.adopt(2, lm)
            else:
                branches.discard(lm)
        counts[action] = done.count
        assert [layer.keys.data_ptr() for layer in lm.cache.layers] == keys  # in place: the same storage
    plain = CachedLM(model)
    plain.feed(committed + BLOCK + [3] * len(ALL_ROWS) * (STEPS - 1))
    with FreshElements() as fed:
        plain.feed([3] * len(ALL_ROWS))
    counts["plain_forward"] = fed.count
    return counts


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_per_block_work_does_not_grow_with_the_context_beyond_a_plain_forward(tiny, attn):
    model = load(tiny("llama"), attn)
    short = _lifecycle_allocations(model, COMMITTED)
    long = _lifecycle_allocations(model, COMMITTED * 60)  # 360 committed tokens instead of 6
    for part in ("build", "adopt", "discard"):
        assert short[part] == long[part], part
    config = model.config
    per_slot = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    # adoption reads only the adopted row's slots (and a few indices): less than the tail of all rows' slots
    tail = 2 * config.num_hidden_layers * len(ALL_ROWS) * STEPS * per_slot
    assert 2 * config.num_hidden_layers * STEPS * per_slot <= long["adopt"] < tail
    assert long["discard"] == 0
    # A step grows with the context as any forward of R new tokens on one sequence does (its cache append, its
    # attention, its mask) — not R times a sequence's cache, as batching R copies of the cache would.
    growth = (long["step"] - short["step"]) / (long["plain_forward"] - short["plain_forward"])
    assert growth < 1.1


def test_pre_drafting_never_copies_or_repeats_the_cache(tiny, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the drafter's cache was copied or repeated")

    deepcopy = copy.deepcopy

    def no_cache_copies(obj, *args, **kwargs):
        if isinstance(obj, (Cache, CacheLayerMixin, torch.Tensor)):
            refuse()
        return deepcopy(obj, *args, **kwargs)

    model = load(tiny("gpt2"))
    monkeypatch.setattr(copy, "deepcopy", no_cache_copies)
    for cls in (Cache, DynamicCache, DynamicLayer):
        monkeypatch.setattr(cls, "batch_repeat_interleave", refuse)
        monkeypatch.setattr(cls, "batch_select_indices", refuse)
    session = LMDraftSession(DynamicBackend(model), COMMITTED * 20, len(COMMITTED),
                             GenerationParams(max_new_tokens=50), 0, model.config.vocab_size)
    for _ in range(3):  # three blocks in a row, each confirmed at its bonus outcome
        session.propose(4)
        block = session.chain_tokens[:4]
        assert session.begin_speculation(4)
        for _ in range(STEPS):
            session.speculate_step()
            assert session.lm.cache.layers[0].keys.shape[0] == 1
        assert session.observe_commit([*block, session.chain[4].token]) == 5
        assert cache_len(session.lm) == session.lm.length == len(session.committed) + STEPS - 1
    seq = list(session.committed)
    for _ in range(STEPS):
        seq.append(int(scratch_logits(model, seq).argmax()))
    assert session.committed + session.chain_tokens == seq


def test_sliding_window_drafters_do_not_pre_draft(model_dir, tokenizer_dir):
    gemma, _ = build_gemma4_pair(model_dir / "branches", tokenizer_dir)
    model = load(gemma)
    session = LMDraftSession(DynamicBackend(model), COMMITTED, len(COMMITTED), GenerationParams(max_new_tokens=50), 0,
                             model.config.vocab_size)
    assert not session.lm.trees
    session.propose(3)
    assert not session.begin_speculation(3)
    assert session.speculation_depth is None


# --------------------------------------------------------------------------------------------------- ranking


def test_choose_keeps_the_top_two_probabilities_under_greedy():
    scores = torch.tensor([0.5, 3.0, -1.0, 2.0, float("-inf")])
    token = choose(scores, GenerationParams(), position=0, q_top_m=0)
    probs = scores.softmax(-1)
    assert (token.token, token.alt) == (1, 3)
    assert token.prob == pytest.approx(float(probs[1])) and token.alt_prob == pytest.approx(float(probs[3]))


def test_outcomes_are_ranked_by_the_drafters_probabilities():
    chain = [DraftToken(10, alt=20, prob=0.9, alt_prob=0.05), DraftToken(11, alt=21, prob=0.5, alt_prob=0.3),
             DraftToken(12, alt=None, prob=1.0), DraftToken(13, alt=23, prob=0.6, alt_prob=0.2),
             DraftToken(14, alt=24, prob=0.7, alt_prob=0.1)]
    ranked = rank_outcomes(chain, 4)
    weights = {0: 0.05, 1: 0.9 * 0.3, 3: 0.9 * 0.5 * 1.0 * 0.2, 4: 0.9 * 0.5 * 1.0 * 0.6 * 0.7}
    guesses = {0: 20, 1: 21, 3: 23, 4: 14}  # the bonus row assumes the drafted token after the block
    assert [r for r, _, _ in ranked] == [1, 4, 3, 0]  # outcome 2 has no guess
    for r, guess, weight in ranked:
        assert guess == guesses[r] and math.isclose(weight, weights[r])
    assert [r for r, _, _ in rank_outcomes(chain[:4], 4)] == [1, 3, 0]  # no drafted bonus token: no bonus row
    # unknown probabilities weigh nothing; the order of r is kept among equals
    assert rank_outcomes([DraftToken(1, alt=2), DraftToken(3, alt=4)], 1) == [(0, 2, 0.0), (1, 3, 0.0)]
