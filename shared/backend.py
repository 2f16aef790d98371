"""Target backends: who owns the KV memory of a model's sequences, and how a forward over several of them runs.

A backend opens one *handle* per sequence (a verifier session; :class:`shared.kv.CachedLM`'s public surface:
``feed``, ``crop``, ``length``, ``uncached``, ``next_logits``, ``new_rows``, ``held_rows``, ``check_kv_layers``,
``recurrent``, ``grew``, the counters, and ``close`` to give its memory back), runs a batched forward over rows of
such handles (``feed_rows``) and says whether it can (``can_batch``). Three implementations:

* :class:`DynamicBackend` (``dynamic``): each handle is a batch-1 transformers ``DynamicCache`` that grows by
  concatenation; a batched forward stacks the rows' caches into a fresh batch cache and copies the new rows back
  (:mod:`shared.batch`). Serves every model pipespec loads (sliding windows, hybrid / recurrent layers).
* :class:`StaticBackend` (``static``): one pool per layer ``[slots, kv_heads, slot_tokens, head_dim]`` allocated
  once (the model's dtype and device); a handle owns a slot and its cache's layers (:class:`SlotLayer`) write new
  K/V into the slot in place and hand the model views of it. A crop is a length change; tree and pre-draft moves
  (``layer.keys[..., lo:hi, :] = …``) write the pool through those views. A batched forward writes each row's new
  K/V into its own slot and reads the rows' prefixes from the pool (a view when the slots are adjacent, else one
  gather), with a ragged 4D mask and per-row positions. Only for models whose cache layers are all plain attention
  layers and whose attention kernel takes a custom mask (:func:`static_problem`): ``auto`` serves the others with
  the dynamic backend and says why once at start-up (:func:`make_backend`).
* :class:`CompiledBackend` (``compiled``, opt-in): static slots whose single-sequence forwards of a few tokens run
  a ``torch.compile``d fixed-shape step (everything else: the static eager path on the same slots).

When every slot is taken, :meth:`StaticBackend.open` hands out a dynamic handle instead (a sequence never fails for
want of a slot; a batch holding such a handle runs the dynamic, copying path). A sequence that may grow beyond a
slot (``open(tokens=…)``) gets a dynamic handle too; a forward that would still overflow a slot raises
:class:`SlotOverflow` before anything is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from shared.batch import MASKABLE_ATTENTION, feed_rows
from shared.kv import CachedLM
from shared.node_keys import (
    BACKEND_CHOICES,
    COMPILED_BUCKETS,
    DEFAULT_COMPILED_TOKENS,
    DEFAULT_SLOT_TOKENS,
    compiled_buckets,
)
from shared.target import Row, RowOutput, Target, TargetBackend, TargetOptions, register_target_backend
from shared.target_torch import DynamicBackend, TorchBackend, as_target, torch_target

#: What callers import from here (the torch seam's parts live in shared.target_torch and shared.target).
__all__ = ["CompiledBackend", "DynamicBackend", "SlotOverflow", "StaticBackend", "StaticHandle", "TargetBackend",
           "TorchBackend", "as_target", "load_torch_target", "make_backend", "static_problem", "torch_target"]

log = logging.getLogger("pipespec.backend")

class SlotOverflow(ValueError):
    """A forward would write past the end of a sequence's KV slot (nothing was written)."""


# ---------------------------------------------------------------------------------------------------- static slots
def static_problem(model: Any) -> str | None:
    """Why the static backend cannot serve ``model`` (None: it can)."""
    attention = getattr(model.config, "_attn_implementation", "eager")
    if attention not in MASKABLE_ATTENTION:
        return f"attention kernel {attention!r} ignores custom masks (static slots need eager or sdpa)"
    try:
        cache = DynamicCache(config=model.config)
    except Exception as exc:
        return f"transformers cannot build a cache for it ({exc})"
    for index, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            kind = "sliding-window" if getattr(layer, "is_sliding", False) else type(layer).__name__
            return f"cache layer {index} is a {kind} layer (static slots hold plain attention layers only)"
    return None


