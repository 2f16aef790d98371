"""The FastAPI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, plus ``/health``
and ``/metrics``, served from one :class:`~runtime.client.AsyncClient`. Every error leaves as an OpenAI-shaped JSON
body (``{"error": {"message", "type", "param", "code"}}``), never as a traceback."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from http_server.errors import OpenAIError, error_body, from_pipespec
from http_server.gate import KeyRing, RequestGate, bearer_token
from http_server.generation import Generation
from http_server.guard import ClientStalled, HostCheck
from http_server.logprobs import body as logprobs_body
from http_server.metrics import CONTENT_TYPE, HttpMetrics
from http_server.schemas import ChatRequest, CompletionRequest, check_supported
from http_server.sse import sse
from http_server.tools import ToolOutput, ToolPlan, check_chat_messages, plan_tools
from runtime.client import AsyncClient, PipespecError, live_drafters
from runtime.config_schema import HttpConfig
from runtime.keys import DEFAULT_TENANT

log = logging.getLogger("pipespec.http")
T = TypeVar("T")

#: How often a non-streamed request checks whether its caller is still there.
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP caller went away; its request was cancelled on the verifier."""


class _Format:
    """How completions (``text``) and chat (``message`` / ``delta``) spell their choices; the rest is shared."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"

    def _choice(self, finish_reason: str | None, logprobs: list | None = None, **body: Any) -> dict[str, Any]:
        # logprobs: the shown tokens' (entry, text offset) pairs (http_server.logprobs); None where not asked
        return {"index": 0, **body, "logprobs": logprobs_body(self.chat, logprobs), "finish_reason": finish_reason}

    def piece(self, text: str, logprobs: list | None = None) -> dict[str, Any]:
        if self.chat:
            return self._choice(None, logprobs, delta={"content": text})
        return self._choice(None, logprobs, text=text)

    def opening(self) -> dict[str, Any] | None:
        return self._choice(None, delta={"role": "assistant", "content": ""}) if self.chat else None

    def delta(self, delta: dict[str, Any], logprobs: list | None = None) -> dict[str, Any]:
        """A chat chunk's choice with this ``delta`` (content and/or tool calls)."""
        return self._choice(None, logprobs, delta=delta)

    def finish(self, finish_reason: str, logprobs: list | None = None) -> dict[str, Any]:
        if self.chat:
            return self._choice(finish_reason, logprobs, delta={})
        return self._choice(finish_reason, logprobs, text="")

    def whole(self, text: str, finish_reason: str, logprobs: list | None = None) -> dict[str, Any]:
        if self.chat:
            return self._choice(finish_reason, logprobs,
                                message={"role": "assistant", "content": text, "refusal": None})
        return self._choice(finish_reason, logprobs, text=text)


