"""One forward over several sequences that each keep their own KV cache: the mechanism behind batched verification
(many sessions' rounds in one target forward) and batched drafting (many sessions' draft steps in one drafter
forward).

Layout: every sequence keeps its own batch-1 ``DynamicCache`` (:class:`shared.kv.CachedLM`), so a session's prefill,
rollback (``crop``), K/V rows for drafters and pre-draft rows work exactly as for one sequence. A batched forward
stacks the rows' caches into one preallocated batch cache ``[B, heads, L_max + T, dim]`` per layer (row b's prefix in
columns ``[0, L_b)``, zeros behind it), writes the new tokens' K/V into columns ``[L_max, L_max + T)`` in place, and
runs the model over ``input_ids [B, T]`` (ragged rows padded to T) with each row's own position ids and a 4D additive
mask: row b's new token t sees its own prefix columns and its own new tokens up to t — never the zero padding of a
shorter prefix, never another row, never a padded slot. Afterwards each row's new K/V columns are appended to its own
cache. The price is two copies of the batch's K/V per forward (the stacking and the append); next to the weights a
forward reads that is small for short contexts, and it keeps one cache mechanism instead of two.

A row may also bring its own visibility over its cached positions and new tokens (pre-draft rows flattened into one
session's cache, :mod:`drafter_node.branches`) and its own position ids.

Not for sliding-window models (their layers keep only the window) nor attention kernels that ignore a custom mask:
a handle's ``batchable`` says so, and callers then run one forward per sequence.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from shared.kv import MASKABLE_ATTENTION, plain_attention
from shared.target import Row, RowOutput

__all__ = ["MASKABLE_ATTENTION", "Row", "RowOutput", "feed_rows", "plain_attention"]


class _FilledLayer(DynamicLayer):
    """A batch cache layer whose prefix columns are already stacked in a tensor with room for the new tokens: the
    forward's ``update`` writes them in place (no concatenation of the whole batch's K/V)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, prefix_len: int):
        super().__init__()
        self.device = keys.device
        self.keys, self.values = keys, values
        self.prefix_len = prefix_len
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.prefix_len + key_states.shape[-2]
        self.keys[:, :, self.prefix_len : end] = key_states
        self.values[:, :, self.prefix_len : end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.prefix_len


def _layer_shapes(rows: list[Row], layer: int, new: int) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
    """Shapes of one layer's stacked keys and values (they may differ: MLA caches keys and values of other widths)."""
    for row in rows:
        held = row.lm.cache.layers[layer]
        if row.lm.length and getattr(held, "keys", None) is not None:
            k, v = held.keys, held.values
            return (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), k.dtype
    raise ValueError("no row holds cached positions")


def _stacked_cache(model, rows: list[Row], prefix: int, new: int) -> DynamicCache:
    """A batch cache holding each row's cached positions in columns [0, L_b) and room for ``new`` tokens."""
    cache = DynamicCache(config=model.config)
    layers = []
    for index in range(len(cache.layers)):
        (kh, kd), (vh, vd), dtype = _layer_shapes(rows, index, new)
        device = rows[0].lm._device
        keys = torch.zeros(len(rows), kh, prefix + new, kd, dtype=dtype, device=device)
        values = torch.zeros(len(rows), vh, prefix + new, vd, dtype=dtype, device=device)
        for b, row in enumerate(rows):
            if row.lm.length:
                held = row.lm.cache.layers[index]
                keys[b, :, : row.lm.length] = held.keys[0]
                values[b, :, : row.lm.length] = held.values[0]
        layers.append(_FilledLayer(keys, values, prefix))
    cache.layers = layers
    return cache


def _mask_and_positions(rows: list[Row], prefix: int, new: int, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """The additive mask [B, 1, T, prefix + T] and position ids [B, T] of a batched forward."""
    visible = torch.zeros(len(rows), new, prefix + new, dtype=torch.bool)
    positions = torch.zeros(len(rows), new, dtype=torch.long)
    causal = torch.ones(new, new, dtype=torch.bool).tril()
    for b, row in enumerate(rows):
        length, count = row.lm.length, len(row.tokens)
        if row.visible is not None:
            visible[b, :count, :length] = row.visible[:, :length]
            visible[b, :count, prefix : prefix + count] = row.visible[:, length:]
        else:
            visible[b, :count, :length] = True
            visible[b, :count, prefix : prefix + count] = causal[:count, :count]
        # Padded slots see their own earlier slots: finite, ignored, and they never see a real row's columns.
        visible[b, count:, prefix : prefix + new] = causal[count:]
        pos = torch.tensor(row.positions, dtype=torch.long) if row.positions is not None else \
            torch.arange(length, length + count)
        positions[b, :count] = pos
        positions[b, count:] = pos[-1] if count else length
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None], positions


@torch.inference_mode()
def feed_rows(model, rows: list[Row], want_hidden: bool = False, logits: bool = True) -> list[RowOutput]:
    """Feed every row's tokens in one forward of ``model`` (all rows' ``lm`` share it); each row's cache gains its
    new positions, as ``CachedLM.feed`` would. One row with the default causal rule is exactly ``CachedLM.feed``.
    ``logits=False`` (prompts' prefill) skips the LM head but for one column: over every prompt position of a batch
    of prompts it would cost a large share of the forward and B·T·vocab floats of memory."""
    if not rows:
        return []
    if any(not row.tokens for row in rows):
        raise ValueError("every row must feed at least one token")
    if len(rows) == 1 and rows[0].positions is None and rows[0].visible is None:
        out, hidden = rows[0].lm.feed(rows[0].tokens, want_hidden=want_hidden, last_logits_only=not logits)
        return [RowOutput(out if logits else None, hidden)]
    lm0 = rows[0].lm
    prefix = max(row.lm.length for row in rows)
    new = max(len(row.tokens) for row in rows)
    dtype = next(model.parameters()).dtype
    device = lm0._device
    ids = torch.zeros(len(rows), new, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
    mask, positions = _mask_and_positions(rows, prefix, new, dtype)
    cache = _stacked_cache(model, rows, prefix, new) if prefix else DynamicCache(config=model.config)
    extra = {} if logits or not lm0._keeps_logits else {"logits_to_keep": 1}
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                cache=cache, use_cache=True, output_hidden_states=want_hidden, **extra)
    results = []
    for b, row in enumerate(rows):
        count = len(row.tokens)
        for index, layer in enumerate(cache.layers):
            k = layer.keys[b : b + 1, :, prefix : prefix + count]
            v = layer.values[b : b + 1, :, prefix : prefix + count]
            row.lm.cache.update(k, v, index)  # a copy (cat): the batch cache is dropped after this forward
        row.lm.grew(count)
        hidden = out.hidden_states[-1][b, :count] if want_hidden else None
        results.append(RowOutput(out.logits[b, :count].float() if logits else None, hidden))
    return results
