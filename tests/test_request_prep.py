"""Request preparation off the verifier's loop (verifier_node/request_prep.py) and admission by memory
(verifier_node/admission.py): the grammar compiler's child process and its time limit, the schema bounds, the caches'
byte bounds, and a verifier built from parts (real sockets, a tiny target) whose loop keeps serving while a request
is being prepared, with the pending request cancelled, dropped with its silent client, or refused past the queue."""

from __future__ import annotations

import itertools
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import zmq
from transformers import AutoTokenizer

from shared.protocol import Cancel, Chunk, Done, Error, Generate, Ping, Pong, ProtocolError, decode, encode
from shared.sampling import GrammarSpec, ParamError
from testkit.inproc_verifier import verifier_from_parts
from verifier_node.admission import DEFAULT_KV_TOKENS, DEFAULT_MAX_MODEL_LEN, MemoryAdmission
from verifier_node.grammar import COMPILED_CACHE, GrammarCompiler
from verifier_node.request_prep import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, GrammarChild, check_schema_bounds
from verifier_node.server import VerifierServer

pytestmark = pytest.mark.unit

EOS = 0
_names = itertools.count()


def _nested_any_of(levels: int) -> str:
    """A schema whose compile time grows super-exponentially with ``levels`` (8: tens of seconds on a tiny vocab)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"anyOf": [{"type": "object", "properties": {"a": schema, "b": schema}},
                            {"type": "array", "items": schema}]}
    return json.dumps(schema)


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# ------------------------------------------------------------------------------------------------- grammar side
def test_schema_bounds_refuse_deep_or_huge_schemas_before_compiling():
    check_schema_bounds(GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {}}})))
    deep = "[" * 100_000 + "]" * 100_000  # json.loads would recurse out of its stack on this
    with pytest.raises(ParamError, match=f"at most {MAX_SCHEMA_DEPTH} levels"):
        check_schema_bounds(GrammarSpec("json_schema", deep))
    wide = json.dumps({"enum": list(range(MAX_SCHEMA_NODES + 1))})
    with pytest.raises(ParamError, match=f"at most {MAX_SCHEMA_NODES}"):
        check_schema_bounds(GrammarSpec("json_schema", wide))
    # brackets inside strings are not nesting
    check_schema_bounds(GrammarSpec("json_schema", json.dumps({"pattern": "[" * 100})))
    check_schema_bounds(GrammarSpec("regex", "(" * 100 + ")" * 100))  # not a schema: the engine judges it


@pytest.mark.process
def test_grammar_child_compiles_and_is_killed_past_its_time_limit(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny("llama"))
    local = GrammarCompiler(tokenizer, len(tokenizer), [EOS])
    child = GrammarChild(local.xgr, local.info, len(tokenizer), 1 << 20, timeout_s=1.0)
    try:
        spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                                      "required": ["n"]}))
        remote = GrammarCompiler(tokenizer, len(tokenizer), [EOS], compile_with=child.compile)
        a, b = remote.session(spec, {EOS}), local.session(spec, {EOS})
        assert torch.equal(a.mask(), b.mask())  # the grammar that came back is the one compiled here
        loose = GrammarSpec("json_schema", spec.value, strict=False)  # strict: false reaches the child
        assert child.compile(loose).serialize_json() == local.compile_uncached(loose).serialize_json()
        assert child.compile(loose).serialize_json() != local.compile_uncached(spec).serialize_json()
        with pytest.raises(ParamError, match="refused by the grammar engine"):
            child.compile(GrammarSpec("regex", "(unclosed"))
        first = child.proc
        assert first is not None and child.starts == 1
        with pytest.raises(ParamError, match=r"verifier\.grammar_compile_timeout_s \(1 s\)"):
            child.compile(GrammarSpec("json_schema", _nested_any_of(8)))
        assert child.proc is None and first.poll() is not None  # the runaway compile burns nothing any more
        assert remote.compile(GrammarSpec("regex", "[0-9]+")) is not None  # a fresh child serves the next one
        assert child.starts == 2
    finally:
        child.close()


def test_memory_stays_flat_over_thousands_of_distinct_schemas(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny("llama"))
    bound = 256 * 1024
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [EOS], cache_bytes=bound)

    def spec(i: int) -> GrammarSpec:
        return GrammarSpec("json_schema", json.dumps({
            "type": "object", "required": [f"key{i}"],
            "properties": {f"key{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(10)]}}}))

    for i in range(300):  # warm-up: allocator pools, xgrammar's first caches
        compiler.compile(spec(i), scope="t")
    before = _rss()
    for i in range(300, 3300):
        compiler.compile(spec(i), scope="t")
    grown = _rss() - before
    entries, size = compiler.cached
    assert entries <= COMPILED_CACHE and size <= bound
    # unbounded (xgrammar's default cache) this grows by about 65 MB
    assert grown < 20 * 1024 * 1024, f"RSS grew by {grown / 1e6:.1f} MB over 3000 schemas"


def test_cache_key_has_a_scope():
    compiled: list[str] = []
    compiler = GrammarCompiler.__new__(GrammarCompiler)  # the cache alone: no tokenizer needed
    from collections import OrderedDict

    compiler.cache_bytes, compiler._cache, compiler._sizes, compiler._cached_bytes = 1 << 20, OrderedDict(), {}, 0
    compiler._lock = threading.Lock()
    compiler.compile_with = lambda spec: compiled.append(spec.value) or SimpleNamespace(memory_size_bytes=10)
    spec = GrammarSpec("regex", "a+")
    compiler.compile(spec, "tenant-a")
    compiler.compile(spec, "tenant-a")
    compiler.compile(spec, "tenant-b")
    assert compiled == ["a+", "a+"] and compiler.cached == (2, 2 * (10 + 2))


# ----------------------------------------------------------------------------------------------------- admission
def test_admission_bounds_resolve_and_refuse():
    slots = 4 * 512  # a static backend's capacity_tokens()
    assert MemoryAdmission.resolve(None, None, None, None) == MemoryAdmission(DEFAULT_MAX_MODEL_LEN, DEFAULT_KV_TOKENS)
    a = MemoryAdmission.resolve(None, None, 512, slots)
    assert a == MemoryAdmission(512, 2048)
    with pytest.raises(ValueError, match="exceeds the target's context"):
        MemoryAdmission.resolve(1024, None, 512, slots)
    with pytest.raises(ParamError, match=r"verifier\.max_model_len \(512\)"):
        a.check(10, 1_000_000, 0)
    small = MemoryAdmission(512, 300)
    with pytest.raises(ParamError, match=r"verifier\.max_kv_tokens \(300\)"):
        small.check(10, 400, 0)
    small.check(10, 100, 190)
    with pytest.raises(ProtocolError, match="max_kv_tokens") as busy:
        small.check(10, 100, 191, request_id=7)
    assert busy.value.code == "busy" and busy.value.request_id == 7


# ----------------------------------------------------------------------------------------- a verifier from parts
def _server(target, **settings) -> tuple[VerifierServer, str]:
    return verifier_from_parts(target, **settings)


class _Client:
    """A DEALER on the verifier's client socket, keeping every reply by request id."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.got: dict[int, list] = {}
        self.pongs: list[Pong] = []

    def send(self, msg) -> None:
        self.sock.send_multipart(encode(msg))

    def until(self, done, limit_s: float = 60.0) -> None:
        """Read replies until ``done()``; pings every 0.2 s, so the verifier never takes this client as gone."""
        deadline = time.monotonic() + limit_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no expected reply from the verifier; got {self.got}")
            if self.sock.poll(200):
                msg = decode(self.sock.recv_multipart())
                if isinstance(msg, Pong):
                    self.pongs.append(msg)
                else:
                    self.got.setdefault(msg.request_id, []).append(msg)
            else:
                self.send(Ping())

    def last(self, rid: int):
        return self.got.get(rid, [None])[-1]

    def close(self) -> None:
        self.sock.close(linger=0)


