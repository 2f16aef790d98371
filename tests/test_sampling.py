"""Logits processing matches transformers, and the acceptance rules are lossless — measured, with a negative control.

The lossless check runs the real acceptance functions over many seeds on a two-step Markov "model" whose exact
joint distribution of the first two generated tokens is known in closed form, so the only noise is the sampling of
the rule itself: total-variation distance to the exact distribution must stay under a bound, and a verifier that
accepts everything must exceed it.
"""

from __future__ import annotations

import math

import pytest
import torch
from node_entry import accept_everything
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from drafter_node.lm_drafter import choose
from shared.sampling import GenerationParams, ParamError, make_generator, process_block, process_logits
from verifier_node.acceptance import accept_greedy, accept_sampling

pytestmark = pytest.mark.unit

V = 6


@pytest.mark.parametrize(
    "params",
    [
        dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
        dict(do_sample=True, temperature=1.5, top_p=0.5),
        dict(do_sample=True, top_k=1),
        dict(do_sample=False, repetition_penalty=0.8),
    ],
)
def test_process_logits_matches_transformers(params):
    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    context = torch.tensor([3, 7, 7, 11, 40])
    p = GenerationParams(**params)
    ours = process_logits(logits, context, p, num_generated=2)
    ref = logits[None].clone()
    chain = []
    if p.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.do_sample:
        if p.temperature != 1.0:
            chain.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k:
            chain.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            chain.append(TopPLogitsWarper(p.top_p))
    for proc in chain:
        ref = proc(context[None], ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref[0]))
    finite = torch.isfinite(ours)
    assert torch.allclose(ours[finite], ref[0][finite], atol=1e-5)


def test_min_new_tokens_blocks_eos_until_reached():
    p = GenerationParams(min_new_tokens=3, eos_token_ids=[4])
    logits = torch.zeros(8)
    logits[4] = 10
    assert process_logits(logits, torch.tensor([1]), p, 2)[4] == -math.inf
    assert process_logits(logits, torch.tensor([1]), p, 3)[4] == 10


def test_process_block_uses_each_rows_own_context():
    p = GenerationParams(repetition_penalty=2.0)
    logits = torch.ones(3, 5)
    out = process_block(logits, torch.tensor([0]), torch.tensor([1, 2]), p, 0)
    assert out[0].tolist() == [0.5, 1, 1, 1, 1]
    assert out[1].tolist() == [0.5, 0.5, 1, 1, 1]
    assert out[2].tolist() == [0.5, 0.5, 0.5, 1, 1]


@pytest.mark.parametrize(
    "bad",
    [
        {"max_new_tokens": 0}, {"max_new_tokens": "5"}, {"temperature": 0}, {"temperature": float("nan")},
        {"top_k": -1}, {"top_p": 0}, {"top_p": 1.5}, {"repetition_penalty": -1}, {"seed": -3},
        {"eos_token_ids": [999]}, {"eos_token_ids": "3"}, {"do_sample": "yes"}, {"colour": 1},
        {"max_new_tokens": True},
    ],
)
def test_bad_params_are_rejected(bad):
    with pytest.raises(ParamError):
        GenerationParams.from_dict(bad, vocab_size=100)


def test_greedy_rule():
    scores = torch.full((4, V), -1.0)
    for row, best in enumerate([2, 3, 1, 5]):
        scores[row, best] = 1.0
    assert accept_greedy(scores, [2, 3, 1]) == [2, 3, 1, 5]  # all accepted + bonus
    assert accept_greedy(scores, [2, 4, 1]) == [2, 3]  # first mismatch → the target's token
    assert accept_greedy(scores[:1], []) == [2]  # no draft: a plain step


# ---------------------------------------------------------------------------- lossless sampling, measured
def markov(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, V, generator=g) * sharpness).log_softmax(-1)  # row = log p(next | last token)


def exact_joint(log_p: torch.Tensor, start: int) -> torch.Tensor:
    p = log_p.exp()
    return p[start][:, None] * p  # P(x1, x2) = p(x1 | start) p(x2 | x1)


def two_tokens(log_p, log_q, start: int, k: int, seed: int, rule, q_mode: str) -> tuple[int, int]:
    """Generate two tokens by rounds of draft (from q) + verification (against p), like a session does."""
    params = GenerationParams(do_sample=True, seed=seed)
    context = [start]
    while len(context) < 3:
        base = len(context)
        draft, q_rows = [], []
        for _ in range(k):
            scores = log_q[(context + draft)[-1]]
            if q_mode == "onehot":
                draft.append(int(scores.argmax()))
            else:
                tok = choose(scores, params, base + len(draft), q_top_m=3 if q_mode == "topm" else 0)
                q_rows.append(torch.zeros(V).scatter_(0, tok.q_idx.long(), tok.q_prob))
                draft.append(tok.token)
        rows = torch.stack([log_p[t] for t in [context[-1], *draft]])
        q = torch.stack(q_rows) if q_rows else None
        context += rule(rows, draft, q, make_generator(seed, base, 0))
    return context[1], context[2]


def tv_to_exact(log_p, log_q, k, rule, q_mode, n=6000) -> float:
    counts = torch.zeros(V, V)
    for seed in range(n):
        x1, x2 = two_tokens(log_p, log_q, 0, k, seed, rule, q_mode)
        counts[x1, x2] += 1
    return 0.5 * float((counts / n - exact_joint(log_p, 0)).abs().sum())


# With n = 6000 draws over 36 outcomes the expected TV of an exact sampler is about 0.03; the bound leaves margin.
TV_BOUND = 0.06


@pytest.mark.statistical
@pytest.mark.parametrize(("k", "q_mode"), [(1, "full"), (3, "topm"), (2, "onehot")])
def test_sampling_rule_is_lossless(k, q_mode):
    log_p, log_q = markov(1, 2.0), markov(2, 2.0)
    assert 0.5 * float((exact_joint(log_p, 0) - exact_joint(log_q, 0)).abs().sum()) > 0.3  # q really differs
    assert tv_to_exact(log_p, log_q, k, accept_sampling, q_mode) < TV_BOUND


@pytest.mark.statistical
@pytest.mark.parametrize(("k", "q_mode"), [(3, "full"), (2, "onehot")])
def test_negative_control_accept_everything_is_caught(k, q_mode):
    log_p, log_q = markov(1, 2.0), markov(2, 2.0)
    assert tv_to_exact(log_p, log_q, k, accept_everything, q_mode, n=3000) > 2 * TV_BOUND


def test_seeded_rounds_are_reproducible():
    log_p, log_q = markov(1, 2.0), markov(2, 2.0)
    runs = {two_tokens(log_p, log_q, 0, 3, 1234, accept_sampling, "full") for _ in range(5)}
    assert len(runs) == 1
