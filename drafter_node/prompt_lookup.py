"""``prompt_lookup`` drafter: copies the continuation of the most recent earlier occurrence of the trailing n-gram
of the context (prompt and generated text), as transformers' prompt lookup decoding does.

It holds nothing but token ids, so it works with any target tokenizer, drafts cost no model forward, and a round
with no match sends an empty block (the verifier then steps on its own at once). Drafts are deterministic: one-hot
q, exact under greedy and sampling alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from drafter_node.base import Capabilities, Drafter, DraftSession, DraftToken
from shared.protocol import ANY_TOKENIZER
from shared.sampling import GenerationParams

if TYPE_CHECKING:
    from drafter_node.settings import DrafterConfig
    from drafter_node.type_specs.prompt_lookup import PromptLookupSettings
    from shared.models import ProfileSpec


def lookup(ids: list[int], max_ngram: int, count: int) -> list[int]:
    """Up to ``count`` tokens that followed the latest earlier match of the longest trailing n-gram (≤ max_ngram)."""
    n_ids = len(ids)
    for n in range(min(max_ngram, n_ids - 1), 0, -1):
        tail = ids[n_ids - n :]
        for start in range(n_ids - n - 1, -1, -1):  # most recent first; the tail itself is excluded
            if ids[start : start + n] == tail:
                follow = ids[start + n : start + n + count]
                if follow:
                    return follow
    return []


class PromptLookupSession(DraftSession):
    cheap_steps = True

    def __init__(self, token_ids: list[int], prompt_len: int, params: GenerationParams, max_ngram: int, count: int):
        super().__init__(token_ids, prompt_len, params)
        self.max_ngram = max_ngram
        self.count = count

    def propose(self, n: int) -> int:
        if self.ended:
            return 0
        found = lookup(self.committed + self.chain_tokens, self.max_ngram, min(n, self.count))
        self.chain.extend(DraftToken(t) for t in found)
        return len(found)


class PromptLookupDrafter(Drafter):
    type_name = "prompt_lookup"
    free_drafting = True  # a lookup in the token history

    def __init__(self, settings: DrafterConfig, own: PromptLookupSettings,
                 profile: ProfileSpec | None = None):  # no causal LM: no profile
        self.max_ngram = own.max_matching_ngram_size
        self.count = own.prompt_lookup_num_tokens
        self.tokenizer_id = ANY_TOKENIZER
        self.capabilities = Capabilities(sends_q=False)
        self.block_len = self.count  # a lookup costs nothing: blocks are as long as the match allows
        self.target_vocab_size = 0

    def open_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor]
    ) -> DraftSession:
        return PromptLookupSession(token_ids, prompt_len, params, self.max_ngram, self.count)
