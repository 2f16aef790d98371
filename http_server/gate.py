"""What a request must pass before the app reads its body (issue 43): the API key, a JSON content type, a size
and a deadline for the whole body (:class:`RequestGate`); and, below HTTP, a bound on the connections one client
address holds and a deadline for a connection's first request head (:func:`limited_protocol`).

The order is the point: a caller without a key is answered 401 from its headers alone and its connection closed,
so keyless slow uploads hold nothing; a keyed caller's body must arrive whole within ``http.body_timeout_s``
(a 408 and a closed connection otherwise), so a slow upload cannot hold a connection slot for long either; and no
address may hold more than ``http.max_connections_per_client`` connections, so one client cannot take every slot
uvicorn has (beyond them it answers 503 to everyone)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections import Counter
from typing import Any

from http_server.errors import OpenAIError, error_body, send_error

log = logging.getLogger("pipespec.http")

#: Paths that need no key: ``/health`` answers everyone (its details only to the admin, see app.py).
OPEN_PATHS = frozenset({"/health"})
#: Paths that need the admin key rather than a tenant's (``http.admin_key``).
ADMIN_PATHS = frozenset({"/metrics"})


def bearer_token(headers: Any) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (None: none, or another scheme); ``headers``:
    Starlette's, or an ASGI scope's as a dict of bytes."""
    value = headers.get(b"authorization") if isinstance(headers, dict) else headers.get("authorization")
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = (value or "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


class KeyRing:
    """The server's keys: tenants' API keys (key → tenant) and the admin's. ``open``: no tenant key is set, so the
    generation routes need none (a loopback-only server); the admin routes then need the admin key if one is set."""

    def __init__(self, tenants: list[tuple[str, str]], admin_key: str | None):
        self.tenants = [(key.encode(), tenant) for key, tenant in tenants]
        self.admin = admin_key.encode() if admin_key else None

    @property
    def open(self) -> bool:
        return not self.tenants

    def tenant(self, token: bytes | None) -> str | None:
        """The tenant whose key ``token`` is, or None. Every key is compared, in constant time, so the time taken
        says neither which key matched nor how much of one."""
        found = None
        for key, tenant in self.tenants:
            if hmac.compare_digest(token or b"", key) and found is None:
                found = tenant
        return found

    def is_admin(self, token: bytes | None) -> bool:
        """Whether ``token`` may read ``/metrics`` and ``/health``'s details: the admin key; with none set, any
        caller of an open server (loopback only, everyone trusted) and no one on a keyed one."""
        if self.admin is None:
            return self.open
        return hmac.compare_digest(token or b"", self.admin)

    def check_tenant(self, headers: Any) -> str | None:
        """The caller's tenant (None on an open server); raises the 401 for a missing or wrong key."""
        if self.open:
            return None
        tenant = self.tenant(bearer_token(headers))
        if tenant is None:
            raise OpenAIError(401, "Incorrect API key provided: send Authorization: Bearer <your API key>",
                              code="invalid_api_key")
        return tenant

    def check_admin(self, headers: Any) -> None:
        if not self.is_admin(bearer_token(headers)):
            raise OpenAIError(401, "this endpoint needs the admin key (http.admin_key): send Authorization: "
                              "Bearer <admin key>", code="invalid_api_key")


def json_content_type(value: bytes | None) -> bool:
    """``application/json`` or ``application/*+json`` (parameters such as ``charset`` allowed). A browser sends a
    cross-site POST without asking first only as ``text/plain``, a form, or with no type at all: all refused."""
    if not value:
        return False
    kind = value.decode("latin-1").split(";", 1)[0].strip().lower()
    main, _, sub = kind.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


class RequestGate:
    """ASGI middleware, inside the Host check: the key (from the headers, before any body byte is read), the
    content type of a POST (415 unless JSON), then the whole body, read here up to ``max_bytes`` (413) and within
    ``body_timeout_s`` of the request head (408), and replayed to the app. Every refusal closes the connection,
    so a body left unread holds nothing."""

    def __init__(self, app: Any, keys: KeyRing, max_bytes: int, body_timeout_s: float):
        self.app = app
        self.keys = keys
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        try:
            self._check_headers(scope["path"], scope["method"], headers)
        except OpenAIError as exc:
            await send_error(send, exc.status, exc.message, exc.code or "invalid_request", close=True)
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
        except asyncio.TimeoutError:
            peer = scope.get("client")
            log.warning("HTTP client %s did not send its request body within %s s (http.body_timeout_s): refused",
                        peer[0] if peer else "?", self.body_timeout_s)
            await send_error(send, 408, f"the request body did not arrive within {self.body_timeout_s} s "
                             "(http.body_timeout_s)", "request_timeout", close=True)
            return
        except _TooLarge:
            error = _too_large(self.max_bytes)
            await send_error(send, error.status, error.message, "request_too_large", close=True)
            return
        if body is None:  # the client left while sending: nothing to answer
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    def _check_headers(self, path: str, method: str, headers: dict[bytes, bytes]) -> None:
        """The refusals that need no body: key, content type, announced length."""
        if path in ADMIN_PATHS:
            self.keys.check_admin(headers)
        elif path not in OPEN_PATHS:
            self.keys.check_tenant(headers)
        if method == "POST" and not json_content_type(headers.get(b"content-type")):
            raise OpenAIError(415, "send the body as JSON with Content-Type: application/json",
                              code="unsupported_media_type")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            raise _too_large(self.max_bytes)

    async def _read_body(self, receive: Any) -> bytes | None:
        parts: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            part = message.get("body", b"")
            seen += len(part)
            if seen > self.max_bytes:  # a chunked body announces no length: counted as it comes
                raise _TooLarge
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)


