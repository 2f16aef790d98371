"""What the verifier checks of a drafter's draft before a round may use it, without sockets: the draft
distribution q (sparse or dense) rebuilt and checked, a token tree's parents (or a refusal the drafter answers by
sending chains), the drafter's ``stats`` as the request's metrics will read them. Each raises
:class:`shared.protocol.ProtocolError`, which refuses that draft only."""

from __future__ import annotations

import math
from typing import Any

import torch

from shared.protocol import Draft, ProtocolError
from verifier_node.drafters import DrafterLink
from verifier_node.session import Session

#: Error code of a tree draft the verifier will not verify (the draft is dropped; the drafter turns trees off).
TREE_REFUSED = "tree_refused"


def tree_parents(msg: Draft, s: Session, link: DrafterLink, ensemble: bool) -> list[int] | None:
    """A draft's ``parents`` (its shape was checked by decode), or None for a chain; a ProtocolError (refusing
    this draft only, code ``tree_refused``: the drafter then sends chains) where the verifier cannot verify a tree
    losslessly: sampled requests or q (children drawn from q would need recursive rejection sampling), ensemble
    verification (``ensemble``), drafters that need hidden states or K/V rows back, targets whose attention takes
    no custom mask."""
    parents = msg.parents
    if parents is None or parents == list(range(-1, len(parents) - 1)):
        return None  # a chain spelled as a tree: the chain path
    if s.params.do_sample or ensemble or any(k in msg.tensors for k in ("q", "q_idx")):
        raise ProtocolError("draft: token trees are verified for greedy requests without q only (no sampling, "
                            "no ensemble verification)", code=TREE_REFUSED)
    if link.needs_hidden or link.kv_layers:
        raise ProtocolError("draft: token trees are not taken from drafters that need the target's hidden "
                            "states or K/V rows", code=TREE_REFUSED)
    if not s.lm.trees:
        raise ProtocolError("draft: this target cannot verify token trees (its attention takes no custom mask, "
                            "or it has sliding-window layers)", code=TREE_REFUSED)
    return parents


def dense_q(msg: Draft, k: int, vocab_size: int) -> torch.Tensor | None:
    """Rebuild the draft distribution rows from a sparse (q_idx, q_prob) or dense (q) encoding."""
    t = msg.tensors
    if "q" in t:
        q = t["q"].float()
        if q.shape != (k, vocab_size):
            raise ProtocolError(f"dense q must have shape [{k}, {vocab_size}], got {list(q.shape)}")
    elif "q_idx" in t and "q_prob" in t:
        idx, prob = t["q_idx"].long(), t["q_prob"].float()
        if idx.shape != prob.shape or idx.dim() != 2 or idx.shape[0] != k:
            raise ProtocolError("sparse q: q_idx and q_prob must both have shape [k, m]")
        if idx.numel() and (idx.min() < 0 or idx.max() >= vocab_size):
            raise ProtocolError("sparse q: index outside the vocabulary")
        q = torch.zeros(k, vocab_size).scatter_add_(1, idx, prob)
    else:
        return None  # drafts chosen deterministically: one-hot q
    if not torch.isfinite(q).all() or (q < 0).any():
        raise ProtocolError("q must hold finite, non-negative probabilities")
    return q


_NUMERIC_STATS = ("busy_s", "blocks", "predraft_hits", "rolled_back", "idle_blocks", "batch_steps", "batch_rows",
                  "tree_blocks", "side_accepted")


def checked_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """A draft's ``stats`` as the request's metrics read them: numbers where numbers go, a map of plan counts, a dtype
    name; anything else is refused here, not when the request finishes."""
    for key in _NUMERIC_STATS:
        v = stats.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ProtocolError(f"draft: stats.{key} must be a finite number, got {type(v).__name__}")
    plans = stats.get("plans", {})
    if not isinstance(plans, dict) or not all(isinstance(k, str) and type(v) is int for k, v in plans.items()):
        raise ProtocolError("draft: stats.plans must map plan names to counts")
    ceiling = stats.get("ceiling_tokens_per_second", 0)  # sent beside SessionStats' fields (NodeSession.ceiling)
    if isinstance(ceiling, bool) or not isinstance(ceiling, (int, float)) or not math.isfinite(ceiling) or ceiling < 0:
        raise ProtocolError("draft: stats.ceiling_tokens_per_second must be a finite, non-negative number")
    if not isinstance(stats.get("dtype", ""), (str, type(None))):
        raise ProtocolError("draft: stats.dtype must be a string")
    timing = stats.get("timing", {})
    if not isinstance(timing, dict) or len(timing) > 16 or not all(
            isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            for k, v in timing.items()):
        raise ProtocolError("draft: stats.timing must map at most 16 names to finite numbers")
    rates = stats.get("plan_rates", {})
    if not isinstance(rates, dict) or len(rates) > 32 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, list) and len(v) == 4
            and all(not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x >= 0
                    for x in v) for k, v in rates.items()):
        raise ProtocolError("draft: stats.plan_rates must map at most 32 plan names to 4 non-negative numbers")
    check = stats.get("plan_check")
    if check is not None and not (
            isinstance(check, dict) and set(check) == {"startup", "realised_best", "verdict"}
            and all(isinstance(v, str) and len(v) <= 64 for v in check.values())
            and check["verdict"] in ("confirmed", "corrected")):
        raise ProtocolError("draft: stats.plan_check must hold startup, realised_best (plan names) and a verdict "
                            "(confirmed or corrected)")
    return stats
