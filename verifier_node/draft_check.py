"""What the verifier checks of a drafter's draft before a round may use it, without sockets: the draft
distribution q (sparse or dense) rebuilt and checked, a token tree's parents (or a refusal the drafter answers by
sending chains). Each raises :class:`shared.protocol.ProtocolError`, which refuses that draft only. The drafter's
``stats`` are a :class:`shared.protocol.DrafterStats` that ``decode`` checked; the checked draft a session then
holds is a :class:`verifier_node.pending_draft.PendingDraft`."""

from __future__ import annotations

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
