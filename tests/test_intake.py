"""Request intake (verifier_node/intake.py) and the hello checks (verifier_node/pool_policy.py ``HelloCheck``) in
this process: no sockets, no node processes. The intake is given a session table, a pool policy and callbacks; what
it admits is what it hands ``open_session``, what it refuses is the ``ProtocolError`` (code, message) the server
sends. The same paths through real sockets and nodes are in tests/test_request_prep.py, tests/test_tenancy.py,
tests/test_security.py and tests/test_robust.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.protocol import (
    ANY_TOKENIZER,
    Capabilities,
    Error,
    Generate,
    Hello,
    ProtocolError,
    Welcome,
    decode,
)
from shared.target_torch import DynamicBackend
from verifier_node.admission import MemoryAdmission, fair_share
from verifier_node.drafters import DrafterLink, DrafterPool
from verifier_node.intake import RequestIntake
from verifier_node.liveness import CLOSED_GRACE_S, ClientLiveness
from verifier_node.pool_policy import HelloCheck, PoolPolicy
from verifier_node.request_prep import PrepJob
from verifier_node.rounds import ForwardCounts
from verifier_node.settings import VerifierSettings
from verifier_node.tenancy import TenantRule

pytestmark = pytest.mark.unit

EOS = [0]


class Bench:
    """A :class:`RequestIntake` over a plain session table, recording what it opens and what it replies."""

    def __init__(self, tokenizer, *, ensemble_weight: float | None = None, max_kv_tokens: int = 1000,
                 per_tenant: int | None = None, **settings):
        fields = {"model_name": "tiny", "draft_timeout_s": 1.0, "max_sessions": 4, "max_message_bytes": 1 << 20,
                  "client_timeout_s": 60.0, "ensemble_weight": ensemble_weight, "drafter_endpoint": "inproc://d",
                  "client_endpoint": "inproc://c", "admission_wait_s": 0.0, **settings}
        self.sessions: dict[int, SimpleNamespace] = {}
        self.requests: dict[tuple[bytes, int], int] = {}
        self.opened: list[PrepJob] = []
        self.replies: list[tuple[bytes, Error]] = []
        self.pool = DrafterPool()
        policy = PoolPolicy(self.pool, self.sessions, ensemble_weight, send=lambda link, frames: None,
                            announce=lambda s, kv: None)
        self.intake = RequestIntake(VerifierSettings(**fields), tokenizer, len(tokenizer), EOS,
                                    admission=MemoryAdmission(200, max_kv_tokens, per_tenant), sessions=self.sessions,
                                    requests=self.requests, policy=policy, tenancy=TenantRule(),
                                    open_session=self.open, reply=self.reply)

    def open(self, job: PrepJob) -> None:
        """What the server does with an admitted request, reduced to the table's entries the intake reads."""
        sid = len(self.sessions) + 1
        self.sessions[sid] = SimpleNamespace(tenant=job.scope, prompt_len=len(job.prompt), params=job.params)
        self.requests[job.key] = sid
        self.opened.append(job)

    def reply(self, peer: bytes, frames: list) -> None:
        self.replies.append((peer, decode(frames)))

    def refused(self, msg: Generate, peer: bytes = b"c") -> ProtocolError:
        with pytest.raises(ProtocolError) as info:
            self.intake.receive(peer, msg)
        assert info.value.request_id == msg.request_id
        return info.value

    def wait_prepared(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.opened) + len(self.replies) < count:
            assert time.monotonic() < deadline, "the preparation worker finished nothing in 30 s"
            self.intake.prep.socket.poll(100)
            self.intake.admit_prepared()


@pytest.fixture
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def bench(tokenizer):
    made: list[Bench] = []

    def make(**kwargs) -> Bench:
        made.append(Bench(tokenizer, **kwargs))
        return made[-1]

    yield make
    for b in made:
        b.intake.close()


def _gen(rid: int, **fields) -> Generate:
    return Generate(request_id=rid, **{"params": {}, **fields})


def _ids(rid: int, ids: list[int], **params) -> Generate:
    return Generate(request_id=rid, token_ids=ids, params={"max_new_tokens": 8, **params})