class _TooLarge(Exception):
    """A chunked body grew past ``http.max_body_bytes`` while being read."""


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"request body over the server's limit of {max_bytes} bytes (http.max_body_bytes)",
                       code="request_too_large")


# ------------------------------------------------------------------------------------------ connections
def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes its connection (written before any request was parsed)."""
    body = json.dumps(error_body(message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def limited_protocol(base: type, per_client: int, header_timeout_s: float) -> type:
    """A subclass of uvicorn's HTTP protocol class ``base`` that refuses (503, connection closed) a connection
    from an address already holding ``per_client`` connections, and drops a connection that has sent no complete
    request head within ``header_timeout_s`` of opening (a slow-header client holds no slot for long)."""
    held: Counter[str] = Counter()  # open connections per client address, for this server

    class Limited(base):  # type: ignore[misc, valid-type]
        _peer: str | None = None
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._peer = str(peer[0]) if peer else "?"
            held[self._peer] += 1
            if held[self._peer] > per_client:
                log.warning("HTTP client %s holds %d connections (http.max_connections_per_client): one refused",
                            self._peer, per_client)
                transport.write(_raw_error(503, "Service Unavailable", f"this address holds {per_client} "
                                           "connections already (http.max_connections_per_client)",
                                           "too_many_connections"))
                transport.close()
                return
            self._head_timer = asyncio.get_running_loop().call_later(header_timeout_s, self._head_overdue)

        def _head_overdue(self) -> None:
            if getattr(self, "cycle", None) is None and not self.transport.is_closing():
                log.warning("HTTP client %s sent no request head within %s s (http.header_timeout_s): "
                            "connection closed", self._peer, header_timeout_s)
                self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            if self._peer is not None:
                held[self._peer] -= 1
                if held[self._peer] <= 0:
                    del held[self._peer]
                self._peer = None
            super().connection_lost(exc)

    Limited.__name__ = f"Limited{base.__name__}"
    Limited.held = held  # type: ignore[attr-defined]  # read by tests
    return Limited
