"""Tool calling end to end: one launcher serving a tiny Qwen2-architecture target whose tokenizer carries
Qwen2.5's tool template (hermes calls), its drafter the target itself drafting 15 tokens a round (every draft
accepted on free text: rounds commit up to 16 tokens), driven by the ``openai`` package and by a real agent library
(the OpenAI Agents SDK) over HTTP; plus in-process clusters with a one-token drafter (rounds of a few tokens) driven
by :class:`AsyncClient`, one per family (hermes, mistral, llama3_json). A random tiny model calls only under a
grammar (``required`` / a named tool), or where a regex makes its ``auto`` output a call; its free text is checked
against transformers' greedy ``generate``."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Annotated

import jsonschema
import openai
import pytest
from conftest import http_launcher, start_cluster, tiny_config
from pydantic import Field

from runtime.client import AsyncClient, Chunk, GenerationResult, PipespecError
from shared.models import load_tokenizer
from testkit.tiny_models import reference_greedy
from testkit.tool_templates import build_tool_model

pytestmark = pytest.mark.cluster

# bounded numbers: a random model under a grammar would otherwise write digits until max_tokens
NUMBER = {"type": "integer", "minimum": 0, "maximum": 999}
ADD_SCHEMA = {"type": "object", "properties": {"a": NUMBER, "b": NUMBER}, "required": ["a", "b"],
              "additionalProperties": False}
# a word of ASCII letters: on the tiny byte-level tokenizer a free JSON string may hold raw control bytes
MUL_SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["x"],
              "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": ADD_SCHEMA}},
    {"type": "function", "function": {"name": "mul", "description": "Repeat a word.", "parameters": MUL_SCHEMA}},
]
SCHEMAS = {"add": ADD_SCHEMA, "mul": MUL_SCHEMA}
ASK = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 2 + 3?"}]
HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "5"}]


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory):
    """The hermes target, and a different one-layer model with its tokenizer (a drafter that is often wrong)."""
    root = tmp_path_factory.mktemp("tools")
    target = build_tool_model(root, "hermes")
    return target, build_tool_model(root, "hermes", seed=2, layers=1, name="drafter")


@pytest.fixture(scope="module")
def hermes_target(tool_models):
    return tool_models[0]


@pytest.fixture(scope="module")
def server(hermes_target, tmp_path_factory):
    config = tiny_config(hermes_target, hermes_target, num_draft_tokens=15)
    with http_launcher(config, tmp_path_factory.mktemp("tools-http")) as served:
        yield served


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _calls(message_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message_calls or []]


def _assembled(chunks) -> tuple[str, list[tuple[str, dict]], list[str], str | None]:
    """Streamed chunks put together as an OpenAI client does: content, calls, call ids, finish reason."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for c in choice.delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += c.id or ""
            entry["name"] += (c.function.name or "") if c.function else ""
            entry["arguments"] += (c.function.arguments or "") if c.function else ""
        reason = choice.finish_reason or reason
    ordered = [calls[i] for i in sorted(calls)]
    return content, [(c["name"], json.loads(c["arguments"])) for c in ordered], [c["id"] for c in ordered], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "mul"}}],
                         ids=["required", "named"])
def test_forced_calls_follow_the_schema_and_stream_identically(server, choice):
    client = _client(server)
    # one call: a random model allowed several may repeat them until max_tokens
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
              temperature=0, max_tokens=160)
    r = client.chat.completions.create(**kw)
    message, calls = r.choices[0].message, _calls(r.choices[0].message.tool_calls)
    assert calls and r.choices[0].finish_reason == "tool_calls", (message, r.choices[0].finish_reason)
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    if isinstance(choice, dict):
        assert {name for name, _ in calls} == {"mul"}
    assert all(c.id and c.type == "function" for c in message.tool_calls)
    # streamed, rounds of up to 16 tokens: the same calls, content and reason
    content, streamed, ids, reason = _assembled(client.chat.completions.create(**kw, stream=True))
    assert streamed == calls and reason == "tool_calls" and all(ids)
    assert (content or None) == (message.content or None)


