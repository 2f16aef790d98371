"""The end-to-end sampling check: the exact joint distribution of a tiny target's first two sampled tokens, an
empirical one from N seeded requests through a running cluster, and their total-variation distance.

Two halves, so that the negative control runs once for the suite rather than once per check:

* :func:`check_lossless_sampling`: the cluster's joint is within :data:`TV_BOUND` of the exact one; every run also
  shows that the check *could* fail there: drafts were both accepted and rejected (a verifier that accepts every
  draft rejects none), and each wrong joint the caller names (what accepting every draft would give: the drafter's
  own joint, or the lookup's continuation; an unmasked target under a grammar) is more than twice the bound away;
* :func:`check_negative_control`: the same measurement with a verifier that accepts every draft (injected by
  tests/node_entry.py's ``accept_all`` hook) lands more than twice the bound away, so the bound really catches a
  biased verifier (tests/test_conformance.py runs it once, on the dense setup).

The acceptance rule itself is checked in-process, for full, sparse and one-hot q with the same negative control, in
tests/test_sampling.py; these checks cover everything around it (the drafter's q on the wire, batching, rollbacks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from conftest import start_cluster
from transformers import AutoModelForCausalLM

PROMPT = [2, 5, 7]
N = 800
VOCAB = 12  # tiny_models.build_small_vocab_tokenizer's default
# An exact sampler with N = 800 draws over this joint (12 outcomes above 1 %) lands near TV 0.06 (measured
# 0.066; seeds are fixed, so the run is deterministic); accepting everything gives about 0.85.
TV_BOUND = 0.11


def exact_joint(model_or_folder, prompt: list[int] = PROMPT, top_k: int = 0, presence: float = 0.0,
                frequency: float = 0.0, bias: Mapping[int, float] | None = None) -> torch.Tensor:
    """P(x1, x2) of a model's first two sampled tokens after ``prompt`` (a loaded model or a saved folder); ``top_k``:
    of its top-k probabilities renormalised at each step (a drafter's sparse q: ``drafter.q_top_k``). OpenAI's
    penalties, computed here on their own: ``bias`` (token id → bias) added to both steps' logits; at the second
    step x1 is the one generated token, so its logit loses ``presence + frequency`` (one occurrence)."""
    model = model_or_folder
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model_or_folder, dtype=torch.float32)
    model = model.float().eval()
    with torch.no_grad():
        logits1 = model(torch.tensor([prompt])).logits[0, -1]
        v = logits1.numel()
        batch = torch.tensor([[*prompt, x] for x in range(v)])
        logits2 = model(batch).logits[:, -1]
    for token, value in (bias or {}).items():
        logits1[token] += value
        logits2[:, token] += value
    logits2 -= (presence + frequency) * torch.eye(v, dtype=logits2.dtype)  # row x1: token x1 occurred once
    p1, p2 = logits1.softmax(-1), logits2.softmax(-1)
    if top_k:
        p1, p2 = _top_k(p1, top_k), _top_k(p2, top_k)
    return p1[:, None] * p2


def _top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest probabilities renormalised, the rest 0."""
    values, indices = probs.topk(k, dim=-1)
    return torch.zeros_like(probs).scatter_(-1, indices, values / values.sum(-1, keepdim=True))


def point_joint(x1: int, x2: int) -> torch.Tensor:
    """The joint of a sampler that always answers (x1, x2): what accepting every draft of a deterministic drafter
    gives (a lookup's continuation)."""
    joint = torch.zeros(VOCAB, VOCAB)
    joint[x1, x2] = 1.0
    return joint


@dataclass(frozen=True)
class Sampled:
    """What :func:`sample_pairs` measured."""

    joint: torch.Tensor  # the empirical joint of the first two tokens
    drafted: int  # draft tokens the verifier checked, over every request
    accepted: int  # of which it accepted


async def sample_pairs(config, hooks: Mapping[str, str] | None = None, prompt: list[int] = PROMPT,
                       params: dict | None = None) -> Sampled:
    """Empirical joint of the first two tokens over N seeded requests (50 in flight at a time, so rounds are verified
    in batches). ``hooks``: test behaviour per role (tests/node_entry.py's hook names, see :func:`start_cluster`);
    ``params``: more generation parameters for every request (they override the defaults here)."""
    counts = torch.zeros(VOCAB, VOCAB)
    drafts, drafted, accepted, batched = 0, 0, 0, 0.0
    async with start_cluster(config, hooks=hooks) as client:
        for start in range(0, N, 50):
            results = await asyncio.gather(*(
                client.generate(token_ids=prompt, **{"max_new_tokens": 2, "do_sample": True, "seed": seed,
                                                     "eos_token_ids": [], **(params or {})})
                for seed in range(start, start + 50)
            ))
            for r in results:
                pair = [*r.token_ids, 0, 0][:2]  # an output that ended at once (an end token; a control) pads with 0
                counts[pair[0], pair[1]] += 1
                drafts += r.metrics["drafts"]
                drafted += r.metrics["draft_tokens"]
                accepted += r.metrics["accepted_tokens"]
                batched = max(batched, r.metrics["verify_batch_mean"])
        batching = (await client.ping())["batching"]
    assert drafts > 0 and drafted > 0, "the drafter never contributed: the check would test nothing"
    if batching:  # 50 requests in flight: the check covers batched verification (where the target allows it)
        assert batched > 1.0, "no request shared a target forward with another"
    return Sampled(counts / N, drafted, accepted)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def check_lossless_sampling(config, exact: torch.Tensor, prompt: list[int] = PROMPT, *,
                            wrong: Mapping[str, torch.Tensor] | None = None, hooks: Mapping[str, str] | None = None,
                            params: dict | None = None) -> float:
    """Sampled through ``config`` the joint is within TV_BOUND of ``exact``; returns the TV. The run must have
    accepted some drafts and rejected others (a verifier that accepts everything rejects none). ``wrong``: joints a
    lossy verifier would produce here, where the test can compute them (what accepting every draft gives: the
    drafter's own joint), each of which must be more than twice the bound from ``exact``. ``hooks``: node hooks for
    the run; ``params``: more generation parameters for every request (a grammar: tests/test_grammar_sampling.py)."""
    wrong = wrong or {}
    for what, joint in wrong.items():
        assert tv(joint, exact) > 2 * TV_BOUND, f"{what} is too close to the target's joint: the check tests nothing"
    sampled = asyncio.run(sample_pairs(config, hooks=hooks, prompt=prompt, params=params))
    lossless = tv(sampled.joint, exact)
    print(f"sampling TV {lossless:.3f} (bound {TV_BOUND}); {sampled.accepted} of {sampled.drafted} drafts accepted; "
          + ", ".join(f"{what} {tv(joint, exact):.3f} away" for what, joint in wrong.items()))
    assert 0 < sampled.accepted < sampled.drafted, "need drafts accepted and rejected, or the check tests nothing"
    assert lossless < TV_BOUND
    return lossless


def check_negative_control(config, exact: torch.Tensor, prompt: list[int] = PROMPT,
                           hooks: Mapping[str, str] | None = None) -> float:
    """The accept-all negative control on ``config``: its joint must be more than twice the bound from ``exact``
    (and it accepted every draft). Returns its TV."""
    sampled = asyncio.run(sample_pairs(config, hooks={**(hooks or {}), "verifier": "accept_all"}, prompt=prompt))
    control = tv(sampled.joint, exact)
    print(f"accept-all control TV {control:.3f} (bound {TV_BOUND})")
    assert sampled.accepted == sampled.drafted, "the control's verifier must accept every draft"
    assert control > 2 * TV_BOUND, "the drafts must really differ from the target, or the check tests nothing"
    return control
