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
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from drafter_node.types import DRAFTER_TYPES
from shared.batch import Row, can_batch, feed_rows
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
)
from shared.protocol import (
    ANY_TOKENIZER,
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
    SessionEnd,
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
from shared.transport import (
    CLIENT_DOMAIN,
    DRAFTER_DOMAIN,
    SECRET_ENV,
    Authenticator,
    VerifierLinks,
    bind_router,
    secret_matches,
)
from verifier_node.acceptance import AcceptRule, check_ensemble_weight
from verifier_node.draft_wait import DraftWait
from verifier_node.drafters import DrafterLink, DrafterPool
from verifier_node.session import NumericalError, RoundPlan, RoundResult, Session
from verifier_node.tree import tree_row

#: Error code of a tree draft the verifier will not verify (the draft is dropped; the drafter turns trees off).
TREE_REFUSED = "tree_refused"

log = logging.getLogger("pipespec.verifier")

#: Longest wait for drafts on their way before a batched round runs without them (a tenth of a forward, at most).
GATHER_MAX_S = 0.005
#: Requests sent together (one client's burst) arrive a few ms apart: before prefilling a prompt that arrived less
#: than PROMPT_GATHER_S ago, the client socket is read for more, each arrival extending the wait by as much, up to
#: PROMPT_GATHER_MAX_S in all, so a burst shares one forward instead of its first prompt taking one alone.
PROMPT_GATHER_S = 0.01
PROMPT_GATHER_MAX_S = 0.05
#: Most padding a batched prefill may add, as a fraction of its prompts' own tokens.
PREFILL_PADDING = 0.25
#: A session waits at least this multiple of its drafter's longest block (profile: steps × one step's cost).
BLOCK_WAIT_FACTOR = 1.5
#: How often the pool is checked for drafters that went silent.
REAP_EVERY_S = 0.1


@dataclass
class PendingRound:
    """One session's part of a verification round between taking its draft and the target forward."""

    session: Session
    plan: RoundPlan
    solo: bool  # a round the drafter's k = 0 plan gave to the verifier alone
    demoted: bool  # its drafter missed once too often: move the session after this round
    drafter_busy: bool  # its drafter pre-drafts while this round runs (the verifier keeps its thread share)
    want_hidden: bool
    kv_layers: list[int]
    timed_from: float = 0.0  # when the session's previous round was published (the round's wall time starts)
    draft_wait_s: float = 0.0  # of that, waiting for its drafter's block


@dataclass
class Prefills:
    """Prompts to cache in the next forward (several in one when batching)."""

    sessions: list[Session]


@dataclass
class Receipt:
    """How a message arrived: its bytes on the wire and the time its decoding took (for the session's metrics)."""

    nbytes: int
    decode_s: float


def _state_tensors(
    hidden: torch.Tensor | None, kv: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], int]:
    """The target state a drafter asked for (hidden states, ``kv.{layer}`` rows) as message tensors, and their bytes."""
    tensors = {"hidden": hidden} if hidden is not None else {}
    tensors.update(kv or {})
    return tensors, sum(t.numel() * t.element_size() for t in tensors.values())


_NUMERIC_STATS = ("busy_s", "blocks", "predraft_hits", "rolled_back", "idle_blocks", "batch_steps", "batch_rows",
                  "tree_blocks", "side_accepted")


def _checked_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """A draft's ``stats`` as the request's metrics read them: numbers where numbers go, a map of plan counts, a dtype
    name; anything else is refused here, not when the request finishes."""
    for key in _NUMERIC_STATS:
        v = stats.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ProtocolError(f"draft: stats.{key} must be a finite number, got {type(v).__name__}")
    plans = stats.get("plans", {})
    if not isinstance(plans, dict) or not all(isinstance(k, str) and type(v) is int for k, v in plans.items()):
        raise ProtocolError("draft: stats.plans must map plan names to counts")
    if not isinstance(stats.get("dtype", ""), (str, type(None))):
        raise ProtocolError("draft: stats.dtype must be a string")
    timing = stats.get("timing", {})
    if not isinstance(timing, dict) or len(timing) > 16 or not all(
            isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            for k, v in timing.items()):
        raise ProtocolError("draft: stats.timing must map at most 16 names to finite numbers")
    rates = stats.get("plan_rates", {})
    if not isinstance(rates, dict) or len(rates) > 32 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, list) and len(v) == 4
            and all(not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x >= 0
                    for x in v) for k, v in rates.items()):
        raise ProtocolError("draft: stats.plan_rates must map at most 32 plan names to 4 non-negative numbers")
    return stats


