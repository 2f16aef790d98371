"""Choosing a draft tree's shape from cost curves: how deep to draft, and where a second candidate pays.

Pure functions, no models. The family of trees considered is a *chain with side leaves*: the drafter's top-1 chain of
depth k, plus, at some positions i < k, the drafter's second choice at that position as a leaf (a sibling of chain
node i). The drafter's top-2 come out of the forward that drafts the chain, so a side leaf costs the drafter nothing
and the verifier one more token per forward: a round costs ``k·D + V(1 + k + m) + o`` with m side leaves, D the
drafter's step, V the verifier's cost curve (seconds per forward over n new tokens) and o the round trip beyond it.

The model's assumptions (those of :mod:`drafter_node.cost_model`, extended by one number): the drafter's top-1 at
position i is accepted with probability α_i given every token before it was (independently of the branch it is on),
and at a rejection its second choice is the target's token with probability g (``Acceptance.correction_guess``).
Under them the expected committed tokens of any tree are exactly ``1 + Σ_v P(v accepted)`` over its nodes
(:func:`expected_tokens`), with P(v) the product along v's path of α_d for a top-1 node at position d and
(1 − α_d)·g for a second choice. A side leaf at position i adds ``s_i·(1 − α_i)·g`` (s_i = Π_{j<i} α_j), so for a
given k and m the best leaves are the m positions with the largest such gain — the least sure positions that are
still likely to be reached — and :func:`plan_tree` searches every (k, m) exactly.

Not covered: second children with their own sub-chains (they would cost the drafter batched rows per step), a third
choice, and acceptance that differs by branch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drafter_node.cost_model import Acceptance

Curve = Callable[[int], float]  # seconds per verifier forward over n new tokens


@dataclass
class TreePlan:
    """A tree shape: chain depth ``k`` and the positions that get a second-choice leaf."""

    k: int
    sides: list[int]  # chain positions (0-based, < k) with the drafter's second choice as a leaf
    expected: float  # expected committed tokens per round
    rate: float  # expected committed tokens per second

    @property
    def nodes(self) -> int:
        return self.k + len(self.sides)

    @property
    def width(self) -> int:
        """The most candidates at one position (1: a chain, 0: no draft)."""
        return 0 if self.k == 0 else (2 if self.sides else 1)

    def shape(self) -> tuple[list[int], list[int]]:
        """``(parents, ranks)`` in topological order for a ``DraftTree``: rank 0 is the drafter's top-1 at that
        node's position (the chain), rank 1 its second choice."""
        parents, ranks = [], []
        chain_parent = -1
        for i in range(self.k):
            parents.append(chain_parent)
            ranks.append(0)
            chain_node = len(parents) - 1
            if i in self.sides:
                parents.append(chain_parent)
                ranks.append(1)
            chain_parent = chain_node
        return parents, ranks


def survival(alphas: Sequence[float], k: int) -> list[float]:
    """s[j] = P(the first j chain drafts are all accepted), j = 0..k."""
    s = [1.0]
    for i in range(k):
        s.append(s[-1] * alphas[i])
    return s


def expected_tokens(parents: Sequence[int], ranks: Sequence[int], alphas: Sequence[float], g: float) -> float:
    """Expected committed tokens of a round verifying the tree ``(parents, ranks)`` (topological order), under the
    model's assumptions: 1 (the target's own token) plus every node's probability of being accepted."""
    depth: list[int] = []
    reach: list[float] = []
    for parent, rank in zip(parents, ranks):
        if rank not in (0, 1):
            raise ValueError(f"rank {rank!r}: only the drafter's top-1 (0) and second choice (1) are modelled")
        d = 0 if parent < 0 else depth[parent] + 1  # position of the node's token (0: right after the pending one)
        a = alphas[min(d, len(alphas) - 1)]
        step = a if rank == 0 else (1.0 - a) * g
        depth.append(d)
        reach.append(step * (1.0 if parent < 0 else reach[parent]))
    return 1.0 + sum(reach)


def plan_tree(alphas: Sequence[float], g: float, verify: Curve, draft_step_s: float, overhead_s: float = 0.0,
              allow_solo: bool = True) -> TreePlan:
    """The tree (chain depth k ≤ ``len(alphas)`` and side leaves) with the most expected committed tokens per
    second; k = 0 is the verifier stepping alone (``1 / V(1)``, no round trip), considered when ``allow_solo``."""
    best: TreePlan | None = None
    if allow_solo:
        best = TreePlan(0, [], 1.0, 1.0 / max(verify(1), 1e-12))
    for k in range(1, len(alphas) + 1):
        s = survival(alphas, k)
        chain = sum(s)
        gains = sorted(((s[i] * (1.0 - alphas[i]) * g, i) for i in range(k)), reverse=True)
        extra = 0.0
        for m in range(k + 1):
            if m:
                extra += gains[m - 1][0]
            seconds = k * draft_step_s + verify(1 + k + m) + max(0.0, overhead_s)
            rate = (chain + extra) / max(seconds, 1e-12)
            if best is None or rate > best.rate:  # only a better shape is built (136 are weighed at max_k 16)
                best = TreePlan(k, sorted(i for _, i in gains[:m]), chain + extra, rate)
    if best is None:
        raise ValueError("no plan: give at least one acceptance position or allow_solo")
    return best


def plan_from_acceptance(acc: Acceptance, max_k: int, verify: Curve, draft_step_s: float,
                         overhead_s: float = 0.0, allow_solo: bool = True) -> TreePlan:
    """:func:`plan_tree` with a cost model's running estimates (α_i and the correction guess)."""
    return plan_tree([acc.alpha(i) for i in range(max_k)], acc.correction_guess.value, verify, draft_step_s,
                     overhead_s, allow_solo)
