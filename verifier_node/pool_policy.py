"""Which drafter of the pool serves which session: who may join (:class:`HelloCheck`: the checks of a hello),
assignment (the least-loaded live drafter that fits), a hello again, failover of a silent drafter's sessions and
demotion of one that keeps missing. No sockets: what goes to a drafter (its welcome, a session's end, its
announcement) goes through callbacks the server gives; the clock is injectable.

The pool itself (who is connected, alive, how loaded) is :class:`verifier_node.drafters.DrafterPool`; the sessions
are the scheduler's table (:class:`verifier_node.scheduler.Scheduler`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.costs.curve import NodeProfile
from shared.models import VocabPrefixes, vocab_prefix_matches
from shared.protocol import ANY_TOKENIZER, Hello, Message, ProtocolError, SessionEnd, encode
from shared.sampling import GenerationParams
from shared.target import KVRowsError, TargetBackend
from shared.transport import SECRET_ENV, secret_matches
from verifier_node.drafters import DrafterLink, DrafterPool
from verifier_node.session import Session

#: How often the pool is checked for drafters that went silent.
REAP_EVERY_S = 0.1
#: A session waits at least this multiple of its drafter's longest block (profile: steps × one step's cost).
BLOCK_WAIT_FACTOR = 1.5

log = logging.getLogger("pipespec.verifier")

#: Sends encoded frames to a drafter.
Send = Callable[[DrafterLink, list], None]
#: Announces a session to its (new) drafter, with the K/V rows it holds for it (or None).
Announce = Callable[[Session, "dict[str, torch.Tensor] | None"], None]


@dataclass(frozen=True)
class HelloCheck:
    """Who may join the pool: a drafter of this run (``run_secret``, where the drafter link has no CURVE; None:
    anyone the link lets in), with the target's tokenizer (``tokenizer_id``, or a GGUF token list that is a prefix
    of ``vocab_tokens``), q where ensemble verification needs it, and K/V rows the target's ``backend`` can provide.
    ``draft_timeout``: the cap on a session's wait for a draft (bounds the drafter's measured block time)."""

    backend: TargetBackend
    target_kind: str
    model_name: str
    tokenizer_id: str
    vocab_tokens: list[str]
    ensemble_weight: float | None
    draft_timeout: float
    run_secret: str | None = None

    def __post_init__(self) -> None:
        # the target's prefix fingerprints, computed here (at start-up) and remembered, not at every hello on the loop
        object.__setattr__(self, "_prefixes", VocabPrefixes(self.vocab_tokens))

    def check(self, peer: bytes, msg: Hello) -> DrafterLink:
        """The link of the drafter ``peer`` that sent ``msg``, or a :class:`ProtocolError` saying why it may not
        join (``unauthorized``, ``tokenizer_mismatch``, ``ensemble_needs_q``, ``unsupported``, ``bad_message``)."""
        if self.run_secret is not None and not secret_matches(self.run_secret, msg.run_secret):
            log.warning("refused a hello from %s: no valid run secret (not a drafter of this run)", peer.hex())
            raise ProtocolError("unauthorized: this verifier takes drafters of its own run only (a hello must carry "
                                f"the run secret from ${SECRET_ENV})", code="unauthorized")
        if msg.tokenizer_id not in (self.tokenizer_id, ANY_TOKENIZER) and not vocab_prefix_matches(
                msg.tokenizer_id, self._prefixes):
            log.error("refused drafter %r: tokenizer %s != target's %s", msg.drafter_type, msg.tokenizer_id,
                      self.tokenizer_id)
            raise ProtocolError(
                f"tokenizer mismatch: the drafter's tokenizer ({msg.tokenizer_id}) is not the target's "
                f"({self.tokenizer_id}); drafter type {msg.drafter_type!r} needs the target's tokenizer",
                code="tokenizer_mismatch",
            )
        drafter = DrafterLink(peer, msg.drafter_type, msg.capabilities, msg.host)
        if self.ensemble_weight is not None and not drafter.sends_q:
            log.error("refused drafter %r: ensemble verification needs q, it sends none", drafter.type)
            raise ProtocolError(
                f"static ensemble verification (verification.ensemble_weight = {self.ensemble_weight}) needs the "
                f"draft distribution q; drafter type {drafter.type!r} sends none (it is not supported with drafters "
                "that have no q, such as prompt lookup): unset verification.ensemble_weight or use a model drafter",
                code="ensemble_needs_q",
            )
        self._check_kv_layers(msg, drafter)
        if msg.profile is not None:
            self._read_profile(msg, drafter)
        return drafter

    def _check_kv_layers(self, msg: Hello, drafter: DrafterLink) -> None:
        if drafter.kv_layers:
            try:
                self.backend.check_kv_layers(drafter.kv_layers)
            except KVRowsError as exc:
                log.error("refused drafter %r: %s", msg.drafter_type, exc)
                raise ProtocolError(
                    f"drafter type {msg.drafter_type!r} needs K/V rows of target layers {drafter.kv_layers}, "
                    f"which this target ({self.model_name}, {self.target_kind}) cannot provide: {exc}",
                    code="unsupported",
                ) from None

    def _read_profile(self, msg: Hello, drafter: DrafterLink) -> None:
        """The drafter's dtype and longest block time, from the cost profile its hello carries."""
        try:
            profile = NodeProfile.from_dict(msg.profile)
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"hello: bad cost profile: {exc}") from None
        drafter.dtype = profile.dtype
        # its profile covers 1 .. max_draft_tokens + 1 rows: the longest block is that many steps, less one
        curve = profile.curve(max(profile.curves))
        drafter.block_s = min(self.draft_timeout, BLOCK_WAIT_FACTOR * max(1, curve.sizes[-1] - 1) * curve.cost(1))


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
        """``link`` may serve ``s``: the type the request asked for (if any), q where ensemble verification needs it;
        none serves a request that turned speculation off (``num_draft_tokens`` 0: the target steps alone)."""
        return ((s.drafter_type is None or link.type == s.drafter_type) and not self.lacks_q(s.params, link)
                and s.params.num_draft_tokens != 0)

    def on_hello(self, peer: bytes, msg: Hello, check: HelloCheck, welcome: Message) -> None:
        """A drafter said hello: if ``check`` lets it in, it joins the pool (or rejoins), gets ``welcome`` and its
        sessions (:meth:`on_joined`); else the :class:`ProtocolError` of the check, to be sent to it."""
        link, again = self.pool.join(check.check(peer, msg))
        log.info("drafter %s %s: caps=%s dtype=%s", link.label(), "said hello again" if again else "joined",
                 msg.capabilities, link.dtype)
        self.send(link, encode(welcome))
        self.on_joined(link, again)

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
