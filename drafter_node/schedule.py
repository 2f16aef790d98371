"""Draft length per block.

* ``constant``: always ``num_draft_tokens``.
* ``heuristic``: transformers' schedule (all accepted → k + 2, else k − 1, never below 1).
* ``adaptive``: grows like heuristic but falls only when less than half the block was accepted.
* ``cost`` (the default): each round picks the block length k — k = 0 included: the verifier steps alone — whether to
  pre-draft while the block is verified, and how many outcome rows, to maximise expected committed tokens per second
  from the measured cost curves of both nodes, per-position acceptance and the round trip
  (:mod:`drafter_node.cost_model`). While it chooses k = 0 it probes now and then (one synchronous block) so it can
  come back when acceptance recovers.
* ``pipeline``: picks the k that maximises the speed model (docs/architecture.md) from running estimates —
  E(α, k) / max(1, (k+1)·c) when drafting overlaps verification (a round drafts the next block and its bonus
  guess), E(α, k) / (1 + k·c) when it does not — with α the
  per-token acceptance and c = (drafter step time) / (verification round trip), both measured as the session runs.
  Overlapped, this keeps the drafter's block about one verification long, so neither side waits for the other.

All are capped at ``max_draft_tokens``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from drafter_node.cost_model import (
    Acceptance,
    CostBook,
    Costs,
    Plan,
    best_plan,
    block_should_end,
    plans,
)
from drafter_node.plan_search import EXPLORE_ROUNDS
from drafter_node.plan_search import kind as plan_kind
from drafter_node.tree_plan import plan_from_acceptance
from shared.config import DRAFT_SCHEDULES

log = logging.getLogger("pipespec.schedule")

SCHEDULES = DRAFT_SCHEDULES  # declared beside the config key (shared/config.py)

#: k = 0 is kept for this many verifier rounds before a probe block; doubled after each probe that confirms k = 0.
SOLO_ROUNDS_MIN, SOLO_ROUNDS_MAX = 8, 64
#: k = 0 is chosen only if drafting loses even at the acceptance this many standard errors above the estimate
#: (Acceptance.optimistic): one rejected block or a pessimistic prior cannot switch drafting off; many can.
EXPLORE_Z = 1.0
#: Candidates for the plan search (drafter_node.plan_search): this many plans of the highest predicted rate, plus
#: the best of each kind, every plan that ran, and sync k = max_k where the verifier is flat.
TOP_CANDIDATES = 3
#: A verifier whose forward over max_k + 1 tokens costs at most this times one token's is flat: the longest
#: synchronous block is always a candidate there (the model may rank it low while the session's acceptance is young).
FLAT_VERIFY = 1.5
#: A probe is sent only if a perfect drafter (every draft accepted) would beat k = 0 by this factor: where even
#: that cannot pay (e.g. a verifier whose cost grows with every token), probing would be pure overhead.
PROBE_MARGIN = 1.05

_EMA = 0.3  # weight of the newest timing sample
_ALPHA_PRIOR = (4.0, 1.0)  # pseudo-counts (accepted, rejected): a mildly optimistic start
_DECAY = 0.9  # older acceptance evidence fades, so α follows the text being written


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per verification] = (1 − α^(k+1)) / (1 − α) (Leviathan et al. 2023)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class DraftLengthSchedule:
    """The draft length of each round under the ``heuristic``, ``adaptive``, ``constant`` and ``pipeline`` schedules.

    No defaults here: ``max_k`` and ``overlap`` come from the validated ``drafter`` section (declared once, in
    ``drafter_node/settings.py``).
    """

    def __init__(self, k: int, mode: str, *, max_k: int, overlap: bool):
        self.k = k
        self.mode = mode
        self.max_k = max(max_k, k)
        self.overlap = overlap
        self.accepted, self.rejected = _ALPHA_PRIOR
        self.step_s: float | None = None
        self.roundtrip_s: float | None = None
        self.solo_period = 0  # counts runs of k = 0 (``cost`` only): each needs its own idle block
        self.plans: dict[str, int] = {}  # rounds per kind of plan (``cost`` only), reported in the draft stats

    #: Rounds the verifier takes alone from now (``cost`` only); outcome rows to pre-draft (None: all).
    solo_rounds = 0
    rows: int | None = None

    @property
    def overlap_now(self) -> bool:
        """Pre-draft while this round's block is verified."""
        return self.overlap

    def observe_guess(self, bonus: bool, correct: bool) -> None:
        """Whether the drafter's guess of the verifier's own token in a commit was right (``cost`` only)."""

    def block_done(self, probs: list[float | None]) -> bool | None:
        """Whether a block sized by the drafter's confidence should go now (``cost`` only; None: fixed k)."""
        return None

    def observe_confidence(self, probs: list[float | None], accepted: int) -> None:
        """A verified block's drafter probabilities and how many of its tokens were accepted (``cost`` only)."""

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

    def observe_round(self, committed: int, seconds: float) -> None:
        """A round committed ``committed`` tokens ``seconds`` after the previous commit (the cost schedule's use)."""

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


