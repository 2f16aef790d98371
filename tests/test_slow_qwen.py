"""Slow: the real pair of configs/cpu.yaml (Qwen2.5-Coder 1.5B target, 0.5B assistant) against transformers'
greedy ``generate`` on the target alone. Run on purpose: ``make test-slow`` (installs the weights on first use)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.launch import cluster
from shared.models import load_tokenizer
from weights import resolve_model

pytestmark = pytest.mark.slow

MESSAGES = [
    [{"role": "user", "content": "Write a Python function `fib(n)` that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Write a Python function that reverses the words of a sentence."}],
]
NEW_TOKENS = 48


@pytest.mark.parametrize("overlap", [True, False])
def test_qwen_pair_matches_transformers_greedy(overlap):
    path = resolve_model("qwen2.5-coder-1.5b-instruct")
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)
               ["input_ids"] for m in MESSAGES]

    async def main():
        async with cluster("cpu.yaml", overrides={"drafter.overlap": overlap}) as client:
            return [await client.generate(messages=m, max_new_tokens=NEW_TOKENS) for m in MESSAGES]

    results = asyncio.run(main())
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for ids, result in zip(prompts, results):
        x = torch.tensor([ids])
        ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == ref[0, len(ids):].tolist()
        assert result.metrics["acceptance_rate"] > 0.3
