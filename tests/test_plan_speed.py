"""The replan's fast paths (each round's plan on a fast target costs part of the round): they must give exactly
what the plain formulas give. Each reference below is the straightforward form the fast code replaced; the
comparisons are exact (same floats, same order, same ties)."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from drafter_node.cost_model import Acceptance, CostBook, Costs, Plan, plans, rollback_s
from drafter_node.plan_search import kind as plan_kind
from drafter_node.schedule import TOP_CANDIDATES, CostSchedule
from drafter_node.tree_plan import TreePlan, plan_tree, survival
from shared.costs.curve import CostCurve

pytestmark = pytest.mark.unit

MAX_K = 16


def reference_plans(acc: Acceptance, costs: Costs, max_k: int, rows_ok: bool, allow_solo: bool = True,
                    allow_sync: bool = True, allow_overlap: bool = True) -> list[Plan]:
    out: list[Plan] = []
    o = max(0.0, costs.overhead_s)
    if allow_solo:
        out.append(Plan(0, False, 0, 1.0 / max(costs.verify_full(1), 1e-9)))
    d1_full, d1_share = costs.draft_full(1), costs.draft_share(1)
    s = acc.survival(max_k)
    e = 1.0
    for k in range(1, max_k + 1):
        e += s[k]
        if allow_sync:
            t = k * d1_full + costs.verify_full(k + 1) + o
            if costs.rollback_refeeds:
                t += rollback_s(acc, k, costs.verify_full)
            out.append(Plan(k, False, 0, e / max(t, 1e-9)))
        if allow_overlap:
            tv = costs.verify_share(k + 1) + o
            if costs.rollback_refeeds:
                tv += rollback_s(acc, k, costs.verify_share)
            miss = acc.correction_guess.value
            hits = [s[r] * (1 - acc.alpha(r)) * miss for r in range(k)] + [s[k] * acc.bonus_guess.value]
            hits = sorted(hits, reverse=True) if rows_ok else [s[k] * acc.bonus_guess.value]
            h = 0.0
            for rows in range(1, len(hits) + 1):
                h += hits[rows - 1]
                td = d1_share + k * costs.draft_share(rows)
                t = max(tv, td) + (1 - h) * k * d1_share
                out.append(Plan(k, True, rows, e / max(t, 1e-9), hit=h))
    return out


def reference_by_label(schedule: CostSchedule, acc: Acceptance, costs: Costs) -> dict[str, Plan]:
    every = [schedule._sized(p) for p in reference_plans(acc, costs, schedule.max_k, schedule.rows_ok,
                                                         allow_solo=False, allow_overlap=schedule.overlap)]
    if schedule.tree:
        tree = schedule._best_tree(costs, acc)
        every += [tree] if tree is not None else []
    by_label: dict[str, Plan] = {}
    for p in every:
        if p.label not in by_label or p.rate > by_label[p.label].rate:
            by_label[p.label] = p
    return by_label


def reference_candidates(schedule: CostSchedule, costs: Costs) -> list[Plan]:
    by_label = reference_by_label(schedule, schedule.acc, costs)
    ranked = sorted(by_label.values(), key=lambda p: p.rate, reverse=True)
    keep = {p.label: p for p in ranked[:TOP_CANDIDATES]}
    kinds = {plan_kind(label) for label in keep}
    for p in ranked:
        if plan_kind(p.label) not in kinds or schedule.book.search.tried(p.label):
            keep.setdefault(p.label, p)
            kinds.add(plan_kind(p.label))
    if costs.verify_full(schedule.max_k + 1) <= 1.5 * costs.verify_full(1):
        longest = schedule._sized(Plan(schedule.max_k, False, 0, 0.0)).label
        keep.setdefault(longest, by_label[longest])
    return list(keep.values())


def reference_tree(alphas: list[float], g: float, verify, draft_step_s: float, overhead_s: float,
                   allow_solo: bool) -> TreePlan:
    best = TreePlan(0, [], 1.0, 1.0 / max(verify(1), 1e-12)) if allow_solo else None
    for k in range(1, len(alphas) + 1):
        s = survival(alphas, k)
        gains = sorted(((s[i] * (1.0 - alphas[i]) * g, i) for i in range(k)), reverse=True)
        extra = 0.0
        for m in range(k + 1):
            if m:
                extra += gains[m - 1][0]
            seconds = k * draft_step_s + verify(1 + k + m) + max(0.0, overhead_s)
            plan = TreePlan(k, sorted(i for _, i in gains[:m]), sum(s) + extra, (sum(s) + extra) / max(seconds, 1e-12))
            if best is None or plan.rate > best.rate:
                best = plan
    assert best is not None
    return best


def random_curve(rng: random.Random, base: float) -> CostCurve:
    sizes = sorted(rng.sample(range(1, 40), rng.randint(1, 6)))
    seconds, t = [], base
    for _ in sizes:
        t *= 1 + rng.random() * rng.choice((0.0, 0.1, 1.0))
        seconds.append(t)
    return CostCurve(sizes, seconds, prefix_len=16, per_context_token_s=rng.choice((0.0, 1e-6)))


def random_acceptance(rng: random.Random, alpha: float) -> Acceptance:
    acc = Acceptance(MAX_K)
    for _ in range(rng.randint(0, 40)):
        drafted = rng.randint(1, MAX_K)
        accepted = 0
        while accepted < drafted and rng.random() < alpha:
            accepted += 1
        acc.observe(drafted, accepted)
        (acc.bonus_guess if accepted == drafted else acc.correction_guess).observe(rng.random() < 0.7)
    return acc


def random_state(seed: int) -> tuple[random.Random, Acceptance, Costs]:
    rng = random.Random(seed)
    verify, draft = random_curve(rng, 0.01), random_curve(rng, rng.choice((0.001, 0.003, 0.02)))
    verify2, draft2 = random_curve(rng, 0.01), random_curve(rng, 0.003)
    book = CostBook(MAX_K)
    book.verify = {"share": verify, "full": verify2}
    book.draft = {"share": draft, "full": draft2}
    book.overhead_s = rng.choice((0.0, 0.002))
    book.rollback_refeeds = seed % 5 == 0
    costs = book.costs(rng.choice((16, 300)), batch=rng.choice((1, 1, 3)))
    return rng, random_acceptance(rng, rng.choice((0.05, 0.5, 0.9, 0.99))), costs


def fields(plans_: list[Plan]) -> list[tuple]:
    return [(p.k, p.overlap, p.rows, p.rate, p.hit, p.sides, p.sized, p.label) for p in plans_]


@pytest.mark.parametrize("seed", range(40))
def test_plans_are_exactly_the_plain_formulas(seed):
    _, acc, costs = random_state(seed)
    for rows_ok in (True, False):
        for allowed in ({}, {"allow_overlap": False}, {"allow_sync": False, "allow_solo": False}):
            got = plans(acc, costs, MAX_K, rows_ok, **allowed)
            assert fields(got) == fields(reference_plans(acc, costs, MAX_K, rows_ok, **allowed))
            memo = plans(acc, costs.memoized(), MAX_K, rows_ok, **allowed)
            assert fields(memo) == fields(got)  # the replan's memoized curves read the same points


@pytest.mark.parametrize("seed", range(40))
def test_the_plans_by_label_and_the_candidates_are_the_plain_ones(seed):
    rng, acc, costs = random_state(seed)
    book = CostBook(MAX_K)
    book.fix_curves(random_curve(rng, 0.01), random_curve(rng, 0.003))
    book.sizes_blocks = rng.choice((None, True, False))
    for label in rng.sample(["overlap k=2 rows=3", "sync sized", "sync k=4", "overlap k=5 rows=1", "solo"], 3):
        for _ in range(3):
            book.search.observe(label, rng.randint(1, 8), 0.02, 100.0)
    for tree in (False, True):
        schedule = CostSchedule(5, MAX_K, book, lambda: 100, overlap=seed % 3 != 0, tree=tree)
        schedule.acc = acc
        got = schedule._by_label(acc, costs)
        want = reference_by_label(schedule, acc, costs)
        assert list(got) == list(want)  # the same labels in the same order (ties rank by it)
        assert fields(list(got.values())) == fields(list(want.values()))
        assert fields(schedule._candidates(costs)) == fields(reference_candidates(schedule, costs))


@pytest.mark.parametrize("seed", range(20))
def test_the_best_tree_is_the_plain_search(seed):
    _, acc, costs = random_state(seed)
    alphas = [acc.alpha(i) for i in range(MAX_K)]
    for allow_solo in (True, False):
        got = plan_tree(alphas, acc.correction_guess.value, costs.verify_full, 0.003, 0.001, allow_solo)
        want = reference_tree(alphas, acc.correction_guess.value, costs.verify_full, 0.003, 0.001, allow_solo)
        assert dataclasses.astuple(got) == dataclasses.astuple(want)


def test_a_plans_label_names_it_and_a_changed_copy_gets_its_own():
    assert [p.label for p in (Plan(0, False, 0, 1.0), Plan(3, True, 2, 1.0), Plan(4, False, 0, 1.0, sides=(1, 2)),
                              Plan(5, False, 0, 1.0), Plan(5, False, 0, 1.0, sized=True))] == [
        "solo", "overlap k=3 rows=2", "tree k=4 sides=2", "sync k=5", "sync sized"]
    plan = Plan(5, False, 0, 1.0)
    assert plan.label == "sync k=5" and dataclasses.replace(plan, sized=True).label == "sync sized"
    assert plan == Plan(5, False, 0, 1.0)  # the cached label is no field: equality is the fields'


def test_a_copied_acceptance_is_independent_of_the_original():
    acc = Acceptance(4)
    acc.observe(4, 2)
    twin = copy.deepcopy(acc)
    assert [b.__dict__ for b in twin.positions] == [b.__dict__ for b in acc.positions]
    twin.observe(4, 0)
    twin.bonus_guess.observe(False)
    assert acc.alpha(0) != twin.alpha(0) and acc.bonus_guess.value != twin.bonus_guess.value
    assert acc.optimistic(1.0).alpha(0) >= acc.alpha(0)
