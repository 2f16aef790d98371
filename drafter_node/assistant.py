"""``assistant`` drafter: a small model that shares the target's tokenizer (classic speculative decoding)."""

from __future__ import annotations

from typing import Any

import torch

from drafter_node.base import Capabilities, Drafter, DraftSession
from drafter_node.lm_drafter import LMDraftSession, drafter_backend
from drafter_node.settings import DrafterConfig
from shared.models import ProfileSpec, load_causal_lm, load_tokenizer, resolve_model, tokenizer_id
from shared.sampling import GenerationParams


class AssistantDrafter(Drafter):
    type_name = "assistant"

    def __init__(self, settings: DrafterConfig, own: Any = None, profile: ProfileSpec | None = None):
        path = resolve_model(settings.model)
        self.tokenizer = load_tokenizer(path)
        self.tokenizer_id = tokenizer_id(self.tokenizer)
        self.model = load_causal_lm(path, settings.device, settings.dtype, settings.max_memory,
                                    config=self.model_config(path, own), profile=profile)
        # Where the sessions' KV caches live (drafter.backend); a compiled one builds steps at the node's threads.
        self.backend = drafter_backend(self.model, settings, profile.threads if profile else None)
        self.max_draft_tokens = settings.max_draft_tokens
        self.q_top_m = settings.q_top_k
        self.capabilities = Capabilities(sends_q=True, greedy_q=True)
        self.target_vocab_size = self.model.config.vocab_size  # replaced by the verifier's at connect time

    @property
    def profile_model(self):
        return self.model

    def model_config(self, path: str, own: Any):
        """The architecture to build (None: the checkpoint's own). Subtypes shape the drafter here from their own
        settings (``own``; the assistant has none)."""
        return None

    def open_session(
        self, token_ids: list[int], prompt_len: int, params: GenerationParams, extras: dict[str, torch.Tensor]
    ) -> DraftSession:
        return LMDraftSession(self.backend, token_ids, prompt_len, params, self.q_top_m, self.target_vocab_size,
                              max_draft_tokens=self.max_draft_tokens)
