"""Stop strings over streamed text: text is released as soon as it cannot be the start of a stop string, so a stop
split across two chunks (or two tokens) is still caught and never shown in part."""

from __future__ import annotations


class StopMatcher:
    """Feed text with :meth:`push`; it returns what may be shown now and whether a stop string matched (then the
    text before the match that completes first is the last output, the stop string itself is not included).
    :meth:`flush` releases what is held back once the generation ends without a match."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        buffer = self._held + text
        if not self.stops:
            self._held = ""
            return buffer, False
        # The stop that completes first wins (then the one that starts first): the same cut however the text is
        # split into pieces, and what a server checking after every token does. Held text never holds a whole stop
        # (it would have matched on an earlier push), so every match ends in the new text.
        best = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < (best[0] + len(best[1]), best[0])):
                best = (at, stop)
        if best is not None:
            self._held = ""
            self.matched = best[1]
            return buffer[: best[0]], True
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """What was held back (the generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of ``buffer`` that is a proper beginning of some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:k]):
                    longest = k
                    break
        return longest
