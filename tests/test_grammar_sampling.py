"""Sampling under a grammar keeps the grammar-masked target's distribution: the first two tokens of N seeded requests
constrained by a small regex (four choices, then five) against the exact masked joint — p_masked(x1) ∝ p(x1)·1[x1
allowed], then p_masked(x2 | x1) likewise; the unmasked target and the masked drafter (what accepting every allowed
draft would give) are far outside the bound. The drafter is a different model that ignores the grammar, so its
drafts are often refused (rejected, the correction drawn from the residual) and sometimes accepted. CI runs it
(``make test-ci``) beside make test's one sampling check per kind of draft (tests/test_conformance.py)."""

from __future__ import annotations

import pytest
from conftest import tiny_config
from sampling_check import TV_BOUND, check_lossless_sampling, exact_joint, tv

pytestmark = pytest.mark.ci

# word-level vocabulary: <eos> 0, <pad> 1, w0 … w9 = ids 2 … 11 (testkit.tiny_models.build_small_vocab_tokenizer)
REGEX = "w[1-4]w[5-9]"
FIRST, SECOND = [3, 4, 5, 6], [7, 8, 9, 10, 11]


def masked_joint(exact):
    """The exact joint of the grammar-masked target, token by token, from the unmasked one."""
    p1 = exact.sum(1)
    p2 = exact / p1[:, None]
    m1 = p1.clone()
    keep1 = [i for i in range(len(p1)) if i not in FIRST]
    m1[keep1] = 0
    m1 /= m1.sum()
    m2 = p2.clone()
    m2[:, [i for i in range(m2.shape[1]) if i not in SECOND]] = 0
    m2 /= m2.sum(1, keepdim=True)
    return m1[:, None] * m2


def test_sampling_under_a_regex_is_the_masked_targets(sharp_pair):
    target, drafter = sharp_pair
    unmasked = exact_joint(target)
    exact = masked_joint(unmasked)
    assert tv(unmasked, exact) > 2 * TV_BOUND  # the grammar moves the distribution far more than the bound allows
    config = tiny_config(target, drafter, num_draft_tokens=3, q_top_k=0)
    wrong = {"the unmasked target's joint": unmasked, "the masked drafter's joint": masked_joint(exact_joint(drafter))}
    check_lossless_sampling(config, exact, wrong=wrong, params={"regex": REGEX, "eos_token_ids": [0]})