class _Stream(StreamingResponse):
    """A streamed response that closes its body iterator when it ends early (its request is then cancelled on the
    verifier at once, not when the iterator is collected), and takes a stalled client's
    :class:`~http_server.guard.ClientStalled` as the end of the stream."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        except ClientStalled:
            pass
        finally:
            await self.body_iterator.aclose()


def create_app(client: AsyncClient, model_name: str, *, api_key: str | None = None,
               api_keys: dict[str, str] | None = None,
               default_max_tokens: int = HttpConfig.default_max_tokens,
               max_body_bytes: int = HttpConfig.max_body_bytes,
               scrape_timeout_s: float = HttpConfig.scrape_timeout_s,
               allowed_hosts: frozenset[str] | None = None,
               request_metrics: bool = HttpConfig.request_metrics, admin_key: str | None = None,
               body_timeout_s: float = HttpConfig.body_timeout_s,
               tool_call_parser: str = HttpConfig.tool_call_parser) -> FastAPI:
    """The app. ``model_name``: the id ``/v1/models`` lists and requests may name; ``api_key``: when set, ``/v1/*``
    needs ``Authorization: Bearer <api_key>``, checked before the body is read, and the caller is tenant
    ``default``; ``api_keys``: more keys, key → tenant (``http.api_keys_file``). A request's tenant goes to the
    verifier with it (docs/security.md). ``admin_key``: the key of ``/metrics`` and ``/health``'s details
    (null: :meth:`~http_server.gate.KeyRing.is_admin` says who). ``body_timeout_s``: the whole body's deadline.
    ``allowed_hosts``: when given, a request whose Host header is neither a loopback name nor one of these is
    refused (:class:`~http_server.guard.HostCheck`). ``request_metrics``: each response carries its request's
    speculative metrics (off: a client could read from them how well another tenant's text predicts its own).
    ``tool_call_parser``: the tool-call format to read (``auto``: the one of the target's chat template)."""
    app = FastAPI(title="pipespec", docs_url=None, redoc_url=None, openapi_url=None)
    tenants = list((api_keys or {}).items())
    if api_key:
        tenants.append((api_key, DEFAULT_TENANT))
    if admin_key is None and api_key and not api_keys:
        admin_key = api_key  # one key, one user: the operator, who may see the load
    keys = KeyRing(tenants, admin_key)
    app.add_middleware(RequestGate, keys=keys, max_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=frozenset(allowed_hosts))  # added last: runs first
    metrics = HttpMetrics()
    app.state.metrics = metrics
    authorize = Authorize(keys)
    _add_error_handlers(app)
    _add_generation_routes(app, authorize, Completions(client, model_name, metrics, default_max_tokens,
                                                       request_metrics, tool_call_parser))
    _add_service_routes(app, authorize, client, model_name, metrics, scrape_timeout_s)
    return app


class Authorize:
    """The ``Depends`` that finds the caller's tenant by its API key (None: an open server, no key needed). The
    :class:`~http_server.gate.RequestGate` has already refused a wrong key before the body; this names the tenant
    (and stands on its own where the app runs without the gate)."""

    def __init__(self, keys: KeyRing):
        self.keys = keys

    async def __call__(self, request: Request) -> str | None:
        return self.keys.check_tenant(request.headers)

    async def admin(self, request: Request) -> None:
        self.keys.check_admin(request.headers)


# ------------------------------------------------------------------------------------------ errors
def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-shaped JSON body, never as a traceback."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind, code=str(exc.status_code)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, ClientStalled):  # its connection is gone: nothing to log or send
            return JSONResponse({}, status_code=500)
        log.exception("unexpected error in the HTTP server")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error",
                                       code="internal_error"), status_code=500)


def validation_body(exc: RequestValidationError) -> dict[str, Any]:
    """A request body that failed validation, as an OpenAI error naming its first problem (``param``: the field)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a body that is not JSON at all names no field (its loc is a character offset)
    param = None if first.get("type") == "json_invalid" else ".".join(loc) or None
    message = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return error_body(message, param=param, code="invalid_value")


# ------------------------------------------------------------------------------------------ routes
def _add_generation_routes(app: FastAPI, authorize: Authorize, runner: Completions) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``."""

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest,
                          tenant: str | None = Depends(authorize)) -> Response:
        return await runner.run(request, req, _Format(chat=False), tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest,
                               tenant: str | None = Depends(authorize)) -> Response:
        return await runner.run(request, req, _Format(chat=True), tenant)


def _add_service_routes(app: FastAPI, authorize: Authorize, client: AsyncClient, model_name: str,
                        metrics: HttpMetrics, scrape_timeout_s: float) -> None:
    """``/v1/models``, ``/health`` and ``/metrics``."""
    created = int(time.time())
    guarded = [Depends(authorize)]

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "pipespec"}]}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            pong = await asyncio.wait_for(client.ping(timeout_s=scrape_timeout_s), scrape_timeout_s + 0.5)
        except Exception:  # a health check answers, whatever the verifier does
            return JSONResponse({"status": "unavailable", "verifier": False}, status_code=503)
        # the load (sessions, drafters) only to the admin (on a server without keys: every, loopback, caller)
        if not authorize.keys.is_admin(bearer_token(request.headers)):
            return JSONResponse({"status": "ok", "verifier": True})
        live = len(live_drafters(pong))
        return JSONResponse({"status": "ok", "verifier": True, "drafters": live, "sessions": pong.get("sessions")})

    @app.get("/metrics", dependencies=[Depends(authorize.admin)])
    async def prometheus() -> Response:
        return Response(await metrics.render(client, scrape_timeout_s), media_type=CONTENT_TYPE)


# ------------------------------------------------------------------------------------------ generation
class Completions:
    """Runs one completion or chat request on the verifier: answered whole, or streamed as server-sent events."""

    def __init__(self, client: AsyncClient, model_name: str, metrics: HttpMetrics, default_max_tokens: int,
                 request_metrics: bool, tool_call_parser: str = HttpConfig.tool_call_parser):
        self.client = client
        self.tool_call_parser = tool_call_parser
        self.model_name = model_name
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.request_metrics = request_metrics

    def check(self, req: CompletionRequest | ChatRequest) -> None:
        check_supported(req)
        if req.model is not None and req.model != self.model_name:
            raise OpenAIError(404, f"The model {req.model!r} does not exist: this server serves "
                              f"{self.model_name!r} (see GET /v1/models)", param="model", code="model_not_found")

    def base(self, fmt: _Format, rid: str) -> dict[str, Any]:
        return {"id": rid, "object": fmt.chunk_object, "created": int(time.time()), "model": self.model_name}

    def spec_metrics(self, out: Any) -> dict[str, Any]:
        """The response's ``metrics`` block, only where ``http.request_metrics`` is on."""
        return {"metrics": out.metrics()} if self.request_metrics else {}

    def record(self, out: Any) -> None:
        """A request that finished (the verifier's metrics, when it gave them)."""
        self.metrics.record(out.finish_reason, out.result.metrics if out.result else None, out.ttft_s,
                            time.monotonic() - out.started)

    async def tool_plan(self, req: CompletionRequest | ChatRequest) -> ToolPlan | None:
        """A chat request's tool use (None: none); its tool turns and tools checked (a 400 naming the field)."""
        if not isinstance(req, ChatRequest):
            return None
        check_chat_messages([m.as_template_input() for m in req.messages])
        parser = self.tool_call_parser
        if req.tools and parser == "auto":
            try:  # the target's family, from the verifier's pong (asked once per verifier)
                parser = await self.client.target_tool_parser()
            except (PipespecError, TimeoutError) as exc:
                raise from_pipespec(exc) from None
        return plan_tools(req, parser, req.grammar_spec())

    async def run(self, request: Request, req: CompletionRequest | ChatRequest, fmt: _Format,
                  tenant: str | None) -> Response:
        self.check(req)
        plan = await self.tool_plan(req)
        gen = Generation(self.client, req, self.default_max_tokens, tenant)
        if plan is not None and plan.grammar is not None:  # a forced call (required / named)
            gen.params["grammar"] = plan.grammar.to_wire()
        tools = ToolOutput(plan) if plan is not None and plan.parser is not None else None
        pieces = gen.pieces()
        rid = fmt.id_prefix + secrets.token_hex(12)
        try:
            # the first step runs here, not in the stream: a refused request gets its real status, not a 200
            first = await until_disconnect(request, anext_or_none(pieces))
            if not req.stream and first is not None:
                await until_disconnect(request, drain(pieces))
        except (PipespecError, TimeoutError) as exc:
            await pieces.aclose()
            error = from_pipespec(exc)
            self.metrics.record_error(error.code)
            raise error from None
        except (ClientGone, asyncio.CancelledError):
            await pieces.aclose()
            self.metrics.record_error("client_gone")
            raise
        if not req.stream:
            out = gen.outcome
            self.record(out)
            if tools is None:
                choice = fmt.whole(out.text, out.finish_reason, gen.all_logprobs())
            else:
                message = tools.message(out.text)  # parsed first: the finish reason depends on the calls
                choice = fmt._choice(tools.finish_reason(out.finish_reason), gen.all_logprobs(), message=message)
            return JSONResponse({**self.base(fmt, rid), "object": fmt.object, "choices": [choice],
                                 "usage": out.usage(), **self.spec_metrics(out)})
        return _Stream(sse(self.stream_events(gen, pieces, first, fmt, rid, req.include_usage(), tools)),
                       media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_events(self, gen: Generation, pieces: AsyncIterator[str], first: str | None, fmt: _Format,
                            rid: str, include_usage: bool, tools: ToolOutput | None = None
                            ) -> AsyncIterator[dict[str, Any]]:
        head = self.base(fmt, rid)
        extra = {"usage": None} if include_usage else {}
        finished = False

        def chunks(piece: str) -> list[dict[str, Any]]:
            """A piece of text as events: one, or with tools the parser's deltas (none while it holds back: the
            log probabilities shown meanwhile go with the next event)."""
            if tools is None:
                return [{**head, "choices": [fmt.piece(piece, gen.take_logprobs())], **extra}] if piece else []
            deltas = tools.deltas(piece)
            return [{**head, "choices": [fmt.delta(d, gen.take_logprobs() if i == 0 else None)], **extra}
                    for i, d in enumerate(deltas)]

        try:
            opening = fmt.opening()
            if opening is not None:
                yield {**head, "choices": [opening], **extra}
            for event in chunks(first or ""):
                yield event
            if first is not None:
                async for piece in pieces:
                    for event in chunks(piece):
                        yield event
            out = gen.outcome
            finished = True
            self.record(out)
            reason = out.finish_reason
            if tools is not None:
                for delta in tools.finish():
                    yield {**head, "choices": [fmt.delta(delta, gen.take_logprobs())], **extra}
                reason = tools.finish_reason(reason)
            yield {**head, "choices": [fmt.finish(reason, gen.take_logprobs())], **extra, **self.spec_metrics(out)}
            if include_usage:
                yield {**head, "choices": [], "usage": out.usage()}
        except (PipespecError, TimeoutError) as exc:  # after the 200: the error travels as an event
            error = from_pipespec(exc)
            self.metrics.record_error(error.code)
            yield error.body()
        finally:
            if not finished:
                await pieces.aclose()  # the caller left (or an error): cancel the request on the verifier
                if gen.outcome.result is None:
                    self.metrics.record_error("client_gone")


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, cancelling it (and so its request on the verifier) if the caller disconnects."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def anext_or_none(pieces: AsyncIterator[str]) -> str | None:
    """The first piece (None: the run ended without one)."""
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None


async def drain(pieces: AsyncIterator[str]) -> None:
    async for _ in pieces:
        pass