def test_token_ids_are_admitted_at_once_with_the_targets_end_tokens_and_a_seed(bench):
    b = bench()
    b.intake.receive(b"c", _ids(1, [5, 6, 7]))
    b.intake.receive(b"c", _ids(2, [5], eos_token_ids=[3], seed=11))
    (first, second) = b.opened
    assert first.prompt == [5, 6, 7] and first.grammar is None and first.scope is None and first.wanted is None
    assert first.params.eos_token_ids == EOS and first.params.seed is not None
    assert second.params.eos_token_ids == [3] and second.params.seed == 11
    assert not b.intake.prep.pending  # nothing slow to prepare: no worker involved


def test_generate_checks_keep_their_codes_and_messages(bench):
    b = bench(max_sessions=2)
    b.intake.receive(b"c", _ids(1, [5]))
    exc = b.refused(_ids(1, [5]))
    assert exc.code == "bad_request" and "request_id 1 is already running for this client" in str(exc)
    b.intake.receive(b"other", _ids(1, [5]))  # the same id from another client is another request
    exc = b.refused(_ids(2, [5]))
    assert exc.code == "busy" and str(exc) == "verifier is at its limit of 2 sessions"
    b = bench()
    vocab = b.intake.vocab_size
    exc = b.refused(_ids(3, [vocab]))
    assert exc.code == "bad_request" and str(exc) == f"token ids must be in [0, {vocab})"
    exc = b.refused(_gen(4, token_ids=[5], drafter_type="no-such-type"))
    assert exc.code == "bad_request" and "drafter_type must be one of" in str(exc) and "'no-such-type'" in str(exc)
    exc = b.refused(_ids(5, [5], temperature=-1.0))
    assert exc.code == "bad_request"
    assert b.opened == [] and b.requests == {}


def test_admission_by_tokens_refuses_before_any_work(bench):
    b = bench(max_kv_tokens=30)
    exc = b.refused(_ids(1, [5] * 195))  # 195 + 8 > max_model_len (200): never fits
    assert exc.code == "bad_request" and "verifier.max_model_len (200)" in str(exc)
    b.intake.receive(b"c", _ids(2, [5] * 10))  # holds 18 of 30
    exc = b.refused(_ids(3, [5] * 10))  # 18 + 18 > 30: not now
    assert exc.code == "busy" and "retry later" in str(exc)
    # a text prompt is checked with one token before it is tokenised: here it does not fit either
    exc = b.refused(_gen(4, prompt="hello", params={"max_new_tokens": 12}))
    assert exc.code == "busy" and not b.intake.prep.pending


def test_tenant_cap_counts_sessions_and_requests_being_prepared(bench):
    b = bench(max_sessions_per_tenant=2)
    b.intake.receive(b"c", _gen(1, token_ids=[5], tenant="A"))
    b.intake.prep.pending[(b"c", 2)] = PrepJob(b"c", _gen(2, prompt="x"), b.opened[0].params, None,
                                               scope=b.opened[0].scope)  # as if being prepared
    exc = b.refused(_gen(3, token_ids=[5], tenant="A"))
    assert exc.code == "busy" and str(exc) == ("your requests hold 2 of your 2 sessions "
                                               "(verifier.max_sessions_per_tenant): retry later")
    b.intake.receive(b"c", _gen(4, token_ids=[5], tenant="B"))  # another tenant's cap
    b.intake.receive(b"c", _gen(5, token_ids=[5]))  # no tenant: a scope of its own
    assert [job.msg.request_id for job in b.opened] == [1, 4, 5]
    assert b.opened[0].scope != b.opened[1].scope and b.opened[2].scope is None
    b.intake.prep.pending.clear()


def test_ensemble_verification_refuses_grammars_and_drafters_without_q(bench):
    b = bench(ensemble_weight=0.5)
    b.pool.join(DrafterLink(b"d", "prompt_lookup", Capabilities(sends_q=False)))
    exc = b.refused(_ids(1, [5]))  # greedy, and the only live drafter sends no q
    assert exc.code == "bad_request" and "ensemble verification needs the draft distribution q" in str(exc)
    b.intake.receive(b"c", _ids(2, [5], do_sample=True, seed=1))
    exc = b.refused(_gen(3, token_ids=[5], params={"do_sample": True, "grammar": {"kind": "regex", "value": "a+"}}))
    assert exc.code == "bad_request" and "structured output cannot be combined" in str(exc)


