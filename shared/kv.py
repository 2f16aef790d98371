"""A causal LM with one KV cache: feed new tokens, get their logits, roll back. Used by the verifier (the target)
and by model-based drafters, so cache handling and rollback are written once.

Sliding-window layers (Gemma 2/3/4 and others) keep only their window in transformers' ``DynamicCache``; past
recording is switched on so that a rollback can restore the window, and every ``crop`` trims such layers back to it.

Hybrid and state-space models (Qwen3-Next's gated delta net, Mamba2, Falcon-H1, LFM2's short convolutions) keep
convolution and recurrent state in ``LinearAttentionLayer`` cache layers, which cannot be cropped: a state summarises
every token it has seen. Here each forward first keeps a copy of those states (:class:`StateSnapshot`, a few tensors
per layer, no sequence dimension); a rollback restores that copy, crops the attention layers to the same length and
re-feeds the kept tokens after it (for the verifier: the pending token and the accepted drafts). So a rejection
costs one more forward over the accepted tokens (counted in ``CachedLM.refed_total``; the drafter's cost model
charges it from the verifier's curve, ``drafter_node.cost_model.rollback_s``). A model whose cache holds a layer kind
none of this covers is refused when it is loaded (:func:`rollback_problem`).

A drafter feeds one token per forward, so its last forward's snapshot lies past a rejection; it marks rollback
points (:meth:`CachedLM.anchor`) at its committed length before drafting a block, and where the block's commit would
land when it pre-drafts past it, and a rejection restores the latest one before it and re-feeds the accepted drafts
only: a block's worth of tokens, not the whole context (a model that also has sliding-window layers still rebuilds
from the start).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from shared.devices import input_device
from shared.target import KVRowsError

#: Attention implementations that take a custom 4D additive mask as given (transformers' mask builders return a 4D
#: mask as is; eager adds it to the scores, sdpa passes it as ``attn_mask``).
MASKABLE_ATTENTION = ("eager", "sdpa")

#: Rollback points a recurrent cache keeps (:meth:`CachedLM.anchor`): a drafter's committed length and the end of the
#: block in flight; each holds a copy of the recurrent states (no sequence dimension).
MAX_ANCHORS = 2


def _is_recurrent(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def plain_attention(layer) -> bool:
    """A cache layer that holds every position's K/V and nothing else: a ``DynamicLayer`` or a static slot's layer
    (:class:`shared.backend.SlotLayer`)."""
    return type(layer) is DynamicLayer or getattr(layer, "slot_backed", False)


def rollback_problem(config) -> str | None:
    """Why a rejected draft could not be rolled back exactly in the cache of a model with this ``config`` (None: it
    can).

    Supported cache layers: attention (``DynamicLayer``), sliding-window attention, KV-sharing layers that hold
    nothing of their own (``DummyLayer``, Gemma 3n / 4), and layers holding convolution or recurrent state
    (``LinearAttentionLayer``, alone or with full attention in one layer). Checked when a node loads its model, so an
    unsupported model fails at start, not at its first rejected draft."""
    model_type = getattr(config, "model_type", type(config).__name__)
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:
        return f"model type {model_type!r}: transformers cannot build a DynamicCache for it ({exc})"
    for index, layer in enumerate(cache.layers):
        recurrent, sliding = _is_recurrent(layer), isinstance(layer, DynamicSlidingWindowLayer)
        if recurrent and sliding:
            return (f"model type {model_type!r}: cache layer {index} ({type(layer).__name__}) mixes recurrent state "
                    "with a sliding window, which pipespec cannot roll back")
        if not (recurrent or isinstance(layer, DynamicLayer | DummyLayer)):  # DummyLayer: reuses another's K/V
            return (f"model type {model_type!r}: cache layer {index} is a {type(layer).__name__}, which pipespec "
                    "cannot roll back after a rejected draft (supported: attention, sliding-window attention, "
                    "linear-attention / state-space layers)")
    return None


@dataclass
class StateSnapshot:
    """The convolution and recurrent states of a cache's recurrent layers at ``length`` cached tokens."""

    length: int
    layers: dict[int, dict[str, object]]

    @classmethod
    def take(cls, cache: DynamicCache, length: int) -> StateSnapshot:
        layers = {}
        for index, layer in enumerate(cache.layers):
            if _is_recurrent(layer):
                layers[index] = {
                    "conv": {i: None if t is None else t.clone() for i, t in layer.conv_states.items()},
                    "recurrent": {i: None if t is None else t.clone() for i, t in layer.recurrent_states.items()},
                    "previous": dict(layer.has_previous_state),
                    "conv_init": dict(layer.is_conv_states_initialized),
                    "recurrent_init": dict(layer.is_recurrent_states_initialized),
                    "count": layer.cumulative_length_linear.clone(),
                }
        return cls(length, layers)

    def restore(self, cache: DynamicCache) -> None:
        """Put the recurrent layers back as they were (the snapshot's tensors are handed over, not copied again)."""
        for index, saved in self.layers.items():
            layer = cache.layers[index]
            layer.conv_states, layer.recurrent_states = saved["conv"], saved["recurrent"]
            layer.has_previous_state = saved["previous"]
            layer.is_conv_states_initialized = saved["conv_init"]
            layer.is_recurrent_states_initialized = saved["recurrent_init"]
            layer.cumulative_length_linear = saved["count"]


