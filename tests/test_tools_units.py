"""Tool calling's pure parts: the checks of tool turns and tools (shared.chat_tools, as Generate.validate runs
them), the verifier's templating of them on the three families' templates against ``apply_chat_template`` itself,
the plan of a request (tool_choice, the grammar, what is refused), and the HTTP server's shaping of the parser's
output, streamed in pieces of any size and whole."""

from __future__ import annotations

import json

import msgpack
import pytest
from transformers import PreTrainedTokenizerFast

from http_server.errors import OpenAIError
from http_server.tools import ToolOutput, check_chat_messages
from runtime.cli import flag_overrides, parser
from shared.chat_tools import MAX_TOOLS, ChatError, check_messages, check_tools, plan_tools, template_messages
from shared.protocol import Generate, ProtocolError, decode, encode
from shared.sampling import GrammarSpec
from shared.tool_calls import parser_name_for_template
from testkit.tool_templates import TEMPLATES, build_tool_tokenizer
from verifier_node.intake import _encode

pytestmark = pytest.mark.unit

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}
HISTORY = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abc123xyz", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "abc123xyz", "name": "add", "content": "5"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, PreTrainedTokenizerFast]:
    root = tmp_path_factory.mktemp("tool-tokenizers")
    return {family: build_tool_tokenizer(root / family, family) for family in TEMPLATES}


# ------------------------------------------------------------------------------------------ checks
BAD_TURNS = {
    "content missing": ([{"role": "user"}], "messages[0] must be {role, content}"),
    "null content without calls": ([{"role": "user", "content": None}], "messages[0].content may be null"),
    "arguments not JSON": ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]}],
        "messages[0].tool_calls[0].function.arguments"),
    "arguments a list": ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[1]"}}]}], "JSON text of an object"),
    "calls on a user turn": ([{"role": "user", "content": "x", "tool_calls": []}], "assistant turn only"),
    "tool turn without id": ([{"role": "tool", "content": "5"}], "messages[0].tool_call_id"),
    "call type": ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "code", "function": {"name": "add", "arguments": "{}"}}]}], ".type must be"),
    "content a number": ([{"role": "user", "content": 5}], "content must be a string"),
}


@pytest.mark.parametrize("name", sorted(BAD_TURNS))
def test_a_bad_turn_is_a_bad_request_naming_its_place(name):
    messages, words = BAD_TURNS[name]
    with pytest.raises(ChatError, match=words.replace("[", r"\[").replace("]", r"\]").replace("{", r"\{")):
        check_messages(messages)
    # on the wire: the request's own bad_request, never a dead node
    header = {"request_id": 3, "params": {}, "messages": messages}
    frames = encode(Generate(request_id=3, params={}, token_ids=[1]))
    raw = msgpack.unpackb(frames[0], raw=False)
    raw.update(header)
    raw.pop("token_ids")
    with pytest.raises(ProtocolError) as info:
        decode([msgpack.packb(raw, use_bin_type=True)])
    assert info.value.code == "bad_request" and info.value.request_id == 3
    # and at the HTTP server, first: a 400 naming messages
    with pytest.raises(OpenAIError) as http:
        check_chat_messages(messages)
    assert http.value.status == 400 and http.value.body()["error"]["param"] == "messages"


def test_good_turns_and_tools_pass_and_round_trip():
    check_messages(HISTORY)
    check_tools([ADD, MUL])
    msg = decode(encode(Generate(request_id=1, params={}, messages=HISTORY, tools=[ADD, MUL])))
    assert msg.messages == HISTORY and msg.tools == [ADD, MUL]


@pytest.mark.parametrize("tools, words", [
    ([], "1 to"), ([ADD] * (MAX_TOOLS + 1), "1 to"), ([ADD, ADD], "given twice"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "add numbers"}}], "letters, digits"),
    ([{"type": "retrieval"}], "tools[0] must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "parameters must be a JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": json.loads("[" * 40 + "]" * 40)}}],
     "parameters must be"),
], ids=["none", "too many", "twice", "no name", "name with a space", "not a function", "parameters text", "deep"])
def test_bad_tools_are_refused(tools, words):
    with pytest.raises(ChatError, match=words.replace("[", r"\[").replace("]", r"\]")):
        check_tools(tools)


