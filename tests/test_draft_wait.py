"""The verifier's bookkeeping for drafters, without processes: the per-session draft wait (measured delays, misses,
demotion, probes) and the pool (least-loaded choice, a hello again, bad announcements)."""

from __future__ import annotations

import pytest

from shared.protocol import MAX_HOST_CHARS, SCHEMA_VERSION, Capabilities, Hello, ProtocolError, decode, encode
from verifier_node.draft_wait import DEMOTE_AFTER, FLOOR_S, PROBE_GAP_MIN, WAIT_FACTOR, DraftWait
from verifier_node.drafters import DrafterLink, DrafterPool

pytestmark = pytest.mark.unit

CAP = 3.0


def test_wait_follows_the_measured_delays_within_floor_and_cap():
    w = DraftWait(CAP)
    assert w.limit_s() == CAP  # nothing measured: the first draft includes the drafter's prefill
    w.ready(10, 100.0)
    w.arrived(10, 100.2, has_tokens=True)
    assert w.limit_s() == pytest.approx(WAIT_FACTOR * 0.2)
    w.ready(11, 101.0)
    w.arrived(11, 101.001, has_tokens=True)
    assert w.limit_s() == pytest.approx(WAIT_FACTOR * 0.2)  # the slowest recent delay counts
    w.ready(12, 102.0)
    w.arrived(12, 102.0 + 5.0, has_tokens=True)  # a late draft is still measured
    assert w.limit_s() == CAP
    fast = DraftWait(CAP)
    fast.ready(5, 0.0)
    fast.arrived(5, 0.001, has_tokens=True)
    assert fast.limit_s() == FLOOR_S
    fast.ready(6, 1.0)
    fast.arrived(6, 1.0, has_tokens=False)  # an empty block (k = 0) is answered at once: not a measurement
    assert len(fast.delays) == 1


def test_misses_demote_probes_and_a_draft_in_time_promotes():
    w = DraftWait(CAP)
    assert not w.outcome(False, CAP)  # the first round waited the cap and missed
    assert w.limit_s() == FLOOR_S  # nothing answered within the cap: later probes cost the floor only
    demoted = [w.outcome(False, FLOOR_S) for _ in range(DEMOTE_AFTER - 1)]
    assert demoted == [False] * (DEMOTE_AFTER - 2) + [True]
    assert w.demoted and w.limit_s() == 0.0 and w.demotions == 1 and w.misses == DEMOTE_AFTER
    for _ in range(PROBE_GAP_MIN):  # plain rounds without waiting
        assert not w.outcome(False, 0.0)
    assert not w.demoted and w.limit_s() == FLOOR_S  # the probe round waits again
    assert w.outcome(False, FLOOR_S)  # a failed probe demotes at once, for twice as long
    assert w.plain_left == 2 * PROBE_GAP_MIN
    w.outcome(True, 0.01)  # a draft that is there is used and promotes
    assert not w.demoted and w.limit_s() > 0 and w.probe_gap == PROBE_GAP_MIN
    assert w.summary() == {"draft_wait_s": pytest.approx(CAP + DEMOTE_AFTER * FLOOR_S + 0.01),
                           "draft_misses": DEMOTE_AFTER + 1, "demotions": 2}
    w.reset()
    assert w.limit_s() == CAP and not w.demoted


def test_empty_blocks_leave_the_first_real_block_the_whole_cap():
    # k = 0 plans are answered at once; the drafter prefills its copy only at its first drafting step (a probe after
    # rounds alone), so that block may still take the cap. Before, any round that used a draft (an empty block
    # included) spent it: the probe got the floor, missed while the drafter prefilled, and never landed.
    w = DraftWait(CAP)
    for length in range(10, 20):
        w.ready(length, float(length))
        w.arrived(length, float(length), has_tokens=False)
        assert not w.outcome(True, 0.0)
    assert w.limit_s() == CAP and not w.delays
    assert not w.outcome(False, CAP)  # waited the cap and missed: now the floor, as before
    assert w.limit_s() == FLOOR_S


def test_ensemble_sessions_always_wait_the_cap():
    w = DraftWait(CAP, adaptive=False)
    w.ready(3, 0.0)
    w.arrived(3, 0.001, has_tokens=True)
    for _ in range(10):
        assert not w.outcome(False, CAP)
    assert w.limit_s() == CAP and w.demotions == 0


def _link(rid: bytes, kind: str = "assistant", **caps) -> DrafterLink:
    return DrafterLink(rid, kind, Capabilities(sends_q=True, **caps), host="h")


def test_pool_picks_the_least_loaded_fitting_drafter_and_a_hello_again_keeps_its_id():
    pool = DrafterPool()
    a, again = pool.join(_link(b"a"))
    b, _ = pool.join(_link(b"b", "prompt_lookup"))
    assert (a.id, b.id, again) == ("d1", "d2", False)
    assert pool.pick(lambda d: True) is a  # a tie goes to the earlier drafter
    a.sessions.add(1)
    assert pool.pick(lambda d: True) is b
    assert pool.pick(lambda d: d.type == "assistant") is a
    assert pool.pick(lambda d: True, exclude={"d2"}) is a
    same, again = pool.join(_link(b"a", needs_hidden_states=True))
    assert same is a and again and a.id == "d1" and a.sessions == {1} and a.needs_hidden
    a.last_seen -= 10
    assert pool.live() == [b] and pool.dead(a.last_seen + 10) == [a]
    assert pool.pick(lambda d: d.type == "assistant") is None
    assert [d["id"] for d in pool.describe()] == ["d1", "d2"]
    assert pool.describe()[0] == {"id": "d1", "type": "assistant", "host": "h", "sessions": 1, "alive": False}
    assert pool.forget_silent(a.last_seen + 35) == [a] and pool.get(b"a") is None


@pytest.mark.parametrize("host", [5, "x" * (MAX_HOST_CHARS + 1), ["h"]])
def test_a_bad_host_in_hello_is_a_protocol_error(host):
    import msgpack

    frame = msgpack.packb({"v": SCHEMA_VERSION, "type": "hello", "drafter_type": "assistant", "tokenizer_id": "t",
                           "capabilities": {}, "host": host})
    with pytest.raises(ProtocolError, match="host"):
        decode([frame])
    assert decode(encode(Hello(drafter_type="a", tokenizer_id="t", capabilities=Capabilities(), host="box"))).host \
        == "box"


def test_the_wait_covers_the_drafters_longest_block():
    """Blocks sized by the drafter's confidence: after short blocks (0.2 s), an 8-step one (0.7 s) still arrives
    within the wait, since the wait is at least the longest block its profile announces."""
    wait = DraftWait(3.0)
    for length in range(1, 9):
        wait.ready(length, 0.0)
        wait.arrived(length, 0.2, True)
    assert wait.limit_s() == pytest.approx(0.6)  # 3 x the slowest delay: an 8-step block would miss
    wait.block_floor_s = 1.0
    assert wait.limit_s() == pytest.approx(1.0)
    wait.block_floor_s = 5.0
    assert wait.limit_s() == pytest.approx(3.0)  # never beyond the cap