def _serving(server: VerifierServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve)
    thread.start()
    return thread


def _stop(server: VerifierServer, thread: threading.Thread) -> None:
    server.stop()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_a_request_being_prepared_stalls_no_other_session(tiny):
    gate, entered = threading.Event(), threading.Event()

    def slow_preparation(job) -> None:  # a tokenizer or compile that takes as long as the test wants
        if job.msg.request_id == 1:
            entered.set()
            assert gate.wait(60)

    server, endpoint = _server(tiny("llama"), max_pending_requests=1, prep_hook=slow_preparation)
    thread, client = _serving(server), _Client(endpoint)
    params = {"max_new_tokens": 6, "eos_token_ids": []}
    try:
        client.send(Generate(request_id=1, prompt="def add(a, b):", params=params))
        assert entered.wait(60)
        client.send(Generate(request_id=2, prompt="class Node:", params=params))  # the queue holds one
        client.send(Generate(request_id=3, token_ids=[5, 17, 33, 2, 60], params=params))
        client.until(lambda: isinstance(client.last(3), Done) and 2 in client.got)
        assert isinstance(client.last(2), Error) and client.last(2).code == "busy"
        assert "verifier.max_pending_requests" in client.last(2).message
        assert any(isinstance(m, Chunk) for m in client.got[3]) and len(client.last(3).token_ids) == 6
        assert 1 not in client.got  # still being prepared while request 3 streamed and finished
        client.send(Cancel(request_id=1))
        client.until(lambda: 1 in client.got)
        assert client.got[1] == [Done(request_id=1, token_ids=[], text="", metrics={}, finish_reason="cancelled")]
        gate.set()
        client.send(Generate(request_id=4, prompt="def add(a, b):", params=params))  # after 1 in the worker's queue
        client.until(lambda: isinstance(client.last(4), Done))
        client.send(Ping())
        client.until(lambda: bool(client.pongs))
        assert client.pongs[-1].sessions == 0 and len(client.got[1]) == 1  # the cancelled one never ran
    finally:
        gate.set()
        client.close()
        _stop(server, thread)


