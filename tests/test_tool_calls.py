"""Tool-call parsing and the tool_choice grammar (shared/tool_calls.py), in one process.

Parsers: the examples of each family (content, calls, malformed and unterminated calls as content), what streaming
holds back, and the property that a streamed answer equals the whole one for any split of realistic outputs
(hypothesis: nested arguments, braces, quotes, escaped quotes and non-ASCII in strings, 1 or 2 calls, content before,
broken calls). Grammar: compiled by the verifier's own compiler against the tiny tokenizer; strings the matcher
accepts parse to calls whose arguments validate against the schema (random walks over the matcher's masks), and wrong
names, schema violations, content before a call and a second call where one is allowed are refused."""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from shared.sampling import GrammarSpec, ParamError
from shared.tool_calls import (
    PARSERS,
    ParsedDelta,
    ToolCall,
    parse_whole,
    parser_name_for_template,
    random_call_id,
    tool_call_grammar,
)
from verifier_node.grammar import GrammarCompiler, unpack_bitmask
from verifier_node.schema_check import check_schema, check_spec_bounds

pytestmark = pytest.mark.unit

EOS = 0


def ids():
    """A deterministic id source: the same ids for the streamed and the whole parse."""
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def render(family: str, calls: list[tuple[str, str]], before: str = "") -> str:
    """An output of ``family`` as its chat template writes it: ``calls`` are (name, arguments JSON text)."""
    if family == "hermes":
        return before + "\n".join(f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n</tool_call>'
                                  for n, a in calls)
    if family == "llama3_json":
        return before + "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)
    body = ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls)
    return before + f"[TOOL_CALLS][{body}]"


def stream(family: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """Feed ``pieces`` one push each and put the deltas back together as an OpenAI client does."""
    parser = PARSERS[family](ids())
    deltas = [parser.push(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    by_index: dict[int, dict] = {}
    for d in deltas:
        for c in d.calls:
            entry = by_index.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            for key in ("id", "name"):
                if getattr(c, key) is not None:
                    assert entry[key] is None, f"{key} sent twice for call {c.index}"
                    entry[key] = getattr(c, key)
            entry["arguments"] += c.arguments
    assert sorted(by_index) == list(range(len(by_index)))
    calls = [ToolCall(e["id"], e["name"], e["arguments"]) for _, e in sorted(by_index.items())]
    assert calls == parser.calls and content == parser.content
    return content, calls


ARGS_1 = '{"city": "Par{is} \\"old\\" town", "days": 3, "opts": {"units": ["°C", "mm"], "deep": {"a": [1, {}]}}}'
ARGS_2 = '{"q": "北京 ]}\\\\", "n": null}'


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_each_family_finds_its_calls_with_the_models_own_argument_text(family):
    text = render(family, [("get_weather", ARGS_1), ("search", ARGS_2)])
    content, calls = parse_whole(PARSERS[family](ids()), text)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", ARGS_1), ("search", ARGS_2)]
    assert [c.id for c in calls] == [f"call_{i:024x}" for i in range(2)]
    for c in calls:
        json.loads(c.arguments)


def test_content_before_a_hermes_call_and_text_after_it():
    text = "Let me look.\n" + render("hermes", [("f", "{}")]) + "\nDone."
    content, calls = parse_whole(PARSERS["hermes"](ids()), text)
    assert content == "Let me look.\n\nDone." and [c.name for c in calls] == ["f"]


def test_a_closing_marker_cut_by_the_end_is_dropped_and_pretty_printed_calls_parse():
    content, calls = parse_whole(PARSERS["hermes"](ids()), '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_c')
    assert (content, [c.name for c in calls]) == ("", ["f"])
    pretty = '<tool_call>\n{\n  "arguments": {\n    "a": [1, 2]\n  },\n  "name": "f"\n}\n</tool_call>'
    content, calls = parse_whole(PARSERS["hermes"](ids()), pretty)
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("f", '{\n    "a": [1, 2]\n  }')])


def test_llama_python_tag_and_mistral_content_before_the_marker():
    content, calls = parse_whole(PARSERS["llama3_json"](ids()), '<|python_tag|>{"name": "f", "parameters": {"a": 1}}')
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("f", '{"a": 1}')])
    content, calls = parse_whole(PARSERS["mistral"](ids()), 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {}}]')
    assert (content, [c.name for c in calls]) == ("Sure. ", ["f"])


