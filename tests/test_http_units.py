"""The HTTP server's pieces without a cluster: the stop-string matcher over streamed text, the request schemas'
field policy, the ``http`` config section's rules (loopback unless api_key and allow_remote), and ``--http``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import http_refusal
from hypothesis import given
from hypothesis import strategies as st

from http_server.errors import OpenAIError, from_pipespec
from http_server.generation import generation_params
from http_server.schemas import ChatRequest, CompletionRequest, check_supported
from http_server.stop import StopMatcher
from runtime.client import PipespecError
from runtime.config import ConfigError, load_config
from runtime.launch import main, parse_http_address

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    shown, hit = [], False
    for piece in pieces:
        out, hit = m.push(piece)
        shown.append(out)
        if hit:
            break
    if not hit:
        shown.append(m.flush())
    return shown, hit


def test_stop_split_across_pieces_is_never_shown_in_part():
    shown, hit = _run(["END"], ["abc E", "N", "D tail"])
    assert hit and "".join(shown) == "abc " and shown[0] == "abc "  # " E" held back until it could not be a stop
    shown, hit = _run(["END"], ["abc E", "x"])
    assert not hit and "".join(shown) == "abc Ex" and shown == ["abc ", "Ex", ""]


def test_the_stop_completed_first_wins_and_no_stop_passes_everything():
    assert _run(["yz", "b"], ["a", "bcxyz"]) == (["a", ""], True)
    assert _run(["longer", "on"], ["lo", "nger"])[0] == ["", "l"]  # "on" ends first in the text
    assert _run([], ["a", "b"]) == (["a", "b", ""], False)
    with pytest.raises(ValueError):
        StopMatcher([""])


@given(st.text(alphabet="abc", max_size=40), st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1,
                                                        max_size=3), st.randoms())
def test_stop_matcher_equals_cutting_the_whole_text(text, stops, rnd: random.Random):
    cuts = sorted(rnd.sample(range(len(text) + 1), min(len(text) + 1, 5)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    shown, hit = _run(stops, pieces)
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]  # (end, start) of first matches
    assert hit == bool(hits)
    assert "".join(shown) == (text[: min(hits)[1]] if hits else text)


def test_schemas_refuse_what_pipespec_would_ignore():
    ok = CompletionRequest(prompt="x", n=1, echo=False, logprobs=None, user="me", presence_penalty=0)
    check_supported(ok)
    check_supported(CompletionRequest(prompt="x", logit_bias={"1": 2}, frequency_penalty=0.5))  # implemented
    for extra in ({"best_of": 2, "n": 3}, {"suffix": "x"}, {"logit_bias": {"1": 200}},
                  {"response_format": {"type": "xml"}}, {"logit_bias": {"a": 1}}, {"tools": []},
                  {"prompt": ["a", "b"]}):
        with pytest.raises(OpenAIError) as info:
            check_supported(CompletionRequest(**{"prompt": "x", **extra}))
        assert info.value.status == 400 and info.value.param == next(iter(extra))
    check_supported(ChatRequest(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"}]}]))
    msg = ChatRequest(messages=[{"role": "developer", "content": "be brief"}]).messages[0]
    assert msg.as_template_input() == {"role": "system", "content": "be brief"}


def test_temperature_zero_is_greedy_and_absent_samples_as_openai():
    greedy = generation_params(CompletionRequest(prompt="x", temperature=0, top_p=0.5, max_tokens=5), 256)
    assert greedy == {"max_new_tokens": 5, "do_sample": False}
    default = generation_params(CompletionRequest(prompt="x", seed=3, top_k=-1), 64)
    assert default == {"max_new_tokens": 64, "do_sample": True, "temperature": 1.0, "seed": 3}
    both = generation_params(ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=9,
                                         max_completion_tokens=4, temperature=0.7, top_k=5,
                                         repetition_penalty=1.1), 64)
    assert both == {"max_new_tokens": 4, "do_sample": True, "temperature": 0.7, "top_k": 5,
                    "repetition_penalty": 1.1}


def test_verifier_error_codes_map_to_statuses():
    assert [from_pipespec(PipespecError("m", code)).status for code in
            ("bad_request", "too_large", "busy", "verifier_gone", "closed", "internal_error", "whatever")] == \
        [400, 413, 429, 503, 503, 500, 500]
    assert from_pipespec(TimeoutError("slow")).status == 504
    assert from_pipespec(PipespecError("m", "busy")).headers == {"Retry-After": "1"}


@pytest.mark.parametrize("overrides,match", [
    ({"http.host": "0.0.0.0"}, "needs http.api_key .* and http.allow_remote: true"),
    ({"http.host": "0.0.0.0", "http.api_key": "k" * 20}, "needs http.allow_remote: true"),
    ({"http.host": "0.0.0.0", "http.allow_remote": True}, "needs http.api_key"),
    ({"http.host": "127.0.0.1", "http.api_key": "short"}, "at least 16"),
    ({"http.host": "example.org"}, "not an IP address"),
    ({"http.port": 70000}, r"\[1, 65535\]"),
    ({"http.allow_remote": "yes"}, "true or false"),
    ({"http.max_body_bytes": 10}, "max_body_bytes"),
])
def test_http_config_refuses_unsafe_or_bad_values(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("cpu.yaml", overrides)


def test_http_config_allows_loopback_and_remote_with_key_and_allow_remote(monkeypatch):
    assert load_config("cpu.yaml", {"http.host": "::1"})["http"]["host"] == "::1"
    remote = load_config("cpu.yaml", {"http.host": "0.0.0.0", "http.api_key": "k" * 20, "http.allow_remote": True})
    assert remote["http"]["api_key"] == "k" * 20
    monkeypatch.setenv("PIPESPEC_HTTP_API_KEY", "e" * 20)  # a key kept out of argv and config files
    env = load_config("cpu.yaml", {"http.host": "0.0.0.0", "http.allow_remote": True})
    assert env["http"]["api_key"] == "e" * 20


def test_http_flag_parses_and_bad_combinations_are_clear_errors(capsys):
    assert parse_http_address("127.0.0.1:8000") == {"http.host": "127.0.0.1", "http.port": 8000}
    assert parse_http_address("[::1]:9") == {"http.host": "::1", "http.port": 9}
    assert parse_http_address("8001") == {"http.host": "127.0.0.1", "http.port": 8001}
    assert main(["--config", "cpu.yaml", "--http", "0.0.0.0:8000"]) == 2
    assert "http.api_key" in capsys.readouterr().err
    assert main(["--config", "cpu.yaml", "--http", "127.0.0.1:x"]) == 2
    assert main(["--config", "cpu.yaml", "--http", "127.0.0.1:8000", "--prompt", "hi"]) == 2
    assert "--http" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the field table
#: A value of each field in docs/http.md's "OpenAI request fields" table: for implemented and ignored fields one the
#: server takes, for refused ones one it must refuse.
_FIELD_SAMPLES = {
    "model": None, "messages": None, "prompt": None, "max_tokens": 8, "max_completion_tokens": 8,
    "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["\n"], "stream": True,
    "stream_options": {"include_usage": True}, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "logit_bias": {"5": 1.0}, "n": 2, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto", "parallel_tool_calls": False, "response_format": {"type": "json_object"},
    "functions": [{"name": "f"}], "function_call": "auto", "echo": True, "suffix": "x", "audio": {"voice": "x"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "verbosity": "low", "web_search_options": {}, "user": "u", "safety_identifier": "s", "metadata": {"k": "v"},
    "store": False, "service_tier": "auto", "prompt_cache_key": "k", "repetition_penalty": 1.1, "min_tokens": 2,
    "top_k": 5, "structured_outputs": {"regex": "[a-z]+"}, "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+", "guided_grammar": 'root ::= "a"', "guided_choice": ["a", "b"],
    "speculative": {"num_draft_tokens": 2},
}
#: Fields that take their value together with another (a sample alone would be refused for that reason).
_FIELD_COMPANIONS = {"top_logprobs": {"logprobs": True}, "best_of": {"n": 2}}


def _table_rows() -> list[tuple[str, str, str]]:
    """(field, endpoint, status) per field named in docs/http.md's "OpenAI request fields" table."""
    text = (REPO_ROOT / "docs" / "http.md").read_text()
    section = text.split("## OpenAI request fields", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        for name in cells[0].replace("`", "").split(","):
            rows.append((name.strip(), cells[1], cells[2]))
    return rows


def _refusal(endpoint: str, fields: dict) -> str | None:
    return http_refusal(endpoint, **fields)


def test_the_field_table_names_every_openai_field_with_what_the_server_does():
    rows = _table_rows()
    named = {name for name, _, _ in rows}
    openai_chat = {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
                   "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
                   "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
                   "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
                   "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
                   "verbosity", "web_search_options"}
    openai_completions = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                          "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
                          "temperature", "top_p", "user"}
    assert openai_chat | openai_completions <= named, sorted((openai_chat | openai_completions) - named)
    checked = 0
    for name, endpoint, status in rows:
        endpoints = {"both": ["chat", "completions"], "chat, completions": ["chat", "completions"]}.get(
            endpoint, [endpoint])
        if name in ("model", "messages", "prompt"):
            continue  # every request has them (model: the app's own 404 check, tests/test_http.py)
        for ep in endpoints:
            if name == "logprobs":
                sample = True if ep == "chat" else 2
            elif name == "top_logprobs":
                sample = 2
            elif name == "best_of":
                sample = 3
            else:
                sample = _FIELD_SAMPLES[name]
            fields = {name: sample, **_FIELD_COMPANIONS.get(name, {})}
            if name == "stream_options":
                fields["stream"] = True
            got = _refusal(ep, fields)
            if status.startswith("refused"):
                assert got is not None and got.split(".")[0] == name, (name, ep, got)
            else:
                assert got is None, (name, ep, status, got)
            checked += 1
    assert checked > 40
    # what the table says of the odd ones: include_obfuscation and echo true refused, chat best_of refused
    assert _refusal("completions", {"stream": True, "stream_options": {"include_obfuscation": True}})
    assert _refusal("completions", {"echo": False}) is None
    assert _refusal("completions", {"best_of": 3, "n": 2, "stream": True}) == "best_of"
