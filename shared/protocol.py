"""Wire protocol shared by the verifier, the drafters and the clients: one typed message class per message type,
the codec, and every limit both sides must agree on.

A message is a list of ZeroMQ frames: one msgpack header followed by zero or more raw tensor frames. The header
carries the schema version ``v``, the message ``type``, the message's fields and, for each tensor frame, its name,
dtype and shape. Nothing is ever pickled.

Each message type is a dataclass below (:class:`Draft`, :class:`Commit`, …) with its wire name (``TYPE``), who
sends it (``DIRECTION``), typed fields (required ones first, optional ones with their defaults) and, where the type
carries tensors, ``tensors``. ``encode(msg)`` turns an instance into frames; ``decode(frames, max_bytes)`` checks
the frames against the class and returns an instance: a known version and type, every required field present, every
field of its annotated type (``int`` rejects bools, ``float`` accepts ints and gives a float, list elements and
nested structures such as :class:`Capabilities`, :class:`ThreadCounts` and :class:`DrafterStats` are checked too),
missing optional fields filled with their defaults, tensor sizes that match their shapes, a total size under a cap,
and the message's own range checks (``validate()``: a draft's length, ``idle_rounds`` and ``stats``, non-negative
counts). Anything else raises :class:`ProtocolError`, which a node turns into an ``error`` reply before it goes on
serving. **Unknown extra header fields are ignored** (not an error, not kept): a newer peer may add optional fields
without breaking an older one. Checks that need a node's state (token ids below the vocabulary size, a matching
``base_len``) stay in the nodes.

The message types, their fields and the limits are listed in docs/protocol.md, generated from the classes below
(``python -m shared.protocol_doc --write``; the comment next to a field is its description there).

Capabilities: ``sends_q`` — sampled drafts come with the distribution they were drawn from; ``greedy_q`` — when
the welcome says ``want_q``, greedy drafts come with q too: the drafter's softmax over its processed scores,
truncated to its top-m tokens and not renormalised (``q_idx``/``q_prob``; tokens left out count as q = 0), or the
full row when m = 0. A verifier with ensemble verification refuses a drafter without ``sends_q`` (error code
``ensemble_needs_q``) and greedy requests while its drafter lacks ``greedy_q`` (``bad_request``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import torch

from shared.chat_tools import ChatError, check_messages, check_tools
from shared.sampling import MAX_DRAFT_TOKENS
from shared.tree_shape import validate_tree_shape

SCHEMA_VERSION = 2

# ----------------------------------------------------------------------------------------------------- limits
#: Default cap on the total bytes of one message (header + tensor frames). Configurable per node
#: (``verifier.max_message_bytes``).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Cap on the header frame alone; headers are small, a huge one is an attack or a bug.
MAX_HEADER_BYTES = 1024 * 1024
#: Longest run of rounds one draft may ask the verifier to take alone (``draft.idle_rounds``).
MAX_IDLE_ROUNDS = 1024
#: Largest size of one tensor dimension (keeps shape arithmetic far from overflow).
MAX_DIM = 2**31
#: Longest ``hello.host`` (a hostname) a verifier accepts.
MAX_HOST_CHARS = 255
#: Longest text field of a :class:`StartReport` (a dtype's reason, a schedule's name).
MAX_REPORT_CHARS = 200
#: Most start-up reports one pong lists (one per live drafter).
MAX_REPORTS = 256
#: Longest ``generate.tenant`` / ``session_start.tenant`` (a tenant name, or the verifier's opaque id of one).
MAX_TENANT_CHARS = 128
#: Most plan names one draft's ``stats`` lists in ``plans`` and in ``plan_rates`` each.
MAX_PLAN_NAMES = 32
#: Longest plan name in a draft's ``stats`` (``overlap k=5 rows=3``).
MAX_PLAN_NAME_CHARS = 64
#: Most alternatives one token's log probabilities list (``chunk.logprobs[i].top_ids``; = shared.sampling's bound).
MAX_TOP_LOGPROBS = 20
#: Longest byte form of one token a chunk's log probabilities carry (``piece``, ``top_pieces``).
MAX_PIECE_BYTES = 1024
#: ``tokenizer_id`` of a drafter that only copies token ids (prompt lookup): it fits any target tokenizer.
ANY_TOKENIZER = "any"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_ITEM_SIZES = {name: torch.empty((), dtype=dt).element_size() for name, dt in _DTYPES.items()}


class ProtocolError(ValueError):
    """A message that does not follow the schema. ``code`` is a short machine-readable reason."""

    def __init__(self, message: str, code: str = "bad_message", request_id: int | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


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


# ------------------------------------------------------------------------------------- field specs (built once)
_MISSING = object()
Check = Callable[[str, Any], Any]  # (field path, wire value) -> Python value, or raises ProtocolError


def _wrong(path: str, what: str, value: Any) -> ProtocolError:
    return ProtocolError(f"field {path!r} must be {what}, got {type(value).__name__}")


def _check_int(path: str, v: Any) -> int:
    if type(v) is not int:  # bool is a subclass of int; msgpack keeps them apart, so must we
        raise _wrong(path, "an integer", v)
    return v


def _check_float(path: str, v: Any) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)
    raise _wrong(path, "a number", v)


def _check_str(path: str, v: Any) -> str:
    if type(v) is not str:
        raise _wrong(path, "a string", v)
    return v


def _check_bytes(path: str, v: Any) -> bytes:
    if type(v) is not bytes:  # msgpack's bin type (use_bin_type on both sides): never a str
        raise _wrong(path, "bytes", v)
    return v


def _check_bool(path: str, v: Any) -> bool:
    if type(v) is not bool:
        raise _wrong(path, "true or false", v)
    return v


def _check_int_list(path: str, v: Any) -> list[int]:
    if type(v) is not list:
        raise _wrong(path, "a list of integers", v)
    for x in v:
        if type(x) is not int:
            raise ProtocolError(f"field {path!r} must be a list of integers, got an element of type "
                                f"{type(x).__name__}")
    return v


def _check_any(path: str, v: Any) -> Any:
    return v


#: Annotations whose wire values need no conversion when they have exactly this Python type (decode's fast path).
_EXACT: dict[Any, type] = {int: int, str: str, bool: bool, float: float, bytes: bytes, dict[str, Any]: dict,
                           int | None: int, str | None: str, float | None: float, dict[str, Any] | None: dict}

_SCALARS: dict[Any, tuple[Check, str]] = {
    int: (_check_int, "an integer"),
    float: (_check_float, "a number"),
    str: (_check_str, "a string"),
    bool: (_check_bool, "true or false"),
    bytes: (_check_bytes, "bytes"),
}


def _compile(tp: Any, owner: str) -> tuple[Check, Callable[[Any], Any] | None]:
    """A checker for wire values of annotation ``tp``, and a converter to the wire form (None: sent as it is)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"{owner}: only X | None unions are supported, got {tp}")
        check, to_wire = _compile(inner[0], owner)
        return (lambda path, v: None if v is None else check(path, v)), (
            None if to_wire is None else (lambda v: None if v is None else to_wire(v)))
    if tp in _SCALARS:
        return _SCALARS[tp][0], None
    if tp is Any:
        return _check_any, None
    if origin is list:
        if args == (int,):
            return _check_int_list, None
        item_check, item_wire = _compile(args[0], owner) if args else (_check_any, None)
        item_exact = _EXACT.get(args[0]) if args else None

        def check_list(path: str, v: Any) -> list:
            if type(v) is not list:
                raise _wrong(path, "a list", v)
            return [x if type(x) is item_exact else item_check(f"{path}[{i}]", x) for i, x in enumerate(v)]

        return check_list, None if item_wire is None else (lambda v: [item_wire(x) for x in v])
    if origin is dict or tp is dict:
        value_check = _compile(args[1], owner)[0] if args and args[1] is not Any else None
        value_exact = _EXACT.get(args[1]) if args else None

        def check_dict(path: str, v: Any) -> dict:
            if type(v) is not dict:
                raise _wrong(path, "a map", v)
            if value_check is None:
                return v
            if not all(type(key) is str for key in v):
                raise ProtocolError(f"field {path!r} must be a map with string keys")
            # converted values (a float takes an int); the path is only spelled out for a value that needs a check
            return {key: x if type(x) is value_exact else value_check(f"{path}.{key}", x) for key, x in v.items()}

        return check_dict, None
    spec = getattr(tp, "_SPEC", None)
    if isinstance(spec, _Spec):  # a nested structure (Capabilities, ThreadCounts): a map on the wire
        return spec.read, spec.write
    raise TypeError(f"{owner}: unsupported field type {tp!r}")


