"""Async client library: ``async with AsyncClient(address) as c: r = await c.generate(prompt=...)``.

One DEALER socket per client; a reader task routes replies to their request by ``request_id``, so any number of
concurrent ``generate``/``stream`` calls share it. Every wait is bounded by ``timeout_s`` (no reply from the
verifier for that long raises :class:`TimeoutError`).

Liveness: while requests are in flight the client pings the verifier every ``heartbeat_s`` (the verifier cancels
the sessions of a client it has not heard from for ``client.heartbeat_timeout_s``). Whether the verifier is there
is the connection's business, not the pings': the socket sends ZMTP heartbeats, which the verifier's ZeroMQ I/O
thread answers even in the middle of a long forward, and a socket monitor watches the connection. When it drops (the
verifier's process died: at once; its host went silent: after ``gone_after_s``), every in-flight request fails with
``PipespecError(code="verifier_gone")``; a verifier that is only slow (a long prefill) is waited for, up to
``timeout_s``. The same client works again once a verifier listens at the address (ZeroMQ reconnects; the client
asks the new one for its limits before its next request). Before its first request the client learns the
verifier's message cap (from a ``pong``) and raises ``too_large`` locally rather than send a message the verifier
would refuse. ``close()`` cancels the requests in flight and fails their waiters with ``closed``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from runtime.logprobs import TokenLogprob, from_wire
from shared.chat_tools import ChatError, ToolPlan, plan_tools
from shared.choices import MAX_N, choice_seed
from shared.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_HEADER_BYTES,
    Cancel,
    Done,
    Error,
    Generate,
    Message,
    Ping,
    Pong,
    ProtocolError,
    decode,
    encode,
)
from shared.protocol import Chunk as ChunkMessage
from shared.sampling import GrammarSpec, ParamError, structured_output
from shared.tool_calls import ParsedDelta, ToolCall, ToolCallParser
from shared.transport import ClientKeys, is_local_endpoint, make_dealer
from verifier_node.schema_check import check_schema

#: How long a stream whose ``cancel`` event was set waits for the verifier's final result.
CANCEL_WAIT_S = 10.0


def live_drafters(pong: dict[str, Any]) -> list[dict[str, Any]]:
    """The drafters a verifier's pong (:meth:`AsyncClient.ping`) counts as alive, each ``{id, type, host, ...}``."""
    return [d for d in pong.get("drafters") or [] if d.get("alive")]


class PipespecError(RuntimeError):
    """The verifier refused or failed a request; ``code`` says why (``bad_request``, ``busy``, …)."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


@dataclass
class Chunk:
    """Tokens committed in one verification round, and the text they complete."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token with ``logprobs=N`` (runtime.logprobs)
    #: with ``tools``: the text read by the tool-call parser (content and call deltas; possibly empty while it holds
    #: back a call). A last chunk without tokens carries what it held at the end, when it held anything.
    delta: ParsedDelta | None = None


@dataclass
class GenerationResult:
    text: str  # the whole output, tool calls included
    token_ids: list[int]  # new tokens only
    metrics: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = ""  # stop, length, cancelled; tool_calls when tools were given and the output called
    logprobs: list[TokenLogprob] | None = None  # one per new token with ``logprobs=N`` (runtime.logprobs)
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls, in order
    content: str | None = None  # with tools: the text besides the calls (None: no tools, or not parsed)


_PARAM_NAMES = (
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "min_new_tokens",
    "eos_token_ids", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "num_draft_tokens",
)
#: Structured output (one at most): turned into the ``grammar`` parameter by shared.sampling.structured_output.
_CONSTRAINT_NAMES = ("response_format", "json_schema", "regex", "grammar", "choice")