def test_a_silent_client_is_dropped_while_its_request_is_prepared(tiny):
    gate = threading.Event()
    server, endpoint = _server(tiny("llama"), client_timeout_s=1.0,
                               prep_hook=lambda job: job.msg.request_id == 1 and gate.wait(60))
    thread, silent, other = _serving(server), _Client(endpoint), _Client(endpoint)
    try:
        silent.send(Generate(request_id=1, prompt="def add(a, b):", params={"max_new_tokens": 4}))
        deadline = time.monotonic() + 60
        while not server.prep.pending:  # it arrives
            assert time.monotonic() < deadline
            time.sleep(0.02)
        silent.close()
        while server.prep.pending:  # and is dropped, nothing heard from its client
            assert time.monotonic() < deadline, "a silent client's pending request was never dropped"
            time.sleep(0.05)
        gate.set()
        other.send(Generate(request_id=1, prompt="class Node:", params={"max_new_tokens": 4}))
        other.until(lambda: isinstance(other.last(1), Done))  # prepared after the silent client's, in order
        other.send(Ping())
        other.until(lambda: bool(other.pongs))
        assert other.pongs[-1].sessions == 0 and not server.prep.pending  # the dropped request never ran
    finally:
        gate.set()
        other.close()
        _stop(server, thread)


def test_requests_are_admitted_by_their_tokens(tiny):
    server, endpoint = _server(tiny("llama"), max_kv_tokens=100, forward_delay_s=0.02, admission_wait_s=0.0)
    thread, client = _serving(server), _Client(endpoint)
    try:
        prompt = [5, 17, 33, 2, 60, 6, 7, 8, 9, 10]
        client.send(Generate(request_id=1, token_ids=prompt, params={"max_new_tokens": 60, "eos_token_ids": []}))
        client.send(Generate(request_id=2, token_ids=prompt[:5], params={"max_new_tokens": 40}))  # 70 + 45 > 100
        client.send(Generate(request_id=3, token_ids=prompt, params={"max_new_tokens": 1_000_000}))
        client.send(Generate(request_id=4, token_ids=prompt, params={"max_new_tokens": 95}))
        client.send(Generate(request_id=5, prompt="word " * 600, params={"max_new_tokens": 4}))  # tokenised: > 512
        client.until(lambda: all(rid in client.got for rid in (2, 3, 4, 5)) and isinstance(client.last(1), Done))
        codes = {rid: (client.last(rid).code, client.last(rid).message) for rid in (2, 3, 4, 5)}
        assert codes[2][0] == "busy" and "verifier.max_kv_tokens" in codes[2][1] and "hold 70 tokens" in codes[2][1]
        assert codes[3][0] == "bad_request" and "verifier.max_model_len (512)" in codes[3][1]
        assert codes[4][0] == "bad_request" and "verifier.max_kv_tokens (100)" in codes[4][1]
        assert codes[5][0] == "bad_request" and "verifier.max_model_len (512)" in codes[5][1]
        assert len(client.last(1).token_ids) == 60
        client.send(Generate(request_id=6, token_ids=prompt[:5], params={"max_new_tokens": 40}))  # fits now
        client.until(lambda: isinstance(client.last(6), Done))
        assert len(client.last(6).token_ids) >= 1
    finally:
        client.close()
        _stop(server, thread)
