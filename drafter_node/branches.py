"""Pre-drafting several likely outcomes of a block at once, flattened into the session's own batch-1 cache.

While block ``d_0 … d_{k-1}`` is verified, the verifier will commit one of k + 1 outcomes: the first ``r`` drafts
plus its own token at position r. The most likely own token is the drafter's next-best guess at that position
(``alt_r``, for a rejection at r < k) or the drafter's top-1 after the block (the bonus, r = k).
:func:`rank_outcomes` weighs each outcome by the drafter's own probabilities; a *plan* is any subset of them, one
row per chosen outcome ``(r, guess)``, continuing ``committed + d_0 … d_{r-1} + guess``.

The rows are never copied out of the session's cache. Each step feeds the R rows' pending tokens as one batch-1
forward of R new tokens onto the cache of ``committed + block``, with explicit position ids (row r at depth j sits
at position ``committed + r + j``) and a 4D mask in which a token sees the committed prefix, its row's kept drafts
``block[:r]``, and its own row's earlier slots — not the dropped drafts, not other rows. So the cache grows by R
slots per step (step-major: step j holds one slot per row) and nothing of the context is copied or repeated. The
cache's ``length`` counts those slots too, so a step can also run as one row of a batched forward over several
sessions (:meth:`Branches.batch_step`, :func:`shared.batch.feed_rows`: the same tokens, positions and visibility).

When the commit arrives, the row it confirms is moved in place to directly after ``committed + block[:r]`` (an
``index_select`` of its few slots and a write into the tail) and the cache is cropped behind it: adoption is
O(tail), whatever the context length. A commit no row predicted crops the cache back to ``committed + block`` and
the session rolls back as without pre-drafting. Greedy requests only: a sampled correction comes from the residual
distribution and is rarely guessed.

The forwards and the adoption are the backend's (``feed_tree``, ``keep_positions``: :mod:`shared.target`), for
handles whose ``trees`` flag is set. Not for sliding-window models: their layers keep only the last W positions, so
R new slots per step would push out committed positions that rows still need; pre-drafting is disabled for them
(``begin_speculation`` returns False and the node extends the single chain) rather than keeping a second, copying
implementation. Nor for attention kernels that ignore a custom mask (flash attention).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from drafter_node.base import BatchStep, DraftToken
from shared.target import Row, SequenceHandle, TargetBackend


def rank_outcomes(chain: list[DraftToken], block_len: int) -> list[tuple[int, int, float]]:
    """The outcomes of a block of ``chain[:block_len]``, most likely first: ``(r, guess, weight)``.

    Outcome r < k keeps ``block[:r]`` and assumes the verifier's token at r is the drafter's next-best ``alt_r``:
    weight Π_{i<r} prob_i × alt_prob_r. The bonus outcome r = k keeps the whole block and assumes the drafted token
    ``chain[k]``: weight Π_{i<k} prob_i × prob_k (left out when the chain has no token k). Outcomes without a guess
    are left out; a missing probability counts as 0. The sort is stable, so equal weights keep the order of r."""
    outcomes: list[tuple[int, int, float]] = []
    kept = 1.0  # probability that the drafter's own tokens 0 … r-1 are all accepted
    for r, draft in enumerate(chain[: block_len + 1]):
        if r < block_len:
            guess, p = draft.alt, draft.alt_prob
        else:
            guess, p = draft.token, draft.prob
        if guess is not None:
            outcomes.append((r, guess, kept * (p or 0.0)))
        kept *= draft.prob or 0.0
    return sorted(outcomes, key=lambda o: -o[2])


class Branches:
    """Outcome rows of one block, drafted as extra slots of the session's own batch-1 cache."""

    def __init__(self, backend: TargetBackend, lm: SequenceHandle, committed_len: int, block: list[int],
                 rows: list[tuple[int, int]], weights: list[float] | None = None):
        """``lm`` (a handle of ``backend``'s whose ``trees`` flag is set) caches exactly ``committed + block``; row
        ``(r, guess)`` keeps ``block[:r]`` then assumes the verifier's token ``guess`` at position r (r ==
        len(block): the bonus row). ``weights``: each row's probability (from :func:`rank_outcomes`), summed in
        :attr:`hit_weight`."""
        self.base = committed_len
        self.block = list(block)
        self.k = len(block)
        self.rows = [(int(r), int(guess)) for r, guess in rows]
        if not self.rows or any(not 0 <= r <= self.k for r, _ in self.rows):
            raise ValueError(f"rows must be a non-empty list of (r, guess) with 0 ≤ r ≤ {self.k}: {rows}")
        if lm.length != committed_len + self.k:
            raise ValueError(f"the cache holds {lm.length} tokens, not committed + block ({committed_len + self.k})")
        self.weights = None if weights is None else [float(w) for w in weights]
        self.backend, self.lm = backend, lm
        self.drafted: list[list[DraftToken]] = [[] for _ in self.rows]  # tokens after the guess, per row
        self.pending = [guess for _, guess in self.rows]  # next input token per row
        self._cuts = torch.tensor([committed_len + r for r, _ in self.rows])  # row r sees the first base + r slots
        # What every step's visibility shares, built at the first step and kept for the block's others (a step is a
        # few ms on a fast drafter): which slots of committed + block each row sees, and one step's tail pattern
        # (each row sees its own slot).
        self._prefix_visible: torch.Tensor | None = None
        self._own = torch.eye(len(self.rows), dtype=torch.bool)

    @property
    def depth(self) -> int:
        return len(self.drafted[0])

    @property
    def hit_weight(self) -> float | None:
        """Probability (by the drafter's own estimate) that the commit confirms one of the rows; None without
        weights."""
        return None if self.weights is None else sum(self.weights)

    def _visible(self) -> torch.Tensor:
        """Which of the cached slots and the next step's R tokens each of those tokens sees: bool [R, cached + R]."""
        # Tail slots are step-major: slot j * R + i is row i's token at depth j; a row sees only its own.
        return torch.cat([self._prefix(), self._own.repeat(1, self.depth + 1)], dim=1)

    def _prefix(self) -> torch.Tensor:
        """Which slots of committed + block each row sees: bool [R, base + k] (row r: the first base + r)."""
        if self._prefix_visible is None:
            self._prefix_visible = torch.arange(self.base + self.k)[None, :] < self._cuts[:, None]
        return self._prefix_visible

    def _positions(self) -> torch.Tensor:
        return self._cuts + self.depth  # row r at depth j: base + r + j

    @torch.inference_mode()
    def step(self, choose_rows: Callable[[torch.Tensor, list[list[int]]], list[DraftToken]]) -> None:
        """Feed each row's pending token; ``choose_rows(logits [rows, V], contexts)`` picks the next tokens."""
        # in place on the session's memory; it holds every slot: a batched step stacks it from ``length``
        logits, _ = self.backend.feed_tree(self.lm, list(self.pending), self._positions().tolist(), self._visible())
        self._advance(logits, choose_rows)

    def batch_step(self, choose_rows: Callable[[torch.Tensor, list[list[int]]], list[DraftToken]]) -> BatchStep:
        """The next :meth:`step` as one row of a batched forward (:func:`shared.batch.feed_rows`): the R pending
        tokens with their positions and visibility over this cache; ``finish`` picks the next tokens as ``step``."""
        row = Row(self.lm, list(self.pending), positions=self._positions().tolist(), visible=self._visible())
        return BatchStep([row], lambda outputs: self._advance(outputs[0].logits, choose_rows))

    def _advance(self, logits: torch.Tensor, choose_rows) -> None:
        nxt = choose_rows(logits, [self.context(i) for i in range(len(self.rows))])
        for drafted, token in zip(self.drafted, nxt):
            drafted.append(token)
        self.pending = [t.token for t in nxt]

    def context(self, index: int) -> list[int]:
        """Row ``index``'s tokens after the committed prefix (the block part it keeps, its guess, what it drafted)."""
        r, guess = self.rows[index]
        return [*self.block[:r], guess, *(t.token for t in self.drafted[index])]

    def match(self, tokens: list[int]) -> int | None:
        """The index of the row a commit of ``tokens`` confirms, if any."""
        r = len(tokens) - 1
        if r < 0 or r > self.k or tokens[:r] != self.block[:r]:
            return None
        return next((i for i, row in enumerate(self.rows) if row == (r, tokens[r])), None)

    def adopt(self, index: int, lm: SequenceHandle) -> list[DraftToken]:
        """Make row ``index`` the session's sequence; return its drafted tokens (the new chain).

        Its slots are kept directly after ``committed + block[:r]`` and the rest dropped
        (:meth:`~shared.target.TargetBackend.keep_positions`: the torch backends move only the row's own ``depth``
        slots per layer, in place)."""
        r, _ = self.rows[index]
        rows, depth = len(self.rows), self.depth
        tail = self.base + self.k + index  # row ``index``'s slot at depth 0 (step-major: one slot per row a step)
        # held now: committed + block[:r] + guess + drafted[:-1] (the last drafted token is not fed yet)
        self.backend.keep_positions(lm, self.base + r, [tail + j * rows for j in range(depth)])
        return list(self.drafted[index])

    def discard(self, lm: SequenceHandle) -> None:
        """No row was confirmed: crop the rows' slots, leaving ``lm`` caching ``committed + block`` again."""
        lm.crop(self.base + self.k)
