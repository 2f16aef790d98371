"""The thread counts both nodes pick while a batching verifier works on other sessions: whoever computes at the
same time as the other node takes its share of the cores, never both every core (a shared machine would be
oversubscribed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from drafter_node.cost_model import CostBook
from drafter_node.node_picker import ThreadShare, WorkPicker
from shared.models import ThreadPlan
from verifier_node.pending_draft import PendingDraft
from verifier_node.scheduler import BatchLimits, Scheduler

pytestmark = pytest.mark.unit


def _share(pending: list[bool], batch: int) -> tuple[ThreadShare, WorkPicker, CostBook, list[int]]:
    calls: list[int] = []
    share = ThreadShare(ThreadPlan(share=1, full=2), apply=calls.append)  # the node's thread count starts at 1
    book = CostBook(8)
    book.start_batch(batch)
    picker = WorkPicker(max_batch_sessions=64, max_k=8)
    for i, p in enumerate(pending):
        picker.add(SimpleNamespace(sid=i, block_pending=lambda p=p: p, solo_wait=False, threads=0))
    return share, picker, book, calls


@pytest.mark.parametrize(("pending", "batch", "wanted"), [
    ([True], 1, 2),                       # the verifier waits for this one block: every core
    ([False], 1, 1),                      # pre-drafting while the block is verified: the share
    ([True, False, False, False], 4, 1),  # the verifier runs the three other sessions meanwhile
    ([True, True, True, True], 4, 2),     # every session it would batch waits on us
])
def test_the_drafter_takes_every_core_only_while_the_verifier_has_nothing_else(pending, batch, wanted):
    share, picker, book, calls = _share(pending, batch)
    share.use([picker.sessions[0]], picker, book.batch)
    assert share.now == wanted and picker.sessions[0].threads == wanted
    assert calls == ([wanted] if wanted != 1 else [])


def test_the_verifier_shares_the_cores_while_a_session_left_out_waits_for_its_draft():
    live = SimpleNamespace(alive=lambda now=None: True)

    def session(sid: int, **state) -> SimpleNamespace:
        base = {"sid": sid, "prefilled": True, "draft": None, "announced": True, "solo_left": 0, "drafter": live,
                "grammar": None}
        return SimpleNamespace(**{**base, **state})

    ready, waiting = session(1, draft=PendingDraft([], None, 0, True, 0.0, None)), session(2)
    scheduler = Scheduler(BatchLimits(True, 64, 512, 2048))  # only the session table drafting_elsewhere reads
    scheduler.add(ready)
    scheduler.add(waiting)
    assert scheduler.drafting_elsewhere([ready], 0.0)  # session 2's drafter is drafting its block now
    assert not scheduler.drafting_elsewhere([ready, waiting], 0.0)
    waiting.solo_left = 3  # a run of plain rounds: its drafter idles
    assert not scheduler.drafting_elsewhere([ready], 0.0)
    waiting.solo_left, waiting.drafter = 0, SimpleNamespace(alive=lambda now=None: False)
    assert not scheduler.drafting_elsewhere([ready], 0.0)
