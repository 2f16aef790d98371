"""Slow: the real different-tokenizer pair of configs/universal.yaml (Qwen2.5-Coder-1.5B target, SmolLM2-135M
drafter) against transformers' greedy ``generate`` on the target alone. Run on purpose: ``make test-slow``."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.launch import cluster
from shared.models import load_tokenizer
from weights import resolve_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write a Python function `fib(n)` that returns the n-th Fibonacci number."}]
NEW_TOKENS = 32


def test_qwen_with_smollm_drafter_matches_transformers_greedy():
    path = resolve_model("qwen2.5-coder-1.5b-instruct")
    tokenizer = load_tokenizer(path)
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]

    async def main():
        async with cluster("universal.yaml") as client:
            return await client.generate(messages=MESSAGES, max_new_tokens=NEW_TOKENS)

    result = asyncio.run(main())
    print("universal metrics:", {k: result.metrics[k] for k in ("acceptance_rate", "mean_accepted_length", "drafts",
                                                               "draft_tokens", "tokens_per_second")})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == ref[0, len(ids):].tolist()
    assert result.metrics["drafts"] > 0
    assert result.metrics["acceptance_rate"] > 0.2
