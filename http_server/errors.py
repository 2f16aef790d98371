"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status, and how the
verifier's :class:`~runtime.client.PipespecError` codes map onto statuses."""

from __future__ import annotations

import json
from typing import Any

from runtime.client import PipespecError

#: PipespecError code → (HTTP status, OpenAI error type). Anything not listed is a 500.
_STATUS_BY_CODE: dict[str, tuple[int, str]] = {
    "bad_request": (400, "invalid_request_error"),
    "unsupported": (400, "invalid_request_error"),
    "ensemble_needs_q": (400, "invalid_request_error"),
    "too_large": (413, "invalid_request_error"),
    "busy": (429, "rate_limit_error"),  # sessions, pending requests or KV tokens at their limit: retry later
    "closed": (503, "server_error"),
    "verifier_gone": (503, "server_error"),
    "numerical_error": (500, "server_error"),
    "internal_error": (500, "server_error"),
}


class OpenAIError(Exception):
    """An error to send as an OpenAI-shaped body with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


async def send_error(send: Any, status: int, message: str, code: str, *, close: bool = False) -> None:
    """Answer with an OpenAI-shaped error body straight through ASGI ``send`` (for middlewares, which answer before
    the app runs); ``close``: ask the client to close the connection (a body left unread)."""
    body = json.dumps(error_body(message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_pipespec(exc: PipespecError | TimeoutError) -> OpenAIError:
    """The HTTP face of a verifier-side failure (a timeout waiting for the verifier is a 504)."""
    if isinstance(exc, TimeoutError):
        return OpenAIError(504, f"the verifier did not answer in time: {exc}", type="server_error", code="timeout")
    status, kind = _STATUS_BY_CODE.get(exc.code, (500, "server_error"))
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    message = busy_message(str(exc)) if exc.code == "busy" else str(exc)
    param = param_of(message) if exc.code == "bad_request" else None  # e.g. a logit_bias id outside the vocabulary
    return OpenAIError(status, message, type=kind, param=param, code=exc.code, headers=headers)


#: pipespec parameter → the HTTP field it comes from, for naming the field of a verifier's refusal
_HTTP_NAME = {"presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
              "logit_bias": "logit_bias", "repetition_penalty": "repetition_penalty", "min_new_tokens": "min_tokens"}


def param_of(message: str) -> str | None:
    """The HTTP field a verifier's ``bad_request`` message is about, where it opens with one of these parameters'
    names (the checks in shared.sampling and shared.penalties name their field first)."""
    return _HTTP_NAME.get(message.split(" ", 1)[0])


#: What a ``busy`` refusal says over HTTP: which limit, never how much of it others hold (the verifier's own text
#: counts sessions, requests and KV tokens of every tenant, a view of the others' load).
BUSY_OWN_CAP = "your tenant is at its limit of sessions (verifier.max_sessions_per_tenant): retry later"
BUSY_SERVER = ("the server is at capacity (verifier.max_sessions, verifier.max_pending_requests or "
               "verifier.max_kv_tokens): retry later")


def busy_message(verifier_text: str) -> str:
    """The HTTP text of a verifier's ``busy``: its own tenant's cap named, every other limit said in one line."""
    return BUSY_OWN_CAP if "max_sessions_per_tenant" in verifier_text else BUSY_SERVER
