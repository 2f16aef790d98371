"""``suffix``: suffix decoding over the request's tokens and earlier responses (``drafter_node/suffix.py``).

Every key is checked from its declaration (kind and bounds), so the type needs no ``check`` hook.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafter_node.spec import DrafterSpec
from shared.protocol import MAX_DRAFT_TOKENS
from shared.settings import setting


@dataclass(frozen=True)
class SuffixSettings:
    """``suffix``'s own ``drafter`` keys (vLLM's ``suffix_decoding_*`` knobs, and a token cap of its own)."""

    suffix_num_draft_tokens: int = setting(
        16, "Most tokens per draft block (vLLM num_speculative_tokens); a proposal is often shorter.",
        kind="int", bounds=(1, MAX_DRAFT_TOKENS))
    suffix_max_tree_depth: int = setting(
        24, "Depth of the suffix tries: the longest match plus its proposal, in tokens.", kind="int",
        bounds=(2, None))
    suffix_max_spec_factor: float = setting(
        1.0, "A proposal is at most ceil(factor × match length) tokens.", kind="number", bounds=(0, None),
        open_low=True)
    suffix_min_token_prob: float = setting(
        0.1, "A proposal stops where its cumulative empirical probability would fall below this.",
        kind="number", bounds=(0, 1))
    suffix_max_cached_requests: int = setting(
        10000, "Responses kept for later requests (0: no cross-request cache); the oldest goes first.", kind="int",
        bounds=(0, None))
    suffix_max_cached_tokens: int = setting(
        100000, "Tokens of responses kept for later requests (at most about 1.6 kB each at depth 24).",
        kind="int", bounds=(0, None))
    suffix_max_tenants: int = setting(
        1024, "Tenants with a response cache of their own; the least recently used one's is dropped first.",
        kind="int", bounds=(1, None))
    suffix_share_across_tenants: bool = setting(
        False, "One response cache for every tenant: a request may be offered another tenant's responses "
        "(docs/security.md).", kind="bool")


SPEC = DrafterSpec(
    name="suffix",
    cls="drafter_node.suffix:SuffixDrafter",
    title="suffix decoding",
    settings=SuffixSettings,
    needs_model=False,
    sends_q=False,  # one-hot drafts: no distribution to ensemble with
    block_length_key="suffix_num_draft_tokens",
    transformers='none (vLLM `"method": "suffix"`)',
    drafts_with="no model: suffix tries over the request and over the responses of the same tenant's earlier "
                "requests (suffix decoding)",
    holds="no model: a suffix trie over the request's prompt and generated tokens, and one over the responses of "
          "the earlier (and concurrent) requests this drafter process served; proposes the most frequent "
          "continuation of the longest matching suffix",
    conformance="testkit.conformance:suffix",
)
