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
:mod:`verifier_node.pool_policy` (which drafter serves which session: assignment, failover, demotion; no sockets),
:mod:`verifier_node.rounds` (prefills, batched forwards with the fallback per session, publishing through the
server). :class:`VerifierServer` is the I/O loop and the message handlers that tie them to the two sockets;
:meth:`VerifierServer.from_config` loads the target, measures its profile and binds.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from shared.backend import DynamicBackend, TargetBackend, make_backend
from shared.config import DRAFTER_TYPE_NAMES, Config
from shared.config_sections import VerifierConfig
from shared.cores import CoreLeases, leases_for
from shared.costs.cache import CurveCheck
from shared.costs.curve import NodeProfile
from shared.costs.measure import measuring_alone
from shared.kv import CachedLM, KVRowsError
from shared.models import (
    ProfileSpec,
    ThreadPlan,
    default_eos_ids,
    load_causal_lm,
    load_tokenizer,
    logits_vocab_size,
    model_dtype,
    profile_node,
    profile_sizes,
    resolve_model,
    set_threads,
    tokenizer_id,
    vocab_prefix_matches,
    vocab_tokens,
)
from shared.node_keys import kv_slots
from shared.protocol import (
    ANY_TOKENIZER,
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
    SessionStart,
    State,
    ThreadCounts,
    Welcome,
    decode,
    encode,
    error_frames,
    split_state,
)
from shared.sampling import GenerationParams, ParamError
from shared.signals import stop_on_signals
from shared.transport import (
    CLIENT_DOMAIN,
    DRAFTER_DOMAIN,
    SECRET_ENV,
    Authenticator,
    VerifierLinks,
    bind_router,
    peer_user_id,
    secret_matches,
)
from verifier_node.acceptance import AcceptRule, check_ensemble_weight
from verifier_node.admission import MemoryAdmission
from verifier_node.draft_check import checked_stats, dense_q, tree_parents
from verifier_node.draft_wait import DraftWait
from verifier_node.drafters import DrafterLink, DrafterPool
from verifier_node.grammar import GrammarCompiler
from verifier_node.pool_policy import PoolPolicy
from verifier_node.request_prep import (
    GrammarChild,
    PrepJob,
    RequestPrep,
    check_schema_bounds,
)
from verifier_node.rounds import RoundRunner, ThreadSwitch
from verifier_node.scheduler import BatchLimits, Prefills, Scheduler
from verifier_node.session import NumericalError, RoundResult, Session
from verifier_node.tenancy import TenantRule

log = logging.getLogger("pipespec.verifier")

#: Longest wait for drafts on their way before a batched round runs without them (a tenth of a forward, at most).
GATHER_MAX_S = 0.005
#: Requests sent together (one client's burst) arrive a few ms apart: before prefilling a prompt that arrived less
#: than PROMPT_GATHER_S ago, the client socket is read for more, each arrival extending the wait by as much, up to
#: PROMPT_GATHER_MAX_S in all, so a burst shares one forward instead of its first prompt taking one alone.
PROMPT_GATHER_S = 0.01
PROMPT_GATHER_MAX_S = 0.05
#: A session waits at least this multiple of its drafter's longest block (profile: steps × one step's cost).
BLOCK_WAIT_FACTOR = 1.5


@dataclass
class Receipt:
    """How a message arrived: its bytes on the wire and the time its decoding took (for the session's metrics)."""

    nbytes: int
    decode_s: float
    user_id: str | None = None  # the sender's ZAP User-Id (under CURVE its public key, z85), None without CURVE


def _state_tensors(
    hidden: torch.Tensor | None, kv: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], int]:
    """The target state a drafter asked for (hidden states, ``kv.{layer}`` rows) as message tensors, and their bytes."""
    tensors = {"hidden": hidden} if hidden is not None else {}
    tensors.update(kv or {})
    return tensors, sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass(frozen=True)
