"""The verifier's parts without sockets or models: the scheduler (which sessions run next, prefill turns, batch
gathering, waits on a fake clock), the pool policy (assignment, failover, demotion), the round runner's fallback
from a batched forward to one per session, and the checks a draft passes before a round uses it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from shared.models import ThreadPlan
from shared.protocol import Capabilities, ProtocolError, SessionEnd, decode
from verifier_node.draft_check import TREE_REFUSED, dense_q, tree_parents
from verifier_node.draft_wait import DraftWait
from verifier_node.drafters import FORGET_AFTER_S, HEARTBEAT_TIMEOUT_S, DrafterLink, DrafterPool
from verifier_node.pending_draft import PendingDraft
from verifier_node.pool_policy import REAP_EVERY_S, PoolPolicy
from verifier_node.rounds import RoundRunner, ThreadSwitch
from verifier_node.scheduler import IDLE_POLL_MAX_MS, BatchLimits, Prefills, Scheduler

pytestmark = pytest.mark.unit

LIMITS = BatchLimits(batching=True, max_batch_sessions=64, max_batch_tokens=512, max_prefill_tokens=2048)


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _link(alive: bool = True) -> SimpleNamespace:
    return SimpleNamespace(alive=lambda now=None: alive)


def _pending(tokens: list[int]) -> PendingDraft:
    return PendingDraft(tokens, None, 0, True, 0.0, None)


def _session(sid: int, **state) -> SimpleNamespace:
    """A session as the scheduler reads it (prefilled and announced to a live drafter, no draft: it may wait)."""
    base = {"sid": sid, "prefilled": True, "draft": None, "announced": True, "solo_left": 0, "drafter": _link(),
            "ready_since": 100.0, "started": 100.0, "prompt_to_cache": [], "wait": DraftWait(3.0), "grammar": None}
    return SimpleNamespace(**{**base, **state})


def _scheduler(*sessions, limits: BatchLimits = LIMITS, clock: FakeClock | None = None) -> Scheduler:
    sched = Scheduler(limits, now=clock or FakeClock())
    for s in sessions:
        sched.add(s)
    return sched


def test_prefill_batches_take_prompts_of_like_length_within_the_budget():
    """Which waiting prompts share a prefill forward: in order, while the padding stays within PREFILL_PADDING of
    their own tokens and rows × longest within max_prefill_tokens; a one-token prompt (nothing to cache) always
    joins. (Moved from tests/test_batch.py, where it built a VerifierServer with object.__new__.)"""
    lengths = {1: 50, 2: 130, 3: 55, 4: 0, 5: 60, 6: 120, 7: 52}
    sched = _scheduler(*(SimpleNamespace(sid=sid, prefilled=False, drafter=None, prompt_to_cache=[7] * n, grammar=None)
                         for sid, n in lengths.items()),
                       limits=replace(LIMITS, batching=True, max_batch_sessions=64, max_prefill_tokens=2048))

    def picked(first: int) -> list[int]:
        return [s.sid for s in sched.prompts_to_prefill(sched.sessions[first], 0.0).sessions]

    assert picked(1) == [1, 3, 4, 5, 7]
    assert picked(2) == [2, 4, 6]
    sched.limits = replace(sched.limits, max_prefill_tokens=160)  # two rows of 50–55 tokens fit, a third does not
    assert picked(1) == [1, 3, 4]
    sched.limits = replace(sched.limits, max_batch_sessions=2)
    assert picked(1) == [1, 3]
    sched.limits = replace(sched.limits, batching=False)
    assert picked(1) == [1]


def test_drafting_elsewhere_sees_a_session_left_out_that_waits_for_its_draft():
    ready, waiting = _session(1, draft=_pending([])), _session(2)
    sched = _scheduler(ready, waiting)
    assert sched.drafting_elsewhere([ready], 0.0)  # session 2's drafter is drafting its block now
    assert not sched.drafting_elsewhere([ready, waiting], 0.0)
    waiting.solo_left = 3  # a run of plain rounds: its drafter idles
    assert not sched.drafting_elsewhere([ready], 0.0)
    waiting.solo_left, waiting.drafter = 0, _link(alive=False)
    assert not sched.drafting_elsewhere([ready], 0.0)


def test_a_session_waits_for_its_draft_until_its_wait_runs_out():
    clock = FakeClock(100.0)
    s = _session(1)
    sched = _scheduler(s, clock=clock)
    assert sched.may_wait(s, clock.t) and not sched.runnable(s, clock.t)
    assert sched.next_work() is None
    assert sched.idle_timeout_ms() == IDLE_POLL_MAX_MS  # the 3 s cap is further off than the longest poll
    clock.t = 102.875
    assert sched.idle_timeout_ms() == 126  # 125 ms left, and a millisecond so the wait has run out on waking
    clock.t = 103.0
    assert sched.runnable(s, clock.t) and sched.next_work() == [s]  # waited the cap: a plain step
    for state in ({"draft": {"tokens": [1]}}, {"solo_left": 2}, {"drafter": None}, {"drafter": _link(False)},
                  {"announced": False}):
        other = _session(2, **state)
        assert not sched.may_wait(other, 100.0) and sched.runnable(other, 100.0), state


def test_no_session_polls_at_most_the_idle_maximum():
    assert _scheduler().idle_timeout_ms() == IDLE_POLL_MAX_MS
    assert not _scheduler().any_runnable(0.0) and _scheduler().next_work() is None


def test_rounds_batch_in_round_robin_order_within_the_limits():
    drafted = [_session(i, draft=_pending([7] * 3)) for i in range(1, 6)]  # 4 tokens fed each
    sched = _scheduler(*drafted, limits=replace(LIMITS, max_batch_sessions=2))
    assert [s.sid for s in sched.next_work()] == [1, 2]
    assert [s.sid for s in sched.next_work()] == [3, 4]  # the first two went to the back
    assert [s.sid for s in sched.next_work()] == [5, 1]
    assert list(sched.order) == [2, 3, 4, 5, 1]
    sched.limits = replace(LIMITS, max_batch_tokens=9)  # two rows of 4 fit, a third does not
    assert [s.sid for s in sched.next_work()] == [2, 3]
    sched.limits = replace(LIMITS, max_batch_tokens=1)  # the first row always runs, however long
    assert [s.sid for s in sched.next_work()] == [4]


def test_a_prompt_takes_a_turn_of_its_own():
    clock = FakeClock()
    drafted = _session(1, draft=_pending([5]))
    prompt = _session(2, prefilled=False, announced=False, prompt_to_cache=[3] * 8)
    later = _session(3, prefilled=False, announced=False, prompt_to_cache=[4] * 9)
    sched = _scheduler(drafted, prompt, later, clock=clock)
    assert sched.next_work() == [drafted]  # the round comes first in order; prompts are left to their turn
    work = sched.next_work()
    assert isinstance(work, Prefills) and [s.sid for s in work.sessions] == [2, 3]  # like lengths: one forward
    assert list(sched.order) == [1, 2, 3]
    sched.limits = replace(LIMITS, batching=False)
    assert sched.next_work() == [drafted]
    assert [s.sid for s in sched.next_work().sessions] == [2]
    assert sched.prompts_waiting() == [100.0, 100.0]


def test_decoding_counts_the_sessions_a_forward_would_share():
    sessions = [_session(1), _session(2), _session(3, prefilled=False)]
    sched = _scheduler(*sessions, limits=replace(LIMITS, max_batch_sessions=2))
    assert sched.decoding() == 2 and sched.decoding(waiting=True) == 2
    sched.limits = replace(LIMITS, max_batch_sessions=64)
    assert sched.decoding() == 2 and sched.decoding(waiting=True) == 3
    sched.limits = replace(LIMITS, batching=False)
    assert sched.decoding(waiting=True) == 1
    assert _scheduler().decoding() == 1


def test_an_ended_session_leaves_the_table_once():
    s = _session(1)
    sched = _scheduler(s, _session(2))
    assert sched.remove(s) and not sched.remove(s)
    assert list(sched.sessions) == [2] and list(sched.order) == [2]


# ---------------------------------------------------------------------------------------------- the pool policy
class PolicyBench:
    """A PoolPolicy over a pool on a fake clock, recording what it sends and announces."""

    def __init__(self, ensemble_weight: float | None = None):
        self.clock = FakeClock(1000.0)
        self.pool = DrafterPool()
        self.sessions: dict[int, SimpleNamespace] = {}
        self.sent: list[tuple[str, object]] = []
        self.announced: list[tuple[int, str]] = []
        self.policy = PoolPolicy(self.pool, self.sessions, ensemble_weight, send=self._send,
                                 announce=self._announce, now=self.clock)

    def _send(self, link: DrafterLink, frames: list) -> None:
        self.sent.append((link.id, decode(frames)))

    def _announce(self, s, kv) -> None:
        s.announced = True
        self.announced.append((s.sid, s.drafter.id))

    def join(self, kind: str = "lm", **caps) -> DrafterLink:
        link, _ = self.pool.join(DrafterLink(f"rid-{len(self.pool.links)}".encode(), kind,
                                             Capabilities(sends_q=True, **caps), host="h"))
        link.last_seen = self.clock.t
        return link

    def session(self, sid: int, drafter_type: str | None = None, do_sample: bool = True, **state):
        base = {"sid": sid, "drafter": None, "drafter_type": drafter_type,
                "params": SimpleNamespace(do_sample=do_sample, num_draft_tokens=None),
                "tried": set(), "served_by": [], "wait": DraftWait(3.0), "prefilled": True, "announced": False,
                "draft": None, "solo_left": 0, "lm": SimpleNamespace(held_rows=lambda layers: {"kv.0": layers})}
        s = SimpleNamespace(**{**base, **state})
        self.sessions[sid] = s
        return s


def test_sessions_go_to_the_least_loaded_drafter_that_fits():
    bench = PolicyBench()
    a, b = bench.join("lm"), bench.join("lookup")
    s1, s2, s3 = bench.session(1), bench.session(2), bench.session(3, drafter_type="lm")
    for s in (s1, s2, s3):
        bench.policy.reassign(s)
    assert (s1.drafter, s2.drafter, s3.drafter) == (a, b, a)  # a tie goes to the earlier drafter
    assert a.sessions == {1, 3} and b.sessions == {2}
    assert s1.served_by == ["d1"] and bench.announced == [(1, "d1"), (2, "d2"), (3, "d1")]
    bench.session(4, drafter_type="other")
    bench.policy.reassign(bench.sessions[4])
    assert bench.sessions[4].drafter is None  # nothing fits: plain steps


def test_ensemble_verification_keeps_greedy_requests_from_drafters_without_greedy_q():
    bench = PolicyBench(ensemble_weight=0.5)
    plain, greedy = bench.join("lm"), bench.join("lm", greedy_q=True)
    assert bench.policy.lacks_q(SimpleNamespace(do_sample=False), plain)
    assert not bench.policy.lacks_q(SimpleNamespace(do_sample=True), plain)
    assert not bench.policy.lacks_q(SimpleNamespace(do_sample=False), greedy)
    assert not PolicyBench().policy.lacks_q(SimpleNamespace(do_sample=False), plain)
    greedy.sessions.update({10, 11})  # the one that fits is the more loaded one
    s = bench.session(1, do_sample=False)
    bench.policy.reassign(s)
    assert s.drafter is greedy


def test_a_silent_drafters_sessions_fail_over_and_a_forgotten_one_leaves_the_pool():
    bench = PolicyBench()
    a = bench.join()
    s = bench.session(1)
    bench.policy.reassign(s)
    b = bench.join()
    b.last_seen = bench.clock.t + HEARTBEAT_TIMEOUT_S  # b keeps talking, a falls silent
    bench.clock.t += HEARTBEAT_TIMEOUT_S + 0.01
    bench.policy.reap()
    assert s.drafter is b and s.served_by == ["d1", "d2"] and a.reported_dead and a.sessions == set()
    assert bench.sent == [("d1", SessionEnd(session=1))]  # it was announced there: told, in case it comes back
    bench.policy.reap()  # within REAP_EVERY_S: not checked again
    bench.clock.t += FORGET_AFTER_S
    b.last_seen = bench.clock.t
    bench.policy.reap()
    assert list(bench.pool.links.values()) == [b] and not b.reported_dead


def test_a_session_without_a_live_drafter_that_fits_stays_and_the_check_is_paced():
    bench = PolicyBench()
    a = bench.join()
    s = bench.session(1)
    bench.policy.reassign(s)
    bench.clock.t += HEARTBEAT_TIMEOUT_S
    bench.policy.reap()
    assert s.drafter is a and a.reported_dead  # nowhere to go: it stays (plain steps), for when a answers again
    a.last_seen = bench.clock.t + 0.5 * REAP_EVERY_S
    bench.clock.t += 0.5 * REAP_EVERY_S
    bench.policy.reap()
    assert a.reported_dead  # not checked again yet
    bench.clock.t += REAP_EVERY_S
    bench.policy.reap()
    assert not a.reported_dead


def test_a_drafter_saying_hello_again_relearns_its_sessions_and_a_newcomer_takes_the_orphans():
    bench = PolicyBench()
    a = bench.join()
    s1, s2 = bench.session(1), bench.session(2)
    bench.policy.reassign(s1)
    bench.policy.on_joined(a, again=True)  # it may have lost them: announced afresh, no session_end
    assert s1.drafter is a and bench.announced == [(1, "d1"), (1, "d1"), (2, "d1")] and bench.sent == []
    a.last_seen = bench.clock.t - HEARTBEAT_TIMEOUT_S  # a went silent; b joins and takes both
    b = bench.join()
    bench.policy.on_joined(b, again=False)
    assert s1.drafter is b and s2.drafter is b and a.sessions == set()


def test_a_demoted_drafter_is_left_for_another_and_not_chosen_again():
    bench = PolicyBench()
    a, b = bench.join(), bench.join()
    s = bench.session(1)
    bench.policy.reassign(s)
    assert s.drafter is a
    bench.policy.on_demoted(s)
    assert s.drafter is b and s.tried == {"d1"}
    bench.policy.on_demoted(s)  # demoted by both: it stays with the last, plain steps and probes
    assert s.drafter is b and s.tried == {"d1", "d2"}


# ---------------------------------------------------------------------------------------------- the round runner
def test_a_failed_batched_forward_falls_back_to_one_forward_per_session():
    """The mechanism behind batched rounds and prefills: when the one forward over every row raises (before any cache
    changed), each session gets a forward of its own, and one that fails alone ends only that session. (Moved from
    tests/test_batch.py, where it built a VerifierServer with object.__new__.)"""
    failed = []
    out = SimpleNamespace(round_failed=lambda s, exc: failed.append((s.sid, str(exc))))
    scheduler = Scheduler(replace(LIMITS, batching=True))
    runner = RoundRunner(None, scheduler, out, threads=None, curve_check=None)
    sessions = [SimpleNamespace(sid=i) for i in range(3)]

    def together():
        raise RuntimeError("batched forward broke")

    def alone(i: int):
        if i == 1:
            raise ValueError("row 1 broke")
        return f"row {i}"

    assert runner.together_or_each("forward", 3, sessions, together, alone) == ["row 0", None, "row 2"]
    assert failed == [(1, "row 1 broke")]
    assert runner.together_or_each("forward", 3, sessions, lambda: ["all"], alone) == ["all"]
    scheduler.limits = replace(LIMITS, batching=False)  # batching off, or a single row: never the batched forward
    assert runner.together_or_each("forward", 3, sessions, lambda: ["all"], alone) == ["row 0", None, "row 2"]
    scheduler.limits = replace(LIMITS, batching=True)
    assert runner.together_or_each("prefill", 1, sessions[:1], lambda: ["all"], alone) == ["row 0"]


def test_the_thread_count_is_set_only_when_it_changes():
    applied: list[int] = []
    switch = ThreadSwitch(ThreadPlan(share=1, full=4), apply=applied.append)
    switch.use(1)
    switch.use(4)
    switch.use(4)
    switch.use(1)
    assert applied == [4, 1] and switch.now == 1


# ---------------------------------------------------------------------------------------------- the draft checks
def _draft(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"parents": None, "tensors": {}, **fields})


def test_q_is_rebuilt_from_its_sparse_encoding_and_checked():
    idx, prob = torch.tensor([[0, 3], [2, 3]]), torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    q = dense_q(_draft(tensors={"q_idx": idx, "q_prob": prob}), 2, 5)
    assert q.tolist() == [[0.25, 0, 0, 0.75, 0], [0, 0, 1.0, 0, 0]]
    assert dense_q(_draft(), 2, 5) is None  # drafts chosen deterministically: one-hot q
    for tensors in ({"q": torch.zeros(2, 4)}, {"q_idx": idx, "q_prob": prob[:1]},
                    {"q_idx": idx + 3, "q_prob": prob}, {"q": torch.full((2, 5), -1.0)}):
        with pytest.raises(ProtocolError):
            dense_q(_draft(tensors=tensors), 2, 5)


def test_a_tree_is_taken_for_greedy_requests_only_and_a_chain_spelled_as_a_tree_is_a_chain():
    greedy = SimpleNamespace(params=SimpleNamespace(do_sample=False, num_draft_tokens=None), lm=None)
    link = SimpleNamespace(needs_hidden=False, kv_layers=[])
    assert tree_parents(_draft(parents=[-1, 0, 1]), greedy, link, ensemble=False) is None
    sampled = SimpleNamespace(params=SimpleNamespace(do_sample=True, num_draft_tokens=None), lm=None)
    for s, ensemble, d in ((sampled, False, link), (greedy, True, link),
                           (greedy, False, SimpleNamespace(needs_hidden=True, kv_layers=[]))):
        with pytest.raises(ProtocolError) as refused:
            tree_parents(_draft(parents=[-1, 0, 0]), s, d, ensemble)
        assert refused.value.code == TREE_REFUSED
