"""The drafter node: connects to the verifier, keeps one draft session per request, and overlaps drafting with
verification.

Loop: drain messages (session starts, commits, ends), then do one unit of work for one session, round-robin. A unit
is either sending a ready block or one drafter step (one token), so a commit is noticed within one step. A turn with
no such work does one bounded piece of a session's deferred set-up (``DraftSession.background``: the ``suffix``
type's long prompt, a budget of tokens at a time), so no session's set-up holds the loop up.

Batched drafting (``batching: true``, the default): when the unit is a step, every other session that wants one
(whose block the verifier waits for first, then pre-drafting ones) joins it, up to ``max_batch_sessions``, and one
drafter forward (its KV backend's ``feed_rows``, :mod:`shared.backend`) advances all their chains and pre-draft rows
at once — for types whose sessions express a step as rows of such a forward (``DraftSession.batch_step``: model-based
types over their own cache); the others step alone.

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
after a long silence) or nothing at all comes from it for ``VERIFIER_SILENT_S`` (:mod:`drafter_node.node_picker`), the
node drops its sessions, opens a fresh socket (a new connection: nothing queued for the old verifier is delivered to
a new one) and says hello again.

Parts: :mod:`drafter_node.node_session` (one session: its schedule, blocks and commits),
:mod:`drafter_node.node_picker` (which session sends or steps next, batching, thread counts, hello and heartbeat
pacing: pure), :mod:`drafter_node.node_handlers` (the verifier's messages and the session bookkeeping they drive).
:class:`DrafterNode` is the loop that ties them to the socket; :meth:`DrafterNode.from_config` loads the drafter,
measures its profile and connects.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import zmq

from drafter_node.base import BatchStep, Drafter
from drafter_node.cost_model import CostBook
from drafter_node.node_handlers import MessageHandler
from drafter_node.node_picker import LinkPacer, ThreadShare, WorkPicker
from drafter_node.node_session import NodeSession
from drafter_node.settings import Config, DrafterConfig
from drafter_node.start_report import start_plan_label, start_report
from drafter_node.types import drafter_class, drafter_spec
from shared.batch import feed_rows
from shared.cores import CoreLeases, leases_for
from shared.costs.cache import CurveCheck
from shared.costs.curve import CostCurve, NodeProfile
from shared.costs.measure import measuring_alone
from shared.models import ModelLoadError, ProfileSpec, ThreadPlan, profile_node, profile_sizes, set_threads
from shared.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_HOST_CHARS,
    Draft,
    Heartbeat,
    Hello,
    StartReport,
    ThreadCounts,
    encode,
)
from shared.signals import stop_on_signals
from shared.transport import AuthWatch, ClientKeys, DrafterLinks, connect_dealer

log = logging.getLogger("pipespec.drafter")


def flat_fields(counters: Any) -> dict[str, Any]:
    """A dataclass of plain numbers (``SessionStats``, ``SessionTiming``) as a dict: ``dataclasses.asdict``'s
    deep walk cost ~40 µs a block on the send path, between a commit and the next block."""
    return dict(vars(counters))


def load_drafter(settings: DrafterConfig, own: Any = None, profile: ProfileSpec | None = None) -> Drafter:
    """Build the configured drafter type as ``cls(settings, own, profile)`` (:class:`drafter_node.base.Drafter`);
    files it cannot read or fetch (a hub id without hub access, a missing folder) become one clear error naming what
    it was loading, not a traceback from deep inside a loader."""
    try:
        return drafter_class(settings.type)(settings, own, profile)
    except OSError as exc:
        sources = ", ".join(f"{key}={value!r}" for key, value in (("model", settings.model),
                                                                  ("target_model", settings.target_model)) if value)
        raise ModelLoadError(f"drafter type {settings.type!r} cannot load its files ({sources}): {exc}") from None


def profile_spec(config: Config, threads: ThreadPlan) -> ProfileSpec:
    """What the drafter measures of its model: one to max_draft_tokens + 1 rows, at its thread counts."""
    settings = config.drafter
    variant = drafter_spec(settings.type).profile_variant(settings, config.drafter_type)
    return ProfileSpec(threads.counts(), profile_sizes(settings.max_draft_tokens), float(settings.profile_s),
                       variant)


def measure_profile(config: Config, drafter: Drafter, spec: ProfileSpec) -> NodeProfile | None:
    """The drafter model's cost profile (cached, or measured now); None: learned from the rounds alone."""
    if spec.budget_s <= 0:
        return None
    own = drafter.measure_profile(spec, lambda line: log.info("drafter: %s", line))
    if own is not None:
        return own
    model = drafter.profile_model
    if model is None:
        return None
    source = config.drafter.model or config.verifier.model
    return profile_node(model, source, config.drafter.device, spec, "drafter")


