"""Drafting with a causal LM and its own KV cache: the mechanism behind model-based drafter types.

``propose`` runs the model one token at a time on top of committed + chain, choosing each token with the shared
logits processing: argmax when the request is greedy, otherwise a sample from the (optionally top-m truncated)
distribution q, which is kept with the token and sent to the verifier. Truncating q is still exact: the verifier
uses the very distribution the token was drawn from.

Under greedy decoding a session with ``want_q`` (ensemble verification) also keeps q with each token: the
drafter's softmax over its processed scores, truncated to its top-m tokens and *not* renormalised, so every value
sent is exactly the drafter's probability and a token left out counts as q = 0 (m = 0 sends the full row).

``batch_step`` gives the node the same step (a chain token, or a step of the pre-draft rows) as rows of a batched
forward over many sessions; ``propose`` runs the very same chain step alone (the LM head over the last token only).

KV memory: a session's cache is a handle from the drafter's backend (:func:`drafter_backend`, ``drafter.backend``:
static slots or dynamic caches, as the verifier's), opened for the request's whole length plus room for pre-draft
rows (:func:`predraft_room`) and given back by ``close``. A slot never overflows: pre-drafting that would not fit is
skipped, and a chain step that would not fit moves the session onto a dynamic cache (:func:`with_room`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from drafter_node.base import BatchStep, DraftSession, DraftToken
from drafter_node.branches import Branches, rank_outcomes
from drafter_node.settings import DrafterConfig
from shared.backend import make_backend
from shared.node_keys import kv_slots
from shared.sampling import GenerationParams, make_generator, process_logits
from shared.target import Row, RowOutput, SequenceHandle, TargetBackend

_GREEDY = GenerationParams(do_sample=False)

log = logging.getLogger("pipespec.drafter")


def predraft_room(max_draft_tokens: int) -> int:
    """Positions a session's cache may hold beyond its committed tokens: a block of k ≤ ``max_draft_tokens`` and
    its k + 1 pre-draft rows, each up to k deep (the single overlapped chain, 2k + 1, is shorter)."""
    return max_draft_tokens * (max_draft_tokens + 2)


def drafter_backend(model: Any, settings: DrafterConfig, thread_counts: list[int] | None = None) -> TargetBackend:
    """The KV backend of a drafter's model from its ``drafter`` section (``backend``, ``kv_slot_tokens``,
    ``kv_slots``; null slots: the smaller of ``max_batch_sessions`` and :data:`~shared.node_keys.DEFAULT_KV_SLOTS`).
    ``thread_counts``: the node's planned counts (its ``ProfileSpec.threads``), which a compiled backend builds its
    steps for."""
    slots = kv_slots(settings.kv_slots, settings.max_batch_sessions)
    return make_backend(model, settings.backend, slots, settings.kv_slot_tokens, role="drafter",
                        thread_counts=thread_counts)


def with_room(lm: SequenceHandle, count: int, backend: TargetBackend) -> SequenceHandle:
    """``lm``, or where it cannot take ``count`` more positions, a fresh handle of ``backend``'s for a sequence that
    long (a static backend's is a dynamic cache; ``lm``'s slot given back; the caller re-feeds the sequence: what the
    new handle lacks)."""
    room = lm.room
    if room is None or room >= count:
        return lm
    log.info("a draft session outgrew its KV slot (%d positions): it goes on with a dynamic cache", lm.capacity)
    need = lm.length + count
    lm.close()
    return backend.open(need)


def choose(
    scores: torch.Tensor, params: GenerationParams, position: int, q_top_m: int, greedy_q: bool = False
) -> DraftToken:
    """Pick the draft token for ``position`` from processed scores (shared by every model-based type).

    Under greedy the token also carries its next-best ``alt`` and both softmax probabilities (``prob``,
    ``alt_prob``: they rank a block's outcomes for pre-drafting). ``greedy_q``: under greedy, keep the drafter's
    top-m softmax probabilities with the token (ensemble verification); they are not renormalised, so they are the
    drafter's own values."""
    m = scores.numel() if q_top_m <= 0 else min(q_top_m, scores.numel())
    if not params.do_sample:
        top2 = torch.topk(scores, min(2, scores.numel())).indices  # on the scores: exact argmax, ties as before
        probs = scores.softmax(-1)
        p2 = probs[top2].tolist()
        two = len(p2) > 1
        token = DraftToken(int(top2[0]), alt=int(top2[1]) if two else None, prob=p2[0], alt_prob=p2[1] if two else None)
        if greedy_q:
            q_prob, q_idx = torch.topk(probs, m)
            token.q_idx, token.q_prob = q_idx.to(torch.int32), q_prob.float()
        return token
    probs = scores.softmax(-1)
    q_prob, q_idx = torch.topk(probs, m)
    q_prob = q_prob / q_prob.sum()
    pick = int(torch.multinomial(q_prob, 1, generator=make_generator(params.seed or 0, position, stream=1)))
    return DraftToken(int(q_idx[pick]), q_idx=q_idx.to(torch.int32), q_prob=q_prob.float())


def choose_greedy_rows(logits: torch.Tensor) -> list[DraftToken]:
    """:func:`choose` for every row of ``logits`` [rows, vocab] at once, for greedy rows that no logits processor
    changes (no penalty or bias, no end token held back, no q kept): the same tokens, next-best tokens and
    probabilities as row by row (the same kernels, per row), from one top-2 and one softmax instead of one each per
    row (pre-draft rows: several per drafter step)."""
    scores = logits.float()
    if scores.shape[-1] < 2:  # no next-best token: choose's own path
        return [choose(row.clone(), _GREEDY, 0, 0) for row in scores]
    top2 = torch.topk(scores, 2, dim=-1).indices
    probs = scores.softmax(-1).gather(-1, top2).tolist()
    return [DraftToken(a, alt=b, prob=pa, alt_prob=pb) for (a, b), (pa, pb) in zip(top2.tolist(), probs)]


def pick_token(logits: torch.Tensor, ids: list[int], params: GenerationParams, prompt_len: int, vocab_size: int,
               q_top_m: int, greedy_q: bool = False) -> DraftToken:
    """The draft token after ``ids`` (the whole sequence) from a drafter's raw logits at that position: the shared
    logits processing (on the target's ``vocab_size`` columns: a drafter head may be padded wider), then
    :func:`choose`."""
    scores = process_logits(logits[:vocab_size], params.context(ids, prompt_len), params, len(ids) - prompt_len)
    return choose(scores, params, len(ids), q_top_m, greedy_q)


class LMDraftSession(DraftSession):
    """A draft session over a causal LM whose vocabulary is the target's."""

    def __init__(
        self, backend: TargetBackend, token_ids: list[int], prompt_len: int, params: GenerationParams, q_top_m: int,
        vocab_size: int, max_draft_tokens: int = 16,
    ):
        """``backend``: the drafter model's, where the session's KV memory lives and its forwards run;
        ``max_draft_tokens``: the node's largest block, which sizes the slot's room for pre-draft rows."""
        super().__init__(token_ids, prompt_len, params)
        self.backend = backend
        self.lm: SequenceHandle = backend.open(len(token_ids) + params.max_new_tokens + predraft_room(max_draft_tokens))
        self.q_top_m = q_top_m
        self.vocab_size = vocab_size  # the target's: a drafter head may be padded wider
        self.branches: Branches | None = None
        self.outcomes: list[tuple[int, int, float]] = []  # the last block's ranked outcomes (r, guess, weight)
        self._block_end: int | None = None  # the committed length once the block in flight is accepted whole

    def pick(self, logits: torch.Tensor, ids: list[int]) -> DraftToken:
        """The draft token after ``ids`` (the whole sequence) from the drafter's raw logits at that position."""
        return pick_token(logits, ids, self.params, self.prompt_len, self.vocab_size, self.q_top_m, self.want_q)

    def propose(self, n: int) -> int:
        self._drop_branches()  # drafting the single chain needs the cache to end at committed + chain again
        added = 0
        while added < n and not self.ended:
            step = self._chain_step()
            row = step.rows[0]
            logits, _ = row.lm.feed(row.tokens, last_logits_only=True)  # alone: the LM head over the last one only
            step.finish([RowOutput(logits, None)])
            added += 1
        return added

    def catch_up(self, limit: int) -> int:
        lacking = len(self.committed) - self.lm.length
        if lacking <= limit:
            return 0
        self._drop_branches()  # nothing pre-drafted survives so long a gap; the cache ends at committed + chain
        self.lm = with_room(self.lm, lacking + len(self.chain) + 1, self.backend)
        start = self.lm.length
        chunk = self.committed[start : start + limit]
        self.lm.feed(chunk, last_logits_only=True)  # its logits are not needed: the LM head over one token only
        return len(chunk)

    def _chain_step(self) -> BatchStep:
        """The next chain token's step: feed what the cache lacks of committed + chain, pick from the last logits
        (on a dynamic cache from now on where the slot has no room for it)."""
        ids = self.committed + self.chain_tokens
        self.lm = with_room(self.lm, len(self.lm.uncached(ids)), self.backend)
        if self.lm.length in (len(self.committed), self._block_end):
            # A recurrent (hybrid) drafter's rollback point: a rejected block restores it and re-feeds the accepted
            # drafts only, not the whole context (a no-op for attention caches, which crop).
            self.lm.anchor()
        return BatchStep([Row(self.lm, self.lm.uncached(ids))],
                         lambda outputs: self.chain.append(self.pick(outputs[0].logits[-1], ids)))

    def batch_step(self) -> BatchStep | None:
        """``speculate_step`` (the pre-draft rows) while speculating, else ``propose(1)``, as a batched forward's
        rows; None where the model cannot run batched forwards (sliding-window layers, a kernel without masks) or
        the chain ended (``propose`` has nothing to add)."""
        if not self.lm.batchable:
            return None
        if self.branches is not None:
            return self.branches.batch_step(self._choose_rows) if self._rows_fit() else None
        if self.ended:
            return None
        room = self.lm.room
        if room is not None and room < len(self.lm.uncached(self.committed + self.chain_tokens)):
            return None  # alone: propose moves the session onto a dynamic cache first
        return self._chain_step()

    def _truncate(self, length: int) -> None:
        self._drop_branches()
        self.lm.crop(length)

    def close(self) -> None:
        """The request ended: its KV memory goes back to the backend."""
        self._drop_branches()
        self.lm.close()

    def _rows_fit(self) -> bool:
        """Whether the cache has room for one more step of the pre-draft rows (one position per row)."""
        room = self.lm.room
        return room is None or room >= len(self.branches.rows)

    # --------------------------------------------------------------- multi-outcome pre-drafting (greedy)
    @property
    def predrafts_rows(self) -> bool:  # type: ignore[override]
        return not self.params.do_sample and self.lm.trees  # else: the single all-accepted chain

    @property
    def forward_size(self) -> int:
        return len(self.branches.rows) if self.branches is not None else self.lm.last_fed

    def _drop_branches(self) -> None:
        if self.branches is not None:
            self.branches.discard(self.lm)
            self.branches = None

    def begin_speculation(self, block_len: int, max_rows: int | None = None) -> bool:
        """Pre-draft the ``max_rows`` likeliest outcomes of the block just sent (None: every outcome with a
        guess), ranked by :func:`~drafter_node.branches.rank_outcomes`; :meth:`outcome_weights` keeps the ranking."""
        self._drop_branches()
        self.outcomes = []
        self._block_end = len(self.committed) + block_len + 1  # the single chain pre-drafted past it anchors there
        if self.params.do_sample or self.ended or not self.lm.trees:
            return False
        if len(self.chain) < block_len + 1:
            self.propose(block_len + 1 - len(self.chain))  # the bonus guess
        if len(self.chain) < block_len + 1:
            return False
        self.outcomes = rank_outcomes(self.chain, block_len)
        chosen = self.outcomes if max_rows is None else self.outcomes[:max_rows]
        if not chosen:
            return False
        cached = len(self.committed) + block_len
        if self.lm.capacity is not None and self.lm.capacity - cached < len(chosen):
            return False  # no room in the slot for the rows: the node extends the single chain instead
        ids = self.committed + self.chain_tokens
        if self.lm.length > cached:
            self.lm.crop(cached)
        elif self.lm.length < cached:
            self.lm.feed(ids[self.lm.length : cached], last_logits_only=True)
        self.branches = Branches(self.backend, self.lm, len(self.committed), self.chain_tokens[:block_len],
                                 [(r, guess) for r, guess, _ in chosen], weights=[w for _, _, w in chosen])
        return True

    def outcome_weights(self) -> list[tuple[int, int, float]]:
        """Every outcome of the last block ``begin_speculation`` saw, ``(r, guess, weight)``, likeliest first (the
        pre-drafted rows are its first ``max_rows``; ``branches.hit_weight`` sums their weights)."""
        return list(self.outcomes)

    @property
    def speculation_depth(self) -> int | None:
        return None if self.branches is None else self.branches.depth

    def speculate_step(self) -> None:
        assert self.branches is not None
        if not self._rows_fit():  # the slot is full: stop pre-drafting, extend the single chain
            self._drop_branches()
            self.propose(1)
            return
        self.branches.step(self._choose_rows)

    def _choose_rows(self, logits: torch.Tensor, contexts: list[list[int]]) -> list[DraftToken]:
        """Each pre-draft row's next token from its logits (``contexts``: the rows' tokens after the committed)."""
        p = self.params
        generated = len(self.committed) - self.prompt_len
        if (not p.do_sample and not self.want_q and not p.changes_logits
                and not (p.eos_token_ids and any(generated + len(c) < p.min_new_tokens for c in contexts))):
            return choose_greedy_rows(logits[:, : self.vocab_size])  # no processor reads a row: all rows at once
        return [self.pick(row, self.committed + ctx) for row, ctx in zip(logits, contexts)]

    def observe_commit(self, tokens: list[int], extras: dict[str, torch.Tensor] | None = None) -> int:
        self._block_end = None  # that block is verified: the next one sets its own
        branches = self.branches
        row = branches.match(tokens) if branches is not None else None
        if row is None:
            self._drop_branches()  # back to committed + block: the usual rollback follows
            return super().observe_commit(tokens, extras)
        self.branches = None
        self.chain = branches.adopt(row, self.lm)
        self.committed.extend(tokens)
        return len(tokens)
