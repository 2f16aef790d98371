"""The cost model and the ``cost`` schedule: plans from cost curves and acceptance, k = 0 with probes."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from drafter_node.cost_model import (
    Acceptance,
    CostBook,
    Costs,
    Plan,
    best_plan,
    ceiling,
    plans,
    rollback_s,
)
from drafter_node.plan_search import EXPLORE_ROUNDS, MIN_ROUNDS, STALE_ROUNDS
from drafter_node.schedule import SOLO_ROUNDS_MAX, SOLO_ROUNDS_MIN, CostSchedule
from shared.costs.curve import CostCurve, NodeProfile

pytestmark = pytest.mark.unit


def curve(points: dict[int, float]) -> CostCurve:
    sizes = sorted(points)
    return CostCurve(sizes=sizes, seconds=[points[n] for n in sizes], prefix_len=64)


def flat(seconds: float) -> CostCurve:
    return curve({1: seconds, 16: seconds})


def linear(per_token: float) -> CostCurve:
    return curve({1: per_token, 16: 16 * per_token})


def accepting(alpha: float, max_k: int = 8, n: int = 200) -> Acceptance:
    acc = Acceptance(max_k)
    for i in range(n):
        # a stream of blocks of 8 whose acceptance per position is about alpha
        accepted = 0
        while accepted < 8 and ((i * 7919 + accepted * 104729) % 1000) / 1000 < alpha:
            accepted += 1
        acc.observe(8, accepted)
    return acc


def costs(verify: CostCurve, draft: CostCurve, verify_full: CostCurve | None = None,
          draft_full: CostCurve | None = None, overhead: float = 0.001) -> Costs:
    vf, df = verify_full or verify, draft_full or draft
    return Costs(verify.cost, vf.cost, draft.cost, df.cost, overhead)


def test_acceptance_follows_observations_per_position():
    acc = Acceptance(4)
    for _ in range(100):
        acc.observe(4, 2)  # positions 0 and 1 accepted, 2 rejected, 3 never tested
    assert acc.alpha(0) > 0.95 and acc.alpha(1) > 0.95 and acc.alpha(2) < 0.05
    # position 3 was never reached: its prior is the deepest tested position's estimate, not PRIOR_ALPHA
    assert abs(acc.alpha(3) - acc.alpha(2)) < 1e-9


@pytest.mark.unit
def test_untested_positions_follow_the_deepest_tested_one():
    """Short blocks that are all accepted raise the estimate of the positions beyond them too, so the plan can ask
    for a longer block at once; the first test of a deeper position then moves it on its own evidence."""
    acc = Acceptance(8)
    assert acc.alpha(7) == acc.alpha(0) == 0.6  # nothing tested: the prior everywhere
    for _ in range(3):
        acc.observe(1, 1)
    assert acc.alpha(0) > 0.8 and all(abs(acc.alpha(i) - acc.alpha(0)) < 1e-12 for i in range(1, 8))
    acc.observe(4, 1)  # position 1 rejected: positions 2.. now follow position 1
    assert acc.alpha(1) < acc.alpha(0)
    assert all(abs(acc.alpha(i) - acc.alpha(1)) < 1e-12 for i in range(2, 8))
    assert abs(acc.expected_tokens(2) - (1 + acc.alpha(0) + acc.alpha(0) * acc.alpha(1))) < 1e-12


def test_flat_costs_and_good_acceptance_draft_and_overlap():
    # An AMX/GPU-like target (verifying 8 tokens costs what 1 does) and a cheap drafter: long overlapped blocks.
    p = best_plan(accepting(0.9), costs(flat(0.4), linear(0.04)), 8, rows_ok=True)
    assert p.k >= 4 and p.overlap and p.rows >= 1
    assert p.rate > 1 / 0.4 * 2


def test_no_drafting_when_acceptance_is_near_zero():
    p = best_plan(accepting(0.01), costs(linear(0.4), linear(0.1)), 8, rows_ok=True)
    assert p.solo and p.k == 0


def test_linear_verify_cost_makes_speculation_lose_to_solo_with_all_cores():
    # bf16 emulated: verifying k + 1 tokens costs (k + 1)× one; all cores halve the cost of one token.
    share, full = linear(0.4), linear(0.22)
    p = best_plan(accepting(0.8), costs(share, linear(0.15), full, linear(0.09)), 8, rows_ok=True)
    assert p.solo
    assert abs(p.rate - 1 / 0.22) < 1e-6


def test_rows_are_pruned_when_each_row_costs_a_row():
    # Batched rows cost linearly (CPU): pre-drafting all k + 1 rows is not worth it; fewer rows are planned.
    cands = [c for c in plans(accepting(0.85), costs(flat(1.0), linear(0.15)), 6, rows_ok=True) if c.overlap]
    best = max(cands, key=lambda c: c.rate)
    assert 1 <= best.rows < best.k + 1
    # ... and with rows that are free, every row is worth it
    free = max((c for c in plans(accepting(0.85), costs(flat(1.0), flat(0.15)), 6, rows_ok=True) if c.overlap),
               key=lambda c: c.rate)
    assert free.rows == free.k + 1


def test_single_chain_drafters_plan_one_row():
    assert all(c.rows <= 1 for c in plans(accepting(0.8), costs(flat(0.4), linear(0.04)), 6, rows_ok=False))


def profile(points: dict[int, float], threads: int = 1) -> NodeProfile:
    return NodeProfile(model="m", device="cpu", dtype="float32", curves={threads: curve(points)})


def test_cost_schedule_goes_solo_then_probes_and_returns():
    book = CostBook()
    book.set_verifier(profile({1: 0.4, 9: 0.8}), 1, 1)
    book.set_drafter(profile({1: 0.15, 9: 1.35}), 1, 1)
    s = CostSchedule(4, 8, book, context=lambda: 100, overlap=True)
    for _ in range(30):
        s.update(4, 0)  # nothing accepted
    assert s.k == 0 and s.solo_rounds == SOLO_ROUNDS_MIN
    for _ in range(SOLO_ROUNDS_MIN):
        assert s.k == 0
        s.update(0, 0)  # the verifier's solo rounds
    assert s.probing and s.k >= 1 and not s.overlap_now  # a synchronous probe block
    s.update(s.k, 0)  # the probe failed: solo again, probing half as often
    assert s.k == 0 and s.solo_rounds == 2 * SOLO_ROUNDS_MIN
    for _ in range(2 * SOLO_ROUNDS_MIN):
        s.update(0, 0)
    for _ in range(40):  # acceptance recovers: probes succeed, drafting comes back
        if s.k == 0:
            s.update(0, 0)
        else:
            s.update(s.k, s.k)
    assert s.k >= 1


def test_cost_schedule_without_curves_keeps_the_configured_k():
    s = CostSchedule(5, 8, CostBook(), context=lambda: 10, overlap=True)
    s.update(5, 1)
    assert s.k == 5 and s.overlap_now


def test_cost_book_learns_a_missing_curve_from_rounds():
    book = CostBook()
    book.set_verifier(profile({1: 0.4, 9: 0.5}), 1, 1)
    book.set_drafter(None, 1, 1)
    assert not book.ready
    book.observe_draft(1, 0.1, 1, 50)
    assert book.ready
    assert abs(book.costs(50).draft_share(1) - 0.1) < 1e-9


def test_no_probes_where_not_even_a_perfect_drafter_could_pay():
    # every verified token costs as much as one step alone: k = 0 for good, with no probe blocks at all
    book = CostBook()
    book.set_verifier(profile({1: 0.4, 9: 3.6}), 1, 1)
    book.set_drafter(profile({1: 0.15, 9: 1.35}), 1, 1)
    s = CostSchedule(4, 8, book, context=lambda: 100, overlap=True)
    assert s.k == 0 and not s.drafting_can_pay()
    period = s.solo_period
    for _ in range(SOLO_ROUNDS_MIN + 3 * SOLO_ROUNDS_MAX):
        s.update(0, 0)
        assert s.k == 0 and not s.probing
    assert s.solo_period == period + 4  # each run alone ends in another one (a new idle block), never a probe


def _batch_book(verify, draft) -> CostBook:
    book = CostBook(8)
    book.fix_curves(CostCurve(sizes=[1, 512], seconds=[verify(1), verify(512)], prefix_len=0),
                    CostCurve(sizes=[1, 512], seconds=[draft(1), draft(512)], prefix_len=0))
    return book


def _good_acceptance(alpha: float = 0.6) -> Acceptance:
    """α = ``alpha`` at every position (E(k) = (1 − α^(k+1)) / (1 − α)), with guesses right half the time, on
    the evidence of many blocks (20 observations: the decay's limit), so exploration adds little to it."""
    acc = Acceptance(8)
    for beta in (*acc.positions, acc.bonus_guess, acc.correction_guess):
        beta.trials = 20.0
        beta.successes = (alpha if beta in acc.positions else 0.5) * beta.trials
    return acc


def test_plans_by_batch_speculate_at_small_batches_and_step_plainly_at_large_ones():
    """A memory-bound verifier (a large fixed cost per forward, a small one per token): speculation pays at batch 1,
    where a forward of k + 1 tokens costs about one of 1; at batch 64 a forward already carries 64 tokens, so k + 1
    tokens per session cost (k + 1) times more and plain batched decoding wins. The chosen plan is never slower than
    plain decoding of the same batch."""
    book = _batch_book(lambda n: 0.05 + 0.002 * n, lambda n: 0.004 + 0.0005 * n)
    table = book.plans_by_batch(_good_acceptance(), 8, rows_ok=True, context=0)
    by_batch = {row["batch"]: row for row in table}
    assert by_batch[1]["k"] > 0 and by_batch[64]["k"] == 0
    assert by_batch[1]["tokens_per_s"] > 1.5 * by_batch[1]["plain_tokens_per_s"]
    for row in table:
        assert row["tokens_per_s"] >= row["plain_tokens_per_s"] * (1 - 1e-9)
    ks = [row["k"] for row in table]
    assert ks == sorted(ks, reverse=True), "speculation shrinks as the batch grows"


def test_flat_verifier_costs_keep_speculating_at_every_batch():
    """A verifier whose forward costs the same up to 512 tokens (a large GPU): drafting pays at every batch size."""
    book = _batch_book(lambda n: 0.05, lambda n: 0.004)
    assert all(row["k"] > 0 for row in book.plans_by_batch(_good_acceptance(), 8, False, 0))


def test_the_schedule_plans_for_the_batch_the_commits_report():
    """Commits that report 64 sessions per forward turn the cost schedule to plain steps (k = 0); with one session
    per forward the same curves and acceptance draft."""
    book = _batch_book(lambda n: 0.05 + 0.002 * n, lambda n: 0.004 + 0.0005 * n)
    book.acceptance = _good_acceptance()
    alone = CostSchedule(4, 8, book, lambda: 0, overlap=False, rows_ok=False)
    assert alone.k > 0
    for _ in range(40):
        book.observe_batch(64)
    assert book.batch == 64
    batched = CostSchedule(4, 8, book, lambda: 0, overlap=False, rows_ok=False)
    assert batched.k == 0


def test_a_session_start_plans_its_first_block_for_the_batch_it_joins():
    """A session that joins 63 others plans plain steps from its first block (its start's ``decoding``), instead of
    drafting for the batch of one the average still remembers; a later start with fewer sessions lowers it again."""
    book = _batch_book(lambda n: 0.05 + 0.002 * n, lambda n: 0.004 + 0.0005 * n)
    book.acceptance = _good_acceptance()
    book.start_batch(64)
    assert book.batch == 64
    assert CostSchedule(4, 8, book, lambda: 0, overlap=False, rows_ok=False).k == 0
    book.start_batch(1)
    assert CostSchedule(4, 8, book, lambda: 0, overlap=False, rows_ok=False).k > 0
    book.start_batch(0)  # unknown (an older verifier): the average stays
    assert book.batch == 1


def test_a_drafter_that_does_not_batch_pays_per_session():
    book = _batch_book(lambda n: 0.05, lambda n: 0.004)
    together = book.costs(0, batch=16)
    book.draft_batched = False
    apart = book.costs(0, batch=16)
    assert apart.draft_full(1) == pytest.approx(16 * 0.004)
    assert together.draft_full(1) == pytest.approx(0.004)
    assert together.verify_full(2) == pytest.approx(0.05)


# ----------------------------------------------------------------------------- exploring, not getting stuck
# The Qwen2.5-Coder 1.5B + 0.5B pair in bf16 at 2 threads on an avx512_bf16 CPU (the nodes' own start-up
# profiles): verifying 9 tokens costs 1.4x one token, a draft step 0.4x.
REAL_VERIFY = {1: 0.252, 4: 0.254, 9: 0.359}
REAL_DRAFT = {1: 0.100, 4: 0.136, 9: 0.186}


def _real_book() -> CostBook:
    book = CostBook(8)
    book.set_verifier(profile(REAL_VERIFY), 1, 1)
    book.set_drafter(profile(REAL_DRAFT), 1, 1)
    return book


def test_one_rejected_block_does_not_switch_drafting_off():
    """The make-run failure: a fresh pair's first block rejected at its first token. The estimate alone (α_0 from
    0.6 to 0.39) would choose k = 0 on these curves; the optimistic bound of so little evidence keeps drafting."""
    book = _real_book()
    s = CostSchedule(5, 8, book, context=lambda: 60, overlap=False)
    assert s.k > 0
    s.update(s.k, 0)
    plain = best_plan(s.acc, book.costs(60), 8, rows_ok=True, allow_overlap=False)
    assert plain.solo, "the premise: the mean estimate alone would stop drafting here"
    assert s.k > 0 and s.explored >= 1


def test_many_rejected_blocks_still_switch_drafting_off():
    """The same curves after a long run of rejections (the node's evidence too): k = 0, where it belongs."""
    book = _real_book()
    s = CostSchedule(5, 8, book, context=lambda: 60, overlap=False)
    for _ in range(40):
        if s.k:
            s.update(s.k, 0)
        else:
            s.update(0, 0)
    assert s.k == 0 or s.probing


def test_the_optimistic_bound_narrows_with_evidence():
    thin, thick = Acceptance(4), accepting(0.5)
    assert thin.optimistic(1.0).alpha(0) > thin.alpha(0) + 0.2
    assert thick.optimistic(1.0).alpha(0) - thick.alpha(0) < 0.15
    # a new session's shrunk estimate takes its margin from the node's evidence
    shrunk = Acceptance(4)
    assert shrunk.optimistic(1.0, evidence=thick).alpha(0) - shrunk.alpha(0) < 0.15


def test_overhead_is_a_median_so_one_slow_round_trip_does_not_count():
    book = CostBook()
    book.observe_overhead(0.051)  # a first round trip that waited behind a prefill
    book.observe_overhead(0.001)
    assert book.overhead_s == pytest.approx(0.001)  # the smallest while fewer than three
    for _ in range(5):
        book.observe_overhead(0.001)
    book.observe_overhead(0.200)
    assert book.overhead_s == pytest.approx(0.001)


def test_acceptance_round_trips_through_memory():
    acc = accepting(0.8)
    again = Acceptance.from_memory(8, acc.to_dict(), weight=4.0)
    for i in range(8):
        assert again.alpha(i) == pytest.approx(acc.alpha(i))
        assert again.positions[i].trials == 4.0
    assert again.bonus_guess.value == pytest.approx(acc.bonus_guess.value)
    longer = Acceptance.from_memory(12, {"alpha": [0.9, 0.8]})
    assert longer.alpha(5) == pytest.approx(0.8)  # past what was remembered: the last remembered rate


# ----------------------------------------------------------------------------- blocks sized by confidence
def test_a_sure_drafter_on_a_flat_verifier_keeps_drafting_and_an_unsure_one_stops():
    from drafter_node.cost_model import Calibration, block_should_end

    cal = Calibration()  # prior: acceptance = the drafter's probability
    flat_costs = costs(curve(REAL_VERIFY), curve(REAL_DRAFT), overhead=0.002)
    assert not block_should_end([0.98, 0.97, 0.99], cal, flat_costs, 8)
    assert block_should_end([0.98, 0.97, 0.15], cal, flat_costs, 8)
    assert block_should_end([0.98] * 8, cal, flat_costs, 8)  # the cap
    # where every verified token costs a forward of its own, even a sure drafter stops at once
    assert block_should_end([0.98], cal, costs(linear(0.25), curve(REAL_DRAFT)), 8)
    # the calibration learns that this drafter's 0.15s are in fact accepted: then it goes on
    for _ in range(300):
        cal.observe(0.15, True)
    assert not block_should_end([0.98, 0.97, 0.15], cal, flat_costs, 8)


def test_synchronous_cost_blocks_are_sized_by_confidence_probes_are_not():
    s = CostSchedule(5, 8, _real_book(), context=lambda: 60, overlap=False)
    assert s.confidence_sized and not s.plan.overlap
    assert s.block_done([0.99, 0.99]) is False and s.block_done([0.99, 0.05]) is True
    assert s.block_done([0.99, None]) is None  # a drafter without probabilities: the plan's fixed k
    s.probing = True
    assert s.block_done([0.99, 0.05]) is None



# ----------------------------------------------------------------------------- plans chosen by what they realise
# The measured case of issue 30 (2-core Xeon with AMX, 1.5B + 0.5B, greedy): verifying 9 tokens costs what 1 does,
# acceptance 0.93-0.98; the model predicts overlap best, overlap realises about 5 tok/s and sync k = 8 about 7.5.
AMX_VERIFY = {1: 0.200, 4: 0.205, 9: 0.210}
AMX_DRAFT = {1: 0.040, 4: 0.050, 9: 0.070}


def _amx_schedule(sizes_blocks: bool | None = False) -> CostSchedule:
    """A session on the AMX curves, its node's acceptance 0.95 on much evidence (a remembered pair)."""
    book = CostBook(8)
    book.set_verifier(profile(AMX_VERIFY), 1, 1)
    book.set_drafter(profile(AMX_DRAFT), 1, 1)
    book.acceptance = _good_acceptance(0.95)
    book.sizes_blocks = sizes_blocks
    return CostSchedule(4, 8, book, context=lambda: 60, overlap=True)


def _run_rounds(s: CostSchedule, realised, rounds: int, sized: bool = False) -> list[str]:
    """``rounds`` rounds whose committed tokens arrive at ``realised(label)`` tok/s (the node's order: the round is
    observed, then the schedule updated). The acceptance estimate is held (no drafted tokens reported), so the
    predictions stay put and only the realised rates move the plan. Returns each round's label."""
    labels = []
    for _ in range(rounds):
        if sized and s.confidence_sized:
            s.block_done([0.99] * s.k)  # the drafter sizes its block (here: the plan's k)
        label = s.round_label()
        labels.append(label)
        s.observe_round(s.k + 1, (s.k + 1) / realised(label))
        s.update(0, 0)
    return labels


def _favours_long_sync(label: str) -> float:
    return 7.5 if label in ("sync k=8", "sync sized") else 5.0 if label.startswith("overlap") else 6.0


def test_plans_that_realise_more_than_predicted_are_found_and_kept():
    s = _amx_schedule()
    assert s.plan.overlap, "the premise: the model predicts overlap best"
    model_sync8 = next(p for p in plans(s.acc, s.book.costs(60), 8, rows_ok=True) if p.k == 8 and not p.overlap)
    assert model_sync8.rate < s.plan.rate
    labels = _run_rounds(s, _favours_long_sync, 60)
    moved = labels.index("sync k=8")
    assert moved <= EXPLORE_ROUNDS + MIN_ROUNDS, labels[:moved + 1]
    # After that only re-tries of forgotten records (STALE_ROUNDS), each MIN_ROUNDS long, at growing intervals.
    others = [i for i, label in enumerate(labels) if i > moved and label != "sync k=8"]
    assert len(others) <= 2 * MIN_ROUNDS, labels
    assert all(b - a == 1 or b - a > STALE_ROUNDS for a, b in itertools.pairwise(others)), labels
    assert s.exploring_rounds <= EXPLORE_ROUNDS
    assert s.book.search.records["sync k=8"].rate == pytest.approx(7.5)


@pytest.mark.parametrize("forget", [True, False])
def test_a_plan_that_realised_little_in_a_slow_spell_is_tried_again(forget, monkeypatch):
    """Records age: sync k=8 realises 3 tok/s while the host is slow (overlap 5), so overlap runs; once the host
    is back (sync k=8 at 7.5) the forgotten sync record lets it run again, and it stays. The negative control keeps
    every record for good (the old behaviour): sync k=8 never runs again."""
    import drafter_node.plan_search as plan_search

    if not forget:
        monkeypatch.setattr(plan_search, "STALE_ROUNDS", 10**9)
    s = _amx_schedule()
    slow = _run_rounds(s, lambda label: 3.0 if label == "sync k=8" else _favours_long_sync(label), 30)
    assert "sync k=8" in slow and slow[-10:] != ["sync k=8"] * 10, slow
    s.exploring_rounds = 0  # a new session's exploration budget
    back = _run_rounds(s, _favours_long_sync, 60)
    if forget:
        assert back[-20:].count("sync k=8") >= 18, back
    else:
        assert "sync k=8" not in back, back


def test_rounds_alone_do_not_age_the_drafting_records():
    from drafter_node.plan_search import PlanSearch

    search = PlanSearch()
    for _ in range(MIN_ROUNDS):
        search.observe("sync k=8", 3, 1.0, 6.0)
    for _ in range(10 * STALE_ROUNDS):
        search.observe("solo", 1, 0.25, 4.0)
    assert search.tried("sync k=8")
    for _ in range(STALE_ROUNDS + 1):
        search.observe("overlap k=2 rows=3", 3, 1.0, 5.0)
    assert not search.tried("sync k=8") and "sync k=8" not in search.records


def test_a_sizing_drafter_finds_sized_sync_rounds():
    s = _amx_schedule(sizes_blocks=None)
    labels = _run_rounds(s, _favours_long_sync, 40, sized=True)
    assert "sync sized" in labels[: EXPLORE_ROUNDS + 2 * MIN_ROUNDS]
    assert labels[-15:] == ["sync sized"] * 15 and s.book.sizes_blocks  # (a forgotten overlap re-tried at ~19)


def test_where_the_model_is_right_its_plan_stays_after_a_bounded_exploration():
    s = _amx_schedule()
    model = best_plan(s.acc, s.book.costs(60), 8, rows_ok=True).label
    predicted = {label: p.rate for label, p in s._by_label(s.acc, s.book.costs(60)).items()}
    labels = _run_rounds(s, predicted.__getitem__, 40)
    assert s.exploring_rounds <= EXPLORE_ROUNDS
    assert sum(label != model for label in labels) <= EXPLORE_ROUNDS
    assert labels[-20:] == [model] * 20


def test_a_plan_that_realised_clearly_less_is_not_run_again():
    s = _amx_schedule()
    labels = _run_rounds(s, _favours_long_sync, 40)
    for label, record in s.book.search.records.items():
        if record.rate is not None and record.rate < 7.0:
            assert record.rounds <= MIN_ROUNDS, label
    assert labels.count("sync k=8") >= 30


def test_long_sync_blocks_and_trees_are_candidates_where_verification_is_flat():
    s = _amx_schedule()
    s.tree = True
    labels = {p.label for p in s._candidates(s.book.costs(60))}
    assert "sync k=8" in labels and any(label.startswith("tree") for label in labels)
    assert any(label.startswith("overlap") for label in labels)
    linear_book = CostBook(8)
    linear_book.set_verifier(profile({1: 0.2, 9: 1.8}), 1, 1)
    linear_book.set_drafter(profile(AMX_DRAFT), 1, 1)
    linear_book.acceptance = _good_acceptance(0.95)
    linear_book.sizes_blocks = False
    steep = CostSchedule(4, 8, linear_book, context=lambda: 60, overlap=True)
    assert "sync k=8" not in {p.label for p in steep._candidates(linear_book.costs(60))}


def test_batched_sessions_are_neither_searched_nor_recorded():
    book = _real_book()
    book.start_batch(4)
    s = _overlap_schedule(book)
    for _ in range(4):
        s.observe_round(s.k + 1, 0.1)
        s.update(s.k, s.k)
    assert s.book.search.records == {} and s.exploring_rounds == 0


def test_a_drafter_without_probabilities_runs_fixed_sync_lengths():
    s = _overlap_schedule(_real_book())
    s.plan = dataclasses.replace(s.plan, overlap=False, rows=0, sized=True)
    assert s.confidence_sized and s.block_done([None]) is None
    assert s.round_label() == f"sync k={s.k}"
    s.observe_round(s.k + 1, 0.5)
    s.update(s.k, s.k)
    assert s.book.sizes_blocks is False
    assert all(not p.sized for p in s._candidates(s.book.costs(60)))


def _overlap_schedule(book: CostBook) -> CostSchedule:
    return CostSchedule(5, 8, book, context=lambda: 60, overlap=True)


def test_a_plan_that_beat_its_prediction_does_not_keep_the_models_plan_from_running():
    """The run-B trap of issue 30: an earlier session (the bench's warm-up) ran another plan, which realised more than
    the model's own plan is predicted to; the new session must still try the model's plan (here the best) instead
    of keeping to the one that ran."""
    s = _amx_schedule()
    model = s.plan
    other = next(p for p in plans(s.acc, s.book.costs(60), 8, rows_ok=True) if p.k == 4 and not p.overlap)
    for _ in range(MIN_ROUNDS):
        s.book.search.observe(other.label, 5, 5 / (model.rate + 0.5), other.rate)  # realised above model.rate
    fresh = CostSchedule(4, 8, s.book, context=lambda: 60, overlap=True)
    labels = _run_rounds(fresh, lambda label: model.rate + (2.0 if label == model.label else 0.5), 30)
    assert model.label in labels[: EXPLORE_ROUNDS + MIN_ROUNDS], labels
    assert labels[-10:] == [model.label] * 10, labels


def _solo_rounds_realised(book: CostBook, rate: float, rounds: int = 4) -> None:
    """Earlier sessions of the node stepped alone for ``rounds`` rounds at ``rate`` tok/s."""
    solo = best_plan(Acceptance(8), book.costs(60), 8, rows_ok=True, allow_solo=True, allow_sync=False,
                     allow_overlap=False)
    for _ in range(rounds):
        book.search.observe("solo", 1, 1.0 / rate, solo.rate)


def test_drafting_that_realises_less_than_the_verifier_alone_gives_way_to_it():
    """The model predicts drafting (flat verification, α 0.95), but every drafting plan realises 3 tok/s where the
    node's verifier alone realised 4.5 (a drafter that guesses little on this text, a verifier slower than its
    profile over k + 1 tokens): after trying its plans the session steps alone, apart from its probes."""
    s = _amx_schedule()
    _solo_rounds_realised(s.book, 4.5)
    labels = _run_rounds(s, lambda label: 4.5 if label == "solo" else 3.0, 60)
    assert labels[0] != "solo", "the premise: the model's plan drafts, and runs first"
    first_alone = labels.index("solo")
    assert first_alone <= 2 * MIN_ROUNDS + 1, labels  # the model's plan, and one plan of the other kind, tried
    assert labels[first_alone:first_alone + SOLO_ROUNDS_MIN] == ["solo"] * SOLO_ROUNDS_MIN, labels
    drafting_after = [label for label in labels[first_alone:] if label != "solo"]
    assert len(drafting_after) <= 3, labels  # one probe per run alone (8, 16, 32 rounds)
    assert s.book.solo_span > SOLO_ROUNDS_MIN, "probes that bring no drafting back come less often"


def test_drafting_that_realises_more_than_the_verifier_alone_keeps_drafting():
    """The negative control of the test above: the same records of the verifier alone, drafting realising 7.5."""
    s = _amx_schedule()
    _solo_rounds_realised(s.book, 4.5)
    labels = _run_rounds(s, lambda label: 4.5 if label == "solo" else 7.5, 40)
    assert "solo" not in labels


def test_a_drafter_whose_plans_realised_less_than_alone_is_not_sent_exploring():
    """The model's plan is k = 0 (α 0.2, verifying 9 tokens 2.5x the cost of 1) and the acceptance bound of a fresh
    session would explore a drafting plan; where that plan already realised less than the verifier alone, it does
    not."""
    book = CostBook(8)
    book.set_verifier(profile({1: 0.2, 9: 0.5}), 1, 1)
    book.set_drafter(profile({1: 0.02, 9: 0.18}), 1, 1)
    book.acceptance = _good_acceptance(0.2)
    fresh = CostSchedule(4, 8, book, context=lambda: 60, overlap=False)
    assert not fresh.plan.solo and fresh.explored, "the premise: the bound sends a fresh session exploring"
    explored = fresh.plan
    _solo_rounds_realised(book, 5.0)
    for _ in range(MIN_ROUNDS):
        book.search.observe(explored.label, 1, 1.0 / 2.5, explored.rate)
    again = CostSchedule(4, 8, book, context=lambda: 60, overlap=False)
    assert again.plan.solo and not again.explored


def test_drafting_realised_on_hard_text_comes_back_when_its_prediction_rises():
    """A plan is weighed against the verifier alone at its prediction now times what its rounds realised over what
    they were promised: rounds on text the drafter could not guess do not keep it off once acceptance rises."""
    from drafter_node.plan_search import PlanSearch

    search = PlanSearch()
    for _ in range(MIN_ROUNDS):
        search.observe("sync k=8", 3, 1.0, 6.0)  # realised 3 tok/s where 6 were predicted
        search.observe("solo", 1, 1.0 / 4.5, 5.0)
    solo = Plan(0, False, 0, 5.0)
    assert search.now(Plan(8, False, 0, 6.0)) < search.now(solo)
    assert search.now(Plan(8, False, 0, 12.0)) > search.now(solo)  # the acceptance estimate rose


def test_a_new_session_keeps_the_nodes_run_alone_length():
    """How long a run alone lasts is the node's: a new session of a drafter whose probes kept failing does not probe
    again after SOLO_ROUNDS_MIN rounds."""
    book = CostBook()
    book.set_verifier(profile({1: 0.4, 9: 0.8}), 1, 1)
    book.set_drafter(profile({1: 0.15, 9: 1.35}), 1, 1)
    first = CostSchedule(4, 8, book, context=lambda: 100, overlap=True)
    for _ in range(30):
        first.update(4, 0)
    probes = 0
    while first.solo_span < 4 * SOLO_ROUNDS_MIN and probes < 10:  # runs alone, each ended by a failed probe
        for _ in range(first.solo_left):
            first.update(0, 0)
        first.update(first.k, 0)
        probes += 1
    assert first.solo_span >= 4 * SOLO_ROUNDS_MIN
    second = CostSchedule(4, 8, book, context=lambda: 100, overlap=True)
    if second.plan.solo:
        assert second.solo_left == first.solo_span
    else:  # its acceptance bound sends it drafting first; the run alone after that block is the node's length
        second.update(second.k, 0)
        assert second.k == 0 and second.solo_left == first.solo_span


def test_the_start_plan_is_confirmed_or_corrected():
    from drafter_node.node_session import plan_check
    from shared.protocol import PlanCheck

    rates = {"overlap k=3 rows=4": [10, 55, 10.0, 60.0], "sync k=8": [3, 24, 3.2, 18.0], "sync k=2": [1, 9, 0.5, 5]}
    assert plan_check("sync k=8", rates) == PlanCheck(startup="sync k=8", realised_best="sync k=8",
                                                      verdict="confirmed")
    assert plan_check("sync k=1", rates).verdict == "corrected"  # sync k=2 ran one round only: not counted
    assert plan_check(None, rates) is None and plan_check("solo", {}) is None


def _draft_with_stats(stats: object) -> bytes:
    import msgpack

    from shared.protocol import SCHEMA_VERSION

    return msgpack.packb({"v": SCHEMA_VERSION, "type": "draft", "session": 1, "base_len": 2, "tokens": [3],
                          "stats": stats})


def test_the_plan_check_travels_in_the_draft_stats():
    from shared.protocol import PlanCheck, ProtocolError, decode

    good = {"startup": "sync k=1", "realised_best": "sync k=8", "verdict": "corrected"}
    assert decode([_draft_with_stats({"plan_check": good})]).stats.plan_check == PlanCheck(**good)
    for bad in ({**good, "verdict": "maybe"}, {"startup": "x"}, "corrected", {**good, "startup": 3}):
        with pytest.raises(ProtocolError):
            decode([_draft_with_stats({"plan_check": bad})])


def test_the_ceiling_travels_in_the_draft_stats():
    from shared.protocol import ProtocolError, decode

    assert decode([_draft_with_stats({"ceiling_tokens_per_second": 7.5})]).stats.ceiling_tokens_per_second == 7.5
    for bad in (-1.0, float("nan"), float("inf"), "fast", True):
        with pytest.raises(ProtocolError):
            decode([_draft_with_stats({"ceiling_tokens_per_second": bad})])


def test_the_start_report_names_the_plan_a_new_session_starts_with():
    from drafter_node.settings import DrafterConfig
    from drafter_node.start_report import start_plan_label

    book = _real_book()
    settings = DrafterConfig()
    assert start_plan_label(settings, book) == CostSchedule(
        min(settings.num_draft_tokens, settings.max_draft_tokens), settings.max_draft_tokens, book,
        lambda: 64, settings.overlap, tree=settings.tree).plan.label
    assert start_plan_label(settings, CostBook()) is None


def test_a_target_that_refeeds_on_rollback_pays_for_rejections():
    """A hybrid target (shared.kv) re-feeds the pending token and the accepted drafts after a rejection: a sync round
    of k costs Σ_a P(exactly a accepted, then a rejection) · V(a + 1) more, and overlap pays it on the verifier."""
    acc = accepting(0.5)
    plain = costs(linear(0.1), linear(0.01))
    refeeding = dataclasses.replace(plain, rollback_refeeds=True)
    s = acc.survival(4)
    extra = sum((s[a] - s[a + 1]) * 0.1 * (a + 1) for a in range(4))
    assert abs(rollback_s(acc, 4, plain.verify_full) - extra) < 1e-12
    assert rollback_s(accepting(1.0), 4, plain.verify_full) < 0.02  # nearly all accepted: almost nothing re-fed

    def sync(c: Costs, k: int) -> float:
        return next(p.rate for p in plans(acc, c, 8, rows_ok=True) if p.k == k and not p.overlap)

    t_plain = acc.expected_tokens(4) / sync(plain, 4)
    t_refeed = acc.expected_tokens(4) / sync(refeeding, 4)
    assert abs((t_refeed - t_plain) - extra) < 1e-9
    # On a flat-cost verifier (a GPU: V(k + 1) ≈ V(1)) a re-feed costs about a whole forward: at α = 0.5 the plain
    # target speculates, the re-feeding one runs alone.
    gpu = costs(flat(0.3), linear(0.03))
    assert best_plan(acc, gpu, 8, rows_ok=True).k == 2
    assert best_plan(acc, dataclasses.replace(gpu, rollback_refeeds=True), 8, rows_ok=True).k == 0


def test_the_debug_log_says_why_each_round_runs_its_plan(caplog, monkeypatch):
    import logging

    from runtime.node_setup import LOG_LEVEL_ENV, node_log_level

    s = _amx_schedule()
    with caplog.at_level(logging.DEBUG, logger="pipespec.schedule"):
        _run_rounds(s, _favours_long_sync, 3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("replan: ")]
    assert len(lines) == 3 and all("model's best" in line and "verify 1 token 200 ms" in line for line in lines)
    for value, level in (("debug", "DEBUG"), (" Warning ", "WARNING"), ("loud", "INFO"), ("", "INFO")):
        monkeypatch.setenv(LOG_LEVEL_ENV, value)
        assert node_log_level() == level


def test_the_ceiling_is_the_best_plan_at_the_realised_acceptance_without_overhead():
    """By hand: a flat 100 ms verifier, a 10 ms drafter step, synchronous blocks of at most 4. Every draft accepted:
    k = 4 gives 5 tokens in 4 × 10 + 100 ms = 35.7 tok/s (the 50 ms round-trip overhead is not counted). Nothing
    accepted: the target alone, 10 tok/s."""
    flat = curve({1: 0.1, 5: 0.1})
    step = curve({1: 0.01, 5: 0.01})
    costs = Costs(flat.cost, flat.cost, step.cost, step.cost, overhead_s=0.05)
    perfect = Acceptance.realised(4, [10, 10, 10, 10], [10, 10, 10, 10])
    assert ceiling(perfect, costs, 4, rows_ok=False, allow_overlap=False).rate == pytest.approx(5 / 0.14)
    hopeless = Acceptance.realised(4, [0], [10])
    top = ceiling(hopeless, costs, 4, rows_ok=False, allow_overlap=False)
    assert top.solo and top.rate == pytest.approx(10.0)
    # the realised rates are the counts' (no prior); untested positions take the deepest tested one's
    half = Acceptance.realised(4, [5, 1], [10, 4])
    assert [round(half.alpha(i), 6) for i in range(4)] == [0.5, 0.25, 0.25, 0.25]
    e = 1 + 0.5 + 0.5 * 0.25  # k = 2 at α = 0.5, 0.25
    assert max(p.rate for p in plans(half, Costs(flat.cost, flat.cost, step.cost, step.cost), 4, False,
                                     allow_overlap=False) if p.k == 2) == pytest.approx(e / 0.12)


def test_k_grows_within_the_first_request_when_every_draft_is_accepted():
    """A new pair (no memory: the plain prior) whose drafts are all accepted: the schedule reaches long blocks within a
    few rounds of the first request (the make-run case: 43 of 44 drafts accepted, yet k = 2.1 on average)."""
    book = _real_book()
    s = CostSchedule(1, 8, book, context=lambda: 60, overlap=False)
    ks = []
    for _ in range(12):
        k = max(s.k, 1)
        ks.append(k)
        s.update(k, k)
    # with a fixed prior for untested positions it stayed at k = 1-2 for good: positions beyond k were never tried
    assert ks == sorted(ks) and ks[-1] >= 6, ks
    assert s.acc.alpha(7) > 0.9  # untested deep positions follow the accepted ones


def test_a_remembered_pair_plans_long_blocks_from_its_first_round():
    """The seeded plan: a node that remembers this pair's acceptance (drafter_node/pair_memory.py) plans the first
    round of the first request with it, where the plain prior plans a short block."""
    from drafter_node.pair_memory import REMEMBERED_WEIGHT

    fresh = CostSchedule(5, 8, _real_book(), context=lambda: 60, overlap=False)
    book = _real_book()
    book.acceptance = Acceptance.from_memory(8, {"alpha": [0.97] * 8, "bonus_guess": 0.9, "correction_guess": 0.3},
                                             REMEMBERED_WEIGHT)
    seeded = CostSchedule(5, 8, book, context=lambda: 60, overlap=False)
    assert seeded.acc.alpha(0) > 0.9
    assert seeded.k >= 4 and fresh.k <= 2, (seeded.k, fresh.k)
