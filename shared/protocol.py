"""Wire protocol shared by the verifier, the drafters and the clients.

A message is a list of ZeroMQ frames: one msgpack header followed by zero or more raw tensor frames. The header
carries the schema version, the message type, the message fields and, for each tensor frame, its name, dtype and
shape. Nothing is ever pickled; every decoded message is checked against the schema below (known type, required
fields with the right types, tensor sizes that match their shapes, a total size under a cap), and anything else
raises :class:`ProtocolError`, which a node turns into an ``error`` reply before it goes on serving.

Message types (``type`` field) and who sends them:

=================  ===============  ============================================================================
type               direction        fields
=================  ===============  ============================================================================
hello              drafter → verif  drafter_type, tokenizer_id, capabilities{sends_q, greedy_q,
                                    needs_hidden_states, needs_kv_layers}; optional profile (shared.costs
                                    NodeProfile dict, validated), threads{share, full}
welcome            verif → drafter  target (model name), vocab_size, want_q (send q with every draft, greedy
                                    requests included: the verifier runs ensemble verification); optional
                                    profile, threads{share, full} (the verifier's cost curves)
session_start      verif → drafter  session, token_ids (whole committed prefix), params (GenerationParams dict)
draft              drafter → verif  session, base_len, epoch, tokens[k]; tensors q_idx/q_prob (sparse q) or q (dense);
                                    optional idle_rounds (k = 0: step alone this many rounds), overlap, stats
commit             verif → drafter  session, base_len, tokens[n+1], new_len, drafted, accepted, verify_s, threads;
                                    tensors: extras
state              verif → drafter  session, base_len, end; tensors: extras for positions before ``end`` (a part of a
                                    session_start's state too large for one message, in position order)
session_end        verif → drafter  session
heartbeat          drafter → verif  (liveness while idle)
generate           client → verif   request_id, token_ids | prompt | messages, params
chunk              verif → client   request_id, token_ids (new committed tokens), text (new text)
done               verif → client   request_id, token_ids (all new tokens), text, metrics, finish_reason
cancel             client → verif   request_id
ping / pong        client ↔ verif   pong: drafter_connected, drafter_type, target, sessions
error              any              request_id or session (when known), message, code
=================  ===============  ============================================================================

Capabilities: ``sends_q`` — sampled drafts come with the distribution they were drawn from; ``greedy_q`` — when
the welcome says ``want_q``, greedy drafts come with q too: the drafter's softmax over its processed scores,
truncated to its top-m tokens and not renormalised (``q_idx``/``q_prob``; tokens left out count as q = 0), or the
full row when m = 0. A verifier with ensemble verification refuses a drafter without ``sends_q`` (error code
``ensemble_needs_q``) and greedy requests while its drafter lacks ``greedy_q`` (``bad_request``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

SCHEMA_VERSION = 1

#: Default cap on the total bytes of one message (header + tensor frames). Configurable per node.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Cap on the header frame alone; headers are small, a huge one is an attack or a bug.
MAX_HEADER_BYTES = 1024 * 1024
#: ``tokenizer_id`` of a drafter that only copies token ids (prompt lookup): it fits any target tokenizer.
ANY_TOKENIZER = "any"
#: Largest size of one tensor dimension (keeps shape arithmetic far from overflow).
MAX_DIM = 2**31

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}

# Required header fields per message type, with the Python types they must have. Optional fields are not listed;
# handlers read them with defaults. ``int`` fields reject bools (msgpack keeps them apart, Python does not).
_LIST = list
SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"drafter_type": str, "tokenizer_id": str, "capabilities": dict},
    "welcome": {"target": str, "vocab_size": int, "want_q": bool},
    "session_start": {"session": int, "token_ids": _LIST, "params": dict},
    "draft": {"session": int, "base_len": int, "epoch": int, "tokens": _LIST},
    "commit": {"session": int, "base_len": int, "tokens": _LIST, "new_len": int},
    "state": {"session": int, "base_len": int, "end": int},
    "session_end": {"session": int},
    "heartbeat": {},
    "generate": {"request_id": int, "params": dict},
    "chunk": {"request_id": int, "token_ids": _LIST, "text": str},
    "done": {"request_id": int, "token_ids": _LIST, "text": str, "metrics": dict, "finish_reason": str},
    "cancel": {"request_id": int},
    "ping": {},
    "pong": {"drafter_connected": bool},
    "error": {"message": str},
}


def state_row_axis(name: str) -> int:
    """The position axis of a state tensor (``extras``): ``hidden`` [rows, hidden], ``kv.{layer}`` [2, heads, rows,
    head_dim]. Every state tensor's rows are the last positions before the message's ``end``."""
    return 2 if name.startswith("kv.") else 0


def split_state(
    tensors: dict[str, torch.Tensor], end: int, budget: int
) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Cut state tensors whose rows end at position ``end`` into ``(end_i, part)`` pieces of at most about
    ``budget`` bytes each (at least one position per piece), in position order."""
    first = min((end - t.shape[state_row_axis(n)] for n, t in tensors.items()), default=end)
    per_position = sum(t[(slice(None),) * state_row_axis(n) + (slice(0, 1),)].numel() * t.element_size()
                       for n, t in tensors.items())
    step = max(1, budget // max(per_position, 1))
    pieces = []
    for lo in range(first, end, step):
        hi = min(end, lo + step)
        part = {}
        for name, t in tensors.items():
            axis, start = state_row_axis(name), end - t.shape[state_row_axis(name)]
            a, b = max(lo, start) - start, hi - start
            if b > a:
                part[name] = t.narrow(axis, a, b - a)
        pieces.append((hi, part))
    return pieces


class ProtocolError(ValueError):
    """A message that does not follow the schema. ``code`` is a short machine-readable reason."""

    def __init__(self, message: str, code: str = "bad_message", request_id: int | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


@dataclass
class Message:
    """A decoded message: its type, header fields and named tensors."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def encode(msg_type: str, tensors: dict[str, torch.Tensor] | None = None, **fields: Any) -> list[Any]:
    """Encode a message into frames: a msgpack header then one raw buffer per tensor (no copy for CPU tensors)."""
    if msg_type not in SCHEMA:
        raise ValueError(f"unknown message type {msg_type!r}")
    if {"v", "type", "tensors"} & fields.keys():
        raise ValueError("v, type and tensors are reserved header keys")
    specs = []
    buffers: list[Any] = []
    for name, tensor in (tensors or {}).items():
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be sent")
        specs.append({"name": name, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)})
        # A uint8 view shares memory with t; numpy exposes it to ZeroMQ as a buffer without copying.
        buffers.append(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    header = {"v": SCHEMA_VERSION, "type": msg_type, "tensors": specs, **fields}
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def _check_type(name: str, value: Any, expected: type | tuple[type, ...]) -> None:
    if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ProtocolError(f"field {name!r} must be an integer")
    if not isinstance(value, expected):
        names = expected.__name__ if isinstance(expected, type) else "/".join(t.__name__ for t in expected)
        raise ProtocolError(f"field {name!r} must be {names}, got {type(value).__name__}")


def decode(frames: list[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate frames (bytes or zmq.Frame). Raises :class:`ProtocolError` on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    raw = [memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames]
    total = sum(r.nbytes for r in raw)
    if total > max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {max_bytes}", code="too_large")
    if raw[0].nbytes > MAX_HEADER_BYTES:
        raise ProtocolError("header frame too large", code="too_large")
    try:
        header = msgpack.unpackb(raw[0], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a map")
    rid = header.get("request_id")
    request_id = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    version = header.pop("v", None)
    if version != SCHEMA_VERSION:
        raise ProtocolError(
            f"unsupported schema version {version!r} (this node speaks {SCHEMA_VERSION})",
            code="bad_version",
            request_id=request_id,
        )
    msg_type = header.pop("type", None)
    if not isinstance(msg_type, str) or msg_type not in SCHEMA:
        raise ProtocolError(f"unknown message type {msg_type!r}", code="unknown_type", request_id=request_id)
    specs = header.pop("tensors", [])
    try:
        for name, expected in SCHEMA[msg_type].items():
            if name not in header:
                raise ProtocolError(f"{msg_type}: missing field {name!r}")
            _check_type(name, header[name], expected)
        tensors = _decode_tensors(specs, raw[1:])
    except ProtocolError as exc:
        exc.request_id = request_id
        raise
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:  # last line of defence: never crash a node
        raise ProtocolError(f"malformed {msg_type} message: {exc}", request_id=request_id) from None
    return Message(msg_type, header, tensors)


def _decode_tensors(specs: Any, buffers: list[memoryview]) -> dict[str, torch.Tensor]:
    if not isinstance(specs, list) or len(specs) != len(buffers):
        raise ProtocolError("tensor descriptors do not match the number of data frames")
    tensors = {}
    for spec, buf in zip(specs, buffers):
        if not isinstance(spec, dict):
            raise ProtocolError("tensor descriptor must be a map")
        name, dtype_name, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
        if not isinstance(name, str) or not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
            raise ProtocolError(f"bad tensor descriptor {spec!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < MAX_DIM for s in shape)
        ):
            raise ProtocolError(f"tensor {name!r}: bad shape {shape!r}")
        dtype = _DTYPES[dtype_name]
        numel = 1
        for s in shape:
            numel *= s
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if buf.nbytes != expected:
            raise ProtocolError(f"tensor {name!r}: {buf.nbytes} bytes for shape {shape} of {dtype_name}")
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            # bytearray copies once into memory torch may own (ZeroMQ buffers are read-only).
            tensors[name] = torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)
    return tensors


def error_frames(message: str, code: str = "error", **fields: Any) -> list[Any]:
    """Frames of an ``error`` reply."""
    return encode("error", message=message, code=code, **{k: v for k, v in fields.items() if v is not None})