def test_tools_need_messages_on_the_wire():
    header = encode(Generate(request_id=4, params={}, messages=[{"role": "user", "content": "x"}], tools=[ADD]))
    raw = msgpack.unpackb(header[0], raw=False)
    raw["prompt"] = raw.pop("messages")[0]["content"]
    with pytest.raises(ProtocolError, match="tools go with messages"):
        decode([msgpack.packb(raw, use_bin_type=True)])


# ------------------------------------------------------------------------------------------ templates
@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_the_verifier_templates_tool_turns_as_the_template_itself(tokenizers, family):
    tok = tokenizers[family]
    # what a user of transformers writes: arguments as a mapping
    as_dicts = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in HISTORY]
    want = tok.apply_chat_template(as_dicts, tools=[ADD, MUL], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    got = _encode(tok, decode(encode(Generate(request_id=1, params={}, messages=HISTORY, tools=[ADD, MUL]))))
    assert got == want
    text = tok.decode(got)
    # the tools, the call and its result are all in the prompt (no part silently dropped)
    assert '"name": "mul"' in text and '"a": 2' in text and ("5" in text.split("What is 2 + 3?")[-1])
    without = _encode(tok, Generate(request_id=1, params={}, messages=[HISTORY[1]]))
    assert '"mul"' not in tok.decode(without)  # no tools, none shown
    assert template_messages(HISTORY)[2]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_each_family_is_recognised_from_its_template(family):
    assert parser_name_for_template(TEMPLATES[family]) == family


def test_a_template_without_tools_is_recognised_as_none():
    from testkit.tiny_models import CHAT_TEMPLATE

    assert parser_name_for_template(CHAT_TEMPLATE) is None
    assert parser_name_for_template(None) is None


# ------------------------------------------------------------------------------------------ plans
def test_plans_of_each_tool_choice():
    assert plan_tools(None, None, None, "hermes") is None
    auto = plan_tools([ADD], None, None, "hermes")
    assert auto.choice == "auto" and auto.parser == "hermes" and auto.grammar is None and auto.parallel
    none = plan_tools([ADD], "none", None, "hermes")
    assert none.parser is None and none.grammar is None
    assert plan_tools([ADD], "none", None, None).parser is None  # none needs no parser: tools only shown
    required = plan_tools([ADD, MUL], "required", False, "hermes")
    assert isinstance(required.grammar, GrammarSpec) and not required.parallel
    named = plan_tools([ADD, MUL], {"type": "function", "function": {"name": "mul"}}, None, "hermes")
    assert named.grammar is not None and named.choice == {"type": "function", "function": {"name": "mul"}}
    # auto with a response format: allowed (the format constrains, the parser reads what comes)
    assert plan_tools([ADD], "auto", None, "hermes", GrammarSpec("json_object")).grammar is None


@pytest.mark.parametrize("args, param, words", [
    (([ADD], "sometimes", None, "hermes"), "tool_choice", "must be none, auto, required"),
    ((None, "required", None, "hermes"), "tool_choice", "needs tools"),
    (([ADD], {"type": "function", "function": {"name": "mul"}}, None, "hermes"), "tool_choice", "not in tools"),
    (([ADD], {"type": "function"}, None, "hermes"), "tool_choice", "must be"),
    (([ADD], "auto", None, None), "tools", "no tool-call format"),
    (([ADD], "auto", "yes", "hermes"), "parallel_tool_calls", "true or false"),
    (([ADD], "auto", None, "nonesuch"), "tools", "not available"),
    (([ADD], "required", None, "hermes", GrammarSpec("json_object")), "tool_choice", "json_object"),
], ids=["choice word", "required without tools", "unknown name", "no function", "no parser", "parallel type",
        "unknown parser", "with response_format"])
def test_plans_refused_name_the_field(args, param, words):
    with pytest.raises(ChatError, match=words) as info:
        plan_tools(*args)
    assert info.value.param == param


def test_the_tool_call_parser_flag_sets_the_config_key():
    args = parser().parse_args(["serve", "--model", "m", "--tool-call-parser", "mistral"])
    assert flag_overrides(args)[0]["http.tool_call_parser"] == "mistral"
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--model", "m", "--tool-call-parser", "xml"])


# ------------------------------------------------------------------------------------------ HTTP output
CALL_TEXT = ('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
             '<tool_call>\n{"name": "mul", "arguments": {"x": "é"}}\n</tool_call>')


def _streamed(plan, text: str, size: int) -> tuple[str, list[dict], str]:
    """``text`` through ToolOutput in pieces of ``size`` characters, assembled as an OpenAI client does."""
    out = ToolOutput(plan)
    deltas = [d for i in range(0, len(text), size) for d in out.deltas(text[i:i + size])] + out.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = c.get("id") or entry["id"]
            entry["name"] += c["function"].get("name", "")
            entry["arguments"] += c["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], out.finish_reason("stop")


@pytest.mark.parametrize("size", [1, 3, 16, 1000])
def test_streamed_calls_equal_whole_ones_whatever_the_piece_size(size):
    plan = plan_tools([ADD, MUL], "auto", None, "hermes")
    message = ToolOutput(plan).message(CALL_TEXT)
    content, calls, reason = _streamed(plan, CALL_TEXT, size)
    whole = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in message["tool_calls"]]
    assert whole == [{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "mul", "arguments": {"x": "é"}}]
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == whole
    assert all(c["id"] for c in calls) and reason == "tool_calls"
    assert content.strip() == message["content"].strip() == "Let me add."


def test_no_calls_leave_the_text_as_content_and_the_reason_as_it_was():
    plan = plan_tools([ADD], "auto", None, "hermes")
    out = ToolOutput(plan)
    message = out.message("just text, no call")
    assert message == {"role": "assistant", "content": "just text, no call", "refusal": None}
    assert out.finish_reason("length") == "length" and out.finish_reason("stop") == "stop"
    assert _streamed(plan, "just text, no call", 4)[:2] == ("just text, no call", [])


def test_parallel_false_keeps_the_first_call():
    plan = plan_tools([ADD, MUL], "auto", False, "hermes")
    message = ToolOutput(plan).message(CALL_TEXT)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"]
    assert [c["name"] for c in _streamed(plan, CALL_TEXT, 5)[1]] == ["add"]


def test_only_calls_give_null_content():
    plan = plan_tools([ADD], "required", None, "hermes")
    message = ToolOutput(plan).message(CALL_TEXT.removeprefix("Let me add."))
    assert message["content"] is None and len(message["tool_calls"]) == 2


# ------------------------------------------------------------------------------------------ call markers in the text
def test_a_tool_request_keeps_its_familys_call_marker_in_the_text(tokenizers):
    from shared.tool_calls import PARSERS, parse_whole
    from verifier_node.detokenize import IncrementalText, decode, tool_marker_ids

    assert tool_marker_ids(tokenizers["hermes"]) == frozenset()  # <tool_call> is ordinary text already
    assert tool_marker_ids(tokenizers["llama3_json"]) == {tokenizers["llama3_json"].convert_tokens_to_ids(
        "<|python_tag|>")}
    tok = tokenizers["mistral"]
    keep = tool_marker_ids(tok)
    assert keep == {tok.convert_tokens_to_ids("[TOOL_CALLS]")}
    ids = tok('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7, "b": 8}}]', add_special_tokens=False)["input_ids"]
    ids += [tok.convert_tokens_to_ids("[INST]"), tok.eos_token_id]  # other special tokens stay out of the text
    kept = IncrementalText(tok, keep)
    text = "".join(kept.push([i]) for i in ids)  # one token a round
    assert text == decode(tok, ids, keep) == '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7, "b": 8}}]'
    content, calls = parse_whole(PARSERS["mistral"](), text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 7, "b": 8})] and not content.strip()
    # the control: without keeping it the marker is gone, and so is the call
    dropped = "".join(IncrementalText(tok).push([i]) for i in ids)
    assert "[TOOL_CALLS]" not in dropped and parse_whole(PARSERS["mistral"](), dropped)[1] == []
