"""α, τ and the mean block from shared.spec_rates: the one place the runtime, the bench and the metrics take them."""

from __future__ import annotations

import pytest

from shared.spec_rates import SpecCounts, acceptance_rate, mean_block, per_position, tokens_per_round

pytestmark = pytest.mark.unit


def test_the_rates_of_counts():
    assert acceptance_rate(3, 4) == 0.75 and tokens_per_round(3, 2) == 2.5 and mean_block(4, 2) == 2.0
    assert per_position([2, 1, 0], [2, 2, 0]) == [1.0, 0.5, 0.0]


def test_nothing_drafted_gives_the_callers_empty_value():
    assert acceptance_rate(0, 0) is None and tokens_per_round(0, 0) is None and mean_block(0, 0) is None
    assert acceptance_rate(0, 0, empty=0.0) == 0.0 and tokens_per_round(0, 0, empty=1.0) == 1.0


def test_requests_are_summed_before_the_ratio():
    """A ratio of sums, not a mean of per-request ratios: 1 of 1 and 0 of 3 is α 0.25, not 0.5."""
    many = [{"drafts": 1, "draft_tokens": 1, "accepted_tokens": 1},
            {"drafts": 1, "draft_tokens": 3, "accepted_tokens": 0, "rounds": 9},
            {"new_tokens": 4, "drafts": None}]  # a request that never drafted (and a count sent as None)
    total = SpecCounts.total(many)
    assert total == SpecCounts(drafts=2, draft_tokens=4, accepted_tokens=1)
    assert (total.alpha, total.tau, total.mean_k) == (0.25, 1.5, 2.0)
    assert SpecCounts.of(many[0]) + SpecCounts.of(many[1]) == total
    assert SpecCounts().alpha is None and SpecCounts().tau is None and SpecCounts().mean_k is None
