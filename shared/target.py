"""The target: one object that owns the verifying model and its KV memory, and the protocol every caller uses to
work on a sequence held in that memory.

Three parts (see docs/architecture.md, "The target seam"):

* :class:`SequenceHandle` — one sequence in a backend's KV memory (a verifier session's, or a drafter session's):
  ``feed`` tokens and get their logits, ``crop`` / ``restore`` back to a length, ``length`` / ``room``, the K/V rows
  drafters that read target state take (``check_kv_layers``, ``new_rows``, ``held_rows``), flags (``recurrent``,
  ``batchable``, ``trees``) and the counters the sessions read. Callers never touch what a handle holds (a cache
  tensor, a slot, a llama.cpp sequence id): that is the backend's business.
* :class:`TargetBackend` — owns the memory: ``open`` a handle, ``feed_rows`` (one forward over rows of several
  handles: batched verification and drafting), ``feed_tree`` (one sequence's forward with its own positions and
  visibility: token trees, pre-draft rows) and ``keep_positions`` (keep a tree path or a pre-draft row, dropping
  the rest), ``capacity_tokens`` (what admission may promise), ``check_kv_layers``, ``describe``.
* :class:`Target` — the backend plus the facts the verifier needs about its model (tokenizer, end tokens,
  vocabulary size, dtype, device, context length, cost profile), made by :func:`load_target` from the verifier's
  config section through a registry of loaders: ``verifier.backend`` names one (:func:`register_target_backend`).

A new backend is one module: a :class:`TargetBackend` subclass, its handle class, and a loader registered under
its ``verifier.backend`` name (listed in :data:`BACKEND_MODULES` so :func:`load_target` imports it on demand).
The torch backends (``auto``, ``dynamic``, ``static``, ``compiled``) live in :mod:`shared.backend`.

Modelled on gpt-fast (``model(ids, input_pos)`` over a static cache), llama.cpp's speculative example (sequences
as ids; ``seq_keep`` / ``seq_cp`` / ``seq_rm`` keep a branch) and SGLang's ``ReqToTokenPool`` (a request holds
slot indices): a handle is the request's index into memory it does not own.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


class KVRowsError(ValueError):
    """A drafter asked for K/V rows of layers this model's cache does not hold."""


