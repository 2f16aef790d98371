"""A causal LM with one KV cache: feed new tokens, get their logits, roll back. Used by the verifier (the target)
and by model-based drafters, so cache handling and rollback are written once.

Sliding-window layers (Gemma 2/3/4 and others) keep only their window in transformers' ``DynamicCache``; past
recording is switched on so that a rollback can restore the window, and every ``crop`` trims such layers back to it.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from shared.devices import input_device


class KVRowsError(ValueError):
    """A drafter asked for K/V rows of layers this model's cache does not hold."""


class CachedLM:
    """One sequence's KV cache over a shared model. ``length`` is the number of tokens the cache holds."""

    def __init__(self, model):
        self.model = model
        self.length = 0
        self.last_fed = 0  # tokens of the last forward (a cost-curve sample's size)
        self.fed_total = 0  # tokens of every forward so far (a step that ran more than one forward is no sample)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._device = input_device(model)
        self.reset()

    @torch.inference_mode()
    def feed(self, token_ids: list[int], want_hidden: bool = False,
             last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``token_ids`` to the cache; return float32 logits for each of them (``last_logits_only``: for the
        last one only, which skips the LM head over the others: a prompt's prefill needs none of them) and the last
        hidden states."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self._device)
        extra = {"logits_to_keep": 1} if last_logits_only and self._keeps_logits else {}
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, output_hidden_states=want_hidden, **extra)
        self.grew(len(token_ids))
        hidden = out.hidden_states[-1][0] if want_hidden else None
        return out.logits[0].float(), hidden

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

    def crop(self, keep: int) -> None:
        """Drop cached positions beyond ``keep`` (rollback after a rejection); trim sliding layers to their window."""
        if keep < self.length or self._sliding:
            self.cache.crop(min(0, keep - self.length))  # transformers 5: a negative count removes that many tokens
            self.length = min(keep, self.length)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._sliding = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
        if self._sliding:
            # Keep a round's states until ``crop`` so a sliding layer can be rolled back past its window.
            self.cache.activate_past_recording()
        self.length = 0

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
