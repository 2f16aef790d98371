"""Acceptance rules: which drafted tokens the target keeps, and the token it adds itself.

Both rules are lossless (Leviathan et al. 2023, Chen et al. 2023):

* greedy: keep the longest prefix of the draft that equals the target's argmax, then emit the target's argmax at
  the first mismatch (the correction) or after the last draft (the bonus);
* sampling: keep draft token x with probability min(1, p(x)/q(x)); on the first rejection sample from
  norm(max(p − q, 0)); when all are kept, sample the bonus from p.

Every function takes processed scores (see :mod:`shared.sampling`) with one row per drafted position plus one for
the bonus, and returns the committed tokens: n accepted drafts followed by the target's own token.
"""

from __future__ import annotations

import torch

from shared.sampling import sample


def accept_greedy(scores: torch.Tensor, draft: list[int]) -> list[int]:
    """Greedy rule. ``scores`` has ``len(draft) + 1`` rows."""
    target = scores.argmax(-1).tolist()
    out = []
    for i, token in enumerate(draft):
        if target[i] != token:
            break
        out.append(token)
    out.append(target[len(out)])
    return out


def accept_sampling(
    scores: torch.Tensor, draft: list[int], q: torch.Tensor | None, generator: torch.Generator
) -> list[int]:
    """Speculative sampling rule.

    ``q`` holds, per drafted position, the distribution the draft token was drawn from (``len(draft)`` rows);
    ``None`` means the drafts were chosen deterministically (one-hot q: prompt lookup, greedy drafters).
    """
    p = scores.softmax(-1)
    out = []
    for i, token in enumerate(draft):
        q_token = float(q[i, token]) if q is not None else 1.0
        p_token = float(p[i, token])
        u = float(torch.rand((), generator=generator))
        if q_token > 0 and u * q_token <= p_token:
            out.append(token)
            continue
        if q is not None:
            residual = (p[i] - q[i].to(p.dtype)).clamp_min(0)
        else:
            residual = p[i].clone()
            residual[token] = 0
        total = float(residual.sum())
        # p == q (or p concentrated on the rejected one-hot token) leaves nothing: fall back to p itself.
        out.append(sample(residual / total if total > 0 else p[i], generator))
        return out
    out.append(sample(p[len(draft)], generator))
    return out


def accept_everything(scores: torch.Tensor, draft: list[int], q: torch.Tensor | None, generator: torch.Generator):
    """NEGATIVE CONTROL for tests only: keeps every draft (biased towards q). Enabled by PIPESPEC_UNSAFE_ACCEPT_ALL."""
    return [*draft, sample(scores[len(draft)].softmax(-1), generator)]
