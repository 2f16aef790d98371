"""OpenAI's ``n`` over HTTP: ``n`` answers to one prompt, answered whole or streamed with each chunk's ``index``.

Each choice is an ordinary request of its own on the verifier — its own session, drafter and acceptance rule, so
each is exactly as lossless as a single request — and the ``n`` requests leave together, so the verifier batches
them: their prompts arrive as one burst (its prompt gather waits for those still being tokenised) and are cached in
one batched prefill forward where its batch limits allow, then their rounds share target forwards. The prompt is
not prefilled once and its KV forked: the target interface (``shared.target.SequenceHandle``) has no fork of a
sequence's cache (each backend would need its own), and the batched prefill is one forward all the same.

Seeds: choice i samples with ``shared.choices.choice_seed(seed, i)`` (choice 0 with ``seed`` itself). Admission:
``n`` sessions count against the tenant's shares like ``n`` requests. If one choice fails, the request fails with
its error and the others are cancelled. ``usage`` counts the prompt once and sums the completions (as OpenAI does).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from http_server.errors import from_pipespec
from http_server.generation import Generation, Outcome
from http_server.schemas import ChatRequest, CompletionRequest
from http_server.sse import sse
from runtime.client import PipespecError
from shared.choices import choice_seed

if TYPE_CHECKING:
    from http_server.app import Completions, _Format

#: Put in the queue by a choice that ended (after its last piece).
_END = object()


class Choices:
    """The ``n`` runs of one request: each pumps its pieces into one queue as ``(index, piece | _END | error)``."""

    def __init__(self, runner: Completions, req: CompletionRequest | ChatRequest, tenant: str | None):
        self.gens: list[Generation] = []
        for i in range(req.n or 1):
            gen = Generation(runner.client, req, runner.default_max_tokens, tenant)
            seed = choice_seed(req.seed, i)
            if seed is not None:  # unseeded: the verifier draws each choice's seed on its own
                gen.params["seed"] = seed
            self.gens.append(gen)
        # unbounded, but at most the choices' own text: a stalled reader is cut by http.send_timeout_s
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._pump(i, gen)) for i, gen in enumerate(self.gens)]

    async def _pump(self, index: int, gen: Generation) -> None:
        try:
            async with contextlib.aclosing(gen.pieces()) as pieces:
                async for piece in pieces:
                    self.queue.put_nowait((index, piece))
            self.queue.put_nowait((index, _END))
        except (PipespecError, TimeoutError) as exc:
            self.queue.put_nowait((index, exc))

    async def next(self) -> tuple[int, Any]:
        """The next ``(index, piece)`` or ``(index, _END)``; a choice's failure raises its error."""
        index, item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return index, item

    async def close(self) -> None:
        """Cancel every choice still running (each cancels its request on the verifier)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def outcomes(self) -> list[Outcome]:
        return [gen.outcome for gen in self.gens]


def ranked(outcomes: list[Outcome]) -> list[Outcome]:
    """The choices to answer with, in ``index`` order: all of them while ``best_of`` must equal ``n``. Where
    ``best_of > n`` is served, this is where its candidates get ranked (by the target's cumulative log probability)
    and cut to ``n``."""
    return outcomes


def usage(outcomes: list[Outcome]) -> dict[str, int]:
    """The prompt once (every choice has the same), the completion tokens of every choice summed."""
    prompt = outcomes[0].usage()["prompt_tokens"]
    completion = sum(out.usage()["completion_tokens"] for out in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def run_choices(runner: Completions, request: Request, req: CompletionRequest | ChatRequest, fmt: _Format,
                      tenant: str | None) -> Response:
    """A request with ``n`` > 1: whole, or streamed (the stream starts once every choice took its first step, so a
    refused request gets its real status)."""
    from http_server.app import ClientGone, _Stream, until_disconnect  # the app imports this module

    choices = Choices(runner, req, tenant)
    n = len(choices.gens)
    ended: set[int] = set()
    early: list[tuple[int, Any]] = []  # what came before the stream started
    try:
        started: set[int] = set()
        while len(ended if not req.stream else started) < n:
            index, item = await until_disconnect(request, choices.next())
            started.add(index)
            if item is _END:
                ended.add(index)
            early.append((index, item))
    except (PipespecError, TimeoutError) as exc:
        await choices.close()
        error = from_pipespec(exc)
        runner.metrics.record_error(error.code)
        raise error from None
    except (ClientGone, asyncio.CancelledError):
        await choices.close()
        runner.metrics.record_error("client_gone")
        raise
    rid = fmt.id_prefix + secrets.token_hex(12)
    if not req.stream:
        outs = ranked(choices.outcomes)
        body = []
        for i, out in enumerate(outs):
            runner.record(out)
            body.append({**fmt.whole(out.text, out.finish_reason), "index": i, **runner.spec_metrics(out)})
        return JSONResponse({**runner.base(fmt, rid), "object": fmt.object, "choices": body, "usage": usage(outs)})
    events = stream_events(runner, choices, early, fmt, rid, req.include_usage())
    return _Stream(sse(events), media_type="text/event-stream",
                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_events(runner: Completions, choices: Choices, early: list[tuple[int, Any]], fmt: _Format,
                        rid: str, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """The chunks of every choice as they come, each with its ``index``; each choice's own finish chunk (with its
    metrics where ``http.request_metrics`` is on); then, with ``include_usage``, one usage chunk for all."""
    head = runner.base(fmt, rid)
    extra = {"usage": None} if include_usage else {}
    n = len(choices.gens)
    finished = failed = False

    def chunk(index: int, item: Any) -> dict[str, Any] | None:
        if item is _END:
            out = choices.gens[index].outcome
            runner.record(out)
            return {**head, "choices": [{**fmt.finish(out.finish_reason), "index": index}], **extra,
                    **runner.spec_metrics(out)}
        return {**head, "choices": [{**fmt.piece(item), "index": index}], **extra} if item else None

    try:
        opening = fmt.opening()
        if opening is not None:
            for i in range(n):
                yield {**head, "choices": [{**opening, "index": i}], **extra}
        done = 0
        for index, item in early:
            done += item is _END
            if (event := chunk(index, item)) is not None:
                yield event
        while done < n:
            index, item = await choices.next()
            done += item is _END
            if (event := chunk(index, item)) is not None:
                yield event
        finished = True
        if include_usage:
            yield {**head, "choices": [], "usage": usage(choices.outcomes)}
    except (PipespecError, TimeoutError) as exc:  # after the 200: the error travels as an event
        failed = True
        error = from_pipespec(exc)
        runner.metrics.record_error(error.code)
        yield error.body()
    finally:
        if not finished:
            await choices.close()  # the caller left (or a choice failed): cancel the others on the verifier
            if not failed and any(out.result is None for out in choices.outcomes):
                runner.metrics.record_error("client_gone")