def cost_book(max_k: int, drafter: Drafter, profile: NodeProfile | None, threads: ThreadPlan, batched: bool,
              fixed_costs: tuple[CostCurve, CostCurve] | None = None) -> CostBook:
    """The node's cost book, knowing the drafter's side (its profile, or fixed curves); the verifier's comes with
    the welcome."""
    book = CostBook(max_k)
    book.set_drafter(profile, threads.share, threads.full)
    if drafter.free_drafting:  # no model: nothing to measure, and no step to learn a curve from
        book.set_free_drafter()
    book.draft_batched = batched  # what the cost model assumes of our steps
    if fixed_costs:
        book.fix_curves(*fixed_costs)
    return book


class VerifierConnection:
    """The DEALER socket to the verifier, with this drafter's CURVE keys (watched for a refusal) where the link runs
    CURVE. :meth:`reopen` makes a fresh socket: a new connection, so nothing queued for the old verifier is
    delivered to a new one."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: ClientKeys | None = None):
        self.ctx = ctx
        self.endpoint = endpoint
        self.keys = keys
        self.auth_watch: AuthWatch | None = None
        self.sock = self._open()

    def _open(self) -> zmq.Socket:
        sock = connect_dealer(self.ctx, self.endpoint, self.keys)
        self.auth_watch = AuthWatch(sock) if self.keys else None
        return sock

    def refused(self) -> bool:
        """The verifier refused our CURVE key (only known where the link runs CURVE)."""
        return self.auth_watch is not None and self.auth_watch.refused()

    def reopen(self) -> None:
        self.close()
        self.sock = self._open()

    def close(self) -> None:
        if self.auth_watch is not None:
            self.auth_watch.close()
        self.sock.close(linger=0)


class DrafterNode:
    """The drafter's loop over built parts: it reads the verifier's messages into ``handler``, asks ``picker`` what
    to do next and does it (send blocks, step sessions alone or in one batched forward)."""

    def __init__(self, settings: DrafterConfig, drafter: Drafter, book: CostBook, connection: VerifierConnection,
                 picker: WorkPicker[NodeSession], threads: ThreadShare, profile: NodeProfile | None = None, *,
                 max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, run_secret: str | None = None,
                 key_name: str | None = None, costs_fixed: bool = False, link: LinkPacer | None = None,
                 cores: CoreLeases | None = None):
        """``run_secret``: shown in hello where the link has no CURVE; ``key_name``: the CURVE key's name, for the
        refusal message; ``costs_fixed``: the book's curves are fixed (see :meth:`from_config`); ``cores``: the CPU
        core leases each step holds (:mod:`shared.cores`; None: the planned thread counts as they are)."""
        self.settings = settings
        self.drafter = drafter
        self.profile = profile
        self.book = book
        self.connection = connection
        self.picker = picker
        self.threads = threads
        self.cores = cores
        self.run_secret = run_secret
        self.key_name = key_name
        self.link = link or LinkPacer()
        self.handler = MessageHandler(settings, drafter, book, picker, self.link, self._rejoin, max_bytes, costs_fixed)
        self.curve_check = CurveCheck(profile)
        self.running = True
        self.rejoins = 0
        self._deferred = False  # a session may have deferred set-up work (DraftSession.background)

    @classmethod
    def from_config(cls, config: Config, fixed_costs: tuple[CostCurve, CostCurve] | None = None,
                    drafter: Drafter | None = None, *, links: DrafterLinks) -> DrafterNode:
        """Load the configured drafter (unless ``drafter`` is given), measure its profile and connect to the
        verifier. ``config``: the typed config (``runtime.config.typed``; the drafter reads its ``drafter`` section
        and its type's own settings, ``drafter_type``, and of the ``verifier`` section the endpoint, message limit,
        model and device). ``links``: CURVE keys and run secret, resolved by the launcher
        (``runtime.security.drafter_links``).
        ``fixed_costs``: (verify, draft) curves that replace measured ones and are never re-measured or remembered
        (tests on tiny models, whose forwards all cost about the same, pass them to get the plans they mean to
        exercise: tests/node_entry.py)."""
        settings = config.drafter
        threads = ThreadPlan.for_node(settings.threads, settings.device, config.verifier.device)
        max_k = settings.max_draft_tokens
        # Batched drafting: one drafter forward advances every session that wants a step (drafter.batching).
        max_batch_sessions = settings.max_batch_sessions if settings.batching else 1
        set_threads(threads.share)
        spec = profile_spec(config, threads)
        # Load and measure while no other node on this machine does (the verifier starts at the same time).
        with measuring_alone(settings.device) if settings.profile_s > 0 else contextlib.nullcontext():
            drafter = drafter or load_drafter(settings, config.drafter_type, spec)
            profile = measure_profile(config, drafter, spec)
        book = cost_book(max_k, drafter, profile, threads, max_batch_sessions > 1, fixed_costs)
        endpoint = settings.verifier_endpoint or config.verifier.endpoint
        max_bytes = config.verifier.max_message_bytes
        # The run secret is shown in hello where the link has no CURVE (there the verifier's key allow-list decides).
        keys, key_name, run_secret = links.keys, links.key_name, links.run_secret
        connection = VerifierConnection(zmq.Context.instance(), endpoint, keys)
        cores = leases_for(settings.device, threads.full, set_threads)  # the leases set the threads, not the plan
        share = ThreadShare(threads, set_threads if cores is None else lambda n: None)
        return cls(settings, drafter, book, connection, WorkPicker(max_batch_sessions, max_k), share, profile,
                   max_bytes=max_bytes, run_secret=run_secret, key_name=key_name, costs_fixed=bool(fixed_costs),
                   cores=cores)

    @property
    def sock(self) -> zmq.Socket:
        """The socket to the verifier now (a rejoin replaces it)."""
        return self.connection.sock

    def _rejoin(self, reason: str) -> None:
        """The verifier lost this drafter (restart, or a silence): forget every session, reconnect, say hello."""
        log.warning("rejoining the verifier at %s: %s", self.connection.endpoint, reason)
        self.handler.forget_all()
        self.connection.reopen()
        self.link.lost()
        self.rejoins += 1

    def serve(self) -> int:
        """Loop until :meth:`stop` (any thread; the process entry point :func:`run` stops it on SIGTERM / SIGINT)."""
        try:
            return self._loop()
        finally:
            if self.handler.memory is not None:
                self.handler.memory.save(self.book.acceptance)
            self.connection.close()

    def stop(self) -> None:
        self.running = False

    def _send(self, frames: list) -> None:
        try:
            # Never block: with no connection to the verifier (a refused CURVE handshake, a verifier not up yet) a
            # blocking send would stall the node's loop; a dropped message is safe (hellos are re-sent, a missing
            # draft or heartbeat costs the verifier a wait, never a wrong token).
            self.sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("verifier link not ready: a message was dropped")
            return
        self.link.sent()

    def _hello(self) -> None:
        plan = self.threads.plan
        self._send(encode(Hello(drafter_type=self.drafter.type_name, tokenizer_id=self.drafter.tokenizer_id,
                                capabilities=self.drafter.capabilities,
                                profile=self.profile.to_dict() if self.profile else None,
                                threads=ThreadCounts(plan.share, plan.full),
                                host=socket.gethostname()[:MAX_HOST_CHARS], run_secret=self.run_secret)))

    def _loop(self) -> int:
        while self.running:
            status = self.turn()
            if status is not None:
                return status
        return 0

    def turn(self) -> int | None:
        """One turn of the loop: a hello or heartbeat when due, the verifier's messages, then one unit of work, or
        one piece of a session's deferred set-up where there is none; an exit status where the node must stop."""
        link = self.link
        now = link.clock()
        if not link.welcomed and self.connection.refused():
            print(f"pipespec drafter: the verifier at {self.connection.endpoint} refused this drafter's CURVE key "
                  f"(security.drafter_key {self.key_name!r}): its keys folder must hold "
                  f"drafters/{self.key_name}.key, the public half of this key, in its drafter allow-list",
                  file=sys.stderr)
            return 2
        if link.hello_due(now):
            self._hello()
            link.hello_sent(now)
        elif link.heartbeat_due(now):
            self._send(encode(Heartbeat()))
        work = self.picker.next_work()
        if self.sock.poll(0 if work or self._deferred else 50):
            status = self._read()
            if status is not None:
                return status
            self._deferred = True  # a new session may bring set-up work: the next idle turn looks
            work = self.picker.next_work()
        if link.silent():  # checked after reading, so a long step of ours never looks like a silent verifier
            self._rejoin(f"no message from the verifier for {link.silent_s:.0f} s")
            return None
        if work is not None:
            self._do(work)
        elif self._deferred:
            self._deferred = self._background()
        return None

    def _background(self) -> bool:
        """One piece of deferred set-up work of the first session that has some; False: none has any left."""
        for s in list(self.picker.sessions.values()):
            with self.handler.dropped_on_failure(s.sid, "setting up"):
                if s.draft.background():
                    return True
        return False

    def _read(self) -> int | None:
        """Apply what the socket holds (up to 1000 messages); an exit status where a message ends the node."""
        sock = self.sock
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.link.heard()
            status = self.handler.on_message(frames)
            if status is not None:
                return status
            if self.handler.report_due:
                self._send_report()
            if self.sock is not sock:
                break  # rejoined: what the old socket still holds is for a verifier that is gone
        return None

    def start_report(self) -> StartReport:
        """What this node and its verifier chose, and the plan the cost model implies (the launcher prints it)."""
        plan = self.threads.plan
        handler = self.handler
        return start_report(self.settings, self.book, block_len=self.drafter.block_len,
                            free=self.drafter.free_drafting, drafter_profile=self.profile,
                            verifier_profile=handler.verifier_profile, drafter_threads=ThreadCounts(plan.share,
                                                                                                    plan.full),
                            verifier_threads=handler.verifier_threads, drafter_dtype=self.dtype_name,
                            verifier_dtype=handler.verifier_dtype)

    def _send_report(self) -> None:
        self.handler.report_due = False
        try:
            report = self.start_report()
            self.book.start_plan = start_plan_label(self.settings, self.book, self.drafter.block_len)
        except Exception:  # a report is a courtesy: never the reason a drafter stops serving
            log.exception("could not build the start-up report")
            return
        log.info("start-up plan: %s %s (k=%d overlap=%s), expected %.2fx the target alone (verify 1 token %.1f ms, "
                 "%d+1 tokens %.1f ms, draft step %.1f ms, acceptance assumed %.2f); each request's metrics confirm or "
                 "correct it (plan_check)", report.decision, self.book.start_plan or "-", report.k,
                 report.overlap, report.speedup, report.verify_1_s * 1e3, report.verify_k, report.verify_k_s * 1e3,
                 report.draft_s * 1e3, report.alpha)
        self._send(encode(Heartbeat(report=report)))

    def _do(self, work: NodeSession) -> None:
        """One unit of work: ``work``'s block (and every other ready one) goes out, or it steps, with others where
        their steps batch."""
        with self.handler.dropped_on_failure(work.sid):
            if work.ready_to_send():
                self._send_ready(work)
            elif (batch := self._gather_steps(work)) is not None:
                self._run_steps(batch)
            else:
                waited_on = work.block_pending()
                with self._computing(work):
                    work.step()
                if waited_on:  # the verifier waits for this block: our forward ran alone
                    self._check_profile(work)

    def _send_ready(self, work: NodeSession) -> None:
        """Send ``work``'s block and every other block that is ready, back to back: the blocks of one batched step
        reach the verifier together and are verified in one forward."""
        self._send_block(work)
        for s in self.picker.ready_behind(work):
            with self.handler.dropped_on_failure(s.sid, "sending its block"):
                self._send_block(s)

    def _gather_steps(self, work: NodeSession) -> list[tuple[NodeSession, BatchStep]] | None:
        """The sessions stepping with ``work`` in one batched forward (:meth:`WorkPicker.gather_steps`)."""
        return self.picker.gather_steps(work, self.handler.dropped_on_failure)

    @contextlib.contextmanager
    def _computing(self, *sessions: NodeSession) -> Iterator[int]:
        """Around a step's forward: the thread count the plan wants for ``sessions`` (ThreadShare), leased from the
        cores (fewer where another process's forward holds some); yields the count the forward runs with."""
        wanted = self.threads.use(sessions, self.picker, self.book.batch)
        if self.cores is None:
            yield wanted
            return
        with self.cores.hold(wanted) as granted:
            for s in sessions:
                s.threads = granted
            yield granted

    def _run_steps(self, batch: list[tuple[NodeSession, BatchStep]]) -> None:
        """One drafter forward over the steps of ``batch``, then each session's ``finish``. A session whose finish
        fails is dropped alone; a failing forward (nothing cached yet) falls back to one step per session."""
        sessions = [s for s, _ in batch]
        rows = [row for _, step in batch for row in step.rows]
        t0 = time.monotonic()
        try:
            with self._computing(*sessions) as threads:
                outputs = self._feed_rows(batch[0][1].model, rows)
        except Exception:
            log.exception("a batched drafter forward over %d sessions failed; stepping them one by one", len(batch))
            self._step_each(sessions)
            return
        done, start = [], 0
        for s, step in batch:
            count = len(step.rows)
            with self.handler.dropped_on_failure(s.sid):
                step.finish(outputs[start : start + count])
                done.append(s)
            start += count
        spent = time.monotonic() - t0
        for s in done:
            s.stepped(spent, len(batch))
        # One cost-curve sample at the forward's total rows (pre-draft rows and chain tokens of every session); its
        # context is the longest, to which the forward stacks every cache.
        self.book.observe_draft(sum(step.tokens for _, step in batch), spent, threads,
                                max(s.base_len for s in sessions))

    def _feed_rows(self, model, rows: list) -> list:
        """One batched forward of ``model`` over ``rows``: through the drafter's KV backend where the rows are its
        model's (static slots: each row's new K/V go straight into its slot), else :func:`shared.batch.feed_rows`."""
        backend = self.drafter.backend
        if backend is not None and backend.batch_key is model:
            return backend.feed_rows(rows)
        return feed_rows(model, rows)

    def _step_each(self, sessions: list[NodeSession]) -> None:
        for s in sessions:
            if s.sid not in self.picker.sessions:
                continue
            with self.handler.dropped_on_failure(s.sid), self._computing(s):
                s.step()

    def _send_block(self, s: NodeSession) -> None:
        t0 = time.monotonic()
        tokens, tensors, idle_rounds, parents = s.block()
        # the wire keeps plain maps (msgpack): the typed counters go out as dicts
        stats = {**flat_fields(s.stats), "plans": dict(s.schedule.plans), "dtype": self.dtype_name,
                 "timing": flat_fields(s.timing), "plan_rates": {k: list(v) for k, v in s.plan_rates.items()}}
        if s.plan_check is not None:
            stats["plan_check"] = dict(s.plan_check)
        ceiling = s.ceiling()
        if ceiling is not None:
            stats["ceiling_tokens_per_second"] = ceiling
        self._send(encode(Draft(session=s.sid, base_len=s.sent_base, epoch=s.stats.blocks, tokens=tokens,
                                idle_rounds=idle_rounds, overlap=s.overlap, sent_at=time.time(), stats=stats,
                                parents=parents, tensors=tensors)))
        s.timing.send_s += time.monotonic() - t0
        s.after_send()

    @property
    def dtype_name(self) -> str | None:
        if self.profile is not None:
            return self.profile.dtype
        model = self.drafter.profile_model
        return str(model.dtype).removeprefix("torch.") if model is not None else None

    def _check_profile(self, s: NodeSession) -> None:
        """Compare a step timed alone with the profile; a profile that keeps missing is re-measured next start."""
        if s.last_step is None:
            return
        n, spent = s.last_step
        ratio = self.curve_check.forward(s.threads or self.threads.plan.share, n, s.base_len, spent)
        if ratio is not None:
            log.warning("drafter: steps take %.2fx what the cached profile says (measured on a busy machine, or the "
                        "machine changed); plans follow the measured steps now, and the profile is measured again "
                        "at the next start", ratio)


def run(config: Config, links: DrafterLinks, fixed_costs: tuple[CostCurve, CostCurve] | None = None) -> int:
    """Entry point of the drafter process: ``config`` built once by the caller (``runtime.config.typed``);
    ``links``, ``fixed_costs``: see :meth:`DrafterNode.from_config`."""
    node = DrafterNode.from_config(config, fixed_costs=fixed_costs, links=links)
    stop_on_signals(node.stop)
    return node.serve()
