"""Pre-drafting several likely outcomes of a block at once, as one batched forward per step.

While block ``d_0 … d_{k-1}`` is verified, the verifier will commit one of k + 1 outcomes: the first ``r`` drafts
plus its own token at position r. The most likely own token is the drafter's next-best guess at that position
(``alt_r``, for a rejection at r < k) or the drafter's top-1 after the block (the bonus, r = k). Row r of the batch
continues ``committed + d_0 … d_{r-1} + x_r`` with x_r those guesses. All rows share the drafter's cache of
``committed + d_0 … d_{k-1}``; row r simply masks out the cached slots of ``d_r … d_{k-1}`` and carries its own
position ids, so one forward of k + 1 rows (about the cost of one row) extends every outcome by a token.

When the commit arrives, the row whose assumption it confirms becomes the session's cache and chain (its masked
slots cut out), so the next block is ready at once; DESIGN.md explains why this is where pipelining pays.
Greedy requests only: a sampled correction comes from the residual distribution and is rarely guessed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from drafter_node.base import DraftToken
from shared.kv import CachedLM


class Branches:
    """k + 1 outcome rows drafted in one batch on top of a session's cache."""

    def __init__(self, lm: CachedLM, committed_len: int, block: list[int], guesses: list[int]):
        """``lm`` caches exactly ``committed + block``; ``guesses[r]`` is row r's assumed verifier token."""
        self.model = lm.model
        self.base = committed_len
        self.block = list(block)
        self.k = len(block)
        self.guesses = list(guesses)
        rows = len(guesses)
        self.cache = copy.deepcopy(lm.cache)
        self.cache.batch_repeat_interleave(rows)
        cached = committed_len + self.k
        # mask[r, slot]: row r sees the committed prefix, its own r drafts, and everything it adds itself.
        self.mask = torch.ones(rows, cached, dtype=torch.long)
        for r in range(rows):
            self.mask[r, committed_len + r : cached] = 0
        self.drafted: list[list[DraftToken]] = [[] for _ in range(rows)]  # tokens after the guess, per row
        self.pending = torch.tensor(guesses, dtype=torch.long)  # next input token per row
        self._device = lm._device

    @property
    def depth(self) -> int:
        return len(self.drafted[0])

    @torch.inference_mode()
    def step(self, choose_rows: Callable[[torch.Tensor, list[list[int]]], list[DraftToken]]) -> None:
        """Feed each row's pending token; ``choose_rows(logits [rows, V], contexts)`` picks the next tokens."""
        rows = len(self.guesses)
        self.mask = torch.cat([self.mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
        positions = torch.tensor([[self.base + r + self.depth] for r in range(rows)])
        out = self.model(
            input_ids=self.pending[:, None].to(self._device),
            attention_mask=self.mask.to(self._device),
            position_ids=positions.to(self._device),
            cache=self.cache,
            use_cache=True,
        )
        nxt = choose_rows(out.logits[:, -1].float(), [self.context(r) for r in range(rows)])
        for r, token in enumerate(nxt):
            self.drafted[r].append(token)
        self.pending = torch.tensor([t.token for t in nxt], dtype=torch.long)

    def context(self, r: int) -> list[int]:
        """Row r's tokens after the committed prefix (the block part it keeps, its guess, what it drafted)."""
        return [*self.block[:r], self.guesses[r], *(t.token for t in self.drafted[r])]

    def match(self, tokens: list[int]) -> int | None:
        """The row a commit of ``tokens`` confirms, if any."""
        r = len(tokens) - 1
        if r < len(self.guesses) and tokens[:r] == self.block[:r] and tokens[r] == self.guesses[r]:
            return r
        return None

    def adopt(self, r: int, lm: CachedLM) -> list[DraftToken]:
        """Make row r the session's cache; return its drafted tokens (the new chain)."""
        keep_prefix = self.base + r
        cut_from, cut_to = keep_prefix, self.base + self.k
        for layer in self.cache.layers:
            keys, values = layer.keys[r : r + 1], layer.values[r : r + 1]
            layer.keys = torch.cat([keys[..., :cut_from, :], keys[..., cut_to:, :]], dim=-2)
            layer.values = torch.cat([values[..., :cut_from, :], values[..., cut_to:, :]], dim=-2)
        lm.cache = self.cache
        # cached now: committed + block[:r] + guess + drafted[:-1] (the last drafted token is not fed yet)
        lm.length = keep_prefix + self.depth
        return list(self.drafted[r])
