"""Multi-outcome pre-drafting: every batched outcome row drafts exactly what a from-scratch greedy run on that
row's sequence would, and an adopted row's cache continues exactly like a fresh cache of its sequence."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_node.base import DraftToken
from drafter_node.branches import Branches
from drafter_node.lm_drafter import LMDraftSession
from shared.kv import CachedLM
from shared.sampling import GenerationParams

COMMITTED = [5, 17, 33, 2, 60, 7]
BLOCK = [11, 12, 13, 14]
GUESSES = [40, 41, 42, 43, 44]  # a different assumed verifier token for each outcome row
STEPS = 3


def scratch_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def greedy_rows(logits: torch.Tensor, contexts) -> list[DraftToken]:
    return [DraftToken(int(row.argmax())) for row in logits]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_rows_match_from_scratch_and_adopted_cache_continues(tiny, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny(arch), dtype=torch.float32).eval()
    for row in range(len(GUESSES)):
        lm = CachedLM(model)
        lm.feed(COMMITTED + BLOCK)
        branches = Branches(lm, len(COMMITTED), BLOCK, GUESSES)
        for _ in range(STEPS):
            branches.step(greedy_rows)
        seq = [*COMMITTED, *BLOCK[:row], GUESSES[row]]
        for _ in range(STEPS):
            seq.append(int(scratch_logits(model, seq).argmax()))
        assert [*COMMITTED, *branches.context(row)] == seq, f"row {row}"
        chain = branches.adopt(row, lm)
        assert [t.token for t in chain] == seq[-STEPS:]
        assert lm.length == len(seq) - 1  # the last drafted token is not cached yet
        logits, _ = lm.feed([seq[-1]])
        assert torch.allclose(logits[-1], scratch_logits(model, seq), atol=1e-4), f"row {row}"


def test_commit_matching_a_row_is_a_hit_and_others_roll_back(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.float32).eval()
    params = GenerationParams(max_new_tokens=50)
    session = LMDraftSession(model, COMMITTED, len(COMMITTED), params, q_top_m=0, vocab_size=160)
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
