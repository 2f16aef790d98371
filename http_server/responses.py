"""What a generation route answers with, shared by one choice (``http_server.app``) and several
(``http_server.choices``): how completions and chat spell a choice (:class:`ChoiceFormat`), one choice's text turned
into those bodies — plain, or read for tool calls, with the shown tokens' log probabilities — (:class:`ChoiceOutput`),
the streamed response (:class:`Stream`) and the waits that give up when the caller disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from http_server.errors import from_pipespec
from http_server.generation import Generation
from http_server.guard import ClientStalled
from http_server.logprobs import body as logprobs_body
from http_server.metrics import HttpMetrics
from http_server.tools import ToolOutput, ToolPlan
from runtime.client import PipespecError

T = TypeVar("T")

#: How often a non-streamed request checks whether its caller is still there.
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP caller went away; its request was cancelled on the verifier."""


class ChoiceFormat:
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

    def with_message(self, finish_reason: str, message: dict[str, Any], logprobs: list | None = None
                     ) -> dict[str, Any]:
        """A whole chat choice with this ``message`` (content and/or tool calls)."""
        return self._choice(finish_reason, logprobs, message=message)

    def whole(self, text: str, finish_reason: str, logprobs: list | None = None) -> dict[str, Any]:
        if self.chat:
            return self._choice(finish_reason, logprobs,
                                message={"role": "assistant", "content": text, "refusal": None})
        return self._choice(finish_reason, logprobs, text=text)


class Stream(StreamingResponse):
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


class ChoiceOutput:
    """One choice's bodies: its :class:`~http_server.generation.Generation`'s text as pieces (streamed) or whole, read
    for tool calls where the request's :class:`~http_server.tools.ToolPlan` has a parser (a forced call's grammar
    goes into the generation's parameters here), each body carrying the log probabilities of the tokens shown since
    the last one. ``index``: the choice's place in ``choices``."""

    def __init__(self, gen: Generation, fmt: ChoiceFormat, plan: ToolPlan | None = None, index: int = 0):
        self.gen, self.fmt, self.index = gen, fmt, index
        if plan is not None and plan.grammar is not None:  # a forced call (required / named)
            gen.params["grammar"] = plan.grammar.to_wire()
        self.tools = ToolOutput(plan) if plan is not None and plan.parser is not None else None

    def _at(self, choice: dict[str, Any]) -> dict[str, Any]:
        choice["index"] = self.index
        return choice

    def opening(self) -> dict[str, Any] | None:
        opening = self.fmt.opening()
        return None if opening is None else self._at(opening)

    def pieces(self, piece: str) -> list[dict[str, Any]]:
        """A piece of text as choice bodies: one, or with tools the parser's deltas (none while it holds back: the
        log probabilities shown meanwhile go with the next body)."""
        if self.tools is None:
            return [self._at(self.fmt.piece(piece, self.gen.take_logprobs()))] if piece else []
        return [self._at(self.fmt.delta(d, self.gen.take_logprobs() if i == 0 else None))
                for i, d in enumerate(self.tools.deltas(piece))]

    def closing(self) -> list[dict[str, Any]]:
        """After the last piece: what the tool parser still held, then the finish body."""
        reason, bodies = self.gen.outcome.finish_reason, []
        if self.tools is not None:
            bodies = [self._at(self.fmt.delta(d, self.gen.take_logprobs())) for d in self.tools.finish()]
            reason = self.tools.finish_reason(reason)
        return [*bodies, self._at(self.fmt.finish(reason, self.gen.take_logprobs()))]

    def whole(self) -> dict[str, Any]:
        """The non-streamed choice."""
        out = self.gen.outcome
        if self.tools is None:
            return self._at(self.fmt.whole(out.text, out.finish_reason, self.gen.all_logprobs()))
        message = self.tools.message(out.text)  # parsed first: the finish reason depends on the calls
        return self._at(self.fmt.with_message(self.tools.finish_reason(out.finish_reason), message,
                                              self.gen.all_logprobs()))


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


@contextlib.asynccontextmanager
async def failing_as_http(metrics: HttpMetrics, close: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    r"""Around a run's first steps: a verifier error or timeout ``close``\ s the run (cancelling it on the verifier),
    is counted and leaves as its OpenAI error; a caller that went away closes it, is counted and goes on up."""
    try:
        yield
    except (PipespecError, TimeoutError) as exc:
        await close()
        error = from_pipespec(exc)
        metrics.record_error(error.code)
        raise error from None
    except (ClientGone, asyncio.CancelledError):
        await close()
        metrics.record_error("client_gone")
        raise
