"""A causal LM with one KV cache: feed new tokens, get their logits, roll back. Used by the verifier (the target)
and by model-based drafters, so cache handling and rollback are written once.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from shared.models import input_device


class CachedLM:
    """One sequence's KV cache over a shared model. ``length`` is the number of tokens the cache holds."""

    def __init__(self, model):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self._device = input_device(model)

    @torch.inference_mode()
    def feed(self, token_ids: list[int], want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``token_ids`` to the cache; return float32 logits for each of them (and last hidden states)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self._device)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, output_hidden_states=want_hidden)
        self.length += len(token_ids)
        hidden = out.hidden_states[-1][0] if want_hidden else None
        return out.logits[0].float(), hidden

    def crop(self, keep: int) -> None:
        """Drop cached positions beyond ``keep`` (rollback after a rejection)."""
        if keep < self.length:
            self.cache.crop(keep - self.length)  # transformers 5: a negative count removes that many tokens
            self.length = keep

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0