@dataclass(frozen=True)
class _Field:
    name: str
    check: Check
    to_wire: Callable[[Any], Any] | None
    default: Any  # _MISSING: required
    factory: Callable[[], Any] | None
    skip_none: bool  # optional with default None: left out of the header when None


class _Spec:
    """What encode and decode need of one class, computed once when the class is defined (no reflection per call)."""

    def __init__(self, cls: type):
        hints = typing.get_type_hints(cls)
        self.cls = cls
        self.has_tensors = False
        fields = []
        for f in dataclasses.fields(cls):
            if f.name == "tensors":
                self.has_tensors = True
                continue
            check, to_wire = _compile(hints[f.name], cls.__name__)
            factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
            default = f.default if f.default is not dataclasses.MISSING else (_MISSING if factory is None else None)
            fields.append(_Field(f.name, check, to_wire, default, factory, default is None and factory is None))
        self.fields = tuple(fields)
        self.names = tuple(f.name for f in fields)
        self.wire = tuple((f.name, f.to_wire, f.skip_none) for f in fields)
        # per field: (name, exact type that needs no check or conversion, check, default, factory)
        self.plan = tuple((f.name, _EXACT.get(hints[f.name]), f.check, f.default, f.factory) for f in fields)

    def read(self, path: str, header: Any) -> Any:
        """Check a header (or a nested map) and build an instance; unknown keys are ignored."""
        if type(header) is not dict:
            raise _wrong(path, "a map", header)
        values = {}
        get = header.get
        for name, exact, check, default, factory in self.plan:
            v = get(name, _MISSING)
            if type(v) is exact:  # the common case: a scalar of exactly its type (never a bool for an int)
                values[name] = v
            elif v is _MISSING:
                if default is _MISSING:
                    where = f"{path}." if path else ""
                    raise ProtocolError(f"{path or self.cls.TYPE}: missing field {where + name!r}")
                values[name] = factory() if factory is not None else default
            else:
                values[name] = check(f"{path}.{name}" if path else name, v)
        obj = self.cls.__new__(self.cls)
        obj.__dict__ = values
        return obj

    def write(self, obj: Any) -> dict[str, Any]:
        """The wire map of an instance (fields as they are: no copies)."""
        d = obj.__dict__
        out = {}
        for name, to_wire, skip_none in self.wire:
            v = d[name]
            if v is None and skip_none:
                continue
            out[name] = v if to_wire is None else to_wire(v)
        return out


