"""The drafter node's work picker, thread share and link pacing (drafter_node/node_picker.py) over fake sessions and
a fake clock: no sockets, no models."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from drafter_node.node_picker import LinkPacer, WorkPicker

pytestmark = pytest.mark.unit


@dataclass
class FakeDraft:
    width: int | None = 1  # None: no batch step
    model: str = "m"
    cheap_steps: bool = False
    fails: bool = False

    def batch_step(self):
        if self.fails:
            raise RuntimeError("bad state")
        return None if self.width is None else SimpleNamespace(width=self.width, model=self.model)


@dataclass
class Fake:
    sid: int
    ready: bool = False
    pending: bool = False
    wants: bool = False
    solo_wait: bool = False
    draft: FakeDraft = field(default_factory=FakeDraft)
    threads: int = 0

    def ready_to_send(self) -> bool:
        return self.ready

    def block_pending(self) -> bool:
        return self.pending

    def wants_step(self) -> bool:
        return self.wants


def picker_of(*sessions: Fake, max_batch: int = 64, max_k: int = 4) -> WorkPicker:
    picker = WorkPicker(max_batch, max_k)
    for s in sessions:
        picker.add(s)
    return picker


def test_next_work_prefers_a_block_to_send_then_a_waited_on_step_then_predrafting_round_robin():
    a, b, c = Fake(0, wants=True), Fake(1, pending=True, wants=True), Fake(2, ready=True)
    picker = picker_of(a, b, c)
    assert picker.next_work() is c and list(picker.order) == [0, 1, 2]
    c.ready = False
    assert picker.next_work() is b and list(picker.order) == [0, 2, 1]
    b.pending = False
    assert picker.next_work() is a and list(picker.order) == [2, 1, 0]
    assert picker.next_work() is b  # round-robin among equals
    a.wants = b.wants = False
    assert picker.next_work() is None and list(picker.order) == [2, 0, 1]


def test_ready_behind_skips_the_work_and_asks_each_session_at_its_turn():
    a, b, c = Fake(0, ready=True), Fake(1, ready=True), Fake(2, ready=False)
    picker = picker_of(a, b, c)
    behind = picker.ready_behind(a)
    assert next(behind) is b
    c.ready = True  # became ready after b's block went out
    picker.remove(1)
    assert list(behind) == [c]


@contextlib.contextmanager
def _no_guard(sid):
    yield


def test_gather_steps_takes_waited_on_sessions_first_up_to_the_cap_same_model_and_short_rows():
    work = Fake(0, wants=True, draft=FakeDraft(width=3))
    others = [Fake(1, wants=True), Fake(2, wants=True, pending=True), Fake(3, wants=True, draft=FakeDraft(model="x")),
              Fake(4, wants=True, draft=FakeDraft(width=4)), Fake(5, ready=True, wants=True),
              Fake(6, wants=False), Fake(7, wants=True, draft=FakeDraft(cheap_steps=True)), Fake(8, wants=True)]
    picker = picker_of(work, *others)
    assert [s.sid for s, _ in picker.gather_steps(work, _no_guard)] == [0, 2, 1, 8]
    picker.max_batch_sessions = 3
    assert [s.sid for s, _ in picker.gather_steps(work, _no_guard)] == [0, 2, 1]
    picker.max_batch_sessions = 1
    assert picker.gather_steps(work, _no_guard) is None  # batching off


@pytest.mark.parametrize("draft", [FakeDraft(cheap_steps=True), FakeDraft(width=None), FakeDraft(width=6)])
def test_gather_steps_lets_work_step_alone_where_it_cannot_batch(draft):
    work = Fake(0, wants=True, draft=draft)
    assert picker_of(work, Fake(1, wants=True)).gather_steps(work, _no_guard) is None  # width 6 > max_k + 1
    assert picker_of(Fake(0, wants=True)).gather_steps(Fake(0, wants=True), _no_guard) is None  # nobody to join


def test_a_failing_candidate_is_dropped_by_the_guard_and_the_others_still_batch():
    work = Fake(0, wants=True)
    picker = picker_of(work, Fake(1, wants=True, draft=FakeDraft(fails=True)), Fake(2, wants=True))

    @contextlib.contextmanager
    def guard(sid):
        try:
            yield
        except RuntimeError:
            picker.remove(sid)

    assert [s.sid for s, _ in picker.gather_steps(work, guard)] == [0, 2]
    assert sorted(picker.sessions) == [0, 2] and list(picker.order) == [0, 2]


def test_waited_on_counts_pending_blocks_outside_solo_runs_and_clear_forgets_all():
    picker = picker_of(Fake(0, pending=True), Fake(1, pending=True, solo_wait=True), Fake(2))
    assert picker.waited_on() == 1
    assert [s.sid for s in picker.clear()] == [0, 1, 2] and not picker.sessions and not picker.order


def test_link_pacer_hello_heartbeat_and_silence_follow_the_clock():
    now = [100.0]
    link = LinkPacer(clock=lambda: now[0], hello_retry_s=1.0, heartbeat_s=0.25, silent_s=15.0)
    assert link.hello_due(now[0]) and not link.heartbeat_due(now[0])
    link.hello_sent(now[0])
    assert not link.hello_due(100.5) and link.hello_due(101.1)
    assert link.welcome() is True and link.welcome() is False  # queued hellos are each welcomed
    assert not link.hello_due(200.0)
    now[0] = 100.2
    link.sent()
    assert not link.heartbeat_due(100.4) and link.heartbeat_due(100.5)
    now[0] = 114.0
    assert not link.silent()
    now[0] = 115.5
    assert link.silent()
    link.heard()
    assert not link.silent()
    link.lost()
    now[0] = 200.0
    assert not link.silent() and link.hello_due(now[0]) and not link.heartbeat_due(now[0])
