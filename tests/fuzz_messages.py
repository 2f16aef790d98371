"""Seeded mutations of protocol messages, for the fuzz test (tests/test_fuzz.py).

``samples()`` gives one valid instance of every type in ``MESSAGE_TYPES``, every optional field set (so that removing
any field is a mutation too) and tensors where the type carries them. ``Mutator(seed).mutate(msg)`` returns the
frames of one mutated message: a field of it (nested fields, generate's ``params`` keys and chat turns included) set
to a value of the wrong type, a huge/negative/NaN/inf number, a very long list or string, or removed; or the header as
a whole (unknown type, bad version, extra fields, not a map, non-string keys); or the frames (garbage bytes, truncated
msgpack, extra frames, tensor descriptors with the wrong dtype, shape or byte count). The same seed gives the same
messages, so a failure reproduces.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import msgpack
import torch

from shared.protocol import (
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
    Pong,
    SessionEnd,
    SessionStart,
    State,
    ThreadCounts,
    Welcome,
)

#: Values of the wrong type or out of range, for any field.
WEIRD: list[Any] = [
    None, True, False, "x", "", "ü" * 3, b"\x00\xff", [], [1, 2], [None], ["a"], {}, {"a": 1}, {"role": 1},
    0, -1, 1, 2, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, -0.0, 1e-30, 1e-300, 5e-324, 1e30, 1e308,
    math.nan, math.inf, -math.inf, [[[[1]]]], {"k": [None, {"x": math.nan}]},
]


def _long_values() -> list[Any]:
    return [list(range(5000)), [2**63 - 1] * 300, "x" * 20_000, [{"role": "user", "content": "x"}] * 500,
            {f"k{i}": i for i in range(500)}]


def generation_params(sample: bool = True) -> dict[str, Any]:
    """Every generate parameter, set, with small budgets (valid requests finish in a few rounds)."""
    return {"max_new_tokens": 3, "do_sample": sample, "temperature": 0.8, "top_k": 20, "top_p": 0.9,
            "repetition_penalty": 1.1, "min_new_tokens": 1, "eos_token_ids": [0], "stop_token_ids": [1], "seed": 7}


def samples(vocab: int = 160, session: int = 1, base_len: int = 5, request_id: int = 1,
            run_secret: str = "not-this-run") -> list[Message]:
    """One valid message of every type (several forms of ``generate``), optional fields set."""
    k, m, hidden = 2, 3, 64
    q_idx = torch.randint(0, vocab, (k, m))
    q_prob = torch.full((k, m), 0.2)
    caps = Capabilities(sends_q=True, greedy_q=True, needs_hidden_states=False, needs_kv_layers=[])
    threads = ThreadCounts(share=1, full=2)
    state = {"hidden": torch.zeros(2, hidden)}
    params = generation_params()
    return [
        Hello(drafter_type="fuzz", tokenizer_id="any", capabilities=caps, profile=None, threads=threads, host="h",
              run_secret=run_secret),
        Welcome(target="t", vocab_size=vocab, want_q=False, profile=None, threads=threads),
        SessionStart(session=session, token_ids=[5, 6, 7], params=params, prompt_len=2, tensors=state),
        Draft(session=session, base_len=base_len, tokens=[3, 4], idle_rounds=0, overlap=True,
              sent_at=1.0, stats=DrafterStats(busy_s=0.1, blocks=1, plans={"sync": 1}, dtype="float32",
                                             timing=DrafterTiming(step_s=0.05, roundtrips=1),
                                             plan_rates={"sync k=2": [1, 3, 0.5, 5.0]}),
              tensors={"q_idx": q_idx, "q_prob": q_prob}),
        Draft(session=session, base_len=base_len, tokens=[3, 4], tensors={"q": torch.full((k, vocab),
                                                                                                 1 / vocab)}),
        Draft(session=session, base_len=base_len, tokens=[], idle_rounds=4),
        Draft(session=session, base_len=base_len, tokens=[3, 4, 5], parents=[-1, -1, 0]),
        Commit(session=session, base_len=base_len, tokens=[1, 2], drafted=1, accepted=1,
               verify_s=0.01, threads=1, tensors=state),
        State(session=session, base_len=base_len, end=3, tensors=state),
        SessionEnd(session=session),
        Heartbeat(),
        Generate(request_id=request_id, params=params, token_ids=[5, 17, 33]),
        Generate(request_id=request_id, params=generation_params(False), prompt="def add(a, b):"),
        Generate(request_id=request_id, params=params, messages=[{"role": "user", "content": "hi"}]),
        Generate(request_id=request_id, params=params, token_ids=[7, 8], drafter_type="assistant"),
        Chunk(request_id=request_id, token_ids=[1], text="a"),
        Done(request_id=request_id, token_ids=[1], text="a", metrics={"rounds": 1}, finish_reason="stop"),
        Cancel(request_id=request_id),
        Ping(),
        Pong(drafter_connected=True, drafter_type="x", target="t", sessions=1,
             drafters=[{"id": 1, "type": "x", "host": "h", "sessions": 0, "alive": True}]),
        Error(message="m", code="c", request_id=request_id, session=session),
    ]


def field_paths(header: dict[str, Any]) -> list[tuple]:
    """Paths of every field of a header, nested ones included (``("params", "top_p")``, ``("messages", 0,
    "role")``), the codec's own keys (v, type, tensors) left to the header and tensor mutations."""
    paths: list[tuple] = []
    for key, value in header.items():
        if key in ("v", "type", "tensors"):
            continue
        paths.append((key,))
        if isinstance(value, dict):
            paths += [(key, inner) for inner in value]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            paths += [(key, 0, inner) for inner in value[0]]
    return paths