def _struct(cls: type) -> type:
    """A nested structure inside a message (a map on the wire), with its field spec."""
    cls = dataclass(cls)
    cls._SPEC = _Spec(cls)
    return cls


#: Message type name -> class.
MESSAGE_TYPES: dict[str, type[Message]] = {}


def _message(cls: type) -> type:
    """Register a message class: a dataclass, its field spec, its entry in :data:`MESSAGE_TYPES`."""
    cls = dataclass(cls)
    cls._SPEC = _Spec(cls)
    if cls.TYPE in MESSAGE_TYPES:
        raise TypeError(f"message type {cls.TYPE!r} defined twice")
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls


def _tensors() -> Any:
    # the tensors a message carries; not compared (tensor equality is not a bool)
    return field(default_factory=dict, compare=False, repr=False)


class Message:
    """Base of every message class: ``TYPE`` (wire name), ``DIRECTION`` (who sends it), ``validate()``."""

    TYPE: ClassVar[str] = ""
    DIRECTION: ClassVar[str] = ""
    _SPEC: ClassVar[_Spec]

    def validate(self) -> None:
        """Range checks that belong to the message itself; raise :class:`ProtocolError`. Called by ``decode``."""

    def to_dict(self) -> dict[str, Any]:
        """The header fields as plain values (nested structures as maps, None where unset), without tensors."""
        return {f.name: _plain(getattr(self, f.name)) for f in self._SPEC.fields}


def _plain(v: Any) -> Any:
    if type(v) is list and v and isinstance(getattr(type(v[0]), "_SPEC", None), _Spec):
        return [_plain(x) for x in v]  # a list of nested structures (pong.reports)
    spec = getattr(type(v), "_SPEC", None)
    return {name: _plain(x) for name, x in v.__dict__.items()} if isinstance(spec, _Spec) else v


# ------------------------------------------------------------------------------------------ nested structures
@_struct
class Capabilities:
    """What a drafter announces at connect time; the verifier adapts to it and knows nothing else about the type."""

    sends_q: bool = False  # sends the distribution each draft was drawn from (sampling); else drafts are one-hot
    greedy_q: bool = False  # can send its q under greedy too, when the verifier asks (ensemble verification)
    needs_hidden_states: bool = False  # wants the target's last hidden states for committed positions
    needs_kv_layers: list[int] = field(default_factory=list)  # wants new K/V rows of these target layers


@_struct
class ThreadCounts:
    """A node's torch thread counts: its share while both nodes compute, and every core (``full``)."""

    share: int = 0
    full: int = 0


#: :attr:`StartReport.decision`: what the drafter's cost model concluded at start-up.
REPORT_DECISIONS = (
    "pays",  # speculation beats the target alone at the assumed acceptance
    "cannot_pay",  # not even a drafter whose every token is accepted would beat the target alone: k = 0
    "unsure",  # the target alone wins at the assumed acceptance; blocks are still tried while it is uncertain
    "fixed",  # a schedule other than cost: k as configured, the expected speed-up as the cost model sees it
    "unmeasured",  # a side's costs are not known yet (no profile): the plan is learned from the rounds
)


@_struct
class StartReport:
    """What a drafter chose at start-up and the plan its cost model (drafter_node.cost_model) implies for a new
    session: both nodes' dtypes and why, thread counts, the measured seconds of verifying 1 and k + 1 tokens and of
    one draft step, and the expected speed-up over the target alone. Sent in a heartbeat after each welcome; the
    verifier lists the latest of each drafter in ``pong.reports`` (``drafter``: its pool id, set by the verifier)."""

    decision: str = "unmeasured"  # one of REPORT_DECISIONS
    schedule: str = ""  # drafter.draft_schedule
    k: int = 0  # the first plan's block length (0: the target steps alone)
    overlap: bool = False  # the first plan pre-drafts while its block is verified
    speedup: float = 0.0  # expected committed tokens per second over the target alone's (0: unknown)
    alpha: float = 0.0  # the per-token acceptance assumed (the prior, or this pair's remembered one)
    verify_1_s: float = 0.0  # the verifier's forward over 1 token (0: unknown)
    verify_k_s: float = 0.0  # over k + 1 tokens (k ≥ 1: the plan's, else num_draft_tokens)
    verify_k: int = 0  # that k
    draft_s: float = 0.0  # one draft step (1 row)
    verifier_dtype: str = ""
    verifier_dtype_why: str = ""
    verifier_threads: ThreadCounts | None = None
    drafter_dtype: str = ""
    drafter_dtype_why: str = ""
    drafter_threads: ThreadCounts | None = None
    drafter: str = ""

    def check(self, where: str) -> None:
        """Range checks (nested structures have no ``validate`` of their own)."""
        if self.decision not in REPORT_DECISIONS:
            raise ProtocolError(f"{where}: decision must be one of {', '.join(REPORT_DECISIONS)}")
        for name in ("schedule", "verifier_dtype", "verifier_dtype_why", "drafter_dtype", "drafter_dtype_why",
                     "drafter"):
            if len(getattr(self, name)) > MAX_REPORT_CHARS:
                raise ProtocolError(f"{where}: {name} must be at most {MAX_REPORT_CHARS} characters")
        _non_negative(where, self, "k", "speedup", "alpha", "verify_1_s", "verify_k_s", "verify_k", "draft_s")
        for threads in (self.verifier_threads, self.drafter_threads):
            if threads is not None:
                _non_negative(f"{where}: threads", threads, "share", "full")


