"""The thread counts both nodes pick while a batching verifier works on other sessions: whoever computes at the
same time as the other node takes its share of the cores, never both every core (a shared machine would be
oversubscribed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import drafter_node.node
from drafter_node.cost_model import CostBook
from drafter_node.node import DrafterNode
from shared.models import ThreadPlan
from verifier_node.server import VerifierServer

pytestmark = pytest.mark.unit


def _node(pending: list[bool], batch: int, monkeypatch) -> tuple[DrafterNode, list[int]]:
    calls: list[int] = []
    monkeypatch.setattr(drafter_node.node, "set_threads", calls.append)
    node = object.__new__(DrafterNode)  # only the state _use_threads reads
    node.threads, node._threads_now = ThreadPlan(share=1, full=2), 1
    node.book = CostBook(8)
    node.book.start_batch(batch)
    node.sessions = {i: SimpleNamespace(block_pending=lambda p=p: p, solo_wait=False, threads=0)
                     for i, p in enumerate(pending)}
    return node, calls


@pytest.mark.parametrize(("pending", "batch", "wanted"), [
    ([True], 1, 2),                       # the verifier waits for this one block: every core
    ([False], 1, 1),                      # pre-drafting while the block is verified: the share
    ([True, False, False, False], 4, 1),  # the verifier runs the three other sessions meanwhile
    ([True, True, True, True], 4, 2),     # every session it would batch waits on us
])
def test_the_drafter_takes_every_core_only_while_the_verifier_has_nothing_else(pending, batch, wanted, monkeypatch):
    node, calls = _node(pending, batch, monkeypatch)
    node._use_threads(node.sessions[0])
    assert node._threads_now == wanted and node.sessions[0].threads == wanted
    assert calls == ([wanted] if wanted != 1 else [])


def test_the_verifier_shares_the_cores_while_a_session_left_out_waits_for_its_draft():
    server = object.__new__(VerifierServer)  # only the state _drafting_elsewhere reads
    live = SimpleNamespace(alive=lambda now=None: True)

    def session(sid: int, **state) -> SimpleNamespace:
        base = {"sid": sid, "prefilled": True, "draft": None, "announced": True, "solo_left": 0, "drafter": live}
        return SimpleNamespace(**{**base, **state})

    ready, waiting = session(1, draft={"tokens": []}), session(2)
    server.sessions = {1: ready, 2: waiting}
    assert server._drafting_elsewhere([ready], 0.0)  # session 2's drafter is drafting its block now
    assert not server._drafting_elsewhere([ready, waiting], 0.0)
    waiting.solo_left = 3  # a run of plain rounds: its drafter idles
    assert not server._drafting_elsewhere([ready], 0.0)
    waiting.solo_left, waiting.drafter = 0, SimpleNamespace(alive=lambda now=None: False)
    assert not server._drafting_elsewhere([ready], 0.0)