def wire_params(params: dict[str, Any]) -> dict[str, Any]:
    """A request's keyword parameters in their wire form: an unknown name is a ``TypeError``; the structured-output
    arguments become the ``grammar`` parameter and ``logit_bias``'s integer keys text (the wire's maps take text keys,
    JSON's form: 42 -> "42"); a bad one is ``bad_request``, not sent."""
    unknown = sorted(set(params) - set(_PARAM_NAMES) - set(_CONSTRAINT_NAMES))
    if unknown:
        raise TypeError(f"unknown generation parameter(s): {', '.join(unknown)}")
    if not isinstance(params.get("grammar"), dict):  # a dict: already the wire form (the HTTP server's)
        constraints = {k: params.pop(k) for k in _CONSTRAINT_NAMES if k in params}
        try:
            spec = structured_output(**constraints)
        except ParamError as exc:
            raise PipespecError(str(exc), "bad_request") from None
        if spec is not None:
            params["grammar"] = spec.to_wire()
    if isinstance(params.get("logit_bias"), dict):
        bias = {str(k) if type(k) is int else k: v for k, v in params["logit_bias"].items()}
        if not all(isinstance(k, str) for k in bias):
            raise PipespecError("logit_bias keys must be token ids (integers)", "bad_request")
        params["logit_bias"] = bias
    return params


def request_frames(msg: Generate, max_message_bytes: int | None) -> list:
    """``msg`` encoded, or ``bad_request`` / ``too_large`` said here, before sending (the verifier could not tell
    which request an over-size message belonged to); ``max_message_bytes``: the verifier's cap (None: the default)."""
    try:
        frames = encode(msg)
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON "\ud800"): no UTF-8 for it, so no message
        raise PipespecError(f"the request's text is not valid Unicode: {exc.object[exc.start]!r} at character "
                            f"{exc.start} of a string (a lone surrogate); send UTF-8 text", "bad_request") from None
    size = sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
    limit = max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
    if size > limit or len(frames[0]) > MAX_HEADER_BYTES:
        raise PipespecError(
            f"request {msg.request_id} of {size} bytes exceeds the verifier's limit ({limit} bytes per message, "
            f"{MAX_HEADER_BYTES} per header): send a shorter prompt", "too_large")
    return frames


class _LocalFailure:
    """Put in a request's queue by the client itself (verifier gone, client closed): the waiter raises it."""

    def __init__(self, message: str, code: str):
        self.message = message
        self.code = code


#: Replies one request may hold unread: beyond it, chunks merge into the last one held (so a consumer that stops
#: reading costs at most its request's own text and tokens, which the final result carries anyway).
MAX_PENDING_REPLIES = 64


class _Merged:
    """Chunks merged in an inbox past its bound: parts kept in lists, joined once when read (merging stays linear)."""

    def __init__(self, first: ChunkMessage):
        self.request_id = first.request_id
        self.token_ids = list(first.token_ids)
        self.texts = [first.text]
        self.logprobs = None if first.logprobs is None else list(first.logprobs)  # a request has them in every chunk

    def add(self, chunk: ChunkMessage) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.texts.append(chunk.text)
        if self.logprobs is not None and chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)

    def chunk(self) -> ChunkMessage:
        return ChunkMessage(request_id=self.request_id, token_ids=self.token_ids, text="".join(self.texts),
                            logprobs=self.logprobs)


class _Inbox:
    """One request's replies, in order, at most ``limit`` of them: a chunk that would go beyond it is merged into
    the last chunk held; the final reply (done, error, local failure) always gets a place of its own."""

    def __init__(self, limit: int = MAX_PENDING_REPLIES):
        self.limit = limit
        self._items: collections.deque[Message | _LocalFailure | _Merged] = collections.deque()
        self._ready = asyncio.Event()

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Message | _LocalFailure) -> None:
        items = self._items
        if len(items) >= self.limit:
            last = items[-1] if items else None
            if isinstance(item, ChunkMessage) and isinstance(last, (ChunkMessage, _Merged)):
                if isinstance(last, ChunkMessage):
                    last = items[-1] = _Merged(last)
                last.add(item)
                return
            if len(items) >= self.limit + 2:  # room for the final reply and a local failure; anything else is late
                return
        items.append(item)
        self._ready.set()

    async def get(self) -> Message | _LocalFailure:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        return item.chunk() if isinstance(item, _Merged) else item


