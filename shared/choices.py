"""Several answers to one prompt (OpenAI's ``n``): the bound on how many, and the seed each choice samples with.

A choice is an ordinary request of its own on the verifier (its own session, KV budget and drafter), so the rule
that makes a seeded request reproducible lives here, shared by the HTTP server (``http_server/choices.py``) and
:meth:`runtime.client.AsyncClient.generate_n`: choice 0 uses the request's seed itself (so ``n = 1`` and choice 0 of
any ``n`` give the same text), choice i ≥ 1 uses ``choice_seed(seed, i)``, a SplitMix64 mix of the two (neighbouring
seeds or indices give unrelated streams); a request without a seed gives each choice a random seed of its own.
"""

from __future__ import annotations

#: Most choices one request may ask for. Each is a whole session (one of ``verifier.max_sessions``, its own
#: prompt + max_tokens of the KV budget): 16 keeps one request from taking a server's every slot while covering
#: what OpenAI users send (best-of-n reranking, a few samples to compare); raise it here if a deployment needs more.
MAX_N = 16

_MASK64 = (1 << 64) - 1


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed`` (None: unseeded, each choice draws its own).
    Deterministic; in [0, 2^63) like every request seed; choice 0 keeps ``seed``."""
    if seed is None or index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64  # SplitMix64: one step from the pair, then its mix
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1
