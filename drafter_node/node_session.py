"""One request's draft session as the drafter node holds it: the block length schedule, the block in flight and
what the node measures of it (steps, commits, round trips, plans' realised rates).

:class:`NodeSession` answers the questions the work picker (:mod:`drafter_node.node_picker`) asks — a block ready to
send, a step wanted, a block the verifier waits for — and does the session's own work: one step alone, the block to
send, applying a commit. It holds no socket; the node sends what :meth:`NodeSession.block` gives.
"""

from __future__ import annotations

import logging
import time

import torch

from drafter_node.base import DraftSession
from drafter_node.cost_model import Acceptance, CostBook, ceiling
from drafter_node.plan_search import MIN_ROUNDS
from drafter_node.schedule import CostSchedule, DraftLengthSchedule
from shared.protocol import DrafterStats, PlanCheck

log = logging.getLogger("pipespec.drafter")

#: Most committed tokens one step feeds to catch the drafter's cache up (a new session's prompt, announced after the
#: verifier's prefill and first round): each chunk is a forward of its own, so the node reads the verifier's
#: messages between them (heartbeats included), and a verifier forward that wants a core the chunk holds waits for
#: one chunk at most (shared.cores), not for the whole prompt.
CATCH_UP_TOKENS = 256


#: Blocks between two computations of a session's ceiling (:meth:`NodeSession.ceiling`).
CEILING_EVERY = 4


