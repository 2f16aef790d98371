"""The verifier loop's short waits before a forward, so that messages on their way share it: drafts of one batched
drafter step (sent back to back) before a round, and the requests of one client's burst before a prefill. Both
read their socket through the loop's own drain (its handlers), and only where the target verifies in batches."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from verifier_node.scheduler import Scheduler
from verifier_node.session import Session

#: Longest wait for drafts on their way before a batched round runs without them (a tenth of a forward, at most).
GATHER_MAX_S = 0.005
#: Requests sent together (one client's burst) arrive a few ms apart: before prefilling a prompt that arrived less
#: than PROMPT_GATHER_S ago, the client socket is read for more, each arrival extending the wait by as much, up to
#: PROMPT_GATHER_MAX_S in all, so a burst shares one forward instead of its first prompt taking one alone. Requests
#: of the burst still being prepared (a text prompt tokenised, verifier_node.request_prep; one that arrived less than
#: PROMPT_GATHER_MAX_S ago) hold the wait until they are sessions: an HTTP request's ``n`` choices are such a burst.
PROMPT_GATHER_S = 0.01
PROMPT_GATHER_MAX_S = 0.05


class Gather:
    """The waits over ``scheduler``'s sessions; ``drain_drafters`` / ``drain_clients`` read every message waiting
    on ``drafter_sock`` / ``client_sock`` (the loop's handlers)."""

    def __init__(self, scheduler: Scheduler, drafter_sock: zmq.Socket, client_sock: zmq.Socket, *,
                 drain_drafters: Callable[[], None], drain_clients: Callable[[], None],
                 prep_sock: zmq.Socket | None = None, drain_prepared: Callable[[], None] | None = None,
                 preparing: Callable[[], list[float]] | None = None):
        """``prep_sock``, ``drain_prepared``, ``preparing``: the preparation workers' wake-up socket, the loop's
        admission of the requests they finished, and when each request still being prepared arrived."""
        self.scheduler = scheduler
        self.drafter_sock, self.client_sock = drafter_sock, client_sock
        self.drain_drafters, self.drain_clients = drain_drafters, drain_clients
        self.prep_sock, self.drain_prepared = prep_sock, drain_prepared
        self.preparing = preparing or (lambda: [])
        self._poller = zmq.Poller()
        for sock in (client_sock, prep_sock):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)

    def drafts(self, batch: list[Session], forward_s: float) -> bool:
        """Let drafts on their way join this round: a drafter sends one batched step's blocks back to back, and a
        round started on the first would leave the rest for a forward of their own. While sessions outside ``batch``
        still wait for a draft, read the drafter socket for up to a tenth of a recent forward (``forward_s``; at
        most GATHER_MAX_S). True if anything arrived."""
        limits = self.scheduler.limits
        if not limits.batching or len(batch) >= limits.max_batch_sessions:
            return False
        deadline = time.monotonic() + min(GATHER_MAX_S, 0.1 * forward_s)
        got = False
        while True:
            now = time.monotonic()
            if now >= deadline or not self.scheduler.drafting_elsewhere(batch, now):
                return got
            if not self.drafter_sock.poll(max(1, int(1000 * (deadline - now)))):
                return got
            self.drain_drafters()
            got = True

    def prompts(self) -> bool:
        """Before a prefill, read the requests of a burst still arriving (see PROMPT_GATHER_S). True if anything
        arrived."""
        if not self.scheduler.limits.batching:
            return False
        deadline = time.monotonic() + PROMPT_GATHER_MAX_S
        got = False
        while True:
            now = time.monotonic()
            waiting = self.scheduler.prompts_waiting()
            if len(waiting) >= self.scheduler.limits.max_batch_sessions:
                break
            # a burst's request still being prepared holds the gather (to its end) until it is a session
            preparing = any(now - arrived < PROMPT_GATHER_MAX_S for arrived in self.preparing())
            until = deadline if preparing else min(deadline, max(waiting, default=0.0) + PROMPT_GATHER_S)
            if now >= until:
                break
            ready = dict(self._poller.poll(max(1, int(1000 * (until - now)))))
            if not ready:
                break
            if self.client_sock in ready:
                self.drain_clients()
            if self.prep_sock is not None and self.prep_sock in ready and self.drain_prepared is not None:
                self.drain_prepared()
            got = True
        return got
