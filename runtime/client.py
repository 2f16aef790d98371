"""Async client library: ``async with AsyncClient(address) as c: r = await c.generate(prompt=...)``.

One DEALER socket per client; a reader task routes replies to their request by ``request_id``, so any number of
concurrent ``generate``/``stream`` calls share it. Every wait is bounded by ``timeout_s`` (no reply from the
verifier for that long raises :class:`TimeoutError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from shared.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
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
from shared.transport import ClientKeys, connect_dealer, is_local_endpoint


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


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only
    metrics: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = ""


_PARAM_NAMES = (
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "min_new_tokens",
    "eos_token_ids", "stop_token_ids", "seed",
)


class AsyncClient:
    """A client of one verifier. ``curve``: the keys to connect with when the verifier's client socket runs CURVE
    (``runtime.keys.client_keys(KEYS_DIR, NAME)``); without an allowed key such a verifier never answers."""

    def __init__(self, address: str, timeout_s: float = 600.0, curve: ClientKeys | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.curve = curve
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._pongs: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock = None

    async def __aenter__(self) -> AsyncClient:
        self._ctx = zmq.asyncio.Context()
        self._sock = connect_dealer(self._ctx, self.address, self.curve)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                msg = decode(frames, DEFAULT_MAX_MESSAGE_BYTES)
            except ProtocolError:
                continue
            if isinstance(msg, Pong):
                self._pongs.put_nowait(msg)
                continue
            rid = getattr(msg, "request_id", None)  # chunk, done and error replies name their request
            queue = self._queues.get(rid) if rid is not None else None
            if queue is not None:
                queue.put_nowait(msg)

    def _hint(self) -> str:
        with contextlib.suppress(ValueError):
            if self.curve is None and not is_local_endpoint(self.address):
                return " (a verifier on a network address runs CURVE: pass curve=runtime.keys.client_keys(KEYS_DIR))"
        return ""

    async def ping(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Ask the verifier for its state (``drafter_connected``, ``drafters``, ``target``, ``sessions``)."""
        while not self._pongs.empty():
            self._pongs.get_nowait()
        await self._sock.send_multipart(encode(Ping()))
        try:
            msg: Pong = await asyncio.wait_for(self._pongs.get(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer from the verifier at {self.address} within {timeout_s} s{self._hint()}") \
                from None
        return msg.to_dict()

    async def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        include_result: bool = False,
        drafter_type: str | None = None,
        **params: Any,
    ) -> AsyncIterator[Chunk | GenerationResult]:
        """Yield committed tokens as the verifier commits them. Same arguments as :meth:`generate`;
        with ``include_result=True`` the final :class:`GenerationResult` (with metrics) comes last."""
        async for item in self._run(prompt, token_ids, messages, params, drafter_type):
            if include_result or isinstance(item, Chunk):
                yield item

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        drafter_type: str | None = None,
        **params: Any,
    ) -> GenerationResult:
        """Generate from exactly one of ``prompt``, ``token_ids`` or ``messages`` (chat, templated by the target).

        Parameters: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``min_new_tokens``, ``eos_token_ids``, ``stop_token_ids``, ``seed``.
        ``drafter_type``: only a drafter of this type may serve the request (see the README, "Drafter pool").
        """
        result = None
        async for item in self._run(prompt, token_ids, messages, params, drafter_type):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result

    async def _run(self, prompt, token_ids, messages, params: dict[str, Any], drafter_type: str | None = None):
        unknown = sorted(set(params) - set(_PARAM_NAMES))
        if unknown:
            raise TypeError(f"unknown generation parameter(s): {', '.join(unknown)}")
        if self._sock is None:
            raise RuntimeError("use the client inside 'async with AsyncClient(address) as client:'")
        rid = next(self._ids)
        queue: asyncio.Queue[Message] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            await self._sock.send_multipart(encode(Generate(
                request_id=rid, params={k: v for k, v in params.items() if v is not None}, token_ids=token_ids,
                prompt=prompt, messages=messages, drafter_type=drafter_type,
            )))
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), self.timeout_s)
                except asyncio.TimeoutError:
                    raise TimeoutError(
                        f"no reply from the verifier at {self.address} for {self.timeout_s} s (request {rid})"
                        f"{self._hint()}"
                    ) from None
                if isinstance(msg, ChunkMessage):
                    yield Chunk(msg.token_ids, msg.text)
                elif isinstance(msg, Done):
                    finished = True
                    yield GenerationResult(msg.text, msg.token_ids, msg.metrics, msg.finish_reason)
                    return
                elif isinstance(msg, Error):
                    finished = True
                    raise PipespecError(msg.message, msg.code)
        finally:
            self._queues.pop(rid, None)
            if not finished and self._sock is not None:
                # The caller stopped early (break, cancel, timeout): free the verifier's session.
                await self._sock.send_multipart(encode(Cancel(request_id=rid)))