class AsyncClient:
    """A client of one verifier. ``timeout_s`` bounds each wait for a reply; ``heartbeat_s`` is the ping period
    while requests are in flight (and the ZMTP heartbeat interval); ``gone_after_s`` is how long the connection may
    be missing (no verifier to connect to at the first request) or unanswered at the ZeroMQ level before requests
    fail with ``verifier_gone``. A long verification round does not count: ZeroMQ answers heartbeats meanwhile.
    ``curve``: the keys to connect with when the verifier's client socket runs CURVE
    (``runtime.keys.client_keys(KEYS_DIR, NAME)``); without an allowed key such a verifier never answers.
    ``context``: a ZeroMQ context to share (an ``inproc://`` verifier is reached only from its own context; the
    client then leaves it open), None: a context of the client's own."""

    def __init__(self, address: str, timeout_s: float = 600.0, curve: ClientKeys | None = None,
                 heartbeat_s: float = 0.5, gone_after_s: float = 1.5, context: zmq.Context | None = None):
        if not 0 < heartbeat_s < gone_after_s:
            raise ValueError(f"need 0 < heartbeat_s < gone_after_s, got {heartbeat_s} and {gone_after_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.curve = curve
        self.heartbeat_s = heartbeat_s
        self.gone_after_s = gone_after_s
        self._ids = itertools.count(1)
        self._queues: dict[int, _Inbox] = {}
        self._pong_waiters: list[asyncio.Future] = []
        self._drop_waiters: list[asyncio.Future] = []  # pings that fail when the connection drops (first request)
        self._reader: asyncio.Task | None = None
        self._heartbeat: asyncio.Task | None = None
        self._monitor_task: asyncio.Task | None = None
        self._connected: asyncio.Event | None = None  # set while a handshaken connection to the verifier is up
        self._auth_refused = False  # the verifier's CURVE authenticator refused our key
        #: The verifier's cap on one message, from its pong (None: not asked yet, or the verifier changed).
        self.max_message_bytes: int | None = None
        self._tool_parser: str | None = None  # the target's tool-call format, from the same pong
        self._ctx: zmq.asyncio.Context | None = None
        self._shared_ctx = context
        self._sock = None

    async def __aenter__(self) -> AsyncClient:
        self._ctx = (zmq.asyncio.Context() if self._shared_ctx is None
                     else zmq.asyncio.Context.shadow(self._shared_ctx.underlying))
        self._sock = make_dealer(self._ctx, self.curve,
                                 heartbeat_ms=(int(1000 * self.heartbeat_s), int(1000 * self.gone_after_s)))
        self._connected = asyncio.Event()
        # The monitor goes on before connect(), so the first connection's events are not missed.
        monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._sock.connect(self.address)
        self._connected_without_handshake()
        self._monitor_task = asyncio.create_task(self._watch_connection(monitor))
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel every request in flight on the verifier, fail its waiter with ``closed``, close the socket."""
        cancelled = False
        if self._sock is not None:
            for rid, queue in list(self._queues.items()):
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart(encode(Cancel(request_id=rid)), flags=zmq.NOBLOCK)
                    cancelled = True
                queue.put_nowait(_LocalFailure(f"the client was closed (request {rid})", "closed"))
        for task in (self._heartbeat, self._reader, self._monitor_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._heartbeat = self._reader = self._monitor_task = None
        if self._sock is not None:
            # A short linger lets the cancels leave (bounded: a dead verifier costs at most this on close).
            self._sock.close(linger=500 if cancelled else 0)
            self._sock = None
        if self._ctx is not None:
            if self._shared_ctx is None:  # a shared context is its owner's to end
                self._ctx.term()
            self._ctx = None

    async def retarget(self, address: str, server_key: bytes | None = None) -> None:
        """Connect to the verifier at ``address`` instead (a launcher whose verifier came back on another host,
        under CURVE with ``server_key``, its new public key, where it made a new pair there); requests in flight
        at the old address fail with ``verifier_gone``, as when a verifier dies."""
        if self._sock is None or address == self.address:
            self.address = address
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disconnect(self.address)
        self._connected.clear()
        self._fail_all(f"the launcher moved it to {address}")
        self.address = address
        if server_key is not None and self.curve is not None:
            self._sock.curve_serverkey = server_key  # read at connect: the next connection checks the new key
        self._sock.connect(address)
        self._connected_without_handshake()

    def _connected_without_handshake(self) -> None:
        """An ``inproc://`` link has no handshake (and no connection events): it is up once connected."""
        if self.address.startswith("inproc://"):
            self._connected.set()

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg = decode(frames, DEFAULT_MAX_MESSAGE_BYTES)
            except ProtocolError as exc:
                # a reply this client cannot read (over the header cap, malformed) ends its request with the
                # reason instead of leaving it to wait for its timeout; one naming no request is dropped
                queue = self._queues.get(exc.request_id) if exc.request_id is not None else None
                if queue is not None:
                    queue.put_nowait(_LocalFailure(f"the verifier's reply could not be read: {exc}", exc.code))
                continue
            if isinstance(msg, Pong):
                self.max_message_bytes = msg.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
                self._tool_parser = msg.tool_parser
                waiters, self._pong_waiters = self._pong_waiters, []
                for w in waiters:
                    if not w.done():
                        w.set_result(msg)
                continue
            rid = getattr(msg, "request_id", None)  # chunk, done and error replies name their request
            queue = self._queues.get(rid) if rid is not None else None
            if queue is not None:
                queue.put_nowait(msg)

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        """Follow the connection's events: up after a handshake, down when it drops (then fail what is in flight)."""
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._auth_refused = False
                    self._connected.set()
                elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self._auth_refused = True
                elif event == zmq.EVENT_DISCONNECTED and self._connected.is_set():
                    self._connected.clear()
                    self._fail_all("the connection dropped")
        finally:
            with contextlib.suppress(zmq.ZMQError):
                if self._sock is not None and not self._sock.closed:
                    self._sock.disable_monitor()
            monitor.close(linger=0)

    def _fail_all(self, why: str) -> None:
        """The verifier is gone: every request in flight and every ping waiter fails with ``verifier_gone``."""
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(_LocalFailure(
                f"the verifier at {self.address} is gone: {why} (request {rid}); the client reconnects when a "
                "verifier listens there again", "verifier_gone"))
        self._queues.clear()
        for w in self._drop_waiters:  # a public ping() just waits on: the verifier may come back within its timeout
            if not w.done():
                w.set_exception(PipespecError(f"the verifier at {self.address} is gone: {why}", "verifier_gone"))
        self.max_message_bytes = None  # a verifier that comes back may announce other limits

    async def _watch(self) -> None:
        """While requests are in flight: ping every ``heartbeat_s``, so the verifier knows this client is alive."""
        while self._queues and self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart(encode(Ping()))
            await asyncio.sleep(self.heartbeat_s)
        self._heartbeat = None

    def _track(self, rid: int, queue: _Inbox) -> None:
        self._queues[rid] = queue
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._watch())

    def _hint(self) -> str:
        with contextlib.suppress(ValueError):
            if self._auth_refused:
                return " (its CURVE authenticator refused this client's key: is it in the verifier's clients/ folder?)"
            if self.curve is None and not is_local_endpoint(self.address):
                return " (a verifier on a network address runs CURVE: pass curve=runtime.keys.client_keys(KEYS_DIR))"
        return ""

    async def _await_connection(self) -> None:
        """Until a handshaken connection is up; ``verifier_gone`` if none comes within ``gone_after_s``."""
        try:
            await asyncio.wait_for(self._connected.wait(), self.gone_after_s)
        except asyncio.TimeoutError:
            raise PipespecError(f"no verifier answers at {self.address} (no connection within {self.gone_after_s} s)"
                                f"{self._hint()}", "verifier_gone") from None

    async def ping(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Ask the verifier for its state (``drafter_connected``, ``drafters``, ``target``, ``sessions``,
        ``max_message_bytes``); ``TimeoutError`` when no answer comes within ``timeout_s``."""
        return await self._ping(timeout_s)

    async def _ping(self, timeout_s: float, fail_on_drop: bool = False) -> dict[str, Any]:
        if self._sock is None:
            raise RuntimeError("use the client inside 'async with AsyncClient(address) as client:'")
        waiter = asyncio.get_running_loop().create_future()
        self._pong_waiters.append(waiter)
        if fail_on_drop:
            self._drop_waiters.append(waiter)
        try:
            await self._sock.send_multipart(encode(Ping()))
            msg: Pong = await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer from the verifier at {self.address} within {timeout_s} s{self._hint()}") \
                from None
        finally:
            for waiters in (self._pong_waiters, self._drop_waiters):
                with contextlib.suppress(ValueError):
                    waiters.remove(waiter)
        return msg.to_dict()

    async def target_tool_parser(self) -> str | None:
        """The tool-call format of the target's chat template (a key of ``shared.tool_calls.PARSERS``; None: the
        template has none pipespec knows), as the verifier's pong tells it."""
        if self.max_message_bytes is None:
            await self._learn_limits()
        return self._tool_parser

    async def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        include_result: bool = False,
        drafter_type: str | None = None,
        cancel: asyncio.Event | None = None,
        tenant: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_parser: str | None = None,
        **params: Any,
    ) -> AsyncIterator[Chunk | GenerationResult]:
        """Yield committed tokens as the verifier commits them. Same arguments as :meth:`generate`;
        with ``include_result=True`` the final :class:`GenerationResult` (with metrics) comes last.

        ``cancel``: set it (between two items) to end the request early *and still get its result*: the client
        sends a cancel, drops the chunks that follow, and the result comes with ``finish_reason == "cancelled"`` and
        the metrics of what ran (within :data:`CANCEL_WAIT_S`; a stream closed early instead gets no result)."""
        reader = await _tool_reader(self, tools, tool_choice, parallel_tool_calls, tool_parser, params)
        async for item in self._run(prompt, token_ids, messages, params, drafter_type, cancel, tenant, tools):
            held = reader.read(item) if reader is not None else None
            if held is not None:
                yield held
            if include_result or isinstance(item, Chunk):
                yield item

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        drafter_type: str | None = None,
        tenant: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_parser: str | None = None,
        **params: Any,
    ) -> GenerationResult:
        """Generate from exactly one of ``prompt``, ``token_ids`` or ``messages`` (chat, templated by the target).

        Parameters: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``min_new_tokens``, ``eos_token_ids``, ``stop_token_ids``, ``seed``, and OpenAI's
        ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2], over the generated tokens) and ``logit_bias``
        (token id, an int or its decimal text, → bias in [-100, 100]); ranges and processing order: docs/client.md;
        ``logprobs`` (N in 0..20: each token's log probability under the target's processed scores and its N likeliest
        alternatives, in ``Chunk.logprobs`` / ``GenerationResult.logprobs``; docs/client.md).
        Structured output, one at most (docs/client.md): ``response_format`` (OpenAI's: ``{"type": "json_object"}``
        or ``{"type": "json_schema", "json_schema": {"name", "schema"}}``), ``json_schema`` (a dict or JSON
        text), ``regex``, ``grammar`` (EBNF) or ``choice`` (a list of strings).
        ``num_draft_tokens``: this request's speculation, 0 = the target alone (no drafts), k ≥ 1 = blocks of at most
        k tokens (a drafter's ``max_draft_tokens`` still caps them). ``drafter_type``: only a drafter of this type may
        serve the request (see docs/deployment.md, "Drafter pool").
        ``tenant``: the user the request is for, set by a gateway such as the HTTP server (docs/security.md; a client
        that is not trusted to set it gets ``unauthorized``).
        Tool calling (with ``messages``; docs/client.md): ``tools`` (OpenAI's list, given to the chat template),
        ``tool_choice`` (``auto``, the default; ``none``: not parsed; ``required`` or
        ``{"type": "function", "function": {"name": ...}}``: a grammar makes the model call),
        ``parallel_tool_calls`` (false: the first call only), ``tool_parser`` (the format, default the target
        template's); the result's ``tool_calls`` and ``content`` (the text besides the calls).
        """
        reader = await _tool_reader(self, tools, tool_choice, parallel_tool_calls, tool_parser, params)
        result = None
        async for item in self._run(prompt, token_ids, messages, params, drafter_type, tenant=tenant, tools=tools):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        if reader is not None:
            reader.read(result)
        return result

    async def generate_n(self, prompt: str | None = None, *, n: int, seed: int | None = None,
                         **kwargs: Any) -> list[GenerationResult]:
        """``n`` answers to one prompt, run concurrently (the verifier batches them), in choice order. Same arguments
        as :meth:`generate`; choice i samples with ``shared.choices.choice_seed(seed, i)`` (choice 0: ``seed``
        itself), so a seeded call is reproducible; unseeded, each choice is independent. If one choice fails the
        others are cancelled and its error is raised."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise PipespecError(f"n must be an integer in [1, {MAX_N}], got {n!r}", "bad_request")
        tasks = [asyncio.ensure_future(self.generate(prompt, seed=choice_seed(seed, i), **kwargs)) for i in range(n)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:  # in choice order: the first failed choice's own error (not an ExceptionGroup)
                if t.done() and t.exception() is not None:
                    raise t.exception()
            return [t.result() for t in tasks]
        finally:
            for t in tasks:  # a failure or the caller's cancel: the others are cancelled on the verifier too
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, prompt, token_ids, messages, params: dict[str, Any], drafter_type: str | None = None,
                   cancel: asyncio.Event | None = None, tenant: str | None = None,
                   tools: list[dict[str, Any]] | None = None):
        """One request: its chunks, then its :class:`GenerationResult` (an error reply raises)."""
        params = wire_params(params)
        if self._sock is None:
            raise RuntimeError("use the client inside 'async with AsyncClient(address) as client:'")
        if self.max_message_bytes is None:  # first request (or first since the verifier went): learn its cap
            await self._learn_limits()
        rid = next(self._ids)
        frames = request_frames(Generate(
            request_id=rid, params={k: v for k, v in params.items() if v is not None}, token_ids=token_ids,
            prompt=prompt, messages=messages, drafter_type=drafter_type, tenant=tenant, tools=tools,
        ), self.max_message_bytes)
        queue = _Inbox()  # bounded: the reader task never waits for a slow consumer
        self._track(rid, queue)
        finished = False
        try:
            await self._sock.send_multipart(frames)
            async for item in self._replies(rid, queue, cancel):
                finished = isinstance(item, GenerationResult)
                yield item
        except PipespecError as exc:
            finished = getattr(exc, "verifier_ended", False)  # an error reply ended the request there
            raise
        finally:
            self._queues.pop(rid, None)
            if not finished and self._sock is not None:
                # The caller stopped early (break, cancel, timeout) or the verifier went: free the session (a
                # verifier that comes back at the address gets it with anything else queued, and ignores it).
                with contextlib.suppress(zmq.ZMQError):
                    await self._sock.send_multipart(encode(Cancel(request_id=rid)))

    async def _learn_limits(self) -> None:
        """Wait for the connection and the verifier's pong (its message cap)."""
        await self._await_connection()
        try:  # connected: a verifier busy with a long round answers after it, so wait as long as for a reply
            await self._ping(self.timeout_s, fail_on_drop=True)
        except TimeoutError:
            raise PipespecError(f"no pong from the verifier at {self.address} within {self.timeout_s} s",
                                "verifier_gone") from None

    async def _replies(self, rid: int, queue: _Inbox, cancel: asyncio.Event | None):
        """Request ``rid``'s chunks, then its result; a cancel is sent once when ``cancel`` is set."""
        cancel_sent = False
        gathered: list | None = None  # the chunks' log probabilities, for a done too long to carry them itself
        while True:
            if cancel is not None and cancel.is_set() and not cancel_sent:
                await self._sock.send_multipart(encode(Cancel(request_id=rid)))
                cancel_sent = True
            wait_s = min(self.timeout_s, CANCEL_WAIT_S) if cancel_sent else self.timeout_s
            try:
                msg = await asyncio.wait_for(queue.get(), wait_s)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"no reply from the verifier at {self.address} for {wait_s} s (request {rid}){self._hint()}"
                ) from None
            if isinstance(msg, ChunkMessage):
                if msg.logprobs is not None:
                    if gathered is None:
                        gathered = []
                    gathered.extend(msg.logprobs)
                if not cancel_sent:  # chunks already on their way when the cancel left are dropped
                    yield Chunk(msg.token_ids, msg.text, from_wire(msg.token_ids, msg.logprobs))
            elif isinstance(msg, Done):
                logprobs = msg.logprobs
                if logprobs is None and gathered is not None and len(gathered) == len(msg.token_ids):
                    logprobs = gathered  # the verifier left them out of a done past the header cap
                yield GenerationResult(msg.text, msg.token_ids, msg.metrics, msg.finish_reason,
                                       from_wire(msg.token_ids, logprobs))
                return
            elif isinstance(msg, (Error, _LocalFailure)):
                error = PipespecError(msg.message, msg.code)
                error.verifier_ended = isinstance(msg, Error)  # type: ignore[attr-defined]  # no cancel needed
                raise error