class Mutator:
    """Seeded mutations; ``mutate(msg)`` -> (frames, what was done)."""

    def __init__(self, seed: int, max_bytes: int):
        self.rng = random.Random(seed)
        self.max_bytes = max_bytes
        self.long = _long_values()

    def value(self) -> Any:
        rng = self.rng
        return rng.choice(self.long) if rng.random() < 0.04 else rng.choice(WEIRD)

    def mutate(self, msg: Message) -> tuple[list[bytes], str]:
        from shared.protocol import encode

        frames = [bytes(f) for f in encode(msg)]
        header = msgpack.unpackb(frames[0], raw=False)
        rng = self.rng
        r = rng.random()
        paths = field_paths(header)
        if r < 0.55 and paths:
            path = rng.choice(paths)
            if rng.random() < 0.2:
                _delete(header, path)
                what = f"delete {'.'.join(map(str, path))}"
            else:
                v = self.value()
                _set(header, path, v)
                what = f"set {'.'.join(map(str, path))} = {_short(v)}"
            return [_pack(header), *frames[1:]], what
        if r < 0.62:
            header["type"] = rng.choice(["explode", "", "HELLO", 7, None, ["draft"], "draft\x00"])
            return [_pack(header), *frames[1:]], f"type {header['type']!r}"
        if r < 0.68:
            header["v"] = rng.choice([SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, -1, 2**64 - 1, "1", 1.0, None, True,
                                      [1]])
            return [_pack(header), *frames[1:]], f"version {header['v']!r}"
        if r < 0.72:
            header[rng.choice(["extra", "zz", "profile", "threads", "stats", "sent_at"])] = self.value()
            return [_pack(header), *frames[1:]], "extra or optional field"  # unknown keys are ignored by design
        if r < 0.76:
            choice = rng.randrange(4)
            if choice == 0:
                return [msgpack.packb([1, 2, 3])], "header not a map"
            if choice == 1:
                return [msgpack.packb({1: 2, "v": SCHEMA_VERSION, "type": msg.TYPE})], "int key"
            if choice == 2:
                return [msgpack.packb({b"v": SCHEMA_VERSION, b"type": msg.TYPE.encode()}, use_bin_type=True)], \
                    "bytes keys"
            return [b""], "empty frame"
        if r < 0.82:
            size = rng.choice([1, 7, 64, 1000])
            return [rng.randbytes(size)], f"garbage {size} bytes"
        if r < 0.88:
            cut = rng.randrange(1, max(2, len(frames[0])))
            return [frames[0][:cut], *frames[1:]], f"truncated header at {cut}"
        if r < 0.92:
            extra = [rng.randbytes(rng.choice([0, 1, 8, 64])) for _ in range(rng.randint(1, 3))]
            return [*frames, *extra], f"{len(extra)} extra frames"
        if r < 0.995 and header.get("tensors"):
            return self._tensor(header, frames)
        if r < 0.995:
            return [_pack(header), *frames[1:], b"\x00" * 16], "tensor frame on a message without tensors"
        return [frames[0], b"\x00" * (self.max_bytes + 1)], "oversized"

    def _tensor(self, header: dict[str, Any], frames: list[bytes]) -> tuple[list[bytes], str]:
        rng = self.rng
        descriptors = header["tensors"]
        i = rng.randrange(len(descriptors))
        d = descriptors[i]
        data = list(frames[1:])
        kind = rng.randrange(8)
        if kind == 0:
            d["dtype"] = rng.choice(["float64", "int8", "bool", "", 3, None, "float16", "int64"])
        elif kind == 1:
            d["shape"] = rng.choice([[-1], [2**40], [1] * 9, "x", None, [1.5], [0], [3, 0, 2], [10**6, 10**6],
                                     [*d["shape"], 1], d["shape"][::-1]])
        elif kind == 2:
            data[i] = data[i][:-1] if data[i] and rng.random() < 0.5 else data[i] + b"\x00"
        elif kind == 3:
            del data[i]
        elif kind == 4:
            d["name"] = rng.choice([None, 3, "", "q", "kv.0", "hidden", "x" * 300])
        elif kind == 5:
            header["tensors"] = rng.choice([None, "x", {}, [1], [None]])
        elif kind == 6:  # same byte count, other values: NaN / negative probabilities, huge indices
            t = torch.frombuffer(bytearray(data[i]), dtype=_dtype(d["dtype"])) if data[i] else None
            if t is not None:
                t.fill_(rng.choice([math.nan, -1.0, math.inf, 2**30]) if t.is_floating_point()
                        else rng.choice([-1, 2**30, -(2**31)]))
                data[i] = bytes(t.numpy().tobytes())
        else:
            del d["shape"]
        return [_pack(header), *data], f"tensor {i} mutation {kind}"


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int32": torch.int32,
            "int64": torch.int64, "uint8": torch.uint8}[name]


def _pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _container(header: dict[str, Any], path: tuple) -> Any:
    node = header
    for key in path[:-1]:
        node = node[key]
    return node


def _set(header: dict[str, Any], path: tuple, value: Any) -> None:
    node = _container(header, path)
    node[path[-1]] = copy.deepcopy(value)


def _delete(header: dict[str, Any], path: tuple) -> None:
    node = _container(header, path)
    del node[path[-1]]


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) < 40 else text[:37] + "..."
