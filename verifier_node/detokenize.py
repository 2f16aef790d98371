"""Incremental detokenisation for streaming: each round decodes only the last round's tokens plus the new ones,
not the whole generation (the approach of vLLM's incremental detokenizer), and holds back text that ends in half a
multi-byte character until the next round completes it."""

from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context (tokenisers merge across boundaries)
        self.read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        """Add committed tokens; return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
