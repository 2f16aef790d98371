"""``prompt_lookup``: continuations copied from the token history (``drafter_node/prompt_lookup.py``).

Every key is checked from its declaration (kind and bounds), so the type needs no ``check`` hook.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafter_node.spec import DrafterSpec
from shared.protocol import MAX_DRAFT_TOKENS
from shared.settings import setting


@dataclass(frozen=True)
class PromptLookupSettings:
    """``prompt_lookup``'s own ``drafter`` keys."""

    prompt_lookup_num_tokens: int = setting(10, "Tokens copied per draft block (the verifier takes blocks of up to "
                                            f"{MAX_DRAFT_TOKENS}).", kind="int", bounds=(1, MAX_DRAFT_TOKENS))
    max_matching_ngram_size: int = setting(2, "Longest n-gram matched in the history.", kind="int",
                                           bounds=(1, None))


SPEC = DrafterSpec(
    name="prompt_lookup",
    cls="drafter_node.prompt_lookup:PromptLookupDrafter",
    title="prompt lookup decoding",
    settings=PromptLookupSettings,
    needs_model=False,
    sends_q=False,  # one-hot drafts: no distribution to ensemble with
    block_length_key="prompt_lookup_num_tokens",
    transformers="`prompt_lookup_num_tokens=K`",
    drafts_with="no model: n-gram matches in the prompt and the text so far",
    holds="nothing but the token history: it copies the continuation of the most recent earlier match of the "
          "trailing n-gram (prompt and generated text)",
    conformance="testkit.conformance:prompt_lookup",
)
