"""Draft length per block: constant, or adaptive.

``heuristic`` is transformers' schedule (all accepted → k + 2, else k − 1, never below 1). ``adaptive`` (the
default) grows like heuristic but falls only when less than half the block was accepted, so one late miss does
not shrink a block that mostly pays; both are capped at ``max_draft_tokens`` so a lucky streak does not make
blocks longer than the verifier checks in one cheap forward.
"""

from __future__ import annotations

from typing import Any

SCHEDULES = ("constant", "heuristic", "adaptive")


class DraftLengthSchedule:
    def __init__(self, k: int, mode: str = "adaptive", max_k: int = 16):
        self.k = k
        self.mode = mode
        self.max_k = max(max_k, k)

    @classmethod
    def from_config(cls, dcfg: dict[str, Any]) -> DraftLengthSchedule:
        return cls(int(dcfg["num_draft_tokens"]), dcfg.get("draft_schedule", "adaptive"),
                   int(dcfg.get("max_draft_tokens", 16)))

    def k_if_accepted(self) -> int:
        """The block length after a fully accepted block: what pre-drafting should aim for."""
        return self.k if self.mode == "constant" else min(self.k + 2, self.max_k)

    def update(self, drafted: int, accepted: int) -> None:
        """Adjust after a block of ``drafted`` tokens had ``accepted`` of them accepted."""
        if self.mode == "constant" or drafted == 0:
            return
        if accepted >= drafted:
            self.k = min(self.k + 2, self.max_k)
        elif self.mode == "heuristic" or 2 * accepted < drafted:
            self.k = max(1, self.k - 1)
