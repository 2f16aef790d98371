"""``assistant``: a small model that shares the target's tokenizer (``drafter_node/assistant.py``)."""

from drafter_node.spec import DrafterSpec

SPEC = DrafterSpec(
    name="assistant",
    cls="drafter_node.assistant:AssistantDrafter",
    title="an assistant model",
    transformers="`assistant_model=D`",
    drafts_with="a small model with the target's tokenizer",
    holds="a small model with the target's tokenizer, its own KV cache",
    conformance="testkit.conformance:assistant",
)
