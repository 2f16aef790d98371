"""Transport pieces: server-sent events (``data: {...}`` then ``data: [DONE]``) and an ASGI middleware that bounds
request bodies (413 beyond ``max_bytes``, whether the body announces its length or is chunked)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from http_server.errors import error_body


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Each event as one ``data:`` line; ``[DONE]`` after the last, unless the stream ended with an error event
    (OpenAI's clients raise on it)."""
    failed = False
    async for event in events:
        failed = "error" in event
        yield b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    if not failed:
        yield b"data: [DONE]\n\n"


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with a 413 before they are read whole."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(error_body(f"request body over the server's limit of {self.max_bytes} bytes "
                                     "(http.max_body_bytes)", code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
