"""Grammar masks within a budget, off the verifier's loop.

A structured-output round fills one token mask per position it verifies (up to about 35); a schema whose masks are
slow to fill (a large ``maxLength``; xgrammar issues 852 and 917) would otherwise stretch every stream on the
verifier. Here:

* each grammar session's round is planned (its masks filled) on a worker thread (:class:`MaskWorkers`; xgrammar's
  ``fill_next_token_bitmask`` runs outside Python's lock), and the loop waits for a plan only briefly when other
  sessions could use the forward: a plan not ready by then joins a later round, and the scheduler skips its session
  meanwhile, so the loop keeps serving;
* each session's mask time per round is measured against its share of a round, ``verifier.grammar_mask_budget_ms``
  (:class:`MaskBudget`): a session over it is shrunk (fewer forced and draft positions next round, as many as fit
  its measured time per mask), grows back while it stays well under, and a session over its share even at one
  position per round for :data:`MASK_STRIKES` rounds in a row fails with :class:`GrammarTooSlow` (its request's
  ``bad_request`` error, naming the request).

Fewer positions never change the output (the tokens left out come in later rounds, each masked with the grammar
unchanged): only the session's own speed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pipespec.verifier")

#: Rounds in a row over the budget at one position per round (one mask) before the session fails.
MASK_STRIKES = 3
#: The shortest wait for plans still in work when other sessions are ready (the forward does not wait longer than
#: this, or a quarter of the recent forward time, or the budget: the plan joins a later round instead).
MASK_GRACE_S = 0.005
#: Worker threads filling masks (a session's plans run one at a time, so one slow session holds one thread).
MASK_THREADS = 4
#: A shrunk session grows back (doubling) while its rounds take at most this part of the budget; above this many
#: positions the cap is lifted.
GROW_BELOW = 0.5
GROW_LIMIT = 64


class GrammarTooSlow(RuntimeError):
    """A session's grammar masks stayed over its share of a round at the smallest round: its request fails."""


@dataclass
class MaskBudget:
    """One session's mask time against its share of a round (``budget_s``), and the positions cap that follows.

    :meth:`record` takes a round's mask seconds and fills: over the budget with room to shrink, the cap becomes the
    positions whose masks fit at the measured time per mask (always fewer than the round used); over it at one mask
    per round (nothing left to shrink), a strike; :data:`MASK_STRIKES` strikes in a row: ``"failed"``. A round under
    the budget clears the strikes, and one under :data:`GROW_BELOW` of it doubles the cap (lifted past
    :data:`GROW_LIMIT`)."""

    budget_s: float
    positions: int | None = None  # the most tokens a round verifies (None: no cap)
    strikes: int = 0
    shrunk: int = 0  # times the cap went down (metrics, tests)
    last_s: float = 0.0
    worst_s: float = 0.0  # the most mask time of one round (metrics, tests)

    def record(self, seconds: float, fills: int) -> str:
        """One round's mask work: ``"ok"``, ``"grown"``, ``"shrunk"``, ``"over"`` (a strike) or ``"failed"``."""
        self.last_s = seconds
        self.worst_s = max(self.worst_s, seconds)
        if seconds <= self.budget_s:
            self.strikes = 0
            if self.positions is not None and seconds <= GROW_BELOW * self.budget_s:
                grown = self.positions * 2 + 1
                self.positions = None if grown > GROW_LIMIT else grown
                return "grown"
            return "ok"
        if fills > 1:  # room to shrink: as many positions as fit (the bonus row's mask included), fewer than used
            per_mask = seconds / fills
            fit = max(0, math.floor(self.budget_s / per_mask) - 1)
            self.positions = min(fills - 2, fit if self.positions is None else min(self.positions, fit))
            self.strikes = 0
            self.shrunk += 1
            return "shrunk"
        self.strikes += 1
        return "failed" if self.strikes >= MASK_STRIKES else "over"


