"""The OpenAI-compatible HTTP server end to end, with real clients: one launcher subprocess started the way a user
starts it (``python -m runtime.launch --config X --http 127.0.0.1:PORT``) serves the whole module; the ``openai``
package, ``curl -N`` and the standard library's HTTP client talk to it, and an :class:`AsyncClient` on the same
cluster gives the expected output of each request."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import socket
import subprocess
import time
import types
import urllib.request

import openai
import pytest
import yaml
from conftest import tiny_config
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.http_overhead import free_port, start_launcher  # the benchmark starts its launcher the same way
from runtime.client import AsyncClient, Chunk
from runtime.config import load_config
from runtime.launch import serve_http, stop_process

pytestmark = pytest.mark.cluster

START_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    target = tiny("llama")
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    config["http"] = {"max_body_bytes": 65536, "request_metrics": True}  # the tests read per-request metrics
    path = tmp_path_factory.mktemp("http") / "http.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc, address, ready = start_launcher(path, port, timeout_s=START_TIMEOUT_S)  # as a user starts it
    try:
        assert ready == f"[pipespec] serving OpenAI-compatible HTTP on http://127.0.0.1:{port} (model {target})"
        yield types.SimpleNamespace(port=port, base_url=f"http://127.0.0.1:{port}/v1", address=address,
                                    model=str(target), config_path=path, proc=proc)
    finally:
        stop_process(proc)


def _http(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
          port: int | None = None) -> tuple[int, str]:
    """One plain HTTP exchange (the standard library's client): status and body text."""
    conn = http.client.HTTPConnection("127.0.0.1", port or server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def _openai(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60, **kw)


def _expected(server, calls: list[dict]) -> list:
    """``AsyncClient.generate`` on the same cluster, for each call's arguments (concurrently)."""
    async def main():
        async with AsyncClient(server.address, timeout_s=60) as c:
            return await asyncio.gather(*(c.generate(**call) for call in calls))
    return asyncio.run(main())


def _sessions(server) -> int:
    async def main():
        async with AsyncClient(server.address, timeout_s=10) as c:
            return (await c.ping())["sessions"]
    return asyncio.run(main())


PROMPTS = ["def add(a, b):", "for i in range(10):", "class Node:", "import os\n"]


def test_models_and_health(server):
    assert [m.id for m in _openai(server).models.list().data] == [server.model]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["drafters"] == 1


def test_completions_greedy_equal_async_client_streamed_or_not(server):
    client = _openai(server)
    expected = _expected(server, [{"prompt": p, "max_new_tokens": 12} for p in PROMPTS])
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
        assert r.usage.prompt_tokens == want.metrics["prompt_tokens"]
        assert r.usage.completion_tokens == len(want.token_ids)
        spec = r.model_extra["metrics"]["speculative_decoding"]
        assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0 and spec["num_drafts"] > 0
        assert set(spec) >= {"acceptance_rate", "mean_accepted_length", "per_position_acceptance"}
        chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # token ids as the prompt, as OpenAI allows
    ids = [5, 17, 33, 2, 60]
    (want,) = _expected(server, [{"token_ids": ids, "max_new_tokens": 7}])
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=7, temperature=0)
    assert r.choices[0].text == want.text


def test_chat_greedy_equal_async_client_with_usage_chunk(server):
    client = _openai(server)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "print hello"}]
    (want,) = _expected(server, [{"messages": messages, "max_new_tokens": 10}])
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == want.metrics["prompt_tokens"]
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    # content as a list of text parts is the same conversation
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    r = client.chat.completions.create(model=server.model, messages=parts, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want.text


def test_curl_reads_the_sse_stream(server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    (want,) = _expected(server, [{"prompt": PROMPTS[0], "max_new_tokens": 9}])
    body = json.dumps({"model": server.model, "prompt": PROMPTS[0], "max_tokens": 9, "temperature": 0,
                       "stream": True})
    out = subprocess.run(["curl", "-sN", "--max-time", "60", f"{server.base_url}/completions", "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    events = [line[len("data: "):] for line in out.stdout.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and out.stdout.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("kind,kwargs,param", [
    ("completions", {"n": 17}, "n"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"n": 3, "best_of": 2}, "best_of"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ("completions", {"prompt": ["one", "two"]}, "prompt"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # a tool turn needs its tool_call_id
    ("chat", {"temperature": -1}, "temperature"),
])
def test_unsupported_or_invalid_fields_are_openai_400s(server, kind, kwargs, param):
    client = _openai(server)
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            client.chat.completions.create(**{"model": server.model, "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hi"}], **kwargs})
        else:
            client.completions.create(**{"model": server.model, "prompt": "hi", "max_tokens": 4, **kwargs})
    err = info.value
    assert err.status_code == 400
    assert set(err.body) == {"message", "type", "param", "code"} and err.body["type"] == "invalid_request_error"
    assert err.body["param"] is not None and err.body["param"].startswith(param), err.body


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"model": "M", "prompt": "ab\\ud800c", "max_tokens": 3}'),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 3}'),
])
def test_a_lone_surrogate_in_the_text_is_a_400_not_a_500(server, path, body):
    """JSON may escape a lone surrogate; no UTF-8 encodes it, so the request is refused as bad, not failed."""
    status, text = _http(server, "POST", path, body.replace("M", server.model).encode(),
                         {"Content-Type": "application/json"})
    error = json.loads(text)["error"]
    assert status == 400 and error["code"] == "bad_request" and "lone surrogate" in error["message"], text
    status, _ = _http(server, "POST", path, body.replace("M", server.model).replace("\\u", "u").encode(),
                      {"Content-Type": "application/json"})
    assert status == 200  # the same request with plain text is served