def test_n2_choices_each_carry_their_calls_and_logprobs(server):
    """Tools, log probabilities and n together, sync and async: each choice is read for calls on its own, whole
    and streamed."""
    client = _client(server)
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=160, logprobs=True, top_logprobs=1)
    one = client.chat.completions.create(**kw)
    r = client.chat.completions.create(**kw, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:  # greedy: both equal the single answer
        assert _calls(choice.message.tool_calls) == _calls(one.choices[0].message.tool_calls)
        assert choice.finish_reason == "tool_calls"
        assert [e.token for e in choice.logprobs.content] == [e.token for e in one.choices[0].logprobs.content]
    async def streamed() -> dict[int, list]:  # the openai package's async client, streamed
        by_index: dict[int, list] = {0: [], 1: []}
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as oai:
            async for chunk in await oai.chat.completions.create(**kw, n=2, stream=True):
                for c in chunk.choices:
                    by_index[c.index].append(types.SimpleNamespace(choices=[c]))
        return by_index

    by_index = asyncio.run(streamed())
    for index in (0, 1):
        _, calls, _, reason = _assembled(by_index[index])
        assert calls == _calls(one.choices[0].message.tool_calls) and reason == "tool_calls"
        tokens = [e.token for chunk in by_index[index] if chunk.choices[0].logprobs is not None
                  for e in chunk.choices[0].logprobs.content or []]
        assert tokens == [e.token for e in one.choices[0].logprobs.content]


def test_auto_parses_a_call_the_model_writes(server):
    # a regex makes the random model write a hermes call; auto reads it like any output
    regex = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>'
    client = _client(server)
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
              extra_body={"structured_outputs": {"regex": regex}})
    r = client.chat.completions.create(**kw)
    (name, arguments), = _calls(r.choices[0].message.tool_calls)
    assert name == "add" and set(arguments) == {"a", "b"} and r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content is None
    content, streamed, _, reason = _assembled(client.chat.completions.create(**kw, stream=True))
    assert streamed == [(name, arguments)] and reason == "tool_calls" and not content.strip()
    # with log probabilities: one per token, whole or streamed (where the parser holds text back they go with the
    # next event it lets out)
    r = client.chat.completions.create(**kw, logprobs=True)
    tokens = r.usage.completion_tokens
    assert _calls(r.choices[0].message.tool_calls) == [(name, arguments)]
    assert len(r.choices[0].logprobs.content) == tokens
    chunks = list(client.chat.completions.create(**kw, logprobs=True, stream=True))
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == tokens
    # tool_choice none: the same output, not parsed
    r = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.startswith("<tool_call>")


def test_a_history_with_calls_and_results_is_templated_and_greedy_exact(server, hermes_target):
    tok = load_tokenizer(hermes_target)
    as_dicts = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": {"a": 2, "b": 3}}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in HISTORY]
    ids = tok.apply_chat_template(as_dicts, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    r = _client(server).chat.completions.create(model=server.model, messages=HISTORY, tools=TOOLS, temperature=0,
                                                max_tokens=24)
    assert r.usage.prompt_tokens == len(ids)

    async def on_ids():
        async with AsyncClient(server.address, timeout_s=60) as c:
            return await c.generate(token_ids=ids, max_new_tokens=24)

    want = asyncio.run(on_ids())
    eos = [tok.eos_token_id]
    assert want.token_ids == reference_greedy(hermes_target, ids, 24, eos)[:len(want.token_ids)]
    # the random model writes no call: its text is the content, as on the same ids without chat or tools
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == want.text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "tools": TOOLS}, "tools"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "div"}}},
     "tool_choice"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 2"}}]}], "tools": TOOLS},
     "messages"),
    ({"messages": ASK, "functions": [TOOLS[0]["function"]]}, "functions"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": "required", "stop": ["}"]}, "stop"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "add", "parameters": 3}}]}, "tools"),
], ids=["completions", "unknown name", "with response_format", "arguments not JSON", "legacy functions",
        "required with stop", "bad parameters"])
