"""Choosing each round's plan by what the plans realise, with the cost model's prediction as the prior.

The cost model (:mod:`drafter_node.cost_model`) predicts every plan's rate from measured curves, but its assumptions
miss things that only running shows: overlapped rounds on cores both nodes share realise less than predicted, a
confidence-sized synchronous block more (measured on a 2-core AMX Xeon, the 1.5B + 0.5B pair: overlap predicted 5.4–6.5
tok/s and realised 5.0–5.9, while sync k = 8 realised 7.1–7.8). So every round's committed tokens and seconds are
recorded per plan (its :attr:`~drafter_node.cost_model.Plan.label`: ``sync k=8``, ``overlap k=3 rows=4``, ...), with
the tokens its predictions promised over the same seconds. A plan that ran is estimated at its realised rate (not its
prediction times a ratio: the predictions rise while a session's acceptance estimate climbs from its prior, which
would flatter the plans that ran first); one that did not, at its prediction times the realised-over-predicted ratio
of its kind (``sync``, ``overlap``, ``tree``), so one slow overlap plan marks its siblings down too.

Choice (optimistic initial values): a plan that ran MIN_ROUNDS rounds is valued at its estimate; one that did not, at
its optimistic prediction (at the acceptance the evidence cannot rule out: positions a session's short blocks never
reached keep their prior, which would hide long blocks for good) times its kind's ratio, or times UNTRIED_BONUS while
no plan of its kind ran. The highest value runs once any plan has run (so a node's first session, and the start-up
report, begin with the model's plan; later sessions weigh the model's plan like the other untried ones, so a plan that
ran and beat its prediction cannot keep a better one from ever running). Exploring — running a plan that has not run
enough and is not the model's choice — is limited to EXPLORE_ROUNDS rounds per session; after that only the plans that
ran and the model's choice are weighed, at their estimates. A plan that realised clearly less than the best keeps its
low estimate and is not run again while its record lasts: a record is forgotten once its plan has not run for
STALE_ROUNDS of the node's drafting rounds, since rates measured on a host whose speed drifts, or in a few rounds of a
warm-up, must not keep a plan from running for good.

The verifier stepping alone (k = 0, label ``solo``) is recorded too, and weighed against drafting at the rates each
realises now (:meth:`PlanSearch.now`): a drafter whose blocks realise less than the verifier alone stops drafting
although the model predicts drafting pays (a drafter that guesses a little on one text, a verifier whose forward
over k + 1 tokens costs more than its profile says), and one the model would stop is not sent exploring where its
plans realise less than the verifier alone. How long a run alone lasts before the next probe is the node's, not
the session's: a new session does not probe a drafter that the last probes found useless every few rounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, TypeVar


class Plan(Protocol):
    """What the search reads of a plan (:class:`drafter_node.cost_model.Plan`, which imports this module)."""

    @property
    def label(self) -> str: ...

    @property
    def rate(self) -> float: ...


P = TypeVar("P", bound=Plan)

#: Decay of a plan's record per round it runs: a few rounds follow the text being written.
RECORD_DECAY = 0.8
#: Rounds a plan must have run before its realised rate corrects its prediction.
MIN_ROUNDS = 2
#: How much more than its prediction a plan of an untried kind may realise (one within 1/UNTRIED_BONUS of the best
#: is worth a try).
UNTRIED_BONUS = 1.25
#: Rounds per session that may run a plan the estimates alone would not choose (MIN_ROUNDS each: 3 plans).
EXPLORE_ROUNDS = 6
#: A record whose plan has not run for this many of the node's drafting rounds is forgotten (the plan counts as
#: untried again, and its next rounds start a new record). Rates measured minutes ago on a host whose speed drifts
#: (the AMX host's bare forwards moved by 1.5x within the hour), or in a warm-up of a few rounds, otherwise keep a
#: plan that realised little then from ever running again, however the machine has changed since. Rounds alone do
#: not age the drafting records: a drafter that cannot pay is not sent probing by its records expiring. Each time
#: a record is forgotten the records of its kind (``sync``, ``overlap``, ...) last twice as long from then on (up to
#: STALE_ROUNDS_MAX): plans of a kind that keeps realising less are re-tried at 16, 32, 64, ... rounds, not every 16.
STALE_ROUNDS = 16
STALE_ROUNDS_MAX = 512


class PlanRecord:
    """What one plan realised, decaying: committed tokens, the tokens its predictions promised over the same
    seconds, and the seconds."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.promised = 0.0
        self.seconds = 0.0
        self.rounds = 0
        self.last = 0  # the node's drafting-round count when this plan last ran (PlanSearch.drafting_rounds)

    def observe(self, committed: int, seconds: float, predicted_rate: float) -> None:
        self.tokens = RECORD_DECAY * self.tokens + committed
        self.promised = RECORD_DECAY * self.promised + predicted_rate * seconds
        self.seconds = RECORD_DECAY * self.seconds + seconds
        self.rounds += 1

    @property
    def tried(self) -> bool:
        return self.rounds >= MIN_ROUNDS and self.promised > 0

    @property
    def rate(self) -> float | None:
        """Realised tokens per second, once tried."""
        return self.tokens / self.seconds if self.tried and self.seconds > 0 else None


