"""What one HTTP client may cost the others (issue 32), in one process without model nodes: the real HTTP server
(uvicorn, in this event loop) on a real :class:`AsyncClient`, whose verifier is a scripted ZeroMQ ROUTER here; the
callers are raw sockets, the standard library's HTTP client and ``openai``. A stream whose client never reads is
cancelled after ``http.send_timeout_s``; a foreign Host header is refused without an API key; a chunked over-size
body is a 413;
``/health`` shows the load only to authorized callers; a chat message's ``name`` reaches the verifier;
``response_format.json_schema.strict: false`` reaches it; an :class:`AsyncClient` request holds a bounded inbox."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket

import openai
import pytest
import zmq
import zmq.asyncio

from benchmarks.http_overhead import free_port
from http_server.serve import HttpServer
from runtime.client import MAX_PENDING_REPLIES, AsyncClient, Chunk, GenerationResult
from runtime.config import load_config, typed
from shared.protocol import Cancel, Done, Generate, Ping, Pong, decode, encode
from shared.protocol import Chunk as ChunkMessage

pytestmark = pytest.mark.unit

KEY = "k" * 24
FLOOD_TEXT = "x" * 1000  # one chunk's text: a stream that fills socket buffers fast
MAX_FLOOD = 20_000  # chunks a flood sends at most (20 MB of events: beyond any socket buffer) before its done


class FakeVerifier:
    """A ROUTER that answers pings, serves ``prompt="quick"`` with one chunk and a done, and floods chunks for any
    other prompt until the request is cancelled. Records the generates and the cancels it got."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.generates: list[Generate] = []
        self.cancelled: set[int] = set()
        self.floods: set[int] = set()  # running
        self.cancel_seen = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._serve = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            peer, *body = await self.sock.recv_multipart()
            msg = decode(body)
            if isinstance(msg, Ping):
                await self.sock.send_multipart([peer, *encode(Pong(drafter_connected=True, sessions=len(self.floods),
                                                                   target="fake"))])
            elif isinstance(msg, Generate):
                self.generates.append(msg)
                if msg.prompt == "quick" or msg.messages is not None:
                    await self.sock.send_multipart([peer, *encode(ChunkMessage(request_id=msg.request_id,
                                                                                token_ids=[3], text="ok"))])
                    await self.sock.send_multipart([peer, *encode(Done(request_id=msg.request_id, token_ids=[3],
                                                                       text="ok", metrics={"prompt_tokens": 1,
                                                                                           "new_tokens": 1},
                                                                       finish_reason="length"))])
                else:
                    task = asyncio.create_task(self._flood(peer, msg.request_id))
                    self._tasks.add(task)
            elif isinstance(msg, Cancel):
                self.cancelled.add(msg.request_id)
                self.cancel_seen.set()

    async def _flood(self, peer: bytes, rid: int) -> None:
        self.floods.add(rid)
        try:
            for i in range(MAX_FLOOD):
                if rid in self.cancelled:
                    return
                await self.sock.send_multipart([peer, *encode(ChunkMessage(request_id=rid, token_ids=[i % 100],
                                                                            text=FLOOD_TEXT))])
                await asyncio.sleep(0.001 if i % 50 == 0 else 0)
            await self.sock.send_multipart([peer, *encode(Done(request_id=rid, token_ids=[], text="",
                                                               metrics={}, finish_reason="length"))])
        finally:
            self.floods.discard(rid)

    async def close(self) -> None:
        for task in (self._serve, *self._tasks):
            task.cancel()
        await asyncio.gather(self._serve, *self._tasks, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()


@contextlib.asynccontextmanager
async def serving(tmp_path, **http):
    """The fake verifier, an AsyncClient on it, and the HTTP server (``http`` overrides) on that client."""
    endpoint = f"ipc://{tmp_path}/fake.ipc"
    fake = FakeVerifier(endpoint)
    overrides = {"http.host": "127.0.0.1", "http.port": free_port(), **{f"http.{k}": v for k, v in http.items()}}
    config = typed(load_config("cpu.yaml", overrides))
    try:
        async with AsyncClient(endpoint, timeout_s=30) as client, HttpServer(client, config.http, "fake") as server:
            yield fake, server
    finally:
        await fake.close()


async def _call(port: int, method: str, path: str, headers: dict | None = None,
                body: dict | None = None) -> tuple[int, dict]:
    """One exchange with the standard library's HTTP client (in a thread: the server runs in this loop)."""
    def call() -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()
    return await asyncio.to_thread(call)


def _request(port: int, body: dict, host: str = "127.0.0.1") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def test_a_stream_whose_client_never_reads_is_cancelled_and_others_are_served(tmp_path):
    async def main():
        async with serving(tmp_path, send_timeout_s=0.5) as (fake, server):
            stalled = []
            for _ in range(3):  # clients that send a streamed request and never read a byte of the answer
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's smallest: fills at once
                sock.connect(("127.0.0.1", server.port))
                sock.sendall(_request(server.port, {"prompt": "flood", "max_tokens": 4096, "stream": True}))
                stalled.append(sock)
            try:
                # another client is served meanwhile, streamed and not
                async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                              timeout=30) as oai:
                    plain = await oai.completions.create(model="fake", prompt="quick", max_tokens=1)
                    streamed = [c async for c in await oai.completions.create(model="fake", prompt="quick",
                                                                              max_tokens=1, stream=True)]
                # each stalled stream is cancelled on the verifier (bounded wait: the floods end by themselves
                # after MAX_FLOOD chunks, without a cancel, when nothing stops them)
                floods = [g.request_id for g in fake.generates if g.prompt == "flood"]
                for _ in range(600):
                    if set(floods) <= fake.cancelled and not fake.floods:
                        break
                    await asyncio.sleep(0.1)
                after = await oai_plain(server)
            finally:
                received = []
                for sock in stalled:
                    sock.setblocking(False)
                    data = b""
                    with contextlib.suppress(OSError):
                        while chunk := sock.recv(1 << 20):
                            data += chunk
                    received.append(data)
                    sock.close()
            return plain, streamed, floods, set(fake.cancelled), fake.floods, after, received

    plain, streamed, floods, cancelled, running, after, received = asyncio.run(main())
    assert plain.choices[0].text == "ok" and "".join(c.choices[0].text for c in streamed) == "ok"
    assert len(floods) == 3 and set(floods) <= cancelled and not running
    assert after == "ok"
    # the stalled connections were cut, not finished: no [DONE] ever reached them
    assert all(b"[DONE]" not in data for data in received)


