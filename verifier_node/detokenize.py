"""Incremental detokenisation for streaming: each round decodes only the last round's tokens plus the new ones,
not the whole generation (the approach of vLLM's incremental detokenizer), and holds back text that ends in half a
multi-byte character until the next round completes it.

The hold-back is bounded: a UTF-8 character is at most 4 bytes, so at most 3 trailing tokens can be an unfinished
character. Text that genuinely ends in U+FFFD (the model emits it, or bytes that never complete) is emitted once
more than ``MAX_HELD`` tokens are pending, so the decoded window never grows with the output."""

from __future__ import annotations

# Tokens held back at most while the text ends in U+FFFD (a character spans at most 4 byte tokens).
MAX_HELD = 4


#: Special tokens that open a tool call in some families (Llama 3.1's ``<|python_tag|>``, Mistral's
#: ``[TOOL_CALLS]``): a request with tools keeps them in its text, where the parser looks for them.
TOOL_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")


def tool_marker_ids(tokenizer) -> frozenset[int]:
    """The ids of :data:`TOOL_MARKERS` that are special tokens of ``tokenizer`` (the text drops them otherwise)."""
    special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    special.update(getattr(tokenizer, "all_special_ids", []) or [])
    ids = {tokenizer.convert_tokens_to_ids(m) for m in TOOL_MARKERS}
    return frozenset(i for i in ids if isinstance(i, int) and i in special)


def decode(tokenizer, ids: list[int], keep: frozenset[int] = frozenset()) -> str:
    """``ids`` as text without special tokens, except those in ``keep``."""
    if not keep or not keep.intersection(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    # decoded in runs between the kept tokens, so every other special token is skipped as before
    out, run = [], []
    for i in ids:
        if i in keep:
            out += [tokenizer.decode(run, skip_special_tokens=True), tokenizer.decode([i])]
            run = []
        else:
            run.append(i)
    return "".join(out) + tokenizer.decode(run, skip_special_tokens=True)


class IncrementalText:
    def __init__(self, tokenizer, keep: frozenset[int] = frozenset()) -> None:
        """``keep``: special token ids kept in the text (:func:`tool_marker_ids`, for a request with tools)."""
        self.tokenizer = tokenizer
        self.keep = keep
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context (tokenisers merge across boundaries)
        self.read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, self.keep)

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