class VerifierSettings:
    """What the running server reads of the config (taken once by :meth:`from_config`)."""

    model_name: str
    draft_timeout_s: float  # the cap on a session's wait for a draft
    max_sessions: int
    max_message_bytes: int
    client_timeout_s: float  # a client silent this long (no heartbeat ping, no message) has gone
    ensemble_weight: float | None  # static ensemble verification (lossy by design), None: off
    drafter_endpoint: str
    client_endpoint: str
    # request preparation and admission (verifier_node.request_prep, verifier_node.admission): the config's
    # defaults (declared in shared/config_sections.py); None: resolved by MemoryAdmission
    max_pending_requests: int = VerifierConfig.max_pending_requests
    grammar_compile_timeout_s: float = VerifierConfig.grammar_compile_timeout_s
    grammar_cache_bytes: int = VerifierConfig.grammar_cache_bytes
    max_model_len: int | None = None
    max_kv_tokens: int | None = None
    max_sessions_per_tenant: int | None = None  # None: no cap beyond max_sessions

    @classmethod
    def from_config(cls, config: Config) -> VerifierSettings:
        v = config.verifier
        weight = config.verification.ensemble_weight
        check_ensemble_weight(weight)
        return cls(model_name=v.model, draft_timeout_s=v.draft_timeout_ms / 1000, max_sessions=v.max_sessions,
                   max_message_bytes=v.max_message_bytes, client_timeout_s=float(config.client.heartbeat_timeout_s),
                   ensemble_weight=weight, drafter_endpoint=v.endpoint, client_endpoint=config.client.endpoint,
                   max_pending_requests=v.max_pending_requests, grammar_compile_timeout_s=v.grammar_compile_timeout_s,
                   grammar_cache_bytes=v.grammar_cache_bytes, max_model_len=v.max_model_len,
                   max_kv_tokens=v.max_kv_tokens, max_sessions_per_tenant=v.max_sessions_per_tenant)


@dataclass
class VerifierSockets:
    """The verifier's two bound ROUTER sockets (drafters, clients) and the CURVE authenticator guarding them (None:
    no CURVE on either link)."""

    drafter: zmq.Socket
    client: zmq.Socket
    auth: Authenticator | None = None
    tenancy: TenantRule = field(default_factory=TenantRule)  # who may name a request's tenant

    @classmethod
    def bind(cls, config: Config, links: VerifierLinks) -> VerifierSockets:
        """Bind both endpoints of ``config``, each with CURVE where ``links`` says its link runs it."""
        ctx = zmq.Context.instance()
        allow_remote = config.verifier.allow_remote
        keys = links.keys
        auth = Authenticator(ctx, keys, log) if keys else None  # before binding: no key is let in unchecked
        try:
            drafter = bind_router(ctx, config.verifier.endpoint, allow_remote, domain=DRAFTER_DOMAIN,
                                  auth=auth if links.curve_drafters else None)
            client = bind_router(ctx, config.client.endpoint, allow_remote,
                                 auth=auth if links.curve_clients else None, domain=CLIENT_DOMAIN)
        except BaseException:
            if auth is not None:
                auth.close()
            raise
        log.info("CURVE: drafter link %s, client link %s", "on" if links.curve_drafters else "off",
                 "on" if links.curve_clients else "off")
        return cls(drafter, client, auth, TenantRule(links.curve_clients, links.gateways))

    def close(self) -> None:
        for sock in (self.drafter, self.client):
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.close()