def test_verifier_errors_map_to_http_statuses(server):
    client = _openai(server)
    with pytest.raises(openai.BadRequestError) as info:  # prompt + max_tokens beyond the tiny target's 512
        client.completions.create(model=server.model, prompt="hi", max_tokens=5000, temperature=0)
    assert info.value.body["code"] == "bad_request" and "context" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # sampling below the verifier's minimum temperature
        client.completions.create(model=server.model, prompt="hi", max_tokens=3, temperature=0.001, stream=True)
    assert info.value.body["code"] == "bad_request"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=3)
    assert info.value.body["code"] == "model_not_found"
    # a body announced over http.max_body_bytes (64 KiB here) is refused before it is read
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(100_000))
        conn.endheaders()
        r = conn.getresponse()
        status, huge = r.status, json.loads(r.read())
    finally:
        conn.close()
    assert status == 413 and huge["error"]["code"] == "request_too_large"
    status, text = _http(server, "POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"


def test_stop_string_across_a_chunk_boundary_is_cut_and_cancels(server):
    async def chunks():
        async with AsyncClient(server.address, timeout_s=60) as c:
            return [(item.text, len(item.token_ids)) async for item in c.stream(PROMPTS[2], max_new_tokens=40)
                    if isinstance(item, Chunk)]

    rounds = asyncio.run(chunks())
    texts = [text for text, _ in rounds]
    full = "".join(texts)
    # a stop string made of the end of one chunk and the start of the next, at its first occurrence in the text
    stop = cut = None
    for i in range(1, len(texts) - 1):
        if not (texts[i] and texts[i + 1]):
            continue
        boundary = len("".join(texts[: i + 1]))
        start = boundary - min(2, len(texts[i]))
        candidate = full[start: boundary + min(2, len(texts[i + 1]))]
        if start > 0 and full.find(candidate) == start:
            stop, cut = candidate, full[:start]
            needed = sum(n for _, n in rounds[: i + 2])  # the tokens whose text holds the whole stop string
            break
    assert stop is not None, f"no stop string across a chunk boundary in {texts}"
    client = _openai(server)
    for stream in (False, True):
        kwargs = {"model": server.model, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0,
                  "stop": ["never-in-the-output", stop]}
        if stream:
            got = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in got if c.choices)
            finish = next(c.choices[0].finish_reason for c in got if c.choices and c.choices[0].finish_reason)
            usage = got[-1].usage
        else:
            r = client.completions.create(**kwargs)
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert text == cut and finish == "stop"
        # counted up to the round that completed the stop (a round commits at most num_draft_tokens + 1 = 4
        # tokens), not what the verifier made before the cancel reached it
        assert usage.completion_tokens <= needed + 3, (usage.completion_tokens, needed)
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=30, temperature=0, stop=stop)  # a single string, chat
    assert stop not in r.choices[0].message.content


