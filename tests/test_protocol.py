"""Fast tests of shared.protocol: round trips, schema validation, error codes, fuzzing. No models, no nodes.

Malformed input of any shape must raise only :class:`ProtocolError` (what the nodes catch and answer).
"""

from __future__ import annotations

import ast
import pickle
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
    MAX_HEADER_BYTES,
    SCHEMA,
    SCHEMA_VERSION,
    Message,
    ProtocolError,
    decode,
    encode,
    error_frames,
)

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}

#: One valid set of fields per message type (required fields plus a few optional ones).
VALID_FIELDS: dict[str, dict[str, Any]] = {
    "hello": {
        "drafter_type": "assistant",
        "tokenizer_id": "qwen2.5",
        "capabilities": {"sends_q": True, "needs_hidden_states": False, "needs_kv_layers": []},
    },
    "welcome": {"target": "tiny", "vocab_size": 151936, "want_q": False, "capabilities": {"sends_q": True}},
    "session_start": {"session": 3, "token_ids": [1, 2, 3], "params": {"max_new_tokens": 8, "do_sample": False}},
    "draft": {"session": 3, "base_len": 10, "epoch": 0, "tokens": [4, 5, 6]},
    "commit": {"session": 3, "base_len": 10, "tokens": [4, 5], "new_len": 12, "accepted": 1},
    "state": {"session": 3, "base_len": 10, "end": 9},
    "session_end": {"session": 3},
    "heartbeat": {},
    "generate": {"request_id": 7, "params": {"temperature": 0.7, "seed": None}, "prompt": "héllo"},
    "chunk": {"request_id": 7, "token_ids": [1], "text": "é ✓"},
    "done": {
        "request_id": 7,
        "token_ids": [1, 2],
        "text": "ok",
        "metrics": {"rounds": 2, "acceptance_rate": 0.5},
        "finish_reason": "length",
    },
    "cancel": {"request_id": 7},
    "ping": {},
    "pong": {"drafter_connected": True, "drafter_type": "assistant", "target": "tiny", "sessions": 0},
    "error": {"message": "boom", "code": "bad_message", "request_id": 7},
}

#: For each Python type a schema field can require, values of the wrong type (bool where int is required included).
WRONG_VALUES: dict[type, list[Any]] = {
    int: ["7", 1.5, True, None, [7]],
    str: [5, b"bytes", None, ["a"]],
    list: ["abc", {}, 5, None],
    dict: [[], "x", 5, None],
    bool: [1, 0, "true", None],
}


def _pack(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _header(msg_type: str = "ping", **fields: Any) -> bytes:
    return _pack({"v": SCHEMA_VERSION, "type": msg_type, **fields})


def _error(frames: list[Any], **kwargs: Any) -> ProtocolError:
    """The ProtocolError decode raises; fails the test (as a bug) on any other outcome."""
    try:
        msg = decode(frames, **kwargs)
    except ProtocolError as exc:
        return exc
    except Exception as exc:
        pytest.fail(f"BUG: decode raised {type(exc).__name__}: {exc!s:.300} instead of ProtocolError")
    pytest.fail(f"decode accepted a malformed message: {msg!r:.300}")


def _decode_or_protocol_error(frames: list[Any]) -> Message | None:
    """The contract every input must satisfy: a Message, or a ProtocolError — never anything else."""
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        assert isinstance(exc.code, str) and exc.code
        return None
    except Exception as exc:
        pytest.fail(f"BUG: decode raised {type(exc).__name__}: {exc!s:.300} (only ProtocolError is allowed)")
    assert isinstance(msg, Message)
    assert msg.type in SCHEMA
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


# ------------------------------------------------------------------------------------------------ round trips


def test_valid_fields_cover_every_message_type():
    assert set(VALID_FIELDS) == set(SCHEMA)


@pytest.mark.parametrize("how", ["as_encoded", "bytes", "zmq_copy", "zmq_nocopy"])
@pytest.mark.parametrize("msg_type", sorted(SCHEMA))
def test_round_trip_every_type_with_every_dtype(msg_type, how, zmq_pair):
    tensors = _tensor_set()
    frames = encode(msg_type, tensors=tensors, **VALID_FIELDS[msg_type])
    assert len(frames) == 1 + len(tensors)
    msg = decode(_roundtrip_frames(frames, how, zmq_pair))
    assert msg.type == msg_type
    assert msg.fields == VALID_FIELDS[msg_type]  # v, type and tensors are not fields
    assert set(msg.tensors) == set(tensors)
    for name, tensor in tensors.items():
        _assert_same(msg.tensors[name], tensor)
    for key, value in VALID_FIELDS[msg_type].items():
        assert msg[key] == value
        assert msg.get(key) == value
    assert msg.get("not_there", 42) == 42


@pytest.mark.parametrize("how", ["bytes", "zmq_nocopy"])
@pytest.mark.parametrize("msg_type", sorted(SCHEMA))
def test_round_trip_without_tensors(msg_type, how, zmq_pair):
    frames = encode(msg_type, **VALID_FIELDS[msg_type])
    assert len(frames) == 1
    msg = decode(_roundtrip_frames(frames, how, zmq_pair))
    assert (msg.type, msg.fields, msg.tensors) == (msg_type, VALID_FIELDS[msg_type], {})


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_special_float_values_round_trip_bit_exact(name):
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-8, 65504.0], dtype=DTYPES[name])
    got = decode([memoryview(f).tobytes() for f in encode("ping", tensors={"x": t})]).tensors["x"]
    bits = torch.int32 if name == "float32" else torch.int16
    assert torch.equal(got.view(bits), t.view(bits))