class SlotLayer(DynamicLayer):
    """One layer of one sequence's cache, held in a slot of the backend's pool: ``keys`` / ``values`` are views
    ``pool[slot:slot+1, :, :length]`` (writes through them land in the pool); ``update`` writes the new positions
    in place; ``crop`` only shortens ``length``."""

    slot_backed = True  # shared.batch.can_batch: a plain attention layer, like DynamicLayer

    def __init__(self, pool_keys: torch.Tensor, pool_values: torch.Tensor, slot: int):
        # No DynamicLayer.__init__: keys and values are properties here, not attributes.
        self.pool_keys, self.pool_values, self.slot = pool_keys, pool_values, slot
        self.capacity = pool_keys.shape[-2]
        self.length = 0
        self.device = pool_keys.device
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.pool_keys[self.slot : self.slot + 1, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.pool_values[self.slot : self.slot + 1, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise SlotOverflow(f"the sequence would hold {end} positions, more than its KV slot's {self.capacity}")
        self.pool_keys[self.slot, :, self.length : end] = key_states[0]
        self.pool_values[self.slot, :, self.length : end] = value_states[0]
        self.length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count (the number of positions to remove)")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a KV slot holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a KV slot holds one sequence")


class StaticHandle(CachedLM):
    """A :class:`~shared.kv.CachedLM` whose cache lives in one slot of a :class:`StaticBackend`'s pool."""

    def __init__(self, backend: StaticBackend, slot: int):
        self.backend, self.slot = backend, slot
        super().__init__(backend.model)
        self.capacity = backend.slot_tokens

    def reset(self) -> None:
        b = self.backend
        self.cache = Cache(layers=[SlotLayer(k, v, self.slot) for k, v in zip(b.pool_keys, b.pool_values)])
        self.recurrent = False
        self._sliding = False
        self._snapshot = None
        self._ids = []
        self.length = 0

    def close(self) -> None:
        """Give the slot back (idempotent); the handle must not be used afterwards."""
        if self.slot is not None:
            self.backend.release(self.slot)
            self.slot = None


class _PoolLayer(DynamicLayer):
    """A forward's cache layer over a backend's whole pool (not one sequence's): the forward gives every position,
    ``update`` writes into the pool and returns what attention reads."""

    def __init__(self, pool_keys: torch.Tensor, pool_values: torch.Tensor):
        self.pool_keys, self.pool_values = pool_keys, pool_values
        self.device = pool_keys.device
        self.is_initialized = True
        self.keys = self.values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def get_seq_length(self) -> int:
        return 0  # positions are always given


class _BatchSlotLayer(_PoolLayer):
    """A batched forward's layer over several slots: ``update`` writes row b's new positions into its slot at its
    own length and returns the rows' slots ``[:, :, :width]`` (row b: prefix in ``[0, L_b)``, new tokens from L_b)."""

    def __init__(self, pool_keys: torch.Tensor, pool_values: torch.Tensor, writes: list[tuple[int, int, int]],
                 index: torch.Tensor | None, first: int, width: int):
        super().__init__(pool_keys, pool_values)
        self.writes, self.index, self.first, self.width = writes, index, first, width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for b, (slot, start, count) in enumerate(self.writes):
            self.pool_keys[slot, :, start : start + count] = key_states[b, :, :count]
            self.pool_values[slot, :, start : start + count] = value_states[b, :, :count]
        if self.index is None:  # adjacent slots in order: a view, no copy
            rows = slice(self.first, self.first + len(self.writes))
            return self.pool_keys[rows, :, : self.width], self.pool_values[rows, :, : self.width]
        return (self.pool_keys[:, :, : self.width].index_select(0, self.index),
                self.pool_values[:, :, : self.width].index_select(0, self.index))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width, 0


def _slot_mask_and_positions(rows: list[Row], width: int, new: int,
                             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive mask [B, 1, T, width] and position ids [B, T] of a batched forward over slots: row b's new token
    t sits in column ``L_b + t`` and sees its prefix columns and its own new tokens up to itself (or what the row's
    ``visible`` says); padded slots see their row's first new token only (finite, ignored)."""
    visible = torch.zeros(len(rows), new, width, dtype=torch.bool)
    positions = torch.zeros(len(rows), new, dtype=torch.long)
    causal = torch.ones(new, new, dtype=torch.bool).tril()
    for b, row in enumerate(rows):
        length, count = row.lm.length, len(row.tokens)
        if row.visible is not None:
            visible[b, :count, : length + count] = row.visible
        else:
            visible[b, :count, :length] = True
            visible[b, :count, length : length + count] = causal[:count, :count]
        visible[b, count:, length] = True
        pos = torch.tensor(row.positions, dtype=torch.long) if row.positions is not None else \
            torch.arange(length, length + count)
        positions[b, :count] = pos
        positions[b, count:] = pos[-1]
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None], positions


class StaticBackend(TorchBackend):
    """Preallocated per-sequence KV slots (see the module's docstring)."""

    name = "static"
    handle_class: type[StaticHandle] = StaticHandle  # what ``open`` hands out for a slot

    def __init__(self, model: Any, slots: int, slot_tokens: int):
        super().__init__(model)
        problem = static_problem(model)
        if problem is not None:
            raise ValueError(f"the static backend cannot serve this model: {problem}")
        if slots < 1 or slot_tokens < 1:
            raise ValueError(f"a static backend needs at least one slot of one token (got {slots} × {slot_tokens})")
        self.slots, self.slot_tokens = slots, slot_tokens
        self.pool_keys, self.pool_values = self._allocate()
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.fallbacks = 0  # handles opened as dynamic ones (pool full, or a sequence longer than a slot)
        self._dtype = next(model.parameters()).dtype
        self._keeps_logits = CachedLM(model)._keeps_logits

    @torch.inference_mode()
    def _allocate(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One pool per layer, shaped after what a one-token forward caches (keys and values may differ: MLA)."""
        probe = CachedLM(self.model)
        probe.feed([0], last_logits_only=True)
        keys, values = [], []
        for layer in probe.cache.layers:
            k, v = layer.keys, layer.values
            keys.append(torch.zeros(self.slots, k.shape[1], self.slot_tokens, k.shape[3], dtype=k.dtype,
                                    device=k.device))
            values.append(torch.zeros(self.slots, v.shape[1], self.slot_tokens, v.shape[3], dtype=v.dtype,
                                      device=v.device))
        return keys, values

    @property
    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.pool_keys, *self.pool_values))

    def describe(self) -> str:
        return (f"static ({self.slots} slots of {self.slot_tokens} tokens, "
                f"{self.pool_bytes / 2**20:.1f} MiB of KV preallocated)")

    def open(self, tokens: int | None = None) -> CachedLM:
        if tokens is not None and tokens > self.slot_tokens:
            self.fallbacks += 1
            log.info("a sequence of up to %d tokens is longer than a KV slot (%d): it gets a dynamic cache",
                     tokens, self.slot_tokens)
            return CachedLM(self.model)
        if not self.free:
            self.fallbacks += 1
            log.warning("every one of the %d KV slots is taken: this sequence gets a dynamic cache", self.slots)
            return CachedLM(self.model)
        return self.handle_class(self, self.free.pop())

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self.free:
            raise ValueError(f"KV slot {slot} is not taken")
        self.free.append(slot)

    def can_batch(self) -> bool:
        return True  # static_problem refused the models that cannot

    def capacity_tokens(self) -> int:
        return self.slots * self.slot_tokens

    def _ours(self, lm: CachedLM) -> bool:
        return isinstance(lm, StaticHandle) and lm.backend is self and lm.slot is not None

    @torch.inference_mode()
    def feed_rows(self, rows: list[Row], want_hidden: bool = False, logits: bool = True) -> list[RowOutput]:
        """:func:`shared.batch.feed_rows` over slots: the new K/V go straight into each row's slot (rows holding a
        dynamic handle: the dynamic, copying path for the whole batch)."""
        if not rows or not all(self._ours(row.lm) for row in rows):
            return feed_rows(self.model, rows, want_hidden=want_hidden, logits=logits)
        if any(not row.tokens for row in rows):
            raise ValueError("every row must feed at least one token")
        if len(rows) == 1 and rows[0].positions is None and rows[0].visible is None:
            out, hidden = rows[0].lm.feed(rows[0].tokens, want_hidden=want_hidden, last_logits_only=not logits)
            return [RowOutput(out if logits else None, hidden)]
        for row in rows:
            if row.lm.length + len(row.tokens) > self.slot_tokens:
                raise SlotOverflow(f"a row would hold {row.lm.length + len(row.tokens)} positions, more than its "
                                   f"KV slot's {self.slot_tokens}")
        new = max(len(row.tokens) for row in rows)
        width = max(row.lm.length + len(row.tokens) for row in rows)
        device = rows[0].lm._device
        ids = torch.zeros(len(rows), new, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
        mask, positions = _slot_mask_and_positions(rows, width, new, self._dtype)
        slots = [row.lm.slot for row in rows]
        adjacent = slots == list(range(slots[0], slots[0] + len(slots)))
        writes = [(row.lm.slot, row.lm.length, len(row.tokens)) for row in rows]
        cache = Cache(layers=[
            _BatchSlotLayer(k, v, writes, None if adjacent else torch.tensor(slots, device=k.device), slots[0], width)
            for k, v in zip(self.pool_keys, self.pool_values)
        ])
        extra = {} if logits or not self._keeps_logits else {"logits_to_keep": 1}
        out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                         cache=cache, use_cache=True, output_hidden_states=want_hidden, **extra)
        results = []
        for b, row in enumerate(rows):
            count = len(row.tokens)
            for layer in row.lm.cache.layers:
                layer.length += count
            row.lm.grew(count)
            hidden = out.hidden_states[-1][b, :count] if want_hidden else None
            results.append(RowOutput(out.logits[b, :count].float() if logits else None, hidden))
        return results


def make_backend(model: Any, choice: str, slots: int, slot_tokens: int | None = None,
                 role: str = "verifier", compiled_tokens: int = DEFAULT_COMPILED_TOKENS,
                 thread_counts: Iterable[int] | None = None) -> TargetBackend:
    """The backend a node's ``backend`` key asks for. ``auto``, ``static`` and ``compiled``: static slots where the
    model allows them (:func:`static_problem`), else dynamic with one log line saying why; ``compiled`` also compiles
    its decode steps here for 1, 2, 4, … ``compiled_tokens`` new tokens at each of ``thread_counts`` (the node's
    planned counts; None: the current one) (:class:`CompiledBackend`, one log line per graph). ``slot_tokens`` (None:
    :data:`DEFAULT_SLOT_TOKENS`) is capped by the model's ``max_position_embeddings``."""
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{role}.backend must be one of {', '.join(BACKEND_CHOICES)}, got {choice!r}")
    if choice == "dynamic":
        return DynamicBackend(model)
    problem = static_problem(model)
    if problem is not None:
        say = log.warning if choice == "static" else log.info
        say("%s: KV backend %s falls back to dynamic caches: %s", role, choice, problem)
        return DynamicBackend(model)
    tokens = slot_tokens or DEFAULT_SLOT_TOKENS
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        tokens = min(tokens, positions)
    if choice == "compiled":
        backend: StaticBackend = CompiledBackend(model, slots, tokens, compiled_buckets(compiled_tokens))
        backend.warm_up(thread_counts)
    else:
        backend = StaticBackend(model, slots, tokens)
    log.info("%s: KV backend %s", role, backend.describe())
    return backend


# ---------------------------------------------------------------------------------------------------- compiled step
class _StepLayer(_PoolLayer):
    """A compiled step's cache layer over the whole pool: ``update`` writes the T new positions ``start …
    start + T - 1`` of the step's slot in place (``index_put_``; fixed shapes) and returns the slot's first
    ``step_width`` positions ``[1, kv_heads, width, head_dim]`` (the step's mask hides what lies beyond the
    sequence)."""

    def __init__(self, pool_keys: torch.Tensor, pool_values: torch.Tensor, step: CompiledBackend):
        super().__init__(pool_keys, pool_values)
        self.step = step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        slot, start = self.step.step_slot, self.step.step_start
        new = key_states.shape[-2]
        positions = (start + torch.arange(new, device=self.device))[None, :]
        slot_index = slot.view(1, 1)
        for pool, states in ((self.pool_keys, key_states), (self.pool_values, value_states)):
            heads = torch.arange(pool.shape[1], device=self.device)[:, None]
            pool.index_put_((slot_index, heads, positions), states[0])
        width = self.step.step_width
        return (self.pool_keys[:, :, :width].index_select(0, slot),
                self.pool_values[:, :, :width].index_select(0, slot))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.step_width, 0


def _widths(slot_tokens: int, smallest: int) -> tuple[int, ...]:
    """The attention widths of a compiled step: ``smallest``, doubled up to the slot's length, and that length."""
    widths, width = [], max(1, smallest)
    while width < slot_tokens:
        widths.append(width)
        width *= 2
    return (*widths, slot_tokens)


class CompiledBackend(StaticBackend):
    """Static slots whose single-sequence forwards of up to ``max(buckets)`` tokens run a ``torch.compile``d step
    with fixed shapes (the gpt-fast way): the T new tokens are padded up to their bucket (1, 2, 4, 8, 16), K/V are
    written into the slot with ``index_put_`` at positions held in a tensor, and attention runs over a fixed width
    of the slot (the smallest of ``min_width``, doubled up to the slot's length, that holds the sequence) with a
    mask built from that tensor, so neither the sequence's length nor its slot changes a shape and the step never
    recompiles per token: one graph per (bucket, width, thread count). CPU: inductor (``mode``, default None); CUDA:
    ``reduce-overhead`` (CUDA graphs). The thread count is part of the key because dynamo guards on it: a node's
    core leases switch its forwards between counts, and a graph met at a count it was not compiled for recompiled
    mid-request (the 68 ms compiled forwards against 10–16 ms eager measured on the fast target).

    A single row with its own positions and visibility (a drafter's flat pre-draft rows, a verifier's tree) runs
    the same step, its mask built from the row's visibility (:meth:`feed_rows`). What the step cannot serve takes
    the static backend's eager path on the same slot memory (same results): batched rows of several sequences,
    ``want_hidden``, forwards longer than the largest bucket (prefills) and the last ``max(buckets)`` positions of a
    slot. A compile or run failure switches the step off
    for good with one log line (never a crash). :meth:`warm_up` (``make_backend`` calls it at start-up) compiles
    every bucket at the smallest width for each thread count the node's forwards use, one log line each. Nothing
    compiles while a request waits: a step whose sequence has grown past the compiled width, or that runs at a thread
    count without graphs, runs the eager path (one log line per width or count), since a compile costs 15–50 s on a
    CPU (a request that crossed the first width once waited minutes for its graphs)."""

    name = "compiled"

    def __init__(self, model: Any, slots: int, slot_tokens: int, buckets: tuple[int, ...] = COMPILED_BUCKETS,
                 mode: str | None = None, min_width: int = 256):
        super().__init__(model, slots, slot_tokens)
        self.buckets = tuple(b for b in sorted(set(buckets)) if b <= slot_tokens)
        self.widths = _widths(slot_tokens, min_width)
        self.step_width = self.widths[0]
        self._compiled: set[tuple[int, int, int]] = set()  # (bucket, width, threads) graphs built
        self._eager_noted: set[tuple[int, int]] = set()  # (width, threads) whose steps ran eagerly (logged once)
        self._warming = False
        self.thread_counts: tuple[int, ...] = (torch.get_num_threads(),)
        self._allow_graphs(self.thread_counts)
        device = self.pool_keys[0].device
        cuda = device.type == "cuda"
        self.mode = mode if mode is not None else ("reduce-overhead" if cuda else None)
        self.step_slot = torch.zeros(1, dtype=torch.long, device=device)
        self.step_start = torch.zeros((), dtype=torch.long, device=device)
        self.compile_s: dict[int, float] = {}
        self.compiled_steps = 0  # forwards the compiled step served
        self.failure: str | None = None
        self._cache = Cache(layers=[_StepLayer(k, v, self) for k, v in zip(self.pool_keys, self.pool_values)])
        if cuda:
            for pool in (*self.pool_keys, *self.pool_values):
                torch._dynamo.mark_static_address(pool)
        try:
            self._step = torch.compile(self._eager_step, mode=self.mode, dynamic=False, fullgraph=False)
        except Exception as exc:  # any failure: the eager path serves
            self._fail(exc)

    def describe(self) -> str:
        state = f"off, eager static steps: {self.failure}" if self.failure else \
            f"buckets {', '.join(map(str, self.buckets))}, widths {', '.join(map(str, self.widths))}, " \
            f"mode {self.mode or 'default'}"
        return super().describe().replace("static (", "compiled static (", 1) + f", compiled step: {state}"

    def _fail(self, exc: BaseException) -> None:
        # inductor's first line is only "backend='inductor' raised:"; the cause is on the next one
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:2]
        self.failure = f"{type(exc).__name__}: {' '.join(lines)}"
        log.warning("compiled KV backend: torch.compile failed, every forward takes the eager static path (%s)",
                    self.failure)

    def _eager_step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The step compiled: one forward of ``ids`` [1, T] with position ids ``positions`` [1, T] and the additive
        ``mask`` [1, 1, T, width], whose K/V go to cache positions ``step_start …`` of slot ``step_slot``."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self._cache,
                         use_cache=True)
        return out.logits

    def _step_inputs(self, start: int, count: int, bucket: int, positions: list[int] | None,
                     visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids [1, bucket] and the additive mask [1, 1, bucket, step_width] of a step of ``count`` tokens
        at cache position ``start``: the causal rule, or a row's own ``positions`` and ``visible`` (bool
        [count, start + count]: flat pre-draft rows, trees). Padded tokens sit at the last position and see the
        columns up to their own cache position (finite, ignored); columns past the sequence are hidden."""
        width = self.step_width
        columns = torch.arange(width)
        if visible is None:
            seen = columns[None, :] <= (start + torch.arange(bucket))[:, None]
        else:
            seen = torch.zeros(bucket, width, dtype=torch.bool)
            seen[:count, : start + count] = visible
            seen[count:] = columns[None, :] <= (start + torch.arange(count, bucket))[:, None]
        pos = torch.arange(start, start + bucket)
        if positions is not None:
            pos[:count] = torch.tensor(positions, dtype=torch.long)
            pos[count:] = pos[count - 1]
        mask = torch.zeros(1, 1, bucket, width, dtype=self._dtype)
        mask.masked_fill_(~seen[None, None], torch.finfo(self._dtype).min)
        return pos[None, :], mask

    def bucket(self, count: int) -> int | None:
        return next((b for b in self.buckets if b >= count), None)

    def _allow_graphs(self, thread_counts: tuple[int, ...]) -> None:
        """Raise dynamo's per-function graph limit to every (bucket, width, thread count) this backend may build."""
        limits = torch._dynamo.config
        wanted = len(self.buckets) * len(self.widths) * len(thread_counts) + 8
        limits.recompile_limit = max(limits.recompile_limit, wanted)

    @torch.inference_mode()
    def warm_up(self, thread_counts: Iterable[int] | None = None) -> None:
        """Compile every bucket at the smallest width now, at each of ``thread_counts`` (None: the current count),
        on a free slot (its positions are written: nothing a handle holds); one log line per graph. The process's
        thread count is restored afterwards."""
        if not self.free:
            raise RuntimeError("compiled KV backend: warm_up needs a free slot (it writes the slot's positions)")
        slot = self.free[0]
        before = torch.get_num_threads()
        self.thread_counts = tuple(sorted({max(1, int(n)) for n in (thread_counts or (before,))}))
        self._allow_graphs(self.thread_counts)
        self._warming = True
        try:
            for threads in self.thread_counts:
                torch.set_num_threads(threads)
                for bucket in self.buckets:
                    if self.failure:
                        return
                    t0 = time.perf_counter()
                    self._run(slot, 0, [0] * bucket, bucket)
                    if self.failure:
                        return
                    took = time.perf_counter() - t0
                    self.compile_s[bucket] = self.compile_s.get(bucket, 0.0) + took
                    log.info("compiled KV backend: step of %d token(s) over %d positions at %d thread(s) compiled "
                             "in %.1f s", bucket, self.widths[0], threads, took)
        finally:
            torch.set_num_threads(before)
            self._warming = False
            self.compiled_steps = 0

    def width(self, end: int) -> int:
        """The attention width of a step whose padded tokens end at ``end``."""
        return next(w for w in self.widths if w >= end)

    def _run(self, slot: int, start: int, tokens: list[int], bucket: int, positions: list[int] | None = None,
             visible: torch.Tensor | None = None) -> torch.Tensor | None:
        """The compiled step's logits [count, vocab] (float32), or None when it failed (then switched off).
        ``positions``, ``visible``: a row's own position ids and visibility (:class:`shared.batch.Row`)."""
        device = self.step_slot.device
        ids = torch.zeros(1, bucket, dtype=torch.long)
        ids[0, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.step_slot.fill_(slot)
        self.step_start.fill_(start)
        self.step_width = self.width(start + bucket)
        position_ids, mask = self._step_inputs(start, len(tokens), bucket, positions, visible)
        graph = (bucket, self.step_width, torch.get_num_threads())
        fresh = graph not in self._compiled
        try:
            if self.mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs were copied out
            logits = self._step(ids.to(device), position_ids.to(device), mask.to(device))
        except Exception as exc:  # no C compiler, an unsupported op: eager from now on
            self._fail(exc)
            return None
        if fresh:
            self._compiled.add(graph)  # at warm-up only (serves() gives new graphs to the eager path)
        self.compiled_steps += 1
        return logits[0, : len(tokens)].float().clone()

    def serves(self, lm: CachedLM, count: int, want_hidden: bool) -> int | None:
        """The bucket the compiled step would run ``count`` new tokens of ``lm`` in (None: the eager path)."""
        if self.failure or want_hidden or not count or not self._ours(lm):
            return None
        bucket = self.bucket(count)
        if bucket is None or lm.length + bucket > self.slot_tokens:
            return None
        width = self.width(lm.length + bucket)
        threads = torch.get_num_threads()
        if (bucket, width, threads) not in self._compiled and not self._warming:
            if (width, threads) not in self._eager_noted:
                self._eager_noted.add((width, threads))
                log.info("compiled KV backend: no step compiled over %d positions at %d thread(s) (start-up "
                         "compiles %d positions at %s thread(s)); those steps run eagerly on the same slots", width,
                         threads, self.widths[0], ", ".join(map(str, self.thread_counts)))
            return None
        return bucket

    def feed_compiled(self, lm: CachedLM, tokens: list[int], want_hidden: bool = False,
                      positions: list[int] | None = None, visible: torch.Tensor | None = None) -> torch.Tensor | None:
        """Append ``tokens`` to ``lm``'s slot through the compiled step: their logits [count, vocab] (float32), or
        None where the step does not serve this forward (nothing was fed: take the eager path)."""
        bucket = self.serves(lm, len(tokens), want_hidden)
        if bucket is None:
            return None
        logits = self._run(lm.slot, lm.length, tokens, bucket, positions, visible)
        if logits is not None:
            for layer in lm.cache.layers:
                layer.length += len(tokens)
            lm.grew(len(tokens))
        return logits

    @torch.inference_mode()
    def feed_rows(self, rows: list[Row], want_hidden: bool = False, logits: bool = True) -> list[RowOutput]:
        """:meth:`StaticBackend.feed_rows`, where a single row of a few tokens with its own positions or visibility
        (a drafter's flat pre-draft rows, a tree) runs the compiled step; everything else as the static backend (a
        plain single row reaches the compiled step through its handle's ``feed``)."""
        if len(rows) == 1 and logits and (rows[0].positions is not None or rows[0].visible is not None):
            row = rows[0]
            out = self.feed_compiled(row.lm, row.tokens, want_hidden, row.positions, row.visible)
            if out is not None:
                return [RowOutput(out, None)]
        return super().feed_rows(rows, want_hidden=want_hidden, logits=logits)


class CompiledHandle(StaticHandle):
    """A static slot's handle whose small forwards go through its backend's compiled step."""

    backend: CompiledBackend

    @torch.inference_mode()
    def feed(self, token_ids: list[int], want_hidden: bool = False,
             last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.backend.feed_compiled(self, token_ids, want_hidden)
        if logits is not None:
            return (logits[-1:] if last_logits_only else logits), None
        return super().feed(token_ids, want_hidden=want_hidden, last_logits_only=last_logits_only)


CompiledBackend.handle_class = CompiledHandle  # its slots' small forwards go through the compiled step


# ---------------------------------------------------------------------------------------------------- the loader
@register_target_backend("auto", "dynamic", "static", "compiled")
def load_torch_target(verifier: Any, options: TargetOptions) -> Target:
    """A transformers target: the model (``verifier.model``, ``device``, ``dtype``, ``max_memory``) and its
    tokenizer, its cost profile (measured while no other node on this machine loads or measures: the drafter
    starts at the same time) and the KV backend ``verifier.backend`` names, with a slot per session batched at
    once (:func:`make_backend`)."""
    import contextlib

    from shared.costs.measure import measuring_alone
    from shared.models import load_causal_lm, load_tokenizer, profile_node, resolve_model
    from shared.node_keys import kv_slots

    path = resolve_model(verifier.model)
    tokenizer = options.tokenizer or load_tokenizer(path)
    spec = options.profile
    measure = spec is not None and spec.budget_s > 0
    profile = None
    with measuring_alone(verifier.device) if measure else contextlib.nullcontext():
        model = options.model or load_causal_lm(path, verifier.device, verifier.dtype, verifier.max_memory,
                                                profile=spec)
        if measure:
            profile = profile_node(model, verifier.model, verifier.device, spec, "verifier")
    slots = kv_slots(verifier.kv_slots, verifier.max_sessions, verifier.max_batch_sessions)
    backend = make_backend(model, verifier.backend, slots, verifier.kv_slot_tokens,
                           compiled_tokens=verifier.compiled_max_tokens, thread_counts=options.thread_counts)
    return torch_target(model, tokenizer, backend, name=verifier.model, profile=profile)
