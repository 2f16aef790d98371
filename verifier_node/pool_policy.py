"""Which drafter of the pool serves which session: assignment (the least-loaded live drafter that fits), a hello
again, failover of a silent drafter's sessions and demotion of one that keeps missing. No sockets: what goes to a
drafter (a session's end, its announcement) goes through callbacks the server gives; the clock is injectable.

The pool itself (who is connected, alive, how loaded) is :class:`verifier_node.drafters.DrafterPool`; the sessions
are the scheduler's table (:class:`verifier_node.scheduler.Scheduler`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from shared.protocol import SessionEnd, encode
from shared.sampling import GenerationParams
from verifier_node.drafters import DrafterLink, DrafterPool
from verifier_node.session import Session

#: How often the pool is checked for drafters that went silent.
REAP_EVERY_S = 0.1

log = logging.getLogger("pipespec.verifier")

#: Sends encoded frames to a drafter.
Send = Callable[[DrafterLink, list], None]
#: Announces a session to its (new) drafter, with the K/V rows it holds for it (or None).
Announce = Callable[[Session, "dict[str, torch.Tensor] | None"], None]


class PoolPolicy:
    """Assigns the sessions of ``sessions`` to the drafters of ``pool`` and keeps each link's session set and each
    session's drafter, wait and ``served_by`` in step."""

    def __init__(self, pool: DrafterPool, sessions: dict[int, Session], ensemble_weight: float | None, *,
                 send: Send, announce: Announce, now: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.sessions = sessions
        self.ensemble_weight = ensemble_weight
        self.send = send
        self.announce = announce
        self.now = now
        self._next_reap = 0.0

    def lacks_q(self, params: GenerationParams, drafter: DrafterLink | None) -> bool:
        """Ensemble verification of a request whose drafts would come without q (greedy, drafter without greedy_q)."""
        return (self.ensemble_weight is not None and drafter is not None and not params.do_sample
                and not drafter.greedy_q)

    def fits(self, s: Session, link: DrafterLink) -> bool:
        """``link`` may serve ``s``: the type the request asked for (if any), q where ensemble verification needs it."""
        return (s.drafter_type is None or link.type == s.drafter_type) and not self.lacks_q(s.params, link)

    def on_joined(self, link: DrafterLink, again: bool) -> None:
        """A drafter (re)joined: it learns its own sessions afresh (a hello again: it may have lost them), and takes
        the sessions that have no live drafter (least loaded first: two drafters joining share them)."""
        if again:
            for sid in sorted(link.sessions):
                s = self.sessions[sid]
                self.detach(s, notify=False)
                if self.fits(s, link):
                    self.attach(s, link)
        for s in list(self.sessions.values()):
            if s.drafter is None or not s.drafter.alive(self.now()) or s.wait.demoted:  # demoted: the newcomer may
                self.reassign(s)                                                         # draft for it

    def reassign(self, s: Session) -> None:
        """Move ``s`` to the least-loaded live drafter that fits (and was not demoted for it); keep it where it is
        if there is none (a session without a live drafter takes plain steps)."""
        target = self.pool.pick(lambda d: self.fits(s, d), exclude=s.tried, now=self.now())
        if target is not None and target is not s.drafter:
            self.detach(s)
            self.attach(s, target)

    def attach(self, s: Session, link: DrafterLink) -> None:
        s.drafter = link
        link.sessions.add(s.sid)
        if not s.served_by or s.served_by[-1] != link.id:
            s.served_by.append(link.id)
        s.wait.reset()
        s.wait.block_floor_s = link.block_s
        if s.prefilled:  # announced with the state the drafter needs (held K/V rows; hidden states come per commit)
            self.announce(s, s.lm.held_rows(link.kv_layers) if link.kv_layers else None)

    def detach(self, s: Session, notify: bool = True) -> None:
        """Take ``s`` from its drafter (``notify``: with a ``session_end`` to it, if it was announced there)."""
        d = s.drafter
        if d is None:
            return
        if notify and s.announced:
            self.send(d, encode(SessionEnd(session=s.sid)))
        d.sessions.discard(s.sid)
        s.drafter = None
        s.announced = False
        s.draft = None
        s.solo_left = 0  # that drafter's k = 0 plan

    def reap(self) -> None:
        """Drafters that went silent: their sessions move to a live drafter that fits (else they take plain steps
        and stay, so a drafter that was only busy resumes them); after FORGET_AFTER_S they leave the pool. Checked
        at most every REAP_EVERY_S."""
        now = self.now()
        if now < self._next_reap:
            return
        self._next_reap = now + REAP_EVERY_S
        for link in self.pool.forget_silent(now):
            log.warning("drafter %s removed from the pool (silent for %.0f s)", link.label(), now - link.last_seen)
            for sid in sorted(link.sessions):
                s = self.sessions[sid]
                self.detach(s, notify=False)
                self.reassign(s)
        for link in self.pool.dead(now):
            if not link.reported_dead:
                link.reported_dead = True
                log.warning("drafter %s silent for %.1f s: its %d session(s) move to a live drafter or step alone",
                            link.label(), now - link.last_seen, len(link.sessions))
            for sid in sorted(link.sessions):
                self.reassign(self.sessions[sid])
        for link in self.pool.live(now):
            link.reported_dead = False

    def on_demoted(self, s: Session) -> None:
        """Its drafter kept missing for ``s``: move it to another live drafter (one not demoted for it before) when
        one fits; else it stays, taking plain steps with a probe now and then (verifier_node.draft_wait)."""
        d = s.drafter
        log.info("session %d: drafter %s demoted after %d misses", s.sid, d.label() if d else "?", s.wait.misses)
        if d is not None:
            s.tried.add(d.id)
        self.reassign(s)
