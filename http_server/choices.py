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
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from http_server.errors import from_pipespec
from http_server.generation import Generation, Outcome
from http_server.metrics import HttpMetrics
from http_server.responses import ChoiceFormat, ChoiceOutput, Stream, failing_as_http, until_disconnect
from http_server.schemas import ChatRequest, CompletionRequest
from http_server.sse import sse
from http_server.tools import ToolPlan
from runtime.client import AsyncClient, PipespecError
from shared.choices import choice_seed


class Completions(Protocol):
    """What the choices need of the app's runner (``http_server.app.Completions``, which imports this module)."""

    client: AsyncClient
    default_max_tokens: int
    metrics: HttpMetrics

    def record(self, out: Outcome) -> None: ...
    def base(self, fmt: ChoiceFormat, rid: str) -> dict[str, Any]: ...
    def spec_metrics(self, out: Outcome) -> dict[str, Any]: ...

#: Put in the queue by a choice that ended (after its last piece).
_END = object()


class Choices:
    """The ``n`` runs of one request: each pumps its pieces into one queue as ``(index, piece | _END | error)``."""

    def __init__(self, runner: Completions, req: CompletionRequest | ChatRequest, tenant: str | None,
                 fmt: ChoiceFormat, plan: ToolPlan | None):
        self.outputs: list[ChoiceOutput] = []
        candidates = max(req.n or 1, req.best_of or 1)
        for i in range(candidates):
            gen = Generation(runner.client, req, runner.default_max_tokens, tenant)
            seed = choice_seed(req.seed, i)
            if seed is not None:  # unseeded: the verifier draws each choice's seed on its own
                gen.params["seed"] = seed
            if candidates > (req.n or 1):
                # best_of ranks by the target's log probabilities: asked for even where the caller did not (then
                # nothing shows them: the generation's shown log probabilities stay off)
                gen.params.setdefault("logprobs", 0)
            self.outputs.append(ChoiceOutput(gen, fmt, plan, i))
        # unbounded, but at most the choices' own text: a stalled reader is cut by http.send_timeout_s
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._pump(i, gen)) for i, gen in enumerate(self.generations)]

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
    def generations(self) -> list[Generation]:
        return [output.gen for output in self.outputs]

    @property
    def outcomes(self) -> list[Outcome]:
        return [output.gen.outcome for output in self.outputs]


def mean_logprob(out: Outcome) -> float:
    """A candidate's score for ``best_of``: the mean log probability per token of its output under the target's
    processed scores (OpenAI: "the highest log probability per token"); an empty output scores 0."""
    entries = (out.result.logprobs if out.result is not None else None) or []
    return sum(e.logprob for e in entries) / len(entries) if entries else 0.0


def ranked(outputs: list[ChoiceOutput], n: int) -> list[ChoiceOutput]:
    """The ``n`` choices to answer with: all of them where ``best_of`` is ``n``; else the ``n`` candidates of highest
    :func:`mean_logprob` (ties: the earlier candidate), best first, renumbered 0..n-1."""
    if len(outputs) == n:
        return outputs
    best = sorted(outputs, key=lambda o: -mean_logprob(o.gen.outcome))[:n]
    for i, output in enumerate(best):
        output.index = i
    return best


def usage(outcomes: list[Outcome]) -> dict[str, int]:
    """The prompt once (every choice has the same), the completion tokens of every choice summed."""
    prompt = outcomes[0].usage()["prompt_tokens"]
    completion = sum(out.usage()["completion_tokens"] for out in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def run_choices(runner: Completions, request: Request, req: CompletionRequest | ChatRequest,
                      fmt: ChoiceFormat, tenant: str | None, plan: ToolPlan | None = None) -> Response:
    """A request with ``n`` > 1 (or ``best_of`` > 1): whole, or streamed (the stream starts once every choice took its
    first step, so a refused request gets its real status)."""
    choices = Choices(runner, req, tenant, fmt, plan)
    n = len(choices.outputs)
    ended: set[int] = set()
    early: list[tuple[int, Any]] = []  # what came before the stream started
    async with failing_as_http(runner.metrics, choices.close):
        started: set[int] = set()
        while len(ended if not req.stream else started) < n:
            index, item = await until_disconnect(request, choices.next())
            started.add(index)
            if item is _END:
                ended.add(index)
            early.append((index, item))
    rid = fmt.id_prefix + secrets.token_hex(12)
    if not req.stream:
        for out in choices.outcomes:
            runner.record(out)
        body = [{**output.whole(), **runner.spec_metrics(output.gen.outcome)}
                for output in ranked(choices.outputs, req.n or 1)]
        # usage counts every candidate generated (best_of's too), as OpenAI bills them
        return JSONResponse({**runner.base(fmt, rid), "object": fmt.object, "choices": body,
                             "usage": usage(choices.outcomes)})
    events = stream_events(runner, choices, early, fmt, rid, req.include_usage())
    return Stream(sse(events), media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_events(runner: Completions, choices: Choices, early: list[tuple[int, Any]], fmt: ChoiceFormat,
                        rid: str, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """The chunks of every choice as they come, each with its ``index``; each choice's own finish chunk (with its
    metrics where ``http.request_metrics`` is on); then, with ``include_usage``, one usage chunk for all."""
    head = runner.base(fmt, rid)
    extra = {"usage": None} if include_usage else {}
    n = len(choices.outputs)
    finished = failed = False

    def chunks(index: int, item: Any) -> list[dict[str, Any]]:
        output = choices.outputs[index]
        if item is not _END:
            return [{**head, "choices": [choice], **extra} for choice in output.pieces(item)]
        out = output.gen.outcome
        runner.record(out)
        *held, last = output.closing()
        return [*({**head, "choices": [choice], **extra} for choice in held),
                {**head, "choices": [last], **extra, **runner.spec_metrics(out)}]

    try:
        for output in choices.outputs:
            opening = output.opening()
            if opening is not None:
                yield {**head, "choices": [opening], **extra}
        done = 0
        for index, item in early:
            done += item is _END
            for event in chunks(index, item):
                yield event
        while done < n:
            index, item = await choices.next()
            done += item is _END
            for event in chunks(index, item):
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
