"""Generation parameters and logits processing, one implementation for both sides.

The verifier and every drafter turn raw logits into the distribution they sample from with the same code, so the
draft distribution q and the target distribution p are comparable and the acceptance rule stays exact. Order and
semantics follow transformers' ``generate``: processors apply in greedy and sampling, in this order — its built-in
ones (repetition penalty, min new tokens), then what would be a ``logits_processor=`` list (presence and frequency
penalty, logit bias: :mod:`shared.penalties`; the grammar mask); warpers (temperature, top-k, top-p) only when
sampling, last.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from shared.penalties import apply_penalties, bias_tensors, canonical_bias, check_penalties, reads_context


class ParamError(ValueError):
    """A request parameter that is out of range or of the wrong type (reported to the client, nothing crashes)."""


# Bounds that keep the processed scores finite in float32 (scores are processed in float32 whatever the model's
# dtype): a logit of a real model is far below 1e4 in magnitude, and temperature and repetition penalty scale it by at
# most 1 / MIN each, so |score| stays below 1e8 (float32 overflows at 3.4e38). Documented in docs/client.md
# ("Generation parameters").
MIN_TEMPERATURE = 1e-2  # when sampling; a greedy request ignores temperature (any finite value > 0 is accepted)
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 100.0
MAX_NEW_TOKENS = 1_000_000
#: Longest draft block (the protocol's ``draft.tokens``) a verifier accepts; ``drafter.num_draft_tokens``,
#: ``drafter.max_draft_tokens`` and a request's ``num_draft_tokens`` are capped by it (shared.protocol re-exports it).
MAX_DRAFT_TOKENS = 64
MAX_TOP_K = 2**31 - 1
MAX_TOKEN_ID = 2**31 - 1  # token ids fit an int32 whatever the vocabulary
MAX_END_TOKENS = 1024  # eos_token_ids / stop_token_ids entries
#: Structured output (``GenerationParams.grammar``): the kinds, and the longest spec text a request may carry (a
#: compile costs time on the verifier's loop; real schemas are a few KB).
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
#: ``GenerationParams.logprobs``: the most alternatives (top-N) a request may ask for per token (OpenAI's chat bound).
MAX_TOP_LOGPROBS = 20
#: Parameters only the verifier reads: left out of what drafters receive (``GenerationParams.for_drafter``).
VERIFIER_ONLY_PARAMS = ("logprobs",)
_NO_CONTEXT = torch.empty(0, dtype=torch.long)  # GenerationParams.context where no processor reads one


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint: ``kind`` (one of :data:`GRAMMAR_KINDS`) and its text ``value`` — a JSON
    schema as JSON text, nothing for ``json_object``, a regex, an EBNF grammar, or a JSON list of strings for
    ``choice``. ``strict`` (json_schema only; OpenAI's ``json_schema.strict``): True, no properties or items the
    schema does not name; False, JSON Schema's own defaults (``additionalProperties`` absent allows any). The
    verifier compiles it with xgrammar (:mod:`verifier_node.grammar`)."""

    kind: str
    value: str = ""
    strict: bool = True

    @classmethod
    def from_wire(cls, data: Any) -> GrammarSpec:
        """Check the ``grammar`` parameter (``{"kind", "value"}``): the shape and size only; the engine judges the
        content when the verifier compiles it."""
        if not isinstance(data, dict) or set(data) - {"kind", "value", "strict"} or "kind" not in data:
            raise ParamError('grammar must be {"kind": ..., "value": ..., "strict": true or false (optional)}')
        kind, value, strict = data["kind"], data.get("value", ""), data.get("strict", True)
        if kind not in GRAMMAR_KINDS:
            raise ParamError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise ParamError(f"grammar value must be a string (a JSON schema as JSON text for json_schema), got "
                             f"{type(value).__name__}")
        if len(value) > MAX_GRAMMAR_CHARS:
            raise ParamError(f"grammar value is {len(value)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
        if kind != "json_object" and not value:
            raise ParamError(f"grammar kind {kind} needs a non-empty value")
        if not isinstance(strict, bool):
            raise ParamError(f"grammar strict must be true or false, got {strict!r}")
        if not strict and kind != "json_schema":
            raise ParamError(f"grammar strict=false applies to json_schema only, not {kind}")
        if kind == "choice":
            try:
                choices = json.loads(value)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and 0 < len(choices) <= MAX_CHOICES
                    and all(isinstance(c, str) and c for c in choices)):
                raise ParamError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            for c in choices:
                if not _is_unicode(c):
                    raise ParamError(f"choice {c!r} is not valid Unicode text (a lone surrogate escape)")
        return cls(kind, value, strict)

    def to_wire(self) -> dict[str, Any]:
        """The wire form; ``strict`` only when false (the default), so a plain spec reads as before."""
        return {"kind": self.kind, "value": self.value, **({} if self.strict else {"strict": False})}


