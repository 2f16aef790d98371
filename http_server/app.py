"""The FastAPI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, plus ``/health``
and ``/metrics``, served from one :class:`~runtime.client.AsyncClient`. Every error leaves as an OpenAI-shaped JSON
body (``{"error": {"message", "type", "param", "code"}}``), never as a traceback."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from http_server.choices import run_choices
from http_server.errors import OpenAIError, error_body, from_pipespec
from http_server.gate import KeyRing, RequestGate, bearer_token
from http_server.generation import Generation
from http_server.guard import ClientStalled, HostCheck
from http_server.metrics import CONTENT_TYPE, HttpMetrics
from http_server.responses import (
    ChoiceFormat,
    ChoiceOutput,
    Stream,
    anext_or_none,
    drain,
    failing_as_http,
    until_disconnect,
)
from http_server.schemas import ChatRequest, CompletionRequest, check_supported
from http_server.sse import sse
from http_server.tools import ToolPlan, check_chat_messages, plan_tools
from runtime.client import AsyncClient, PipespecError, live_drafters
from runtime.config_schema import HttpConfig
from runtime.keys import DEFAULT_TENANT

log = logging.getLogger("pipespec.http")


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
        return await runner.run(request, req, ChoiceFormat(chat=False), tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest,
                               tenant: str | None = Depends(authorize)) -> Response:
        return await runner.run(request, req, ChoiceFormat(chat=True), tenant)


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

    def base(self, fmt: ChoiceFormat, rid: str) -> dict[str, Any]:
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

    async def run(self, request: Request, req: CompletionRequest | ChatRequest, fmt: ChoiceFormat,
                  tenant: str | None) -> Response:
        self.check(req)
        plan = await self.tool_plan(req)
        if (req.n or 1) > 1 or (req.best_of or 1) > 1:  # several answers: http_server/choices.py
            return await run_choices(self, request, req, fmt, tenant, plan)
        gen = Generation(self.client, req, self.default_max_tokens, tenant)
        output = ChoiceOutput(gen, fmt, plan)
        pieces = gen.pieces()
        rid = fmt.id_prefix + secrets.token_hex(12)
        async with failing_as_http(self.metrics, pieces.aclose):
            # the first step runs here, not in the stream: a refused request gets its real status, not a 200
            first = await until_disconnect(request, anext_or_none(pieces))
            if not req.stream and first is not None:
                await until_disconnect(request, drain(pieces))
        if not req.stream:
            out = gen.outcome
            self.record(out)
            return JSONResponse({**self.base(fmt, rid), "object": fmt.object, "choices": [output.whole()],
                                 "usage": out.usage(), **self.spec_metrics(out)})
        return Stream(sse(self.stream_events(output, pieces, first, rid, req.include_usage())),
                      media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_events(self, output: ChoiceOutput, pieces: AsyncIterator[str], first: str | None, rid: str,
                            include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        gen = output.gen
        head = self.base(output.fmt, rid)
        extra = {"usage": None} if include_usage else {}
        finished = False
        try:
            opening = output.opening()
            if opening is not None:
                yield {**head, "choices": [opening], **extra}
            for choice in output.pieces(first or ""):
                yield {**head, "choices": [choice], **extra}
            if first is not None:
                async for piece in pieces:
                    for choice in output.pieces(piece):
                        yield {**head, "choices": [choice], **extra}
            out = gen.outcome
            finished = True
            self.record(out)
            *held, last = output.closing()
            for choice in held:
                yield {**head, "choices": [choice], **extra}
            yield {**head, "choices": [last], **extra, **self.spec_metrics(out)}
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
