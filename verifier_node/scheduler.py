"""Which of the verifier's sessions run next: a prefill turn or a round, in round-robin order, gathered into one
batched forward within the batch limits. Pure: no sockets, no model, the clock injectable (``now``).

The scheduler holds the session table (``sessions`` by id, and ``order``, the round-robin queue) and reads each
session's scheduling state (prefilled, its draft, its drafter's liveness, its wait, :mod:`verifier_node.draft_wait`).
The server's parts that read sockets while they wait (gathering drafts on their way, a burst of prompts) stay in
the server and ask the scheduler what they wait for.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from verifier_node.session import Session

#: Most padding a batched prefill may add, as a fraction of its prompts' own tokens.
PREFILL_PADDING = 0.25
#: Longest poll timeout while no session can run (the loop also reaps drafters and sweeps clients that often).
IDLE_POLL_MAX_MS = 200
#: The loop's poll while a grammar session's plan is in work on a mask worker (it wakes to run that round).
PLANNING_POLL_MS = 2


@dataclass
class Prefills:
    """Prompts to cache in the next forward (several in one when batching)."""

    sessions: list[Session]


@dataclass(frozen=True)
class BatchLimits:
    """How much one forward may take: ``batching`` (the target can batch at all), and the rows and tokens a batched
    round or prefill may hold (``max_batch_sessions`` 1: no batching asked for); ``max_prefill_tokens`` also bounds
    one prompt's chunk (a longer prompt is prefilled over several turns)."""

    batching: bool
    max_batch_sessions: int
    max_batch_tokens: int
    max_prefill_tokens: int


