"""The drafter step's fast paths (a step is a few ms on a fast drafter, so its Python counts): pre-draft rows
chosen in one batch op, and the rows' visibility built from parts kept per block. Each must give exactly what the
plain per-row form gives."""

from __future__ import annotations

import pytest
import torch

from drafter_node.branches import Branches
from drafter_node.lm_drafter import choose, choose_greedy_rows
from shared.sampling import GenerationParams, process_logits

pytestmark = pytest.mark.unit

GREEDY = GenerationParams(do_sample=False)


def per_row(logits: torch.Tensor) -> list[tuple]:
    out = []
    for row in logits:
        t = choose(process_logits(row, torch.empty(0, dtype=torch.long), GREEDY, 0), GREEDY, 0, 0)
        out.append((t.token, t.alt, t.prob, t.alt_prob, t.q_idx, t.q_prob))
    return out


def batched(logits: torch.Tensor) -> list[tuple]:
    return [(t.token, t.alt, t.prob, t.alt_prob, t.q_idx, t.q_prob) for t in choose_greedy_rows(logits)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vocab", [1, 2, 7, 300, 151_936])
def test_greedy_rows_at_once_are_the_rows_one_by_one(threads, vocab):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(vocab + threads)
        for rows in (1, 2, 5, 17):
            logits = torch.randn(rows, vocab, generator=g) * 8
            assert batched(logits) == per_row(logits)
            tied = torch.round(logits)  # many exact ties, the top two among them
            tied[:, : min(vocab, 3)] = tied.max()
            assert batched(tied) == per_row(tied)
    finally:
        torch.set_num_threads(before)


def test_greedy_rows_from_a_non_float32_head():
    logits = (torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    assert batched(logits) == per_row(logits)


class FakeLM:
    def __init__(self, length: int):
        self.length = length


def reference_visible(b: Branches) -> torch.Tensor:
    rows, depth = len(b.rows), b.depth
    prefix = torch.arange(b.base + b.k)[None, :] < b._cuts[:, None]
    tail = torch.arange(rows * (depth + 1))[None, :] % rows == torch.arange(rows)[:, None]
    return torch.cat([prefix, tail], dim=1)


@pytest.mark.parametrize("rows", [[(0, 9)], [(0, 9), (3, 8), (2, 7)], [(r, 40 + r) for r in range(5)]])
def test_the_rows_visibility_is_the_plain_one_at_every_depth(rows):
    """The visibility built from the cached prefix part (the additive mask is the backend's, from it)."""
    committed, block = 11, [1, 2, 3, 4]
    b = Branches(None, FakeLM(committed + len(block)), committed, block, rows)  # no forward: no backend needed
    for depth in range(6):
        b.drafted = [[object()] * depth for _ in rows]  # only the depth is read
        assert torch.equal(b._visible(), reference_visible(b))


def test_the_block_stats_are_the_counters_fields():
    from dataclasses import asdict

    from drafter_node.node import flat_fields
    from drafter_node.node_session import SessionStats, SessionTiming

    stats, timing = SessionStats(busy_s=1.5, blocks=3, tree_blocks=1), SessionTiming(step_s=0.25, roundtrips=2)
    for counters in (stats, timing, SessionStats(), SessionTiming()):
        got = flat_fields(counters)
        assert got == asdict(counters) and list(got) == list(asdict(counters))
        got["blocks" if "blocks" in got else "step_s"] = 99  # a copy: the session's counters stay as they were
        assert flat_fields(counters) == asdict(counters)
