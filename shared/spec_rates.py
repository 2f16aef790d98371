"""Speculation's two rates, computed in one place for the runtime, the bench and the metrics.

- α, the acceptance rate: accepted draft tokens ÷ drafted tokens (verified ones; a tree's nodes count as drafted).
- τ, tokens per drafting round: 1 + accepted draft tokens ÷ drafts (the rounds that verified a draft commit their
  accepted tokens plus the target's own one). Rounds without a draft are not in τ.
- k̄, the mean block: drafted tokens ÷ drafts.

Each rate is None where its denominator is 0 (nothing drafted), unless the caller names the value it shows then
(the request metrics show α 0 and τ 1: a request that never drafted committed one token per round).
:class:`SpecCounts` sums the counts of several requests (their ``metrics`` maps, docs/metrics.md) before taking
the rates: a ratio of sums, never a mean of ratios.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def acceptance_rate(accepted: int, drafted: int, empty: float | None = None) -> float | None:
    """α = ``accepted / drafted``; ``empty`` where nothing was drafted."""
    return accepted / drafted if drafted else empty


def tokens_per_round(accepted: int, drafts: int, empty: float | None = None) -> float | None:
    """τ = ``1 + accepted / drafts``: tokens a drafting round commits; ``empty`` where no round drafted."""
    return 1 + accepted / drafts if drafts else empty


def mean_block(drafted: int, drafts: int, empty: float | None = None) -> float | None:
    """k̄ = ``drafted / drafts``; ``empty`` where no round drafted."""
    return drafted / drafts if drafts else empty


def per_position(accepted: Sequence[int], drafted: Sequence[int]) -> list[float]:
    """α at each draft position: ``accepted[i] / drafted[i]`` (0.0 at a position never drafted)."""
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


@dataclass
class SpecCounts:
    """The counts the rates come from: ``drafts`` (rounds that verified a draft), ``draft_tokens``,
    ``accepted_tokens``. Add two with ``+``; :meth:`of` reads one request's metrics, :meth:`total` sums many."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @classmethod
    def of(cls, metrics: Mapping[str, Any]) -> SpecCounts:
        """The counts in one ``metrics`` map (a request's, or an in-process generator's stats); missing or None
        counts read 0."""
        return cls(int(metrics.get("drafts") or 0), int(metrics.get("draft_tokens") or 0),
                   int(metrics.get("accepted_tokens") or 0))

    @classmethod
    def total(cls, many: Iterable[Mapping[str, Any]]) -> SpecCounts:
        """The counts of several requests, summed."""
        out = cls()
        for metrics in many:
            out += cls.of(metrics)
        return out

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                          self.accepted_tokens + other.accepted_tokens)

    @property
    def alpha(self) -> float | None:
        """α (None: nothing drafted)."""
        return acceptance_rate(self.accepted_tokens, self.draft_tokens)

    @property
    def tau(self) -> float | None:
        """τ (None: no round drafted)."""
        return tokens_per_round(self.accepted_tokens, self.drafts)

    @property
    def mean_k(self) -> float | None:
        """k̄ (None: no round drafted)."""
        return mean_block(self.draft_tokens, self.drafts)