class Scheduler:
    """The session table and the policy that picks the next work from it."""

    def __init__(self, limits: BatchLimits, now: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.now = now
        self.sessions: dict[int, Session] = {}
        self.order: deque[int] = deque()

    # ------------------------------------------------------------------ the table
    def add(self, s: Session) -> None:
        """A new session: at the back of the order."""
        self.sessions[s.sid] = s
        self.order.append(s.sid)

    def remove(self, s: Session) -> bool:
        """Take an ended session out of the table; False if it was not there (already gone)."""
        if self.sessions.pop(s.sid, None) is None:
            return False
        if s.sid in self.order:
            self.order.remove(s.sid)
        return True

    # ------------------------------------------------------------------ readiness
    @staticmethod
    def may_wait(s: Session, now: float) -> bool:
        """The session's next round could use a draft from its drafter: prefilled, announced to a live drafter, no
        draft yet, not in a run of rounds the drafter gave to the verifier alone, and not at a point where its grammar
        forces the next token (that round drafts the forced tokens itself: waiting would only delay them)."""
        d = s.drafter
        return (s.prefilled and s.draft is None and s.announced and s.solo_left == 0 and d is not None
                and d.alive(now) and not (s.grammar is not None and s.grammar.next_is_forced()))

    def runnable(self, s: Session, now: float) -> bool:
        """Its next step can run now: nothing to wait for, or it has waited as long as its wait allows; never while
        its grammar's plan is in work on a mask worker (:mod:`verifier_node.masks`)."""
        if s.grammar is not None and s.grammar.planning:
            return False
        return not self.may_wait(s, now) or now - s.ready_since >= s.wait.limit_s()

    def any_runnable(self, now: float) -> bool:
        return any(self.runnable(s, now) for s in self.sessions.values())

    def drafting_elsewhere(self, batch: list[Session], now: float) -> bool:
        """A session outside ``batch`` waits for a block its drafter is drafting now."""
        members = {s.sid for s in batch}
        return any(sid not in members and self.may_wait(s, now) for sid, s in self.sessions.items())

    def idle_timeout_ms(self) -> int:
        """How long the loop may block on its sockets while no session can run: until the first wait runs out."""
        now = self.now()
        if any(s.grammar is not None and s.grammar.planning for s in self.sessions.values()):
            return PLANNING_POLL_MS  # a plan on a mask worker: its round runs as soon as it is done
        waits = [s.ready_since + s.wait.limit_s() - now for s in self.sessions.values()]
        if not waits:
            return IDLE_POLL_MAX_MS
        return max(1, min(IDLE_POLL_MAX_MS, int(1000 * min(waits)) + 1))

    def decoding(self, waiting: bool = False) -> int:
        """How many sessions would share a forward if every one stepped now (what the drafters' cost models plan
        for): the prefilled sessions (``waiting``: and those whose prompts wait, as a new session's own will),
        up to ``max_batch_sessions``; 1 when this verifier does not batch."""
        if not self.limits.batching:
            return 1
        count = sum(1 for s in self.sessions.values() if waiting or s.prefilled)
        return max(1, min(self.limits.max_batch_sessions, count))

    def prompts_waiting(self) -> list[float]:
        """When each session whose prompt is not cached yet started (what a burst's gather waits on)."""
        return [s.started for s in self.sessions.values() if not s.prefilled]

    # ------------------------------------------------------------------ picking
    def next_work(self) -> Prefills | list[Session] | None:
        """What to run next, round-robin: prompts to prefill (a forward of their own turn), or the sessions whose
        next round can run now, up to ``max_batch_sessions`` and ``max_batch_tokens`` (one session when batching is
        off). Sessions taken move to the back of the order, so every session gets its turn."""
        now = self.now()
        batch: list[Session] = []
        tokens = 0
        for sid in list(self.order):
            s = self.sessions[sid]
            if not self.runnable(s, now):
                continue
            if not s.prefilled:
                if batch:
                    continue  # prefills come on their own turn
                return self.take_prefills(s, now)
            fed = 1 + (len(s.draft.tokens) if s.draft is not None else 0)
            if batch and tokens + fed > self.limits.max_batch_tokens:
                continue
            batch.append(s)
            tokens += fed
            if len(batch) >= self.limits.max_batch_sessions:
                break
        self._to_back(batch)
        return batch or None

    def take_prefills(self, first: Session, now: float) -> Prefills:
        """The prompts to prefill with ``first``, moved to the back of the order."""
        prefills = self.prompts_to_prefill(first, now)
        self._to_back(prefills.sessions)
        return prefills

    def prompts_to_prefill(self, first: Session, now: float) -> Prefills:
        """``first`` and, when batching, the other prompts waiting, in order, while the padded forward (rows × the
        longest chunk) stays within ``max_prefill_tokens``, the rows within ``max_batch_sessions``, and padding
        adds at most PREFILL_PADDING of the chunks' own tokens (padded positions are computed like real ones: a
        long prompt among short ones would cost more than it saves, so it waits for a turn with prompts like it).
        A chunk is what is left of a prompt, up to ``max_prefill_tokens``: a longer prompt takes several turns,
        with the running sessions' rounds between them (chunked prefill)."""
        chosen = [first]
        limits = self.limits
        if not limits.batching:
            return Prefills(chosen)
        longest = real = self._chunk(first)
        rows = 1 if real else 0  # a one-token prompt caches nothing: no row
        for sid in self.order:
            s = self.sessions[sid]
            if s is first or s.prefilled or not self.runnable(s, now):
                continue
            if len(chosen) >= limits.max_batch_sessions:
                break
            n = self._chunk(s)
            if n:
                padded = max(longest, n) * (rows + 1)
                if padded > limits.max_prefill_tokens or padded > (1 + PREFILL_PADDING) * (real + n):
                    continue
                longest, real, rows = max(longest, n), real + n, rows + 1
            chosen.append(s)
        return Prefills(chosen)

    def _chunk(self, s: Session) -> int:
        """Tokens of ``s``'s next prefill chunk."""
        return min(len(s.prompt_to_cache), self.limits.max_prefill_tokens)

    def _to_back(self, taken: list[Session]) -> None:
        for s in taken:
            self.order.remove(s.sid)
            self.order.append(s.sid)