class SequenceCache:
    """What every one-sequence cache keeps besides its memory: how many tokens it holds and was fed, and the rule
    for what to feed next. :class:`CachedLM` (torch), ``drafter_node.gguf.LlamaSequence`` and
    ``shared.llama_target.LlamaHandle`` (llama.cpp) build on it; a subclass gives ``feed`` and ``crop``."""

    def __init__(self, model):
        self.model = model
        self.length = 0
        self.last_fed = 0  # tokens of the last forward (a cost-curve sample's size)
        self.fed_total = 0  # tokens of every forward so far (a step that ran more than one forward is no sample)
        self.refed_total = 0  # tokens fed again to roll back recurrent state (hybrid models)
        self.capacity: int | None = None  # the most positions the cache can hold (None: no bound of its own)

    #: Flags of the handle protocol (shared.target.SequenceHandle); a subclass sets what it supports.
    recurrent = False
    batchable = False
    trees = False

    @property
    def batch_key(self):
        """Handles over the same model may share a forward."""
        return self.model

    def feed(self, token_ids: list[int], want_hidden: bool = False,
             last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def crop(self, keep: int) -> None:
        raise NotImplementedError

    def grew(self, count: int) -> None:
        """A forward appended ``count`` positions to the cache (here, in a batched forward, or a tree round)."""
        self.length += count
        self.last_fed = count
        self.fed_total += count

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits for the token after the sequence ``ids`` (whose first ``length`` tokens are cached), feeding
        whatever the cache does not hold yet."""
        logits, _ = self.feed(self.uncached(ids), last_logits_only=True)
        return logits[-1]

    def uncached(self, ids: list[int]) -> list[int]:
        """The tokens of ``ids`` (whose first ``length`` tokens are cached) to feed for the logits after its last
        one: what the cache does not hold yet, at least the last token (the cache is cropped before it if need
        be). What :meth:`next_logits` feeds, and a batched drafter step's row (:mod:`shared.batch`)."""
        if self.length >= len(ids):
            self.crop(len(ids) - 1)  # need at least the last token's forward to get its logits
        return ids[self.length :]

    @property
    def room(self) -> int | None:
        """How many more positions the cache can take (None: no bound of its own; see shared.backend)."""
        return None if self.capacity is None else self.capacity - self.length

    def restore(self, keep: int) -> None:
        """Hold exactly the first ``keep`` positions again after a forward that failed part-way."""
        self.crop(keep)
        self.length = keep

    def anchor(self) -> None:
        """A rollback point (recurrent state only; nothing to mark here)."""

    def close(self) -> None:
        """The sequence ended: its memory goes back (nothing held here)."""

    def check_kv_layers(self, layers: list[int]) -> None:
        """Raise :class:`KVRowsError` unless the memory gives K/V rows of ``layers`` (here: none)."""
        if layers:
            raise KVRowsError(f"a {type(self).__name__} gives no K/V rows")

    def new_rows(self, layers: list[int], fed: int, kept: int) -> dict[str, torch.Tensor]:
        self.check_kv_layers(layers)
        return {}

    def held_rows(self, layers: list[int]) -> dict[str, torch.Tensor]:
        self.check_kv_layers(layers)
        return {}


class CachedLM(SequenceCache):
    """One sequence's KV cache over a shared model. ``length`` is the number of tokens the cache holds."""

    def __init__(self, model):
        super().__init__(model)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._device = input_device(model)
        self._maskable = getattr(model.config, "_attn_implementation", "eager") in MASKABLE_ATTENTION
        self._anchors: list[StateSnapshot] = []  # rollback points the owner marked (recurrent caches only)
        self.reset()

    @torch.inference_mode()
    def feed(self, token_ids: list[int], want_hidden: bool = False,
             last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``token_ids`` to the cache; return float32 logits for each of them (``last_logits_only``: for the
        last one only, which skips the LM head over the others: a prompt's prefill needs none of them) and the last
        hidden states."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self._device)
        extra = {"logits_to_keep": 1} if last_logits_only and self._keeps_logits else {}
        if self.recurrent:
            self._snapshot = StateSnapshot.take(self.cache, self.length)
            del self._ids[self.length :]  # in place: no copy of the whole context per forward
            self._ids.extend(token_ids)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, output_hidden_states=want_hidden, **extra)
        self.grew(len(token_ids))
        hidden = out.hidden_states[-1][0] if want_hidden else None
        return out.logits[0].float(), hidden

    @property
    def batchable(self) -> bool:
        """Ragged batched forwards with a custom mask (:mod:`shared.batch`): no sliding-window layers, a maskable
        attention kernel, plain attention layers only."""
        return not self._sliding and self._maskable and all(plain_attention(layer) for layer in self.cache.layers)

    @property
    def trees(self) -> bool:
        """Forwards with their own positions and visibility on this cache (:meth:`feed_masked`): the same rule (a
        sliding layer keeps only its window, so R new slots per step would push out positions rows still need)."""
        return self.batchable

    @torch.inference_mode()
    def feed_masked(self, tokens: list[int], positions: list[int], visible: torch.Tensor,
                    want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of ``tokens`` directly on this cache (no copy of it) at ``positions``, token t seeing what
        ``visible[t]`` says of the cached positions and the new tokens (bool ``[T, length + T]``): float32 logits
        and, when asked, the last hidden states. The cache grows by T positions (token trees, pre-draft rows)."""
        if not self.trees:
            raise ValueError("masked forwards need eager or sdpa attention and no sliding-window layers")
        dtype = self.cache_dtype()
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        out = self.model(
            input_ids=torch.tensor([tokens], dtype=torch.long, device=self._device),
            attention_mask=mask[None, None].to(self._device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=self._device),
            cache=self.cache,
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        self.grew(len(tokens))
        hidden = out.hidden_states[-1][0] if want_hidden else None
        return out.logits[0].float(), hidden

    def cache_dtype(self) -> torch.dtype:
        """The dtype of the model's weights (what an additive mask is built in)."""
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def keep_positions(self, prefix: int, positions: list[int]) -> None:
        """Keep the first ``prefix`` cached positions and then ``positions`` (ascending, each ≥ ``prefix``), moved
        in place to follow them; drop the rest. Only the moved positions are read and written (``index_select``
        reads them out first, so the write may overlap them); those already in place are not touched."""
        if prefix < 0 or any(p < prefix or p >= self.length for p in positions) or positions != sorted(positions):
            raise ValueError(f"cannot keep positions {positions} after {prefix} of {self.length} cached")
        first = next((j for j, p in enumerate(positions) if p != prefix + j), len(positions))
        if first < len(positions):
            src = torch.tensor(positions[first:], dtype=torch.long, device=self.cache.layers[0].keys.device)
            lo, hi = prefix + first, prefix + len(positions)
            for layer in self.cache.layers:
                layer.keys[..., lo:hi, :] = layer.keys.index_select(-2, src)
                layer.values[..., lo:hi, :] = layer.values.index_select(-2, src)
        self.crop(prefix + len(positions))

    def crop(self, keep: int) -> None:
        """Drop cached positions beyond ``keep`` (rollback after a rejection); trim sliding layers to their window."""
        if self.recurrent:
            self._roll_back_states(keep)
        elif keep < self.length or self._sliding:
            self.cache.crop(min(0, keep - self.length))  # transformers 5: a negative count removes that many tokens
            self.length = min(keep, self.length)

    def restore(self, keep: int) -> None:
        """Hold exactly the first ``keep`` positions again after a forward that failed part-way (a batched forward
        whose caches grew, some rows' or layers' and not others'): every layer that grew past ``keep`` is cut,
        whatever ``length`` says, and ``length`` is ``keep``. Attention layers only (recurrent and sliding caches
        take :meth:`crop`, which restores their states)."""
        if self.recurrent or self._sliding:
            if keep < self.length:
                self.crop(keep)
            return
        for layer in self.cache.layers:
            held = layer.get_seq_length() if getattr(layer, "is_initialized", True) else 0
            if held > keep:
                layer.crop(keep - held)  # a negative count: that many positions removed
        self.length = keep

    def anchor(self) -> None:
        """Mark the current length as a rollback point (recurrent caches; a no-op for others): a later ``crop`` to
        a length from here on that lies before the last forward's start restores this state and re-feeds only the
        tokens after it, not the whole sequence. The latest :data:`MAX_ANCHORS` points are kept; a crop before one
        forgets it. Not with sliding layers, which keep past their window only the positions since the last crop:
        those rebuild as before."""
        if not self.recurrent or self._sliding or any(a.length == self.length for a in self._anchors):
            return
        self._anchors.append(StateSnapshot.take(self.cache, self.length))
        del self._anchors[:-MAX_ANCHORS]

    def _roll_back_states(self, keep: int) -> None:
        """``crop`` for a cache with recurrent layers: back to the last forward's start (or the anchor, where that
        lies past ``keep``), then re-feed up to ``keep``."""
        if keep >= self.length:
            self._crop_attention(0)  # sliding layers: trim the recorded round back to the window
            return
        snapshot, ids = self._snapshot, self._ids[:keep]
        self._anchors = [a for a in self._anchors if a.length <= keep]  # the others summarise tokens being dropped
        if (snapshot is None or snapshot.length > keep) and self._anchors:
            # restore a copy: the anchor stays a rollback point (forwards update the live state in place)
            anchor = self._anchors[-1]
            anchor.restore(self.cache)
            self._anchors[-1] = StateSnapshot.take(self.cache, anchor.length)
            self._crop_attention(self.length - anchor.length)
            self.length, self._snapshot = anchor.length, None
            self.refed_total += keep - anchor.length
        elif snapshot is None or snapshot.length > keep:  # before the last forward's start: rebuild from the start
            self.reset()
            self.refed_total += keep
        else:
            snapshot.restore(self.cache)
            self._crop_attention(self.length - snapshot.length)
            self.length, self._snapshot = snapshot.length, None
            self.refed_total += keep - snapshot.length
        if keep > self.length:
            self.feed(ids[self.length :], last_logits_only=True)

    def _crop_attention(self, count: int) -> None:
        """Remove the last ``count`` positions from the attention layers (recurrent layers are restored instead)."""
        for layer in self.cache.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                DynamicSlidingWindowLayer.crop(layer, -count)
            elif isinstance(layer, DynamicLayer) and count:
                DynamicLayer.crop(layer, -count)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.recurrent = any(_is_recurrent(layer) for layer in self.cache.layers)
        self._sliding = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
        self._snapshot: StateSnapshot | None = None
        self._anchors = []
        self._ids: list[int] = []  # the cached tokens, kept only for recurrent caches (their rollback re-feeds)
        if self._sliding and not self.recurrent:
            # Keep a round's states until ``crop`` so a sliding layer can be rolled back past its window.
            self.cache.activate_past_recording()
        elif self._sliding:  # the sliding layers only: a recurrent layer recording its past keeps a state per token
            for layer in self.cache.layers:
                if getattr(layer, "is_sliding", False) and not _is_recurrent(layer):
                    layer.activate_past_recording()
        self.length = 0

    def close(self) -> None:
        """The sequence ended: give its KV memory back (a ``DynamicCache`` is simply dropped)."""

    def check_kv_layers(self, layers: list[int]) -> None:
        """Raise :class:`KVRowsError` unless every index in ``layers`` is a cache layer that stores K/V itself."""
        count = len(self.cache.layers)
        for index in layers:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
                raise KVRowsError(f"K/V layer {index!r} does not exist (the target's cache has layers 0..{count - 1})")
            if not isinstance(self.cache.layers[index], DynamicLayer):  # e.g. DummyLayer: a KV-sharing consumer
                raise KVRowsError(f"target layer {index} keeps no K/V of its own (it reuses another layer's)")

    def new_rows(self, layers: list[int], fed: int, kept: int) -> dict[str, torch.Tensor]:
        """K/V rows of the positions just fed, before ``crop``: of the last ``fed`` positions the first ``kept``.

        One tensor per layer, ``kv.{layer}`` of shape [2 (key, value), kv_heads, kept, head_dim] (batch row 0).
        Call between ``feed`` and ``crop``: a sliding layer holds the round's rows until then.
        """
        rows = {}
        for index in layers:
            layer = self.cache.layers[index]
            keys, values = layer.keys[0], layer.values[0]
            if keys.shape[-2] < fed:
                raise KVRowsError(f"layer {index} holds {keys.shape[-2]} positions, fewer than the {fed} just fed")
            start = keys.shape[-2] - fed
            rows[f"kv.{index}"] = torch.stack([keys[:, start : start + kept], values[:, start : start + kept]])
        return rows

    def held_rows(self, layers: list[int]) -> dict[str, torch.Tensor]:
        """Every K/V row the cache holds for ``layers`` (a sliding layer: its window), same layout as ``new_rows``."""
        rows = {}
        for index in layers:
            layer = self.cache.layers[index]
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                rows[f"kv.{index}"] = torch.stack([layer.keys[0], layer.values[0]])
        return rows
