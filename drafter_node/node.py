"""The drafter node: connects to the verifier, keeps one draft session per request, and overlaps drafting with
verification.

Loop: drain messages (session starts, commits, ends), then do one unit of work for one session, round-robin. A unit
is either sending a ready block or one drafter step (one token), so a commit is noticed within one step.

Overlap (``overlap: true``): after sending a block, the session pre-drafts what comes after it while it is
verified. Types that support it (``DraftSession.begin_speculation``; model-based drafters on greedy requests)
extend every outcome of the block at once (see :mod:`drafter_node.branches`); others extend the single chain on the
assumption that the block is fully accepted and the bonus is the drafter's own next token. When a commit confirms a
pre-drafted outcome, the next block goes out at once — a *pre-draft hit*; otherwise ``observe_commit`` rolls back
and drafting restarts from the commit.

Synchronous mode (``overlap: false``) drafts exactly one block and waits for its commit: the baseline to compare.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections import deque
from typing import Any

import torch
import zmq

from drafter_node.base import Drafter, DraftSession
from drafter_node.schedule import DraftLengthSchedule
from drafter_node.types import drafter_class
from shared.models import ModelLoadError, set_threads
from shared.protocol import Message, ProtocolError, decode, encode
from shared.sampling import GenerationParams
from shared.transport import connect_dealer

log = logging.getLogger("pipespec.drafter")

HEARTBEAT_S = 0.25
HELLO_RETRY_S = 1.0


class NodeSession:
    """A draft session plus what the node tracks for it: the block length schedule and what was already sent."""

    def __init__(self, sid: int, draft: DraftSession, schedule: DraftLengthSchedule, overlap: bool):
        self.sid = sid
        self.draft = draft
        self.schedule = schedule
        self.overlap = overlap
        self.sent_base: int | None = None  # committed length of the last block sent
        self.sent_len = 0
        self.sent_at = 0.0
        self.exhausted = False  # propose() had nothing more to give on this base
        self.stats = {"busy_s": 0.0, "blocks": 0, "predraft_hits": 0, "rolled_back": 0}

    @property
    def base_len(self) -> int:
        return len(self.draft.committed)

    def block_pending(self) -> bool:
        return self.sent_base != self.base_len

    def speculation_targets(self) -> int:
        """How long the single chain should grow before the drafter idles (when outcomes are not pre-drafted).

        Synchronous: one block. Overlapped: the block, a guess for the bonus token, and the next block.
        """
        if self.block_pending() or not self.overlap:
            return self.schedule.k
        return self.sent_len + 1 + self.schedule.k_if_accepted()

    def ready_to_send(self) -> bool:
        d = self.draft
        return self.block_pending() and (len(d.chain) >= self.schedule.k or d.ended or self.exhausted)

    def wants_step(self) -> bool:
        if self.exhausted:
            return False
        if not self.block_pending() and not self.overlap:
            return False
        depth = self.draft.speculation_depth
        if depth is not None:
            return depth < self.schedule.k_if_accepted()
        return not self.draft.ended and len(self.draft.chain) < self.speculation_targets()

    def step(self) -> None:
        t0 = time.monotonic()
        if self.draft.speculation_depth is not None:
            self.draft.speculate_step()
        elif self.draft.propose(self._step_size()) == 0:
            self.exhausted = True
        spent = time.monotonic() - t0
        self.schedule.observe_step(spent)
        self.stats["busy_s"] += spent

    def _step_size(self) -> int:
        if not self.draft.cheap_steps:
            return 1  # one forward per step keeps the node responsive to commits
        return max(1, self.speculation_targets() - len(self.draft.chain))

    def after_send(self) -> None:
        """Start pre-drafting the outcomes of the block just sent (overlap only)."""
        if self.overlap:
            t0 = time.monotonic()
            self.draft.begin_speculation(self.sent_len)
            self.stats["busy_s"] += time.monotonic() - t0

    def block(self) -> tuple[list[int], dict[str, torch.Tensor]]:
        chain = self.draft.chain[: self.schedule.k]
        tokens = [d.token for d in chain]
        tensors = {}
        if chain and chain[0].q_idx is not None:
            tensors = {"q_idx": torch.stack([d.q_idx for d in chain]), "q_prob": torch.stack([d.q_prob for d in chain])}
        self.sent_base, self.sent_len = self.base_len, len(tokens)
        self.sent_at = time.monotonic()
        self.stats["blocks"] += 1
        return tokens, tensors

    def on_commit(self, tokens: list[int], drafted: int, accepted: int, extras: dict[str, torch.Tensor]) -> None:
        """Apply a commit; ``drafted`` is how many of our block's tokens the verifier checked (0: not used)."""
        t0 = time.monotonic()
        verified_ours = drafted > 0 and self.sent_base == self.base_len
        chain_before = len(self.draft.chain)
        matched = self.draft.observe_commit(tokens, extras)
        if matched < len(tokens):
            self.stats["rolled_back"] += chain_before - matched
        if verified_ours:
            self.schedule.observe_roundtrip(time.monotonic() - self.sent_at)
        self.schedule.update(drafted, accepted)
        self.exhausted = False
        if self.overlap and matched == len(tokens) and self.draft.chain:
            self.stats["predraft_hits"] += 1  # the next block's start was drafted before the commit came
        self.stats["busy_s"] += time.monotonic() - t0


def load_drafter(dcfg: dict[str, Any]) -> Drafter:
    """Build the configured drafter type; files it cannot read or fetch (a hub id without hub access, a missing
    folder) become one clear error naming what it was loading, not a traceback from deep inside a loader."""
    try:
        return drafter_class(dcfg["type"])(dcfg)
    except OSError as exc:
        sources = ", ".join(f"{k}={dcfg[k]!r}" for k in ("model", "target_model") if dcfg.get(k))
        raise ModelLoadError(f"drafter type {dcfg['type']!r} cannot load its files ({sources}): {exc}") from None


