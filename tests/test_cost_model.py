"""The cost model and the ``cost`` schedule: plans from cost curves and acceptance, k = 0 with probes."""

from __future__ import annotations

import dataclasses

import pytest

from drafter_node.cost_model import (
    SIZED_MAX_TRIES,
    SIZED_REFRESH_ROUNDS,
    Acceptance,
    CostBook,
    Costs,
    best_plan,
    plans,
    rollback_s,
)
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
    assert abs(acc.alpha(3) - 0.6) < 1e-9  # the prior: position 3 was never reached
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



# ----------------------------------------------------------------------------- what sized rounds realise
def _overlap_schedule(book: CostBook) -> CostSchedule:
    return CostSchedule(5, 8, book, context=lambda: 60, overlap=True)


def _sized_round(s: CostSchedule, committed: int, seconds: float) -> None:
    """One synchronous round whose block the drafter sized by confidence, committing in ``seconds`` (the node's
    order: the round is observed, then the schedule updated)."""
    assert s.block_done([0.99]) is False
    s.observe_round(committed, seconds)
    s.update(committed - 1, committed - 1)


def test_a_fresh_pair_tries_confidence_sized_sync_rounds_before_settling_on_overlap():
    book = _real_book()
    s = _overlap_schedule(book)
    assert best_plan(s.acc, book.costs(60), 8, rows_ok=True).overlap, "the premise: the model alone overlaps"
    assert not s.plan.overlap and s.confidence_sized, "no record yet: the first round is a sized try"


def test_sized_rounds_that_realise_more_than_overlap_realises_keep_the_plan_synchronous():
    """Run D of issue 17: sized sync rounds realised ≈ 7.3 tok/s, overlap on the shared cores ≈ 5, while the
    model predicted overlap above both. Once both are recorded the realised rates decide."""
    book = _real_book()
    s = _overlap_schedule(book)
    rounds = 0
    while not s.plan.overlap and rounds < 10:
        _sized_round(s, 8, 1.1)
        rounds += 1
    assert s.plan.overlap, "the premise: the prediction for overlap beats the sized record at first"
    while s.plan.overlap and rounds < 20:
        s.observe_round(s.k + 1, (s.k + 1) / 5.0)  # what overlap really gives here
        s.update(s.k, s.k)
        rounds += 1
    assert not s.plan.overlap and book.sized.overlap.rate == pytest.approx(5.0)
    for _ in range(SIZED_REFRESH_ROUNDS * 2):
        _sized_round(s, 8, 1.1)
        assert not s.plan.overlap and s.plan.rate == pytest.approx(8 / 1.1)


def test_slow_sized_rounds_give_way_to_overlap_and_are_refreshed_now_and_then():
    book = _real_book()
    s = _overlap_schedule(book)
    _sized_round(s, 2, 2.0)
    _sized_round(s, 2, 2.0)  # 1 tok/s: overlap predicts more
    assert s.plan.overlap
    overlapped = 0
    while s.plan.overlap:
        s.update(s.k, s.k)
        overlapped += 1
        assert overlapped <= SIZED_REFRESH_ROUNDS + 1
    assert overlapped >= SIZED_REFRESH_ROUNDS - 1 and s.confidence_sized


def test_a_drafter_without_probabilities_stops_being_tried_after_a_few_rounds():
    s = _overlap_schedule(_real_book())
    tries = 0
    for _ in range(12):
        if not s.plan.overlap:
            tries += 1
            assert s.block_done([None]) is None  # the drafter cannot size: nothing is recorded
        s.observe_round(s.k + 1, 0.5)
        s.update(s.k, s.k)
    assert tries == SIZED_MAX_TRIES and s.plan.overlap


def test_batched_sessions_are_neither_tried_nor_recorded():
    book = _real_book()
    book.start_batch(4)
    s = _overlap_schedule(book)
    for _ in range(4):
        s.block_done([0.99])
        s.observe_round(s.k + 1, 0.1)
        s.update(s.k, s.k)
    assert book.sized.sized.samples == book.sized.overlap.samples == book.sized.tries == 0


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