async def oai_plain(server) -> str:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30) as oai:
        return (await oai.completions.create(model="fake", prompt="quick", max_tokens=1)).choices[0].text


def test_an_async_client_request_nobody_reads_holds_a_bounded_inbox(tmp_path):
    """The client's reader task never waits for a consumer: replies beyond MAX_PENDING_REPLIES merge into the last
    chunk held, and a consumer that comes back still gets every token, in order."""
    async def main():
        fake = FakeVerifier(f"ipc://{tmp_path}/fake.ipc")
        try:
            async with AsyncClient(f"ipc://{tmp_path}/fake.ipc", timeout_s=30) as client:
                stream = client.stream(prompt="flood", include_result=True)
                first = await stream.__anext__()
                for _ in range(600):  # until the flood has sent many more chunks than the bound
                    if not fake.floods and fake.generates:
                        break
                    await asyncio.sleep(0.1)
                held = max(q.qsize() for q in client._queues.values())
                rest = [item async for item in stream]
        finally:
            await fake.close()
        return first, held, rest

    first, held, rest = asyncio.run(main())
    chunks = [first, *rest[:-1]]
    assert all(isinstance(c, Chunk) for c in chunks) and isinstance(rest[-1], GenerationResult)
    assert held <= MAX_PENDING_REPLIES + 2
    assert sum(len(c.token_ids) for c in chunks) == MAX_FLOOD
    assert "".join(c.text for c in chunks) == FLOOD_TEXT * MAX_FLOOD


REFUSED_HOSTS = ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example:80"]
ALLOWED_HOSTS = ["localhost", "localhost:{port}", "127.0.0.1:{port}", "[::1]:80", "127.0.0.2", "my.box.lan:1234"]