@_struct
class DrafterTiming:
    """Where a draft session's drafter time went, summed over its blocks (the request's metrics show it per block):
    drafter forwards (``step_s``, pre-drafting included), encoding and sending blocks, applying commits, and the
    round trips (block sent → its commit applied: verification as the drafter sees it)."""

    step_s: float = 0.0  # drafter steps (pre-drafting included)
    send_s: float = 0.0  # encoding and sending blocks
    commit_s: float = 0.0  # applying commits
    roundtrip_s: float = 0.0  # block sent → its commit applied, summed
    roundtrips: int = 0  # round trips in roundtrip_s
    forward_s: float = 0.0  # one-forward steps, measured …
    profile_s: float = 0.0  # … and the start-up profile's time for the same steps

    def check(self, where: str) -> None:
        _finite_non_negative(where, self, "step_s", "send_s", "commit_s", "roundtrip_s", "roundtrips", "forward_s",
                             "profile_s")


@_struct
class PlanCheck:
    """The start-up report's plan against the best plan a session realised (drafter_node.node_session.plan_check)."""

    startup: str  # the plan the start-up report named
    realised_best: str  # the plan with the highest realised tokens/s among those that ran long enough
    verdict: str  # confirmed (the same plan) or corrected

    def check(self, where: str) -> None:
        if self.verdict not in ("confirmed", "corrected"):
            raise ProtocolError(f"{where}: verdict must be confirmed or corrected")
        if max(len(self.startup), len(self.realised_best)) > MAX_PLAN_NAME_CHARS:
            raise ProtocolError(f"{where}: plan names must be at most {MAX_PLAN_NAME_CHARS} characters")


@_struct
class DrafterStats:
    """A draft session's counters as its drafter keeps them, sent with each block (``draft.stats``, the totals so
    far); the verifier passes them on in the request's metrics (docs/metrics.md). One struct on both sides: the
    drafter counts in it, the verifier reads its attributes."""

    busy_s: float = 0.0  # drafter compute time for the session
    blocks: int = 0  # blocks sent
    predraft_hits: int = 0  # the next block's start was drafted before the commit came
    rolled_back: int = 0  # drafted chain tokens a commit threw away
    idle_blocks: int = 0  # k = 0 blocks (the verifier steps alone)
    batch_steps: int = 0  # steps that advanced this session
    batch_rows: int = 0  # the sessions in each of their forwards, summed
    tree_blocks: int = 0  # blocks sent as token trees
    side_accepted: int = 0  # commits that took a side leaf (the drafter's second choice)
    plans: dict[str, int] = field(default_factory=dict)  # rounds per kind of plan (the cost schedule's)
    dtype: str | None = None  # the drafter model's dtype
    timing: DrafterTiming = field(default_factory=DrafterTiming)  # where the drafter's time went
    # Per plan used: [rounds, committed tokens, seconds between commits, the predicted tokens/s summed]
    plan_rates: dict[str, list[float]] = field(default_factory=dict)
    plan_check: PlanCheck | None = None  # the start-up plan, confirmed or corrected
    # The cost model's best plan at the acceptance realised, measured forward costs, no overhead (None: unknown)
    ceiling_tokens_per_second: float | None = None

    def check(self, where: str) -> None:
        """Range checks: counts and times finite and ≥ 0, the maps bounded (nested structures have no ``validate``)."""
        _finite_non_negative(where, self, *_COUNTERS, "ceiling_tokens_per_second")
        self.timing.check(f"{where}.timing")
        if self.plan_check is not None:
            self.plan_check.check(f"{where}.plan_check")
        if self.dtype is not None and len(self.dtype) > MAX_REPORT_CHARS:
            raise ProtocolError(f"{where}: dtype must be at most {MAX_REPORT_CHARS} characters")
        for name, table in (("plans", self.plans), ("plan_rates", self.plan_rates)):
            if len(table) > MAX_PLAN_NAMES or max(map(len, table), default=0) > MAX_PLAN_NAME_CHARS:
                raise ProtocolError(f"{where}: {name} must map at most {MAX_PLAN_NAMES} plan names of at most "
                                    f"{MAX_PLAN_NAME_CHARS} characters")
        if min(self.plans.values(), default=0) < 0:  # integers (decode checked): no NaN to miss
            raise ProtocolError(f"{where}: plans must count rounds (integers ≥ 0)")
        for row in self.plan_rates.values():  # sent with every block: plain comparisons, no generators
            if len(row) != 4 or not (0 <= row[0] < math.inf and 0 <= row[1] < math.inf and 0 <= row[2] < math.inf
                                     and 0 <= row[3] < math.inf):
                raise ProtocolError(f"{where}: plan_rates must map plan names to 4 finite numbers ≥ 0")


