"""``prompt_lookup``: continuations copied from the token history (``drafter_node/prompt_lookup.py``)."""

from __future__ import annotations

from typing import Any

from drafter_node.spec import DrafterSpec, positive_int


def _check(config: dict[str, Any]) -> None:
    positive_int(config, "prompt_lookup_num_tokens")
    positive_int(config, "max_matching_ngram_size")


SPEC = DrafterSpec(
    name="prompt_lookup",
    cls="drafter_node.prompt_lookup:PromptLookupDrafter",
    title="prompt lookup decoding",
    keys={"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2},  # tokens copied per block; longest n-gram
    needs_model=False,
    sends_q=False,  # one-hot drafts: no distribution to ensemble with
    check=_check,
)