def test_text_prompts_are_prepared_in_the_worker_then_admitted_or_refused(bench, tokenizer):
    b = bench()
    b.intake.receive(b"c", _gen(1, prompt="hello world"))
    b.intake.receive(b"c", _gen(2, messages=[{"role": "user", "content": "hi"}]))
    b.intake.receive(b"c", _gen(3, prompt=""))  # tokenises to nothing: refused once prepared
    assert len(b.intake.prep) == 3 and b.opened == []  # nothing opened on the loop
    b.wait_prepared(3)
    assert [job.msg.request_id for job in b.opened] == [1, 2]
    assert b.opened[0].prompt == tokenizer("hello world")["input_ids"]
    assert b.opened[1].prompt == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                               add_generation_prompt=True, tokenize=True,
                                                               return_dict=True)["input_ids"]
    ((peer, error),) = b.replies
    assert peer == b"c" and error.code == "bad_request" and error.message == "the prompt is empty"
    assert error.request_id == 3 and not b.intake.prep.pending


def test_a_request_cancelled_while_prepared_is_never_opened(bench):
    b = bench()
    b.intake.prep.hook = lambda job: time.sleep(0.2)  # a slow worker (the cancel does not depend on it)
    b.intake.receive(b"c", _gen(1, prompt="hello"))
    assert b.intake.cancel((b"c", 1)) and not b.intake.cancel((b"c", 1))
    b.intake.receive(b"c", _gen(2, prompt="hello"))
    b.wait_prepared(1)
    assert [job.msg.request_id for job in b.opened] == [2] and b.replies == []


def test_a_tokenizer_without_chat_template_refuses_messages(bench, tokenizer):
    tokenizer.chat_template = None
    b = bench()
    b.intake.receive(b"c", _gen(1, messages=[{"role": "user", "content": "hi"}]))
    b.wait_prepared(1)
    ((_, error),) = b.replies
    assert error.code == "bad_request" and "has no chat template" in error.message


# ------------------------------------------------------------------------------------------------ hello checks
@pytest.fixture(scope="module")
def tiny_llama(tiny):
    """The tiny Llama's KV backend: what the hello checks ask whether it holds a drafter's K/V layers."""
    return DynamicBackend(AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.float32).eval())


def _hello(**kwargs) -> Hello:
    fields = {"drafter_type": "assistant", "tokenizer_id": "tok", "capabilities": Capabilities(sends_q=True)}
    return Hello(**{**fields, **kwargs})


def test_hello_checks_refuse_with_their_codes(tiny_llama):
    check = HelloCheck(tiny_llama, "LlamaForCausalLM", "tiny", "tok", ["a", "b"], ensemble_weight=0.5,
                       draft_timeout=1.0, run_secret="s" * 64)
    cases = {
        "unauthorized": _hello(run_secret="x" * 64),
        "tokenizer_mismatch": _hello(run_secret="s" * 64, tokenizer_id="other"),
        "ensemble_needs_q": _hello(run_secret="s" * 64, capabilities=Capabilities(sends_q=False)),
        "unsupported": _hello(run_secret="s" * 64, capabilities=Capabilities(sends_q=True, needs_kv_layers=[7])),
        "bad_message": _hello(run_secret="s" * 64, profile={"curves": "no"}),
    }
    for code, msg in cases.items():
        with pytest.raises(ProtocolError) as info:
            check.check(b"d", msg)
        assert info.value.code == code, (code, str(info.value))
    link = check.check(b"d", _hello(run_secret="s" * 64, tokenizer_id=ANY_TOKENIZER,
                                    capabilities=Capabilities(sends_q=True, needs_kv_layers=[1])))
    assert link.routing_id == b"d" and link.kv_layers == [1] and link.sends_q