@pytest.mark.parametrize("family, text, want_content, want_names", [
    # unterminated: the output ended inside the call
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "}', None, []),
    # invalid JSON in a closed object, a key missing, arguments not an object, an extra key, NaN
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>', None, []),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', None, []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>', None, []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}, "x": 1}\n</tool_call>', None, []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>', None, []),
    ("hermes", "<tool_call> not json", None, []),
    ("hermes", "a <tool_cal", None, []),
    # a broken call after a good one: the good one stays a call
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": ',
     '\n<tool_call>\n{"name": ', ["f"]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}', None, []),
    ("llama3_json", 'Hello {"name": "f", "parameters": {}}', None, []),
    ("llama3_json", '{"answer": 42}', None, []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": []}]',
     ', {"name": "g", "arguments": []}]', ["f"]),
    ("mistral", "[TOOL_CALLS] oops", None, []),
])
def test_malformed_calls_end_as_plain_content(family, text, want_content, want_names):
    content, calls = parse_whole(PARSERS[family](ids()), text)
    assert content == (text if want_content is None else want_content)
    assert [c.name for c in calls] == want_names


def test_streaming_holds_back_only_a_possible_marker_and_emits_a_call_once_whole():
    parser = PARSERS["hermes"](ids())
    assert parser.push("Hi <tool").content == "Hi "  # "<tool" may start the marker
    assert parser.push("s> and <").content == "<tools> and "  # it did not; "<" may again
    d = parser.push('tool_call>\n{"name": "f", "arguments": {"a": ')
    assert d == ParsedDelta("", [])  # the call is held until its JSON closes
    d = parser.push('1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert [(c.index, c.id, c.name, c.arguments) for c in d.calls] == [
        (0, "call_" + "0" * 24, "f", '{"a": 1}'), (1, "call_" + "0" * 23 + "1", "g", "{}")]
    assert d.content == "" and parser.finish() == ParsedDelta("", [])


def test_random_call_ids_have_openais_shape():
    a, b = random_call_id(), random_call_id()
    assert a != b and all(len(x) == 29 and x.startswith("call_") and int(x[5:], 16) >= 0 for x in (a, b))


# -- the property: any split gives the whole result ----------------------------------------------------------------

_text = st.lists(st.sampled_from([*'ab {}[]"\\,:;é北😀\n<>/_', "<tool_call>", "[TOOL_CALLS]", "</tool_call>"]),
                max_size=12).map("".join)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3), max_leaves=8)
_args = st.tuples(st.dictionaries(_text, _json, max_size=4), st.booleans(), st.sampled_from([None, 2])).map(
    lambda a: json.dumps(a[0], ensure_ascii=a[1], indent=a[2]))
_name = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)


@st.composite
def outputs(draw, family: str):
    """(an output of ``family``, the calls and the content it holds when not broken, whether it was broken)."""
    calls = draw(st.lists(st.tuples(_name, _args), min_size=0, max_size=2))
    before = draw(st.sampled_from(["", "Let me check.\n", "ok "])) if family != "llama3_json" else ""
    text = render(family, calls, before) if calls else draw(_text)
    broken = draw(st.sampled_from(["", "truncate", "drop", "append"]))
    if broken == "truncate" and text:
        text = text[:draw(st.integers(0, len(text) - 1))]
    elif broken == "drop" and text:
        i = draw(st.integers(0, len(text) - 1))
        text = text[:i] + text[i + 1:]
    elif broken == "append":
        text += draw(_text)
    return text, calls, before if calls else text, bool(broken)


def _splits(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("family", sorted(PARSERS))
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_split_streams_exactly_the_whole_result(family, data):
    text, calls, want_content, broken = data.draw(outputs(family))
    pieces = _splits(data.draw, text)
    whole_content, whole_calls = parse_whole(PARSERS[family](ids()), text)
    content, streamed = stream(family, pieces)
    assert (content, streamed) == (whole_content, whole_calls)
    if not broken:  # a well-formed output: exactly its calls, nothing lost or invented
        assert [(c.name, c.arguments) for c in whole_calls] == calls
        assert whole_content == want_content
    for c in whole_calls:  # a reported call always carries valid JSON arguments
        assert isinstance(json.loads(c.arguments), dict)
    # a round may commit many tokens at once: one push of everything equals the whole result too
    assert stream(family, [text]) == (whole_content, whole_calls)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), family=st.sampled_from(sorted(PARSERS)), text=st.text(max_size=80))
def test_any_text_parses_without_an_exception_and_streams_the_same(data, family, text):
    whole = parse_whole(PARSERS[family](ids()), text)
    assert stream(family, _splits(data.draw, text)) == whole
    assert whole[0] == text or whole[1]  # without a call, the content is the text itself


class _Forgetful(PARSERS["hermes"]):
    """A negative control: a parser that forgets what it held back at the end of each push (as one that parses
    each round's text on its own would)."""

    def push(self, text):
        out = super().push(text)
        self._emit(self._held)
        self._held, self._state = "", "content"
        return ParsedDelta(out.content + self._take().content, out.calls)


