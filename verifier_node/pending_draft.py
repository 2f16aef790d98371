"""The draft a session holds between its arrival (checked by :mod:`verifier_node.draft_check`) and the session's
next round (:mod:`verifier_node.rounds`): a typed record, and the empty one a round without a draft verifies."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PendingDraft:
    """A checked draft waiting for its session's next round (``Session.draft``)."""

    tokens: list[int]  # the drafted block (empty: an idle block)
    q: torch.Tensor | None  # the draft distribution rows [k, vocab] (None: one-hot, drafts chosen deterministically)
    idle_rounds: int  # k = 0: the verifier steps alone this many rounds
    overlap: bool  # the drafter pre-drafts while this block is verified
    arrived: float  # time.monotonic() when it arrived
    parents: list[int] | None  # a token tree's parent indices (None: a chain)


#: What a round verifies when its session has no draft: the target's own token alone.
NO_DRAFT = PendingDraft(tokens=[], q=None, idle_rounds=0, overlap=False, arrived=0.0, parents=None)