class VerifierServer:
    def __init__(self, config: dict[str, Any], model=None, tokenizer=None, forward_delay_s: float = 0.0,
                 accept: AcceptRule | None = None, *, links: VerifierLinks):
        """``links``: CURVE keys and run secret, resolved by the launcher (``runtime.security.verifier_links``).
        ``forward_delay_s`` and ``accept`` exist for tests (tests/node_entry.py injects them): seconds added
        before each target forward, so tests on tiny models (whose forwards take about as long as a drafter's step
        or a message) can rely on drafts made ahead and on requests arriving while a forward runs; and an
        acceptance rule that replaces the method's own (the negative control of the distribution tests)."""
        vcfg = config["verifier"]
        self.config = config
        self.draft_timeout = vcfg["draft_timeout_ms"] / 1000
        self.max_sessions = vcfg["max_sessions"]
        # Batched verification: one target forward over every session whose round is ready (shared/batch.py).
        self.max_batch_sessions = int(vcfg["max_batch_sessions"]) if vcfg["batching"] else 1
        self.max_batch_tokens = int(vcfg["max_batch_tokens"])
        self.forwards = self.batch_sessions_sum = self.batch_tokens_sum = 0
        self.max_prefill_tokens = int(vcfg["max_prefill_tokens"])
        self.prefill_forwards = self.prefill_sessions_sum = 0
        self.forward_delay_s = forward_delay_s
        self.accept_rule = accept
        self.forward_s_ema = 0.0  # recent verification forward time (bounds the wait for drafts on their way)
        self.max_bytes = vcfg["max_message_bytes"]
        # A client silent this long (no heartbeat ping, no message) has gone: its sessions are cancelled.
        self.client_timeout = float(config["client"]["heartbeat_timeout_s"])
        self.client_seen: dict[bytes, float] = {}
        self._next_sweep = 0.0
        self.threads = ThreadPlan.for_node(config, "verifier")
        set_threads(self.threads.share)
        self._threads_now = self.threads.share
        path = resolve_model(vcfg["model"])
        self.tokenizer = tokenizer or load_tokenizer(path)
        spec = ProfileSpec(self.threads.counts(), profile_sizes(config), float(vcfg["profile_s"]), role="verifier")
        self.profile: NodeProfile | None = None
        # Load and measure while no other node on this machine does (the drafter starts at the same time).
        with measuring_alone(vcfg["device"]) if spec.budget_s > 0 else contextlib.nullcontext():
            self.model = model or load_causal_lm(path, vcfg["device"], vcfg["dtype"], vcfg["max_memory"],
                                                 profile=spec)
            if spec.budget_s > 0:
                self.profile = profile_node(self.model, vcfg["model"], vcfg["device"], spec, "verifier")
        self.curve_check = CurveCheck(self.profile)
        self.dtype = model_dtype(self.model)
        self.batching = self.max_batch_sessions > 1 and can_batch(CachedLM(self.model))
        if self.max_batch_sessions > 1 and not self.batching:
            log.warning("verifier: batched verification is not possible with this target (sliding-window layers or "
                        "an attention kernel without custom masks): one forward per session")
        log.info("verifier: %s in %s, threads %d (share) / %d (full)", vcfg["model"], self.dtype, self.threads.share,
                 self.threads.full)
        self.vocab_size = logits_vocab_size(self.model)
        self.tokenizer_id = tokenizer_id(self.tokenizer)
        self.default_eos = default_eos_ids(self.model, self.tokenizer)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.model_name = vcfg["model"]
        # Static ensemble verification (lossy by design): verify against w·p + (1 − w)·q; needs q from the drafter.
        self.ensemble_weight = config["verification"]["ensemble_weight"]
        check_ensemble_weight(self.ensemble_weight)
        self.ctx = zmq.Context.instance()
        allow_remote = bool(vcfg["allow_remote"])
        keys = links.keys
        self.auth = Authenticator(self.ctx, keys, log) if keys else None  # before binding: no key is let in unchecked
        try:
            self.drafter_sock = bind_router(self.ctx, vcfg["endpoint"], allow_remote, domain=DRAFTER_DOMAIN,
                                            auth=self.auth if links.curve_drafters else None)
            self.client_sock = bind_router(self.ctx, config["client"]["endpoint"], allow_remote,
                                           auth=self.auth if links.curve_clients else None, domain=CLIENT_DOMAIN)
        except BaseException:
            if self.auth is not None:
                self.auth.close()
            raise
        log.info("CURVE: drafter link %s, client link %s", "on" if links.curve_drafters else "off",
                 "on" if links.curve_clients else "off")
        # Without CURVE on the drafter link, a launcher-given secret is what a drafter's hello must show.
        self.run_secret = links.run_secret
        self.poller = zmq.Poller()
        self.poller.register(self.drafter_sock, zmq.POLLIN)
        self.poller.register(self.client_sock, zmq.POLLIN)
        self.sessions: dict[int, Session] = {}
        self.by_request: dict[tuple[bytes, int], int] = {}
        self.order: deque[int] = deque()
        self.next_sid = 1
        self.pool = DrafterPool()
        self._next_reap = 0.0
        self.running = True

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        log.info("verifier ready: drafters at %s, clients at %s", self.config["verifier"]["endpoint"],
                 self.config["client"]["endpoint"])
        try:
            while self.running:
                now = time.monotonic()
                busy = any(self._runnable(s, now) for s in self.sessions.values())
                timeout_ms = 0 if busy else self._idle_timeout_ms()
                events = dict(self.poller.poll(timeout_ms))
                if self.drafter_sock in events:
                    self._drain(self.drafter_sock, self._on_drafter_message)
                if self.client_sock in events:
                    self._drain(self.client_sock, self._on_client_message)
                self._reap()  # after the drains: a long round must not make a drafter that kept talking look dead
                self._drop_silent_clients()
                work = self._next_work()
                if isinstance(work, list) and self._gather(work):
                    work = self._next_work()
                elif isinstance(work, Prefills) and self._gather_prompts():
                    first = work.sessions[0]  # the prompt whose turn it is, unless the burst's messages ended it
                    work = (self._take_prefills(first, time.monotonic()) if first.sid in self.sessions
                            else self._next_work())
                if isinstance(work, Prefills):
                    self._prefill_batch(work.sessions)
                elif work:
                    self._run_batch(work)
        finally:
            self.close()

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        for sock in (self.drafter_sock, self.client_sock):
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.close()

    def _idle_timeout_ms(self) -> int:
        now = time.monotonic()
        waits = [s.ready_since + s.wait.limit_s() - now for s in self.sessions.values()]
        if not waits:
            return 200
        return max(1, min(200, int(1000 * min(waits)) + 1))

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
            receipt = Receipt(sum(len(f.buffer) for f in body), time.monotonic() - t0)
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
                self._finish(s, "client_gone")
        live = {s.client for s in self.sessions.values()}
        for peer in [p for p in self.client_seen if p not in live and now - self.client_seen[p] > self.client_timeout]:
            del self.client_seen[peer]  # bounded: forget peers that are gone and hold nothing

    def _gather(self, batch: list[Session]) -> bool:
        """Let drafts on their way join this round: a drafter sends one batched step's blocks back to back, and a
        round started on the first would leave the rest for a forward of their own. While sessions outside ``batch``
        still wait for a draft, read the drafter socket for up to a tenth of a recent forward (≤ GATHER_MAX_S).
        True if anything arrived."""
        if not self.batching or len(batch) >= self.max_batch_sessions:
            return False
        deadline = time.monotonic() + min(GATHER_MAX_S, 0.1 * self.forward_s_ema)
        got = False
        while True:
            now = time.monotonic()
            if now >= deadline or not self._drafting_elsewhere(batch, now):
                return got
            if not self.drafter_sock.poll(max(1, int(1000 * (deadline - now)))):
                return got
            self._drain(self.drafter_sock, self._on_drafter_message)
            got = True

    def _runnable(self, s: Session, now: float) -> bool:
        return not self._may_wait(s, now) or now - s.ready_since >= s.wait.limit_s()

    def _next_work(self) -> Prefills | list[Session] | None:
        """What to run next, round-robin: prompts to prefill (a forward of their own turn), or the sessions whose
        next round can run now, up to ``max_batch_sessions`` and ``max_batch_tokens`` (one session when batching is
        off). Sessions taken move to the back of the order, so every session gets its turn."""
        now = time.monotonic()
        batch: list[Session] = []
        tokens = 0
        for sid in list(self.order):
            s = self.sessions[sid]
            if not self._runnable(s, now):
                continue
            if not s.prefilled:
                if batch:
                    continue  # prefills come on their own turn
                return self._take_prefills(s, now)
            fed = 1 + (len(s.draft["tokens"]) if s.draft is not None else 0)
            if batch and tokens + fed > self.max_batch_tokens:
                continue
            batch.append(s)
            tokens += fed
            if len(batch) >= self.max_batch_sessions:
                break
        for s in batch:
            self.order.remove(s.sid)
            self.order.append(s.sid)
        return batch or None

    def _take_prefills(self, first: Session, now: float) -> Prefills:
        """The prompts to prefill with ``first``, moved to the back of the order."""
        prefills = self._prompts_to_prefill(first, now)
        for p in prefills.sessions:
            self.order.remove(p.sid)
            self.order.append(p.sid)
        return prefills

    def _gather_prompts(self) -> bool:
        """Before a prefill, read the requests of a burst still arriving (see PROMPT_GATHER_S). True if anything
        arrived."""
        if not self.batching:
            return False
        deadline = time.monotonic() + PROMPT_GATHER_MAX_S
        got = False
        while True:
            now = time.monotonic()
            waiting = [s.started for s in self.sessions.values() if not s.prefilled]
            if len(waiting) >= self.max_batch_sessions:
                break
            until = min(deadline, max(waiting, default=0.0) + PROMPT_GATHER_S)
            if now >= until or not self.client_sock.poll(max(1, int(1000 * (until - now)))):
                break
            self._drain(self.client_sock, self._on_client_message)
            got = True
        return got

    def _prompts_to_prefill(self, first: Session, now: float) -> Prefills:
        """``first`` and, when batching, the other prompts waiting, in order, while the padded forward (rows × the
        longest prompt) stays within ``max_prefill_tokens``, the rows within ``max_batch_sessions``, and padding
        adds at most PREFILL_PADDING of the prompts' own tokens (padded positions are computed like real ones: a
        long prompt among short ones would cost more than it saves, so it waits for a turn with prompts like it)."""
        chosen = [first]
        if not self.batching:
            return Prefills(chosen)
        longest = real = len(first.prompt_to_cache)
        rows = 1 if real else 0  # a one-token prompt caches nothing: no row
        for sid in self.order:
            s = self.sessions[sid]
            if s is first or s.prefilled or not self._runnable(s, now):
                continue
            if len(chosen) >= self.max_batch_sessions:
                break
            n = len(s.prompt_to_cache)
            if n:
                padded = max(longest, n) * (rows + 1)
                if padded > self.max_prefill_tokens or padded > (1 + PREFILL_PADDING) * (real + n):
                    continue
                longest, real, rows = max(longest, n), real + n, rows + 1
            chosen.append(s)
        return Prefills(chosen)

    @staticmethod
    def _may_wait(s: Session, now: float) -> bool:
        """The session's next round could use a draft from its drafter: prefilled, announced to a live drafter, no
        draft yet, not in a run of rounds the drafter gave to the verifier alone."""
        d = s.drafter
        return (s.prefilled and s.draft is None and s.announced and s.solo_left == 0 and d is not None
                and d.alive(now))

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
        if msg.tokenizer_id not in (self.tokenizer_id, ANY_TOKENIZER):
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
                                           threads=ThreadCounts(self.threads.share, self.threads.full))))
        self._on_joined(link, again)

    # -------------------------------------------------------------- the pool
    def _on_joined(self, link: DrafterLink, again: bool) -> None:
        """A drafter (re)joined: it learns its own sessions afresh (a hello again: it may have lost them), and takes
        the sessions that have no live drafter (least loaded first: two drafters joining share them)."""
        if again:
            for sid in sorted(link.sessions):
                s = self.sessions[sid]
                self._detach(s, notify=False)
                if self._fits(s, link):
                    self._attach(s, link)
        for s in list(self.sessions.values()):
            if s.drafter is None or not s.drafter.alive() or s.wait.demoted:  # a demoted one: the newcomer may draft
                self._reassign(s)

    def _fits(self, s: Session, link: DrafterLink) -> bool:
        """``link`` may serve ``s``: the type the request asked for (if any), q where ensemble verification needs it."""
        return (s.drafter_type is None or link.type == s.drafter_type) and not self._lacks_q(s.params, link)

    def _reassign(self, s: Session) -> None:
        """Move ``s`` to the least-loaded live drafter that fits (and was not demoted for it); keep it where it is
        if there is none (a session without a live drafter takes plain steps)."""
        target = self.pool.pick(lambda d: self._fits(s, d), exclude=s.tried)
        if target is not None and target is not s.drafter:
            self._detach(s)
            self._attach(s, target)

    def _attach(self, s: Session, link: DrafterLink) -> None:
        s.drafter = link
        link.sessions.add(s.sid)
        if not s.served_by or s.served_by[-1] != link.id:
            s.served_by.append(link.id)
        s.wait.reset()
        s.wait.block_floor_s = link.block_s
        if s.prefilled:  # announced with the state the drafter needs (held K/V rows; hidden states come per commit)
            self._announce(s, kv=s.lm.held_rows(link.kv_layers) if link.kv_layers else None)

    def _detach(self, s: Session, notify: bool = True) -> None:
        d = s.drafter
        if d is None:
            return
        if notify and s.announced:
            self._send_to(d, encode(SessionEnd(session=s.sid)))
        d.sessions.discard(s.sid)
        s.drafter = None
        s.announced = False
        s.draft = None
        s.solo_left = 0  # that drafter's k = 0 plan

    def _reap(self) -> None:
        """Drafters that went silent: their sessions move to a live drafter that fits (else they take plain steps
        and stay, so a drafter that was only busy resumes them); after FORGET_AFTER_S they leave the pool."""
        now = time.monotonic()
        if now < self._next_reap:
            return
        self._next_reap = now + REAP_EVERY_S
        for link in self.pool.forget_silent(now):
            log.warning("drafter %s removed from the pool (silent for %.0f s)", link.label(), now - link.last_seen)
            for sid in sorted(link.sessions):
                s = self.sessions[sid]
                self._detach(s, notify=False)
                self._reassign(s)
        for link in self.pool.dead(now):
            if not link.reported_dead:
                link.reported_dead = True
                log.warning("drafter %s silent for %.1f s: its %d session(s) move to a live drafter or step alone",
                            link.label(), now - link.last_seen, len(link.sessions))
            for sid in sorted(link.sessions):
                self._reassign(self.sessions[sid])
        for link in self.pool.live(now):
            link.reported_dead = False

    def _on_demoted(self, s: Session) -> None:
        """Its drafter kept missing for ``s``: move it to another live drafter (one not demoted for it before) when
        one fits; else it stays, taking plain steps with a probe now and then (verifier_node.draft_wait)."""
        d = s.drafter
        log.info("session %d: drafter %s demoted after %d misses", s.sid, d.label() if d else "?", s.wait.misses)
        if d is not None:
            s.tried.add(d.id)
        self._reassign(s)

    def _lacks_q(self, params: GenerationParams, drafter: DrafterLink | None) -> bool:
        """Ensemble verification of a request whose drafts would come without q (greedy, drafter without greedy_q)."""
        return (self.ensemble_weight is not None and drafter is not None and not params.do_sample
                and not drafter.greedy_q)

    def _announce(
        self, s: Session, hidden: torch.Tensor | None = None, kv: dict[str, torch.Tensor] | None = None
    ) -> None:
        d = s.drafter
        if d is None or self._lacks_q(s.params, d):
            return  # not announced: the session takes plain steps from the target
        tensors, size = _state_tensors(hidden, kv)
        pieces = [] if size <= self._state_budget() else split_state(tensors, len(s.tokens) - 1, self._state_budget())
        self._send_to(d, encode(SessionStart(session=s.sid, token_ids=s.tokens, params=s.params.to_dict(),
                                             prompt_len=s.prompt_len, decoding=self._decoding(waiting=True),
                                             tensors={} if pieces else tensors)))
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
        if s is None or not s.prefilled or msg.base_len != len(s.tokens):
            if s is not None:
                s.metrics.stale_drafts += 1
                s.wait.arrived(msg.base_len, time.monotonic(), bool(msg.tokens))  # too late: still a measured delay
            return  # stale or duplicate: harmless by design
        tokens = msg.tokens  # its length and idle_rounds were checked by decode (Draft.validate)
        if not all(0 <= t < self.vocab_size for t in tokens):
            raise ProtocolError(f"draft tokens must be ids in [0, {self.vocab_size})")
        ensemble = self.ensemble_weight is not None
        parents = self._tree_parents(s, link, msg)
        q = self._dense_q(msg, len(tokens)) if s.params.do_sample or ensemble else None
        if ensemble and tokens and q is None:
            raise ProtocolError("ensemble verification needs q (q_idx/q_prob or q) with every draft")
        stats = _checked_stats(msg.stats) if msg.stats is not None else None  # a bad field refuses the draft
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

    def _tree_parents(self, s: Session, link: DrafterLink, msg: Draft) -> list[int] | None:
        """A draft's ``parents`` (its shape was checked by decode), or None for a chain; a ProtocolError (refusing
        this draft only, code ``tree_refused``: the drafter then sends chains) where the verifier cannot verify a tree
        losslessly: sampled requests or q (children drawn
        from q would need recursive rejection sampling), ensemble verification, drafters that need hidden states or
        K/V rows back, targets whose attention takes no custom mask."""
        parents = msg.parents
        if parents is None or parents == list(range(-1, len(parents) - 1)):
            return None  # a chain spelled as a tree: the chain path
        if s.params.do_sample or self.ensemble_weight is not None or any(k in msg.tensors for k in ("q", "q_idx")):
            raise ProtocolError("draft: token trees are verified for greedy requests without q only (no sampling, "
                                "no ensemble verification)", code=TREE_REFUSED)
        if link.needs_hidden or link.kv_layers:
            raise ProtocolError("draft: token trees are not taken from drafters that need the target's hidden "
                                "states or K/V rows", code=TREE_REFUSED)
        if not can_batch(s.lm):
            raise ProtocolError("draft: this target cannot verify token trees (its attention takes no custom mask, "
                                "or it has sliding-window layers)", code=TREE_REFUSED)
        return parents

    def _dense_q(self, msg: Draft, k: int) -> torch.Tensor | None:
        """Rebuild the draft distribution rows from a sparse (q_idx, q_prob) or dense (q) encoding."""
        t = msg.tensors
        if "q" in t:
            q = t["q"].float()
            if q.shape != (k, self.vocab_size):
                raise ProtocolError(f"dense q must have shape [{k}, {self.vocab_size}], got {list(q.shape)}")
        elif "q_idx" in t and "q_prob" in t:
            idx, prob = t["q_idx"].long(), t["q_prob"].float()
            if idx.shape != prob.shape or idx.dim() != 2 or idx.shape[0] != k:
                raise ProtocolError("sparse q: q_idx and q_prob must both have shape [k, m]")
            if idx.numel() and (idx.min() < 0 or idx.max() >= self.vocab_size):
                raise ProtocolError("sparse q: index outside the vocabulary")
            q = torch.zeros(k, self.vocab_size).scatter_add_(1, idx, prob)
        else:
            return None  # drafts chosen deterministically: one-hot q
        if not torch.isfinite(q).all() or (q < 0).any():
            raise ProtocolError("q must hold finite, non-negative probabilities")
        return q

    def _send_to(self, link: DrafterLink, frames: list) -> None:
        self.drafter_sock.send_multipart([link.routing_id, *frames], copy=False)

    # --------------------------------------------------------------- client side
    def _on_client_message(self, peer: bytes, msg: Message, receipt: Receipt) -> None:
        self.client_seen[peer] = time.monotonic()
        if isinstance(msg, Generate):
            try:
                self._on_generate(peer, msg)
            except ProtocolError:
                raise  # keeps its code (busy)
            except (ParamError, ValueError) as exc:
                raise ProtocolError(str(exc), code="bad_request", request_id=msg.request_id) from None
        elif isinstance(msg, Cancel):
            sid = self.by_request.get((peer, msg.request_id))
            if sid is not None:
                self._finish(self.sessions[sid], "cancelled")
        elif isinstance(msg, Ping):
            live = self.pool.live()
            self.client_sock.send_multipart([peer, *encode(Pong(
                drafter_connected=bool(live), drafter_type=live[0].type if live else None,
                drafters=self.pool.describe(), target=self.model_name, sessions=len(self.sessions),
                max_message_bytes=self.max_bytes, heartbeat_timeout_s=self.client_timeout, batching=self.batching,
                forwards=self.forwards,
                mean_batch_sessions=self.batch_sessions_sum / self.forwards if self.forwards else 0.0,
                mean_batch_tokens=self.batch_tokens_sum / self.forwards if self.forwards else 0.0,
                prefill_forwards=self.prefill_forwards,
                mean_prefill_sessions=(self.prefill_sessions_sum / self.prefill_forwards if self.prefill_forwards
                                       else 0.0),
            ))])
        else:
            raise ProtocolError(f"a client may not send {msg.TYPE!r}", code="unexpected")

    def _on_generate(self, peer: bytes, msg: Generate) -> None:
        rid = msg.request_id
        if (peer, rid) in self.by_request:
            raise ParamError(f"request_id {rid} is already running for this client")
        if len(self.sessions) >= self.max_sessions:
            raise ProtocolError(f"verifier is at its limit of {self.max_sessions} sessions", "busy", rid)
        params_in = dict(msg.params)
        params_in.setdefault("eos_token_ids", self.default_eos)
        params = GenerationParams.from_dict(params_in, self.vocab_size)
        if params.seed is None:
            params.seed = secrets.randbits(62)
        wanted = self._wanted_type(msg.drafter_type)
        live = [d for d in self.pool.live() if wanted is None or d.type == wanted]
        if live and all(self._lacks_q(params, d) for d in live):
            raise ParamError(
                f"ensemble verification needs the draft distribution q; drafter type {live[0].type!r} sends none "
                "under greedy decoding (use do_sample=true, or a drafter that sends q when greedy)"
            )
        prompt = self._prompt_ids(msg)
        if self.max_positions and len(prompt) + params.max_new_tokens > self.max_positions:
            raise ParamError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the target's "
                f"context of {self.max_positions}"
            )
        sid = self.next_sid
        self.next_sid += 1
        # Under ensemble verification a plain step is not equivalent (it samples from p, not from w·p + (1 − w)·q),
        # so there the wait stays the cap; lossless sessions wait as long as their drafter's answers take.
        wait = DraftWait(self.draft_timeout, adaptive=self.ensemble_weight is None)
        s = Session(sid, self.model, self.tokenizer, prompt, params, peer, rid, self.ensemble_weight, wanted, wait,
                    accept=self.accept_rule)
        self.sessions[sid] = s
        self.by_request[(peer, rid)] = sid
        self.order.append(sid)
        self._reassign(s)

    def _wanted_type(self, value: str | None) -> str | None:
        """``generate.drafter_type``: None (any drafter), or a type name known to pipespec or present in the pool.
        A known type with no live drafter is not an error: the request takes plain steps until one joins."""
        if value is None:
            return None
        known = set(DRAFTER_TYPES) | self.pool.types()
        if value not in known:
            raise ParamError(f"drafter_type must be one of {', '.join(sorted(known))}, got {value!r}")
        return value

    def _prompt_ids(self, msg: Generate) -> list[int]:
        # decode checked the types and that exactly one of token_ids, prompt and messages is given
        if msg.token_ids is not None:
            ids = msg.token_ids
        elif msg.prompt is not None:
            try:
                ids = self.tokenizer(msg.prompt, add_special_tokens=True)["input_ids"]
            except Exception as exc:  # a tokenizer may refuse odd text (lone surrogates, …)
                raise ParamError(f"the target's tokenizer cannot encode the prompt: {exc!r:.300}") from None
        else:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ParamError("the target's tokenizer has no chat template; send prompt or token_ids")
            try:
                ids = self.tokenizer.apply_chat_template(msg.messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"]
            except Exception as exc:  # the template's own raise_exception, or one that fails on these messages
                raise ParamError(f"the target's chat template failed on these messages: {exc!r:.300}") from None
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
        if self.sessions.pop(s.sid, None) is None:
            return
        self.by_request.pop((s.client, s.request_id), None)
        with contextlib.suppress(ValueError):
            self.order.remove(s.sid)
        self._detach(s)

    def _prefill_batch(self, sessions: list[Session]) -> None:
        """Cache the prompts of ``sessions`` (one forward over all of them when there are several) and announce
        each to its drafter. A failure ends only the session it belongs to."""
        # A prompt is one long forward: every core (a drafter that drafts prefills its own copy meanwhile, one whose
        # plan is k = 0 waits; the threads follow the plan again from the first round)
        self._use_threads(self.threads.full)
        needs = []  # what each session's own drafter needs: hidden states or K/V rows of the prompt
        for s in list(sessions):
            d = s.drafter
            want_hidden, kv_layers = bool(d and d.needs_hidden), list(d.kv_layers) if d else []
            try:
                if not (want_hidden or kv_layers):
                    self._announce(s)  # early: its drafter prefills its own copy while we do
            except Exception as exc:
                self._round_failed(s, exc)
                sessions.remove(s)
                continue
            needs.append((want_hidden, kv_layers))
        fed = self._prompt_forward(sessions, [w for w, _ in needs])
        for s, (want_hidden, kv_layers), done in zip(sessions, needs, fed):
            if done is None:
                continue  # its forward failed (reported)
            try:
                hidden, kv = s.prefilled_with(done[0] if want_hidden else None, kv_layers, done[1])
                if want_hidden or kv_layers:
                    self._announce(s, hidden, kv)
                s.wait.ready(len(s.tokens), s.ready_since)
            except Exception as exc:
                self._round_failed(s, exc)

    def _prompt_forward(self, sessions: list[Session], want_hidden: list[bool]) -> list[tuple | None]:
        """The prompts' forward: one over every prompt when batching allows it, else one each. Per session:
        (hidden states or None, forward seconds), or None where its forward failed (the session ended)."""
        self._forward_delay()
        rows = [i for i, s in enumerate(sessions) if s.prompt_to_cache]

        def together() -> list[tuple]:
            t0 = time.monotonic()
            outs = feed_rows(self.model, [Row(sessions[i].lm, sessions[i].prompt_to_cache) for i in rows],
                             want_hidden=any(want_hidden[i] for i in rows), logits=False)
            seconds = time.monotonic() - t0
            self.prefill_forwards += 1
            self.prefill_sessions_sum += len(rows)
            hidden = {i: o.hidden for i, o in zip(rows, outs)}
            return [(hidden.get(i), seconds) for i in range(len(sessions))]

        def alone(i: int) -> tuple:
            s, t0 = sessions[i], time.monotonic()
            hidden = s.feed_prompt(want_hidden[i])
            if s.prompt_to_cache:
                self.prefill_forwards += 1
                self.prefill_sessions_sum += 1
            return hidden, time.monotonic() - t0

        return self._together_or_each("prefill", len(rows), sessions, together, alone)

    def _together_or_each(self, what: str, rows: int, sessions: list[Session], together: Callable[[], list],
                          alone: Callable[[int], Any]) -> list:
        """``together()``: one batched forward's per-session results, when batching is on and there are several
        ``rows``; if it raises (before any cache changed) or does not apply, ``alone(i)`` for each session, where a
        failure ends that session only and gives None."""
        if rows > 1 and self.batching:
            try:
                return together()
            except Exception:  # every session gets a forward of its own instead
                log.exception("a batched %s over %d sessions failed; running them one by one", what, rows)
        results = []
        for i, s in enumerate(sessions):
            try:
                results.append(alone(i))
            except Exception as exc:
                self._round_failed(s, exc)
                results.append(None)
        return results

    def _begin_round(self, s: Session) -> PendingRound:
        """Take the session's draft (or none: a plain step) for this round and note what its drafter needs back."""
        d = s.drafter
        now = time.monotonic()
        could_use = self._may_wait(s, now) or (s.draft is not None and s.solo_left == 0)
        waited = (s.draft["arrived"] if s.draft is not None else now) - s.ready_since
        demoted = could_use and s.wait.outcome(s.draft is not None, max(0.0, waited))
        draft = s.draft or {"tokens": [], "q": None, "idle_rounds": 0, "overlap": False, "parents": None}
        s.draft = None
        if draft["idle_rounds"]:
            s.solo_left = draft["idle_rounds"]
        solo = s.solo_left > 0
        s.solo_left = max(0, s.solo_left - 1)
        drafter_busy = bool(draft["tokens"] and draft["overlap"] and d is not None and d.alive() and not solo)
        gap = max(0.0, now - s.timed_from)
        draft_wait = min(gap, max(0.0, waited)) if could_use else 0.0
        return PendingRound(s, s.plan_round(draft["tokens"], draft["q"], draft["parents"]), solo, demoted, drafter_busy,
                            bool(d and d.needs_hidden), list(d.kv_layers) if d else [], s.timed_from, draft_wait)

    def _run_batch(self, batch: list[Session]) -> None:
        """One verification round for every session of ``batch``: one target forward over all of them (batched
        verification), each row accepted, committed and published on its own. A failure in one row ends that
        session only."""
        rounds = []
        for s in batch:
            try:
                rounds.append(self._begin_round(s))
            except Exception as exc:
                self._round_failed(s, exc)
        if not rounds:
            return
        # Every core while the drafters idle (k = 0, synchronous blocks, no drafter); the share while one pre-drafts
        # for a row of this round or drafts a block for a session left out of it (its drafter computes meanwhile).
        busy = any(r.drafter_busy for r in rounds) or self._drafting_elsewhere(batch, time.monotonic())
        self._use_threads(self.threads.share if busy else self.threads.full)
        decoding = self._decoding()
        forwards = self._forward(rounds)
        if not busy and len(rounds) == 1 and forwards[0][0] is not None:  # timed alone: a sample of the profile
            self._check_profile(forwards[0][4], forwards[0][2], len(rounds[0].session.tokens))
        for r, (logits, hidden, forward_s, rows, tokens) in zip(rounds, forwards):
            if logits is None:
                continue  # that row's own forward failed (already reported)
            s = r.session
            try:
                t_accept = time.monotonic()
                result = s.finish_round(r.plan, logits, hidden, forward_s, r.kv_layers, rows, tokens)
                result.threads = self._threads_now
                if r.solo:
                    s.metrics.solo_rounds += 1
                s.wait.ready(len(s.tokens), s.ready_since)
                t_publish = time.monotonic()
                self._publish(s, result, decoding)
                s.timed_from = done = time.monotonic()
                s.metrics.timing.add(done - r.timed_from, r.draft_wait_s, forward_s, t_publish - t_accept,
                                     done - t_publish)
                if s.finished:
                    self._finish(s, s.finished)
                elif r.demoted:
                    self._on_demoted(s)
            except Exception as exc:
                self._round_failed(s, exc)

    def _check_profile(self, tokens: int, seconds: float, context: int) -> None:
        """Compare a forward timed alone with the profile; a profile that keeps missing is re-measured next start
        (the drafters' plans follow the measured forwards meanwhile: every commit carries its forward's time)."""
        ratio = self.curve_check.forward(self._threads_now, tokens, context, seconds)
        if ratio is not None:
            log.warning("verifier: forwards take %.2fx what the cached profile says (measured on a busy machine, or "
                        "the machine changed); the profile is measured again at the next start", ratio)

    def _drafting_elsewhere(self, batch: list[Session], now: float) -> bool:
        """A session outside ``batch`` waits for a block its drafter is drafting now."""
        members = {s.sid for s in batch}
        return any(sid not in members and self._may_wait(s, now) for sid, s in self.sessions.items())

    def _forward(self, rounds: list[PendingRound]) -> list[tuple]:
        """The target forward(s) of a round: one over every row when batching is on and the target allows it, else
        one per row. Per row: (logits, hidden, forward seconds, sessions in its forward, tokens in its forward); a
        row whose forward failed gets ``None`` logits."""
        self._forward_delay()

        def together() -> list[tuple]:
            tokens = sum(len(r.plan.fed) for r in rounds)
            t0 = time.monotonic()
            rows = [Row(r.session.lm, r.plan.fed) if r.plan.tree is None else
                    tree_row(r.session.lm, r.plan.fed[0], r.plan.tree) for r in rounds]
            outs = feed_rows(self.model, rows, any(r.want_hidden for r in rounds))
            forward_s = time.monotonic() - t0
            self._count_forward(len(rounds), tokens, forward_s)
            return [(o.logits, o.hidden if r.want_hidden else None, forward_s, len(rounds), tokens)
                    for r, o in zip(rounds, outs)]

        def alone(i: int) -> tuple:
            r, t0 = rounds[i], time.monotonic()
            logits, hidden = r.session.round_forward(r.plan, want_hidden=r.want_hidden)
            forward_s = time.monotonic() - t0
            self._count_forward(1, len(r.plan.fed), forward_s)
            return logits, hidden, forward_s, 1, len(r.plan.fed)

        results = self._together_or_each("forward", len(rounds), [r.session for r in rounds], together, alone)
        return [(None, None, 0.0, 1, 0) if out is None else out for out in results]

    def _forward_delay(self) -> None:
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s)  # injected by tests: a target slow enough that other work gets ahead

    def _count_forward(self, sessions: int, tokens: int, seconds: float) -> None:
        self.forward_s_ema = 0.8 * self.forward_s_ema + 0.2 * seconds
        self.forwards += 1
        self.batch_sessions_sum += sessions
        self.batch_tokens_sum += tokens

    def _round_failed(self, s: Session, exc: Exception) -> None:
        if isinstance(exc, NumericalError):
            log.error("session %d failed: %s", s.sid, exc)
            self._fail(s, "numerical_error", str(exc))
        else:
            log.error("session %d failed in a round", s.sid, exc_info=exc)
            self._fail(s, "internal_error", f"the verifier failed on this request: {exc!r:.300}")

    def _use_threads(self, count: int) -> None:
        if count != self._threads_now:
            set_threads(count)
            self._threads_now = count

    def _decoding(self, waiting: bool = False) -> int:
        """How many sessions would share a forward if every one stepped now (what the drafters' cost models plan
        for): the prefilled sessions (``waiting``: and those whose prompts wait, as a new session's own will),
        up to ``max_batch_sessions``; 1 when this verifier does not batch."""
        if not self.batching:
            return 1
        count = sum(1 for s in self.sessions.values() if waiting or s.prefilled)
        return max(1, min(self.max_batch_sessions, count))

    def _publish(self, s: Session, r: RoundResult, decoding: int = 1) -> None:
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

    def _finish(self, s: Session, reason: str) -> None:
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


def run(config: dict[str, Any], links: VerifierLinks, forward_delay_s: float = 0.0,
        accept: AcceptRule | None = None) -> None:
    """Entry point of the verifier process (``links``, ``forward_delay_s``, ``accept``: see :class:`VerifierServer`)."""
    VerifierServer(config, forward_delay_s=forward_delay_s, accept=accept, links=links).serve()