def test_bad_tool_requests_are_a_400_naming_the_field(server, body, param):
    client = _client(server)
    path = "/completions" if "prompt" in body else "/chat/completions"
    with pytest.raises(openai.BadRequestError) as info:
        client.post(path, body={"model": server.model, "max_tokens": 4, **body}, cast_to=object)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def test_an_agent_library_runs_its_tool_loop_to_the_end(server):
    """The OpenAI Agents SDK: required tool choice on the first turn (reset after a call), a calculator tool, the
    result back as a tool turn, then a final answer."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    seen: list[tuple[int, int]] = []

    @function_tool
    def add(a: Annotated[int, Field(ge=0, le=999)], b: Annotated[int, Field(ge=0, le=999)]) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    model = OpenAIChatCompletionsModel(model=server.model, openai_client=openai.AsyncOpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=60))
    agent = Agent(name="calculator", instructions="You add numbers with the add tool.", model=model, tools=[add],
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=80))
    result = asyncio.run(Runner.run(agent, "What is 2 + 3?", max_turns=4))
    kinds = [type(item) for item in result.new_items]
    assert seen and all(type(a) is int and type(b) is int for a, b in seen)
    assert kinds.index(ToolCallItem) < kinds.index(ToolCallOutputItem) < kinds.index(MessageOutputItem)
    assert str(sum(seen[0])) in [str(i.output) for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert isinstance(result.final_output, str)


# ------------------------------------------------------------------------------------------ the client, small rounds
@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3_json"])
def test_the_client_streams_the_same_calls_in_one_token_rounds(tool_models, tmp_path, family):
    """Each family end to end through the client: its template, its grammar, its parser (the family from the
    verifier's pong)."""
    if family == "hermes":
        models = tool_models
    else:
        models = (build_tool_model(tmp_path, family), build_tool_model(tmp_path, family, seed=2, layers=1,
                                                                       name="drafter"))
    config = tiny_config(*models, num_draft_tokens=1)

    async def main():
        async with start_cluster(config) as client:
            assert await client.target_tool_parser() == family
            out = {}
            for choice in ("required", {"type": "function", "function": {"name": "add"}}):
                kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                          max_new_tokens=160)
                whole = await client.generate(**kw)
                deltas, result, sizes = [], None, []
                async for item in client.stream(**kw, include_result=True):
                    if isinstance(item, Chunk):
                        deltas.append(item.delta)
                        sizes.append(len(item.token_ids))
                    else:
                        result = item
                out[json.dumps(choice)] = whole, deltas, result, sizes
            with pytest.raises(PipespecError, match="not in tools") as info:
                await client.generate(messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                                                              "function": {"name": "div"}})
            assert info.value.code == "bad_request"
            return out

    for whole, deltas, result, sizes in asyncio.run(main()).values():
        # one draft token a round: rounds of a few tokens (the sum is every token)
        assert isinstance(result, GenerationResult) and sum(sizes) == len(result.token_ids) <= 3 * len(sizes)
        assert whole.tool_calls and whole.finish_reason == result.finish_reason == "tool_calls"
        assert [(c.name, c.arguments) for c in whole.tool_calls] == [(c.name, c.arguments) for c in result.tool_calls]
        for call in whole.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        streamed: dict[int, dict] = {}
        for d in deltas:
            for c in d.calls:
                entry = streamed.setdefault(c.index, {"name": "", "arguments": ""})
                entry["name"] += c.name or ""
                entry["arguments"] += c.arguments
        assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == \
            [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
        assert "".join(d.content for d in deltas) == result.content == whole.content