def test_a_foreign_host_header_is_refused_without_an_api_key(tmp_path):
    async def main():
        got = {}
        async with serving(tmp_path, allowed_hosts=["My.Box.Lan"]) as (fake, server):
            for host in REFUSED_HOSTS + ALLOWED_HOSTS:
                got[host] = await _call(server.port, "GET", "/v1/models", {"Host": host.format(port=server.port)})
            got["POST evil.example"] = await _call(server.port, "POST", "/v1/completions", {"Host": "evil.example"},
                                                   {"prompt": "quick", "max_tokens": 1})
            generated = len(fake.generates)
        async with serving(tmp_path, api_key=KEY) as (_, server):  # with a key: no Host check
            got["with key"] = await _call(server.port, "GET", "/v1/models",
                                          {"Host": "any.example", "Authorization": f"Bearer {KEY}"})
        return got, generated

    got, generated = asyncio.run(main())
    for host in [*REFUSED_HOSTS, "POST evil.example"]:
        status, body = got[host]
        assert status == 400 and body["error"]["code"] == "host_not_allowed", (host, body)
    for host in [*ALLOWED_HOSTS, "with key"]:
        status, body = got[host]
        assert status == 200 and body["data"][0]["id"] == "fake", (host, body)
    assert generated == 0  # the refused request did no work


def test_a_chunked_body_over_the_limit_is_a_413_and_a_small_one_is_served(tmp_path):
    def chunked(port: int, body: bytes) -> tuple[int, dict]:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
                         "\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode())
            for i in range(0, len(body), 4096):
                part = body[i:i + 4096]
                with contextlib.suppress(OSError):  # the server may answer and close before the rest
                    sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            with contextlib.suppress(OSError):
                sock.sendall(b"0\r\n\r\n")
            data = b""
            with contextlib.suppress(OSError):
                while chunk := sock.recv(65536):
                    data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(rest)

    async def main():
        async with serving(tmp_path, max_body_bytes=8192) as (_, server):
            big = json.dumps({"prompt": "quick" + " " * 20_000, "max_tokens": 1}).encode()
            small = json.dumps({"prompt": "quick", "max_tokens": 1}).encode()
            return (await asyncio.to_thread(chunked, server.port, big),
                    await asyncio.to_thread(chunked, server.port, small))

    (big_status, big_body), (small_status, small_body) = asyncio.run(main())
    assert big_status == 413 and big_body["error"]["code"] == "request_too_large", big_body
    assert small_status == 200 and small_body["choices"][0]["text"] == "ok", small_body


def test_health_shows_the_load_only_to_authorized_callers(tmp_path):
    async def main():
        out = {}
        async with serving(tmp_path, api_key=KEY) as (_, server):
            out["anonymous"] = await _call(server.port, "GET", "/health")
            out["wrong"] = await _call(server.port, "GET", "/health", {"Authorization": "Bearer nope"})
            out["key"] = await _call(server.port, "GET", "/health", {"Authorization": f"Bearer {KEY}"})
        async with serving(tmp_path) as (_, server):
            out["loopback"] = await _call(server.port, "GET", "/health")  # no key: loopback only, details kept
        return out

    out = asyncio.run(main())
    assert out["anonymous"] == out["wrong"] == (200, {"status": "ok", "verifier": True})
    assert out["key"] == out["loopback"] == (200, {"status": "ok", "verifier": True, "drafters": 0, "sessions": 0})


def test_a_chat_message_name_and_a_non_strict_schema_reach_the_verifier(tmp_path):
    async def main():
        async with serving(tmp_path) as (fake, server):
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                          timeout=30) as oai:
                r = await oai.chat.completions.create(model="fake", max_tokens=1, messages=[
                    {"role": "user", "name": "alice", "content": "hi"}, {"role": "user", "content": "yo"}])
                await oai.chat.completions.create(
                    model="fake", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "n", "strict": False, "schema": {"type": "object"}}})
            return r, list(fake.generates)

    r, generates = asyncio.run(main())
    assert r.choices[0].message.content == "ok"
    assert generates[0].messages == [{"role": "user", "content": "hi", "name": "alice"},
                                     {"role": "user", "content": "yo"}]
    assert generates[1].params["grammar"] == {"kind": "json_schema", "value": '{"type": "object"}', "strict": False}