def test_on_hello_joins_welcomes_and_hands_out_waiting_sessions(tiny_llama):
    pool, sent = DrafterPool(), []
    policy = PoolPolicy(pool, {}, None, send=lambda link, frames: sent.append((link.id, decode(frames))),
                        announce=lambda s, kv: None)
    check = HelloCheck(tiny_llama, "LlamaForCausalLM", "tiny", "tok", [], ensemble_weight=None, draft_timeout=1.0)
    welcome = Welcome(target="tiny", vocab_size=64, want_q=False)
    policy.on_hello(b"d", _hello(), check, welcome)
    policy.on_hello(b"d", _hello(), check, welcome)  # again: the same link
    assert [(i, type(m)) for i, m in sent] == [("d1", Welcome), ("d1", Welcome)] and len(pool.links) == 1
    with pytest.raises(ProtocolError):
        policy.on_hello(b"e", _hello(tokenizer_id="other"), check, welcome)
    assert len(pool.links) == 1 and len(sent) == 2  # refused: neither joined nor welcomed


def test_pong_stats_are_the_forward_counts_means():
    counts = ForwardCounts()
    assert counts.pong_stats() == {"forwards": 0, "mean_batch_sessions": 0.0, "mean_batch_tokens": 0.0,
                                   "prefill_forwards": 0, "mean_prefill_sessions": 0.0}
    counts.count_forward(2, 10, 0.1)
    counts.count_forward(1, 4, 0.1)
    counts.count_prefill(3)
    assert counts.pong_stats() == {"forwards": 2, "mean_batch_sessions": 1.5, "mean_batch_tokens": 7.0,
                                   "prefill_forwards": 1, "mean_prefill_sessions": 3.0}


# ------------------------------------------------------------------ per-tenant shares and the wait for room (issue 43)


def _tid(rid: int, n: int, tenant: str) -> Generate:
    """Request ``rid`` of tenant ``tenant``: ``n`` prompt tokens and 8 new ones."""
    return Generate(request_id=rid, token_ids=[5] * n, params={"max_new_tokens": 8}, tenant=tenant)


def test_a_tenants_share_of_the_budget_and_busy_names_only_its_own_numbers(bench):
    b = bench(max_kv_tokens=100, per_tenant=50)
    b.intake.receive(b"a", _tid(1, 22, "A"))  # A holds 30 of its 50
    exc = b.refused(_tid(2, 22, "A"), peer=b"a")  # 60 > A's 50: not now, though the budget has room
    assert exc.code == "busy" and str(exc) == ("your requests hold 30 of your 50 tokens (verifier."
                                               "max_kv_tokens_per_tenant); this request needs 30: retry later")
    b.intake.receive(b"b", _tid(3, 22, "B"))  # B's share is its own
    b.intake.receive(b"c", _ids(4, [5] * 22))  # no tenant: a share of its own
    exc = b.refused(_tid(5, 22, "D"), peer=b"d")  # 90 + 30 > 100: the whole budget is taken
    assert exc.code == "busy" and str(exc) == ("the verifier's KV budget (verifier.max_kv_tokens) is taken (your "
                                               "requests hold 0 tokens; this request needs 30): retry later")
    assert "90" not in str(exc) and "100" not in str(exc)  # nothing of what the others hold, nor the total
    exc = b.refused(_tid(6, 50, "B"), peer=b"b")  # past one tenant's share on its own: never fits
    assert exc.code == "bad_request" and "verifier.max_kv_tokens_per_tenant (50)" in str(exc)


def test_fair_defaults_when_several_tenants_share_the_verifier():
    assert MemoryAdmission.resolve(512, 4096, None, None).per_tenant is None  # one tenant: the whole budget
    assert MemoryAdmission.resolve(512, 4096, None, None, tenants=2).per_tenant == 2048
    assert MemoryAdmission.resolve(512, 4096, None, None, tenants=100).per_tenant == 512  # at least 1/8 each
    assert MemoryAdmission.resolve(512, 4096, None, None, 9999, tenants=2).per_tenant == 4096  # set: kept (capped)
    assert fair_share(64, 3) == 21 and fair_share(3, 8) == 1


