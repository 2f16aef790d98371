"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (pydantic), and the check that turns the
OpenAI fields pipespec does not implement into a 400 instead of silently ignoring them.

Field policy (documented in docs/http.md):

- implemented: ``model``, ``prompt`` / ``messages`` (a message's ``name`` goes to the chat template),
  ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
  ``stream_options.include_usage``, and pipespec's own ``top_k`` and ``repetition_penalty``;
- tool calling on chat (:mod:`http_server.tools`): ``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant
  turns' ``tool_calls`` and ``tool`` turns (``tool_call_id``); the legacy ``functions`` / ``function_call`` are a 400;
- penalties and bias (http_server/penalties.py): ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and
  vLLM's ``min_tokens``;
- log probabilities of the target (http_server.logprobs): chat ``logprobs`` + ``top_logprobs`` (0..20), completions
  ``logprobs`` (0..20);
- structured output, one constraint per request: ``response_format`` (``text``, ``json_object``, ``json_schema``
  with its ``strict``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``grammar``, ``choice``) and its older
  ``guided_json``, ``guided_regex``, ``guided_grammar``, ``guided_choice``; not together with ``stop``;
- several answers: ``n`` (1 .. ``shared.choices.MAX_N``) and, on completions, ``best_of`` (n .. MAX_N, ranked);
  pipespec's own ``speculative`` (``num_draft_tokens``, ``draft_type``): this request's speculation;
- accepted when they ask for nothing (their default): ``echo: false``; accepted and ignored:
  ``user``, ``metadata``, ``store``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``;
- anything else — a known OpenAI field pipespec lacks (``suffix``, ``functions``, …) or an unknown name (a typo) — is a
  400 naming the field (``tools`` on ``/v1/completions`` too): a request is never served with part of it dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from http_server.errors import bad_request
from http_server.logprobs import requested as requested_logprobs
from http_server.penalties import check_penalty_fields
from shared.choices import MAX_N
from shared.penalties import MAX_PENALTY
from shared.protocol import MAX_DRAFT_TOKENS
from shared.sampling import (
    MAX_NEW_TOKENS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    GrammarSpec,
    ParamError,
    structured_output,
)

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_MESSAGES = 4096

Tokens = Annotated[StrictInt, Field(ge=1, le=MAX_NEW_TOKENS)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31)]

#: Fields accepted and ignored: bookkeeping of the caller's own (``user``, ``metadata``, ``safety_identifier``), and
#: hints for OpenAI's own services that have nothing to act on here (``store``, ``service_tier``, ``prompt_cache_key``:
#: pipespec keeps no responses, has one tier and no cross-request prompt cache to route to); docs/http.md's table.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class Speculative(BaseModel):
    """pipespec's ``speculative`` field: this request's speculation (``num_draft_tokens`` 0: the target alone, k ≥ 1:
    blocks of at most k tokens; ``draft_type``: only a drafter of that type serves it)."""

    model_config = ConfigDict(extra="forbid")

    num_draft_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_DRAFT_TOKENS)] | None = None
    draft_type: Annotated[str, Field(min_length=1, max_length=64)] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object (the subset pipespec serves)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


