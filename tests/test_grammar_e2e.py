"""Structured output through real nodes: one launcher (verifier, an assistant drafter that is a perturbed copy of the
tiny target, so drafts are accepted and rejected, and the HTTP server) serves the module. Greedy output equals
transformers' ``generate`` on the target with xgrammar's logits processor; every sampled output parses and validates
against its schema; bad constraints are a ``bad_request`` for :class:`AsyncClient` and a 400 through the ``openai``
package and ``curl``, with the engine's message, and the node keeps serving."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import statistics
import subprocess
import time

import jsonschema
import openai
import pytest
import torch
import xgrammar as xgr
from conftest import http_launcher, tiny_config
from node_entry import node_entry
from transformers import AutoModelForCausalLM, AutoTokenizer
from xgrammar.contrib.hf import LogitsProcessor

from runtime.client import AsyncClient, PipespecError
from runtime.launch import cluster
from testkit.tiny_hybrid import perturbed_copy

pytestmark = pytest.mark.cluster

EOS = 0
SCHEMA = {
    "type": "object",
    # free text (printable ASCII but quote and backslash): the drafter has tokens to get right. A pattern, not
    # maxLength: xgrammar 0.2.9 lets raw control characters into a maxLength string (docs/architecture.md, limits)
    "properties": {"name": {"type": "string", "pattern": "^[ !#-\\[\\]-~]{1,10}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = [[5, 17, 33, 2, 60, 5, 17], [100, 101, 7], [40, 41, 42, 43, 44]]
MAX_NEW = 96


@pytest.fixture(scope="module")
def server(tiny, model_dir, tmp_path_factory):
    target = tiny("llama")
    near = model_dir / "llama-near-grammar"
    if not near.exists():
        perturbed_copy(target, near, noise=0.6, seed=5)
    config = tiny_config(target, near, num_draft_tokens=4)
    with http_launcher(config, tmp_path_factory.mktemp("grammar"), target=target) as served:
        yield served


def _run(server, calls: list[dict]) -> list:
    async def main():
        async with AsyncClient(server.address, timeout_s=60) as c:
            return await asyncio.gather(*(c.generate(**call) for call in calls))
    return asyncio.run(main())


def _reference(folder, prompt: list[int], schema: dict) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                             strict_mode=True)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                         eos_token_id=[EOS], pad_token_id=1, logits_processor=[LogitsProcessor(compiled)])
    return out[0, len(prompt):].tolist()


def _counts(results) -> tuple[int, int]:
    drafted = sum(r.metrics["draft_tokens"] for r in results)
    return sum(r.metrics["accepted_tokens"] for r in results), drafted


def test_greedy_equals_generate_with_the_engines_processor(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    results = _run(server, [{"token_ids": p, "max_new_tokens": MAX_NEW, "response_format": fmt} for p in PROMPTS])
    for prompt, r in zip(PROMPTS, results):
        assert r.token_ids == _reference(server.target, prompt, SCHEMA), f"prompt {prompt}"
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), SCHEMA)
    accepted, drafted = _counts(results)
    assert 0 < accepted < drafted, f"need drafts accepted and rejected: {accepted}/{drafted}"
    assert sum(r.metrics["grammar_forced_tokens"] for r in results) > 0


def test_every_sampled_output_validates(server):
    calls = [{"token_ids": PROMPTS[i % 3], "max_new_tokens": MAX_NEW, "do_sample": True, "temperature": 1.3,
              "seed": i, "json_schema": SCHEMA} for i in range(12)]
    results = _run(server, calls)
    values = set()
    for r in results:
        assert r.finish_reason == "stop", r.text
        value = json.loads(r.text)
        jsonschema.validate(value, SCHEMA)
        values.add(json.dumps(value, sort_keys=True))
    assert len(values) > 2
    accepted, drafted = _counts(results)
    assert 0 < accepted < drafted, f"need drafts accepted and rejected: {accepted}/{drafted}"


def test_regex_choice_and_json_object_through_the_client(server):
    regex, choice, obj = _run(server, [
        {"prompt": "answer:", "max_new_tokens": 12, "regex": r"(yes|no), [0-9]{2}"},
        {"prompt": "pick:", "max_new_tokens": 12, "choice": ["alpha", "beta gamma"]},
        {"prompt": "json:", "max_new_tokens": 30, "response_format": {"type": "json_object"}},
    ])
    assert regex.text[:3] in ("yes", "no,") and regex.finish_reason == "stop"
    assert choice.text in ("alpha", "beta gamma")
    if obj.finish_reason == "stop":  # a run cut by max_new_tokens need not parse (documented)
        assert isinstance(json.loads(obj.text), dict)


def test_bad_constraints_are_bad_requests_and_the_node_keeps_serving(server):
    async def main():
        async with AsyncClient(server.address, timeout_s=60) as c:
            with pytest.raises(PipespecError, match="minimum greater than maximum") as info:
                await c.generate(prompt="x", max_new_tokens=4,
                                 json_schema={"type": "integer", "minimum": 5, "maximum": 1})
            assert info.value.code == "bad_request"
            with pytest.raises(PipespecError, match="parenthesis is not closed"):
                await c.generate(prompt="x", max_new_tokens=4, regex="(ab")
            with pytest.raises(PipespecError, match="at most one output constraint") as info:
                await c.generate(prompt="x", max_new_tokens=4, regex="a", grammar='root ::= "a"')
            assert info.value.code == "bad_request"
            with pytest.raises(PipespecError, match="min_new_tokens"):
                await c.generate(prompt="x", max_new_tokens=4, regex="a+", min_new_tokens=2)
            return await c.generate(prompt="x", max_new_tokens=6, regex="ok")
    assert asyncio.run(main()).text == "ok"


def test_openai_client_gets_json_and_400s(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=MAX_NEW, messages=[{"role": "user", "content": "a person"}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    c = client.completions.create(model=server.model, prompt="go:", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[ab]{3}"}})
    assert len(c.choices[0].text) == 3 and set(c.choices[0].text) <= {"a", "b"}
    g = client.completions.create(model=server.model, prompt="go:", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert g.choices[0].text in ("left", "right")
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "foo"}}}},
         'Unsupported type "foo"'),
        ({"extra_body": {"guided_regex": "(ab"}}, "parenthesis is not closed"),
        ({"extra_body": {"guided_regex": "a", "guided_grammar": 'root ::= "a"'}}, "at most one output constraint"),
        ({"response_format": {"type": "xml"}}, "response_format type"),
    ]
    for extra, message in bad:
        with pytest.raises(openai.BadRequestError, match=message) as info:
            client.chat.completions.create(model=server.model, max_tokens=4, **extra,
                                           messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 400


def test_a_streamed_response_follows_the_schema(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    chunks = client.chat.completions.create(
        model=server.model, temperature=0.8, seed=4, max_tokens=MAX_NEW, stream=True,
        messages=[{"role": "user", "content": "a person"}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_curl_gets_a_400_with_the_engines_message(server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": server.model, "prompt": "x", "max_tokens": 4,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "n", "schema": "not json"}}})
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", f"{server.base_url}/completions", "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=60)
    text, status = out.stdout.rsplit("\n", 1)
    assert status == "400"
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and "response_format" in error["message"]
    body = json.dumps({"model": server.model, "prompt": "x", "max_tokens": 4,
                       "structured_outputs": {"json": {"type": "integer", "minimum": 9, "maximum": 1}}})
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", f"{server.base_url}/completions", "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=60)
    text, status = out.stdout.rsplit("\n", 1)
    assert status == "400" and "minimum greater than maximum" in json.loads(text)["error"]["message"]


def test_a_verifier_without_xgrammar_refuses_constraints_and_serves_the_rest(tiny):
    config = tiny_config(tiny("llama"), None, type="prompt_lookup", num_draft_tokens=2)

    async def main():
        async with cluster(config, entry={"verifier": node_entry("no_xgrammar")}) as c:
            with pytest.raises(PipespecError, match="needs the xgrammar package") as info:
                await c.generate(prompt="x", max_new_tokens=4, regex="a+")
            assert info.value.code == "bad_request"
            return await c.generate(prompt="x", max_new_tokens=4)
    assert len(asyncio.run(main()).token_ids) == 4


def test_constraints_keep_their_word_or_refuse_over_http(server):
    """An emoji choice comes back exactly; strict=false is served; a schema keyword the engine ignores, and stop
    strings with a constraint, are 400s that name them."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model=server.model, prompt="go:", max_tokens=12, temperature=0,
                                  extra_body={"guided_choice": ["a\U0001F600"]})
    assert r.choices[0].text == "a\U0001F600" and r.choices[0].finish_reason == "stop"
    loose = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=MAX_NEW, messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": loose, "strict": False}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}}}},
         "'not' at /properties/n/not is not supported"),
        ({"stop": ["}"], "response_format": {"type": "json_object"}}, "stop cannot be combined"),
    ]
    for extra, message in bad:
        with pytest.raises(openai.BadRequestError, match=message) as info:
            client.chat.completions.create(model=server.model, max_tokens=4, **extra,
                                           messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 400


# ------------------------------------------------------------------------------------------ masks within a budget
async def _stream_gaps(client, prompt: list[int], max_new: int) -> tuple[list[float], list[int]]:
    """Seconds between a plain greedy stream's chunks (from its start), and its tokens."""
    times, tokens = [time.monotonic()], []
    async for chunk in client.stream(token_ids=prompt, max_new_tokens=max_new, eos_token_ids=[]):
        times.append(time.monotonic())
        tokens.extend(chunk.token_ids)
    return [b - a for a, b in itertools.pairwise(times)], tokens


def test_a_slow_mask_request_fails_named_while_a_plain_stream_keeps_its_pace(tiny):
    """Over the real ZeroMQ link: a verifier whose JSON-schema masks take 0.6 s each (injected) against a 50 ms share.
    The structured request is shrunk, then fails with ``bad_request`` naming its request and the setting; a plain
    stream beside it keeps its median chunk gap within 2x its gap alone (measured first, same verifier) and never
    waits out a slow plan (its first round's masks: about two seconds or more), and its tokens are unchanged."""
    config = tiny_config(tiny("llama"), None, type="prompt_lookup", num_draft_tokens=3, prompt_lookup_num_tokens=3,
                         max_matching_ngram_size=3)
    config["verifier"]["grammar_mask_budget_ms"] = 50

    async def main():
        async with cluster(config, entry={"verifier": node_entry("slow_masks", "0.6,0.02")}) as client:
            # a fast grammar first: the compile child is up, so the slow one starts beside the plain stream
            await client.generate(token_ids=PROMPTS[0], regex="(yes|no)", max_new_tokens=4, eos_token_ids=[EOS])
            alone, alone_tokens = await _stream_gaps(client, PROMPTS[1], 60)
            slow = asyncio.create_task(client.generate(token_ids=PROMPTS[0], json_schema=SCHEMA, max_new_tokens=40,
                                                       eos_token_ids=[EOS]))
            beside, beside_tokens = await _stream_gaps(client, PROMPTS[1], 60)
            with pytest.raises(PipespecError) as failed:
                await slow
            return failed.value, alone, alone_tokens, beside, beside_tokens

    exc, alone, alone_tokens, beside, beside_tokens = asyncio.run(main())
    assert exc.code == "bad_request"
    assert re.match(r"request \d+: its grammar's token masks took", str(exc)), str(exc)
    assert "verifier.grammar_mask_budget_ms = 50 ms" in str(exc)
    assert beside_tokens == alone_tokens
    assert statistics.median(beside) < 2 * statistics.median(alone) + 0.02, (alone, beside)
    assert max(beside) < 1.5, beside  # filled on the loop: the slow request's first round (1.8 s or more) at once
