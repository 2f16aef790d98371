"""Acceptance rules: which drafted tokens the target keeps, and the token it adds itself.

Both rules are lossless (Leviathan et al. 2023, Chen et al. 2023):

* greedy: keep the longest prefix of the draft that equals the target's argmax, then emit the target's argmax at
  the first mismatch (the correction) or after the last draft (the bonus);
* sampling: keep draft token x with probability min(1, p(x)/q(x)); on the first rejection sample from
  norm(max(p − q, 0)); when all are kept, sample the bonus from p.

Static ensemble verification (``ensemble_weight`` w in (0, 1), DIVERSE / transformers'
``assistant_ensemble_weight``) verifies against v = w·p + (1 − w)·q instead of p, where q is the draft
distribution the drafter sent. It is lossy by design: the output distribution is v, not p.

* greedy: keep the longest prefix of the draft that equals argmax v, emit argmax v at the first mismatch and
  argmax p for the bonus (there is no q past the last draft);
* sampling: keep x with probability min(1, v(x)/q(x)) = min(1, 1 − w + w·p(x)/q(x)); on rejection sample from
  norm(max(v − q, 0)) = norm(max(p − q, 0)) (v − q = w·(p − q)), falling back to p when that is zero; bonus from p.

Every function takes processed scores (see :mod:`shared.sampling`) with one row per drafted position plus one for
the bonus, and returns the committed tokens: n accepted drafts followed by the target's own token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.sampling import sample

#: A rule that replaces the method's own acceptance (``Session(accept=...)``): (processed scores, draft, q or None,
#: generator) -> the committed tokens. Only tests inject one (a negative control that must fail the lossless check).
AcceptRule = Callable[[torch.Tensor, list[int], torch.Tensor | None, torch.Generator], list[int]]


def check_ensemble_weight(w: float | None) -> None:
    """``None`` (lossless) or a number in the open interval (0, 1)."""
    if w is None:
        return
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 < w < 1.0:
        raise ValueError(f"ensemble_weight must be in the open interval (0, 1) or None (lossless), got {w!r}")


def _need_q(q: torch.Tensor | None, draft: list[int]) -> torch.Tensor:
    if q is None or q.shape[0] < len(draft):
        raise ValueError("ensemble verification needs the draft distribution q for every drafted token")
    return q


def ensemble_targets(scores: torch.Tensor, q: torch.Tensor, w: float) -> list[int]:
    """Per row, the greedy choice under ensemble verification: argmax of v = w·p + (1 − w)·q on the drafted rows
    (the first ``len(q)``), argmax p on the bonus row. Tokens ``q`` does not cover count as q = 0."""
    k = q.shape[0]
    p = scores.softmax(-1)
    v = w * p[:k] + (1.0 - w) * q.to(p.dtype)
    return [*v.argmax(-1).tolist(), *scores[k:].argmax(-1).tolist()]


def accept_greedy(
    scores: torch.Tensor, draft: list[int], q: torch.Tensor | None = None, ensemble_weight: float | None = None
) -> list[int]:
    """Greedy rule. ``scores`` has ``len(draft) + 1`` rows; with ``ensemble_weight``, ``q`` has a row per draft."""
    check_ensemble_weight(ensemble_weight)
    if ensemble_weight is not None and draft:
        target = ensemble_targets(scores, _need_q(q, draft)[: len(draft)], ensemble_weight)
    else:
        target = scores.argmax(-1).tolist()
    out = []
    for i, token in enumerate(draft):
        if target[i] != token:
            break
        out.append(token)
    out.append(target[len(out)])
    return out


def accept_sampling(
    scores: torch.Tensor,
    draft: list[int],
    q: torch.Tensor | None,
    generator: torch.Generator,
    ensemble_weight: float | None = None,
) -> list[int]:
    """Speculative sampling rule.

    ``q`` holds, per drafted position, the distribution the draft token was drawn from (``len(draft)`` rows);
    ``None`` means the drafts were chosen deterministically (one-hot q: prompt lookup, greedy drafters).
    With ``ensemble_weight`` w the target is v = w·p + (1 − w)·q (q required); the random draws are the same ones
    the lossless rule makes, so w → 1 gives the lossless outcomes.
    """
    check_ensemble_weight(ensemble_weight)
    if ensemble_weight is not None and draft:
        _need_q(q, draft)
    p = scores.softmax(-1)
    out = []
    for i, token in enumerate(draft):
        q_token = float(q[i, token]) if q is not None else 1.0
        p_token = float(p[i, token])
        if ensemble_weight is not None:  # accept with v(x)/q(x) = 1 − w + w·p(x)/q(x)
            p_token = ensemble_weight * p_token + (1.0 - ensemble_weight) * q_token
        u = float(torch.rand((), generator=generator))
        # p_token > 0: a token the target excludes (a grammar's mask, top-k) is never kept, even on a draw of u = 0
        if q_token > 0 and p_token > 0 and u * q_token <= p_token:
            out.append(token)
            continue
        if q is not None:
            residual = (p[i] - q[i].to(p.dtype)).clamp_min(0)
        else:
            residual = p[i].clone()
            residual[token] = 0
        total = float(residual.sum())
        # p == q (or p concentrated on the rejected one-hot token) leaves nothing: fall back to p itself.
        # Ensemble: max(v − q, 0) = w·max(p − q, 0) normalises to the same residual, so this branch serves both.
        out.append(sample(residual / total if total > 0 else p[i], generator))
        return out
    out.append(sample(p[len(draft)], generator))
    return out
