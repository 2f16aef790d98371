"""The verifier node: owns the target, the sessions and the committed sequences; serves clients and a pool of
drafters.

One thread, one loop: drain both ROUTER sockets (drafters and clients), then run one round for one session that
is ready, round-robin. Every drafter that says hello joins the pool (:mod:`verifier_node.drafters`); each session is
served by one of them (the least loaded that fits) or by none. A session is ready when a draft built on its
committed length is waiting, when its drafter is not alive, or when it has waited as long as its drafter's measured
answer time allows (:mod:`verifier_node.draft_wait`, capped by ``draft_timeout_ms``) — then it takes a plain
autoregressive step instead (same output, only slower). A draft with ``idle_rounds = n`` (the drafter's plan is
k = 0) makes the session step alone, without waiting, for n rounds. A dead or demoted drafter's sessions move to
another live drafter when one fits.

At start-up the verifier measures its cost curve (forward time over 1..K new tokens, cached on disk) and sends it in
the welcome; with ``threads: auto`` it verifies with every core when the drafter idles (k = 0 rounds, synchronous
blocks, no drafter) and with its share while the drafter pre-drafts.

Parts: :mod:`verifier_node.scheduler` (which sessions run next: prefill turns, rounds, batch limits, waits; pure),
:mod:`verifier_node.intake` (a ``generate`` until it is a session: checks, tenant caps, admission, preparation,
grammar start-up), :mod:`verifier_node.pool_policy` (who may join the pool; which drafter serves which session:
assignment, failover, demotion; no sockets), :mod:`verifier_node.rounds` (prefills, batched forwards with the
fallback per session, publishing through the server; the pong's forward counts), :mod:`verifier_node.drafter_out`
(announcements and state tensors to drafters), :mod:`verifier_node.gather` (the short waits before a forward),
:mod:`verifier_node.liveness` (which clients are gone: silent, or their connection closed).
:class:`VerifierServer` is the I/O loop and the message handlers that tie them to the two sockets
(:mod:`verifier_node.settings`); :meth:`VerifierServer.from_config` loads the target, measures its profile and binds.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from shared.config import Config
from shared.cores import CoreLeases, leases_for
from shared.costs.cache import CurveCheck
from shared.models import (
    ProfileSpec,
    ThreadPlan,
    profile_sizes,
    set_threads,
    tokenizer_id,
    vocab_tokens,
)
from shared.protocol import (
    MAX_REPORTS,
    Cancel,
    Chunk,
    Commit,
    Done,
    Draft,
    Generate,
    Heartbeat,
    Hello,
    Message,
    Ping,
    Pong,
    ProtocolError,
    ThreadCounts,
    Welcome,
    decode,
    encode,
    error_frames,
)
from shared.signals import stop_on_signals
from shared.target import Target, TargetOptions, load_target
from shared.tool_calls import parser_name_for_template
from shared.transport import (
    VerifierLinks,
    peer_user_id,
)
from verifier_node.acceptance import AcceptRule
from verifier_node.admission import MemoryAdmission
from verifier_node.detokenize import IncrementalText, tool_marker_ids
from verifier_node.detokenize import decode as detokenize
from verifier_node.draft_check import dense_q, tree_parents
from verifier_node.draft_wait import DraftWait
from verifier_node.drafter_out import DrafterOut
from verifier_node.drafters import DrafterLink, DrafterPool
from verifier_node.gather import Gather
from verifier_node.intake import RequestIntake
from verifier_node.liveness import ClientLiveness
from verifier_node.logprobs import TokenPieces, done_frames, to_wire
from verifier_node.masks import GrammarTooSlow
from verifier_node.pending_draft import PendingDraft
from verifier_node.pool_policy import HelloCheck, PoolPolicy
from verifier_node.request_prep import PrepJob
from verifier_node.rounds import RoundRunner, ThreadSwitch
from verifier_node.scheduler import BatchLimits, Prefills, Scheduler
from verifier_node.session import NumericalError, RoundResult, Session
from verifier_node.settings import VerifierSettings, VerifierSockets

log = logging.getLogger("pipespec.verifier")


@dataclass
class Receipt:
    """How a message arrived: its bytes on the wire and the time its decoding took (for the session's metrics)."""

    nbytes: int
    decode_s: float
    user_id: str | None = None  # the sender's ZAP User-Id (under CURVE its public key, z85), None without CURVE
    frame: Any = None  # its first frame (it knows the connection's descriptor: verifier_node.liveness)


class VerifierServer:
    """The verifier's I/O loop and message handlers; which sessions run is the scheduler's
    (:mod:`verifier_node.scheduler`), which drafter serves them the pool policy's (:mod:`verifier_node.pool_policy`),
    the forwards the round runner's (:mod:`verifier_node.rounds`). :meth:`from_config` loads, measures and binds."""

    def __init__(self, settings: VerifierSettings, target: Target, threads: ThreadPlan, limits: BatchLimits,
                 sockets: VerifierSockets, *, run_secret: str | None = None, forward_delay_s: float = 0.0,
                 accept: AcceptRule | None = None, cores: CoreLeases | None = None,
                 prep_hook: Callable[[PrepJob], None] | None = None):
        """Serve with built parts: the ``target`` (its KV backend, tokenizer and measured profile:
        :mod:`shared.target`), the thread plan (its share already applied), the batch ``limits`` (batching only
        where the target can), bound ``sockets``. ``run_secret``: what a drafter's hello must show where the drafter
        link has no CURVE (None: nothing). ``forward_delay_s`` and ``accept``: see :meth:`from_config`. ``cores``: the
        CPU core leases each forward holds (:mod:`shared.cores`; None: the planned thread counts as they are).
        ``prep_hook``: for tests, run by the preparation worker before each request it prepares (a slow tokenizer or
        compile)."""
        self.settings = settings
        self.draft_timeout = settings.draft_timeout_s
        self.max_bytes = settings.max_message_bytes
        self.client_timeout = settings.client_timeout_s
        self.model_name, self.ensemble_weight = settings.model_name, settings.ensemble_weight
        self.accept_rule = accept
        self.threads = threads
        self.target = target
        self.backend = target.backend
        self.tokenizer = tokenizer = target.tokenizer
        self.pieces = TokenPieces(tokenizer)  # token bytes for requests that ask for log probabilities
        self.profile = target.profile
        self.dtype = target.dtype
        self.vocab_size = target.vocab_size
        self.rollback_refeeds = target.rollback_refeeds  # hybrid / state-space target: see shared/kv.py
        self.hello_check = HelloCheck(self.backend, target.kind, self.model_name, tokenizer_id(tokenizer),
                                      vocab_tokens(tokenizer), self.ensemble_weight, self.draft_timeout, run_secret)
        admission = MemoryAdmission.resolve(settings.max_model_len, settings.max_kv_tokens, target.max_positions,
                                            self.backend.capacity_tokens(), settings.max_kv_tokens_per_tenant,
                                            settings.tenants)
        self.sockets = sockets
        self.drafter_sock, self.client_sock = sockets.drafter, sockets.client
        self.drafter_out = DrafterOut(self.drafter_sock, self.max_bytes)
        self.scheduler = Scheduler(limits)
        self.by_request: dict[tuple[bytes, int], int] = {}
        self.next_sid = 1
        self.pool = DrafterPool()
        self.policy = PoolPolicy(self.pool, self.sessions, self.ensemble_weight, send=self.drafter_out.send,
                                 announce=lambda s, kv: self.announce(s, kv=kv))
        # generate checks, admission and preparation (tokenising, grammar compiles: off this loop)
        self.intake = RequestIntake(settings, tokenizer, self.vocab_size, list(target.end_token_ids),
                                    admission=admission, sessions=self.sessions, requests=self.by_request,
                                    policy=self.policy, tenancy=sockets.tenancy, open_session=self._open_session,
                                    reply=lambda peer, frames: self.client_sock.send_multipart([peer, *frames]),
                                    prep_hook=prep_hook)
        self.prep = self.intake.prep  # a finished preparation wakes the loop through prep.socket
        self.liveness = ClientLiveness(self.client_timeout, self.client_sock)  # clients gone: silent or closed
        self.poller = zmq.Poller()
        for sock in (self.drafter_sock, self.client_sock, self.prep.socket, self.liveness.monitor):
            self.poller.register(sock, zmq.POLLIN)
        switch = ThreadSwitch(threads) if cores is None else ThreadSwitch(threads, apply=lambda n: None)
        self.rounds = RoundRunner(self.backend, self.scheduler, self, switch, CurveCheck(self.profile),
                                  forward_delay_s, cores, settings.grammar_mask_budget_ms / 1000)
        self.gather = Gather(self.scheduler, self.drafter_sock, self.client_sock,  # waits before a forward
                             drain_drafters=lambda: self._drain(self.drafter_sock, self._on_drafter_message),
                             drain_clients=lambda: self._drain(self.client_sock, self._on_client_message),
                             prep_sock=self.prep.socket, drain_prepared=self.intake.admit_prepared,
                             preparing=lambda: [job.arrived for job in self.prep.pending.values()])
        self.running = True

    @classmethod
    def from_config(cls, config: Config, *, links: VerifierLinks, forward_delay_s: float = 0.0,
                    accept: AcceptRule | None = None, model: Any = None, tokenizer: Any = None,
                    prep_hook: Callable[[PrepJob], None] | None = None) -> VerifierServer:
        """Load the target (unless ``model`` / ``tokenizer`` are given), measure its profile and bind the sockets.
        ``config``: the typed config (``runtime.config.typed``; the verifier reads its ``verifier``,
        ``verification`` and ``client`` sections, and the drafter's ``device`` and ``max_draft_tokens``).
        ``links``: CURVE keys and run secret, resolved by the launcher (``runtime.security.verifier_links``).
        ``forward_delay_s`` and ``accept`` exist for tests (tests/node_entry.py injects them): seconds added
        before each target forward, so tests on tiny models (whose forwards take about as long as a drafter's step
        or a message) can rely on drafts made ahead and on requests arriving while a forward runs; and an
        acceptance rule that replaces the method's own (the negative control of the distribution tests).
        ``prep_hook``: see :meth:`__init__`."""
        v = config.verifier
        threads = ThreadPlan.for_node(v.threads, v.device, config.drafter.device)
        set_threads(threads.share)
        spec = ProfileSpec(threads.counts(), profile_sizes(config.drafter.max_draft_tokens), float(v.profile_s),
                           role="verifier")
        # The model, its KV backend and its profile: the loader verifier.backend names (shared/target.py).
        target = load_target(v, TargetOptions(threads.counts(), spec, model=model, tokenizer=tokenizer))
        # Batched verification: one target forward over every session whose round is ready (shared/batch.py).
        max_batch_sessions = v.max_batch_sessions if v.batching else 1
        batching = max_batch_sessions > 1 and target.backend.can_batch()
        if max_batch_sessions > 1 and not batching:
            log.warning("verifier: batched verification is not possible with this target (sliding-window layers or "
                        "an attention kernel without custom masks): one forward per session")
        log.info("verifier: %s in %s, threads %d (share) / %d (full)", v.model, target.dtype,
                 threads.share, threads.full)
        limits = BatchLimits(batching, max_batch_sessions, v.max_batch_tokens, v.max_prefill_tokens)
        settings = VerifierSettings.from_config(config)
        # Without CURVE on the drafter link, a launcher-given secret is what a drafter's hello must show.
        return cls(settings, target, threads, limits, VerifierSockets.bind(config, links),
                   run_secret=links.run_secret, forward_delay_s=forward_delay_s, accept=accept,
                   cores=leases_for(v.device, threads.full, set_threads), prep_hook=prep_hook)

    @property
    def sessions(self) -> dict[int, Session]:
        """The session table (the scheduler's)."""
        return self.scheduler.sessions

    @property
    def batching(self) -> bool:
        return self.scheduler.limits.batching

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        """Loop until :meth:`stop` (any thread; the process entry point :func:`run` stops it on SIGTERM / SIGINT)."""
        log.info("verifier ready: drafters at %s, clients at %s", self.settings.drafter_endpoint,
                 self.settings.client_endpoint)
        try:
            while self.running:
                now = time.monotonic()
                busy = self.scheduler.any_runnable(now)
                timeout_ms = 0 if busy else self.scheduler.idle_timeout_ms()
                events = dict(self.poller.poll(timeout_ms))
                if self.liveness.monitor in events:  # before the clients': a descriptor's new peer clears itself
                    self.liveness.read_monitor()
                if self.drafter_sock in events:
                    self._drain(self.drafter_sock, self._on_drafter_message)
                if self.client_sock in events:
                    self._drain(self.client_sock, self._on_client_message)
                self.intake.admit_prepared()
                self.policy.reap()  # after the drains: a long round must not make a drafter that kept talking look dead
                self._drop_silent_clients()
                work = self.scheduler.next_work()
                if isinstance(work, list) and self.gather.drafts(work, self.rounds.counts.forward_s_ema):
                    work = self.scheduler.next_work()
                elif isinstance(work, Prefills) and self.gather.prompts():
                    first = work.sessions[0]  # the prompt whose turn it is, unless the burst's messages ended it
                    work = (self.scheduler.take_prefills(first, time.monotonic()) if first.sid in self.sessions
                            else self.scheduler.next_work())
                if isinstance(work, Prefills):
                    self.rounds.prefill_batch(work.sessions)
                elif work:
                    self.rounds.run_batch(work)
        finally:
            self.close()

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        self.rounds.masks.close()
        self.intake.close()
        self.liveness.close()
        self.sockets.close()

    def _drain(self, sock: zmq.Socket, handler) -> None:
        for _ in range(1000):  # bounded, so a flood cannot starve the rounds
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer, body = frames[0].bytes, frames[1:]
            t0 = time.monotonic()
            try:
                msg = decode(body, self.max_bytes)
            except ProtocolError as exc:
                log.warning("bad message from %s: %s", peer.hex(), exc)
                sock.send_multipart([peer, *error_frames(str(exc), exc.code, request_id=exc.request_id)])
                continue
            receipt = Receipt(sum(len(f.buffer) for f in body), time.monotonic() - t0, peer_user_id(body[0]), body[0])
            try:
                handler(peer, msg, receipt)
            except ProtocolError as exc:
                sock.send_multipart([peer, *error_frames(str(exc), exc.code, request_id=exc.request_id)])
            except Exception as exc:  # last resort: a bug in a handler fails this message, never the process
                log.exception("internal error handling a %s message from %s", msg.TYPE, peer.hex())
                sock.send_multipart([peer, *error_frames(f"internal error handling {msg.TYPE}: {exc!r:.300}",
                                                         "internal_error",
                                                         request_id=getattr(msg, "request_id", None))])

    def _drop_silent_clients(self) -> None:
        """End what gone clients hold (silent for ``client_timeout``, or their connection closed:
        :mod:`verifier_node.liveness`): their sessions, their requests being prepared or waiting for room."""
        if not self.liveness.due():
            return
        holding = {s.client for s in self.sessions.values()} | self.intake.clients()
        for peer, why in self.liveness.gone(holding).items():
            for s in [s for s in self.sessions.values() if s.client == peer]:
                log.warning("session %d (request %d of client %s): cancelled, the client is gone (%s)", s.sid,
                            s.request_id, peer.hex(), why)
                self.finish(s, "client_gone")
            for rid in self.intake.drop_client(peer):
                log.warning("request %d of client %s: dropped before its session, the client is gone (%s)", rid,
                            peer.hex(), why)

    # -------------------------------------------------------------- drafter side
    def _on_drafter_message(self, peer: bytes, msg: Message, receipt: Receipt) -> None:
        if isinstance(msg, Hello):
            self._on_hello(peer, msg)
            return
        link = self.pool.get(peer)
        if link is None:
            raise ProtocolError("say hello first: this drafter is not connected", code="not_connected")
        link.last_seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            if msg.report is not None:  # what it chose and plans, once after each welcome (listed in pongs)
                msg.report.drafter = link.id
                link.report = msg.report
            self.drafter_out.send(link, encode(Heartbeat()))  # answered: the drafter notices a verifier that went away
            return
        if isinstance(msg, Draft):
            self._on_draft(link, msg, receipt)
            return
        raise ProtocolError(f"a drafter may not send {msg.TYPE!r}", code="unexpected")

    def _on_hello(self, peer: bytes, msg: Hello) -> None:
        """Checked by the pool policy (:class:`verifier_node.pool_policy.HelloCheck`), welcomed with the target's
        facts and cost profile."""
        self.policy.on_hello(peer, msg, self.hello_check, Welcome(
            target=self.model_name, vocab_size=self.vocab_size, want_q=self.ensemble_weight is not None,
            profile=self.profile.to_dict() if self.profile else None,
            threads=ThreadCounts(self.threads.share, self.threads.full), rollback_refeeds=self.rollback_refeeds,
            dtype=self.dtype))

    def announce(
        self, s: Session, hidden: torch.Tensor | None = None, kv: dict[str, torch.Tensor] | None = None
    ) -> None:
        d = s.drafter
        if d is None or self.policy.lacks_q(s.params, d):
            return  # not announced: the session takes plain steps from the target
        self.drafter_out.announce(s, d, self.scheduler.decoding(waiting=True), hidden, kv)

    def _on_draft(self, link: DrafterLink, msg: Draft, receipt: Receipt) -> None:
        s = self.sessions.get(msg.session)
        if s is not None and s.drafter is not link:
            s.metrics.stale_drafts += 1
            return  # from a drafter that no longer serves this session
        # A session is announced once its prompt is cached (verifier_node.rounds): a draft before that is stale.
        if s is None or not (s.prefilled or s.announced) or msg.base_len != len(s.tokens):
            if s is not None:
                s.metrics.stale_drafts += 1
                s.wait.arrived(msg.base_len, time.monotonic(), bool(msg.tokens))  # too late: still a measured delay
            return  # stale or duplicate: harmless by design
        tokens = msg.tokens  # its length and idle_rounds were checked by decode (Draft.validate)
        if not all(0 <= t < self.vocab_size for t in tokens):
            raise ProtocolError(f"draft tokens must be ids in [0, {self.vocab_size})")
        ensemble = self.ensemble_weight is not None
        parents = tree_parents(msg, s, link, ensemble)
        q = dense_q(msg, len(tokens), self.vocab_size) if s.params.do_sample or ensemble else None
        if ensemble and tokens and q is None:
            raise ProtocolError("ensemble verification needs q (q_idx/q_prob or q) with every draft")
        now = time.monotonic()
        s.draft = PendingDraft(tokens, q, msg.idle_rounds, msg.overlap, now, parents)
        s.wait.arrived(len(s.tokens), now, bool(tokens))
        s.metrics.bytes_in += receipt.nbytes
        s.metrics.message_s += receipt.decode_s
        if msg.sent_at is not None:
            s.metrics.transit_s += max(0.0, time.time() - msg.sent_at)
        if msg.stats is not None:  # checked by decode (DrafterStats.check)
            s.metrics.drafter_stats = msg.stats

    # --------------------------------------------------------------- client side
    def _on_client_message(self, peer: bytes, msg: Message, receipt: Receipt) -> None:
        self.liveness.heard(peer, receipt.frame)
        if isinstance(msg, Generate):
            self.intake.receive(peer, msg, receipt.user_id)
        elif isinstance(msg, Cancel):
            sid = self.by_request.get((peer, msg.request_id))
            if sid is not None:
                self.finish(self.sessions[sid], "cancelled")
            elif self.intake.cancel((peer, msg.request_id)):  # cancelled while being prepared
                self.client_sock.send_multipart([peer, *encode(Done(request_id=msg.request_id, token_ids=[], text="",
                                                                    metrics={}, finish_reason="cancelled"))])
        elif isinstance(msg, Ping):
            live = self.pool.live()
            self.client_sock.send_multipart([peer, *encode(Pong(
                drafter_connected=bool(live), drafter_type=live[0].type if live else None,
                drafters=self.pool.describe(), target=self.model_name, sessions=len(self.sessions),
                max_message_bytes=self.max_bytes, heartbeat_timeout_s=self.client_timeout, batching=self.batching,
                reports=[d.report for d in live if d.report is not None][:MAX_REPORTS], tool_parser=self.tool_parser,
                **self.rounds.counts.pong_stats()))])
        else:
            raise ProtocolError(f"a client may not send {msg.TYPE!r}", code="unexpected")

    @functools.cached_property
    def tool_parser(self) -> str | None:
        """The tool-call format of the target's chat template, told to clients in pongs (the HTTP server reads
        calls with it); None where it has none that pipespec knows."""
        return parser_name_for_template(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def tool_markers(self) -> frozenset[int]:
        """The special tokens that open a tool call in the target's family (kept in tool requests' text)."""
        return tool_marker_ids(self.tokenizer)

    def _open_session(self, job: PrepJob) -> None:
        """An admitted request (:mod:`verifier_node.intake`) becomes a session, served by a drafter that fits."""
        prompt, params, rid = job.prompt, job.params, job.msg.request_id
        assert prompt is not None
        sid = self.next_sid
        self.next_sid += 1
        # Under ensemble verification a plain step is not equivalent (it samples from p, not from w·p + (1 − w)·q),
        # so there the wait stays the cap; lossless sessions wait as long as their drafter's answers take.
        wait = DraftWait(self.draft_timeout, adaptive=self.ensemble_weight is None)
        s = Session(sid, self.backend, self.tokenizer, prompt, params, job.peer, rid, self.ensemble_weight, job.wanted,
                    wait, accept=self.accept_rule, grammar=job.grammar)
        s.tenant = job.scope
        if job.msg.tools is not None and self.tool_markers:  # the call markers stay in a tool request's text
            s.text = IncrementalText(self.tokenizer, self.tool_markers)
        self.scheduler.add(s)
        self.by_request[(job.peer, rid)] = sid
        self.policy.reassign(s)

    # ------------------------------------------------------------------ rounds
    def _fail(self, s: Session, code: str, message: str) -> None:
        """End a session with an ``error`` to its client (its request_id and ``code``) and a ``session_end`` to the
        drafter, and free it."""
        if s.sid not in self.sessions:
            return  # already gone
        self.client_sock.send_multipart([s.client, *error_frames(message, code, request_id=s.request_id)])
        self._release(s)

    def _release(self, s: Session) -> None:
        """Free an ended session: out of the tables, and a ``session_end`` to its drafter, if it had one."""
        if not self.scheduler.remove(s):
            return
        s.close()  # its KV slot goes back to the backend
        self.by_request.pop((s.client, s.request_id), None)
        self.policy.detach(s)

    # ------------------------------------------------------- the rounds' output (verifier_node.rounds.RoundOutput)
    def demoted(self, s: Session) -> None:
        self.policy.on_demoted(s)

    def round_failed(self, s: Session, exc: Exception) -> None:
        if isinstance(exc, NumericalError):
            log.error("session %d failed: %s", s.sid, exc)
            self._fail(s, "numerical_error", str(exc))
        elif isinstance(exc, GrammarTooSlow):  # the request's own grammar: its client's error, not the node's
            log.warning("session %d failed: %s", s.sid, exc)
            self._fail(s, "bad_request", str(exc))
        else:
            log.error("session %d failed in a round", s.sid, exc_info=exc)
            self._fail(s, "internal_error", f"the verifier failed on this request: {exc!r:.300}")

    def publish(self, s: Session, r: RoundResult, decoding: int) -> None:
        t0 = time.monotonic()
        if s.announced and s.drafter is not None:
            frames = encode(Commit(session=s.sid, base_len=r.base_len, tokens=r.tokens,
                                   drafted=r.drafted, accepted=r.accepted, verify_s=r.forward_s, threads=r.threads,
                                   batch_sessions=r.batch_sessions, batch_tokens=r.batch_tokens,
                                   decoding=decoding, tensors=self.drafter_out.extras(s, r.hidden, r.kv)))
            s.metrics.bytes_out += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
            self.drafter_out.send(s.drafter, frames)
        delta = s.text.push(r.tokens)
        logprobs = to_wire(r.logprobs, self.pieces) if r.logprobs is not None else None
        if logprobs is not None:
            s.logprobs.extend(logprobs)  # the done message lists every token's
        self.client_sock.send_multipart([s.client, *encode(Chunk(request_id=s.request_id, token_ids=r.tokens,
                                                                 text=delta, logprobs=logprobs))])
        s.metrics.message_s += time.monotonic() - t0

    def finish(self, s: Session, reason: str) -> None:
        try:
            text = detokenize(self.tokenizer, s.generated, s.text.keep)
            d = s.drafter
            metrics = {**s.summary(verifier_dtype=self.dtype, drafter_dtype=d.dtype if d else None),
                       **s.wait.summary(), "drafter_ids": list(s.served_by), "drafter_type": d.type if d else None}
            frames = done_frames(Done(request_id=s.request_id, token_ids=s.generated, text=text, metrics=metrics,
                                      finish_reason=reason,
                                      logprobs=s.logprobs if s.params.logprobs is not None else None))
        except Exception as exc:  # detokenization or the metrics: the request fails, the node does not
            log.exception("session %d failed to finish", s.sid)
            self._fail(s, "internal_error", f"the verifier failed to finish this request: {exc!r:.300}")
            return
        self.client_sock.send_multipart([s.client, *frames])
        self._release(s)


def run(config: Config, links: VerifierLinks, forward_delay_s: float = 0.0,
        accept: AcceptRule | None = None, prep_hook: Callable[[PrepJob], None] | None = None) -> None:
    """Entry point of the verifier process: ``config`` built once by the caller (``runtime.config.typed``);
    ``links``, ``forward_delay_s``, ``accept``, ``prep_hook``: see :meth:`VerifierServer.from_config`."""
    server = VerifierServer.from_config(config, links=links, forward_delay_s=forward_delay_s, accept=accept,
                                        prep_hook=prep_hook)
    stop_on_signals(server.stop)
    server.serve()
