"""The verifier node: owns the target, the sessions and the committed sequences; serves clients and one drafter.

One thread, one loop: drain both ROUTER sockets (drafters and clients), then run one round for one session that
is ready, round-robin. A session is ready when a draft built on its committed length is waiting, when no live
drafter is connected, or when it has waited ``draft_timeout_ms`` — the verifier never idles on a slow or dead
drafter longer than that bound; it takes a plain autoregressive step instead (same output, only slower). A draft with
``idle_rounds = n`` (the drafter's plan is k = 0) makes the session step alone, without waiting, for n rounds.

At start-up the verifier measures its cost curve (forward time over 1..K new tokens, cached on disk) and sends it in
the welcome; with ``threads: auto`` it verifies with every core when the drafter idles (k = 0 rounds, synchronous
blocks, no drafter) and with its share while the drafter pre-drafts.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from shared.costs import NodeProfile, measuring_alone
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
    DEFAULT_MAX_MESSAGE_BYTES,
    Cancel,
    Capabilities,
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
from shared.transport import bind_router
from verifier_node.acceptance import check_ensemble_weight
from verifier_node.session import RoundResult, Session

log = logging.getLogger("pipespec.verifier")

HEARTBEAT_TIMEOUT_S = 3.0


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


class Drafter:
    """The connected drafter as the verifier sees it: routing id and announced capabilities."""

    def __init__(self, routing_id: bytes, drafter_type: str, capabilities: Capabilities):
        self.routing_id = routing_id
        self.type = drafter_type
        self.sends_q = capabilities.sends_q
        self.greedy_q = self.sends_q and capabilities.greedy_q
        self.needs_hidden = capabilities.needs_hidden_states
        self.kv_layers: list[int] = capabilities.needs_kv_layers
        self.last_seen = time.monotonic()
        self.dtype: str | None = None  # the drafter's model dtype, from its profile (None: unknown / no model)

    def alive(self) -> bool:
        return time.monotonic() - self.last_seen < HEARTBEAT_TIMEOUT_S


class VerifierServer:
    def __init__(self, config: dict[str, Any], model=None, tokenizer=None):
        vcfg = config["verifier"]
        self.config = config
        self.draft_timeout = vcfg["draft_timeout_ms"] / 1000
        self.max_sessions = vcfg.get("max_sessions", 64)
        self.max_bytes = vcfg.get("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
        self.threads = ThreadPlan.for_node(config, "verifier")
        set_threads(self.threads.share)
        self._threads_now = self.threads.share
        path = resolve_model(vcfg["model"])
        self.tokenizer = tokenizer or load_tokenizer(path)
        spec = ProfileSpec(self.threads.counts(), profile_sizes(config), float(vcfg["profile_s"]), role="verifier")
        self.profile: NodeProfile | None = None
        # Load and measure while no other node on this machine does (the drafter starts at the same time).
        with measuring_alone(vcfg["device"]) if spec.budget_s > 0 else contextlib.nullcontext():
            self.model = model or load_causal_lm(path, vcfg["device"], vcfg["dtype"], vcfg.get("max_memory"),
                                                 profile=spec)
            if spec.budget_s > 0:
                self.profile = profile_node(self.model, vcfg["model"], vcfg["device"], spec, "verifier")
        self.dtype = model_dtype(self.model)
        log.info("verifier: %s in %s, threads %d (share) / %d (full)", vcfg["model"], self.dtype, self.threads.share,
                 self.threads.full)
        self.vocab_size = logits_vocab_size(self.model)
        self.tokenizer_id = tokenizer_id(self.tokenizer)
        self.default_eos = default_eos_ids(self.model, self.tokenizer)
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.model_name = vcfg["model"]
        # Static ensemble verification (lossy by design): verify against w·p + (1 − w)·q; needs q from the drafter.
        self.ensemble_weight = (config.get("verification") or {}).get("ensemble_weight")
        check_ensemble_weight(self.ensemble_weight)
        self.ctx = zmq.Context.instance()
        allow_remote = bool(vcfg.get("allow_remote", False))
        self.drafter_sock = bind_router(self.ctx, vcfg["endpoint"], allow_remote)
        self.client_sock = bind_router(self.ctx, config["client"]["endpoint"], allow_remote)
        self.poller = zmq.Poller()
        self.poller.register(self.drafter_sock, zmq.POLLIN)
        self.poller.register(self.client_sock, zmq.POLLIN)
        self.sessions: dict[int, Session] = {}
        self.by_request: dict[tuple[bytes, int], int] = {}
        self.order: deque[int] = deque()
        self.next_sid = 1
        self.drafter: Drafter | None = None
        self.running = True

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        log.info("verifier ready: drafters at %s, clients at %s", self.config["verifier"]["endpoint"],
                 self.config["client"]["endpoint"])
        try:
            while self.running:
                session = self._next_runnable()
                timeout_ms = 0 if session else self._idle_timeout_ms()
                events = dict(self.poller.poll(timeout_ms))
                if self.drafter_sock in events:
                    self._drain(self.drafter_sock, self._on_drafter_message)
                if self.client_sock in events:
                    self._drain(self.client_sock, self._on_client_message)
                session = self._next_runnable()
                if session is not None:
                    self._run_round(session)
        finally:
            self.close()

    def stop(self) -> None:
        self.running = False

    def close(self) -> None:
        for sock in (self.drafter_sock, self.client_sock):
            sock.close(linger=0)

    def _idle_timeout_ms(self) -> int:
        waits = [s.ready_since + self.draft_timeout - time.monotonic() for s in self.sessions.values()]
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

    def _next_runnable(self) -> Session | None:
        now = time.monotonic()
        live = self.drafter is not None and self.drafter.alive()
        for _ in range(len(self.order)):
            sid = self.order[0]
            self.order.rotate(-1)
            s = self.sessions[sid]
            if not s.prefilled or s.draft is not None or not live or not s.announced or s.solo_left > 0:
                return s
            if now - s.ready_since >= self.draft_timeout:
                return s
        return None

    # -------------------------------------------------------------- drafter side
    def _on_drafter_message(self, peer: bytes, msg: Message, receipt: Receipt) -> None:
        if isinstance(msg, Hello):
            self._on_hello(peer, msg)
            return
        if self.drafter is None or peer != self.drafter.routing_id:
            raise ProtocolError("say hello first: this drafter is not connected", code="not_connected")
        self.drafter.last_seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, Draft):
            self._on_draft(msg, receipt)
            return
        raise ProtocolError(f"a drafter may not send {msg.TYPE!r}", code="unexpected")

    def _on_hello(self, peer: bytes, msg: Hello) -> None:
        if msg.tokenizer_id not in (self.tokenizer_id, ANY_TOKENIZER):
            log.error("refused drafter %r: tokenizer %s != target's %s", msg.drafter_type, msg.tokenizer_id,
                      self.tokenizer_id)
            raise ProtocolError(
                f"tokenizer mismatch: the drafter's tokenizer ({msg.tokenizer_id}) is not the target's "
                f"({self.tokenizer_id}); drafter type {msg.drafter_type!r} needs the target's tokenizer",
                code="tokenizer_mismatch",
            )
        drafter = Drafter(peer, msg.drafter_type, msg.capabilities)
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
                drafter.dtype = NodeProfile.from_dict(msg.profile).dtype
            except (ValueError, TypeError) as exc:
                raise ProtocolError(f"hello: bad cost profile: {exc}") from None
        self.drafter = drafter
        log.info("drafter connected: type=%s caps=%s dtype=%s", self.drafter.type, msg.capabilities, drafter.dtype)
        self._send_drafter(encode(Welcome(target=self.model_name, vocab_size=self.vocab_size,
                                          want_q=self.ensemble_weight is not None,
                                          profile=self.profile.to_dict() if self.profile else None,
                                          threads=ThreadCounts(self.threads.share, self.threads.full))))
        for s in self.sessions.values():  # a (re)connected drafter learns every live session
            s.announced = False
            s.draft = None
            if s.prefilled:
                kv = s.lm.held_rows(self.drafter.kv_layers) if self.drafter.kv_layers else None
                self._announce(s, kv=kv)

    def _lacks_q(self, params: GenerationParams, drafter: Drafter | None) -> bool:
        """Ensemble verification of a request whose drafts would come without q (greedy, drafter without greedy_q)."""
        return (self.ensemble_weight is not None and drafter is not None and not params.do_sample
                and not drafter.greedy_q)

    def _announce(
        self, s: Session, hidden: torch.Tensor | None = None, kv: dict[str, torch.Tensor] | None = None
    ) -> None:
        if self.drafter is None or self._lacks_q(s.params, self.drafter):
            return  # not announced: the session takes plain steps from the target
        tensors, size = _state_tensors(hidden, kv)
        pieces = [] if size <= self._state_budget() else split_state(tensors, len(s.tokens) - 1, self._state_budget())
        self._send_drafter(encode(SessionStart(session=s.sid, token_ids=s.tokens, params=s.params.to_dict(),
                                               prompt_len=s.prompt_len, tensors={} if pieces else tensors)))
        for end, part in pieces:  # a long prompt's state, in pieces that each fit the message cap
            self._send_drafter(encode(State(session=s.sid, base_len=len(s.tokens), end=end, tensors=part)))
        s.announced = True
        s.ready_since = time.monotonic()

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

    def _on_draft(self, msg: Draft, receipt: Receipt) -> None:
        s = self.sessions.get(msg.session)
        if s is None or not s.prefilled or msg.base_len != len(s.tokens):
            if s is not None:
                s.metrics.stale_drafts += 1
            return  # stale or duplicate: harmless by design
        tokens = msg.tokens  # its length and idle_rounds were checked by decode (Draft.validate)
        if not all(0 <= t < self.vocab_size for t in tokens):
            raise ProtocolError(f"draft tokens must be ids in [0, {self.vocab_size})")
        ensemble = self.ensemble_weight is not None
        q = self._dense_q(msg, len(tokens)) if s.params.do_sample or ensemble else None
        if ensemble and tokens and q is None:
            raise ProtocolError("ensemble verification needs q (q_idx/q_prob or q) with every draft")
        s.draft = {"tokens": tokens, "q": q, "idle_rounds": msg.idle_rounds, "overlap": msg.overlap}
        s.metrics.bytes_in += receipt.nbytes
        s.metrics.message_s += receipt.decode_s
        if msg.sent_at is not None:
            s.metrics.transit_s += max(0.0, time.time() - msg.sent_at)
        if msg.stats is not None:
            s.metrics.drafter_stats = msg.stats

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

    def _send_drafter(self, frames: list) -> None:
        if self.drafter is not None:
            self.drafter_sock.send_multipart([self.drafter.routing_id, *frames], copy=False)

    # --------------------------------------------------------------- client side
    def _on_client_message(self, peer: bytes, msg: Message, receipt: Receipt) -> None:
        if isinstance(msg, Generate):
            try:
                self._on_generate(peer, msg)
            except (ParamError, ValueError) as exc:
                raise ProtocolError(str(exc), code="bad_request", request_id=msg.request_id) from None
        elif isinstance(msg, Cancel):
            sid = self.by_request.get((peer, msg.request_id))
            if sid is not None:
                self._finish(self.sessions[sid], "cancelled")
        elif isinstance(msg, Ping):
            d = self.drafter
            self.client_sock.send_multipart([peer, *encode(Pong(
                drafter_connected=bool(d and d.alive()), drafter_type=d.type if d else None,
                target=self.model_name, sessions=len(self.sessions),
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
        d = self.drafter
        if d is not None and d.alive() and self._lacks_q(params, d):
            raise ParamError(
                f"ensemble verification needs the draft distribution q; drafter type {d.type!r} sends none under "
                "greedy decoding (use do_sample=true, or a drafter that sends q when greedy)"
            )
        prompt = self._prompt_ids(msg)
        if self.max_positions and len(prompt) + params.max_new_tokens > self.max_positions:
            raise ParamError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the target's "
                f"context of {self.max_positions}"
            )
        sid = self.next_sid
        self.next_sid += 1
        s = Session(sid, self.model, self.tokenizer, prompt, params, peer, rid, self.ensemble_weight)
        self.sessions[sid] = s
        self.by_request[(peer, rid)] = sid
        self.order.append(sid)

    def _prompt_ids(self, msg: Generate) -> list[int]:
        # decode checked the types and that exactly one of token_ids, prompt and messages is given
        if msg.token_ids is not None:
            ids = msg.token_ids
        elif msg.prompt is not None:
            ids = self.tokenizer(msg.prompt, add_special_tokens=True)["input_ids"]
        else:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ParamError("the target's tokenizer has no chat template; send prompt or token_ids")
            ids = self.tokenizer.apply_chat_template(msg.messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        if not ids:
            raise ParamError("the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ParamError(f"token ids must be in [0, {self.vocab_size})")
        return list(ids)

    # ------------------------------------------------------------------ rounds
    def _run_round(self, s: Session) -> None:
        want_hidden = bool(self.drafter and self.drafter.needs_hidden)
        kv_layers = self.drafter.kv_layers if self.drafter else []
        if not s.prefilled:
            # A prompt is one long forward: every core (a drafter that drafts prefills its own copy meanwhile, one
            # whose plan is k = 0 waits; the threads follow the plan again from the first round)
            self._use_threads(self.threads.full)
            if not (want_hidden or kv_layers):
                self._announce(s)
            hidden, kv = s.prefill(want_hidden, kv_layers)
            if want_hidden or kv_layers:
                self._announce(s, hidden, kv)
            return
        draft = s.draft or {"tokens": [], "q": None, "idle_rounds": 0, "overlap": False}
        s.draft = None
        if draft["idle_rounds"]:
            s.solo_left = draft["idle_rounds"]
        solo = s.solo_left > 0
        s.solo_left = max(0, s.solo_left - 1)
        # Every core while the drafter idles (k = 0, a synchronous block, no drafter); the share while it pre-drafts.
        drafter_busy = draft["tokens"] and draft["overlap"] and self.drafter is not None and self.drafter.alive()
        self._use_threads(self.threads.share if drafter_busy and not solo else self.threads.full)
        result = s.verify(draft["tokens"], draft["q"], want_hidden, kv_layers)
        result.threads = self._threads_now
        if solo:
            s.metrics.solo_rounds += 1
        self._publish(s, result)
        if s.finished:
            self._finish(s, s.finished)

    def _use_threads(self, count: int) -> None:
        if count != self._threads_now:
            set_threads(count)
            self._threads_now = count

    def _publish(self, s: Session, r: RoundResult) -> None:
        t0 = time.monotonic()
        if s.announced and self.drafter is not None:
            frames = encode(Commit(session=s.sid, base_len=r.base_len, tokens=r.tokens, new_len=len(s.tokens),
                                   drafted=r.drafted, accepted=r.accepted, verify_s=r.forward_s, threads=r.threads,
                                   tensors=self._extras(s, r.hidden, r.kv)))
            s.metrics.bytes_out += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
            self._send_drafter(frames)
        delta = s.text.push(r.tokens)
        self.client_sock.send_multipart([s.client, *encode(Chunk(request_id=s.request_id, token_ids=r.tokens,
                                                                 text=delta))])
        s.metrics.message_s += time.monotonic() - t0

    def _finish(self, s: Session, reason: str) -> None:
        text = self.tokenizer.decode(s.generated, skip_special_tokens=True)
        self.client_sock.send_multipart([s.client, *encode(Done(
            request_id=s.request_id, token_ids=s.generated, text=text,
            metrics=s.summary(verifier_dtype=self.dtype, drafter_dtype=self.drafter.dtype if self.drafter else None),
            finish_reason=reason,
        ))])
        if s.announced:
            self._send_drafter(encode(SessionEnd(session=s.sid)))
        del self.sessions[s.sid]
        del self.by_request[(s.client, s.request_id)]
        self.order.remove(s.sid)


def run(config: dict[str, Any]) -> None:
    """Entry point of the verifier process."""
    VerifierServer(config).serve()
