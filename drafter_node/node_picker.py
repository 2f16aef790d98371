"""What the drafter node's loop does next, decided over plain objects: no socket, no model, and a clock handed in.

* :class:`WorkPicker` holds the sessions in round-robin order and picks the unit of work: which session sends or
  steps next (:meth:`WorkPicker.next_work`), which other ready blocks go out with it (:meth:`WorkPicker.ready_behind`)
  and which sessions' steps join its batched drafter forward (:meth:`WorkPicker.gather_steps`).
* :class:`ThreadShare`: the torch threads a step runs with (every core only while the verifier waits on us).
* :class:`LinkPacer`: when to say hello, when a heartbeat is due, when a silent verifier counts as gone.

The node (:mod:`drafter_node.node`) carries out what these decide; tests/test_drafter_scheduler.py drives them with
fake sessions and a fake clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # type names only: this module imports no model code
    from drafter_node.base import BatchStep
    from shared.models import ThreadPlan

HEARTBEAT_S = 0.25
HELLO_RETRY_S = 1.0
#: No message from the verifier for this long while welcomed (it answers heartbeats): it is gone; say hello again.
#: Generous, because a verifier computing one long prefill reads nothing meanwhile.
VERIFIER_SILENT_S = 15.0


class Work(Protocol):
    """What the picker reads of a session (:class:`drafter_node.node_session.NodeSession`); ``draft`` has
    ``cheap_steps`` and ``batch_step()`` (:class:`drafter_node.base.DraftSession`)."""

    sid: int
    draft: Any
    threads: int

    @property
    def solo_wait(self) -> bool: ...

    def block_pending(self) -> bool: ...

    def ready_to_send(self) -> bool: ...

    def wants_step(self) -> bool: ...


S = TypeVar("S", bound=Work)
#: ``guard(sid)``: a context in which whatever fails drops session ``sid`` alone, and the code after it runs.
Guard = Callable[[int], AbstractContextManager[None]]


class WorkPicker(Generic[S]):
    """The sessions the node holds, in round-robin order, and the choice of what to do next for them."""

    def __init__(self, max_batch_sessions: int, max_k: int):
        self.max_batch_sessions = max_batch_sessions  # 1: batching off
        self.max_k = max_k
        self.sessions: dict[int, S] = {}
        self.order: deque[int] = deque()

    def add(self, s: S) -> None:
        self.sessions[s.sid] = s
        self.order.append(s.sid)

    def remove(self, sid: int) -> S | None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            self.order.remove(sid)
        return s

    def clear(self) -> list[S]:
        """Forget every session; returns them (for the caller to close)."""
        held = list(self.sessions.values())
        self.sessions.clear()
        self.order.clear()
        return held

    def next_work(self) -> S | None:
        """Round-robin, by priority: a block to send, a block the verifier still waits for, then pre-drafting. The
        session picked goes to the back of the order."""
        wanted_by_priority: tuple[Callable[[S], bool], ...] = (
            lambda s: s.ready_to_send(),
            lambda s: s.block_pending() and s.wants_step(),
            lambda s: s.wants_step(),
        )
        for wanted in wanted_by_priority:
            for sid in self.order:
                s = self.sessions[sid]
                if wanted(s):
                    self.order.remove(sid)
                    self.order.append(sid)
                    return s
        return None

    def ready_behind(self, work: S) -> Iterator[S]:
        """The other sessions whose block is ready, in round-robin order, to send right after ``work``'s: the blocks
        of one batched step reach the verifier together and are verified in one forward. Lazy: each is asked when
        its turn comes, after the blocks before it went out (or their session was dropped)."""
        for sid in list(self.order):
            s = self.sessions.get(sid)
            if s is None or s is work or not s.ready_to_send():
                continue
            yield s

    def gather_steps(self, work: S, guard: Guard) -> list[tuple[S, BatchStep]] | None:
        """The sessions whose steps run with ``work``'s as one batched forward (``work`` first), or None: ``work``
        steps alone (batching off, a type that cannot batch, a long catch-up or prefill, nobody to batch with).

        Candidates: every other session that wants a step, those whose block the verifier waits for first, each in
        round-robin order, up to ``max_batch_sessions``; only over the same model, and only rows no longer than
        ``work``'s (or 2 tokens: a chain step after a rejection), since a batched forward pads every row to its
        longest. A candidate whose ``batch_step`` fails is dropped inside ``guard``."""
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
            with guard(s.sid):
                step = s.draft.batch_step()
            if step is not None and step.model is first.model and step.width <= limit:
                batch.append((s, step))
        return batch if len(batch) > 1 else None

    def waited_on(self) -> int:
        """Sessions whose block the verifier waits for (not those in a run of rounds it takes alone)."""
        return sum(1 for s in self.sessions.values() if s.block_pending() and not s.solo_wait)


class ThreadShare:
    """The torch threads of the node's steps: every core while the verifier waits for a block of the sessions
    stepping (synchronous rounds, probes, a pre-draft miss) and has nothing else to run; the node's share while the
    verifier works on their blocks in flight (pre-drafting) or on other sessions' rounds (a batching verifier does
    not wait for one session's block while others are ready: both nodes at every core would oversubscribe a shared
    machine). ``apply`` sets the count (``shared.models.set_threads``); it is called only when the count changes."""

    def __init__(self, plan: ThreadPlan, apply: Callable[[int], None]):
        self.plan = plan
        self.apply = apply
        self.now = plan.share  # the count in force (the node starts at its share)

    def use(self, sessions: Sequence[Work], picker: WorkPicker, batch: int) -> int:
        """Set the count for one step of ``sessions``; ``batch``: the sessions the verifier would batch now."""
        wanted = self.plan.share
        # Counted only where one of them is waited on (this is the per-step path): full where every session the
        # verifier would batch waits on us (batch 1: this one).
        if any(s.block_pending() for s in sessions) and picker.waited_on() >= batch:
            wanted = self.plan.full
        if wanted != self.now:
            self.apply(wanted)
            self.now = wanted
        for s in sessions:
            s.threads = wanted
        return wanted


class LinkPacer:
    """When the node speaks to the verifier unasked: a hello every ``hello_retry_s`` until welcomed, a heartbeat
    after ``heartbeat_s`` without sending while welcomed; and whether a welcomed verifier has been silent for
    ``silent_s`` (it answers heartbeats, so silence means it is gone). ``clock``: monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, hello_retry_s: float = HELLO_RETRY_S,
                 heartbeat_s: float = HEARTBEAT_S, silent_s: float = VERIFIER_SILENT_S):
        self.clock = clock
        self.hello_retry_s = hello_retry_s
        self.heartbeat_s = heartbeat_s
        self.silent_s = silent_s
        self.welcomed = False
        self.last_heard = 0.0  # when the last message from the verifier came
        self.last_hello = 0.0
        self.last_sent = 0.0

    def hello_due(self, now: float) -> bool:
        return not self.welcomed and now - self.last_hello > self.hello_retry_s

    def heartbeat_due(self, now: float) -> bool:
        return self.welcomed and now - self.last_sent > self.heartbeat_s

    def hello_sent(self, now: float) -> None:
        self.last_hello = now

    def sent(self) -> None:
        self.last_sent = self.clock()

    def heard(self) -> None:
        self.last_heard = self.clock()

    def welcome(self) -> bool:
        """The verifier welcomed us; True for the first welcome of this connection (hellos queued while the verifier
        started are each welcomed)."""
        first = not self.welcomed
        self.welcomed = True
        self.last_heard = self.clock()
        return first

    def silent(self) -> bool:
        """Checked after reading, so a long step of ours never looks like a silent verifier."""
        return self.welcomed and self.clock() - self.last_heard > self.silent_s

    def lost(self) -> None:
        """A new connection: say hello at once."""
        self.welcomed = False
        self.last_hello = 0.0