class NodeSession:
    """A draft session plus what the node tracks for it: the block length schedule and what was already sent."""

    def __init__(self, sid: int, draft: DraftSession, schedule: DraftLengthSchedule, book: CostBook | None = None):
        self.sid = sid
        self.draft = draft
        self.schedule = schedule
        self.book = book
        self.sent_base: int | None = None  # committed length of the last block sent
        self.sent_len = 0
        self.sent_at = 0.0
        self.sent_guesses: list[int | None] = []  # our guess of the verifier's token per outcome of the block sent
        self.sent_probs: list[float | None] = []  # the drafter's probability of each token of the block sent
        self.sent_chain: list[int] = []  # the chain tokens of the block sent
        self.sent_sides: dict[int, int] = {}  # chain position -> second-choice leaf sent there (a token tree)
        self.exhausted = False  # propose() had nothing more to give on this base
        self.idle_period_sent = 0  # the schedule's k = 0 run whose idle block went out
        self.threads = 0  # torch threads of the last step (0: not set by the node)
        self.timed_block = False  # a block of ours was verified (later round trips are overhead samples)
        self.last_step: tuple[int, float] | None = None  # (forward size, seconds) of its last one-forward step
        self._sized: tuple | None = None  # what _sized_done last answered for: (base, chain length, plan)
        self._sized_value: bool | None = None
        # the counters sent with each block (``Draft.stats``); ``timing`` is its DrafterTiming, summed here
        self.stats = DrafterStats()
        self.timing = self.stats.timing
        # Per plan used (``solo``, ``sync k=4``, ``overlap k=5 rows=3``, or the schedule's k): [rounds, committed
        # tokens, seconds between commits, the predicted tokens/s summed] — what the cost model expected against
        # what the rounds gave. Sent as the stats' plan_rates, with the start-up plan's check (stats.plan_check).
        self.plan_rates: dict[str, list[float]] = self.stats.plan_rates
        self.last_commit_at: float | None = None
        # Per block position, this session's verified drafts: how many were tested and accepted (the realised
        # acceptance the ceiling is computed at), and the ceiling last computed (every CEILING_EVERY blocks).
        self.realised_drafted: list[int] = []
        self.realised_accepted: list[int] = []
        self._ceiling: tuple[int, float] | None = None

    @property
    def solo_wait(self) -> bool:
        """This k = 0 run's idle block went out: nothing to send until the schedule's rounds end."""
        s = self.schedule
        return s.k == 0 and s.solo_rounds > 0 and self.idle_period_sent == s.solo_period

    @property
    def overlap(self) -> bool:
        """Pre-draft while the block in flight is verified (this round's plan)."""
        return self.schedule.overlap_now

    @property
    def base_len(self) -> int:
        return len(self.draft.committed)

    def block_pending(self) -> bool:
        return self.sent_base != self.base_len

    def speculation_targets(self) -> int:
        """How long the single chain should grow before the drafter idles (when outcomes are not pre-drafted).

        Synchronous: one block. Overlapped: the block, a guess for the bonus token, and the next block.
        """
        if self.block_pending() or not self.overlap:
            return self.schedule.k
        return self.sent_len + 1 + self.schedule.k_if_accepted()

    def _sized_done(self) -> bool | None:
        """For a block sized by the drafter's confidence (``CostSchedule.confidence_sized``): whether the chain
        drafted so far should go now; None where the plan's fixed k applies."""
        if not self.block_pending():
            return None
        # asked several times per loop turn (what to send, what to step, the block's length): once per chain length
        key = (self.base_len, len(self.draft.chain), id(getattr(self.schedule, "plan", None)))
        if self._sized != key:
            self._sized, self._sized_value = key, self.schedule.block_done([d.prob for d in self.draft.chain])
        return self._sized_value

    def block_len(self) -> int:
        """Tokens the block sent now carries: the plan's k, or the whole chain of a confidence-sized block."""
        return len(self.draft.chain) if self._sized_done() is not None else self.schedule.k

    def ready_to_send(self) -> bool:
        d = self.draft
        if not self.block_pending() or self.solo_wait:
            return False
        if self.schedule.k and (done := self._sized_done()) is not None:
            return done or d.ended or self.exhausted
        return self.schedule.k == 0 or len(d.chain) >= self.schedule.k or d.ended or self.exhausted

    def wants_step(self) -> bool:
        if self.exhausted or self.solo_wait or self.schedule.k == 0:
            return False
        if not self.block_pending() and not self.overlap:
            return False
        if (done := self._sized_done()) is not None:
            return not done and not self.draft.ended
        depth = self.draft.speculation_depth
        if depth is not None:
            return depth < self.schedule.k_if_accepted()
        return not self.draft.ended and len(self.draft.chain) < self.speculation_targets()

    def step(self) -> None:
        """One step of this session alone (one drafter forward, or a cheap type's whole block); where the drafter's
        cache lacks more than CATCH_UP_TOKENS committed tokens (a new session's prompt), one chunk of them."""
        t0 = time.monotonic()
        if self.draft.catch_up(CATCH_UP_TOKENS):
            # not a sample of a drafting step's cost (the schedule's step time, the cost curves)
            spent = time.monotonic() - t0
            self.stats.busy_s += spent
            self.timing.step_s += spent
            self.last_step = None
            return
        lm = getattr(self.draft, "lm", None)
        fed_before = getattr(lm, "fed_total", 0)
        t0 = time.monotonic()
        advanced = True
        if self.draft.speculation_depth is not None:
            self.draft.speculate_step()
        elif self.draft.propose(self._step_size()) == 0:
            self.exhausted = True
            advanced = False
        spent = time.monotonic() - t0
        self.stepped(spent, 1 if advanced else 0)
        # A step that also caught up on the prompt or a commit (more tokens fed than its last forward's) is not a
        # sample of one forward's cost.
        one_forward = getattr(lm, "fed_total", 0) - fed_before <= max(1, self.draft.forward_size)
        self.last_step = (self.draft.forward_size, spent) if one_forward and not self.draft.cheap_steps else None
        if self.book is not None and self.last_step is not None:
            self.book.observe_draft(self.draft.forward_size, spent, self.threads, self.base_len)
            profiled = self.book.profiled_draft_s(self.draft.forward_size, self.threads, self.base_len)
            if profiled:  # the step's forward against the same forward in the start-up profile
                self.timing.forward_s += spent
                self.timing.profile_s += profiled

    def stepped(self, spent: float, sessions: int) -> None:
        """A step of ``spent`` seconds advanced this session in a forward over ``sessions`` sessions (0: it added
        nothing)."""
        self.schedule.observe_step(spent)
        self.stats.busy_s += spent
        self.timing.step_s += spent
        if sessions:
            self.stats.batch_steps += 1
            self.stats.batch_rows += sessions

    def _step_size(self) -> int:
        if not self.draft.cheap_steps:
            return 1  # one forward per step keeps the node responsive to commits
        return max(1, self.speculation_targets() - len(self.draft.chain))

    def after_send(self) -> None:
        """Start pre-drafting the outcomes of the block just sent (overlap only)."""
        if self.overlap and self.sent_len:
            t0 = time.monotonic()
            self.draft.begin_speculation(self.sent_len, self.schedule.rows)
            self.stats.busy_s += time.monotonic() - t0
        chain = self.draft.chain
        self.sent_guesses = [d.alt for d in chain[: self.sent_len]]
        self.sent_probs = [d.prob for d in chain[: self.sent_len]]
        self.sent_guesses.append(chain[self.sent_len].token if len(chain) > self.sent_len else None)

    def block(self) -> tuple[list[int], dict[str, torch.Tensor], int, list[int] | None]:
        """The block to send now, its q tensors, how many rounds the verifier should then take alone, and its
        parents when the plan makes it a token tree (None: a chain)."""
        idle_rounds = self.schedule.solo_rounds if self.schedule.k == 0 else 0
        chain = self.draft.chain[: self.block_len() if self.schedule.k else 0]
        tokens = [d.token for d in chain]
        tensors = {}
        if chain and chain[0].q_idx is not None:
            tensors = {"q_idx": torch.stack([d.q_idx for d in chain]), "q_prob": torch.stack([d.q_prob for d in chain])}
        self.sent_base, self.sent_len = self.base_len, len(tokens)
        self.sent_chain = list(tokens)
        self.sent_sides = {}
        parents = None
        sides = getattr(getattr(self.schedule, "plan", None), "sides", ())
        if sides and not tensors:
            self.sent_sides = {i: chain[i].alt for i in sides if i < len(chain) and chain[i].alt is not None
                               and chain[i].alt != chain[i].token}
        if self.sent_sides:
            tokens, parents = tree_block(self.sent_chain, self.sent_sides)
            self.stats.tree_blocks += 1
        self.sent_at = time.monotonic()
        self.stats.blocks += 1
        if idle_rounds:
            self.idle_period_sent = self.schedule.solo_period
            self.stats.idle_blocks += 1
        return tokens, tensors, idle_rounds, parents

    def on_commit(self, tokens: list[int], drafted: int, accepted: int, extras: dict[str, torch.Tensor],
                  verify_s: float | None = None, verifier_threads: int = 0, batch_sessions: int = 1,
                  batch_tokens: int = 0, decoding: int = 0) -> None:
        """Apply a commit; ``drafted`` is how many of our block's tokens the verifier checked (0: not used);
        ``verify_s``: the verifier's forward time of the round (with ``verifier_threads`` threads), a forward over
        ``batch_tokens`` tokens of ``batch_sessions`` sessions (batched verification); ``decoding``: how many
        sessions would share a forward if all stepped now (the batch to plan for; 0: unknown)."""
        t0 = time.monotonic()
        verified_ours = drafted > 0 and self.sent_base == self.base_len
        if verified_ours and self.sent_sides:
            # A tree: the verifier counts its nodes and the accepted path; our estimates are of the chain (how many
            # of its tokens the target took, the second choice as the guess of its token at the first rejection).
            drafted, accepted = self.sent_len, 0
            while accepted < min(drafted, len(tokens)) and tokens[accepted] == self.sent_chain[accepted]:
                accepted += 1
            if accepted < len(tokens) and self.sent_sides.get(accepted) == tokens[accepted]:
                self.stats.side_accepted += 1
        if verified_ours:
            self.schedule.observe_confidence(self.sent_probs[:drafted], accepted)
            self._count_realised(drafted, accepted)
        if verified_ours and accepted < len(tokens) and accepted < len(self.sent_guesses):
            guess = self.sent_guesses[accepted]
            if guess is not None:
                self.schedule.observe_guess(bonus=accepted == drafted, correct=guess == tokens[accepted])
        if self.book is not None and verify_s is not None and verify_s > 0:
            self.book.observe_verify(batch_tokens or drafted + 1, verify_s, verifier_threads, self.base_len)
            self.book.observe_batch(decoding or batch_sessions)
            if verified_ours and self.timed_block:  # the first block's trip overlaps the verifier's prefill
                self.book.observe_overhead(time.monotonic() - self.sent_at - verify_s)
            self.timed_block = self.timed_block or verified_ours
        self._count_plan_round(len(tokens), t0)
        chain_before = len(self.draft.chain)
        matched = self.draft.observe_commit(tokens, extras)
        if matched < len(tokens):
            self.stats.rolled_back += chain_before - matched
        if verified_ours:
            self.schedule.observe_roundtrip(t0 - self.sent_at)
            self.timing.roundtrip_s += t0 - self.sent_at
            self.timing.roundtrips += 1
        self.schedule.update(drafted, accepted)
        self.exhausted = False
        if self.overlap and matched == len(tokens) and self.draft.chain:
            self.stats.predraft_hits += 1  # the next block's start was drafted before the commit came
        spent = time.monotonic() - t0
        self.stats.busy_s += spent
        self.timing.commit_s += spent

    def _count_realised(self, drafted: int, accepted: int) -> None:
        """Positions 0..accepted of a verified block were tested (those after the first rejection were not)."""
        tested = min(drafted, accepted + 1)
        while len(self.realised_drafted) < tested:
            self.realised_drafted.append(0)
            self.realised_accepted.append(0)
        for i in range(tested):
            self.realised_drafted[i] += 1
            self.realised_accepted[i] += i < accepted

    def ceiling(self) -> float | None:
        """Tokens per second this session could reach: the cost model's best plan at the acceptance it realised,
        with the nodes' measured forward costs and no overhead (:func:`drafter_node.cost_model.ceiling`); the
        target alone's rate before any draft was verified. None until the costs are known. Recomputed every
        CEILING_EVERY blocks (a plan search weighs every k and row count; a fast target's round is milliseconds)."""
        if self.book is None or not self.book.ready:
            return None
        blocks = self.stats.blocks
        if self._ceiling is not None and blocks - self._ceiling[0] < CEILING_EVERY:
            return self._ceiling[1]
        s = self.schedule
        costs = self.book.costs(self.base_len)
        if not self.realised_drafted:
            rate = 1.0 / max(costs.verify_full(1), 1e-9)
        else:
            acc = Acceptance.realised(s.max_k, self.realised_accepted, self.realised_drafted,
                                      s.acc if isinstance(s, CostSchedule) else None)
            rate = ceiling(acc, costs, s.max_k, getattr(s, "rows_ok", True), allow_overlap=s.overlap).rate
        self._ceiling = (blocks, rate)
        return rate

    def _count_plan_round(self, committed: int, now: float) -> None:
        """One round of the plan in force (the one its block was sent under) gave ``committed`` tokens since the
        previous commit. The session's first commit is not counted: its interval includes both prefills."""
        since, self.last_commit_at = self.last_commit_at, now
        if since is None:
            return
        self.schedule.observe_round(committed, now - since)
        label, predicted = plan_label(self.schedule, bool(self.sent_sides))
        if label not in self.plan_rates and len(self.plan_rates) >= MAX_PLAN_LABELS:
            label = "other"
        row = self.plan_rates.setdefault(label, [0, 0, 0.0, 0.0])
        row[0] += 1
        row[1] += committed
        row[2] += now - since
        row[3] += predicted
        self._check_start_plan()

    def _check_start_plan(self) -> None:
        """Compare the start-up report's plan with the best this session realised; log a correction once per new
        best."""
        start = self.book.start_plan if self.book is not None else None
        check = plan_check(start, self.plan_rates)
        if check is None:
            return
        old, self.stats.plan_check = self.stats.plan_check, check
        if check.verdict == "corrected" and (old is None or old.realised_best != check.realised_best):
            rounds, tokens, seconds, _ = self.plan_rates[check.realised_best]
            log.info("session %d: the start-up plan (%s) is corrected: %s realised %.2f tok/s over %d rounds",
                     self.sid, start, check.realised_best, tokens / seconds, rounds)


