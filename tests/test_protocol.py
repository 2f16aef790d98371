"""Fast tests of shared.protocol: typed round trips, field validation, defaults, error codes, fuzzing. No models, no
nodes.

Malformed input of any shape must raise only :class:`ProtocolError` (what the nodes catch and answer).
"""

from __future__ import annotations

import ast
import dataclasses
import pickle
import types
import typing
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import protocol
from shared.protocol import (
    MAX_DRAFT_TOKENS,
    MAX_HEADER_BYTES,
    MAX_IDLE_ROUNDS,
    MAX_TENANT_CHARS,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Cancel,
    Capabilities,
    Chunk,
    Commit,
    Done,
    Draft,
    DrafterStats,
    DrafterTiming,
    Error,
    Generate,
    Heartbeat,
    Hello,
    Message,
    Ping,
    PlanCheck,
    Pong,
    ProtocolError,
    SessionEnd,
    SessionStart,
    StartReport,
    State,
    ThreadCounts,
    TokenLogprob,
    Welcome,
    decode,
    encode,
    error_frames,
)

pytestmark = pytest.mark.unit

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}

#: One valid instance per message type, every field set to a value other than its default (so a round trip that
#: dropped a field would be seen). Generate's alternatives to token_ids are in VARIANTS.
VALID: dict[str, Message] = {
    "hello": Hello(drafter_type="assistant", tokenizer_id="qwen2.5",
                   capabilities=Capabilities(sends_q=True, greedy_q=True, needs_hidden_states=True,
                                             needs_kv_layers=[0, 3]),
                   profile={"model": "m", "curves": {"1": {"sizes": [1]}}}, threads=ThreadCounts(share=1, full=2),
                   host="box", run_secret="ab" * 32),
    "welcome": Welcome(target="tiny", vocab_size=151936, want_q=True, profile={"dtype": "float32"},
                       threads=ThreadCounts(share=2, full=4), rollback_refeeds=True,
                       dtype="bfloat16"),
    "session_start": SessionStart(session=3, token_ids=[1, 2, 3], params={"max_new_tokens": 8, "do_sample": False},
                                  prompt_len=2, decoding=4, tenant="9f86d081884c7d65"),
    "draft": Draft(session=3, base_len=10, tokens=[4, 5, 6], idle_rounds=0, overlap=False,
                   sent_at=1.7e9, stats=DrafterStats(
                       busy_s=0.5, blocks=2, predraft_hits=1, rolled_back=3, idle_blocks=1, batch_steps=4, batch_rows=6,
                       tree_blocks=1, side_accepted=1, plans={"k=3": 2}, dtype="float32",
                       timing=DrafterTiming(step_s=0.1, send_s=0.01, commit_s=0.02, roundtrip_s=0.3, roundtrips=2,
                                            forward_s=0.05, profile_s=0.04),
                       plan_rates={"sync k=3": [2, 7, 0.5, 12.0]},
                       plan_check=PlanCheck(startup="sync k=3", realised_best="sync k=3", verdict="confirmed"),
                       ceiling_tokens_per_second=9.5)),
    "commit": Commit(session=3, base_len=10, tokens=[4, 5], drafted=3, accepted=1, verify_s=0.25,
                     threads=2, batch_sessions=3, batch_tokens=9, decoding=5),
    "state": State(session=3, base_len=10, end=9),
    "session_end": SessionEnd(session=3),
    "heartbeat": Heartbeat(report=StartReport(decision="pays", schedule="cost", k=4, overlap=True, speedup=1.6,
                                              verify_1_s=0.29, drafter_threads=ThreadCounts(share=1, full=2))),
    "generate": Generate(request_id=7, params={"temperature": 0.7, "seed": None}, token_ids=[5, 6],
                         drafter_type="assistant", tenant="alice"),
    "chunk": Chunk(request_id=7, token_ids=[1], text="é ✓", logprobs=[
        TokenLogprob(logprob=-0.5, piece=b"\xc3", special=True, top_ids=[1, 4], top_logprobs=[-0.5, -1.25],
                     top_pieces=[b"\xc3", b"ab"])]),
    "done": Done(request_id=7, token_ids=[1, 2], text="ok", metrics={"rounds": 2, "acceptance_rate": 0.5},
                 finish_reason="length", logprobs=[TokenLogprob(logprob=-0.5), TokenLogprob(logprob=0)]),
    "cancel": Cancel(request_id=7),
    "ping": Ping(),
    "pong": Pong(drafter_connected=True, drafter_type="assistant", target="tiny", sessions=2,
                 drafters=[{"id": "d1", "type": "assistant", "host": "box", "sessions": 2, "alive": True}],
                 max_message_bytes=4096, heartbeat_timeout_s=5.0, batching=True, forwards=9, mean_batch_sessions=2.5,
                 mean_batch_tokens=7.5, prefill_forwards=3, mean_prefill_sessions=1.5,
                 reports=[StartReport(decision="cannot_pay", draft_s=0.095, drafter="d1")], tool_parser="hermes"),
    "error": Error(message="boom", code="bad_message", request_id=7, session=4),
}
VARIANTS: list[Message] = [
    Generate(request_id=8, params={}, prompt="héllo"),
    Generate(request_id=9, params={}, messages=[{"role": "user", "content": "hi"}]),
    Generate(request_id=10, params={}, messages=[  # tool use: a call, its result
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"}],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]),
    Draft(session=1, base_len=2, tokens=[], idle_rounds=MAX_IDLE_ROUNDS),
    Draft(session=1, base_len=2, tokens=[4, 9, 5, 6], parents=[-1, -1, 0, 2]),  # a token tree
    Welcome(target="t", vocab_size=1, want_q=False),
]
#: Optional fields VALID leaves at their default on purpose (covered by VARIANTS).
AT_DEFAULT = {("generate", "prompt"), ("generate", "messages"), ("generate", "tools"), ("draft", "idle_rounds"),
              ("draft", "parents")}
TENSOR_TYPES = {t for t, cls in MESSAGE_TYPES.items() if "tensors" in {f.name for f in dataclasses.fields(cls)}}


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name != "tensors"]


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _required(cls: type) -> list[str]:
    return [f.name for f in _fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _wire(msg_type: str) -> dict[str, Any]:
    """VALID[msg_type]'s header fields as they go on the wire (v, type and tensors left out)."""
    header = msgpack.unpackb(encode(VALID[msg_type])[0], raw=False)
    return {k: v for k, v in header.items() if k not in ("v", "type", "tensors")}


def _pack(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _header(msg_type: str = "state", **fields: Any) -> bytes:
    """A valid header of ``msg_type`` (a type that carries tensors by default) with ``fields`` replaced or added."""
    return _pack({"v": SCHEMA_VERSION, "type": msg_type, **(_wire(msg_type) if msg_type in VALID else {}), **fields})


def _error(frames: list[Any], **kwargs: Any) -> ProtocolError:
    """The ProtocolError decode raises; fails the test (as a bug) on any other outcome."""
    try:
        msg = decode(frames, **kwargs)
    except ProtocolError as exc:
        return exc
    except Exception as exc:
        pytest.fail(f"BUG: decode raised {type(exc).__name__}: {exc!s:.300} instead of ProtocolError")
    pytest.fail(f"decode accepted a malformed message: {msg!r:.300}")


def _conforms(value: Any, tp: Any) -> bool:
    """Whether a decoded value has the annotated type exactly (bools are not ints, list elements, nested types)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return value is None or _conforms(value, next(a for a in args if a is not type(None)))
    if tp is Any:
        return True
    if origin is list:
        return type(value) is list and all(_conforms(x, args[0]) for x in value)
    if origin is dict:
        return type(value) is dict and all(_conforms(x, args[1]) for x in value.values())
    if dataclasses.is_dataclass(tp):
        return type(value) is tp and all(_conforms(getattr(value, f.name), typing.get_type_hints(tp)[f.name])
                                         for f in dataclasses.fields(tp))
    return type(value) is tp


def _decode_or_protocol_error(frames: list[Any]) -> Message | None:
    """The contract every input must satisfy: a typed message that conforms to its class, or a ProtocolError —
    never anything else."""
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        assert isinstance(exc.code, str) and exc.code
        return None
    except Exception as exc:
        pytest.fail(f"BUG: decode raised {type(exc).__name__}: {exc!s:.300} (only ProtocolError is allowed)")
    assert type(msg) is MESSAGE_TYPES[msg.TYPE]
    hints = typing.get_type_hints(type(msg))
    for f in _fields(type(msg)):
        assert _conforms(getattr(msg, f.name), hints[f.name]), (msg.TYPE, f.name, getattr(msg, f.name))
    return msg


def _sample_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def _tensor_set() -> dict[str, torch.Tensor]:
    shapes = [(3,), (2, 5), (2, 3, 4), (1, 1, 2, 3), (4, 1), (2, 2, 2, 2, 2)]
    tensors = {}
    for i, (name, dtype) in enumerate(DTYPES.items()):
        tensors[name] = _sample_tensor(dtype, shapes[i % len(shapes)], seed=i)
        tensors[f"{name}_empty"] = torch.empty((0, 4) if i % 2 else (3, 0, 2), dtype=dtype)
    tensors["non_contiguous"] = torch.arange(12.0).reshape(3, 4).t()
    tensors["eight_dims"] = torch.arange(256, dtype=torch.int32).reshape((2,) * 8)
    return tensors


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(a, b)


def _state(**tensors: torch.Tensor) -> State:
    return State(session=1, base_len=2, end=2, tensors=tensors)


def _roundtrip_frames(frames: list[Any], how: str, zmq_pair) -> list[Any]:
    if how == "as_encoded":
        return frames
    if how == "bytes":
        return [memoryview(f).tobytes() if not isinstance(f, bytes) else f for f in frames]
    send, recv = zmq_pair
    send.send_multipart(frames, copy=(how == "zmq_copy"))
    assert recv.poll(5000), "nothing arrived over inproc"
    received = recv.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in received)
    return received


@pytest.fixture
def zmq_pair():
    ctx = zmq.Context()
    address = f"inproc://protocol-{uuid.uuid4().hex}"
    recv = ctx.socket(zmq.PAIR)
    recv.bind(address)
    send = ctx.socket(zmq.PAIR)
    send.connect(address)
    yield send, recv
    send.close(linger=0)
    recv.close(linger=0)
    ctx.term()


# ------------------------------------------------------------------------------------------- the message classes


def test_registry_has_one_class_per_type_with_a_direction():
    assert set(MESSAGE_TYPES) == set(VALID) == {
        "hello", "welcome", "session_start", "draft", "commit", "state", "session_end", "heartbeat", "generate",
        "chunk", "done", "cancel", "ping", "pong", "error"}
    directions = {"drafter→verifier", "verifier→drafter", "drafter↔verifier", "client→verifier", "verifier→client",
                  "any"}
    for name, cls in MESSAGE_TYPES.items():
        assert name == cls.TYPE and dataclasses.is_dataclass(cls) and issubclass(cls, Message)
        assert cls.DIRECTION in directions, cls
        assert type(VALID[name]) is cls
    assert {"session_start", "draft", "commit", "state"} == TENSOR_TYPES


def test_capabilities_are_shared_by_both_sides():
    """What a drafter type declares (drafter_node.base's Capabilities) is what the verifier decodes from its hello:
    the same values, in the same class."""
    from drafter_node import base

    caps = base.Capabilities(sends_q=True, greedy_q=False, needs_hidden_states=True, needs_kv_layers=[0, 2])
    hello = protocol.decode(protocol.encode(protocol.Hello(drafter_type="x", tokenizer_id="t", capabilities=caps)))
    assert type(hello.capabilities) is Capabilities and hello.capabilities == caps


def test_limits_are_defined_once_and_used_by_the_nodes():
    assert (MAX_DRAFT_TOKENS, MAX_IDLE_ROUNDS, protocol.DEFAULT_MAX_MESSAGE_BYTES) == (64, 1024, 64 * 1024 * 1024)
    root = Path(protocol.__file__).resolve().parent.parent
    for rel in ("verifier_node/server.py", "drafter_node/node.py", "drafter_node/node_handlers.py", "runtime/client.py",
                "runtime/config.py"):
        source = (root / rel).read_text()
        assert "64 * 1024 * 1024" not in source, rel  # the message limit's value, written out again (the HTTP
        # server's own body limit, in runtime/config.py, is another limit)
        for name in ("MAX_DRAFT_TOKENS", "MAX_IDLE_ROUNDS", "DEFAULT_MAX_MESSAGE_BYTES", "MAX_HEADER_BYTES"):
            assert f"{name} =" not in source, (rel, name)


def test_valid_instances_set_every_field():
    """The round-trip tests below only prove a field survives if it differs from its default."""
    for name, msg in VALID.items():
        for f in _fields(type(msg)):
            if (name, f.name) not in AT_DEFAULT and f.name not in _required(type(msg)):
                assert getattr(msg, f.name) != _default(f), (name, f.name)


# ------------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("how", ["as_encoded", "bytes", "zmq_copy", "zmq_nocopy"])
@pytest.mark.parametrize("msg", [*VALID.values(), *VARIANTS], ids=lambda m: m.TYPE)
def test_round_trip_preserves_every_field(msg, how, zmq_pair):
    got = decode(_roundtrip_frames(encode(msg), how, zmq_pair))
    assert type(got) is type(msg)
    assert got == msg
    assert got.to_dict() == msg.to_dict()
    for f in _fields(type(msg)):
        assert getattr(got, f.name) == getattr(msg, f.name), f.name
        assert type(getattr(got, f.name)) is type(getattr(msg, f.name)), f.name
    if msg.TYPE in TENSOR_TYPES:
        assert got.tensors == {}


@pytest.mark.parametrize("how", ["as_encoded", "bytes", "zmq_copy", "zmq_nocopy"])
@pytest.mark.parametrize("msg_type", sorted(TENSOR_TYPES))
def test_round_trip_with_every_dtype(msg_type, how, zmq_pair):
    tensors = _tensor_set()
    msg = dataclasses.replace(VALID[msg_type], tensors=tensors)
    frames = encode(msg)
    assert len(frames) == 1 + len(tensors)
    got = decode(_roundtrip_frames(frames, how, zmq_pair))
    assert got == msg
    assert set(got.tensors) == set(tensors)
    for name, tensor in tensors.items():
        _assert_same(got.tensors[name], tensor)


def test_to_dict_gives_plain_values():
    assert VALID["hello"].to_dict() == {
        "drafter_type": "assistant", "tokenizer_id": "qwen2.5",
        "capabilities": {"sends_q": True, "greedy_q": True, "needs_hidden_states": True, "needs_kv_layers": [0, 3]},
        "profile": {"model": "m", "curves": {"1": {"sizes": [1]}}}, "threads": {"share": 1, "full": 2},
        "host": "box", "run_secret": "ab" * 32}
    assert Pong(drafter_connected=False).to_dict() == {"drafter_connected": False, "drafter_type": None,
                                                        "target": None, "sessions": 0, "drafters": [],
                                                        "max_message_bytes": 0, "heartbeat_timeout_s": 0.0,
                                                        "batching": False, "forwards": 0,
                                                        "mean_batch_sessions": 0.0,
                                                        "mean_batch_tokens": 0.0, "prefill_forwards": 0,
                                                        "mean_prefill_sessions": 0.0, "reports": [],
                                                        "tool_parser": None}
    assert VALID["pong"].to_dict()["reports"][0]["draft_s"] == 0.095  # nested structures as plain maps


@pytest.mark.parametrize("msg_type", sorted(MESSAGE_TYPES))
def test_missing_optional_fields_get_their_defaults(msg_type):
    cls = MESSAGE_TYPES[msg_type]
    wire = _wire(msg_type)
    header = {name: wire[name] for name in _required(cls)}
    if cls is Generate:
        header["prompt"] = "x"  # one of token_ids, prompt, messages is needed
    got = decode([_pack({"v": SCHEMA_VERSION, "type": msg_type, **header})])
    for f in _fields(cls):
        if f.name in header:
            assert got.to_dict()[f.name] == header[f.name], f.name
        else:
            assert getattr(got, f.name) == _default(f), f.name


def test_float_fields_accept_integers_as_floats():
    got = decode([_header("commit", verify_s=2)])
    assert got.verify_s == 2.0 and type(got.verify_s) is float
    got = decode([_header("draft", sent_at=1700000000)])
    assert type(got.sent_at) is float


def test_nested_maps_fill_their_defaults_and_ignore_extras():
    got = decode([_header("hello", capabilities={"sends_q": True, "future": 1}, threads={"full": 3})])
    assert got.capabilities == Capabilities(sends_q=True)
    assert got.threads == ThreadCounts(share=0, full=3)
    assert not hasattr(got.capabilities, "future")


def test_unknown_extra_fields_are_ignored():
    for msg_type, msg in VALID.items():
        got = decode([_header(msg_type, anything={"nested": [1, 2]}, flag=True)])
        assert got == msg
        assert not hasattr(got, "anything") and "anything" not in got.to_dict()


def test_special_float_values_round_trip_bit_exact():
    for name in ("float32", "float16", "bfloat16"):
        t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-8, 65504.0], dtype=DTYPES[name])
        got = decode([memoryview(f).tobytes() for f in encode(_state(x=t))]).tensors["x"]
        bits = torch.int32 if name == "float32" else torch.int16
        assert torch.equal(got.view(bits), t.view(bits))


def test_integer_extremes_round_trip():
    tensors = {
        name: torch.tensor([torch.iinfo(dt).min, torch.iinfo(dt).max, 0], dtype=dt)
        for name, dt in DTYPES.items()
        if not dt.is_floating_point
    }
    got = decode(encode(_state(**tensors))).tensors
    for name, t in tensors.items():
        _assert_same(got[name], t)


def test_encode_sends_tensors_without_copies():
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    frames = encode(_state(x=src))
    assert frames[1].ctypes.data == src.data_ptr()


def test_decoded_tensors_are_private_writable_copies():
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    frames = encode(_state(x=src))
    got = decode(frames).tensors["x"]
    src.fill_(-1)  # the encoded frame shares memory with src; the decoded tensor must not
    assert torch.equal(got, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    got.add_(1)  # writable, no read-only buffer underneath
    assert got[0, 0].item() == 1.0


def test_header_holds_the_fields_and_tensor_descriptors():
    frames = encode(_state(q=torch.zeros(2, 3, dtype=torch.bfloat16)))
    header = msgpack.unpackb(frames[0], raw=False)
    assert header == {
        "v": SCHEMA_VERSION,
        "type": "state",
        "session": 1,
        "base_len": 2,
        "end": 2,
        "tensors": [{"name": "q", "dtype": "bfloat16", "shape": [2, 3]}],
    }
    assert memoryview(frames[1]).nbytes == 2 * 3 * 2
    # optional fields left at None are not sent; the receiver fills them back in
    assert msgpack.unpackb(encode(Error(message="x"))[0], raw=False) == {
        "v": SCHEMA_VERSION, "type": "error", "message": "x", "code": "error"}


def test_zero_dim_tensor_round_trip():
    """The wire format allows shape [] (decode accepts it), and encode produces it for every dtype."""
    try:
        frames = encode(_state(s=torch.tensor(1.5), i=torch.tensor(7, dtype=torch.int64)))
    except Exception as exc:
        pytest.fail(f"BUG: encode() of a 0-dim tensor raised {type(exc).__name__}: {exc}")
    got = decode(frames).tensors
    _assert_same(got["s"], torch.tensor(1.5))
    _assert_same(got["i"], torch.tensor(7, dtype=torch.int64))


def test_encode_rejects_what_is_not_a_message_and_unsendable_dtypes():
    for bad in ("ping", {"type": "ping"}, Capabilities(), ThreadCounts(), None):
        with pytest.raises(TypeError, match="message instance"):
            encode(bad)
    with pytest.raises(ValueError, match="cannot be sent"):
        encode(_state(x=torch.zeros(2, dtype=torch.float64)))


def test_error_frames_round_trip():
    assert decode(error_frames("it broke", "bad_version", request_id=9)) == Error("it broke", "bad_version", 9)
    assert decode(error_frames("it broke", session=3)) == Error("it broke", "error", None, 3)
    assert decode(error_frames("it broke", request_id=None)) == Error("it broke")


# ---------------------------------------------------------------------------------------- field validation

REQUIRED = [(t, f) for t, cls in MESSAGE_TYPES.items() for f in _required(cls)]


@pytest.mark.parametrize(("msg_type", "field"), REQUIRED, ids=[f"{t}.{f}" for t, f in REQUIRED])
def test_missing_required_field(msg_type, field):
    fields = {k: v for k, v in _wire(msg_type).items() if k != field}
    exc = _error([_pack({"v": SCHEMA_VERSION, "type": msg_type, **fields})])
    assert exc.code == "bad_message"
    assert field in str(exc) and "missing" in str(exc)


#: Wrong values per annotated type (None is wrong too unless the field is optional with default None).
WRONG_VALUES: dict[Any, list[Any]] = {
    int: ["7", 1.5, True, False, [7], {}],
    float: ["0.5", True, [1.0], {}],
    str: [5, b"bytes", ["a"], True],
    bool: [1, 0, "true", [True]],
    list[int]: ["abc", {}, 5, [1, "2"], [1, True], [1.0], [[1]], [None]],
    dict[str, Any]: [[], "x", 5, True],
    list[dict[str, str]]: ["x", [1], [["role", "user"]], [{"role": 1, "content": "x"}], [{"role": "user",
                                                                                            "content": None}]],
    Capabilities: [[], "x", True, {"sends_q": 1}, {"greedy_q": "yes"}, {"needs_kv_layers": [True]},
                   {"needs_kv_layers": 3}],
    ThreadCounts: [[], 2, {"share": "1"}, {"full": True}, {"share": 1.0}],
    StartReport: [[], "x", {"k": "4"}, {"overlap": 1}, {"speedup": "fast"}, {"decision": "maybe"},
                  {"k": -1}, {"verify_1_s": -0.1}, {"schedule": "x" * 201}, {"drafter_threads": {"share": -1}}],
    list[StartReport]: ["x", {}, [1], [{"k": "4"}], [{"decision": "maybe"}]],
    DrafterStats: [[], "x", True, {"blocks": "3"}, {"busy_s": True}, {"blocks": 1.5}, {"plans": ["sync"]},
                   {"plans": {"sync": 1.0}}, {"dtype": 3}, {"timing": []}, {"timing": {"roundtrips": "2"}},
                   {"plan_rates": {"p": "x"}}, {"plan_rates": {"p": [1, "2", 3, 4]}}, {"plan_check": "corrected"},
                   {"plan_check": {"startup": "x"}}, {"ceiling_tokens_per_second": "fast"}, {"side_accepted": -1}],
    list[dict[str, Any]]: ["x", {}, [1], [["id", "d1"]], [None]],
    list[TokenLogprob]: ["x", {}, [1], [None], [{}], [{"logprob": "low"}], [{"logprob": -1.0, "piece": "text"}],
                         [{"logprob": -1.0, "special": 1}], [{"logprob": -1.0, "top_ids": [True]}],
                         [{"logprob": -1.0, "top_pieces": ["a"]}]],
}


def _wrong_cases() -> list[tuple[str, str, Any]]:
    cases = []
    for t, cls in MESSAGE_TYPES.items():
        hints = typing.get_type_hints(cls)
        for f in _fields(cls):
            tp, args = hints[f.name], typing.get_args(hints[f.name])
            nullable = type(None) in args
            base = next(a for a in args if a is not type(None)) if nullable else tp
            assert base in WRONG_VALUES, f"no wrong values for {t}.{f.name}: {tp}"
            cases += [(t, f.name, bad) for bad in WRONG_VALUES[base]]
            if not nullable:
                cases.append((t, f.name, None))
    return cases


WRONG = _wrong_cases()


@pytest.mark.parametrize(("msg_type", "field", "bad"), WRONG, ids=[f"{t}.{f}={b!r}" for t, f, b in WRONG])
def test_wrong_field_type(msg_type, field, bad):
    exc = _error([_header(msg_type, **{field: bad})])
    assert exc.code == "bad_message"
    assert field in str(exc)


INT_FIELDS = [(t, f.name) for t, cls in MESSAGE_TYPES.items() for f in _fields(cls)
              if typing.get_type_hints(cls)[f.name] in (int, int | None)]


@pytest.mark.parametrize(("msg_type", "field"), INT_FIELDS, ids=[f"{t}.{f}" for t, f in INT_FIELDS])
def test_bool_is_not_an_integer(msg_type, field):
    exc = _error([_header(msg_type, **{field: True})])
    assert "integer" in str(exc) and field in str(exc)


# ------------------------------------------------------------------------------- the messages' own range checks

RANGE_ERRORS = [
    ("draft", {"tokens": list(range(MAX_DRAFT_TOKENS + 1))}, "at most 64"),
    ("draft", {"tokens": [], "idle_rounds": -1}, "idle_rounds"),
    ("draft", {"tokens": [], "idle_rounds": MAX_IDLE_ROUNDS + 1}, "idle_rounds"),
    ("draft", {"tokens": [3], "idle_rounds": 2}, "idle_rounds"),
    ("draft", {"tokens": [3, 4], "parents": [-1]}, "parents"),  # one parent per token
    ("draft", {"tokens": [3, 4], "parents": [-1, 1]}, "parents"),  # a parent must come before its child
    ("draft", {"tokens": [3, 4], "parents": [-1, 2]}, "parents"),  # … and be a node index
    ("draft", {"tokens": [3, 4], "parents": [-2, 0]}, "parents"),
    ("draft", {"tokens": [3, 3], "parents": [-1, -1]}, "parents"),  # the same token twice under one parent
    ("draft", {"tokens": list(range(MAX_DRAFT_TOKENS + 1)), "parents": [-1] * (MAX_DRAFT_TOKENS + 1)}, "at most"),
    ("commit", {"drafted": -1}, "drafted"),
    ("commit", {"accepted": -1}, "accepted"),
    ("commit", {"threads": -2}, "threads"),
    ("commit", {"batch_sessions": -1}, "batch_sessions"),
    ("draft", {"stats": {"blocks": -1}}, "stats: blocks"),
    ("draft", {"stats": {"busy_s": float("nan")}}, "busy_s"),
    ("draft", {"stats": {"ceiling_tokens_per_second": float("inf")}}, "ceiling_tokens_per_second"),
    ("draft", {"stats": {"timing": {"step_s": -1.0}}}, "stats.timing: step_s"),
    ("draft", {"stats": {"plans": {"p": -2}}}, "plans"),
    ("draft", {"stats": {"plans": {f"p{i}": 1 for i in range(33)}}}, "plans"),
    ("draft", {"stats": {"plan_rates": {"p": [1, 2, 3]}}}, "plan_rates"),
    ("draft", {"stats": {"plan_rates": {"p": [1, 2, 3, float("inf")]}}}, "plan_rates"),
    ("draft", {"stats": {"plan_check": {"startup": "a", "realised_best": "b", "verdict": "maybe"}}}, "verdict"),
    ("draft", {"stats": {"dtype": "x" * 201}}, "dtype"),
    ("commit", {"verify_s": -0.5}, "verify_s"),
    ("commit", {"verify_s": float("nan")}, "verify_s"),
    ("state", {"end": -1}, "end"),
    ("session_start", {"prompt_len": 4}, "prompt_len"),
    ("session_start", {"prompt_len": -1}, "prompt_len"),
    ("session_start", {"decoding": -1}, "decoding"),
    ("welcome", {"vocab_size": 0}, "vocab_size"),
    ("welcome", {"threads": {"share": -1}}, "share"),
    ("hello", {"capabilities": {"needs_kv_layers": [0, -1]}}, "needs_kv_layers"),
    ("chunk", {"logprobs": []}, "one entry per token"),
    ("done", {"logprobs": [{"logprob": -1.0}]}, "one entry per token"),
    ("chunk", {"logprobs": [{"logprob": float("-inf")}]}, "logprob must be a finite number"),
    ("chunk", {"logprobs": [{"logprob": float("nan")}]}, "logprob must be a finite number"),
    ("chunk", {"logprobs": [{"logprob": 0.25}]}, "logprob must be a finite number <= 0"),
    ("chunk", {"logprobs": [{"logprob": -1.0, "top_ids": [2], "top_logprobs": [-1.0]}]}, "same length"),
    ("chunk", {"logprobs": [{"logprob": -1.0, "top_ids": list(range(21)), "top_logprobs": [-1.0] * 21,
                             "top_pieces": [b""] * 21}]}, "at most 20"),
    ("chunk", {"logprobs": [{"logprob": -1.0, "top_ids": [2], "top_logprobs": [float("-inf")],
                             "top_pieces": [b""]}]}, "top_logprobs must be finite"),
    ("chunk", {"logprobs": [{"logprob": -1.0, "piece": b"x" * 1025}]}, "at most 1024 bytes"),
]


@pytest.mark.parametrize(("msg_type", "fields", "words"), RANGE_ERRORS,
                         ids=[f"{t}:{f}"[:40] for t, f, _ in RANGE_ERRORS])
def test_out_of_range_fields_are_refused(msg_type, fields, words):
    exc = _error([_header(msg_type, **fields)])
    assert exc.code == "bad_message"
    assert words in str(exc)


def test_range_limits_themselves_are_allowed():
    assert len(decode([_header("draft", tokens=list(range(MAX_DRAFT_TOKENS)))]).tokens) == MAX_DRAFT_TOKENS
    assert decode([_header("draft", tokens=[], idle_rounds=MAX_IDLE_ROUNDS)]).idle_rounds == MAX_IDLE_ROUNDS
    wide = decode([_header("draft", tokens=list(range(MAX_DRAFT_TOKENS)), parents=[-1] * MAX_DRAFT_TOKENS)])
    assert wide.parents == [-1] * MAX_DRAFT_TOKENS
    assert decode([_header("draft", tokens=[], parents=[])]).parents == []
    assert decode([_header("session_start", prompt_len=3)]).prompt_len == 3
    assert decode([_header("commit", drafted=0, accepted=0, threads=0, verify_s=0.0)]).verify_s == 0.0


@pytest.mark.parametrize("given", [{}, {"prompt": "a", "token_ids": [1]}, {"prompt": "a", "messages": []},
                                   {"token_ids": [1], "prompt": "a", "messages": []}], ids=repr)
def test_generate_needs_exactly_one_prompt_form(given):
    exc = _error([_pack({"v": SCHEMA_VERSION, "type": "generate", "request_id": 41, "params": {}, **given})])
    assert exc.code == "bad_request" and exc.request_id == 41
    assert "exactly one" in str(exc)


def test_generate_messages_need_role_and_content():
    exc = _error([_pack({"v": SCHEMA_VERSION, "type": "generate", "request_id": 5, "params": {},
                         "messages": [{"role": "user"}]})])
    assert exc.code == "bad_request" and exc.request_id == 5 and "role, content" in str(exc)


@pytest.mark.parametrize("tenant", ["", "a\nb", "x" * (MAX_TENANT_CHARS + 1)], ids=["empty", "newline", "long"])
def test_a_bad_tenant_is_refused(tenant):
    exc = _error([_pack({"v": SCHEMA_VERSION, "type": "generate", "request_id": 6, "params": {}, "token_ids": [1],
                         "tenant": tenant})])
    assert exc.code == "bad_request" and exc.request_id == 6 and "tenant" in str(exc)
    assert decode([_pack({"v": SCHEMA_VERSION, "type": "generate", "request_id": 6, "params": {}, "token_ids": [1],
                          "tenant": "x" * MAX_TENANT_CHARS})]).tenant == "x" * MAX_TENANT_CHARS


def test_tensors_on_a_type_without_tensors_are_refused():
    frames = encode(_state(x=torch.zeros(2)))
    header = msgpack.unpackb(frames[0], raw=False)
    exc = _error([_pack({**header, "type": "ping"}), *frames[1:]])
    assert exc.code == "bad_message" and "no tensors" in str(exc)


def test_message_over_max_bytes_is_too_large():
    frames = encode(_state(x=torch.zeros(1000, dtype=torch.uint8)))
    total = sum(memoryview(f).nbytes for f in frames)
    assert decode(frames, max_bytes=total).tensors["x"].numel() == 1000  # the limit itself is allowed
    exc = _error(frames, max_bytes=total - 1)
    assert exc.code == "too_large"
    # the cap counts every frame, including ones that would be malformed anyway
    assert _error([_header(), b"\x00" * 100], max_bytes=50).code == "too_large"


def test_header_over_max_header_bytes_is_too_large():
    big = [_header("ping", pad="x" * MAX_HEADER_BYTES)]
    assert len(big[0]) > MAX_HEADER_BYTES
    assert _error(big).code == "too_large"
    # just under the cap is fine (and the unknown field is ignored)
    fits = [_header("ping", pad="x" * (MAX_HEADER_BYTES - 100))]
    assert len(fits[0]) <= MAX_HEADER_BYTES
    assert decode(fits) == Ping()


# ------------------------------------------------------------------------------------------ malformed inputs

MALFORMED: list[tuple[str, list[Any], str]] = [
    ("empty frame list", [], "bad_message"),
    ("empty header frame", [b""], "bad_message"),
    ("not msgpack", [b"\xc1\xc1\xc1"], "bad_message"),
    ("truncated msgpack", [_header()[:-2]], "bad_message"),
    ("trailing bytes after header", [_header() + b"\x00"], "bad_message"),
    ("json header", [b'{"v": 1, "type": "ping"}'], "bad_message"),
    ("int map key", [_pack({"v": SCHEMA_VERSION, "type": "ping", 5: 1})], "bad_message"),
    ("header is a list", [_pack([1, "ping"])], "bad_message"),
    ("header is a string", [_pack("ping")], "bad_message"),
    ("header is an int", [_pack(1)], "bad_message"),
    ("header is nil", [_pack(None)], "bad_message"),
    ("no version", [_pack({"type": "ping"})], "bad_version"),
    ("next version", [_pack({"v": SCHEMA_VERSION + 1, "type": "ping"})], "bad_version"),
    ("previous version", [_pack({"v": SCHEMA_VERSION - 1, "type": "ping"})], "bad_version"),
    ("version 0", [_pack({"v": 0, "type": "ping"})], "bad_version"),
    ("version as string", [_pack({"v": "1", "type": "ping"})], "bad_version"),
    ("no type", [_pack({"v": SCHEMA_VERSION})], "unknown_type"),
    ("unknown type", [_header("launch_missiles")], "unknown_type"),
    ("type nil", [_pack({"v": SCHEMA_VERSION, "type": None})], "unknown_type"),
    ("type as int", [_pack({"v": SCHEMA_VERSION, "type": 3})], "unknown_type"),
    ("type as bytes", [_pack({"v": SCHEMA_VERSION, "type": b"ping"})], "unknown_type"),
    ("type in wrong case", [_header("PING")], "unknown_type"),
    # tensor descriptors
    ("descriptor without frame", [_header(tensors=[{"name": "x", "dtype": "uint8", "shape": [1]}])], "bad_message"),
    ("frame without descriptor", [_header(), b"\x00"], "bad_message"),
    ("frame with empty descriptor list", [_header(tensors=[]), b""], "bad_message"),
    ("tensors is a map", [_header(tensors={"name": "x"}), b"\x00"], "bad_message"),
    ("tensors is nil", [_header(tensors=None)], "bad_message"),
    ("descriptor not a map", [_header(tensors=["x"]), b"\x00"], "bad_message"),
    ("descriptor name not str", [_header(tensors=[{"name": 5, "dtype": "uint8", "shape": [1]}]), b"\x00"],
     "bad_message"),
    ("descriptor without name", [_header(tensors=[{"dtype": "uint8", "shape": [1]}]), b"\x00"], "bad_message"),
    ("dtype float64", [_header(tensors=[{"name": "x", "dtype": "float64", "shape": [1]}]), b"\x00" * 8], "bad_message"),
    ("dtype bool", [_header(tensors=[{"name": "x", "dtype": "bool", "shape": [1]}]), b"\x00"], "bad_message"),
    ("dtype torch name", [_header(tensors=[{"name": "x", "dtype": "torch.uint8", "shape": [1]}]), b"\x00"],
     "bad_message"),
    ("dtype nil", [_header(tensors=[{"name": "x", "dtype": None, "shape": [1]}]), b"\x00"], "bad_message"),
    ("dtype int", [_header(tensors=[{"name": "x", "dtype": 3, "shape": [1]}]), b"\x00"], "bad_message"),
    ("negative dim", [_header(tensors=[{"name": "x", "dtype": "uint8", "shape": [-1]}]), b""], "bad_message"),
    ("negative dims cancel", [_header(tensors=[{"name": "x", "dtype": "uint8", "shape": [-2, -2]}]), b"\x00" * 4],
     "bad_message"),
    ("nine dims", [_header(tensors=[{"name": "x", "dtype": "uint8", "shape": [1] * 9}]), b"\x00"], "bad_message"),
    ("float dim", [_header(tensors=[{"name": "x", "dtype": "uint8", "shape": [1.0]}]), b"\x00"], "bad_message"),
    ("string dim", [_header(tensors=[{"name": "x", "dtype": "uint8", "shape": ["1"]}]), b"\x00"], "bad_message"),
    ("shape not a list", [_header(tensors=[{"name": "x", "dtype": "uint8", "shape": 1}]), b"\x00"], "bad_message"),
    ("shape missing", [_header(tensors=[{"name": "x", "dtype": "uint8"}]), b"\x00"], "bad_message"),
    ("too few bytes", [_header(tensors=[{"name": "x", "dtype": "float32", "shape": [2]}]), b"\x00" * 7], "bad_message"),
    ("too many bytes", [_header(tensors=[{"name": "x", "dtype": "int64", "shape": [2, 2]}]), b"\x00" * 33],
     "bad_message"),
    ("bytes for empty shape", [_header(tensors=[{"name": "x", "dtype": "uint8", "shape": [0, 3]}]), b"\x00"],
     "bad_message"),
    ("scalar without bytes", [_header(tensors=[{"name": "x", "dtype": "int32", "shape": []}]), b""], "bad_message"),
    ("bytes of the wrong dtype size", [_header(tensors=[{"name": "x", "dtype": "float16", "shape": [4]}]),
                                       b"\x00" * 4], "bad_message"),
]


@pytest.mark.parametrize(("frames", "code"), [(f, c) for _, f, c in MALFORMED], ids=[n for n, _, _ in MALFORMED])
def test_malformed_message_raises_protocol_error_with_code(frames, code):
    exc = _error(frames)
    assert exc.code == code, str(exc)
    assert isinstance(exc, ValueError)  # callers may catch ValueError too
    assert str(exc)


# ------------------------------------------------------------------------- request_id on errors (verifier replies)

REQUEST_ID_CASES = [
    ("bad version", {"v": 99, "type": "generate", "params": {}}, [], "bad_version"),
    ("unknown type", {"v": SCHEMA_VERSION, "type": "generat", "params": {}}, [], "unknown_type"),
    ("missing field", {"v": SCHEMA_VERSION, "type": "generate"}, [], "bad_message"),
    ("wrong field type", {"v": SCHEMA_VERSION, "type": "generate", "params": []}, [], "bad_message"),
    ("bad tensor", {"v": SCHEMA_VERSION, "type": "generate", "params": {},
                    "tensors": [{"name": "x", "dtype": "int32", "shape": [2]}]}, [b"\x00"], "bad_message"),
    ("cancel missing nothing but tensor count", {"v": SCHEMA_VERSION, "type": "cancel"}, [b"\x00"], "bad_message"),
]


@pytest.mark.parametrize(("header", "extra", "code"), [c[1:] for c in REQUEST_ID_CASES],
                         ids=[c[0] for c in REQUEST_ID_CASES])
def test_request_id_is_carried_on_protocol_error(header, extra, code):
    exc = _error([_pack({**header, "request_id": 41}), *extra])
    assert exc.code == code
    assert exc.request_id == 41
    # and the verifier can address its reply with it
    reply = decode(error_frames(str(exc), exc.code, request_id=exc.request_id))
    assert (reply.request_id, reply.code) == (41, code)


@pytest.mark.parametrize("request_id", [None, "41", 4.1, [41]])
def test_request_id_absent_or_not_an_int_is_none(request_id):
    header = {"v": 99, "type": "ping"}
    if request_id is not None:
        header["request_id"] = request_id
    assert _error([_pack(header)]).request_id is None


def test_bool_request_id_is_not_carried():
    """The schema rejects bools where ints are required, but decode() carries request_id=True onto the error."""
    exc = _error([_pack({"v": 99, "type": "cancel", "request_id": True})])
    assert exc.request_id is None, f"BUG: ProtocolError.request_id is {exc.request_id!r} for request_id=True"


def test_errors_before_the_header_is_read_have_no_request_id():
    assert _error([]).request_id is None
    assert _error([b"\xc1"]).request_id is None
    # an over-size message whose header is within its own cap still names its request (the error reaches it)
    assert _error([_header(request_id=5), b"\x00" * 64], max_bytes=32).request_id == 5
    # a header past its own 1 MiB cap too, read without being unpacked (issue 43): too_large with its id
    big = _error([_header(request_id=5, pad="x" * MAX_HEADER_BYTES)])
    assert big.code == "too_large" and big.request_id == 5
    assert _error([_header(request_id=5, pad="x" * MAX_HEADER_BYTES)], max_bytes=32).request_id == 5
    # where the id comes after a huge value, or a key is not a short string, it stays unknown (never built)
    assert _error([_pack({"pad": "x" * MAX_HEADER_BYTES, "v": 2, "type": "cancel", **{f"k{i}": i for i in range(8)},
                          "request_id": 5})]).request_id is None
    assert _error([_pack({b"x" * 40: 1, "request_id": 5, "pad": "x" * MAX_HEADER_BYTES})]).request_id is None


# ------------------------------------------------------------- bugs: non-ProtocolError escapes from decode()
# The verifier (verifier_node/server.py, _drain) only catches ProtocolError around decode(); anything else escapes
# the serving loop, so each of these one-frame messages from any client or drafter stops the verifier.


@pytest.mark.parametrize("msg_type", [[], [1], {}, {"a": 1}], ids=["empty-list", "list", "empty-map", "map"])
def test_unhashable_type_field_is_unknown_type(msg_type):
    exc = _error([_pack({"v": SCHEMA_VERSION, "type": msg_type, "request_id": 3})])
    assert exc.code == "unknown_type"


@pytest.mark.parametrize("dtype", [[], ["uint8"], {}], ids=["empty-list", "list", "map"])
def test_unhashable_dtype_is_protocol_error(dtype):
    _error([_header(tensors=[{"name": "x", "dtype": dtype, "shape": [1]}]), b"\x00"])


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**64 - 1], [0, 2**62, 2**62]],
                         ids=["2^63", "2^64-1", "2^62x2^62"])
def test_empty_tensor_with_huge_dims_is_protocol_error(shape):
    _error([_header(tensors=[{"name": "x", "dtype": "uint8", "shape": shape}]), b""])


@pytest.mark.parametrize("shape", [[True, 2], [2, False], [True]], ids=["true-2", "2-false", "true"])
def test_bool_dims_are_protocol_error(shape):
    numel = 1
    for s in shape:
        numel *= int(s)
    _error([_header(tensors=[{"name": "x", "dtype": "uint8", "shape": shape}]), b"\x00" * numel])


# ----------------------------------------------------------------------------------------------- no pickle

_UNPICKLED: list[str] = []


def _pickle_trap(marker: str) -> str:
    _UNPICKLED.append(marker)
    return marker


class _Trap:
    def __reduce__(self):
        return (_pickle_trap, ("unpickled!",))


def test_protocol_source_never_uses_pickle():
    source = Path(protocol.__file__).read_text()
    tree = ast.parse(source)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert not names & {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "eval", "exec"}
    # the word may appear in prose ("Nothing is ever pickled"), never in code
    code_lines = [line.split("#")[0] for line in source.splitlines() if "pickle" in line]
    assert all("import" not in line and "pickle." not in line for line in code_lines)


def test_pickled_payload_is_rejected_and_never_unpickled():
    _UNPICKLED.clear()
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        payload = pickle.dumps({"v": 1, "type": "ping", "trap": _Trap()}, protocol=proto)
        assert _error([payload]).code == "bad_message"
    # a pickle in a tensor frame is just bytes: it comes back as raw uint8, never as an object
    payload = pickle.dumps(_Trap())
    msg = decode([_header(tensors=[{"name": "x", "dtype": "uint8", "shape": [len(payload)]}]), payload])
    assert bytes(msg.tensors["x"].numpy()) == payload
    assert _UNPICKLED == []


# ------------------------------------------------------------------------------------------------- fuzzing

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
_dims = st.sampled_from([0, 1, 2, 3, -1, True, False, 2**31, 2**62, 2**63, 2**64 - 1])
_shapes = (
    st.lists(st.integers(min_value=0, max_value=4), max_size=3)
    | st.lists(_dims, max_size=9)
    | st.lists(_values, max_size=3)
    | _values
)
_specs = st.fixed_dictionaries(
    {},
    optional={
        "name": st.text(max_size=4) | _values,
        "dtype": st.sampled_from(sorted(DTYPES)) | _values,
        "shape": _shapes,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_fuzz_arbitrary_bytes_frames(frames):
    _decode_or_protocol_error(frames)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values, st.lists(st.binary(max_size=32), max_size=3))
def test_fuzz_arbitrary_msgpack_header(header, rest):
    _decode_or_protocol_error([_pack(header), *rest])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_fuzz_valid_headers_with_fuzzed_fields(data):
    msg_type = data.draw(st.sampled_from(sorted(MESSAGE_TYPES)))
    header: dict[str, Any] = {"v": SCHEMA_VERSION, "type": msg_type, **_wire(msg_type)}
    # replace, drop or add fields (including the reserved ones: v, type, tensors)
    keys = [*header, "tensors", "request_id", "extra"]
    for key in data.draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
        action = data.draw(st.sampled_from(["replace", "drop"]))
        if action == "drop":
            header.pop(key, None)
        else:
            header[key] = data.draw(_values)
    specs = data.draw(st.lists(_specs, max_size=3))
    if data.draw(st.booleans()):
        header["tensors"] = specs
    # data frames: usually the right sizes for well-formed specs, sometimes arbitrary
    frames: list[bytes] = []
    for spec in specs:
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if (
            data.draw(st.booleans())
            and isinstance(dtype, str)
            and dtype in DTYPES
            and isinstance(shape, list)
            and all(type(s) is int and 0 <= s <= 4 for s in shape)
        ):
            numel = 1
            for s in shape:
                numel *= s
            frames.append(b"\x01" * numel * torch.empty((), dtype=DTYPES[dtype]).element_size())
        else:
            frames.append(data.draw(st.binary(max_size=16)))
    frames = frames[: data.draw(st.integers(min_value=0, max_value=len(frames) + 1))]
    if len(frames) < len(specs) and data.draw(st.booleans()):
        frames.append(b"")
    msg = _decode_or_protocol_error([_pack(header), *frames])  # checks the decoded fields' types too
    if msg is not None:
        header = encode(msg)[0]  # a decoded message encodes back to itself (compared as bytes: NaN != NaN)
        assert encode(decode([header, *encode(msg)[1:]]))[0] == header