def test_the_split_check_catches_a_parser_that_loses_state_between_pushes(monkeypatch):
    text = render("hermes", [("f", '{"a": 1}')])
    monkeypatch.setitem(PARSERS, "hermes", _Forgetful)
    assert stream("hermes", [text]) == parse_whole(_Forgetful(ids()), text)  # one piece: no difference
    content, calls = stream("hermes", [text[:5], text[5:]])
    assert (content, calls) != parse_whole(_Forgetful(ids()), text) and calls == []


def test_template_detection():
    qwen = '{%- if tools %}<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
    llama31 = "{%- if builtin_tools %}<|python_tag|>{{- '\"parameters\": ' }}"
    llama32 = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    mistral = "{%- if message.tool_calls %}[TOOL_CALLS][{%- for tool_call in message.tool_calls %}"
    assert [parser_name_for_template(t) for t in (qwen, llama31, llama32, mistral, "{{ messages }}", None)] == [
        "hermes", "llama3_json", "llama3_json", "mistral", None, None]


# -- the grammar ---------------------------------------------------------------------------------------------------

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                          "unit": {"enum": ["°C", "°F"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "where": {"type": "object", "properties": {"lat": {"type": "number"}},
                                    "required": ["lat"]}},
           "required": ["city", "unit"]}
SEARCH = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                           "exact": {"type": "boolean"}},
          "required": ["tags", "exact"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": SEARCH}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "ping": {"type": "object", "properties": {},
                                                              "additionalProperties": False}}


@pytest.fixture(scope="module")
def compiler(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return GrammarCompiler(tokenizer, len(tokenizer), [EOS]), tokenizer


def _takes(compiled, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled, override_stop_tokens=[EOS])
    return bool(m.accept_string(text) and m.accept_token(EOS))


def _valid_calls(family: str, text: str) -> list[ToolCall]:
    content, calls = parse_whole(PARSERS[family](ids()), text)
    assert content == "", f"content around the calls: {content!r} in {text!r}"
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return calls


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_matcher_accepted_outputs_parse_to_valid_calls(compiler, family):
    """Random walks over the matcher's masks on the tiny tokenizer: every complete output is one or more calls of
    the tools, with schema-valid arguments, and nothing else."""
    grammar_compiler, tokenizer = compiler
    rng = random.Random(7)
    for parallel, choice in ((True, "required"), (False, {"type": "function", "function": {"name": "get_weather"}})):
        spec = tool_call_grammar(family, TOOLS, choice, parallel)
        check_spec_bounds(GrammarSpec.from_wire(spec.to_wire()))  # what the verifier checks before compiling
        compiled = grammar_compiler.compile(spec)
        seen = set()
        for _ in range(12):
            m = xgr.GrammarMatcher(compiled, override_stop_tokens=[EOS])
            mask = xgr.allocate_token_bitmask(1, len(tokenizer))
            out: list[int] = []
            for _step in range(800):
                m.fill_next_token_bitmask(mask, 0)
                allowed = unpack_bitmask(mask, len(tokenizer))[0].nonzero()[:, 0].tolist()
                token = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)
                assert m.accept_token(token)
                if token == EOS:
                    break
                out.append(token)
            assert m.is_terminated(), "the walk did not end"
            calls = _valid_calls(family, tokenizer.decode(out))
            assert calls and (parallel or len(calls) == 1)
            assert parallel or {c.name for c in calls} == {"get_weather"}
            seen.add(tuple(c.name for c in calls))
        assert len(seen) > 1 or not parallel, seen


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_the_grammar_refuses_what_the_choice_forbids(compiler, family):
    grammar_compiler, _ = compiler
    good = ("get_weather", '{"city": "paris", "unit": "°C", "days": 3}')
    required = grammar_compiler.compile(tool_call_grammar(family, TOOLS, "required", True))
    single = grammar_compiler.compile(tool_call_grammar(family, TOOLS, "required", False))
    named = grammar_compiler.compile(tool_call_grammar(
        family, TOOLS, {"type": "function", "function": {"name": "search"}}, True))
    two = render(family, [good, ("ping", "{}")])
    assert _takes(required, render(family, [good])) and _takes(required, two)
    assert _valid_calls(family, two)
    assert _takes(single, render(family, [good])) and not _takes(single, two)  # parallel_tool_calls: false
    assert not _takes(named, render(family, [good]))  # the named function only
    assert _takes(named, render(family, [("search", '{"tags": ["a"], "exact": false}')]))
    for bad in (render(family, [("get_wether", good[1])]),  # a name not in tools
                render(family, [("get_weather", '{"city": "Paris", "unit": "°C"}')]),  # pattern violated
                render(family, [("get_weather", '{"city": "paris"}')]),  # required property missing
                render(family, [("get_weather", '{"city": "paris", "unit": "°C", "x": 1}')]),  # not in the schema
                render(family, [("get_weather", '{"city": "paris", "unit": "°C", "days": 9}')]),  # maximum
                "Sure! " + render(family, [good]),  # content before the call
                render(family, [good]) + " bye",  # content after it
                ""):  # no call at all
        assert not _takes(required, bad), bad


