"""Run the app with uvicorn inside an event loop the caller owns (the launcher's): the socket is bound first, so a
port in use is a clear error, and uvicorn's own signal handling stays off (the launcher handles Ctrl-C)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from http_server.app import create_app
from http_server.gate import limited_protocol
from http_server.guard import SendGuard
from runtime.client import AsyncClient
from runtime.config_schema import HttpConfig
from runtime.keys import read_api_keys

#: Open connections uvicorn serves at once (more get a 503): a bound per verifier session, with room for scrapes.
CONNECTIONS_PER_SESSION = 2
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class HttpStartError(RuntimeError):
    """The HTTP server could not start (the port is taken, the address is not this host's, …)."""


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process that embeds it decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):  # newer uvicorn
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


class HttpServer:
    """``async with HttpServer(client, typed(config).http, ...) as server:`` serves that section until the block
    ends (``http.host`` must be set)."""

    def __init__(self, client: AsyncClient, http: HttpConfig, model_name: str, max_sessions: int = 64):
        if http.host is None:
            raise ValueError("HttpServer needs http.host")
        self.host, self.port = http.host, http.port
        self.model_name = http.model_name or model_name
        # no API key: anyone who reaches the (loopback) port is trusted, so its Host must name this server (a web
        # page re-pointed at 127.0.0.1 by DNS rebinding names its own); with a key, browsers cannot send it
        # cross-origin, so no Host check is needed
        keyed = http.api_key or http.api_keys_file
        hosts = None if keyed else frozenset({self.host.lower(), *http.allowed_hosts})
        api_keys = read_api_keys(http.api_keys_file) if http.api_keys_file else None
        self.app = create_app(client, self.model_name, api_key=http.api_key, api_keys=api_keys,
                              default_max_tokens=http.default_max_tokens, max_body_bytes=http.max_body_bytes,
                              scrape_timeout_s=http.scrape_timeout_s, allowed_hosts=hosts,
                              request_metrics=http.request_metrics, admin_key=http.admin_key,
                              body_timeout_s=http.body_timeout_s, tool_call_parser=http.tool_call_parser)
        limit = max(64, CONNECTIONS_PER_SESSION * max_sessions + 16)
        #: Connections one client address may hold: by default half of uvicorn's limit, so no one address takes it
        self.per_client = http.max_connections_per_client or max(1, limit // 2)
        protocol = limited_protocol(import_from_string(HTTP_PROTOCOLS["auto"]), self.per_client,
                                    http.header_timeout_s)
        self._config = uvicorn.Config(SendGuard(self.app, http.send_timeout_s), http=protocol,
                                      loop="none", lifespan="off", log_level="warning", access_log=False,
                                      timeout_keep_alive=5, timeout_graceful_shutdown=STOP_TIMEOUT_S / 2,
                                      limit_concurrency=limit)
        self._server = _EmbeddedServer(self._config)
        self._task: asyncio.Task | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def __aenter__(self) -> HttpServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise HttpStartError(f"cannot serve HTTP on {self.host}:{self.port}: {exc.strerror or exc}") from None
        sock.set_inheritable(True)
        self._sock = sock
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                await self._close_socket()
                raise HttpStartError(f"the HTTP server on {self.url} stopped during start-up")
            if loop.time() > deadline:
                await self.__aexit__()
                raise HttpStartError(f"the HTTP server on {self.url} did not start within {START_TIMEOUT_S} s")
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, STOP_TIMEOUT_S)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._close_socket()

    async def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
