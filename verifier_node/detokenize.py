"""Incremental detokenisation for streaming: each round decodes only the last round's tokens plus the new ones,
not the whole generation (the approach of vLLM's incremental detokenizer), and holds back text that ends in half a
multi-byte character until the next round completes it.

The hold-back is bounded: a UTF-8 character is at most 4 bytes, so at most 3 trailing tokens can be an unfinished
character. Text that genuinely ends in U+FFFD (the model emits it, or bytes that never complete) is emitted once
more than ``MAX_HELD`` tokens are pending, so the decoded window never grows with the output."""

from __future__ import annotations

# Tokens held back at most while the text ends in U+FFFD (a character spans at most 4 byte tokens).
MAX_HELD = 4


class IncrementalText:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context (tokenisers merge across boundaries)
        self.read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, text: str, prefix: str, upto: int) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, upto
        return text[len(prefix) :]

    def push(self, new_ids: list[int]) -> str:
        """Add committed tokens; return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        end = len(self.ids)
        if end - self.read_offset <= MAX_HELD and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return ""  # maybe half a character: the next round may complete it
        if len(full) <= len(prefix) or not full.endswith("\ufffd"):
            return self._emit(full, prefix, end)  # (tokens that decode to nothing are let go, not held forever)
        # Too much pending to be one unfinished character, which lies in the last MAX_HELD - 1 tokens if anywhere:
        # emit up to the last split that decodes cleanly, else up to the earliest such split, U+FFFD included (the
        # model's own U+FFFD, or bytes that never complete), so that at most MAX_HELD - 1 tokens stay held.
        text = full
        for upto in range(end - 1, end - MAX_HELD, -1):
            text = self._decode(self.ids[self.prefix_offset : upto])
            if len(text) > len(prefix) and not text.endswith("\ufffd"):
                return self._emit(text, prefix, upto)
        if len(text) > len(prefix):
            return self._emit(text, prefix, end - MAX_HELD + 1)
        return self._emit(full, prefix, end)