class VerifierServer:
    """The verifier's I/O loop and message handlers; which sessions run is the scheduler's
    (:mod:`verifier_node.scheduler`), which drafter serves them the pool policy's (:mod:`verifier_node.pool_policy`),
    the forwards the round runner's (:mod:`verifier_node.rounds`). :meth:`from_config` loads, measures and binds."""

    def __init__(self, settings: VerifierSettings, model: Any, tokenizer: Any, profile: NodeProfile | None,
                 threads: ThreadPlan, limits: BatchLimits, sockets: VerifierSockets, *, run_secret: str | None = None,
                 forward_delay_s: float = 0.0, accept: AcceptRule | None = None, backend: TargetBackend | None = None,
                 cores: CoreLeases | None = None, prep_hook: Callable[[PrepJob], None] | None = None):
        """Serve with built parts: the target ``model`` and its ``tokenizer``, its measured ``profile`` (None: not
        measured), the thread plan (its share already applied), the batch ``limits`` (batching only where the
        target can), bound ``sockets``. ``run_secret``: what a drafter's hello must show where the drafter link has
        no CURVE (None: nothing). ``forward_delay_s`` and ``accept``: see :meth:`from_config`. ``backend``: who holds
        the sessions' KV caches (:mod:`shared.backend`; None: dynamic caches). ``cores``: the CPU core leases each
        forward holds (:mod:`shared.cores`; None: the planned thread counts as they are). ``prep_hook``: for tests,
        run by the preparation worker before each request it prepares (a slow tokenizer or compile)."""
        self.settings = settings
        self.draft_timeout = settings.draft_timeout_s
        self.max_sessions = settings.max_sessions
        self.max_bytes = settings.max_message_bytes
        self.client_timeout = settings.client_timeout_s
        self.model_name = settings.model_name
        self.ensemble_weight = settings.ensemble_weight
        self.accept_rule = accept
        self.client_seen: dict[bytes, float] = {}
        self._next_sweep = 0.0
        self.threads = threads
        self.model = model
        self.backend = backend or DynamicBackend(model)
        self.tokenizer = tokenizer
        self._worker_tokenizer: Any = None  # the preparation worker's copy (made at its first text prompt)
        self.profile = profile
        self.dtype = model_dtype(model)
        self.vocab_size = logits_vocab_size(model)
        self.rollback_refeeds = CachedLM(model).recurrent  # hybrid / state-space target: see shared/kv.py
        self.tokenizer_id = tokenizer_id(tokenizer)
        # what a drafter without a transformers tokenizer (a GGUF file's token list) is checked against
        self.vocab_tokens = vocab_tokens(tokenizer)
        self.default_eos = default_eos_ids(model, tokenizer)
        self.grammars: GrammarCompiler | None = None  # built at the first request with a grammar (xgrammar optional)
        self.grammar_child: GrammarChild | None = None  # where grammars compile (started with self.grammars)
        self.admission = MemoryAdmission.resolve(settings.max_model_len, settings.max_kv_tokens, model.config,
                                                 self.backend)
        self.sockets = sockets
        self.drafter_sock, self.client_sock = sockets.drafter, sockets.client
        self.run_secret = run_secret
        self.poller = zmq.Poller()
        self.poller.register(self.drafter_sock, zmq.POLLIN)
        self.poller.register(self.client_sock, zmq.POLLIN)
        # Tokenising and grammar compiles run off this loop; a finished one wakes it through prep.socket.
        self.prep = RequestPrep(self._prepare, settings.max_pending_requests, hook=prep_hook)
        self.poller.register(self.prep.socket, zmq.POLLIN)
        self.scheduler = Scheduler(limits)
        self.by_request: dict[tuple[bytes, int], int] = {}
        self.next_sid = 1
        self.pool = DrafterPool()
        self.policy = PoolPolicy(self.pool, self.sessions, self.ensemble_weight, send=self._send_to,
                                 announce=lambda s, kv: self.announce(s, kv=kv))
        switch = ThreadSwitch(threads) if cores is None else ThreadSwitch(threads, apply=lambda n: None)
        self.rounds = RoundRunner(model, self.scheduler, self, switch, CurveCheck(profile), forward_delay_s,
                                  self.backend, cores)
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
        path = resolve_model(v.model)
        tokenizer = tokenizer or load_tokenizer(path)
        spec = ProfileSpec(threads.counts(), profile_sizes(config.drafter.max_draft_tokens), float(v.profile_s),
                           role="verifier")
        profile: NodeProfile | None = None
        # Load and measure while no other node on this machine does (the drafter starts at the same time).
        with measuring_alone(v.device) if spec.budget_s > 0 else contextlib.nullcontext():
            model = model or load_causal_lm(path, v.device, v.dtype, v.max_memory, profile=spec)
            if spec.budget_s > 0:
                profile = profile_node(model, v.model, v.device, spec, "verifier")
        # Batched verification: one target forward over every session whose round is ready (shared/batch.py).
        max_batch_sessions = v.max_batch_sessions if v.batching else 1
        # Where the sessions' KV caches live (shared/backend.py): a slot per session batched at once.
        slots = kv_slots(v.kv_slots, v.max_sessions, v.max_batch_sessions)
        backend = make_backend(model, v.backend, slots, v.kv_slot_tokens, compiled_tokens=v.compiled_max_tokens,
                               thread_counts=threads.counts())
        batching = max_batch_sessions > 1 and backend.can_batch()
        if max_batch_sessions > 1 and not batching:
            log.warning("verifier: batched verification is not possible with this target (sliding-window layers or "
                        "an attention kernel without custom masks): one forward per session")
        log.info("verifier: %s in %s, threads %d (share) / %d (full)", v.model, model_dtype(model),
                 threads.share, threads.full)
        limits = BatchLimits(batching, max_batch_sessions, v.max_batch_tokens, v.max_prefill_tokens)
        settings = VerifierSettings.from_config(config)
        # Without CURVE on the drafter link, a launcher-given secret is what a drafter's hello must show.
        return cls(settings, model, tokenizer, profile, threads, limits, VerifierSockets.bind(config, links),
                   run_secret=links.run_secret, forward_delay_s=forward_delay_s, accept=accept, backend=backend,
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
                if self.drafter_sock in events:
                    self._drain(self.drafter_sock, self._on_drafter_message)
                if self.client_sock in events:
                    self._drain(self.client_sock, self._on_client_message)
                self._admit_prepared()
                self.policy.reap()  # after the drains: a long round must not make a drafter that kept talking look dead
                self._drop_silent_clients()
                work = self.scheduler.next_work()
                if isinstance(work, list) and self._gather(work):
                    work = self.scheduler.next_work()
                elif isinstance(work, Prefills) and self._gather_prompts():
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
        if self.grammar_child is not None:
            self.grammar_child.kill()  # a compile in work ends now, so the worker can stop
        self.prep.close()
        if self.grammar_child is not None:
            self.grammar_child.close()
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
            receipt = Receipt(sum(len(f.buffer) for f in body), time.monotonic() - t0, peer_user_id(body[0]))
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
        """Cancel the sessions of clients not heard from for ``client_timeout`` (checked at most every 0.25 s;
        after the drains, so a long round never counts against a client whose pings were waiting)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 0.25
        for s in list(self.sessions.values()):
            silent = now - self.client_seen.get(s.client, now)
            if silent > self.client_timeout:
                log.warning("session %d (request %d of client %s): cancelled, nothing from the client for %.1f s",
                            s.sid, s.request_id, s.client.hex(), silent)
                self.finish(s, "client_gone")
        for peer, rid in list(self.prep.pending):
            if now - self.client_seen.get(peer, now) > self.client_timeout:
                log.warning("request %d of client %s: dropped while being prepared, nothing from the client", rid,
                            peer.hex())
                self.prep.cancel((peer, rid))
        live = {s.client for s in self.sessions.values()} | self.prep.clients()
        for peer in [p for p in self.client_seen if p not in live and now - self.client_seen[p] > self.client_timeout]:
            del self.client_seen[peer]  # bounded: forget peers that are gone and hold nothing

    def _gather(self, batch: list[Session]) -> bool:
        """Let drafts on their way join this round: a drafter sends one batched step's blocks back to back, and a
        round started on the first would leave the rest for a forward of their own. While sessions outside ``batch``
        still wait for a draft, read the drafter socket for up to a tenth of a recent forward (≤ GATHER_MAX_S).
        True if anything arrived."""
        if not self.batching or len(batch) >= self.scheduler.limits.max_batch_sessions:
            return False
        deadline = time.monotonic() + min(GATHER_MAX_S, 0.1 * self.rounds.counts.forward_s_ema)
        got = False
        while True:
            now = time.monotonic()
            if now >= deadline or not self.scheduler.drafting_elsewhere(batch, now):
                return got
            if not self.drafter_sock.poll(max(1, int(1000 * (deadline - now)))):
                return got
            self._drain(self.drafter_sock, self._on_drafter_message)
            got = True

    def _gather_prompts(self) -> bool:
        """Before a prefill, read the requests of a burst still arriving (see PROMPT_GATHER_S). True if anything
        arrived."""
        if not self.batching:
            return False
        deadline = time.monotonic() + PROMPT_GATHER_MAX_S
        got = False
        while True:
            now = time.monotonic()
            waiting = self.scheduler.prompts_waiting()
            if len(waiting) >= self.scheduler.limits.max_batch_sessions:
                break
            until = min(deadline, max(waiting, default=0.0) + PROMPT_GATHER_S)
            if now >= until or not self.client_sock.poll(max(1, int(1000 * (until - now)))):
                break
            self._drain(self.client_sock, self._on_client_message)
            got = True
        return got

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
            self._send_to(link, encode(Heartbeat()))  # answered: the drafter notices a verifier that went away
            return
        if isinstance(msg, Draft):
            self._on_draft(link, msg, receipt)
            return
        raise ProtocolError(f"a drafter may not send {msg.TYPE!r}", code="unexpected")

    def _on_hello(self, peer: bytes, msg: Hello) -> None:
        if self.run_secret is not None and not secret_matches(self.run_secret, msg.run_secret):
            log.warning("refused a hello from %s: no valid run secret (not a drafter of this run)", peer.hex())
            raise ProtocolError("unauthorized: this verifier takes drafters of its own run only (a hello must carry "
                                f"the run secret from ${SECRET_ENV})", code="unauthorized")
        if msg.tokenizer_id not in (self.tokenizer_id, ANY_TOKENIZER) and not vocab_prefix_matches(
                msg.tokenizer_id, self.vocab_tokens):
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
        if drafter.kv_layers:
            try:
                CachedLM(self.model).check_kv_layers(drafter.kv_layers)
            except KVRowsError as exc:
                log.error("refused drafter %r: %s", msg.drafter_type, exc)
                raise ProtocolError(
                    f"drafter type {msg.drafter_type!r} needs K/V rows of target layers {drafter.kv_layers}, "
                    f"which this target ({self.model_name}, {type(self.model).__name__}) cannot provide: {exc}",
                    code="unsupported",
                ) from None
        if msg.profile is not None:
            try:
                profile = NodeProfile.from_dict(msg.profile)
            except (ValueError, TypeError) as exc:
                raise ProtocolError(f"hello: bad cost profile: {exc}") from None
            drafter.dtype = profile.dtype
            # its profile covers 1 .. max_draft_tokens + 1 rows: the longest block is that many steps, less one
            curve = profile.curve(max(profile.curves))
            drafter.block_s = min(self.draft_timeout, BLOCK_WAIT_FACTOR * max(1, curve.sizes[-1] - 1) * curve.cost(1))
        link, again = self.pool.join(drafter)
        log.info("drafter %s %s: caps=%s dtype=%s", link.label(), "said hello again" if again else "joined",
                 msg.capabilities, link.dtype)
        self._send_to(link, encode(Welcome(target=self.model_name, vocab_size=self.vocab_size,
                                           want_q=self.ensemble_weight is not None,
                                           profile=self.profile.to_dict() if self.profile else None,
                                           threads=ThreadCounts(self.threads.share, self.threads.full),
                                           rollback_refeeds=self.rollback_refeeds, dtype=self.dtype)))
        self.policy.on_joined(link, again)

    def announce(
        self, s: Session, hidden: torch.Tensor | None = None, kv: dict[str, torch.Tensor] | None = None
    ) -> None:
        d = s.drafter
        if d is None or self.policy.lacks_q(s.params, d):
            return  # not announced: the session takes plain steps from the target
        tensors, size = _state_tensors(hidden, kv)
        pieces = [] if size <= self._state_budget() else split_state(tensors, len(s.tokens) - 1, self._state_budget())
        self._send_to(d, encode(SessionStart(session=s.sid, token_ids=s.tokens, params=s.params.to_dict(),
                                             prompt_len=s.prompt_len, decoding=self.scheduler.decoding(waiting=True),
                                             tenant=s.tenant, tensors={} if pieces else tensors)))
        for end, part in pieces:  # a long prompt's state, in pieces that each fit the message cap
            self._send_to(d, encode(State(session=s.sid, base_len=len(s.tokens), end=end, tensors=part)))
        s.announced = True
        s.ready_since = time.monotonic()
        s.wait.ready(len(s.tokens), s.ready_since)

    def _state_budget(self) -> int:
        """Bytes of state tensors one message may carry (the rest of the cap is left to the header)."""
        return self.max_bytes * 3 // 4

    def _extras(
        self, s: Session, hidden: torch.Tensor | None, kv: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """A commit's state tensors (hidden states, K/V rows of one round's positions), dropped with an error in the
        log if they would exceed the message cap (the drafter then drafts nothing more for the session; the output
        is unaffected)."""
        tensors, size = _state_tensors(hidden, kv)
        if size > self._state_budget():
            log.error("session %d: drafter state of %d bytes exceeds max_message_bytes (%d); not sent", s.sid, size,
                      self.max_bytes)
            return {}
        return tensors

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
        stats = checked_stats(msg.stats) if msg.stats is not None else None  # a bad field refuses the draft
        now = time.monotonic()
        s.draft = {"tokens": tokens, "q": q, "idle_rounds": msg.idle_rounds, "overlap": msg.overlap, "arrived": now,
                   "parents": parents}
        s.wait.arrived(len(s.tokens), now, bool(tokens))
        s.metrics.bytes_in += receipt.nbytes
        s.metrics.message_s += receipt.decode_s
        if msg.sent_at is not None:
            s.metrics.transit_s += max(0.0, time.time() - msg.sent_at)
        if stats is not None:
            s.metrics.drafter_stats = stats

    def _send_to(self, link: DrafterLink, frames: list) -> None:
        self.drafter_sock.send_multipart([link.routing_id, *frames], copy=False)

    # --------------------------------------------------------------- client side
    def _on_client_message(self, peer: bytes, msg: Message, receipt: Receipt) -> None:
        self.client_seen[peer] = time.monotonic()
        if isinstance(msg, Generate):
            try:
                self._on_generate(peer, msg, receipt.user_id)
            except ProtocolError:
                raise  # keeps its code (busy)
            except (ParamError, ValueError) as exc:
                raise ProtocolError(str(exc), code="bad_request", request_id=msg.request_id) from None
        elif isinstance(msg, Cancel):
            sid = self.by_request.get((peer, msg.request_id))
            if sid is not None:
                self.finish(self.sessions[sid], "cancelled")
            elif self.prep.cancel((peer, msg.request_id)) is not None:  # cancelled while being prepared
                self.client_sock.send_multipart([peer, *encode(Done(request_id=msg.request_id, token_ids=[], text="",
                                                                    metrics={}, finish_reason="cancelled"))])
        elif isinstance(msg, Ping):
            live, n = self.pool.live(), self.rounds.counts
            self.client_sock.send_multipart([peer, *encode(Pong(
                drafter_connected=bool(live), drafter_type=live[0].type if live else None,
                drafters=self.pool.describe(), target=self.model_name, sessions=len(self.sessions),
                max_message_bytes=self.max_bytes, heartbeat_timeout_s=self.client_timeout, batching=self.batching,
                forwards=n.forwards,
                mean_batch_sessions=n.batch_sessions_sum / n.forwards if n.forwards else 0.0,
                mean_batch_tokens=n.batch_tokens_sum / n.forwards if n.forwards else 0.0,
                prefill_forwards=n.prefill_forwards,
                mean_prefill_sessions=n.prefill_sessions_sum / n.prefill_forwards if n.prefill_forwards else 0.0,
                reports=[d.report for d in live if d.report is not None][:MAX_REPORTS],
            ))])
        else:
            raise ProtocolError(f"a client may not send {msg.TYPE!r}", code="unexpected")

    def _on_generate(self, peer: bytes, msg: Generate, user_id: str | None = None) -> None:
        """Cheap checks here, on the loop; the prompt's tokenisation and the grammar's compile in the preparation
        worker (:mod:`verifier_node.request_prep`), after which :meth:`_admit` makes the session. A request of
        token ids and no grammar has nothing slow to prepare: it is admitted at once."""
        rid = msg.request_id
        if (peer, rid) in self.by_request or (peer, rid) in self.prep:
            raise ParamError(f"request_id {rid} is already running for this client")
        if len(self.sessions) + len(self.prep) >= self.max_sessions:
            raise ProtocolError(f"verifier is at its limit of {self.max_sessions} sessions", "busy", rid)
        tenant = self.sockets.tenancy.tenant_of(msg, user_id)  # (docs/security.md)
        cap = self.settings.max_sessions_per_tenant
        held = sum(1 for s in self.sessions.values() if s.tenant == tenant) + sum(
            1 for job in self.prep.pending.values() if job.scope == tenant)  # being prepared counts too
        if cap is not None and held >= cap:
            raise ProtocolError(f"this tenant is at its limit of {cap} sessions (verifier.max_sessions_per_tenant)",
                                "busy", rid)
        params_in = dict(msg.params)
        params_in.setdefault("eos_token_ids", self.default_eos)
        params = GenerationParams.from_dict(params_in, self.vocab_size)
        if params.seed is None:
            params.seed = secrets.randbits(62)
        wanted = self._wanted_type(msg.drafter_type)
        live = [d for d in self.pool.live() if wanted is None or d.type == wanted]
        if live and all(self.policy.lacks_q(params, d) for d in live):
            raise ParamError(
                f"ensemble verification needs the draft distribution q; drafter type {live[0].type!r} sends none "
                "under greedy decoding (use do_sample=true, or a drafter that sends q when greedy)"
            )
        if params.grammar_spec is not None and self.ensemble_weight is not None:
            raise ParamError("structured output cannot be combined with static ensemble verification")
        job = PrepJob(peer, msg, params, wanted, scope=tenant)
        self._admission_check(job, len(msg.token_ids) if msg.token_ids is not None else 1)  # before any work
        if msg.token_ids is None or params.grammar_spec is not None:
            self.prep.submit(job)
            return
        self._prepare(job)
        self._admit(job)

    def _prepare(self, job: PrepJob) -> None:
        """Fill ``job``: the prompt's ids and the grammar's matcher (the preparation worker's thread, or the loop
        for a request with nothing slow to prepare)."""
        job.prompt = self._prompt_ids(job.msg)
        job.grammar = self._grammar(job.params, job.scope)

    def _admission_check(self, job: PrepJob, prompt_len: int) -> None:
        in_use = sum(s.prompt_len + s.params.max_new_tokens for s in self.sessions.values())
        self.admission.check(prompt_len, job.params.max_new_tokens, in_use, job.msg.request_id)

    def _admit_prepared(self) -> None:
        """Admit the requests the preparation worker has finished (or send their errors); never blocks."""
        for job in self.prep.finished():
            try:
                if job.error is not None:
                    raise job.error
                self._admit(job)
            except ProtocolError as exc:
                self.client_sock.send_multipart([job.peer, *error_frames(str(exc), exc.code,
                                                                         request_id=job.msg.request_id)])
            except (ParamError, ValueError) as exc:
                self.client_sock.send_multipart([job.peer, *error_frames(str(exc), "bad_request",
                                                                         request_id=job.msg.request_id)])

    def _admit(self, job: PrepJob) -> None:
        """A prepared request becomes a session, if its tokens fit (:mod:`verifier_node.admission`)."""
        prompt, params, rid = job.prompt, job.params, job.msg.request_id
        assert prompt is not None
        self._admission_check(job, len(prompt))
        sid = self.next_sid
        self.next_sid += 1
        # Under ensemble verification a plain step is not equivalent (it samples from p, not from w·p + (1 − w)·q),
        # so there the wait stays the cap; lossless sessions wait as long as their drafter's answers take.
        wait = DraftWait(self.draft_timeout, adaptive=self.ensemble_weight is None)
        s = Session(sid, self.model, self.tokenizer, prompt, params, job.peer, rid, self.ensemble_weight, job.wanted,
                    wait, accept=self.accept_rule, grammar=job.grammar, backend=self.backend)
        s.tenant = job.scope
        self.scheduler.add(s)
        self.by_request[(job.peer, rid)] = sid
        self.policy.reassign(s)

    def _grammar(self, params: GenerationParams, scope: str | None = None):
        """The request's grammar matcher (structured output), or None. Compiled in a child process (cached per
        ``(scope, kind, value)``), from the preparation worker; a spec the engine refuses, one past the bounds, one
        that compiles too long, or a verifier without xgrammar, is a ``ParamError`` (the client's 400)."""
        spec = params.grammar_spec
        if spec is None:
            return None
        check_schema_bounds(spec)
        try:
            if self.grammars is None:
                grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.default_eos,
                                           cache_bytes=self.settings.grammar_cache_bytes)
                self.grammar_child = GrammarChild(grammars.xgr, grammars.info, self.vocab_size,
                                                  self.settings.grammar_cache_bytes,
                                                  self.settings.grammar_compile_timeout_s)
                grammars.compile_with = self.grammar_child.compile
                self.grammars = grammars
            return self.grammars.session(spec, params.end_token_ids, scope)
        except ParamError:
            raise
        except Exception as exc:  # the engine failed on this tokenizer or matcher: this request only, never the node
            log.exception("structured output failed to start")
            raise ParamError(f"structured output could not start on this target: {exc!r:.300}") from None

    def _wanted_type(self, value: str | None) -> str | None:
        """``generate.drafter_type``: None (any drafter), or a type name known to pipespec or present in the pool.
        A known type with no live drafter is not an error: the request takes plain steps until one joins."""
        if value is None:
            return None
        known = set(DRAFTER_TYPE_NAMES) | self.pool.types()
        if value not in known:
            raise ParamError(f"drafter_type must be one of {', '.join(sorted(known))}, got {value!r}")
        return value

    def _prompt_ids(self, msg: Generate) -> list[int]:
        """The prompt's token ids. Runs in the preparation worker, with a copy of the tokenizer of its own: the loop
        detokenises with ``self.tokenizer`` meanwhile, and a Rust tokenizer object is not meant to be shared."""
        # decode checked the types and that exactly one of token_ids, prompt and messages is given
        if msg.token_ids is not None:
            ids = msg.token_ids
        else:
            if self._worker_tokenizer is None:
                self._worker_tokenizer = copy.deepcopy(self.tokenizer)
            ids = _encode(self._worker_tokenizer, msg)
        if not ids:
            raise ParamError("the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ParamError(f"token ids must be in [0, {self.vocab_size})")
        return list(ids)

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
        else:
            log.error("session %d failed in a round", s.sid, exc_info=exc)
            self._fail(s, "internal_error", f"the verifier failed on this request: {exc!r:.300}")

    def publish(self, s: Session, r: RoundResult, decoding: int) -> None:
        t0 = time.monotonic()
        if s.announced and s.drafter is not None:
            frames = encode(Commit(session=s.sid, base_len=r.base_len, tokens=r.tokens, new_len=len(s.tokens),
                                   drafted=r.drafted, accepted=r.accepted, verify_s=r.forward_s, threads=r.threads,
                                   batch_sessions=r.batch_sessions, batch_tokens=r.batch_tokens,
                                   decoding=decoding, tensors=self._extras(s, r.hidden, r.kv)))
            s.metrics.bytes_out += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
            self._send_to(s.drafter, frames)
        delta = s.text.push(r.tokens)
        self.client_sock.send_multipart([s.client, *encode(Chunk(request_id=s.request_id, token_ids=r.tokens,
                                                                 text=delta))])
        s.metrics.message_s += time.monotonic() - t0

    def finish(self, s: Session, reason: str) -> None:
        try:
            text = self.tokenizer.decode(s.generated, skip_special_tokens=True)
            d = s.drafter
            metrics = {**s.summary(verifier_dtype=self.dtype, drafter_dtype=d.dtype if d else None),
                       **s.wait.summary(), "drafter_ids": list(s.served_by), "drafter_type": d.type if d else None}
            frames = encode(Done(request_id=s.request_id, token_ids=s.generated, text=text, metrics=metrics,
                                 finish_reason=reason))
        except Exception as exc:  # detokenization or the metrics: the request fails, the node does not
            log.exception("session %d failed to finish", s.sid)
            self._fail(s, "internal_error", f"the verifier failed to finish this request: {exc!r:.300}")
            return
        self.client_sock.send_multipart([s.client, *frames])
        self._release(s)


def _encode(tokenizer: Any, msg: Generate) -> list[int]:
    """``msg``'s prompt text or chat messages as token ids (a ParamError where the tokenizer or template refuses)."""
    if msg.prompt is not None:
        try:
            return tokenizer(msg.prompt, add_special_tokens=True)["input_ids"]
        except Exception as exc:  # a tokenizer may refuse odd text (lone surrogates, …)
            raise ParamError(f"the target's tokenizer cannot encode the prompt: {exc!r:.300}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ParamError("the target's tokenizer has no chat template; send prompt or token_ids")
    try:
        return tokenizer.apply_chat_template(msg.messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    except Exception as exc:  # the template's own raise_exception, or one that fails on these messages
        raise ParamError(f"the target's chat template failed on these messages: {exc!r:.300}") from None


def run(config: Config, links: VerifierLinks, forward_delay_s: float = 0.0,
        accept: AcceptRule | None = None, prep_hook: Callable[[PrepJob], None] | None = None) -> None:
    """Entry point of the verifier process: ``config`` built once by the caller (``runtime.config.typed``);
    ``links``, ``forward_delay_s``, ``accept``, ``prep_hook``: see :meth:`VerifierServer.from_config`."""
    server = VerifierServer.from_config(config, links=links, forward_delay_s=forward_delay_s, accept=accept,
                                        prep_hook=prep_hook)
    stop_on_signals(server.stop)
    server.serve()