@runtime_checkable
class SequenceHandle(Protocol):
    """One sequence in a backend's KV memory. ``length``: positions it holds (what the next ``feed`` goes after).

    Counters (read by the sessions and cost curves): ``last_fed`` (tokens of the last forward), ``fed_total`` (of
    every forward so far), ``refed_total`` (tokens fed again to roll back recurrent state). ``capacity``: the most
    positions it can hold (None: no bound of its own)."""

    length: int
    last_fed: int
    fed_total: int
    refed_total: int
    capacity: int | None

    @property
    def recurrent(self) -> bool:
        """A rollback re-feeds tokens (hybrid / state-space models: a state summarises every token it saw)."""

    @property
    def batchable(self) -> bool:
        """It may be a row of a batched forward with other handles (:meth:`TargetBackend.feed_rows`)."""

    @property
    def trees(self) -> bool:
        """It takes forwards with its own positions and visibility (:meth:`TargetBackend.feed_tree`, token trees,
        pre-draft rows) and :meth:`TargetBackend.keep_positions`."""

    @property
    def batch_key(self) -> Any:
        """Handles with the same key may share one forward (the model or engine behind them)."""

    @property
    def room(self) -> int | None:
        """How many more positions it can take (None: no bound of its own)."""

    def feed(self, token_ids: list[int], want_hidden: bool = False,
             last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``token_ids``; float32 logits ``[T, vocab]`` (``last_logits_only``: ``[1, vocab]``) and, when
        asked, the last hidden states ``[T, hidden]``."""

    def uncached(self, ids: list[int]) -> list[int]:
        """The tokens of ``ids`` (whose first ``length`` are held) to feed for the logits after its last one."""

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits after the sequence ``ids``, feeding what is not held yet."""

    def crop(self, keep: int) -> None:
        """Hold only the first ``keep`` positions (a rollback after a rejection)."""

    def restore(self, keep: int) -> None:
        """Hold exactly the first ``keep`` positions again after a forward that failed part-way."""

    def anchor(self) -> None:
        """Mark the current length as a rollback point (recurrent state; a no-op elsewhere)."""

    def grew(self, count: int) -> None:
        """A forward run elsewhere (a batched one) appended ``count`` positions: count them."""

    def close(self) -> None:
        """The sequence ended: its memory goes back to the backend (idempotent)."""

    def check_kv_layers(self, layers: list[int]) -> None:
        """Raise :class:`KVRowsError` unless every index in ``layers`` holds K/V rows of its own."""

    def new_rows(self, layers: list[int], fed: int, kept: int) -> dict[str, torch.Tensor]:
        """K/V rows of the positions just fed, before ``crop``: of the last ``fed`` the first ``kept``
        (``kv.{layer}``: ``[2, kv_heads, kept, head_dim]``)."""

    def held_rows(self, layers: list[int]) -> dict[str, torch.Tensor]:
        """Every K/V row held for ``layers``, same layout as :meth:`new_rows`."""


@dataclass
class Row:
    """One sequence's part of a batched forward: feed ``tokens`` on top of what ``lm`` holds.

    ``positions``: position ids of the new tokens (default ``lm.length + i``). ``visible``: bool ``[T, lm.length +
    T]``, which held positions and new tokens each new token attends to (default: the causal rule)."""

    lm: SequenceHandle
    tokens: list[int]
    positions: list[int] | None = None
    visible: torch.Tensor | None = None


@dataclass
class RowOutput:
    logits: torch.Tensor | None  # float32 [T, vocab] (None when the forward was asked for no logits)
    hidden: torch.Tensor | None  # last hidden states [T, hidden] (when asked)


class TargetBackend(ABC):
    """Owns a model's per-sequence KV memory: opens handles and runs the forwards over them. The model (or engine)
    behind it is the backend's own: callers go through these operations."""

    #: The ``backend`` name it serves (``dynamic``, ``static``, ``compiled``, ``llama_cpp``, …).
    name: str = ""
    #: The most tokens one handle holds (None: no bound but the model's).
    slot_tokens: int | None = None

    def __init__(self, model: Any):
        self.model = model  # the backend's own: no caller reads it

    @property
    def batch_key(self) -> Any:
        """What its handles' ``batch_key`` is: rows whose key this is may go to :meth:`feed_rows`."""
        return self.model

    @abstractmethod
    def open(self, tokens: int | None = None) -> SequenceHandle:
        """A handle for a new sequence that will hold up to ``tokens`` positions (None: unknown; more than a slot
        holds: a handle without that bound where the backend has one). Give it back with its ``close()``."""

    @abstractmethod
    def feed_rows(self, rows: list[Row], want_hidden: bool = False, logits: bool = True) -> list[RowOutput]:
        """One forward over every row (each on its own handle, which grows by its row's tokens); ``logits=False``
        (prefill) may skip the LM head. Where it raises, a row's handle may have grown part-way: the caller
        ``restore``s it."""

    def can_batch(self) -> bool:
        """Whether :meth:`feed_rows` runs several rows in one forward (else: one forward per handle)."""
        return False

    def feed_tree(self, lm: SequenceHandle, tokens: list[int], positions: list[int], visible: torch.Tensor,
                  want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of ``tokens`` onto ``lm``'s own memory (no copy of it), token t at ``positions[t]``,
        seeing the held positions and new tokens ``visible[t]`` says (bool ``[T, lm.length + T]``): float32 logits
        ``[T, vocab]`` and, when asked, hidden states. ``lm`` grows by T positions; :meth:`keep_positions` keeps
        the ones a round accepts. Only where ``lm.trees``."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} backend runs no tree forwards")

    def keep_positions(self, lm: SequenceHandle, prefix: int, positions: list[int]) -> None:
        """Keep ``lm``'s first ``prefix`` positions, then the held positions ``positions`` (ascending, each ≥
        ``prefix``) moved to follow them in order; drop the rest: ``lm`` then holds ``prefix + len(positions)``,
        exactly what a forward of those tokens in order would have left (a tree path, a pre-draft row)."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} backend keeps no tree paths")

    def capacity_tokens(self) -> int | None:
        """KV positions all its sequences together can hold (admission's budget; None: no bound of its own)."""
        return None

    @property
    def recurrent(self) -> bool:
        """Its sequences' rollback re-feeds tokens (a rejection costs the target one more forward)."""
        return False

    def check_kv_layers(self, layers: list[int]) -> None:
        """Raise :class:`KVRowsError` unless its sequences can give K/V rows of ``layers``."""
        if layers:
            raise KVRowsError(f"the {self.name or type(self).__name__} backend gives no K/V rows")

    def describe(self) -> str:
        return self.name


@dataclass
class Target:
    """The verifier's model behind its backend, and the facts about it the node needs."""

    backend: TargetBackend
    tokenizer: Any
    end_token_ids: list[int]  # what ``generate`` stops on
    vocab_size: int  # columns of its logits
    dtype: str  # as the drafter's hello compares it: ``float32``, ``bfloat16``, ``q4_k_m``, …
    device: str
    name: str = ""  # the configured model (a named model, a folder, a GGUF)
    max_positions: int | None = None  # its context (None: states none)
    profile: Any = None  # its measured cost profile (shared.costs.curve.NodeProfile; None: not measured)
    kind: str = ""  # what it is, for messages (a model class, ``llama.cpp``)
    input_vocab_size: int | None = None  # ids its input takes where not ``vocab_size`` (random tokens for profiles)
    extras: dict[str, Any] = field(default_factory=dict)  # backend-specific facts (tests, bench rows)

    @property
    def rollback_refeeds(self) -> bool:
        return self.backend.recurrent

    def open(self, tokens: int | None = None) -> SequenceHandle:
        return self.backend.open(tokens)

    def describe(self) -> str:
        return f"{self.name or self.kind} ({self.dtype} on {self.device}, KV backend {self.backend.describe()})"


@dataclass
class TargetOptions:
    """What a loader gets besides the verifier's config section."""

    thread_counts: list[int]  # the node's planned torch thread counts (a compiled backend builds steps for each)
    profile: Any = None  # shared.models.ProfileSpec to measure the cost profile within (None: not measured)
    model: Any = None  # an already loaded model (tests), used instead of loading ``verifier.model``
    tokenizer: Any = None  # an already loaded tokenizer (tests)


#: A loader: the verifier's config section (``verifier``: model, device, dtype, backend, kv_* keys, …) → Target.
TargetLoader = Callable[[Any, TargetOptions], Target]

_LOADERS: dict[str, TargetLoader] = {}

#: Where the loader of a ``verifier.backend`` name is registered: imported on demand by :func:`load_target`.
BACKEND_MODULES: dict[str, str] = {
    "auto": "shared.backend",
    "dynamic": "shared.backend",
    "static": "shared.backend",
    "compiled": "shared.backend",
    "llama_cpp": "shared.llama_target",
}


def register_target_backend(*names: str) -> Callable[[TargetLoader], TargetLoader]:
    """Decorator: ``loader`` makes the :class:`Target` of a verifier whose ``backend`` is one of ``names``."""
    if not names:
        raise ValueError("register_target_backend needs at least one backend name")

    def register(loader: TargetLoader) -> TargetLoader:
        for name in names:
            _LOADERS[name] = loader
        return loader

    return register


def target_loader(name: str) -> TargetLoader:
    """The loader registered for ``name`` (its module imported first where :data:`BACKEND_MODULES` names one)."""
    if name not in _LOADERS and name in BACKEND_MODULES:
        importlib.import_module(BACKEND_MODULES[name])
    if name not in _LOADERS:
        known = sorted(set(_LOADERS) | set(BACKEND_MODULES))
        raise ValueError(f"verifier.backend must be one of {', '.join(known)}, got {name!r}")
    return _LOADERS[name]


def load_target(verifier: Any, options: TargetOptions) -> Target:
    """The verifier's :class:`Target` from its config section (``verifier.backend`` picks the loader)."""
    return target_loader(verifier.backend)(verifier, options)
