"""Prompts as the benchmarks send them: token ids from the target's chat template, as the verifier templates the
same messages."""

from __future__ import annotations

from typing import Any


def chat_prompts(tokenizer: Any, messages: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """``{"ids", "messages"}`` per prompt: the target's chat template with the generation prompt, as the verifier
    templates ``messages``."""
    return [{"messages": m, "ids": list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                                      return_dict=True)["input_ids"])}
            for m in messages]
