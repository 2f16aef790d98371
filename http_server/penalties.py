"""OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``, pipespec's ``repetition_penalty`` and
vLLM's ``min_tokens`` over HTTP: their check (a 400 naming the field) and their pipespec parameters.

The ranges are :mod:`shared.penalties`'s (the verifier checks them again, with the vocabulary: a ``logit_bias`` id
outside it comes back as the verifier's ``bad_request``, which :func:`http_server.errors.param_of` names).
``logit_bias`` keys arrive as JSON object keys, so as text: each must be a token id's decimal digits.
"""

from __future__ import annotations

from typing import Any

from http_server.errors import bad_request
from shared.penalties import check_penalties


def check_penalty_fields(req: Any) -> None:
    """A 400 naming ``presence_penalty``, ``frequency_penalty`` or ``logit_bias`` where one is out of range or
    malformed (the schema has already checked the penalties' types and ranges; this catches the bias map)."""
    problem = check_penalties(req.presence_penalty or 0.0, req.frequency_penalty or 0.0, req.logit_bias or {})
    if problem:
        raise bad_request(problem, param=problem.split(" ", 1)[0], code="invalid_value")


def penalty_params(req: Any) -> dict[str, Any]:
    """The request's penalties, bias and minimum length as pipespec parameters (absent ones left out)."""
    params: dict[str, Any] = {
        "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "logit_bias": dict(req.logit_bias) if req.logit_bias else None,
        "min_new_tokens": req.min_tokens,
    }
    return {k: v for k, v in params.items() if v is not None}