#: Distinct plans one session reports (the rest are summed as ``other``).
MAX_PLAN_LABELS = 24


def plan_check(start_plan: str | None, plan_rates: dict[str, list[float]]) -> PlanCheck | None:
    """The start-up report's plan, the plan with the highest realised
    tokens/s among those that ran MIN_ROUNDS rounds, and ``confirmed`` when they are the same plan, else
    ``corrected``. None without a start-up plan (no cost schedule, no report yet) or before any plan ran enough."""
    if not start_plan:
        return None
    rated = [(tokens / seconds, label) for label, (rounds, tokens, seconds, _) in plan_rates.items()
             if label != "other" and rounds >= MIN_ROUNDS and seconds > 0]
    if not rated:
        return None
    best = max(rated)[1]
    return PlanCheck(startup=start_plan, realised_best=best,
                     verdict="confirmed" if best == start_plan else "corrected")


def tree_block(chain: list[int], sides: dict[int, int]) -> tuple[list[int], list[int]]:
    """A token tree's ``(tokens, parents)`` (topological, as ``Draft.parents``): the chain, and after chain token i
    the leaf ``sides[i]`` under the same parent (a sibling of chain token i: the drafter's second choice there)."""
    tokens, parents, parent = [], [], -1
    for i, token in enumerate(chain):
        tokens.append(token)
        parents.append(parent)
        node = len(tokens) - 1
        if i in sides:
            tokens.append(sides[i])
            parents.append(parent)
        parent = node
    return tokens, parents


def plan_label(schedule: DraftLengthSchedule, tree: bool = False) -> tuple[str, float]:
    """The name of the plan ``schedule`` is running and the tokens/s its cost model predicted (0: no model);
    ``tree``: its block went out as a token tree."""
    plan = getattr(schedule, "plan", None)
    if isinstance(schedule, CostSchedule) and plan is not None:
        name = schedule.round_label()
        if plan.sides and not tree:  # no side leaf differed from its chain token: the block went out as a chain
            name = f"sync k={plan.k}"
        return name, plan.rate
    return f"{schedule.mode} k={schedule.k}", 0.0

