"""Transport pieces: server-sent events (``data: {...}`` then ``data: [DONE]``) and an ASGI middleware that bounds
request bodies (413 beyond ``max_bytes``, whether the body announces its length or is chunked)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from http_server.errors import send_error


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Each event as one ``data:`` line; ``[DONE]`` after the last, unless the stream ended with an error event
    (OpenAI's clients raise on it)."""
    failed = False
    # aclosing: a stream closed early (its client left or stalled) closes ``events`` now, not when collected
    async with contextlib.aclosing(events):
        async for event in events:
            failed = "error" in event
            yield b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    if not failed:
        yield b"data: [DONE]\n\n"


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with a 413 before they are read whole. A body that announces its length is
    judged by its header; a chunked one (no Content-Length) is read here, up to the limit, before the app sees it:
    an error raised while the app reads would reach FastAPI's body parser, which turns any failure into a 400."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            # the HTTP parser delivers no more than the announced length: the header is the whole check
            if not length.isdigit() or int(length) > self.max_bytes:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)
            return
        parts: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending: nothing to answer
                return
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.max_bytes:
                await self._refuse(send)
                return
            parts.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        await send_error(send, 413, f"request body over the server's limit of {self.max_bytes} bytes "
                         "(http.max_body_bytes)", "request_too_large", close=True)
