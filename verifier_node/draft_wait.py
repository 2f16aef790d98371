"""How long the verifier waits for one session's next draft, and when it stops waiting for that drafter.

A fixed wait per round made a drafter that heartbeats but never drafts cost ``draft_timeout_ms`` every round. Here
each session measures how long its drafter takes to answer a commit (the *arrival delay*: from the moment a
committed length became ready to the moment a draft built on it arrived; a draft that came too late still counts)
and waits at most ``WAIT_FACTOR`` × the largest of the last ``WINDOW`` delays, never less than ``FLOOR_S`` and never
more than the cap (``verifier.draft_timeout_ms``). The first block with tokens includes the drafter's own prefill of
the prompt (a drafter prefills lazily, at its first drafting step, which may come after rounds planned at k = 0: a
probe), so until one has been timed the wait may take the whole cap; empty blocks (k = 0 plans, answered at once)
do not use that up, only a round that waited the cap and missed does.

A round that finds no draft when the wait runs out is a *miss* (the verifier takes a plain step: the same output).
After ``DEMOTE_AFTER`` misses in a row the drafter is *demoted* for that session: the next ``probe_gap`` rounds
do not wait at all (a draft that is already there is still used), then one round waits again as a probe. A probe
that misses demotes again with twice the gap (at most ``PROBE_GAP_MAX`` rounds); any draft that is there in time
promotes the drafter back and resets the gap. Under static ensemble verification a plain step changes the output
distribution, so there the wait is always the cap and nothing is demoted.
"""

from __future__ import annotations

from collections import deque
from typing import Any

#: The wait is this multiple of the slowest recent arrival delay.
WAIT_FACTOR = 3.0
#: Never wait less than this for a draft that is due (scheduling noise on a loaded host is tens of ms).
FLOOR_S = 0.1
#: Arrival delays remembered per session.
WINDOW = 16
#: Misses in a row that demote a drafter for a session.
DEMOTE_AFTER = 3
#: Rounds taken without waiting after a demotion (doubling per failed probe, up to the max).
PROBE_GAP_MIN = 8
PROBE_GAP_MAX = 128
#: Committed lengths whose ready time is kept, so that a late draft can still be timed.
_READY_KEPT = 32


class DraftWait:
    """One session's wait for its drafter: measured arrival delays, misses, demotion and probes."""

    def __init__(self, cap_s: float, adaptive: bool = True):
        self.cap_s = cap_s
        self.adaptive = adaptive
        self.delays: deque[float] = deque(maxlen=WINDOW)
        self.ready_at: dict[int, float] = {}
        self.misses_in_row = 0
        self.plain_left = 0  # rounds still to take without waiting (demoted)
        self.probe_gap = PROBE_GAP_MIN
        self.cap_missed = False  # a round waited the cap for this drafter's first block with tokens, in vain
        # The longest block its drafter may send takes about this long to draft (from its announced profile): blocks
        # sized by the drafter's confidence vary from 1 to max_draft_tokens steps, and a long one after short ones
        # must not look like a miss.
        self.block_floor_s = 0.0
        # totals for the request's metrics
        self.waited_s = 0.0
        self.misses = 0
        self.demotions = 0

    def reset(self) -> None:
        """A new drafter serves the session: forget what was measured of the previous one."""
        self.delays.clear()
        self.ready_at.clear()
        self.misses_in_row = 0
        self.plain_left = 0
        self.probe_gap = PROBE_GAP_MIN
        self.cap_missed = False

    @property
    def demoted(self) -> bool:
        return self.plain_left > 0

    def limit_s(self) -> float:
        """How long, from the moment the session became ready, to wait for a draft now."""
        if not self.adaptive:
            return self.cap_s
        if self.plain_left > 0:
            return 0.0
        if self.delays:
            return min(self.cap_s, max(FLOOR_S, self.block_floor_s, WAIT_FACTOR * max(self.delays)))
        # Nothing measured: the first block with tokens may take the cap (it includes the drafter's prefill); after a
        # miss with nothing measured the drafter has not answered within the cap even once, so a probe costs the
        # floor only.
        return self.cap_s if not self.cap_missed else min(self.cap_s, FLOOR_S)

    def ready(self, length: int, now: float) -> None:
        """The session's committed length became ``length`` at ``now`` (after a prefill, a round, an announce)."""
        self.ready_at[length] = now
        if len(self.ready_at) > _READY_KEPT:
            for old in sorted(self.ready_at)[: len(self.ready_at) - _READY_KEPT]:
                del self.ready_at[old]

    def arrived(self, base_len: int, now: float, has_tokens: bool) -> None:
        """A draft built on ``base_len`` arrived (in time or late). Empty blocks (k = 0 plans) are answered at once
        and say nothing about how long a block takes, so only blocks with tokens are timed."""
        start = self.ready_at.get(base_len)
        if has_tokens and start is not None and now >= start:
            self.delays.append(now - start)

    def outcome(self, got_draft: bool, waited_s: float) -> bool:
        """A round that could have used a draft ran: with one (``got_draft``) or without, after ``waited_s``.
        True when this round demoted the drafter (the server may then move the session to another drafter)."""
        self.waited_s += waited_s
        demoted = False
        if not self.adaptive:
            return False
        if got_draft:
            self.misses_in_row = 0
            self.plain_left = 0
            self.probe_gap = PROBE_GAP_MIN
        elif self.plain_left > 0:
            self.plain_left -= 1
            return False
        else:
            self.misses += 1
            self.misses_in_row += 1
            self.cap_missed = True
            if self.misses_in_row >= DEMOTE_AFTER:
                self.demote()
                demoted = True
        return demoted

    def demote(self) -> None:
        self.demotions += 1
        self.plain_left = self.probe_gap
        self.probe_gap = min(PROBE_GAP_MAX, 2 * self.probe_gap)
        self.misses_in_row = DEMOTE_AFTER - 1  # a failed probe demotes again at once

    def summary(self) -> dict[str, Any]:
        return {"draft_wait_s": self.waited_s, "draft_misses": self.misses, "demotions": self.demotions}
