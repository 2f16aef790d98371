"""``suffix`` drafter: suffix decoding (arXiv 2411.04975), as vLLM's ``method: suffix``.

Drafts come from :class:`drafter_node.suffix_tree.SuffixCache`: a suffix trie over the request's own prompt and
generated tokens, and one over the responses of every request this drafter process served for the same tenant
(``SessionStart.tenant``; one for everybody with ``suffix_share_across_tenants``; the cache lives on the
:class:`SuffixDrafter`, built once per process, so every session it serves adds to it and drafts from it, across
rejoins to a restarted verifier). Only
committed tokens go in — a session's response token by token as the verifier commits it, so concurrent requests
learn from each other; a closed session's response stays until evicted (oldest first, by request count and tokens).

A request's own trie is built a budget at a time (:data:`drafter_node.suffix_tree.BUILD_BUDGET` tokens): one piece
per draft step and one per node loop turn with nothing else to do (:meth:`SuffixSession.background`), so a long
prompt never stalls the drafter's loop; until it is built the session drafts from what is built so far.

No model, any tokenizer, no cost curve; drafts are deterministic (one-hot q), exact under greedy and sampling alike.
A round where nothing matches well enough sends an empty block (the verifier steps on its own at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from drafter_node.base import Capabilities, Drafter, DraftSession, DraftToken
from drafter_node.suffix_tree import SuffixCache
from shared.protocol import ANY_TOKENIZER
from shared.sampling import GenerationParams

if TYPE_CHECKING:
    from drafter_node.settings import DrafterConfig
    from drafter_node.type_specs.suffix import SuffixSettings
    from shared.models import ProfileSpec


class SuffixSession(DraftSession):
    cheap_steps = True

    def __init__(self, token_ids: list[int], prompt_len: int, params: GenerationParams, drafter: SuffixDrafter,
                 tenant: str | None = None):
        super().__init__(token_ids, prompt_len, params)
        self.drafter = drafter
        self.cache = drafter.cache
        # a session may start past its prompt (moved from another drafter): that part is response already. Its own
        # trie starts empty: build() puts the tokens in a budget at a time (a long prompt must not stall the loop).
        self.req = self.cache.start(token_ids[:prompt_len], token_ids[prompt_len:], tenant=tenant)
        self._open = True

    def propose(self, n: int) -> int:
        if self.ended or not self._open:
            return 0
        self.cache.build(self.req)  # one piece of a long prompt per step; drafts come from what is built
        depth = self.cache.max_depth
        context = (self.committed[-depth:] + self.chain_tokens)[-depth:]
        d = self.drafter
        found = self.cache.speculate(self.req, context, min(n, d.count), d.max_spec_factor, d.min_token_prob)
        self.chain.extend(DraftToken(t) for t in found.tokens)
        return len(found.tokens)

    def observe_commit(self, tokens: list[int], extras: dict[str, torch.Tensor] | None = None) -> int:
        matched = super().observe_commit(tokens, extras)
        if self._open:
            self.cache.append(self.req, tokens)
        return matched

    def background(self) -> bool:
        if not self._open or not self.cache.unbuilt(self.req):
            return False
        self.cache.build(self.req)
        return True

    def close(self) -> None:
        """Done or cancelled: the request's own trie goes; its response stays in the shared cache."""
        if self._open:
            self._open = False
            self.cache.stop(self.req)


class SuffixDrafter(Drafter):
    type_name = "suffix"
    free_drafting = True  # lookups in tries

    def __init__(self, settings: DrafterConfig, own: SuffixSettings,
                 profile: ProfileSpec | None = None):  # no causal LM: no profile
        self.count = own.suffix_num_draft_tokens
        self.max_spec_factor = float(own.suffix_max_spec_factor)  # a YAML number may be an int
        self.min_token_prob = float(own.suffix_min_token_prob)
        self.cache = SuffixCache(own.suffix_max_tree_depth, own.suffix_max_cached_requests,
                                 own.suffix_max_cached_tokens, own.suffix_max_tenants,
                                 own.suffix_share_across_tenants)
        self.tokenizer_id = ANY_TOKENIZER
        self.capabilities = Capabilities(sends_q=False)
        self.block_len = self.count  # proposals are as long as the tries allow, up to this
        self.target_vocab_size = 0

    def open_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor]
    ) -> DraftSession:
        return SuffixSession(token_ids, prompt_len, params, self)

    def open_tenant_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor],
        tenant: str | None,
    ) -> DraftSession:
        return SuffixSession(token_ids, prompt_len, params, self, tenant)
