"""One request's run on the verifier, shared by completions and chat: OpenAI fields → pipespec parameters, the
stream of committed text with stop strings applied, and what the response reports at the end (finish reason,
usage, speculative-decoding metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from http_server.logprobs import ShownLogprobs, requested
from http_server.penalties import penalty_params
from http_server.schemas import ChatRequest, CompletionRequest
from http_server.stop import StopMatcher
from runtime.client import AsyncClient, Chunk, GenerationResult, PipespecError


def generation_params(req: CompletionRequest | ChatRequest, default_max_tokens: int) -> dict[str, Any]:
    """pipespec's parameters for a request. Temperature follows OpenAI: absent means 1.0 (sampling); 0 means
    greedy (``do_sample=False``), the one setting whose output equals ``AsyncClient.generate``'s default."""
    temperature = 1.0 if req.temperature is None else req.temperature
    params: dict[str, Any] = {
        "max_new_tokens": req.max_completion_tokens or req.max_tokens or default_max_tokens,
        "do_sample": temperature > 0,
        "seed": req.seed,
    }
    if temperature > 0:
        params["temperature"] = temperature
        params["top_p"] = req.top_p
        params["top_k"] = req.top_k if req.top_k and req.top_k > 0 else None
    params.update(penalty_params(req))  # repetition / presence / frequency penalty, logit_bias, min_tokens
    spec = req.grammar_spec()
    if spec is not None:
        params["grammar"] = spec.to_wire()
    params["logprobs"] = requested(isinstance(req, ChatRequest), req.logprobs, req.top_logprobs)
    if req.speculative is not None:  # per-request speculation (docs/http.md)
        params["num_draft_tokens"] = req.speculative.num_draft_tokens
    return {k: v for k, v in params.items() if v is not None}


def prompt_inputs(req: CompletionRequest | ChatRequest) -> dict[str, Any]:
    """``prompt=`` / ``token_ids=`` / ``messages=`` for :meth:`AsyncClient.stream` (the verifier templates chat)."""
    if isinstance(req, ChatRequest):
        # tools go to the template; the HTTP server reads the calls itself (http_server.tools), after the stop
        # strings, so the client is told not to (tool_choice none) and gets any forcing grammar as `grammar`
        tools = {"tools": req.tools, "tool_choice": "none"} if req.tools else {}
        return {"messages": [m.as_template_input() for m in req.messages], **tools}
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a list of one prompt (check_supported refused longer lists)
    if isinstance(prompt, list):
        return {"token_ids": list(prompt)}
    return {"prompt": prompt}


@dataclass
class Outcome:
    """What a finished run reports."""

    text: str = ""
    finish_reason: str = "stop"
    result: GenerationResult | None = None
    ttft_s: float | None = None
    started: float = field(default_factory=time.monotonic)
    stop_tokens: int | None = None  # tokens up to the one that completed a stop string (the ones shown for)
    logprobs: ShownLogprobs | None = None  # the shown tokens' log probabilities, when the request asked

    def usage(self) -> dict[str, int]:
        m = self.result.metrics if self.result else {}
        prompt, completion = int(m.get("prompt_tokens") or 0), int(m.get("new_tokens") or 0)
        if self.stop_tokens is not None:  # not the tokens the verifier made before the cancel reached it
            completion = min(completion, self.stop_tokens) if completion else self.stop_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def metrics(self) -> dict[str, Any]:
        """pipespec's own block of the response (``metrics``): speculative decoding and timing."""
        m = self.result.metrics if self.result else {}
        return {
            "speculative_decoding": {
                "acceptance_rate": m.get("acceptance_rate"),
                "mean_accepted_length": m.get("mean_accepted_length"),
                "num_drafts": m.get("drafts"),
                "num_draft_tokens": m.get("draft_tokens"),
                "num_accepted_tokens": m.get("accepted_tokens"),
                "per_position_acceptance": m.get("per_position_acceptance"),
            },
            "time_to_first_token_s": m.get("time_to_first_token_s"),
            "elapsed_s": m.get("elapsed_s"),
            "tokens_per_second": m.get("tokens_per_second"),
            "rounds": m.get("rounds"),
            "drafter_type": m.get("drafter_type"),
        }