def test_integer_extremes_round_trip():
    tensors = {
        name: torch.tensor([torch.iinfo(dt).min, torch.iinfo(dt).max, 0], dtype=dt)
        for name, dt in DTYPES.items()
        if not dt.is_floating_point
    }
    got = decode(encode("ping", tensors=tensors)).tensors
    for name, t in tensors.items():
        _assert_same(got[name], t)


def test_decoded_tensors_are_private_writable_copies():
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    frames = encode("ping", tensors={"x": src})
    got = decode(frames).tensors["x"]
    src.fill_(-1)  # the encoded frame shares memory with src; the decoded tensor must not
    assert torch.equal(got, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    got.add_(1)  # writable, no read-only buffer underneath
    assert got[0, 0].item() == 1.0


def test_tensor_header_describes_name_dtype_and_shape():
    frames = encode("ping", tensors={"q": torch.zeros(2, 3, dtype=torch.bfloat16)})
    header = msgpack.unpackb(frames[0], raw=False)
    assert header == {
        "v": SCHEMA_VERSION,
        "type": "ping",
        "tensors": [{"name": "q", "dtype": "bfloat16", "shape": [2, 3]}],
    }
    assert memoryview(frames[1]).nbytes == 2 * 3 * 2


def test_zero_dim_tensor_round_trip():
    """The wire format allows shape [] (decode accepts it), but encode cannot produce it for multi-byte dtypes."""
    try:
        frames = encode("ping", tensors={"s": torch.tensor(1.5), "i": torch.tensor(7, dtype=torch.int64)})
    except Exception as exc:
        pytest.fail(f"BUG: encode() of a 0-dim tensor raised {type(exc).__name__}: {exc}")
    got = decode(frames).tensors
    _assert_same(got["s"], torch.tensor(1.5))
    _assert_same(got["i"], torch.tensor(7, dtype=torch.int64))


def test_encode_rejects_unknown_type_and_unsendable_dtype():
    with pytest.raises(ValueError, match="unknown message type"):
        encode("nope")
    with pytest.raises(ValueError, match="cannot be sent"):
        encode("ping", tensors={"x": torch.zeros(2, dtype=torch.float64)})


def test_error_frames_round_trip():
    msg = decode(error_frames("it broke", "bad_version", request_id=9, session=None))
    assert msg.type == "error"
    assert msg.fields == {"message": "it broke", "code": "bad_version", "request_id": 9}
    msg = decode(error_frames("it broke", request_id=None))
    assert msg.fields == {"message": "it broke", "code": "error"}


# ------------------------------------------------------------------------------------------ malformed inputs

MALFORMED: list[tuple[str, list[Any], str]] = [
    ("empty frame list", [], "bad_message"),
    ("empty header frame", [b""], "bad_message"),
    ("not msgpack", [b"\xc1\xc1\xc1"], "bad_message"),
    ("truncated msgpack", [_header()[:-2]], "bad_message"),
    ("trailing bytes after header", [_header() + b"\x00"], "bad_message"),
    ("json header", [b'{"v": 1, "type": "ping"}'], "bad_message"),
    ("int map key", [_pack({"v": 1, "type": "ping", 5: 1})], "bad_message"),
    ("header is a list", [_pack([1, "ping"])], "bad_message"),
    ("header is a string", [_pack("ping")], "bad_message"),
    ("header is an int", [_pack(1)], "bad_message"),
    ("header is nil", [_pack(None)], "bad_message"),
    ("no version", [_pack({"type": "ping"})], "bad_version"),
    ("version 2", [_pack({"v": 2, "type": "ping"})], "bad_version"),
    ("version 0", [_pack({"v": 0, "type": "ping"})], "bad_version"),
    ("version as string", [_pack({"v": "1", "type": "ping"})], "bad_version"),
    ("no type", [_pack({"v": 1})], "unknown_type"),
    ("unknown type", [_header("launch_missiles")], "unknown_type"),
    ("type nil", [_pack({"v": 1, "type": None})], "unknown_type"),
    ("type as int", [_pack({"v": 1, "type": 3})], "unknown_type"),
    ("type as bytes", [_pack({"v": 1, "type": b"ping"})], "unknown_type"),
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


REQUIRED = [(t, f) for t, fields in SCHEMA.items() for f in fields]


@pytest.mark.parametrize(("msg_type", "field"), REQUIRED, ids=[f"{t}.{f}" for t, f in REQUIRED])
def test_missing_required_field(msg_type, field):
    fields = {k: v for k, v in VALID_FIELDS[msg_type].items() if k != field}
    exc = _error(encode(msg_type, **fields))
    assert exc.code == "bad_message"
    assert field in str(exc) and "missing" in str(exc)


WRONG = [
    (t, f, bad)
    for t, fields in SCHEMA.items()
    for f, expected in fields.items()
    for bad in WRONG_VALUES[expected]  # type: ignore[index]
]


@pytest.mark.parametrize(("msg_type", "field", "bad"), WRONG, ids=[f"{t}.{f}={b!r}" for t, f, b in WRONG])
def test_wrong_field_type(msg_type, field, bad):
    exc = _error(encode(msg_type, **{**VALID_FIELDS[msg_type], field: bad}))
    assert exc.code == "bad_message"
    assert field in str(exc)


@pytest.mark.parametrize("field", ["request_id", "session", "vocab_size", "base_len", "epoch", "new_len"])
def test_bool_is_not_an_integer(field):
    msg_type = next(t for t, fields in SCHEMA.items() if fields.get(field) is int)
    exc = _error(encode(msg_type, **{**VALID_FIELDS[msg_type], field: True}))
    assert "integer" in str(exc)


def test_extra_fields_are_kept_not_rejected():
    msg = decode(encode("ping", anything={"nested": [1, 2]}, flag=True))
    assert msg.fields == {"anything": {"nested": [1, 2]}, "flag": True}


def test_message_over_max_bytes_is_too_large():
    frames = encode("ping", tensors={"x": torch.zeros(1000, dtype=torch.uint8)})
    total = sum(memoryview(f).nbytes for f in frames)
    assert decode(frames, max_bytes=total).tensors["x"].numel() == 1000  # the limit itself is allowed
    exc = _error(frames, max_bytes=total - 1)
    assert exc.code == "too_large"
    # the cap counts every frame, including ones that would be malformed anyway
    assert _error([_header(), b"\x00" * 100], max_bytes=50).code == "too_large"


def test_header_over_max_header_bytes_is_too_large():
    big = encode("ping", pad="x" * MAX_HEADER_BYTES)
    assert memoryview(big[0]).nbytes > MAX_HEADER_BYTES
    assert _error(big).code == "too_large"
    # just under the cap is fine
    fits = encode("ping", pad="x" * (MAX_HEADER_BYTES - 100))
    assert memoryview(fits[0]).nbytes <= MAX_HEADER_BYTES
    assert decode(fits).fields["pad"].startswith("xxx")


# ------------------------------------------------------------------------- request_id on errors (verifier replies)

REQUEST_ID_CASES = [
    ("bad version", {"v": 99, "type": "generate", "params": {}}, [], "bad_version"),
    ("unknown type", {"v": 1, "type": "generat", "params": {}}, [], "unknown_type"),
    ("missing field", {"v": 1, "type": "generate"}, [], "bad_message"),
    ("wrong field type", {"v": 1, "type": "generate", "params": []}, [], "bad_message"),
    ("bad tensor", {"v": 1, "type": "generate", "params": {},
                    "tensors": [{"name": "x", "dtype": "int32", "shape": [2]}]}, [b"\x00"], "bad_message"),
    ("cancel missing nothing but tensor count", {"v": 1, "type": "cancel"}, [b"\x00"], "bad_message"),
]


@pytest.mark.parametrize(("header", "extra", "code"), [c[1:] for c in REQUEST_ID_CASES],
                         ids=[c[0] for c in REQUEST_ID_CASES])
def test_request_id_is_carried_on_protocol_error(header, extra, code):
    exc = _error([_pack({**header, "request_id": 41}), *extra])
    assert exc.code == code
    assert exc.request_id == 41
    # and the verifier can address its reply with it
    reply = decode(error_frames(str(exc), exc.code, request_id=exc.request_id))
    assert (reply["request_id"], reply["code"]) == (41, code)


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
    assert _error([_header(request_id=5), b"\x00" * 64], max_bytes=32).request_id is None


# ------------------------------------------------------------- bugs: non-ProtocolError escapes from decode()
# The verifier (verifier_node/server.py, _drain) only catches ProtocolError around decode(); anything else escapes
# the serving loop, so each of these one-frame messages from any client or drafter stops the verifier.


@pytest.mark.parametrize("msg_type", [[], [1], {}, {"a": 1}], ids=["empty-list", "list", "empty-map", "map"])
def test_unhashable_type_field_is_unknown_type(msg_type):
    exc = _error([_pack({"v": 1, "type": msg_type, "request_id": 3})])
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
    msg_type = data.draw(st.sampled_from(sorted(SCHEMA)))
    header: dict[str, Any] = {"v": SCHEMA_VERSION, "type": msg_type, **VALID_FIELDS[msg_type]}
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
    msg = _decode_or_protocol_error([_pack(header), *frames])
    if msg is not None:
        for name, expected in SCHEMA[msg.type].items():
            assert name in msg.fields
            assert isinstance(msg.fields[name], expected)
            if expected is int:
                assert not isinstance(msg.fields[name], bool)