async def _tool_reader(client: AsyncClient, tools: list[dict[str, Any]] | None, tool_choice: Any,
                       parallel: bool | None, tool_parser: str | None, params: dict[str, Any]) -> _ToolReader | None:
    """A request's tool use: a forced call's grammar put into ``params``, and the reader of its calls (None: no
    tools, or ``tool_choice`` none); a bad field is ``bad_request``, raised before anything is sent."""
    if tools is None and tool_choice is None:
        return None
    try:
        parser = tool_parser
        if parser is None and tools and tool_choice != "none":
            parser = await client.target_tool_parser()
        given = params.get("grammar")
        other = GrammarSpec.from_wire(given) if isinstance(given, dict) else structured_output(
            **{k: params[k] for k in _CONSTRAINT_NAMES if k in params})
        plan = plan_tools(tools, tool_choice, parallel, parser, other, check_schema)
    except (ChatError, ParamError) as exc:
        raise PipespecError(str(exc), "bad_request") from None
    if plan is not None and plan.grammar is not None:
        params["grammar"] = plan.grammar.to_wire()
    return _ToolReader(plan) if plan is not None and plan.parser is not None else None


class _ToolReader:
    """One request's output read for tool calls: each chunk gets the parser's delta, the result its calls."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        parser = plan.new_parser()
        assert parser is not None
        self.parser: ToolCallParser = parser
        self.received = ""

    def read(self, item: Chunk | GenerationResult) -> Chunk | None:
        """Read ``item``; at the result: a last chunk with what the parser held back, if anything."""
        if isinstance(item, Chunk):
            self.received += item.text
            item.delta = self.plan.kept(self.parser.push(item.text))
            return None
        # the stream holds back a trailing half character: the result's text has all of it
        tail = item.text[len(self.received):] if item.text.startswith(self.received) else ""
        last, end = self.parser.push(tail), self.parser.finish()
        # the parsed calls and content onto the result (finish_reason tool_calls when it called and ended so)
        item.tool_calls = self.plan.kept_calls(self.parser.calls)
        item.content = self.parser.content
        item.finish_reason = self.plan.finish_reason(item.finish_reason, item.tool_calls)
        held = self.plan.kept(ParsedDelta(last.content + end.content, last.calls + end.calls))
        return Chunk([], "", delta=held) if held.content or held.calls else None