class CostSchedule(DraftLengthSchedule):
    """The ``cost`` schedule: a :class:`~drafter_node.cost_model.Plan` per round from the node's :class:`CostBook`.

    Until both sides' curves are known (profiles off and no round measured yet) it keeps the configured k."""

    def __init__(self, k: int, max_k: int, book: CostBook, context: Callable[[], int], overlap: bool,
                 rows_ok: bool = True, tree: bool = False):
        super().__init__(k, "cost", max_k=max_k, overlap=overlap)
        self.max_k = max_k
        self.book = book
        self.context = context
        self.rows_ok = rows_ok
        self.tree = tree  # synchronous rounds may send a token tree (drafter.tree; greedy, no q, no target state)
        self.acc = book.session_acceptance()
        self.plan = Plan(min(k, max_k), overlap, (min(k, max_k) + 1) if rows_ok else 1, 0.0)
        self.solo_left = 0  # verifier rounds still to be taken alone
        self.probing = False
        self.explored = 0  # plans that drafted although the estimate alone would have chosen k = 0
        self.exploring_rounds = 0  # rounds that ran a plan for the plan search's untried bonus (≤ EXPLORE_ROUNDS)
        self.plans = {"solo": 0, "sync": 0, "overlap": 0, "tree": 0}
        self._plans_memo: dict[tuple[int, bool], tuple[Acceptance, list[Plan]]] | None = None
        self.sized_block = False  # the block in flight was sized by the drafter's confidence (block_done answered)
        self.replan()

    @property
    def solo_span(self) -> int:
        """How many rounds the next run of k = 0 lasts: the node's (its book's), so a new session does not probe
        again every SOLO_ROUNDS_MIN rounds a drafter its sessions' probes found useless."""
        return self.book.solo_span or SOLO_ROUNDS_MIN

    @solo_span.setter
    def solo_span(self, rounds: int) -> None:
        self.book.solo_span = rounds

    @property
    def overlap_now(self) -> bool:
        return self.plan.overlap and not self.probing

    @property
    def rows(self) -> int | None:  # type: ignore[override]
        return self.plan.rows if self.plan.overlap else None

    def k_if_accepted(self) -> int:
        return max(1, self.k)

    @property
    def confidence_sized(self) -> bool:
        """This round's block is synchronous and ends where the drafter stops being sure (up to ``max_k``), not
        at ``k``: the plan chose drafting over k = 0, the drafter's confidence decides how far (greedy drafters that
        report their probabilities; probes keep their fixed length)."""
        return self.plan.sized and not self.overlap_now and not self.probing

    def block_done(self, probs: list[float | None]) -> bool | None:
        """For a confidence-sized block: whether to send the ``len(probs)`` tokens drafted so far (None: the
        fixed k applies — no probabilities, or not such a block)."""
        if not self.confidence_sized or not probs or any(p is None for p in probs):
            return None
        self.sized_block = True
        self.book.sizes_blocks = True
        return block_should_end(probs, self.book.calibration, self.book.costs(self.context()), self.max_k)

    def observe_confidence(self, probs: list[float | None], accepted: int) -> None:
        """A verified block's tokens (their drafter probabilities): accepted up to ``accepted``, then one rejected."""
        for i, p in enumerate(probs[: accepted + 1]):
            if p is not None:
                self.book.calibration.observe(p, i < accepted)

    def round_label(self) -> str:
        """The label of the round in force (the plan its block was sent under): a sized plan whose drafter gave no
        probabilities ran its fixed k."""
        if self.plan.sized and not self.sized_block:
            return dataclasses.replace(self.plan, sized=False).label
        return self.plan.label

    def observe_round(self, committed: int, seconds: float) -> None:
        """The round just committed gave ``committed`` tokens in ``seconds`` (commit to commit): recorded in the
        book's :class:`~drafter_node.plan_search.PlanSearch` under the plan in force (the one its block was sent
        under), at batch 1, rounds alone (``solo``) included; probes are not plans the search chooses."""
        if self.plan.sized and self.confidence_sized and not self.sized_block:
            self.book.sizes_blocks = False  # no probabilities: this drafter's sync blocks run their fixed k
        if self.book.batch > 1 or seconds <= 0 or self.probing:
            return
        self.book.search.observe(self.round_label(), committed, seconds, self.plan.rate)

    # The cost book measures steps and round trips for every session; the EMAs of the older schedules are unused.
    def observe_step(self, seconds: float) -> None:
        pass

    def observe_roundtrip(self, seconds: float) -> None:
        pass

    def observe_guess(self, bonus: bool, correct: bool) -> None:
        for acc in (self.acc, self.book.acceptance):
            (acc.bonus_guess if bonus else acc.correction_guess).observe(correct)

    def update(self, drafted: int, accepted: int) -> None:
        if self.solo_left > 0:
            if drafted == 0:  # one of the rounds the verifier takes alone
                self.solo_left -= 1
                if self.solo_left == 0:
                    if self.drafting_can_pay():
                        self.probing = True  # the next block is a probe: synchronous, so it may take every core
                        self.replan(allow_solo=False)
                    else:  # not even a perfect drafter would win: another run alone, no probe
                        self.solo_span = SOLO_ROUNDS_MAX
                        self._start_solo()
                return
            self.solo_left = 0  # a block was verified after all (e.g. the verifier restarted): plan afresh
        if drafted:
            self.acc.observe(drafted, accepted)
            self.book.acceptance.observe(drafted, accepted)
        was_probe, self.probing = self.probing, False
        self.sized_block = False
        self.replan(was_probe=was_probe)

    @property
    def solo_rounds(self) -> int:  # type: ignore[override]
        return self.solo_left if self.plan.solo else 0

    def replan(self, allow_solo: bool = True, was_probe: bool = False) -> None:
        if not self.book.ready:
            return
        self._plans_memo = {}  # this replan's plans per acceptance (they are weighed several times over)
        try:
            self._replan(allow_solo, was_probe)
        finally:
            self._plans_memo = None

    def _replan(self, allow_solo: bool, was_probe: bool) -> None:
        costs = self.book.costs(self.context()).memoized()
        allowed = {"allow_overlap": self.overlap and allow_solo}
        plan = model = max(self._plans(self.acc, costs, allow_solo=allow_solo, **allowed), key=lambda p: p.rate)
        if self.tree:
            plan = self._tree_or(plan, costs)
        if not plan.solo and allow_solo and self.book.batch == 1:
            plan = self._search(plan, costs)
        elif plan.solo:
            # Explore: k = 0 only where drafting loses even at the acceptance the evidence cannot rule out; else
            # the plan that would win at that acceptance, with the rate the estimate itself predicts for it.
            # Both at the rates they realise (drafting plans that realised less than the verifier alone are not
            # explored again on the model's word).
            hopeful = max(self._plans(self.acc.optimistic(EXPLORE_Z, self.book.acceptance), costs, allow_solo=False,
                                      **allowed), key=lambda p: p.rate)
            if self.book.search.now(hopeful) > self.book.search.now(plan):
                plan = next(p for p in self._plans(self.acc, costs, allow_solo=False, **allowed)
                            if (p.k, p.overlap, p.rows) == (hopeful.k, hopeful.overlap, hopeful.rows))
                self.explored += 1
        plan = self._sized(plan)
        if log.isEnabledFor(logging.DEBUG):  # PIPESPEC_LOG_LEVEL=debug: why each round runs what it runs
            log.debug("replan: %s at %.2f tok/s predicted (model's best %s; acceptance %s; solo span %d; probe %s; "
                      "verify 1 token %.0f ms, draft step %.0f ms)", plan.label, plan.rate, model.label,
                      " ".join(f"{self.acc.alpha(i):.2f}" for i in range(min(4, self.max_k))), self.solo_span,
                      was_probe, 1000 * costs.verify_full(1), 1000 * costs.draft_full(1))
        self.plan, self.k = plan, plan.k
        self.plans["solo" if plan.solo else "overlap" if plan.overlap else "tree" if plan.sides else "sync"] += 1
        if plan.solo:
            self.acc.shrink()
            if was_probe:  # the probe did not bring drafting back: probe less often
                self.solo_span = min(2 * self.solo_span, SOLO_ROUNDS_MAX)
            self._start_solo()
        elif allow_solo:
            self.solo_span = SOLO_ROUNDS_MIN

    def _best_tree(self, costs: Costs, acc: Acceptance | None = None) -> Plan | None:
        """The best synchronous chain-with-side-leaves (:func:`drafter_node.tree_plan.plan_tree`) at ``acc`` (the
        session's estimate); None where no side leaf pays. Overlapped rounds keep chains (pre-drafting follows one
        chain's outcomes)."""
        tree = plan_from_acceptance(acc or self.acc, self.max_k, costs.verify_full, costs.draft_full(1),
                                    costs.overhead_s, allow_solo=False)
        return Plan(tree.k, False, 0, tree.rate, sides=tuple(tree.sides)) if tree.sides else None

    def _tree_or(self, plan: Plan, costs: Costs) -> Plan:
        """The best tree where its expected rate beats ``plan``'s, else ``plan``."""
        tree = self._best_tree(costs)
        return tree if tree is not None and tree.rate > plan.rate else plan

    def _sized(self, plan: Plan) -> Plan:
        """A synchronous chain becomes a confidence-sized block unless the drafter is known not to size them."""
        if plan.solo or plan.overlap or plan.sides or self.book.sizes_blocks is False:
            return plan
        return dataclasses.replace(plan, sized=True)

    def _search(self, plan: Plan, costs: Costs) -> Plan:
        """The plan the realised records and the exploration rule choose (:mod:`drafter_node.plan_search`), with
        the model's ``plan`` among the candidates, or k = 0 where the verifier alone realised more than that plan
        realises now; at most EXPLORE_ROUNDS rounds per session go to exploring."""
        explore = self.exploring_rounds < EXPLORE_ROUNDS
        optimistic = self._by_label(self.acc.optimistic(EXPLORE_Z, self.book.acceptance), costs) if explore else {}
        chosen, exploring = self.book.search.choose(self._candidates(costs), self._sized(plan), explore,
                                                    {label: p.rate for label, p in optimistic.items()})
        solo = next(p for p in self._plans(self.acc, costs, allow_solo=True, allow_overlap=self.overlap) if p.solo)
        if self.book.search.tried(solo.label) and self.book.search.now(solo) > self.book.search.now(chosen):
            return solo  # the verifier alone realised more than drafting realises now
        self.exploring_rounds += exploring
        return chosen

    def _plans(self, acc: Acceptance, costs: Costs, allow_solo: bool, allow_overlap: bool) -> list[Plan]:
        """:func:`~drafter_node.cost_model.plans` at ``acc``, each acceptance's list built once per replan (its
        ``costs`` are the replan's; the memo holds ``acc`` itself, so no other object can take its id meanwhile)."""
        memo, key = self._plans_memo, (id(acc), allow_overlap)
        if memo is None:  # outside a replan: nothing to share
            memo = {}
        if key not in memo:
            memo[key] = (acc, plans(acc, costs, self.max_k, self.rows_ok, allow_overlap=allow_overlap))
        every = memo[key][1]
        return every if allow_solo else [p for p in every if not p.solo]

    def _by_label(self, acc: Acceptance, costs: Costs) -> dict[str, Plan]:
        """Every drafting plan at acceptance ``acc``, the best of each label (all sized sync lengths share one)."""
        # Every sync chain is labelled as its sized block would be (``_sized``): the best of them is made sized once,
        # not each of them (a replan labels a few hundred plans).
        sized = self.book.sizes_blocks is not False
        by_label: dict[str, Plan] = {}
        for p in self._plans(acc, costs, allow_solo=True, allow_overlap=self.overlap):
            if p.solo:
                continue
            label = "sync sized" if sized and not p.overlap and not p.sides else p.label
            best = by_label.get(label)
            if best is None or p.rate > best.rate:
                by_label[label] = p
        if sized and "sync sized" in by_label:
            by_label["sync sized"] = self._sized(by_label["sync sized"])
        if self.tree:
            tree = self._best_tree(costs, acc)
            if tree is not None and (tree.label not in by_label or tree.rate > by_label[tree.label].rate):
                by_label[tree.label] = tree
        return by_label

    def _candidates(self, costs: Costs) -> list[Plan]:
        """The plans the search weighs besides the model's own, one per label: the TOP_CANDIDATES best
        predicted, the best of each kind, every plan that ran, and sync k = max_k where verification is flat."""
        by_label = self._by_label(self.acc, costs)
        ranked = sorted(by_label.items(), key=lambda item: item[1].rate, reverse=True)
        keep = dict(ranked[:TOP_CANDIDATES])
        kinds = {plan_kind(label) for label in keep}
        tried = self.book.search.tried
        for label, p in ranked:
            kind = plan_kind(label)
            if kind not in kinds or tried(label):
                keep.setdefault(label, p)
                kinds.add(kind)
        if costs.verify_full(self.max_k + 1) <= FLAT_VERIFY * costs.verify_full(1):
            longest = self._sized(Plan(self.max_k, False, 0, 0.0)).label
            keep.setdefault(longest, by_label[longest])
        return list(keep.values())

    def _start_solo(self) -> None:
        self.solo_left = self.solo_span
        self.solo_period += 1

    def drafting_can_pay(self) -> bool:
        """Would a perfect drafter (every draft and guess right) beat k = 0 by PROBE_MARGIN with today's costs?"""
        costs = self.book.costs(self.context())
        perfect = Acceptance(self.max_k)
        for beta in (*perfect.positions, perfect.bonus_guess, perfect.correction_guess):
            beta.successes = beta.trials
        best = best_plan(perfect, costs, self.max_k, self.rows_ok, allow_solo=False, allow_overlap=self.overlap)
        return best.rate > PROBE_MARGIN / max(costs.verify_full(1), 1e-9)
