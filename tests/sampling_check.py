"""The sampling check shared by every drafter type: the exact joint distribution of a tiny target's first two
sampled tokens, an empirical one from N seeded requests through a running cluster, and their total-variation
distance. Used with a negative control (a verifier that accepts every draft, injected by tests/node_entry.py)
that the same bound must catch."""

from __future__ import annotations

import asyncio

import torch
from node_entry import node_entry
from transformers import AutoModelForCausalLM

from runtime.launch import cluster

PROMPT = [2, 5, 7]
N = 800
VOCAB = 12  # tiny_models.build_small_vocab_tokenizer's default
# An exact sampler with N = 800 draws over this joint (12 outcomes above 1 %) lands near TV 0.06 (measured
# 0.066; seeds are fixed, so the run is deterministic); accepting everything gives about 0.85.
TV_BOUND = 0.11


def exact_joint(model_or_folder, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(x1, x2) of a model's first two sampled tokens after ``prompt`` (a loaded model or a saved folder)."""
    model = model_or_folder
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model_or_folder, dtype=torch.float32)
    model = model.float().eval()
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        v = p1.numel()
        batch = torch.tensor([[*prompt, x] for x in range(v)])
        p2 = model(batch).logits[:, -1].softmax(-1)
    return p1[:, None] * p2


async def sample_pairs(config, entry=None, prompt: list[int] = PROMPT, params: dict | None = None) -> torch.Tensor:
    """Empirical joint of the first two tokens over N seeded requests (50 in flight at a time, so rounds are verified
    in batches). ``params``: more generation parameters for every request (they override the defaults here)."""
    counts = torch.zeros(VOCAB, VOCAB)
    drafts, batched = 0, 0.0
    async with cluster(config, entry=entry) as client:
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
                batched = max(batched, r.metrics["verify_batch_mean"])
        batching = (await client.ping())["batching"]
    assert drafts > 0, "the drafter never contributed: the check would test nothing"
    if batching:  # 50 requests in flight: the check covers batched verification (where the target allows it)
        assert batched > 1.0, "no request shared a target forward with another"
    return counts / N


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def check_lossless_sampling(config, exact: torch.Tensor, prompt: list[int] = PROMPT,
                            entry: dict[str, list[str]] | None = None,
                            params: dict | None = None) -> tuple[float, float]:
    """The whole check: sampled through ``config`` the joint is within TV_BOUND of ``exact``, and the accept-all
    negative control on the same config is not (so the check can fail). Returns (TV, control TV). ``entry``: node
    entries for both runs (``cluster(entry=...)``); the control's verifier runs the accept-all hook. ``params``: more
    generation parameters for every request (a grammar: tests/test_grammar_sampling.py)."""
    lossless = tv(asyncio.run(sample_pairs(config, entry=entry, prompt=prompt, params=params)), exact)
    control_entry = {**(entry or {}), "verifier": node_entry("accept_all")}
    control = tv(asyncio.run(sample_pairs(config, entry=control_entry, prompt=prompt, params=params)), exact)
    print(f"sampling TV {lossless:.3f} (bound {TV_BOUND}), accept-all control {control:.3f}")
    assert lossless < TV_BOUND
    assert control > 2 * TV_BOUND, "the drafts must really differ from the target, or the check tests nothing"
    return lossless, control