class DrafterNode:
    def __init__(self, config: dict[str, Any], drafter: Drafter | None = None):
        dcfg = config["drafter"]
        self.dcfg = dcfg
        set_threads(dcfg["threads"])
        self.drafter = drafter or load_drafter(dcfg)
        self.endpoint = dcfg.get("verifier_endpoint") or config["verifier"]["endpoint"]
        self.max_bytes = config["verifier"].get("max_message_bytes", 64 * 1024 * 1024)
        self.ctx = zmq.Context.instance()
        self.sock = connect_dealer(self.ctx, self.endpoint)
        self.sessions: dict[int, NodeSession] = {}
        self.order: deque[int] = deque()
        self.running = True
        self.welcomed = False
        self.want_q = False  # the verifier wants q with greedy drafts too (ensemble verification)
        self.last_sent = 0.0

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        try:
            return self._loop()
        finally:
            self.sock.close(linger=0)

    def stop(self) -> None:
        self.running = False

    def _send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)
        self.last_sent = time.monotonic()

    def _hello(self) -> None:
        self._send(encode("hello", drafter_type=self.drafter.type_name, tokenizer_id=self.drafter.tokenizer_id,
                          capabilities=self.drafter.capabilities.to_dict()))

    def _loop(self) -> int:
        last_hello = 0.0
        while self.running:
            now = time.monotonic()
            if not self.welcomed and now - last_hello > HELLO_RETRY_S:
                self._hello()
                last_hello = now
            elif self.welcomed and now - self.last_sent > HEARTBEAT_S:
                self._send(encode("heartbeat"))
            work = self._next_work()
            if self.sock.poll(0 if work else 50):
                for _ in range(1000):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    status = self._on_message(frames)
                    if status is not None:
                        return status
                work = self._next_work()
            if work is not None:
                if work.ready_to_send():
                    self._send_block(work)
                else:
                    work.step()
        return 0

    def _next_work(self) -> NodeSession | None:
        """Round-robin, by priority: a block to send, a block the verifier still waits for, then pre-drafting."""
        for wanted in (
            NodeSession.ready_to_send,
            lambda s: s.block_pending() and s.wants_step(),
            NodeSession.wants_step,
        ):
            for sid in self.order:
                s = self.sessions[sid]
                if wanted(s):
                    self.order.remove(sid)
                    self.order.append(sid)
                    return s
        return None

    def _send_block(self, s: NodeSession) -> None:
        tokens, tensors = s.block()
        self._send(encode("draft", tensors, session=s.sid, base_len=s.sent_base, epoch=s.stats["blocks"],
                          tokens=tokens, sent_at=time.time(), stats=dict(s.stats)))
        s.after_send()

    def _on_message(self, frames: list) -> int | None:
        try:
            msg = decode(frames, self.max_bytes)
        except ProtocolError as exc:
            log.warning("dropped a malformed message from the verifier: %s", exc)
            return None
        handler = getattr(self, f"_on_{msg.type}", None)
        if handler is None:
            log.warning("ignored unexpected message %r", msg.type)
            return None
        return handler(msg)

    def _on_welcome(self, msg: Message) -> None:
        self.welcomed = True
        self.drafter.target_vocab_size = msg["vocab_size"]
        self.want_q = bool(msg.get("want_q", False)) and self.drafter.capabilities.greedy_q
        log.info("connected to verifier (target %s)", msg["target"])

    def _on_error(self, msg: Message) -> int | None:
        log.error("verifier: %s", msg["message"])
        if msg.get("code") in ("tokenizer_mismatch", "bad_version", "ensemble_needs_q", "unsupported"):
            hint = self.drafter.tokenizer_hint if msg.get("code") == "tokenizer_mismatch" else ""
            print(f"pipespec drafter: refused by the verifier: {msg['message']}{hint}", file=sys.stderr)
            return 2
        return None

    def _on_session_start(self, msg: Message) -> None:
        sid = msg["session"]
        old = self.sessions.pop(sid, None)
        if old:
            self.order.remove(sid)
            old.draft.close()
        params = GenerationParams.from_dict(msg["params"])
        prompt_len = int(msg.get("prompt_len", len(msg["token_ids"])))
        draft = self.drafter.open_session(msg["token_ids"], prompt_len, params, msg.tensors)
        draft.want_q = self.want_q
        if self.drafter.block_len is not None:
            schedule = DraftLengthSchedule(self.drafter.block_len, "constant")
        else:
            schedule = DraftLengthSchedule.from_config(self.dcfg)
        self.sessions[sid] = NodeSession(sid, draft, schedule, bool(self.dcfg.get("overlap", True)))
        self.order.append(sid)

    def _on_commit(self, msg: Message) -> None:
        s = self.sessions.get(msg["session"])
        if s is None or msg["base_len"] != s.base_len:
            return  # a duplicate or a commit for a session we no longer hold
        s.on_commit(msg["tokens"], int(msg.get("drafted", 0)), int(msg.get("accepted", 0)), msg.tensors)

    def _on_state(self, msg: Message) -> None:
        s = self.sessions.get(msg["session"])
        if s is None or msg["base_len"] != s.base_len:
            return
        s.draft.observe_state(msg.tensors, int(msg["end"]))

    def _on_session_end(self, msg: Message) -> None:
        s = self.sessions.pop(msg["session"], None)
        if s is not None:
            self.order.remove(s.sid)
            s.draft.close()


def run(config: dict[str, Any]) -> int:
    """Entry point of the drafter process."""
    return DrafterNode(config).serve()