@contextlib.asynccontextmanager
async def _naming_draft_type(drafter_type: str | None) -> AsyncIterator[None]:
    """The verifier's refusal of an unknown ``drafter_type`` names the HTTP field it came from."""
    try:
        yield
    except PipespecError as exc:
        if drafter_type is not None and str(exc).startswith("drafter_type"):
            exc.param = "speculative.draft_type"  # type: ignore[attr-defined]  # read by errors.from_pipespec
        raise


class Generation:
    """Run one request: iterate :meth:`pieces` for the text to show (possibly empty pieces: one per verifier
    round), then read :attr:`outcome`. A stop string ends the text and cancels the request on the verifier (its
    result still comes, with the metrics of what ran); closing the iterator early cancels it too."""

    def __init__(self, client: AsyncClient, req: CompletionRequest | ChatRequest, default_max_tokens: int,
                 tenant: str | None = None):
        self.client = client
        self.tenant = tenant  # the caller's tenant (its API key's), passed on to the verifier
        self.inputs = prompt_inputs(req)
        self.params = generation_params(req, default_max_tokens)
        self.stops = StopMatcher(req.stop_strings())
        self.drafter_type = req.speculative.draft_type if req.speculative is not None else None
        self.outcome = Outcome(logprobs=ShownLogprobs() if "logprobs" in self.params else None)

    def _show(self, everything: bool = False) -> None:
        """More text is shown: release the log probabilities of the tokens that begin inside it (all of them once
        the generation ended without a stop string)."""
        lp = self.outcome.logprobs
        if lp is not None:
            lp.shown(None if everything else len(self.outcome.text))

    def take_logprobs(self) -> list | None:
        """The log probabilities shown since the last take (a streamed chunk's); None where not asked."""
        lp = self.outcome.logprobs
        return None if lp is None else lp.take()

    def all_logprobs(self) -> list | None:
        """Every shown token's log probabilities (a whole response's); None where not asked."""
        lp = self.outcome.logprobs
        return None if lp is None else lp.released

    async def pieces(self) -> AsyncIterator[str]:
        cancel = asyncio.Event()
        received = ""  # the verifier's text so far (what the stop matcher has seen)
        tokens = 0  # the verifier's tokens so far
        out = self.outcome
        stream = self.client.stream(**self.inputs, include_result=True, cancel=cancel, tenant=self.tenant,
                                    drafter_type=self.drafter_type, **self.params)
        async with contextlib.aclosing(stream), _naming_draft_type(self.drafter_type):
            async for item in stream:
                if isinstance(item, Chunk):
                    if out.ttft_s is None:
                        out.ttft_s = time.monotonic() - out.started
                    received += item.text
                    tokens += len(item.token_ids)
                    if out.logprobs is not None and item.logprobs is not None:
                        out.logprobs.add(item.logprobs)
                    piece, hit = self.stops.push(item.text)
                    if hit and out.stop_tokens is None:
                        # a chunk is a verifier round's tokens: counted whole (the stop may end inside it)
                        out.stop_tokens = tokens
                        cancel.set()  # the next step of the stream sends the cancel and waits for the result
                    out.text += piece
                    self._show()
                    yield piece
                else:
                    out.result = item
        result = out.result
        if self.stops.matched is not None:
            out.finish_reason = "stop"
            return
        # the stream holds back a trailing half character: the final text has all of it
        tail = result.text[len(received):] if result.text.startswith(received) else ""
        piece, hit = self.stops.push(tail)
        if hit:
            out.stop_tokens = len(result.token_ids)
        piece += "" if hit else self.stops.flush()
        out.text += piece
        self._show(everything=not hit)
        out.finish_reason = "stop" if hit or result.finish_reason == "stop" else result.finish_reason
        if piece:
            yield piece
