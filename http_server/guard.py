"""What keeps one HTTP client from costing the others (issue 32): a bound on how long a response waits for its
client to read (:class:`SendGuard`), and the Host-header check against DNS rebinding (:class:`HostCheck`).

A client that stops reading a stream fills the connection's buffers; uvicorn's ``send`` then waits for it without
limit, the connection stays open and holds its verifier session, and enough such clients exhaust the server's
connection slots (a 503 for everyone). :class:`SendGuard` wraps the app outermost: a send that waits longer than
``http.send_timeout_s`` aborts the connection (an ``abort``, not a ``close``: a close waits for the unread buffer to
drain, which never happens) and raises :class:`ClientStalled` into the app, whose stream then closes, which cancels
its request on the verifier."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from typing import Any

from http_server.errors import send_error

log = logging.getLogger("pipespec.http")

#: The asyncio write buffer per connection above which a send waits for the client (asyncio's default is 64 KiB).
#: An SSE stream needs little: a small buffer notices a stalled reader sooner and holds less memory for it.
WRITE_BUFFER_HIGH = 16 * 1024


class ClientStalled(Exception):
    """The client did not take a response's bytes within ``http.send_timeout_s``; its connection was aborted."""


def _transport(send: Any) -> Any:
    """The connection's asyncio transport behind uvicorn's ``send`` (its request cycle's ``transport``), or None
    under another server."""
    return getattr(getattr(send, "__self__", None), "transport", None)


class SendGuard:
    """ASGI wrapper, outermost (around the whole app, so it sees the server's own ``send``): every send of a
    response may wait ``timeout_s`` for the client; a longer wait aborts the connection and raises
    :class:`ClientStalled` (the app's streams catch it and cancel their request)."""

    def __init__(self, app: Any, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        transport = _transport(send)
        if transport is not None:
            with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
                transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        stalled = False

        async def timed_send(message: dict) -> None:
            nonlocal stalled
            if stalled:
                raise ClientStalled
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except asyncio.TimeoutError:
                stalled = True
                peer = scope.get("client")
                log.warning("HTTP client %s did not read its response for %s s (http.send_timeout_s): "
                            "connection closed, request cancelled", peer[0] if peer else "?", self.timeout_s)
                if transport is not None:
                    transport.abort()  # frees the connection now; close() would wait for the unread bytes
                raise ClientStalled from None

        with contextlib.suppress(ClientStalled):  # the connection is gone; the app has cancelled what it ran
            await self.app(scope, receive, timed_send)


def _host_name(header: str) -> str | None:
    """The name or address in a Host header (``name``, ``name:port``, ``[v6]:port``), lower-case; None if
    malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        if end < 0 or (header[end + 1:] and not header[end + 1:].startswith(":")):
            return None
        return header[1:end]
    name, _, port = header.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".")


def host_allowed(header: str, extra: frozenset[str]) -> bool:
    """Whether a Host header names this server: a loopback name or address, or one of ``extra`` (any port)."""
    name = _host_name(header)
    if not name:
        return False
    if name == "localhost" or name.endswith(".localhost") or name in extra:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostCheck:
    """Refuse requests whose Host header names another site, before any work (a 400, OpenAI-shaped): without an
    API key the server trusts whoever reaches its loopback port, and a web page whose domain was re-pointed at
    127.0.0.1 (DNS rebinding) reaches it from the user's browser with its own name in Host. A request without Host
    (HTTP/1.0) comes from no browser and passes."""

    def __init__(self, app: Any, allowed: frozenset[str]):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = dict(scope.get("headers") or []).get(b"host")
            if host is not None and not host_allowed(host.decode("latin-1"), self.allowed):
                await send_error(send, 400, f"Host {host.decode('latin-1')[:100]!r} is not this server's name: add "
                                 "it to http.allowed_hosts (or set http.api_key)", "host_not_allowed")
                return
        await self.app(scope, receive, send)
