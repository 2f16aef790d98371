"""The drafter node: connects to the verifier, keeps one draft session per request, and overlaps drafting with
verification.

Loop: drain messages (session starts, commits, ends), then do one unit of work for one session, round-robin. A unit
is either sending a ready block or one drafter step (one token), so a commit is noticed within one step.

Batched drafting (``batching: true``, the default): when the unit is a step, every other session that wants one
(whose block the verifier waits for first, then pre-drafting ones) joins it, up to ``max_batch_sessions``, and one
drafter forward (:func:`shared.batch.feed_rows`) advances all their chains and pre-draft rows at once — for types
whose sessions express a step as rows of such a forward (``DraftSession.batch_step``: model-based types over their
own cache); the others step alone.

Overlap (``overlap: true``): after sending a block, the session pre-drafts what comes after it while it is
verified. Types that support it (``DraftSession.begin_speculation``; model-based drafters on greedy requests)
extend every outcome of the block at once (see :mod:`drafter_node.branches`); others extend the single chain on the
assumption that the block is fully accepted and the bonus is the drafter's own next token. When a commit confirms a
pre-drafted outcome, the next block goes out at once — a *pre-draft hit*; otherwise ``observe_commit`` rolls back
and drafting restarts from the commit.

Synchronous mode (``overlap: false``) drafts exactly one block and waits for its commit: the baseline to compare.
With the ``cost`` schedule (the default) each round's plan chooses between the two, and k = 0: an empty block with
``idle_rounds = n`` tells the verifier to step alone for n rounds, after which the node sends one synchronous probe
block and plans again.

``threads: auto`` (CPU): the node computes with every core while the verifier waits for it (synchronous rounds and
probes) and with its share while both work (overlap); see :mod:`drafter_node.cost_model`.

Rejoin: the verifier answers heartbeats. When it says ``not_connected`` (it restarted, or it dropped this drafter
after a long silence) or nothing at all comes from it for ``VERIFIER_SILENT_S``, the node drops its sessions, opens a
fresh socket (a new connection: nothing queued for the old verifier is delivered to a new one) and says hello again.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import zmq

from drafter_node import pair_memory
from drafter_node.base import BatchStep, Drafter, DraftSession
from drafter_node.cost_model import CostBook
from drafter_node.schedule import CostSchedule, DraftLengthSchedule
from drafter_node.types import drafter_class
from shared.batch import feed_rows
from shared.costs import CostCurve, CurveCheck, NodeProfile, measuring_alone
from shared.models import ModelLoadError, ProfileSpec, ThreadPlan, profile_node, profile_sizes, set_threads
from shared.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_HOST_CHARS,
    Commit,
    Draft,
    Error,
    Heartbeat,
    Hello,
    ProtocolError,
    SessionEnd,
    SessionStart,
    State,
    ThreadCounts,
    Welcome,
    decode,
    encode,
)
from shared.sampling import GenerationParams
from shared.transport import AuthWatch, DrafterLinks, connect_dealer

log = logging.getLogger("pipespec.drafter")

HEARTBEAT_S = 0.25
HELLO_RETRY_S = 1.0
#: No message from the verifier for this long while welcomed (it answers heartbeats): it is gone; say hello again.
#: Generous, because a verifier computing one long prefill reads nothing meanwhile.
VERIFIER_SILENT_S = 15.0


class NodeSession:
    """A draft session plus what the node tracks for it: the block length schedule and what was already sent."""

    def __init__(self, sid: int, draft: DraftSession, schedule: DraftLengthSchedule, book: CostBook | None = None):
        self.sid = sid
        self.draft = draft
        self.schedule = schedule
        self.book = book
        self.sent_base: int | None = None  # committed length of the last block sent
        self.sent_len = 0
        self.sent_at = 0.0
        self.sent_guesses: list[int | None] = []  # our guess of the verifier's token per outcome of the block sent
        self.sent_probs: list[float | None] = []  # the drafter's probability of each token of the block sent
        self.sent_chain: list[int] = []  # the chain tokens of the block sent
        self.sent_sides: dict[int, int] = {}  # chain position -> second-choice leaf sent there (a token tree)
        self.exhausted = False  # propose() had nothing more to give on this base
        self.idle_period_sent = 0  # the schedule's k = 0 run whose idle block went out
        self.threads = 0  # torch threads of the last step (0: not set by the node)
        self.timed_block = False  # a block of ours was verified (later round trips are overhead samples)
        self.last_step: tuple[int, float] | None = None  # (forward size, seconds) of its last one-forward step
        self._sized: tuple | None = None  # what _sized_done last answered for: (base, chain length, plan)
        self._sized_value: bool | None = None
        # batch_steps: steps that advanced this session; batch_rows: the sessions in each of their forwards, summed
        self.stats = {"busy_s": 0.0, "blocks": 0, "predraft_hits": 0, "rolled_back": 0, "idle_blocks": 0,
                      "batch_steps": 0, "batch_rows": 0, "tree_blocks": 0, "side_accepted": 0}
        # Where this session's drafter time went, summed (the request's metrics show it per block): drafter forwards
        # (``step``, pre-drafting included), encoding and sending blocks, applying commits, and the round trips
        # (block sent → its commit applied: verification as the drafter sees it).
        self.timing = {"step_s": 0.0, "send_s": 0.0, "commit_s": 0.0, "roundtrip_s": 0.0, "roundtrips": 0}
        # Per plan used (``solo``, ``sync k=4``, ``overlap k=5 rows=3``, or the schedule's k): [rounds, committed
        # tokens, seconds between commits, the predicted tokens/s summed] — what the cost model expected against
        # what the rounds gave.
        self.plan_rates: dict[str, list[float]] = {}
        self.last_commit_at: float | None = None

    @property
    def solo_wait(self) -> bool:
        """This k = 0 run's idle block went out: nothing to send until the schedule's rounds end."""
        s = self.schedule
        return s.k == 0 and s.solo_rounds > 0 and self.idle_period_sent == s.solo_period

    @property
    def overlap(self) -> bool:
        """Pre-draft while the block in flight is verified (this round's plan)."""
        return self.schedule.overlap_now

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

    def _sized_done(self) -> bool | None:
        """For a block sized by the drafter's confidence (``CostSchedule.confidence_sized``): whether the chain
        drafted so far should go now; None where the plan's fixed k applies."""
        if not self.block_pending():
            return None
        # asked several times per loop turn (what to send, what to step, the block's length): once per chain length
        key = (self.base_len, len(self.draft.chain), id(getattr(self.schedule, "plan", None)))
        if self._sized != key:
            self._sized, self._sized_value = key, self.schedule.block_done([d.prob for d in self.draft.chain])
        return self._sized_value

    def block_len(self) -> int:
        """Tokens the block sent now carries: the plan's k, or the whole chain of a confidence-sized block."""
        return len(self.draft.chain) if self._sized_done() is not None else self.schedule.k

    def ready_to_send(self) -> bool:
        d = self.draft
        if not self.block_pending() or self.solo_wait:
            return False
        if self.schedule.k and (done := self._sized_done()) is not None:
            return done or d.ended or self.exhausted
        return self.schedule.k == 0 or len(d.chain) >= self.schedule.k or d.ended or self.exhausted

    def wants_step(self) -> bool:
        if self.exhausted or self.solo_wait or self.schedule.k == 0:
            return False
        if not self.block_pending() and not self.overlap:
            return False
        if (done := self._sized_done()) is not None:
            return not done and not self.draft.ended
        depth = self.draft.speculation_depth
        if depth is not None:
            return depth < self.schedule.k_if_accepted()
        return not self.draft.ended and len(self.draft.chain) < self.speculation_targets()

    def step(self) -> None:
        """One step of this session alone (one drafter forward, or a cheap type's whole block)."""
        lm = getattr(self.draft, "lm", None)
        fed_before = getattr(lm, "fed_total", 0)
        t0 = time.monotonic()
        advanced = True
        if self.draft.speculation_depth is not None:
            self.draft.speculate_step()
        elif self.draft.propose(self._step_size()) == 0:
            self.exhausted = True
            advanced = False
        spent = time.monotonic() - t0
        self.stepped(spent, 1 if advanced else 0)
        # A step that also caught up on the prompt or a commit (more tokens fed than its last forward's) is not a
        # sample of one forward's cost.
        one_forward = getattr(lm, "fed_total", 0) - fed_before <= max(1, self.draft.forward_size)
        self.last_step = (self.draft.forward_size, spent) if one_forward and not self.draft.cheap_steps else None
        if self.book is not None and self.last_step is not None:
            self.book.observe_draft(self.draft.forward_size, spent, self.threads, self.base_len)

    def stepped(self, spent: float, sessions: int) -> None:
        """A step of ``spent`` seconds advanced this session in a forward over ``sessions`` sessions (0: it added
        nothing)."""
        self.schedule.observe_step(spent)
        self.stats["busy_s"] += spent
        self.timing["step_s"] += spent
        if sessions:
            self.stats["batch_steps"] += 1
            self.stats["batch_rows"] += sessions

    def _step_size(self) -> int:
        if not self.draft.cheap_steps:
            return 1  # one forward per step keeps the node responsive to commits
        return max(1, self.speculation_targets() - len(self.draft.chain))

    def after_send(self) -> None:
        """Start pre-drafting the outcomes of the block just sent (overlap only)."""
        if self.overlap and self.sent_len:
            t0 = time.monotonic()
            self.draft.begin_speculation(self.sent_len, self.schedule.rows)
            self.stats["busy_s"] += time.monotonic() - t0
        chain = self.draft.chain
        self.sent_guesses = [d.alt for d in chain[: self.sent_len]]
        self.sent_probs = [d.prob for d in chain[: self.sent_len]]
        self.sent_guesses.append(chain[self.sent_len].token if len(chain) > self.sent_len else None)

    def block(self) -> tuple[list[int], dict[str, torch.Tensor], int, list[int] | None]:
        """The block to send now, its q tensors, how many rounds the verifier should then take alone, and its
        parents when the plan makes it a token tree (None: a chain)."""
        idle_rounds = self.schedule.solo_rounds if self.schedule.k == 0 else 0
        chain = self.draft.chain[: self.block_len() if self.schedule.k else 0]
        tokens = [d.token for d in chain]
        tensors = {}
        if chain and chain[0].q_idx is not None:
            tensors = {"q_idx": torch.stack([d.q_idx for d in chain]), "q_prob": torch.stack([d.q_prob for d in chain])}
        self.sent_base, self.sent_len = self.base_len, len(tokens)
        self.sent_chain = list(tokens)
        self.sent_sides = {}
        parents = None
        sides = getattr(getattr(self.schedule, "plan", None), "sides", ())
        if sides and not tensors:
            self.sent_sides = {i: chain[i].alt for i in sides if i < len(chain) and chain[i].alt is not None
                               and chain[i].alt != chain[i].token}
        if self.sent_sides:
            tokens, parents = tree_block(self.sent_chain, self.sent_sides)
            self.stats["tree_blocks"] += 1
        self.sent_at = time.monotonic()
        self.stats["blocks"] += 1
        if idle_rounds:
            self.idle_period_sent = self.schedule.solo_period
            self.stats["idle_blocks"] += 1
        return tokens, tensors, idle_rounds, parents

    def on_commit(self, tokens: list[int], drafted: int, accepted: int, extras: dict[str, torch.Tensor],
                  verify_s: float | None = None, verifier_threads: int = 0, batch_sessions: int = 1,
                  batch_tokens: int = 0, decoding: int = 0) -> None:
        """Apply a commit; ``drafted`` is how many of our block's tokens the verifier checked (0: not used);
        ``verify_s``: the verifier's forward time of the round (with ``verifier_threads`` threads), a forward over
        ``batch_tokens`` tokens of ``batch_sessions`` sessions (batched verification); ``decoding``: how many
        sessions would share a forward if all stepped now (the batch to plan for; 0: unknown)."""
        t0 = time.monotonic()
        verified_ours = drafted > 0 and self.sent_base == self.base_len
        if verified_ours and self.sent_sides:
            # A tree: the verifier counts its nodes and the accepted path; our estimates are of the chain (how many
            # of its tokens the target took, the second choice as the guess of its token at the first rejection).
            drafted, accepted = self.sent_len, 0
            while accepted < min(drafted, len(tokens)) and tokens[accepted] == self.sent_chain[accepted]:
                accepted += 1
            if accepted < len(tokens) and self.sent_sides.get(accepted) == tokens[accepted]:
                self.stats["side_accepted"] += 1
        if verified_ours:
            self.schedule.observe_confidence(self.sent_probs[:drafted], accepted)
        if verified_ours and accepted < len(tokens) and accepted < len(self.sent_guesses):
            guess = self.sent_guesses[accepted]
            if guess is not None:
                self.schedule.observe_guess(bonus=accepted == drafted, correct=guess == tokens[accepted])
        if self.book is not None and verify_s is not None and verify_s > 0:
            self.book.observe_verify(batch_tokens or drafted + 1, verify_s, verifier_threads, self.base_len)
            self.book.observe_batch(decoding or batch_sessions)
            if verified_ours and self.timed_block:  # the first block's trip overlaps the verifier's prefill
                self.book.observe_overhead(time.monotonic() - self.sent_at - verify_s)
            self.timed_block = self.timed_block or verified_ours
        self._count_plan_round(len(tokens), t0)
        chain_before = len(self.draft.chain)
        matched = self.draft.observe_commit(tokens, extras)
        if matched < len(tokens):
            self.stats["rolled_back"] += chain_before - matched
        if verified_ours:
            self.schedule.observe_roundtrip(t0 - self.sent_at)
            self.timing["roundtrip_s"] += t0 - self.sent_at
            self.timing["roundtrips"] += 1
        self.schedule.update(drafted, accepted)
        self.exhausted = False
        if self.overlap and matched == len(tokens) and self.draft.chain:
            self.stats["predraft_hits"] += 1  # the next block's start was drafted before the commit came
        spent = time.monotonic() - t0
        self.stats["busy_s"] += spent
        self.timing["commit_s"] += spent

    def _count_plan_round(self, committed: int, now: float) -> None:
        """One round of the plan in force (the one its block was sent under) gave ``committed`` tokens since the
        previous commit. The session's first commit is not counted: its interval includes both prefills."""
        since, self.last_commit_at = self.last_commit_at, now
        if since is None:
            return
        self.schedule.observe_round(committed, now - since)
        label, predicted = plan_label(self.schedule, bool(self.sent_sides))
        if label not in self.plan_rates and len(self.plan_rates) >= MAX_PLAN_LABELS:
            label = "other"
        row = self.plan_rates.setdefault(label, [0, 0, 0.0, 0.0])
        row[0] += 1
        row[1] += committed
        row[2] += now - since
        row[3] += predicted


#: Distinct plans one session reports (the rest are summed as ``other``).
MAX_PLAN_LABELS = 24


def tree_block(chain: list[int], sides: dict[int, int]) -> tuple[list[int], list[int]]:
    """A token tree's ``(tokens, parents)`` (topological, as ``Draft.parents``): the chain, and after chain token i
    the leaf ``sides[i]`` under the same parent (a sibling of chain token i: the drafter's second choice there)."""
    tokens, parents, parent = [], [], -1
    for i, token in enumerate(chain):
        tokens.append(token)
        parents.append(parent)
        node = len(tokens) - 1
        if i in sides:
            tokens.append(sides[i])
            parents.append(parent)
        parent = node
    return tokens, parents


def plan_label(schedule: DraftLengthSchedule, tree: bool = False) -> tuple[str, float]:
    """The name of the plan ``schedule`` is running and the tokens/s its cost model predicted (0: no model);
    ``tree``: its block went out as a token tree."""
    plan = getattr(schedule, "plan", None)
    if isinstance(schedule, CostSchedule) and plan is not None:
        if plan.solo:
            name = "solo"
        elif plan.overlap and not schedule.probing:
            name = f"overlap k={plan.k} rows={plan.rows}"
        elif tree:
            name = f"tree k={plan.k} sides={len(plan.sides)}"
        else:
            name = f"sync k={plan.k}"
        return name, plan.rate
    return f"{schedule.mode} k={schedule.k}", 0.0


def load_drafter(dcfg: dict[str, Any], profile: ProfileSpec | None = None) -> Drafter:
    """Build the configured drafter type; files it cannot read or fetch (a hub id without hub access, a missing
    folder) become one clear error naming what it was loading, not a traceback from deep inside a loader."""
    try:
        return drafter_class(dcfg["type"])(dcfg, profile)
    except OSError as exc:
        sources = ", ".join(f"{k}={dcfg[k]!r}" for k in ("model", "target_model") if dcfg.get(k))
        raise ModelLoadError(f"drafter type {dcfg['type']!r} cannot load its files ({sources}): {exc}") from None


class DrafterNode:
    def __init__(self, config: dict[str, Any], drafter: Drafter | None = None,
                 fixed_costs: tuple[CostCurve, CostCurve] | None = None, *, links: DrafterLinks):
        """``links``: CURVE keys and run secret, resolved by the launcher (``runtime.security.drafter_links``).
        ``fixed_costs``: (verify, draft) curves that replace measured ones and are never re-measured or
        remembered (tests on tiny models, whose forwards all cost about the same, pass them to get the plans they
        mean to exercise: tests/node_entry.py)."""
        dcfg = config["drafter"]
        self.dcfg = dcfg
        self.threads = ThreadPlan.for_node(config, "drafter")
        self.max_k = int(dcfg["max_draft_tokens"])
        # Batched drafting: one drafter forward advances every session that wants a step (drafter.batching).
        self.max_batch_sessions = int(dcfg.get("max_batch_sessions", 64)) if dcfg.get("batching", True) else 1
        set_threads(self.threads.share)
        # Load and measure while no other node on this machine does (the verifier starts at the same time).
        with measuring_alone(dcfg["device"]) if dcfg["profile_s"] > 0 else contextlib.nullcontext():
            self.drafter = drafter or load_drafter(dcfg, self.profile_spec(config))
            self.profile = self._profile(config)
        self.book = CostBook(self.max_k)
        self.book.set_drafter(self.profile, self.threads.share, self.threads.full)
        if self.drafter.free_drafting:  # no model: nothing to measure, and no step to learn a curve from
            self.book.set_free_drafter()
        self.book.draft_batched = self.max_batch_sessions > 1  # what the cost model assumes of our steps
        self._fixed_costs = fixed_costs
        if self._fixed_costs:
            self.book.fix_curves(*self._fixed_costs)
        self._threads_now = self.threads.share
        self.endpoint = dcfg.get("verifier_endpoint") or config["verifier"]["endpoint"]
        self.max_bytes = config["verifier"].get("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
        self.ctx = zmq.Context.instance()
        self.keys = links.keys
        self.key_name = links.key_name
        # Shown in hello where the link has no CURVE (there the verifier's key allow-list decides).
        self.run_secret = links.run_secret
        self.auth_watch: AuthWatch | None = None
        self.sock = self._connect()
        self.sessions: dict[int, NodeSession] = {}
        self.order: deque[int] = deque()
        self.running = True
        self.welcomed = False
        self.want_q = False  # the verifier wants q with greedy drafts too (ensemble verification)
        self.trees = bool(dcfg.get("tree", False))  # token trees allowed (off after the verifier refuses one)
        self.last_sent = 0.0
        self._handlers = {Welcome: self._on_welcome, Error: self._on_error, SessionStart: self._on_session_start,
                          Commit: self._on_commit, State: self._on_state, SessionEnd: self._on_session_end,
                          Heartbeat: self._on_heartbeat}
        self.last_heard = 0.0  # when the last message from the verifier came
        self.last_hello = 0.0
        self.rejoins = 0
        self.memory: pair_memory.PairMemory | None = None  # this pair's remembered acceptance (set at the welcome)
        self.curve_check = CurveCheck(self.profile)

    def _connect(self) -> zmq.Socket:
        """A fresh socket to the verifier (with this drafter's CURVE keys, watched for a refusal, where the link runs
        CURVE)."""
        sock = connect_dealer(self.ctx, self.endpoint, self.keys)
        self.auth_watch = AuthWatch(sock) if self.keys else None
        return sock

    def _rejoin(self, reason: str) -> None:
        """The verifier lost this drafter (restart, or a silence): forget every session, reconnect, say hello."""
        log.warning("rejoining the verifier at %s: %s", self.endpoint, reason)
        for s in self.sessions.values():
            s.draft.close()
        self.sessions.clear()
        self.order.clear()
        self.trees = bool(self.dcfg.get("tree", False))  # a new verifier may take them
        if self.auth_watch is not None:
            self.auth_watch.close()
        self.sock.close(linger=0)
        self.sock = self._connect()
        self.welcomed = False
        self.last_hello = 0.0
        self.rejoins += 1

    def profile_spec(self, config: dict[str, Any]) -> ProfileSpec:
        """What this node measures of its model: one to max_draft_tokens + 1 rows, at its thread counts."""
        from drafter_node.types import drafter_spec

        variant = drafter_spec(self.dcfg["type"]).profile_variant(self.dcfg)
        return ProfileSpec(self.threads.counts(), profile_sizes(config), float(self.dcfg["profile_s"]), variant)

    def _profile(self, config: dict[str, Any]) -> NodeProfile | None:
        model = self.drafter.profile_model
        spec = self.profile_spec(config)
        if model is None or spec.budget_s <= 0:
            return None  # learned from the rounds alone
        source = self.dcfg.get("model") or config["verifier"]["model"]
        profile = profile_node(model, source, self.dcfg["device"], spec, "drafter")
        return profile

    def _use_threads(self, *sessions: NodeSession) -> None:
        """Every core while the verifier waits for a block of these sessions (synchronous rounds, probes, a pre-draft
        miss) and has nothing else to run; the node's share while the verifier works on their blocks in flight
        (pre-drafting) or on other sessions' rounds (a batching verifier does not wait for one session's block while
        others are ready: both nodes at every core would oversubscribe a shared machine)."""
        wanted = self.threads.share
        if any(s.block_pending() for s in sessions):  # only then count, on this per-step path
            waited_on = sum(1 for s in self.sessions.values() if s.block_pending() and not s.solo_wait)
            if waited_on >= self.book.batch:  # every session the verifier would batch waits on us (batch 1: this one)
                wanted = self.threads.full
        if wanted != self._threads_now:
            set_threads(wanted)
            self._threads_now = wanted
        for s in sessions:
            s.threads = wanted

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        try:
            return self._loop()
        finally:
            if self.memory is not None:
                self.memory.save(self.book.acceptance)
            if self.auth_watch is not None:
                self.auth_watch.close()
            self.sock.close(linger=0)

    def stop(self) -> None:
        self.running = False

    def _send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)
        self.last_sent = time.monotonic()

    def _hello(self) -> None:
        self._send(encode(Hello(drafter_type=self.drafter.type_name, tokenizer_id=self.drafter.tokenizer_id,
                                capabilities=self.drafter.capabilities,
                                profile=self.profile.to_dict() if self.profile else None,
                                threads=ThreadCounts(self.threads.share, self.threads.full),
                                host=socket.gethostname()[:MAX_HOST_CHARS], run_secret=self.run_secret)))

    def _loop(self) -> int:
        while self.running:
            now = time.monotonic()
            if not self.welcomed and self.auth_watch is not None and self.auth_watch.refused():
                print(f"pipespec drafter: the verifier at {self.endpoint} refused this drafter's CURVE key "
                      f"(security.drafter_key {self.key_name!r}): its keys folder must hold "
                      f"drafters/{self.key_name}.key, the public half of this key, in its drafter allow-list",
                      file=sys.stderr)
                return 2
            if not self.welcomed and now - self.last_hello > HELLO_RETRY_S:
                self._hello()
                self.last_hello = now
            elif self.welcomed and now - self.last_sent > HEARTBEAT_S:
                self._send(encode(Heartbeat()))
            work = self._next_work()
            if self.sock.poll(0 if work else 50):
                sock = self.sock
                for _ in range(1000):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.last_heard = time.monotonic()
                    status = self._on_message(frames)
                    if status is not None:
                        return status
                    if self.sock is not sock:
                        break  # rejoined: what the old socket still holds is for a verifier that is gone
                work = self._next_work()
            # checked after reading, so a long step of ours never looks like a silent verifier
            if self.welcomed and time.monotonic() - self.last_heard > VERIFIER_SILENT_S:
                self._rejoin(f"no message from the verifier for {VERIFIER_SILENT_S:.0f} s")
                continue
            if work is not None:
                with self._dropped_on_failure(work.sid):
                    if work.ready_to_send():
                        self._send_ready(work)
                    else:
                        batch = self._gather_steps(work)
                        if batch is None:
                            self._use_threads(work)
                            waited_on = work.block_pending()
                            work.step()
                            if waited_on:  # the verifier waits for this block: our forward ran alone
                                self._check_profile(work)
                        else:
                            self._run_steps(batch)
        return 0

    @contextlib.contextmanager
    def _dropped_on_failure(self, sid: int, doing: str = "drafting") -> Iterator[None]:
        """Whatever fails inside drops session ``sid`` alone (the verifier steps it without drafts), never the node;
        the code after the block runs either way."""
        try:
            yield
        except Exception:
            log.exception("session %d failed while %s; dropped", sid, doing)
            self._drop(sid)

    def _send_ready(self, work: NodeSession) -> None:
        """Send ``work``'s block and every other block that is ready, back to back: the blocks of one batched step
        reach the verifier together and are verified in one forward."""
        self._send_block(work)
        for sid in list(self.order):
            s = self.sessions.get(sid)
            if s is None or s is work or not s.ready_to_send():
                continue
            with self._dropped_on_failure(s.sid, "sending its block"):
                self._send_block(s)

    def _gather_steps(self, work: NodeSession) -> list[tuple[NodeSession, BatchStep]] | None:
        """The sessions whose steps run with ``work``'s as one batched forward (``work`` first), or None: ``work``
        steps alone (batching off, a type that cannot batch, a long catch-up or prefill, nobody to batch with).

        Candidates: every other session that wants a step, those whose block the verifier waits for first, each in
        round-robin order, up to ``max_batch_sessions``; only over the same model, and only rows no longer than
        ``work``'s (or 2 tokens: a chain step after a rejection), since a batched forward pads every row to its
        longest."""
        if self.max_batch_sessions <= 1 or work.draft.cheap_steps:
            return None
        first = work.draft.batch_step()
        if first is None or first.width > self.max_k + 1:
            return None
        batch = [(work, first)]
        limit = max(first.width, 2)
        others = [self.sessions[sid] for sid in self.order if sid != work.sid]
        others.sort(key=lambda s: not s.block_pending())  # stable: round-robin order within each priority
        for s in others:
            if len(batch) >= self.max_batch_sessions:
                break
            if s.draft.cheap_steps or s.ready_to_send() or not s.wants_step():
                continue
            step = None
            with self._dropped_on_failure(s.sid):
                step = s.draft.batch_step()
            if step is not None and step.model is first.model and step.width <= limit:
                batch.append((s, step))
        return batch if len(batch) > 1 else None

    def _run_steps(self, batch: list[tuple[NodeSession, BatchStep]]) -> None:
        """One drafter forward over the steps of ``batch``, then each session's ``finish``. A session whose finish
        fails is dropped alone; a failing forward (nothing cached yet) falls back to one step per session."""
        sessions = [s for s, _ in batch]
        self._use_threads(*sessions)
        rows = [row for _, step in batch for row in step.rows]
        t0 = time.monotonic()
        try:
            outputs = feed_rows(batch[0][1].model, rows)
        except Exception:
            log.exception("a batched drafter forward over %d sessions failed; stepping them one by one", len(batch))
            self._step_each(sessions)
            return
        done, start = [], 0
        for s, step in batch:
            count = len(step.rows)
            with self._dropped_on_failure(s.sid):
                step.finish(outputs[start : start + count])
                done.append(s)
            start += count
        spent = time.monotonic() - t0
        for s in done:
            s.stepped(spent, len(batch))
        # One cost-curve sample at the forward's total rows (pre-draft rows and chain tokens of every session); its
        # context is the longest, to which the forward stacks every cache.
        self.book.observe_draft(sum(step.tokens for _, step in batch), spent, self._threads_now,
                                max(s.base_len for s in sessions))

    def _step_each(self, sessions: list[NodeSession]) -> None:
        for s in sessions:
            if s.sid not in self.sessions:
                continue
            with self._dropped_on_failure(s.sid):
                self._use_threads(s)
                s.step()

    def _drop(self, sid: int) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            self.order.remove(sid)
            with contextlib.suppress(Exception):
                s.draft.close()

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
        t0 = time.monotonic()
        tokens, tensors, idle_rounds, parents = s.block()
        stats = {**s.stats, "plans": dict(s.schedule.plans), "dtype": self.dtype_name, "timing": dict(s.timing),
                 "plan_rates": {k: list(v) for k, v in s.plan_rates.items()}}
        self._send(encode(Draft(session=s.sid, base_len=s.sent_base, epoch=s.stats["blocks"], tokens=tokens,
                                idle_rounds=idle_rounds, overlap=s.overlap, sent_at=time.time(), stats=stats,
                                parents=parents, tensors=tensors)))
        s.timing["send_s"] += time.monotonic() - t0
        s.after_send()

    @property
    def dtype_name(self) -> str | None:
        if self.profile is not None:
            return self.profile.dtype
        model = self.drafter.profile_model
        return str(model.dtype).removeprefix("torch.") if model is not None else None

    def _on_message(self, frames: list) -> int | None:
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
                self._drop(sid)
            return None

    def _on_welcome(self, msg: Welcome) -> None:
        first = not self.welcomed  # hellos queued while the verifier started are each welcomed
        self.welcomed = True
        self.last_heard = time.monotonic()
        self.drafter.target_vocab_size = msg.vocab_size
        threads = msg.threads or ThreadCounts()
        try:
            if msg.profile is not None and not self._fixed_costs:
                self.book.set_verifier(NodeProfile.from_dict(msg.profile), threads.share, threads.full)
        except (ValueError, TypeError) as exc:
            log.warning("ignored the verifier's cost profile: %s", exc)
        self.want_q = msg.want_q and self.drafter.capabilities.greedy_q
        if first:  # the welcomes of the other queued hellos change nothing worth a line each
            log.info("connected to verifier (target %s)", msg.target)
            self._recall_pair(msg.target)
        if first and self.book.ready and self.dcfg.get("draft_schedule") == "cost":
            for row in self.book.plans_by_batch(self.book.session_acceptance(), self.max_k, True, 0,
                                                overlap=bool(self.dcfg.get("overlap", True))):
                log.info("plan at batch %(batch)d (prior acceptance): k=%(k)d overlap=%(overlap)s rows=%(rows)d, "
                         "%(tokens_per_s).1f tok/s vs %(plain_tokens_per_s).1f plain", row)

    def _check_profile(self, s: NodeSession) -> None:
        """Compare a step timed alone with the profile; a profile that keeps missing is re-measured next start."""
        if s.last_step is None:
            return
        n, spent = s.last_step
        ratio = self.curve_check.forward(s.threads or self.threads.share, n, s.base_len, spent)
        if ratio is not None:
            log.warning("drafter: steps take %.2fx what the cached profile says (measured on a busy machine, or the "
                        "machine changed); plans follow the measured steps now, and the profile is measured again "
                        "at the next start", ratio)

    def _recall_pair(self, target: str) -> None:
        """Start the cost schedule from what earlier runs of this pair accepted (``drafter.remember_acceptance``)."""
        if not self.dcfg.get("remember_acceptance", True) or self._fixed_costs:
            return
        path = pair_memory.memory_path(self.drafter.type_name, self.dcfg.get("model"), target)
        remembered = pair_memory.load(path, self.max_k)
        self.memory = pair_memory.PairMemory(path, remembered[1] if remembered else 0)
        if remembered is not None:
            self.book.acceptance = remembered[0]
            log.info("acceptance prior from %d earlier request(s) of this pair: α = %s", remembered[1],
                     " ".join(f"{remembered[0].alpha(i):.2f}" for i in range(min(self.max_k, 8))))

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        """The verifier's answer to ours: it is there (``last_heard`` is updated for every message)."""

    def _on_error(self, msg: Error) -> int | None:
        if msg.code == "not_connected":
            if self.welcomed:  # the verifier does not know us (any more): a restarted verifier, or one that forgot us
                self._rejoin("the verifier does not know this drafter (restarted?)")
            return None  # not welcomed: answers to what we sent before our hello; the hello is on its way
        if msg.code == "tree_refused":  # this verifier (or target) takes no trees from us: chains from now on
            if self.trees:
                log.warning("verifier refused a token tree (%s); sending chains only", msg.message)
            self.trees = False
            for s in self.sessions.values():
                if isinstance(s.schedule, CostSchedule):
                    s.schedule.tree = False
            return None
        log.error("verifier: %s", msg.message)
        if msg.code in ("tokenizer_mismatch", "bad_version", "ensemble_needs_q", "unsupported", "unauthorized"):
            hint = self.drafter.tokenizer_hint if msg.code == "tokenizer_mismatch" else ""
            print(f"pipespec drafter: refused by the verifier: {msg.message}{hint}", file=sys.stderr)
            return 2
        return None

    def _on_session_start(self, msg: SessionStart) -> None:
        sid = msg.session
        old = self.sessions.pop(sid, None)
        if old:
            self.order.remove(sid)
            old.draft.close()
        params = GenerationParams.from_dict(msg.params)
        prompt_len = len(msg.token_ids) if msg.prompt_len is None else msg.prompt_len
        draft = self.drafter.open_session(msg.token_ids, prompt_len, params, msg.tensors)
        draft.want_q = self.want_q
        self.book.start_batch(msg.decoding)  # before the schedule's first plan
        self.sessions[sid] = NodeSession(sid, draft, self._schedule_for(draft), self.book)
        self.order.append(sid)

    def _schedule_for(self, draft: DraftSession) -> DraftLengthSchedule:
        overlap = bool(self.dcfg.get("overlap", True))
        fixed = self.drafter.block_len
        if self.dcfg.get("draft_schedule") == "cost":
            max_k = fixed if fixed is not None else self.max_k
            start = min(fixed if fixed is not None else int(self.dcfg["num_draft_tokens"]), max_k)
            return CostSchedule(start, max_k, self.book, lambda: len(draft.committed), overlap,
                                rows_ok=draft.predrafts_rows, tree=self._trees_for(draft))
        if fixed is not None:
            return DraftLengthSchedule(fixed, "constant", overlap=overlap)
        return DraftLengthSchedule.from_config(self.dcfg)

    def _trees_for(self, draft: DraftSession) -> bool:
        """Blocks may be token trees (``drafter.tree``): greedy requests without q (the verifier verifies trees
        losslessly only there), for drafters that need no target state back (trees come with none)."""
        caps = self.drafter.capabilities
        return (self.trees and not draft.params.do_sample and not draft.want_q and not caps.needs_hidden_states
                and not caps.needs_kv_layers)

    def _on_commit(self, msg: Commit) -> None:
        s = self.sessions.get(msg.session)
        if s is None or msg.base_len != s.base_len:
            return  # a duplicate or a commit for a session we no longer hold
        s.on_commit(msg.tokens, msg.drafted, msg.accepted, msg.tensors, msg.verify_s, msg.threads, msg.batch_sessions,
                    msg.batch_tokens, msg.decoding)

    def _on_state(self, msg: State) -> None:
        s = self.sessions.get(msg.session)
        if s is None or msg.base_len != s.base_len:
            return
        s.draft.observe_state(msg.tensors, msg.end)

    def _on_session_end(self, msg: SessionEnd) -> None:
        s = self.sessions.pop(msg.session, None)
        if s is not None:
            self.order.remove(s.sid)
            s.draft.close()
            if self.memory is not None and s.stats["blocks"] > s.stats["idle_blocks"]:
                self.memory.session_ended(self.book.acceptance)


def run(config: dict[str, Any], links: DrafterLinks, fixed_costs: tuple[CostCurve, CostCurve] | None = None) -> int:
    """Entry point of the drafter process (``links``, ``fixed_costs``: see :class:`DrafterNode`)."""
    return DrafterNode(config, fixed_costs=fixed_costs, links=links).serve()
