"""Draft length per block.

* ``constant``: always ``num_draft_tokens``.
* ``heuristic``: transformers' schedule (all accepted → k + 2, else k − 1, never below 1).
* ``adaptive``: grows like heuristic but falls only when less than half the block was accepted.
* ``pipeline`` (the default): picks the k that maximises the speed model (DESIGN.md) from running estimates —
  E(α, k) / max(1, (k+1)·c) when drafting overlaps verification (a round drafts the next block and its bonus
  guess), E(α, k) / (1 + k·c) when it does not — with α the
  per-token acceptance and c = (drafter step time) / (verification round trip), both measured as the session runs.
  Overlapped, this keeps the drafter's block about one verification long, so neither side waits for the other.

All are capped at ``max_draft_tokens``.
"""

from __future__ import annotations

from typing import Any

SCHEDULES = ("constant", "heuristic", "adaptive", "pipeline")

_EMA = 0.3  # weight of the newest timing sample
_ALPHA_PRIOR = (4.0, 1.0)  # pseudo-counts (accepted, rejected): a mildly optimistic start
_DECAY = 0.9  # older acceptance evidence fades, so α follows the text being written


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per verification] = (1 − α^(k+1)) / (1 − α) (Leviathan et al. 2023)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class DraftLengthSchedule:
    def __init__(self, k: int, mode: str = "pipeline", max_k: int = 16, overlap: bool = True):
        self.k = k
        self.mode = mode
        self.max_k = max(max_k, k)
        self.overlap = overlap
        self.accepted, self.rejected = _ALPHA_PRIOR
        self.step_s: float | None = None
        self.roundtrip_s: float | None = None

    @classmethod
    def from_config(cls, dcfg: dict[str, Any]) -> DraftLengthSchedule:
        return cls(int(dcfg["num_draft_tokens"]), dcfg.get("draft_schedule", "pipeline"),
                   int(dcfg.get("max_draft_tokens", 16)), bool(dcfg.get("overlap", True)))

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def k_if_accepted(self) -> int:
        """The block length likely after the block in flight: how deep pre-drafting should go."""
        if self.mode == "constant":
            return self.k
        if self.mode == "pipeline":
            return min(self.k + 1, self.max_k)
        return min(self.k + 2, self.max_k)

    def observe_step(self, seconds: float) -> None:
        """One drafter step (one token, or one batched pre-draft step) took ``seconds``."""
        self.step_s = seconds if self.step_s is None else (1 - _EMA) * self.step_s + _EMA * seconds

    def observe_roundtrip(self, seconds: float) -> None:
        """A block's send → commit time (the verification round as the drafter sees it)."""
        self.roundtrip_s = seconds if self.roundtrip_s is None else (1 - _EMA) * self.roundtrip_s + _EMA * seconds

    def update(self, drafted: int, accepted: int) -> None:
        """Adjust after a block of ``drafted`` tokens had ``accepted`` of them accepted."""
        if self.mode == "constant" or drafted == 0:
            return
        if self.mode == "pipeline":
            self.accepted = _DECAY * self.accepted + accepted
            self.rejected = _DECAY * self.rejected + (1 if accepted < drafted else 0)
            self.k = self.best_k()
        elif accepted >= drafted:
            self.k = min(self.k + 2, self.max_k)
        elif self.mode == "heuristic" or 2 * accepted < drafted:
            self.k = max(1, self.k - 1)

    def best_k(self) -> int:
        if not self.step_s or not self.roundtrip_s:
            return self.k
        c = self.step_s / self.roundtrip_s  # the round trip is send → commit: verification plus transit
        alpha = self.alpha

        def speedup(k: int) -> float:
            # Overlapped, a round's drafting is the next block plus the guess of its bonus token: k + 1 steps.
            cost = max(1.0, (k + 1) * c) if self.overlap else 1.0 + k * c
            return expected_tokens(alpha, k) / cost

        return max(range(1, self.max_k + 1), key=speedup)