#: DrafterStats' counters (its plain-number fields), in order.
_COUNTERS = ("busy_s", "blocks", "predraft_hits", "rolled_back", "idle_blocks", "batch_steps", "batch_rows",
             "tree_blocks", "side_accepted")

def _non_negative(where: str, obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if v is not None and not v >= 0:  # `not >=` also catches NaN
            raise ProtocolError(f"{where}: {name} must be ≥ 0, got {v!r}")


def _finite_non_negative(where: str, obj: Any, *names: str) -> None:
    d = obj.__dict__
    for name in names:
        v = d[name]
        if v is not None and not 0 <= v < math.inf:  # false for NaN too
            raise ProtocolError(f"{where}: {name} must be finite and ≥ 0, got {v!r}")


def _check_tenant(where: str, tenant: str | None) -> None:
    if tenant is not None and not (0 < len(tenant) <= MAX_TENANT_CHARS and tenant.isprintable()):
        raise ProtocolError(f"{where}: tenant must be 1 to {MAX_TENANT_CHARS} printable characters", "bad_request")


# -------------------------------------------------------------------------------------------- message types
@_message
class Hello(Message):
    TYPE = "hello"
    DIRECTION = "drafter→verifier"

    drafter_type: str  # the drafter type's name (drafter.type)
    # fingerprint of the tokenizer its tokens are in ("any": prompt lookup); a mismatch is refused (tokenizer_mismatch)
    tokenizer_id: str
    capabilities: Capabilities  # what the verifier must send it and may expect from it
    profile: dict[str, Any] | None = None  # shared.costs.curve.NodeProfile.to_dict(); the verifier checks it
    threads: ThreadCounts | None = None  # its torch thread counts
    host: str | None = None  # the drafter's hostname (shown in pong.drafters)
    run_secret: str | None = None  # the launcher's per-run secret (links without CURVE; see runtime.security)

    def validate(self) -> None:
        if any(layer < 0 for layer in self.capabilities.needs_kv_layers):
            raise ProtocolError("hello: capabilities.needs_kv_layers must be layer indices ≥ 0")
        if self.host is not None and len(self.host) > MAX_HOST_CHARS:
            raise ProtocolError(f"hello: host must be at most {MAX_HOST_CHARS} characters")
        if self.run_secret is not None and len(self.run_secret) > MAX_HOST_CHARS:
            raise ProtocolError(f"hello: run_secret must be at most {MAX_HOST_CHARS} characters")
        if self.threads is not None:
            _non_negative(f"{self.TYPE}: threads", self.threads, "share", "full")


@_message
class Welcome(Message):
    TYPE = "welcome"
    DIRECTION = "verifier→drafter"

    target: str  # the target model's name
    vocab_size: int  # the target's vocabulary size
    want_q: bool  # send q with greedy drafts too (the verifier runs ensemble verification)
    profile: dict[str, Any] | None = None  # the verifier's cost curves (NodeProfile.to_dict())
    threads: ThreadCounts | None = None  # the verifier's torch thread counts
    # a rejected draft costs the verifier a forward over the accepted tokens (hybrid / state-space target)
    rollback_refeeds: bool = False
    dtype: str | None = None  # the target's dtype (also where it has no profile), for the drafter's start-up report

    def validate(self) -> None:
        if self.dtype is not None and len(self.dtype) > MAX_REPORT_CHARS:
            raise ProtocolError(f"welcome: dtype must be at most {MAX_REPORT_CHARS} characters")
        if self.vocab_size < 1:
            raise ProtocolError(f"welcome: vocab_size must be ≥ 1, got {self.vocab_size}")
        if self.threads is not None:
            _non_negative(f"{self.TYPE}: threads", self.threads, "share", "full")


@_message
class SessionStart(Message):
    TYPE = "session_start"
    DIRECTION = "verifier→drafter"

    session: int  # the session id the verifier gives the request
    token_ids: list[int]  # the whole committed prefix
    params: dict[str, Any]  # shared.sampling.GenerationParams.to_dict()
    prompt_len: int | None = None  # None: all of token_ids is the prompt
    # Sessions that will share a verifier forward once this one is cached, this one included (as Commit.decoding;
    # 0: unknown): the new session's first plan is made for that batch, not for the one before it arrived.
    decoding: int = 0
    # The request's tenant as an opaque id (a hash, never a key or a name; None: no tenant): state a drafter keeps
    # across requests (the suffix cache) is kept per tenant (docs/security.md).
    tenant: str | None = None
    # extras: hidden, kv.{layer} for the prefix (what fits under the size cap; the rest follows in state pieces)
    tensors: dict[str, torch.Tensor] = _tensors()

    def validate(self) -> None:
        if self.prompt_len is not None and not 0 <= self.prompt_len <= len(self.token_ids):
            raise ProtocolError(f"session_start: prompt_len must be in [0, {len(self.token_ids)}]")
        _non_negative(self.TYPE, self, "decoding")
        _check_tenant(self.TYPE, self.tenant)


@_message
class Draft(Message):
    TYPE = "draft"
    DIRECTION = "drafter→verifier"

    session: int  # the session the block is for
    base_len: int  # the committed length the block was built on; any other is stale and dropped
    tokens: list[int]  # the drafted block, at most MAX_DRAFT_TOKENS tokens
    idle_rounds: int = 0  # k = 0: the verifier steps alone this many rounds (no tokens then)
    overlap: bool = True  # the drafter pre-drafts while this block is verified
    sent_at: float | None = None  # the drafter's wall clock at send (same-host transit time)
    stats: DrafterStats | None = None  # the drafter's counters, passed on in the request's metrics
    # A token tree instead of a chain: the parent index of each token (-1: under the pending token; topological).
    # None: a chain. Greedy requests only, without q (verifier_node.tree).
    parents: list[int] | None = None
    tensors: dict[str, torch.Tensor] = _tensors()  # q_idx/q_prob [k, m] (sparse q) or q [k, vocab] (dense)

    def validate(self) -> None:
        if len(self.tokens) > MAX_DRAFT_TOKENS:
            raise ProtocolError(f"draft: at most {MAX_DRAFT_TOKENS} tokens, got {len(self.tokens)}")
        if not 0 <= self.idle_rounds <= MAX_IDLE_ROUNDS or (self.idle_rounds and self.tokens):
            raise ProtocolError(f"draft: idle_rounds must be an integer in [0, {MAX_IDLE_ROUNDS}], with no tokens")
        if self.parents is not None:
            try:
                validate_tree_shape(self.tokens, self.parents, MAX_DRAFT_TOKENS)
            except ValueError as exc:
                raise ProtocolError(f"draft: parents: {exc}") from None
        if self.stats is not None:
            self.stats.check("draft: stats")


@_message
class Commit(Message):
    TYPE = "commit"
    DIRECTION = "verifier→drafter"

    session: int  # the session the round was for
    base_len: int  # the committed length before the round
    tokens: list[int]  # the n accepted drafts plus the target's own token; committed length now: base_len + n + 1
    drafted: int = 0  # draft tokens the verifier checked (0: the round used no draft)
    accepted: int = 0  # of those, the accepted ones
    verify_s: float | None = None  # the round's target forward time
    threads: int = 0  # the verifier's torch threads in that forward (0: unknown)
    batch_sessions: int = 1  # sessions verified in that forward (batched verification; verify_s is the whole one's)
    batch_tokens: int = 0  # tokens that forward ran over, every row's (0: unknown, drafted + 1)
    # Sessions that would share a forward if every one stepped now: the verifier's decoding sessions, capped at its
    # max_batch_sessions (1 when it does not batch; 0: unknown, use batch_sessions). The batch the cost model plans
    # for: the forwards' own batch_sessions shrink while drafts arrive out of step, which would keep drafting chosen.
    decoding: int = 0
    tensors: dict[str, torch.Tensor] = _tensors()  # extras: hidden, kv.{layer} for the committed positions

    def validate(self) -> None:
        _non_negative(self.TYPE, self, "base_len", "drafted", "accepted", "verify_s", "threads",
                      "batch_sessions", "batch_tokens", "decoding")


@_message
class State(Message):
    TYPE = "state"
    DIRECTION = "verifier→drafter"

    session: int  # the session whose start state this piece belongs to
    base_len: int  # the committed length of that session_start
    end: int  # the piece covers the positions just before this one
    tensors: dict[str, torch.Tensor] = _tensors()  # extras (hidden, kv.{layer}) for positions before end

    def validate(self) -> None:
        _non_negative(self.TYPE, self, "base_len", "end")


@_message
class SessionEnd(Message):
    TYPE = "session_end"
    DIRECTION = "verifier→drafter"

    session: int  # the session that ended (done, cancelled or failed)


@_message
class Heartbeat(Message):
    TYPE = "heartbeat"
    DIRECTION = "drafter↔verifier"  # the verifier answers each one

    report: StartReport | None = None  # a drafter's, once after each welcome

    def validate(self) -> None:
        if self.report is not None:
            self.report.check(f"{self.TYPE}: report")


@_message
class Generate(Message):
    TYPE = "generate"
    DIRECTION = "client→verifier"

    request_id: int  # chosen by the client, unique among its requests in flight
    params: dict[str, Any]  # shared.sampling.GenerationParams fields; the verifier checks them
    token_ids: list[int] | None = None
    prompt: str | None = None
    # chat turns {role, content}, templated by the target; for tool use an assistant turn's tool_calls and a tool
    # turn's tool_call_id (shared.chat_tools)
    messages: list[dict[str, Any]] | None = None
    drafter_type: str | None = None  # only a drafter of this type may serve the request (None: any)
    # The user the request is for (None: the sender's own tenant). Only a trusted gateway may set it: any client on
    # a client link without CURVE, under CURVE a client whose key is a gateway (docs/security.md); others get an
    # unauthorized error.
    tenant: str | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI's tools, given to the chat template (with messages only)

    def validate(self) -> None:
        _check_tenant(self.TYPE, self.tenant)
        given = [v for v in (self.token_ids, self.prompt, self.messages) if v is not None]
        if len(given) != 1:
            raise ProtocolError("give exactly one of token_ids, prompt or messages", "bad_request")
        if self.tools is not None and self.messages is None:
            raise ProtocolError("tools go with messages (the chat template places them)", "bad_request")
        try:
            if self.messages is not None:
                check_messages(self.messages)
            if self.tools is not None:
                check_tools(self.tools)
        except ChatError as exc:
            raise ProtocolError(str(exc), "bad_request") from None


@_struct
class TokenLogprob:
    """One committed token's log probability under the target's processed scores (the distribution the verifier
    samples or argmaxes from; verifier_node.logprobs) and its most likely alternatives, best first (``-inf`` ones
    left out). ``piece``: the token's raw bytes (a part of a UTF-8 character possibly); ``special``: a special token
    (its text is its name, and it adds nothing to the request's text)."""

    logprob: float
    piece: bytes = b""
    special: bool = False
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    top_pieces: list[bytes] = field(default_factory=list)

    def check(self, where: str) -> None:
        if not (math.isfinite(self.logprob) and self.logprob <= 0.0):
            raise ProtocolError(f"{where}: logprob must be a finite number <= 0")
        n = len(self.top_ids)
        if n > MAX_TOP_LOGPROBS or len(self.top_logprobs) != n or len(self.top_pieces) != n:
            raise ProtocolError(f"{where}: top_ids, top_logprobs and top_pieces must have the same length, at most "
                                f"{MAX_TOP_LOGPROBS}")
        if not all(math.isfinite(x) and x <= 0.0 for x in self.top_logprobs):
            raise ProtocolError(f"{where}: top_logprobs must be finite numbers <= 0")
        if any(len(p) > MAX_PIECE_BYTES for p in (self.piece, *self.top_pieces)):
            raise ProtocolError(f"{where}: a token's piece is at most {MAX_PIECE_BYTES} bytes")


def _check_logprobs(msg: Any) -> None:
    """A chunk's or done's ``logprobs``: none, or one entry per token."""
    if msg.logprobs is None:
        return
    if len(msg.logprobs) != len(msg.token_ids):
        raise ProtocolError(f"{msg.TYPE}: logprobs must have one entry per token ({len(msg.token_ids)}), got "
                            f"{len(msg.logprobs)}")
    for i, entry in enumerate(msg.logprobs):
        entry.check(f"{msg.TYPE}: logprobs[{i}]")


@_message
class Chunk(Message):
    TYPE = "chunk"
    DIRECTION = "verifier→client"

    request_id: int  # the request it answers
    token_ids: list[int]  # tokens committed in this round
    text: str  # the text they complete
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked (params.logprobs)

    def validate(self) -> None:
        _check_logprobs(self)


@_message
class Done(Message):
    TYPE = "done"
    DIRECTION = "verifier→client"

    request_id: int  # the request it answers
    token_ids: list[int]  # every new token
    text: str
    metrics: dict[str, Any]  # the request's metrics (docs/metrics.md)
    finish_reason: str  # stop, length, cancelled or client_gone
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked (params.logprobs)

    def validate(self) -> None:
        _check_logprobs(self)


@_message
class Cancel(Message):
    TYPE = "cancel"
    DIRECTION = "client→verifier"

    request_id: int  # the request to cancel


@_message
class Ping(Message):
    TYPE = "ping"
    DIRECTION = "client→verifier"


@_message
class Pong(Message):
    TYPE = "pong"
    DIRECTION = "verifier→client"

    drafter_connected: bool  # any drafter alive
    drafter_type: str | None = None  # the first live drafter's
    target: str | None = None
    sessions: int = 0
    drafters: list[dict[str, Any]] = field(default_factory=list)  # {id, type, host, sessions, alive} per drafter
    max_message_bytes: int = 0  # the verifier's cap: a client never sends a larger message (0: not announced)
    heartbeat_timeout_s: float = 0.0  # a client silent this long loses its sessions (0.0: not announced)
    batching: bool = False  # the verifier verifies ready sessions in one forward (config on and the target allows it)
    forwards: int = 0  # target forwards of verification rounds so far (a batched one counts once)
    mean_batch_sessions: float = 0.0  # sessions per such forward, on average
    mean_batch_tokens: float = 0.0  # tokens per such forward (every row's), on average
    prefill_forwards: int = 0  # target forwards that cached prompts (a batched one over several counts once)
    mean_prefill_sessions: float = 0.0  # prompts per such forward, on average
    reports: list[StartReport] = field(default_factory=list)  # each live drafter's latest start-up report
    # the tool-call format of the target's chat template (shared.tool_calls.PARSERS; None: its template has none)
    tool_parser: str | None = None

    def validate(self) -> None:
        if len(self.reports) > MAX_REPORTS:
            raise ProtocolError(f"pong: at most {MAX_REPORTS} reports")
        for i, report in enumerate(self.reports):
            report.check(f"{self.TYPE}: reports[{i}]")


@_message
class Error(Message):
    TYPE = "error"
    DIRECTION = "any"

    message: str  # what went wrong, for a person
    code: str = "error"  # machine-readable reason (see "Errors and robustness")
    request_id: int | None = None  # the request it ends, when known
    session: int | None = None  # the session it concerns, when known


# ------------------------------------------------------------------------------------------------------ codec
def encode(msg: Message) -> list[Any]:
    """Encode a message into frames: a msgpack header then one raw buffer per tensor (no copy for CPU tensors)."""
    if not isinstance(msg, Message) or MESSAGE_TYPES.get(msg.TYPE) is not type(msg):
        raise TypeError(f"encode() takes a message instance (one of {', '.join(MESSAGE_TYPES)}), got {msg!r:.80}")
    spec = msg._SPEC
    header = spec.write(msg)
    header["v"] = SCHEMA_VERSION
    header["type"] = msg.TYPE
    buffers: list[Any] = []
    if spec.has_tensors and msg.tensors:
        descriptors = []
        for name, tensor in msg.tensors.items():
            t = tensor.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            dtype_name = _DTYPE_NAMES.get(t.dtype)
            if dtype_name is None:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be sent")
            descriptors.append({"name": name, "dtype": dtype_name, "shape": list(t.shape)})
            # A uint8 view shares memory with t; numpy exposes it to ZeroMQ as a buffer without copying.
            buffers.append(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
        header["tensors"] = descriptors
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def decode(frames: list[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate frames (bytes or zmq.Frame) into a message instance. Raises :class:`ProtocolError` on
    anything malformed; unknown extra header fields are ignored (forward compatibility)."""
    if not frames:
        raise ProtocolError("empty message")
    raw = [memoryview(f.buffer if hasattr(f, "buffer") else f) for f in frames]
    total = sum(r.nbytes for r in raw)
    if total > max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {max_bytes}", code="too_large",
                            request_id=_peek_request_id(raw[0]))
    if raw[0].nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {raw[0].nbytes} bytes exceeds the limit of {MAX_HEADER_BYTES}",
                            code="too_large", request_id=_peek_request_id(raw[0]))
    try:
        header = msgpack.unpackb(raw[0], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a map")
    rid = header.get("request_id")
    request_id = rid if type(rid) is int else None
    version = header.get("v")
    if version != SCHEMA_VERSION or type(version) is not int:
        raise ProtocolError(
            f"unsupported schema version {version!r} (this node speaks {SCHEMA_VERSION})",
            code="bad_version",
            request_id=request_id,
        )
    msg_type = header.get("type")
    cls = MESSAGE_TYPES.get(msg_type) if isinstance(msg_type, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {msg_type!r}", code="unknown_type", request_id=request_id)
    try:
        spec = cls._SPEC
        msg = spec.read("", header)
        tensors = _decode_tensors(header.get("tensors", []), raw[1:])
        if spec.has_tensors:
            msg.tensors = tensors
        elif tensors:
            raise ProtocolError(f"a {msg_type} message carries no tensors")
        msg.validate()
    except ProtocolError as exc:
        if not str(exc).startswith(msg_type):
            exc.args = (f"{msg_type}: {exc}",)
        exc.request_id = request_id
        raise
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:  # last line of defence: never crash a node
        raise ProtocolError(f"malformed {msg_type} message: {exc}", request_id=request_id) from None
    return msg


#: Entries of an over-size header looked at for its ``request_id`` (encode puts it first).
_PEEK_ENTRIES = 8


def _peek_request_id(header_frame: memoryview) -> int | None:
    """The ``request_id`` of an over-size message, so the error reaches its request. A header past its own cap is
    not unpacked: its first few entries are read with plain string keys, every value skipped without being built."""
    if header_frame.nbytes > MAX_HEADER_BYTES:
        return _scan_request_id(header_frame)
    try:
        header = msgpack.unpackb(header_frame, raw=False, strict_map_key=True)
    except Exception:  # any malformed header: nothing to recover
        return None
    rid = header.get("request_id") if isinstance(header, dict) else None
    return rid if type(rid) is int else None


def _scan_request_id(header_frame: memoryview) -> int | None:
    """``request_id`` among the first :data:`_PEEK_ENTRIES` entries of a header map too large to unpack (None: not
    there, or not readable). Keys must be short strings (checked by their first byte before reading); values are
    skipped, which builds no objects."""
    data = header_frame.cast("B") if header_frame.format != "B" else header_frame
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=data.nbytes)
        unpacker.feed(data)
        for _ in range(min(unpacker.read_map_header(), _PEEK_ENTRIES)):
            if not 0xA0 <= data[unpacker.tell()] <= 0xBF:  # a fixstr (at most 31 bytes), or give up
                return None
            if unpacker.unpack() == "request_id":
                pos = unpacker.tell()
                if data[pos] > 0x7F and data[pos] not in (0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3):
                    return None  # not an int: nothing to build
                rid = unpacker.unpack()
                return rid if type(rid) is int else None
            unpacker.skip()
    except Exception:  # any malformed header: nothing to recover
        return None
    return None


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
            or not all(type(s) is int and 0 <= s < MAX_DIM for s in shape)
        ):
            raise ProtocolError(f"tensor {name!r}: bad shape {shape!r}")
        numel = math.prod(shape)
        if buf.nbytes != numel * _ITEM_SIZES[dtype_name]:
            raise ProtocolError(f"tensor {name!r}: {buf.nbytes} bytes for shape {shape} of {dtype_name}")
        dtype = _DTYPES[dtype_name]
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            # bytearray copies once into memory torch may own (ZeroMQ buffers are read-only).
            tensors[name] = torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)
    return tensors


def error_frames(message: str, code: str = "error", request_id: int | None = None,
                 session: int | None = None) -> list[Any]:
    """Frames of an ``error`` reply."""
    return encode(Error(message=message, code=code, request_id=request_id, session=session))
