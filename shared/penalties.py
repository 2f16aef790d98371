"""OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``: their checks and how they change a row of
scores, for :func:`shared.sampling.process_logits` (the one logits processing of the verifier and every drafter).

Semantics (OpenAI's): over the tokens generated so far — the prompt excluded — ``presence_penalty`` is subtracted
once from the score of every token that occurred, ``frequency_penalty`` × its count; ``logit_bias`` maps a token id
to a bias added to its score. Both penalties lie in [-2, 2] (a negative one favours repeats), a bias in
[-100, 100] (-100 in practice bans a token, 100 forces it), with at most :data:`MAX_LOGIT_BIAS_ENTRIES` entries.

Where they run, in the order transformers' ``generate`` would run them if they were passed as
``logits_processor=[presence, frequency, bias]``: after its built-in processors (repetition penalty, min new tokens),
before the grammar mask (which sits where such a list runs too; -inf stays -inf under any bias) and before the
warpers (temperature, top-k, top-p). Additions commute with each other and with -inf masks, so of that order only
"repetition penalty first" changes a score.

This module imports nothing of pipespec's own, so :mod:`shared.sampling` can import it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # |a logit_bias value| (OpenAI's range)
#: logit_bias entries a request may carry: each costs a scatter per processed row (OpenAI allows 300; a grammar of
#: banned tokens belongs in a grammar or stop_token_ids, not in a bias map).
MAX_LOGIT_BIAS_ENTRIES = 1024
_MAX_TOKEN_ID = 2**31 - 1


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_key(key: Any) -> int | None:
    """A logit_bias key as a token id: an int, or its decimal text (JSON object keys are strings); else None."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        return int(key)
    return None


def check_penalties(presence: Any, frequency: Any, logit_bias: Any, vocab_size: int | None = None) -> str | None:
    """What is wrong with the three parameters (a message naming the field), or None when they are valid."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not _is_num(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            return f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {value!r}"
    if not isinstance(logit_bias, dict):
        return f"logit_bias must be a map of token id to bias, got {type(logit_bias).__name__}"
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        return f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(logit_bias)}"
    seen: set[int] = set()
    for key, value in logit_bias.items():
        token = _token_key(key)
        if token is None or token > _MAX_TOKEN_ID:
            return f"logit_bias keys must be token ids (non-negative integers), got {key!r}"
        if vocab_size is not None and token >= vocab_size:
            return f"logit_bias token id {token} is outside the vocabulary (size {vocab_size})"
        if token in seen:
            return f"logit_bias names token id {token} twice"
        seen.add(token)
        if not _is_num(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            return f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r} " \
                   f"for token {key!r}"
    return None


def canonical_bias(logit_bias: dict[Any, Any]) -> dict[str, float]:
    """A checked logit_bias in its wire form: decimal-text keys (msgpack maps here take text keys only, as JSON's
    do), float values, zero biases dropped (they change nothing)."""
    return {str(_token_key(k)): float(v) for k, v in sorted(logit_bias.items(), key=lambda kv: _token_key(kv[0]))
            if v != 0}


def reads_context(presence: float, frequency: float) -> bool:
    """Whether the penalties read the generated tokens (the caller then passes them in the context)."""
    return presence != 0.0 or frequency != 0.0


def bias_tensors(logit_bias: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The bias map as (token ids, float32 biases), ids ascending, for one ``index_add_`` per row."""
    items = sorted((int(k), float(v)) for k, v in logit_bias.items())
    ids = torch.tensor([k for k, _ in items], dtype=torch.long)
    values = torch.tensor([v for _, v in items], dtype=torch.float32)
    return ids, values


def apply_penalties(scores: torch.Tensor, context: torch.Tensor, num_generated: int, presence: float,
                    frequency: float, bias: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``scores`` (float32, one row) with the penalties over the generated tokens and the bias applied, in place.

    ``context`` ends with the ``num_generated`` generated tokens (whatever precedes them — the prompt, or nothing
    where the caller kept the copy short — is not read); ids beyond the row (a drafter row cut to its own
    vocabulary) are not counted. ``bias``: :func:`bias_tensors` of the map (ids beyond the row are skipped)."""
    if reads_context(presence, frequency) and num_generated > 0 and context.numel():
        generated = context[max(context.numel() - num_generated, 0):].to(scores.device)
        generated = generated[generated < scores.numel()]
        counts = torch.zeros_like(scores).index_add_(0, generated, torch.ones_like(generated, dtype=scores.dtype))
        if presence != 0.0:
            scores -= presence * (counts > 0).to(scores.dtype)
        if frequency != 0.0:
            scores -= frequency * counts
    if bias is not None and bias[0].numel():
        ids, values = bias
        if int(ids[-1]) >= scores.numel():  # ids are sorted; a row narrower than the verifier's vocabulary (a
            keep = ids < scores.numel()  # drafter's) takes the ids it has rather than failing the session
            ids, values = ids[keep], values[keep]
        scores.index_add_(0, ids.to(scores.device), values.to(scores.device))
    return scores
