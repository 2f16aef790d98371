"""The tool-call grammar through a real cluster (verifier and drafter in one process, ZeroMQ, tiny random models):
with the grammar of ``tool_choice`` ``"required"`` or a named function (one call) as the ``grammar`` parameter of
:class:`AsyncClient`, for each family, greedy output equals transformers' ``generate`` on the target with xgrammar's
logits processor, and every output, greedy and sampled, parses (shared.tool_calls) to one call of the tools (the
named one where named) whose arguments validate against its schema, with nothing around it."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json

import jsonschema
import pytest
import torch
import xgrammar as xgr
from conftest import start_cluster, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer
from xgrammar.contrib.hf import LogitsProcessor

from shared.tool_calls import PARSERS, parse_whole, tool_call_grammar

pytestmark = pytest.mark.cluster

EOS = 0
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["C", "F"]}},
           "required": ["city", "days"]}
ALARM = {"type": "object", "properties": {"at": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                          "loud": {"type": "boolean"}},
         "required": ["at"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7], [40, 41, 42, 43]]
MAX_NEW = 160


@functools.lru_cache(maxsize=1)
def _target(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _reference(folder, prompt: list[int], grammar: str) -> list[int]:
    model, tokenizer = _target(folder)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                         eos_token_id=[EOS], pad_token_id=1, logits_processor=[LogitsProcessor(compiled)])
    return out[0, len(prompt):].tolist()


def _calls(family: str, text: str) -> list:
    counter = itertools.count()
    content, calls = parse_whole(PARSERS[family](lambda: f"call_{next(counter):024x}"), text)
    assert content == "" and calls, f"not only calls: {text!r}"
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return calls


def test_forced_tool_calls_through_the_cluster(tiny):
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=4)
    weather = {"type": "function", "function": {"name": "get_weather"}}
    calls = []  # (family, forced name or None, generate's arguments); one call each: a random model given the
    # choice keeps calling until max_new_tokens (tests/test_tool_calls.py walks the parallel grammar)
    for family in sorted(PARSERS):
        for i, prompt in enumerate(PROMPTS):
            calls.append((family, None, {"token_ids": prompt, "grammar": tool_call_grammar(
                family, TOOLS, "required", False).to_wire()}))
            calls.append((family, "get_weather", {"token_ids": prompt, "do_sample": True, "temperature": 1.2,
                                                  "seed": i, "grammar": tool_call_grammar(
                                                      family, TOOLS, weather, False).to_wire()}))

    async def main():
        async with start_cluster(config) as client:
            return await asyncio.gather(*(client.generate(max_new_tokens=MAX_NEW, eos_token_ids=[EOS], **kw)
                                          for _, _, kw in calls))

    results = asyncio.run(main())
    for (family, forced, kw), r in zip(calls, results):
        assert r.finish_reason == "stop", r.text
        found = _calls(family, r.text)
        assert len(found) == 1 and found[0].name == (forced or found[0].name), r.text
        if not kw.get("do_sample"):
            assert r.token_ids == _reference(target, kw["token_ids"], kw["grammar"]["value"]), (family, kw)