def test_a_request_that_does_not_fit_waits_for_room_then_is_admitted(bench):
    b = bench(max_kv_tokens=40, admission_wait_s=30.0)
    b.intake.receive(b"a", _ids(1, [5] * 22))  # holds 30 of 40
    b.intake.receive(b"b", _ids(2, [5] * 22))  # does not fit now: waits, no reply yet
    b.intake.receive(b"b", _gen(3, prompt="hello", params={"max_new_tokens": 30}))  # waits before its preparation
    assert len(b.opened) == 1 and not b.replies and len(b.intake.waiting) == 2
    exc = b.refused(_ids(2, [5]), peer=b"b")  # a waiting request id is in use
    assert exc.code == "bad_request" and "already running" in str(exc)
    b.intake.admit_prepared()  # nothing changed: both still wait
    assert len(b.opened) == 1 and len(b.intake.waiting) == 2
    b.sessions.clear()  # the first request ended
    b.intake.admit_prepared()
    assert [j.msg.request_id for j in b.opened] == [1, 2] and len(b.intake.waiting) == 1  # 3 still does not fit
    assert b.intake.cancel((b"b", 3)) and not len(b.intake.waiting) and not b.replies


def test_the_wait_is_bounded_in_time_and_in_places(bench):
    b = bench(max_kv_tokens=40, admission_wait_s=0.2, max_waiting_requests=2, max_sessions_per_tenant=4)
    b.intake.receive(b"a", _ids(1, [5] * 22))
    b.intake.receive(b"b", _ids(2, [5] * 22))
    b.intake.receive(b"b", _ids(3, [5] * 22))
    exc = b.refused(_ids(4, [5] * 22), peer=b"b")  # no place left to wait: busy at once, and why
    assert exc.code == "busy" and "verifier.max_waiting_requests" in str(exc)
    t0 = time.monotonic()
    while len(b.replies) < 2:
        assert time.monotonic() - t0 < 10, "the waits did not end"
        time.sleep(0.05)
        b.intake.admit_prepared()
    assert time.monotonic() - t0 >= 0.15
    assert [(peer, e.code, e.request_id) for peer, e in b.replies] == [(b"b", "busy", 2), (b"b", "busy", 3)]
    assert "after waiting 0.2 s for room" in b.replies[0][1].message
    # one tenant cannot take every place: its session cap is its cap of places too
    b = bench(max_kv_tokens=40, admission_wait_s=30.0, max_sessions_per_tenant=1)
    b.intake.receive(b"a", _tid(1, 22, "A"))
    b.intake.receive(b"a", _tid(2, 22, "A"))  # waits (A's one session)
    exc = b.refused(_tid(3, 22, "A"), peer=b"a")
    assert exc.code == "busy" and "1 of your requests already wait" in str(exc)
    b.intake.receive(b"b", _tid(4, 22, "B"))  # B still finds a place
    assert sorted(b.intake.drop_client(b"a")) == [2] and len(b.intake.waiting) == 1  # a vanished client's go


def test_liveness_ends_silent_and_closed_clients_and_clears_a_reused_descriptor():
    live = ClientLiveness(timeout_s=5.0)
    live.heard(b"p1", now=0.0)
    live.heard(b"p2", now=0.0)
    live._fd.update({b"p1": 7, b"p2": 8})  # as the frames' descriptors would set them
    live.closed(7, now=1.0)  # p1's connection closed
    assert live.gone({b"p1", b"p2"}, now=1.5) == {}  # within the grace: p1 might be a reused descriptor's peer
    assert live.gone({b"p1", b"p2"}, now=1.0 + CLOSED_GRACE_S + 0.1) == {b"p1": "its connection closed"}
    live.closed(8, now=3.0)
    live.heard(b"p2", now=3.2)  # it speaks: a new connection that got descriptor 8, not a gone one
    assert live.gone({b"p2"}, now=4.5) == {}
    gone = live.gone({b"p2"}, now=9.0)  # silent for 5.8 s
    assert list(gone) == [b"p2"] and "nothing from it for 5.8 s" in gone[b"p2"]
    live.gone(set(), now=20.0)
    assert not live.seen  # peers that hold nothing are forgotten