def _nested_any_of(levels: int) -> dict:
    """A schema whose text doubles per level (so does its conversion time: 3 MB take half a minute)."""
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"anyOf": [{"type": "object", "properties": {"a": s}}, {"type": "array", "items": s}]}
    return {"type": "object", "properties": {"x": s}}


def test_auto_and_none_need_no_grammar_and_bad_input_names_the_field():
    assert tool_call_grammar("hermes", TOOLS, "auto", True) is None
    assert tool_call_grammar("hermes", TOOLS, "none", False) is None
    cases = [
        (("qwen", TOOLS, "required", True), "tool-call parser"),
        (("hermes", TOOLS, "always", True), "tool_choice"),
        (("hermes", TOOLS, {"type": "function", "function": {"name": "nope"}}, True), "'nope', which is not in"),
        (("hermes", [], "required", True), "at least one function"),
        (("hermes", TOOLS, "required", "yes"), "parallel_tool_calls"),
        (("hermes", "x", "auto", True), "tools must be a list"),
        (("hermes", [{"type": "function", "function": {"name": "a b"}}], "auto", True), "tools[0].function.name"),
        (("hermes", [TOOLS[0], TOOLS[0]], "auto", True), "given twice"),
        (("hermes", [{"type": "retrieval"}], "auto", True), "tools[0] must be"),
        (("hermes", [{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}],
          "required", True), "tools[0].function.parameters must be a JSON schema of an object"),
        (("hermes", [{"type": "function", "function": {"name": "a", "parameters": {"type": "object",
                                                                                   "properties": 3}}}],
          "required", True), "tools[0].function.parameters: refused by the grammar engine"),
        (("hermes", [TOOLS[1], {"type": "function", "function": {"name": "a", "strict": 1}}], "auto", True),
         "tools[1].function.strict"),
        (("hermes", [{"type": "function", "function": {"name": "a", "parameters": _nested_any_of(10)}}],
          "required", True), "at most 65536 are accepted"),
    ]
    for args, message in cases:
        with pytest.raises(ParamError) as caught:
            tool_call_grammar(*args)
        assert message in str(caught.value), (args, str(caught.value))


def test_the_schema_check_hook_refuses_keywords_the_engine_would_drop():
    tools = [TOOLS[0], {"type": "function", "function": {"name": "u", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}]
    tool_call_grammar("hermes", tools, "required", True)  # without the hook xgrammar drops uniqueItems silently
    with pytest.raises(ParamError, match=r"tools\[1\]\.function\.parameters: .*uniqueItems"):
        tool_call_grammar("hermes", tools, "required", True, check_schema=check_schema)


def test_non_ascii_in_a_schema_reads_back_as_itself(compiler):
    """xgrammar prints U+00B0 as ``\\xb0`` and reads ``\\xb0C`` back as U+0B0C: the printed escapes are rewritten."""
    grammar_compiler, _ = compiler
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"u": {"enum": ["°C", "😀A", "北"]}, "p": {"type": "string",
                                                                               "pattern": "^[é-ü]{1,3}$"}},
        "required": ["u", "p"]}}}]
    compiled = grammar_compiler.compile(tool_call_grammar("hermes", tools, "required", False))
    for u, p, ok in (("°C", "é", True), ("😀A", "üé", True), ("北", "ö", True), ("\u0b0c", "é", False),
                     ("ଌ", "é", False), ("°C", "a", False)):
        assert _takes(compiled, render("hermes", [("f", json.dumps({"u": u, "p": p}, ensure_ascii=False))])) is ok


def test_strict_false_allows_properties_the_schema_does_not_name(compiler):
    grammar_compiler, _ = compiler
    loose = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": False}}]
    extra = render("hermes", [("get_weather", '{"city": "paris", "unit": "°C", "x": 1}')])
    assert _takes(grammar_compiler.compile(tool_call_grammar("hermes", loose, "required", False)), extra)
    assert not _takes(grammar_compiler.compile(tool_call_grammar("hermes", TOOLS[:1], "required", False)), extra)
