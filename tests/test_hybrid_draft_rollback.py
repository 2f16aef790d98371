"""A hybrid (recurrent-state) draft model after a rejected block (drafter_node/lm_drafter.py, shared/kv.py
``CachedLM.anchor``): it restores its state at the committed length and re-feeds the accepted drafts only, so every
forward after the prompt's is at most a block long, whatever the context (counted with a forward hook over the
input lengths), and each block it drafts is the one a fresh session over the same committed tokens drafts."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from drafter_node.lm_drafter import LMDraftSession
from shared.backend import DynamicBackend
from shared.sampling import GenerationParams
from testkit.tiny_hybrid import HYBRID_FAMILIES, build_hybrid, perturbed_copy
from testkit.tiny_models import build_tokenizer, reference_greedy

pytestmark = pytest.mark.unit

K = 4
NEW_TOKENS = 24
GREEDY = GenerationParams(max_new_tokens=NEW_TOKENS + 2 * K + 2, eos_token_ids=[])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-draft")
    build_tokenizer(root / "tok")
    out = {}
    for family in HYBRID_FAMILIES:
        target = build_hybrid(root / family, family, root / "tok", seed=4)
        near = perturbed_copy(target, root / f"{family}-near", noise=0.6, seed=5)
        out[family] = target, AutoModelForCausalLM.from_pretrained(near, dtype=torch.float32).eval()
    return out


class ForwardSizes:
    """The input length of every forward of ``model`` (a forward pre-hook)."""

    def __init__(self, model) -> None:
        self.sizes: list[int] = []
        self.counting = True
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        if self.counting:
            self.sizes.append(kwargs["input_ids"].shape[1])


def fresh_block(model, committed: list[int], prompt_len: int, n: int) -> list[int]:
    s = LMDraftSession(DynamicBackend(model), committed, prompt_len, GREEDY, 0, model.config.vocab_size)
    s.propose(n)
    return s.chain_tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_a_rejected_block_refeeds_the_block_not_the_context(pairs, family, overlap):
    target, draft = pairs[family]
    rng = random.Random(1)
    prompt = [rng.randrange(2, 150) for _ in range(80)]  # a context much longer than a block
    reference = reference_greedy(target, prompt, NEW_TOKENS + K + 1)
    session = LMDraftSession(DynamicBackend(draft), prompt, len(prompt), GREEDY, 0, draft.config.vocab_size)
    forwards = ForwardSizes(draft)
    out: list[int] = []
    outcomes = []
    while len(out) < NEW_TOKENS:
        base = len(session.committed)
        session.propose(K - len(session.chain))
        block = session.chain_tokens[:K]
        forwards.counting = False
        assert block == fresh_block(draft, session.committed, len(prompt), K)  # the state is the committed one
        forwards.counting = True
        if overlap:  # as the node does: the single chain pre-drafted past the block while it is verified
            session.begin_speculation(K)
            session.propose(2 * K + 1 - len(session.chain))
        accepted = 0
        while accepted < K and block[accepted] == reference[len(out) + accepted]:
            accepted += 1
        commit = reference[len(out) : len(out) + accepted + 1]
        outcomes.append(accepted)
        session.observe_commit(commit)
        out += commit
        assert session.committed == prompt + out and len(session.committed) == base + len(commit)
    assert out == reference[: len(out)]
    assert any(0 < a < K for a in outcomes) and any(a == 0 for a in outcomes), outcomes  # partial and full rejects
    forwards.handle.remove()
    # the prompt's prefill, then no forward longer than a block and its correction, though rejections rolled back a
    # 80-token context (before: every rejection rebuilt it from the start)
    assert forwards.sizes[0] == len(prompt)
    assert max(forwards.sizes[1:]) <= K + 1, (forwards.sizes, outcomes)
    assert session.lm.refed_total <= len(outcomes) * K
