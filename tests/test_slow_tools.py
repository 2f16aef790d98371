"""Slow: the real Qwen2.5-Coder 1.5B instruct target of configs/cpu.yaml (its 0.5B assistant drafting) calls a
calculator tool on its own (``tool_choice`` auto, hermes format read from its template), and its greedy tokens equal
transformers' ``generate`` on the target alone with the same tools in the prompt. Run on purpose: ``make test-slow``
(after ``make models``; skipped, saying so, where the weights are not installed)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.launch import cluster
from shared.models import load_tokenizer
from shared.named_models import installed_folder

pytestmark = pytest.mark.slow

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers and return their sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
MESSAGES = [{"role": "user", "content": "What is 1234 + 4321? Use the add tool."}]
NEW_TOKENS = 64


def test_qwen_calls_the_calculator_on_its_own():
    missing = [name for name in (TARGET, DRAFTER) if installed_folder(name) is None]
    if missing:
        pytest.skip(f"weights of {', '.join(missing)} are not installed (make models)")
    path = installed_folder(TARGET)

    async def main():
        async with cluster("cpu.yaml") as client:
            assert await client.target_tool_parser() == "hermes"
            return await client.generate(messages=MESSAGES, tools=TOOLS, max_new_tokens=NEW_TOKENS)

    result = asyncio.run(main())
    assert result.finish_reason == "tool_calls", result.text
    (call,) = result.tool_calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1234, "b": 4321}
    tokenizer = load_tokenizer(path)
    ids = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    assert result.metrics["prompt_tokens"] == len(ids)
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == ref[0, len(ids):].tolist()[:len(result.token_ids)]
