"""Structured output keeps its word or refuses, in one process on the tiny tokenizer: a ``choice`` outside the BMP
compiles to its UTF-8 bytes (not JSON's surrogate escapes), schema keywords the engine ignores are refused with
their JSON pointer (each one checked against the engine: it really lets a violating text through), ``strict: false``
reaches the compile, a grammar that forces a long run fills it a capped number of tokens per round, taking turns
with other sessions, and stop strings with a constraint are a 400."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

from http_server.errors import OpenAIError
from http_server.schemas import ChatRequest, CompletionRequest, check_supported
from shared.backend import DynamicBackend
from shared.sampling import GenerationParams, GrammarSpec, ParamError, structured_output
from verifier_node.grammar import MAX_FORCED_PER_ROUND, GrammarCompiler, choice_grammar, ebnf_literal
from verifier_node.schema_check import IGNORED_KEYWORDS, check_schema
from verifier_node.session import Session

pytestmark = pytest.mark.unit

EOS = 0
INT = {"type": "integer"}
EMOJI = "a\U0001F600"


@pytest.fixture(scope="module")
def target(tiny):
    folder = tiny("llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def compiler(target):
    model, tokenizer = target
    return GrammarCompiler(tokenizer, model.config.vocab_size, [EOS])


def _takes(compiler, compiled, text: str) -> bool:
    """The matcher takes ``text`` (as UTF-8 bytes) and then the end token: a complete output."""
    m = xgr.GrammarMatcher(compiled, override_stop_tokens=[EOS])
    return bool(m.accept_string(text) and m.accept_token(EOS))


def _session(target, compiler, spec: GrammarSpec, sid: int = 1, max_new_tokens: int = 48) -> Session:
    model, tokenizer = target
    params = GenerationParams.from_dict({"eos_token_ids": [EOS], "max_new_tokens": max_new_tokens,
                                         "grammar": spec.to_wire()})
    s = Session(sid, DynamicBackend(model), tokenizer, [5, 17, 33], params, b"c", sid,
                grammar=compiler.session(spec, params.end_token_ids))
    s.prefill()
    return s


def _run(s: Session) -> str:
    while s.finished is None:
        s.verify([], None)
    return s.text.tokenizer.decode(s.generated, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------ choice literals
def test_a_choice_outside_the_bmp_is_its_utf8_bytes_not_surrogates(compiler, target):
    compiled = compiler.compile(GrammarSpec("choice", json.dumps([EMOJI])))
    assert _takes(compiler, compiled, EMOJI)
    m = xgr.GrammarMatcher(compiled, override_stop_tokens=[EOS])  # what json.dumps escapes used to compile to
    assert not m.accept_string("a\ud83d\ude00".encode("utf-8", "surrogatepass").decode("latin-1"))
    assert _run(_session(target, compiler, GrammarSpec("choice", json.dumps([EMOJI])))) == EMOJI  # greedy, exact


@pytest.mark.parametrize("text", ['say "hi"', "back\\slash", "two\nlines\tand\rcr", "bell\x07a del\x7f0", "é ü ✓"])
def test_choice_literals_escape_only_what_ebnf_needs(compiler, text):
    assert ebnf_literal(text).count("\\") == sum(text.count(c) for c in '"\\\n\t\r\x07\x7f') + text.count("\\")
    compiled = compiler.compiler.compile_grammar(choice_grammar([text, "other"]))
    assert _takes(compiler, compiled, text) and _takes(compiler, compiled, "other")
    assert not _takes(compiler, compiled, text[:-1])


def test_a_choice_with_a_lone_surrogate_is_refused():
    with pytest.raises(ParamError, match="not valid Unicode"):
        structured_output(choice=["a\ud83d"])


# ------------------------------------------------------------------------------------------ ignored keywords
#: (schema, a JSON text that violates it, the keyword, its JSON pointer)
IGNORED = [
    ({"type": "integer", "not": {"const": 3}}, "3", "not", "/not"),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "if": {"properties": {"a": {"const": 1}}},
      "then": {"required": ["b"]}}, '{"a": 1}', "if", "/if"),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}}, '{"a": 1}',
     "dependentRequired", "/dependentRequired"),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentSchemas": {"a": {"required": ["b"]}}},
     '{"a": 1}', "dependentSchemas", "/dependentSchemas"),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}}, '{"a": 1}',
     "dependencies", "/dependencies"),
    ({"type": "object", "properties": {"xs": {"type": "array", "items": INT, "contains": {"const": 5}}}},
     '{"xs": [1]}', "contains", "/properties/xs/contains"),
    ({"type": "array", "items": {"type": "array", "items": INT, "uniqueItems": True}}, "[[1, 1]]", "uniqueItems",
     "/items/uniqueItems"),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}, "5", "oneOf", "/oneOf"),
    ({"allOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 7}]}, "9", "allOf", "/allOf"),
    ({"type": "array", "prefixItems": [INT], "additionalItems": False}, "[1, 2]", "additionalItems",
     "/additionalItems"),
    ({"$defs": {"p": {"type": "string", "format": "idn-email"}}, "$ref": "#/$defs/p"}, '"#%~ zz"', "format",
     "/$defs/p/format"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, '"a"', "minLength", "/minLength"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf", "/multipleOf"),
    ({"type": "integer", "enum": [1, 5], "minimum": 3}, "1", "minimum", "/minimum"),
    ({"anyOf": [{"type": "integer", "enum": [1, "x"]}, {"type": "null"}]}, '"x"', "enum", "/anyOf/0/enum/1"),
    ({"type": "object", "properties": {"a": INT}, "required": ["a", "b"]}, '{"a": 1}', "required", "/required/1"),
    ({"$ref": "http://example.com/x.json"}, '"s"', "$ref", "/$ref"),
]


@pytest.mark.parametrize(("schema", "violating", "keyword", "pointer"), IGNORED, ids=[c[3] for c in IGNORED])
def test_keywords_the_engine_ignores_are_refused_with_their_pointer(compiler, schema, violating, keyword, pointer):
    # the engine really ignores it (if an upgrade starts enforcing one, this fails: take it off the list); not
    # strict, as strict mode alone happens to refuse extra items (additionalItems) where nothing else says so
    raw = compiler.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False)
    assert _takes(compiler, raw, violating)
    with pytest.raises(ParamError, match=re.escape(f"'{keyword}' at {pointer} is not supported")):
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))


def test_every_listed_keyword_is_refused_anywhere_and_data_is_not_walked():
    for keyword in IGNORED_KEYWORDS:
        with pytest.raises(ParamError, match=re.escape(f"'{keyword}' at /properties/x/{keyword} ")):
            check_schema({"type": "object", "properties": {"x": {keyword: {}}}})
    check_schema({"type": "object", "properties": {"not": {"type": "string", "enum": ["a", "b"]},
                                                   "t": {"const": {"oneOf": 1, "not": 2}, "default": {"if": 0}},
                                                   "d": {"type": "string", "format": "date-time"}},
                  "required": ["not"], "allOf": [{"type": "object"}], "$defs": {"n": INT}})


# ------------------------------------------------------------------------------------------ strict
def test_strict_false_is_carried_and_compiled(compiler):
    schema = {"type": "object", "properties": {"a": INT}, "required": ["a"]}
    loose = structured_output(response_format={"type": "json_schema",
                                               "json_schema": {"name": "n", "schema": schema, "strict": False}})
    assert loose is not None and not loose.strict
    strict = structured_output(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert strict is not None and strict.strict and strict.to_wire() == {"kind": "json_schema",
                                                                          "value": json.dumps(schema)}
    params = GenerationParams.from_dict({"eos_token_ids": [EOS], "grammar": loose.to_wire()})
    assert GenerationParams.from_dict(params.to_dict()).grammar_spec == loose  # over the protocol
    assert _takes(compiler, compiler.compile(loose), '{"a": 1, "z": true}')
    assert not _takes(compiler, compiler.compile(strict), '{"a": 1, "z": true}')
    assert _takes(compiler, compiler.compile(strict), '{"a": 1}')
    with pytest.raises(ParamError, match="strict must be true or false"):
        structured_output(response_format={"type": "json_schema",
                                           "json_schema": {"name": "n", "schema": schema, "strict": "no"}})
    with pytest.raises(ParamError, match="json_schema only"):
        GrammarSpec.from_wire({"kind": "regex", "value": "a", "strict": False})


# ------------------------------------------------------------------------------------------ forced runs
LITERAL = "abcdefghij" * 500  # a 5,000-character literal: every token forced


def test_a_long_forced_run_is_capped_per_round_and_completes(target, compiler):
    s = _session(target, compiler, GrammarSpec("regex", LITERAL), max_new_tokens=20_000)
    plan = s.grammar.plan([], None, limit=10**6)
    assert len(plan.draft) == plan.forced == MAX_FORCED_PER_ROUND
    s.grammar.commit(plan, [], 0)
    rounds = 0
    while s.finished is None:
        assert len(s.verify([], None).tokens) <= MAX_FORCED_PER_ROUND + 1
        rounds += 1
    assert s.finished == "stop" and rounds > 1
    assert s.text.tokenizer.decode(s.generated, skip_special_tokens=True) == LITERAL


def test_forced_rounds_take_turns_with_other_sessions(target, compiler):
    from types import SimpleNamespace

    from verifier_node.scheduler import BatchLimits, Scheduler

    model, tokenizer = target
    forced = _session(target, compiler, GrammarSpec("regex", LITERAL), sid=1, max_new_tokens=20_000)
    plain = Session(2, DynamicBackend(model), tokenizer, [5, 17, 33],
                    GenerationParams.from_dict({"eos_token_ids": [EOS]}), b"c", 2)
    plain.prefill()
    alive = SimpleNamespace(alive=lambda now=None: True)
    for s in (forced, plain):
        s.announced, s.drafter = True, alive
    scheduler = Scheduler(BatchLimits(False, 1, 512, 2048), now=lambda: 0.0)
    scheduler.add(forced)
    scheduler.add(plain)
    picked = []
    for _ in range(6):
        plain.draft = {"tokens": [7]}  # its drafter always has a block ready
        batch = scheduler.next_work()
        picked.append(batch[0].sid)
        batch[0].verify([], None)
        batch[0].draft = None
    assert forced.grammar.next_is_forced() and picked == [1, 2, 1, 2, 1, 2]


# ------------------------------------------------------------------------------------------ finish reasons
def test_a_constrained_run_cut_by_the_budget_is_length(target, compiler):
    s = _session(target, compiler, GrammarSpec("regex", LITERAL), max_new_tokens=5)
    _run(s)
    assert s.finished == "length"
    s = _session(target, compiler, GrammarSpec("choice", json.dumps(["yes", "no"])))
    assert _run(s) in ("yes", "no") and s.finished == "stop"


def test_stop_strings_with_a_constraint_are_a_400_naming_both():
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    for req in (ChatRequest(messages=[{"role": "user", "content": "x"}], stop=["}"], response_format=rf),
                CompletionRequest(prompt="x", stop="\n", guided_regex="a+\n")):
        with pytest.raises(OpenAIError, match="stop cannot be combined with an output constraint") as info:
            check_supported(req)
        assert info.value.status == 400 and info.value.param == "stop"
    check_supported(CompletionRequest(prompt="x", stop="\n"))
    check_supported(CompletionRequest(prompt="x", stop="\n", response_format={"type": "text"}))
