"""``universal``: any small causal LM with its own tokenizer (``drafter_node/universal.py``)."""

from drafter_node.spec import DrafterSpec

SPEC = DrafterSpec(
    name="universal",
    cls="drafter_node.universal:UniversalDrafter",
    title="universal assisted decoding",
    reads_target=True,  # the target's tokenizer (files only)
    transformers="`assistant_model=D, assistant_tokenizer=…, tokenizer=…`",
    drafts_with="any small model with its own tokenizer",
    holds="any small causal LM with its own tokenizer and KV cache, plus the target's tokenizer (files only)",
    conformance="testkit.conformance:universal",
)