def kind(label: str) -> str:
    """``sync``, ``overlap``, ``tree`` or ``solo``: the first word of a plan's label."""
    return label.split(" ", 1)[0]


class PlanSearch:
    """Realised records of the plans a node ran (across its sessions, at batch 1) and the explore/exploit choice."""

    def __init__(self) -> None:
        # Records of plans that ran within their kind's lifetime (older ones are dropped as the rounds go by).
        self.records: dict[str, PlanRecord] = {}
        self._lasts: dict[str, int] = {}  # per kind: drafting rounds a record lasts unrun (doubles when one is dropped)
        self.drafting_rounds = 0  # drafting rounds (not ``solo``) observed: the clock records age by

    def observe(self, label: str, committed: int, seconds: float, predicted_rate: float) -> None:
        if seconds > 0 and predicted_rate > 0:
            if kind(label) != "solo":
                self.drafting_rounds += 1
                self._forget_stale()  # only a drafting round moves the clock
            record = self.records.setdefault(label, PlanRecord())  # new, or forgotten: a fresh record
            record.observe(committed, seconds, predicted_rate)
            record.last = self.drafting_rounds

    def _forget_stale(self) -> None:
        """Drop the records whose plan has not run within its kind's lifetime, doubling that lifetime."""
        stale = [label for label, r in self.records.items()
                 if self.drafting_rounds - r.last > self._lasts.get(kind(label), STALE_ROUNDS)]
        for label in stale:
            del self.records[label]
            self._lasts[kind(label)] = min(2 * self._lasts.get(kind(label), STALE_ROUNDS), STALE_ROUNDS_MAX)

    def tried(self, label: str) -> bool:
        record = self.records.get(label)
        return record is not None and record.tried

    def kind_ratio(self, which: str) -> float | None:
        """Realised over predicted across the tried plans of one kind."""
        tried = [r for label, r in self.records.items() if kind(label) == which and r.tried]
        if not tried:
            return None
        return sum(r.tokens for r in tried) / sum(r.promised for r in tried)

    def estimate(self, plan: Plan) -> float:
        """The rate ``plan`` is expected to realise: what it realised, else its prediction corrected by its kind's
        ratio."""
        record = self.records.get(plan.label)
        if record is not None and record.rate is not None:
            return record.rate
        ratio = self.kind_ratio(kind(plan.label))
        return plan.rate * (1.0 if ratio is None else ratio)

    def now(self, plan: Plan) -> float:
        """The rate ``plan`` is expected to realise at the acceptance its prediction was made for: its prediction
        times what its own rounds realised over what they were promised (its kind's where it has not run). Unlike
        :meth:`estimate` this follows the text: a drafting plan whose rounds ran on text the drafter could not guess
        is not held to that rate once the acceptance estimate rises (what k = 0 against drafting needs)."""
        record = self.records.get(plan.label)
        if record is not None and record.tried:
            return plan.rate * record.tokens / record.promised
        return self.estimate(plan)  # not run yet: its prediction times its kind's ratio

    def value(self, plan: Plan, optimistic_rate: float) -> float:
        """:meth:`estimate` for a plan that ran; for one that did not, ``optimistic_rate`` (its prediction at an
        optimistic acceptance) times its kind's ratio, or UNTRIED_BONUS while the kind is unknown."""
        if self.tried(plan.label):
            return self.estimate(plan)
        ratio = self.kind_ratio(kind(plan.label))
        return max(plan.rate, optimistic_rate) * (UNTRIED_BONUS if ratio is None else ratio)

    def choose(self, candidates: Iterable[P], model_plan: P, explore: bool,
               optimistic: Mapping[str, float] | None = None) -> tuple[P, bool]:
        """The plan to run among ``candidates`` and ``model_plan`` (the cost model's own choice), and whether that
        is exploration (a plan that has not run enough, other than the model's). ``explore``: the session may still
        spend a round exploring; ``optimistic``: each label's predicted rate at an optimistic acceptance."""
        cands = [*candidates, model_plan]
        # The prior first: a node's first rounds run the model's plan. Once any plan ran, the model's plan is weighed
        # like the other untried ones (a plan that ran and beat its prediction must not keep it from running).
        if not explore or not any(r.tried for r in self.records.values()):
            cands = [p for p in cands if self.tried(p.label) or p.label == model_plan.label]
            return max(cands, key=self.estimate), False
        optimistic = optimistic or {}
        pick = max(cands, key=lambda p: self.value(p, optimistic.get(p.label, p.rate)))
        return pick, not self.tried(pick.label) and pick.label != model_plan.label