class MaskWorkers:
    """Plans grammar rounds on worker threads and keeps each session's mask time within ``budget_s`` a round.

    ``pending``: by session id, the rounds whose plan was still in work when their batch ran (the session joins a
    later batch once it is done: :meth:`take`). The pool starts with the first grammar round."""

    def __init__(self, budget_s: float, threads: int = MASK_THREADS):
        self.budget_s = float(budget_s)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self.pending: dict[int, Any] = {}  # sid -> PendingRound (verifier_node.rounds) whose plan is in work

    def _submit(self, fn: Callable[[], Any]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pipespec-masks")
        return self._pool.submit(fn)

    def start(self, r: Any) -> None:
        """Start the plan of ``r`` (a PendingRound whose ``make_plan`` fills its masks) on a worker."""
        r.session.grammar.job = self._submit(self._after_peek(r.session.grammar, r.make_plan))

    def collect(self, rounds: list[Any], wait_s: float) -> tuple[list[Any], list[tuple[Any, Exception]]]:
        """Wait up to ``wait_s`` for the started plans of ``rounds``: (the rounds ready now, (session, error) of
        those that failed). The rest stay :attr:`pending`."""
        done, _ = wait([r.session.grammar.job for r in rounds], timeout=max(0.0, wait_s))
        ready, failed = [], []
        for r in rounds:
            if r.session.grammar.job in done:
                try:
                    ready.append(self._finish(r))
                except Exception as exc:
                    failed.append((r.session, exc))
            else:
                self.pending[r.session.sid] = r
        return ready, failed

    @staticmethod
    def _after_peek(g: Any, make_plan: Callable[[], Any]) -> Callable[[], Any]:
        """The plan, run once the committed text's peek is done (submitted before it, so never queued behind it):
        the plan starts from the peeked mask, and no fill of the committed text lands while the matcher is advanced."""
        peek = g.peek

        def run() -> Any:
            if peek is not None:
                peek.exception()  # waits; its error, if any, the plan meets again on its own fill
            return make_plan()
        return run

    def take(self, s: Any) -> Any:
        """The round of ``s`` whose plan finished since its batch ran (None: none waits); raises where the plan
        failed or the session is over its budget for good."""
        r = self.pending.pop(s.sid, None)
        if r is None:
            return None
        s.draft = None  # a draft that came while the plan was in work is built on the text this round replaces
        return self._finish(r)

    def forget(self, live: set[int]) -> None:
        """Drop the pending rounds of sessions that ended meanwhile (their plans' results are never read)."""
        for sid in [sid for sid in self.pending if sid not in live]:
            del self.pending[sid]

    def _finish(self, r: Any) -> Any:
        s, g = r.session, r.session.grammar
        r.plan = g.job.result()
        g.job = None
        self.account(s)
        return r

    def account(self, s: Any) -> None:
        """Charge the session's mask time since its last round to its budget; shrink it, or fail it for good."""
        g = s.grammar
        if g.budget is None:
            g.budget = MaskBudget(self.budget_s)
        seconds, fills = g.take_mask_time()
        budget: MaskBudget = g.budget
        verdict = budget.record(seconds, fills)
        g.positions = budget.positions
        if verdict == "shrunk":
            log.info("session %d (request %d): grammar masks took %.1f ms in %d fills, over its %.0f ms share of a "
                     "round: at most %d positions a round now", s.sid, s.request_id, 1000 * seconds, fills,
                     1000 * self.budget_s, budget.positions)
        elif verdict == "failed":
            raise GrammarTooSlow(
                f"request {s.request_id}: its grammar's token masks took {1000 * seconds:.0f} ms a round at one "
                f"position per round, {MASK_STRIKES} rounds in a row, over verifier.grammar_mask_budget_ms = "
                f"{1000 * self.budget_s:.0f} ms; use a simpler schema or grammar (for example a smaller maxLength "
                "or fewer repeats)")

    def peek(self, s: Any) -> None:
        """After a commit: fill the committed text's mask on a worker (what the scheduler's forced-token check and
        the next plan start from), so the loop never fills one."""
        s.grammar.peek = self._submit(s.grammar.first_mask)

    def grace_s(self, forward_s: float) -> float:
        """How long a batch with other ready rows waits for plans still in work."""
        return min(self.budget_s, max(MASK_GRACE_S, 0.25 * forward_s))

    def close(self) -> None:
        """Stop the workers (plans in work finish; nothing waits for them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