def _is_unicode(text: str) -> bool:
    """No lone surrogate (JSON's ``\\ud83d`` without its pair): the text has a UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def structured_output(
    response_format: Any = None, json_schema: Any = None, regex: str | None = None, grammar: str | None = None,
    choice: list[str] | None = None,
) -> GrammarSpec | None:
    """The one constraint a request asks for, from the names the client and the HTTP API take (OpenAI's
    ``response_format``, vLLM's ``json`` / ``regex`` / ``grammar`` / ``choice``); None for none or
    ``{"type": "text"}``. More than one constraint, or a malformed one, raises :class:`ParamError`."""
    given = []
    if response_format is not None:
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise ParamError('response_format must be an object with a "type" (text, json_object or json_schema)')
        kind = response_format["type"]
        if kind == "json_object":
            given.append(GrammarSpec("json_object"))
        elif kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), (dict, bool)):
                raise ParamError('response_format of type json_schema needs "json_schema": {"name": ..., '
                                 '"schema": {...}}')
            strict = inner.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise ParamError(f"response_format json_schema.strict must be true or false, got {strict!r}")
            # strict absent or null: strict, as pipespec always compiled (OpenAI's default is false, which leaves
            # the output unconstrained there; here a schema is always enforced, strict=false only relaxes it)
            given.append(_schema_spec(inner["schema"], strict is not False))
        elif kind != "text":
            raise ParamError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    if json_schema is not None:
        given.append(_schema_spec(json_schema))
    if regex is not None:
        given.append(GrammarSpec.from_wire({"kind": "regex", "value": regex}))
    if grammar is not None:
        given.append(GrammarSpec.from_wire({"kind": "grammar", "value": grammar}))
    if choice is not None:
        if not isinstance(choice, list):
            raise ParamError("choice must be a list of strings")
        given.append(GrammarSpec.from_wire({"kind": "choice", "value": json.dumps(choice)}))
    if len(given) > 1:
        raise ParamError(f"give at most one output constraint (response_format, json schema, regex, grammar or "
                         f"choice), got {len(given)}: {', '.join(g.kind for g in given)}")
    return given[0] if given else None


def _schema_spec(schema: Any, strict: bool = True) -> GrammarSpec:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(schema, str):
        return GrammarSpec.from_wire({"kind": "json_schema", "value": schema, "strict": strict})
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ParamError(f"the JSON schema is not JSON: {exc}") from None
    return GrammarSpec.from_wire({"kind": "json_schema", "value": text, "strict": strict})


@dataclass
class GenerationParams:
    """Per-request generation parameters (the same names as transformers' ``generate``)."""

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    grammar: dict[str, Any] | None = None  # structured output: GrammarSpec.to_wire(); the verifier compiles it
    # OpenAI's penalties over the generated tokens and its logit_bias (token id as decimal text -> bias), see
    # shared.penalties; 0 / empty: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] = field(default_factory=dict)
    # None: no log probabilities; N: each committed token's log-probability under the target's processed scores and
    # its N most likely alternatives (verifier_node.logprobs)
    logprobs: int | None = None
    # per-request speculation (HTTP ``speculative.num_draft_tokens``): 0 = the target alone, k ≥ 1 caps each draft
    # block at k (the verifier cuts longer ones, losslessly; drafters plan within it); None: the drafter's own
    num_draft_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], vocab_size: int | None = None) -> GenerationParams:
        """Build and validate from a client's dict; unknown names and bad values raise :class:`ParamError`."""
        if not isinstance(data, dict):
            raise ParamError("params must be a mapping")
        names = {f.name for f in fields(cls)}
        unknown = sorted(repr(k) if not isinstance(k, str) else k for k in set(data) - names)  # keys may be bytes
        if unknown:
            raise ParamError(f"unknown generation parameter(s): {', '.join(unknown)}")
        params = cls(**{k: v for k, v in data.items() if v is not None or k == "seed"})
        params.validate(vocab_size)
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ParamError(f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens!r}")
        if not isinstance(self.do_sample, bool):
            raise ParamError(f"do_sample must be true or false, got {self.do_sample!r}")
        if not is_num(self.temperature) or self.temperature <= 0:
            raise ParamError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if self.do_sample and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ParamError(f"temperature must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] when sampling (lower "
                             f"values overflow the scores; use do_sample=false for greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ParamError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 = off), got {self.top_k!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_num(self.repetition_penalty) or not (
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise ParamError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] "
                             f"(1 = off), got {self.repetition_penalty!r}")
        if not is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= MAX_NEW_TOKENS:
            raise ParamError(f"min_new_tokens must be an integer in [0, {MAX_NEW_TOKENS}], got {self.min_new_tokens!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ParamError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        for name in ("eos_token_ids", "stop_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, list) or not all(is_int(i) and 0 <= i <= MAX_TOKEN_ID for i in ids):
                raise ParamError(f"{name} must be a list of token ids (integers in [0, {MAX_TOKEN_ID}])")
            if len(ids) > MAX_END_TOKENS:
                raise ParamError(f"{name} may hold at most {MAX_END_TOKENS} ids, got {len(ids)}")
            if vocab_size is not None and any(i >= vocab_size for i in ids):
                raise ParamError(f"{name} has an id outside the vocabulary (size {vocab_size})")
        problem = check_penalties(self.presence_penalty, self.frequency_penalty, self.logit_bias, vocab_size)
        if problem:
            raise ParamError(problem)
        self.logit_bias = canonical_bias(self.logit_bias)  # text keys whether the caller gave ints or text
        if vocab_size is not None and self.min_new_tokens and len(set(self.eos_token_ids)) >= vocab_size:
            raise ParamError("min_new_tokens with every token an eos_token_id leaves no token to generate")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ParamError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token) or "
                             f"null (off), got {self.logprobs!r}")
        if self.num_draft_tokens is not None and (
                not is_int(self.num_draft_tokens) or not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS):
            raise ParamError(f"num_draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}] (0: no speculation), "
                             f"got {self.num_draft_tokens!r}")
        if self.grammar is not None:
            GrammarSpec.from_wire(self.grammar)
            if not self.eos_token_ids and not self.stop_token_ids:
                raise ParamError("a grammar needs an end token (eos_token_ids or stop_token_ids may not both be "
                                 "empty): the grammar allows it where the output is complete")
            if self.min_new_tokens:
                # a complete output allows only end tokens, which min_new_tokens forbids: nothing would be left
                raise ParamError("min_new_tokens cannot be combined with a grammar (response_format, regex, ...)")

    @property
    def needs_context(self) -> bool:
        """Whether a processor reads the tokens before the predicted position (the callers build that tensor only
        then: a copy of the whole sequence per row)."""
        return self.repetition_penalty != 1.0 or reads_context(self.presence_penalty, self.frequency_penalty)

    def context(self, tokens: list[int], prompt_len: int) -> torch.Tensor:
        """What the processors read of ``tokens`` (the whole sequence, its first ``prompt_len`` the prompt), as the
        ``context`` of :func:`process_logits`: all of it for a repetition penalty, the generated tokens alone for
        presence / frequency penalties, nothing otherwise (an O(length) copy per call is made only when read)."""
        if self.repetition_penalty != 1.0:
            return torch.tensor(tokens, dtype=torch.long)
        if self.needs_context:
            return torch.tensor(tokens[prompt_len:], dtype=torch.long)
        return _NO_CONTEXT

    @property
    def changes_logits(self) -> bool:
        """Whether a processor other than min_new_tokens and the warpers changes a greedy row."""
        return self.needs_context or bool(self.logit_bias)

    def bias(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``logit_bias`` as (ids, biases) tensors, built once per request (None: no bias)."""
        if not self.logit_bias:
            return None
        cached = self.__dict__.get("_bias")
        if cached is None or cached[0] is not self.logit_bias:  # a new map (replace(), validate()): build again
            cached = (self.logit_bias, bias_tensors(self.logit_bias))
            self.__dict__["_bias"] = cached
        return cached[1]

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        return GrammarSpec.from_wire(self.grammar) if self.grammar is not None else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def for_drafter(self) -> dict[str, Any]:
        """:meth:`to_dict` less what only the verifier reads (a drafter of an older version need not know it)."""
        return {k: v for k, v in asdict(self).items() if k not in VERIFIER_ONLY_PARAMS}

    @property
    def end_token_ids(self) -> set[int]:
        return set(self.eos_token_ids) | set(self.stop_token_ids)


def process_logits(
    logits: torch.Tensor, context: torch.Tensor, params: GenerationParams, num_generated: int,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn one row of raw logits into processed float32 scores (``-inf`` for excluded tokens).

    ``context`` holds every token before the predicted position (prompt and generated), as transformers'
    ``input_ids`` would (where no repetition penalty reads it, the generated tokens alone or nothing do: presence
    and frequency penalty read its last ``num_generated``); ``num_generated`` is how many new tokens precede the
    predicted one. ``allowed`` (bool, one per logit): a grammar's mask, applied after the processors and before the
    warpers — where transformers runs a ``logits_processor=`` passed to ``generate`` (so top-k and top-p choose
    among allowed tokens).
    """
    scores = logits.float().clone()
    if params.repetition_penalty != 1.0 and context.numel():
        ids = context.to(scores.device)
        picked = scores.gather(0, ids)
        picked = torch.where(picked < 0, picked * params.repetition_penalty, picked / params.repetition_penalty)
        scores.scatter_(0, ids, picked)
    if num_generated < params.min_new_tokens and params.eos_token_ids:
        scores[torch.tensor(params.eos_token_ids, device=scores.device)] = -math.inf
    # where transformers runs a logits_processor= list: presence, frequency, bias (then the grammar mask)
    scores = apply_penalties(scores, context, num_generated, params.presence_penalty, params.frequency_penalty,
                             params.bias())
    if allowed is not None:
        scores = scores.masked_fill(~allowed.to(scores.device), -math.inf)
    if not params.do_sample:
        return scores
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[-1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(0, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def process_block(
    logits: torch.Tensor, prefix: torch.Tensor, block: torch.Tensor, params: GenerationParams, num_generated: int,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Process ``logits[i]`` (rows predicting the token after ``prefix + block[:i]``) for every row i; ``allowed``:
    a grammar's mask row per logits row."""
    rows = []
    needs_context = params.needs_context  # repetition, presence and frequency penalty read the context
    for i in range(logits.shape[0]):
        context = torch.cat([prefix, block[:i]]) if i and needs_context else prefix
        rows.append(process_logits(logits[i], context, params, num_generated + i,
                                   allowed[i] if allowed is not None else None))
    return torch.stack(rows)


def make_generator(seed: int, position: int, stream: int) -> torch.Generator:
    """A generator for one decision point, so a seeded request reproduces whatever order rounds run in.

    ``position`` is the committed length the decision is made at; ``stream`` separates users of the same position
    (0: verifier acceptance, 1: drafter sampling), so the draft and the acceptance draw independent numbers.
    """
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a probability row."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator).item())
