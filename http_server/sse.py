"""Server-sent events: ``data: {...}`` then ``data: [DONE]`` (request bodies are bounded in
:mod:`http_server.gate`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any


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