class _Request(BaseModel):
    """What completions and chat share. Extra fields are kept (``extra="allow"``) so :func:`check_supported` can
    name them in a 400 rather than pydantic's generic message."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, max_length=1024)
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, lt=2**31)] | None = None  # -1 and 0: off (-1 as in vLLM)
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                               allow_inf_nan=False)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None  # several answers (http_server/choices.py)
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None  # completions, >= n (check_best_of)
    speculative: Speculative | None = None
    # OpenAI fields accepted only at the value that asks for nothing (checked in check_supported)
    echo: StrictBool | None = None
    logprobs: Any = None  # checked in check_supported (http_server.logprobs.requested)
    top_logprobs: Any = None
    # penalties and bias (http_server/penalties.py; logit_bias's keys and values checked in check_supported)
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)] | None = None
    logit_bias: dict[str, Any] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_NEW_TOKENS)] | None = None  # vLLM's name: min_new_tokens
    # structured output (one constraint at most; see grammar_spec)
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's output constraint (None: free text); two constraints or a malformed one: a 400."""
        so = self.structured_outputs
        named = {
            "response_format": self.response_format,
            "structured_outputs.json": so.json_ if so else None, "structured_outputs.regex": so.regex if so else None,
            "structured_outputs.grammar": so.grammar if so else None,
            "structured_outputs.choice": so.choice if so else None,
            "guided_json": self.guided_json, "guided_regex": self.guided_regex,
            "guided_grammar": self.guided_grammar, "guided_choice": self.guided_choice,
        }
        given = {k: v for k, v in named.items() if v is not None}
        if self.response_format is not None and self.response_format.get("type", "text") == "text":
            given.pop("response_format")
        if len(given) > 1:
            raise bad_request(f"give at most one output constraint, got {', '.join(given)}", param=sorted(given)[1],
                              code="invalid_value")
        if not given:
            return None
        (name, value), = given.items()
        kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
        try:
            if kind == "response_format":
                return structured_output(response_format=value)
            return structured_output(**{"json_schema" if kind == "json" else kind: value})
        except ParamError as exc:
            raise bad_request(str(exc), param=name, code="invalid_value") from None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    # one prompt: text, or token ids; a list of several prompts is refused (n > 1 alike) in check_supported
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    # tool use (shapes checked by shared.chat_tools, as the verifier checks them)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """``{role, content}`` and ``name`` when given, for the target's chat template (text parts joined;
        ``developer`` is a system turn, which every template knows; a template that uses no ``name`` ignores it);
        an assistant turn's ``tool_calls`` (its content stays null when it is) and a tool turn's ``tool_call_id``."""
        parts = self.content if isinstance(self.content, list) else [TextPart(type="text", text=self.content or "")]
        text = "".join(part.text for part in parts)
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            turn["name"] = self.name
        if self.tool_calls is not None:
            turn["tool_calls"] = self.tool_calls
            if self.content is None:
                turn["content"] = None
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    # tool calling (checked and planned in http_server.tools)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None


#: field → the value that asks for nothing (a request may send it; any other value is a 400)
_ONLY_DEFAULT: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
}


def check_best_of(req: _Request) -> None:
    """``best_of`` (completions): at least ``n`` candidates, the ``n`` of highest log probability per token returned
    (http_server/choices.py); not streamed, as OpenAI has it (candidates are ranked once all are done)."""
    if req.best_of is None or req.best_of == 1:
        return
    if not isinstance(req, CompletionRequest):
        raise bad_request(f"best_of={req.best_of} is not supported on chat completions (a completions field)",
                          param="best_of", code="unsupported_parameter")
    if req.best_of < (req.n or 1):
        raise bad_request(f"best_of ({req.best_of}) must be at least n ({req.n or 1})", param="best_of",
                          code="invalid_value")
    if req.stream and req.best_of > (req.n or 1):
        raise bad_request("best_of greater than n cannot be streamed (its candidates are ranked once all are done)",
                          param="best_of", code="invalid_value")


def check_supported(req: _Request) -> None:
    """Raise a 400 (OpenAI-shaped, ``param`` naming the field) for anything pipespec would otherwise ignore."""
    for name, allowed in _ONLY_DEFAULT.items():
        value = getattr(req, name)
        if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
            raise bad_request(f"{name}={value!r} is not supported by pipespec (only {allowed[-1]!r})", param=name,
                              code="unsupported_parameter")
    check_penalty_fields(req)
    requested_logprobs(isinstance(req, ChatRequest), req.logprobs, req.top_logprobs)  # a bad value: a 400
    check_best_of(req)
    spec = req.grammar_spec()  # a malformed or doubled constraint is a 400 before anything runs
    if spec is not None and req.stop_strings():
        # A stop string cuts the text wherever it appears, so the output would end short of what the constraint
        # asks for while finish_reason says "stop" (complete): refused rather than served broken.
        raise bad_request(f"stop cannot be combined with an output constraint ({spec.kind}): a stop string would cut "
                          "the constrained text short of what the constraint asks for; put the end into the schema, "
                          "regex or grammar instead", param="stop", code="invalid_value")
    for name in sorted(set(req.model_extra or {}) - IGNORED_FIELDS):
        raise bad_request(f"{name} is not supported by pipespec (unknown or unimplemented field)", param=name,
                          code="unsupported_parameter")
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list) and req.prompt \
            and isinstance(req.prompt[0], (str, list)) and len(req.prompt) != 1:
        raise bad_request("one prompt per request (a list of several prompts is not supported)", param="prompt",
                          code="unsupported_parameter")
