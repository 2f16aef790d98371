"""The drafter node's answers to the verifier's messages, and the bookkeeping of sessions they drive.

:class:`MessageHandler` decodes a message and applies it: a welcome (the verifier's costs, whether it wants q, this
pair's remembered acceptance), a session start (a draft session with its block length schedule), a commit, target
state, a session end, an error (a refusal ends the node; ``not_connected`` rejoins). It opens, drops and forgets
sessions in the node's :class:`~drafter_node.node_picker.WorkPicker`; it never touches the socket, and asks the node
to rejoin through the callback it is given.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from drafter_node import pair_memory
from drafter_node.base import Drafter, DraftSession
from drafter_node.cost_model import CostBook
from drafter_node.node_picker import LinkPacer, WorkPicker
from drafter_node.node_session import NodeSession
from drafter_node.schedule import CostSchedule, DraftLengthSchedule
from drafter_node.settings import DrafterConfig
from shared.costs.curve import NodeProfile
from shared.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Commit,
    Error,
    Heartbeat,
    ProtocolError,
    SessionEnd,
    SessionStart,
    State,
    ThreadCounts,
    Welcome,
    decode,
)
from shared.sampling import GenerationParams

log = logging.getLogger("pipespec.drafter")

#: Error codes after which this drafter cannot serve this verifier: the node stops with exit status 2.
REFUSALS = ("tokenizer_mismatch", "bad_version", "ensemble_needs_q", "unsupported", "unauthorized")


class MessageHandler:
    """Applies the verifier's messages to the sessions in ``picker``, the cost ``book`` and the ``link`` state.

    ``rejoin(reason)``: the node's reconnect (called when the verifier says it does not know us); ``costs_fixed``:
    the book's curves are fixed (tests), so the verifier's profile and this pair's memory are not used."""

    def __init__(self, settings: DrafterConfig, drafter: Drafter, book: CostBook, picker: WorkPicker[NodeSession],
                 link: LinkPacer, rejoin: Callable[[str], None], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 costs_fixed: bool = False):
        self.settings = settings
        self.drafter = drafter
        self.book = book
        self.picker = picker
        self.max_k = picker.max_k
        self.link = link
        self.rejoin = rejoin
        self.max_bytes = max_bytes
        self.costs_fixed = costs_fixed
        self.want_q = False  # the verifier wants q with greedy drafts too (ensemble verification)
        self.trees = settings.tree  # token trees allowed (off after the verifier refuses one)
        self.memory: pair_memory.PairMemory | None = None  # this pair's remembered acceptance (set at the welcome)
        # Set by a welcome: the node sends its start-up report (drafter_node.start_report) in its next heartbeat.
        self.report_due = False
        self.verifier_profile: NodeProfile | None = None
        self.verifier_threads: ThreadCounts | None = None
        self.verifier_dtype: str | None = None
        self._handlers: dict[type, Callable[[Any], int | None]] = {
            Welcome: self.on_welcome, Error: self.on_error, SessionStart: self.on_session_start,
            Commit: self.on_commit, State: self.on_state, SessionEnd: self.on_session_end,
            Heartbeat: self.on_heartbeat}

    # ------------------------------------------------------------------------------------------ session bookkeeping
    def drop(self, sid: int) -> None:
        """Forget session ``sid`` (the verifier steps it without drafts) and close its draft session."""
        s = self.picker.remove(sid)
        if s is not None:
            with contextlib.suppress(Exception):
                s.draft.close()

    def forget_all(self) -> None:
        """A new connection: no session survives it, and a new verifier may take token trees."""
        for s in self.picker.clear():
            s.draft.close()
        self.trees = self.settings.tree  # a new verifier may take them

    @contextlib.contextmanager
    def dropped_on_failure(self, sid: int, doing: str = "drafting") -> Iterator[None]:
        """Whatever fails inside drops session ``sid`` alone (the verifier steps it without drafts), never the node;
        the code after the block runs either way."""
        try:
            yield
        except Exception:
            log.exception("session %d failed while %s; dropped", sid, doing)
            self.drop(sid)

    # ---------------------------------------------------------------------------------------------------- messages
    def on_message(self, frames: list) -> int | None:
        """Apply one message; an exit status where the node must stop (refused by the verifier), else None."""
        try:
            msg = decode(frames, self.max_bytes)
        except ProtocolError as exc:
            log.warning("dropped a malformed message from the verifier: %s", exc)
            return None
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("ignored unexpected message %r", msg.TYPE)
            return None
        try:
            return handler(msg)
        except Exception:  # schema-valid but unusable (bad params, state of the wrong shape): drop that session
            sid = getattr(msg, "session", None)
            log.exception("could not apply a %s message%s; dropped", msg.TYPE,
                          f" for session {sid}" if sid is not None else "")
            if sid is not None:
                self.drop(sid)
            return None

    def on_welcome(self, msg: Welcome) -> None:
        first = self.link.welcome()  # hellos queued while the verifier started are each welcomed
        self.drafter.target_vocab_size = msg.vocab_size
        threads = msg.threads or ThreadCounts()
        try:
            if msg.profile is not None:
                self.verifier_profile = NodeProfile.from_dict(msg.profile)
                if not self.costs_fixed:
                    self.book.set_verifier(self.verifier_profile, threads.share, threads.full)
        except (ValueError, TypeError) as exc:
            log.warning("ignored the verifier's cost profile: %s", exc)
        self.book.rollback_refeeds = msg.rollback_refeeds
        self.verifier_threads = msg.threads
        self.verifier_dtype = msg.dtype
        self.want_q = msg.want_q and self.drafter.capabilities.greedy_q
        if first:  # the welcomes of the other queued hellos change nothing worth a line each
            log.info("connected to verifier (target %s)", msg.target)
            self._recall_pair(msg.target)
            self.report_due = True
        if first and self.book.ready and self.settings.draft_schedule == "cost":
            for row in self.book.plans_by_batch(self.book.session_acceptance(), self.max_k, True, 0,
                                                overlap=self.settings.overlap):
                log.info("plan at batch %(batch)d (prior acceptance): k=%(k)d overlap=%(overlap)s rows=%(rows)d, "
                         "%(tokens_per_s).1f tok/s vs %(plain_tokens_per_s).1f plain", row)

    def _recall_pair(self, target: str) -> None:
        """Start the cost schedule from what earlier runs of this pair accepted (``drafter.remember_acceptance``)."""
        if not self.settings.remember_acceptance or self.costs_fixed:
            return
        model = getattr(self.drafter, "profile_model", None)
        drafter_dtype = str(model.dtype).removeprefix("torch.") if model is not None else "native"
        path = pair_memory.memory_path(self.drafter.type_name, self.settings.model, target,
                                       f"{self.verifier_dtype or '?'}/{drafter_dtype}")
        remembered = pair_memory.load(path, self.max_k)
        self.memory = pair_memory.PairMemory(path, remembered[1] if remembered else 0)
        if remembered is not None:
            self.book.acceptance = remembered[0]
            log.info("acceptance prior from %d earlier request(s) of this pair: α = %s", remembered[1],
                     " ".join(f"{remembered[0].alpha(i):.2f}" for i in range(min(self.max_k, 8))))

    def on_heartbeat(self, msg: Heartbeat) -> None:
        """The verifier's answer to ours: it is there (the node marks it heard for every message)."""

    def on_error(self, msg: Error) -> int | None:
        if msg.code == "not_connected":
            # the verifier does not know us (any more): a restarted verifier, or one that forgot us
            if self.link.welcomed:
                self.rejoin("the verifier does not know this drafter (restarted?)")
            return None  # not welcomed: answers to what we sent before our hello; the hello is on its way
        if msg.code == "tree_refused":  # this verifier (or target) takes no trees from us: chains from now on
            if self.trees:
                log.warning("verifier refused a token tree (%s); sending chains only", msg.message)
            self.trees = False
            for s in self.picker.sessions.values():
                if isinstance(s.schedule, CostSchedule):
                    s.schedule.tree = False
            return None
        log.error("verifier: %s", msg.message)
        if msg.code in REFUSALS:
            hint = self.drafter.tokenizer_hint if msg.code == "tokenizer_mismatch" else ""
            print(f"pipespec drafter: refused by the verifier: {msg.message}{hint}", file=sys.stderr)
            return 2
        return None

    def on_session_start(self, msg: SessionStart) -> None:
        sid = msg.session
        old = self.picker.remove(sid)
        if old:
            old.draft.close()
        params = GenerationParams.from_dict(msg.params)
        prompt_len = len(msg.token_ids) if msg.prompt_len is None else msg.prompt_len
        draft = self.drafter.open_tenant_session(msg.token_ids, prompt_len, params, msg.tensors, msg.tenant)
        draft.want_q = self.want_q
        self.book.start_batch(msg.decoding)  # before the schedule's first plan
        self.picker.add(NodeSession(sid, draft, self._schedule_for(draft), self.book))

    def _schedule_for(self, draft: DraftSession) -> DraftLengthSchedule:
        s = self.settings
        overlap = s.overlap
        fixed = self.drafter.block_len
        # The request's own cap (``num_draft_tokens``, per-request speculation): the verifier cuts longer blocks, so
        # planning within it saves the steps that would be cut. A fixed block (a lookup's: free) stays, cut there.
        cap = draft.params.num_draft_tokens or None
        if s.draft_schedule == "cost":
            max_k = fixed if fixed is not None else min(self.max_k, cap or self.max_k)
            start = min(fixed if fixed is not None else s.num_draft_tokens, max_k)
            return CostSchedule(start, max_k, self.book, lambda: len(draft.committed), overlap,
                                rows_ok=draft.predrafts_rows, tree=self._trees_for(draft))
        if fixed is not None:
            return DraftLengthSchedule(fixed, "constant", max_k=s.max_draft_tokens, overlap=overlap)
        if cap is None:
            return DraftLengthSchedule(s.num_draft_tokens, s.draft_schedule, max_k=s.max_draft_tokens, overlap=overlap)
        return DraftLengthSchedule(min(s.num_draft_tokens, cap), s.draft_schedule,
                                   max_k=min(max(s.max_draft_tokens, s.num_draft_tokens), cap), overlap=overlap)

    def _trees_for(self, draft: DraftSession) -> bool:
        """Blocks may be token trees (``drafter.tree``): greedy requests without q (the verifier verifies trees
        losslessly only there), for drafters that need no target state back (trees come with none)."""
        caps = self.drafter.capabilities
        return (self.trees and not draft.params.do_sample and not draft.want_q and not caps.needs_hidden_states
                and not caps.needs_kv_layers)

    def on_commit(self, msg: Commit) -> None:
        s = self.picker.sessions.get(msg.session)
        if s is None or msg.base_len != s.base_len:
            return  # a duplicate or a commit for a session we no longer hold
        s.on_commit(msg.tokens, msg.drafted, msg.accepted, msg.tensors, msg.verify_s, msg.threads, msg.batch_sessions,
                    msg.batch_tokens, msg.decoding)

    def on_state(self, msg: State) -> None:
        s = self.picker.sessions.get(msg.session)
        if s is None or msg.base_len != s.base_len:
            return
        s.draft.observe_state(msg.tensors, msg.end)

    def on_session_end(self, msg: SessionEnd) -> None:
        s = self.picker.remove(msg.session)
        if s is not None:
            s.draft.close()
            if self.memory is not None and s.stats.blocks > s.stats.idle_blocks:
                self.memory.session_ended(self.book.acceptance)
