"""Draft-length schedules: transformers' heuristic, the adaptive variant, and the speed-model pipeline schedule."""

from __future__ import annotations

import pytest

from drafter_node.schedule import DraftLengthSchedule, expected_tokens

pytestmark = pytest.mark.unit


def test_expected_tokens_matches_the_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_heuristic_is_transformers_schedule():
    s = DraftLengthSchedule(5, "heuristic", max_k=8, overlap=True)
    s.update(5, 5)
    assert s.k == 7
    s.update(7, 6)
    assert s.k == 6
    for _ in range(10):
        s.update(s.k, 0)
    assert s.k == 1
    for _ in range(10):
        s.update(s.k, s.k)
    assert s.k == 8  # capped


def test_adaptive_keeps_k_after_a_late_miss():
    s = DraftLengthSchedule(6, "adaptive", max_k=16, overlap=True)
    s.update(6, 4)
    assert s.k == 6
    s.update(6, 1)
    assert s.k == 5


def test_constant_never_moves():
    s = DraftLengthSchedule(4, "constant", max_k=16, overlap=True)
    s.update(4, 4)
    s.update(4, 0)
    assert s.k == 4 and s.k_if_accepted() == 4


def test_pipeline_picks_the_speed_model_optimum():
    # c = 0.4 (drafter step / verification), α high: overlapped, k + 1 steps should fit in about one verification;
    # synchronous, the optimum is longer blocks.
    chosen = {}
    for overlap in (True, False):
        s = DraftLengthSchedule(5, "pipeline", max_k=16, overlap=overlap)
        s.observe_step(0.14)
        s.observe_roundtrip(0.35)
        for _ in range(30):
            s.update(5, 5 if _ % 10 else 4)
        best = max(range(1, 17), key=lambda k: expected_tokens(s.alpha, k)
                   / (max(1, (k + 1) * 0.4) if overlap else 1 + k * 0.4))
        assert s.k == best
        chosen[overlap] = s.k
    assert chosen[True] <= 3 < 5 <= chosen[False]


def test_pipeline_without_timings_keeps_the_configured_k():
    s = DraftLengthSchedule(5, "pipeline", max_k=16, overlap=True)
    s.update(5, 2)
    assert s.k == 5