def test_client_disconnecting_mid_stream_cancels_the_request(server):
    body = {"model": server.model, "prompt": PROMPTS[2], "max_tokens": 480, "temperature": 0, "stream": True}
    # read a few events, then drop the connection
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        events = 0
        while events < 3:
            events += r.readline().startswith(b"data: ")
        assert _sessions(server) >= 1  # still running on the verifier
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
        conn.close()
    started = time.monotonic()
    while _sessions(server) and time.monotonic() - started < 5:
        time.sleep(0.1)
    assert _sessions(server) == 0, "the verifier still runs the request of a client that left"
    assert time.monotonic() - started < 5  # 480 tokens would take far longer


def test_32_concurrent_streams_each_get_their_own_output(server):
    prompts = [f"def f{i}(x):" if i % 2 else f"x{i} = [" for i in range(32)]
    lengths = [6 + i % 5 for i in range(32)]
    expected = _expected(server, [{"prompt": p, "max_new_tokens": n} for p, n in zip(prompts, lengths)])

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> str:
        stream = await client.completions.create(model=server.model, prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    got = asyncio.run(main())
    assert got == [w.text for w in expected]
    assert len(set(got)) > 1


def _scrape(server, headers: dict | None = None) -> dict[str, float]:
    status, text = _http(server, "GET", "/metrics", headers=headers)
    assert status == 200
    return {(s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")):
            s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_counters_move_as_requests_run(server):
    before = _scrape(server)
    client = _openai(server)
    responses = [client.completions.create(model=server.model, prompt=p, max_tokens=10, temperature=0)
                 for p in PROMPTS[:2]]
    after = _scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    spec = [r.model_extra["metrics"]["speculative_decoding"] for r in responses]
    assert delta("pipespec_spec_decode_num_drafts_total") == sum(s["num_drafts"] for s in spec) > 0
    assert delta("pipespec_spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in spec)
    assert delta("pipespec_spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_tokens"] for s in spec)
    per_pos = sum(v for k, v in after.items() if k.startswith("pipespec_spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == after["pipespec_spec_decode_num_accepted_tokens_total"]
    assert "pipespec_spec_decode_num_accepted_tokens_per_pos_total{position=0}" in after
    reasons = {r.choices[0].finish_reason for r in responses}
    assert sum(delta(f"pipespec_requests_total{{finish_reason={x}}}") for x in reasons) == 2
    assert delta("pipespec_generated_tokens_total") == sum(r.usage.completion_tokens for r in responses)
    assert delta("pipespec_request_latency_seconds_count") == 2
    assert delta("pipespec_time_to_first_token_seconds_count") == 2
    assert after["pipespec_running_sessions"] == 0
    assert after["pipespec_drafters_connected{type=assistant}"] == 1
    assert after["pipespec_verifier_up"] == 1
    assert not any(":" in name.split("{")[0] for name in after)


def test_api_key_through_the_launchers_serve_http(server):
    """The launcher's own serve_http with an api_key (here in-process, on the module's cluster)."""
    key = "k" * 24
    port = free_port()
    config = load_config(str(server.config_path), {"http.host": "127.0.0.1", "http.port": port,
                                                   "http.api_key": key, "http.request_metrics": False})

    async def main():
        async with AsyncClient(server.address, timeout_s=60) as c, serve_http(c, config) as http:
            base = f"{http.url}/v1"
            async with openai.AsyncOpenAI(base_url=base, api_key="wrong-key", max_retries=0) as bad:
                with pytest.raises(openai.AuthenticationError) as info:
                    await bad.completions.create(model=server.model, prompt="hi", max_tokens=2)
                assert info.value.body["code"] == "invalid_api_key"
            async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as good:
                r = await good.completions.create(model=server.model, prompt="hi", max_tokens=2, temperature=0)
                chunks = [c async for c in await good.completions.create(
                    model=server.model, prompt="hi", max_tokens=2, temperature=0, stream=True)]
            # http.request_metrics off (the default): no per-request speculative metrics, streamed or not
            assert "metrics" not in r.model_extra and not any("metrics" in c.model_extra for c in chunks)
            codes = []
            for path, headers in (("/health", {}), ("/metrics", {}), ("/metrics", {"Authorization": f"Bearer {key}"})):
                status, _ = await asyncio.to_thread(_http, server, "GET", path, None, headers, port)
                codes.append(status)
            return r, *codes

    r, health, scrape, scrape_ok = asyncio.run(main())
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1
    assert (health, scrape, scrape_ok) == (200, 401, 200)
