"""``assistant``: a small model that shares the target's tokenizer (``drafter_node/assistant.py``)."""

from drafter_node.spec import DrafterSpec

SPEC = DrafterSpec(name="assistant", cls="drafter_node.assistant:AssistantDrafter", title="an assistant model",
                   conformance="testkit.conformance:assistant")
