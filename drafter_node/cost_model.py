"""The speed model behind the ``cost`` draft schedule: expected committed tokens per second of each way to run a
round, from measured cost curves, per-position acceptance and the measured round-trip overhead.

A round is one verification. The planner compares, for every block length k and pre-draft plan:

* **solo** (k = 0): no drafting; the verifier steps alone with every core (``threads: auto``), without waiting
  for the drafter: ``rate = 1 / V_full(1)``.
* **sync k**: draft k tokens (one forward each), then verify them; the two nodes alternate, so each may use every
  core: ``rate = E(k) / (k·D_full(1) + V_full(k+1) + o)``.
* **overlap k, R rows**: while block k is verified (on the cores the drafter leaves), the drafter guesses the
  verifier's token for R of the k + 1 outcomes and extends those R rows k tokens deep, one forward of R tokens per
  step. With h the probability that the commit hits a pre-drafted row,
  ``T = max(V_share(k+1) + o, D_share(1) + k·D_share(R)) + (1 − h)·k·D_share(1)`` and ``rate = E(k) / T``.

E(k) = Σ_{j=0..k} Π_{i<j} α_i (expected tokens per round: accepted drafts + the verifier's own token), with α_i the
decaying per-position acceptance. h = Σ over the R most likely outcomes of P(outcome) · g, where P(outcome r) is the
probability that exactly r drafts are accepted and g the measured accuracy of the drafter's guess for the verifier's
token in that outcome (its top-1 after a full block, its next-best token at a rejection).

V and D are the cost curves of the verifier and the drafter (seconds per forward over n new tokens), measured at
start-up and refined from the rounds that run; ``o`` is the round trip minus the verifier's forward.

**Batches.** When B sessions run their rounds together (batched verification, batched drafting), one verifier
forward covers every session's k + 1 tokens and one drafter step every session's rows, so each curve is read at B
times its argument: V(B·(k+1)), D(B·R) (a drafter that does not batch runs B forwards: B·D(R)), plus B rows'
context terms. Every plan's rate above is then one session's share of its batch's, and the comparison holds for the
batch as a whole: the planner speculates at batch B only where E(k) / T_B(k) beats plain batched decoding,
1 / V_full(B) — a per-batch-size choice of k (vLLM's static ``num_speculative_tokens_per_batch_size``, here from the
measured curves; :meth:`CostBook.plans_by_batch` prints the table). B is the verifier's recent batch size, which
every commit reports.
"""

from __future__ import annotations

import copy
import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from drafter_node.plan_search import PlanSearch

#: Decay of older acceptance evidence per observed block, so α follows the text being written.
DECAY = 0.95
#: Prior pseudo-observations per position: a mildly optimistic start (α = 0.6) so drafting is tried.
PRIOR_N, PRIOR_ALPHA = 2.0, 0.6
#: Round-trip overhead samples the estimate is the median of.
OVERHEAD_WINDOW = 16


@dataclass
class Plan:
    """What one round does."""

    k: int  # block length; 0: no drafting, the verifier steps alone
    overlap: bool  # pre-draft the outcomes while the block is verified
    rows: int  # outcome rows pre-drafted (0: none; 1 with a single-chain drafter: the all-accepted outcome)
    rate: float  # expected committed tokens per second
    hit: float = 0.0  # expected probability that the commit finds its next block pre-drafted
    # A token tree (synchronous only, drafter_node.tree_plan): chain positions that also send the drafter's second
    # choice as a leaf (a sibling of that chain token). Empty: a chain.
    sides: tuple[int, ...] = ()
    # A synchronous block that ends where the drafter stops being sure (up to max_k), k being the model's best
    # fixed length (:func:`block_should_end`).
    sized: bool = False

    @property
    def solo(self) -> bool:
        return self.k == 0

    @property
    def label(self) -> str:
        """The plan's name in the realised records and the metrics (``plan_rates``); computed once per plan, and
        each name formatted once per process (the plan search reads the labels of every candidate plan, twice per
        round; ``functools.cached_property`` takes a lock per first read, which cost ~1 ms of a round)."""
        label = self.__dict__.get("_label")
        if label is None:
            label = self.__dict__["_label"] = _label(self.k, self.overlap, self.rows, len(self.sides), self.sized)
        return label


@functools.lru_cache(maxsize=4096)
def _label(k: int, overlap: bool, rows: int, sides: int, sized: bool) -> str:
    """:attr:`Plan.label` of a plan with these fields (``sides``: how many side leaves)."""
    if k == 0:
        return "solo"
    if overlap:
        return f"overlap k={k} rows={rows}"
    if sides:
        return f"tree k={k} sides={sides}"
    return "sync sized" if sized else f"sync k={k}"


class Beta:
    """A decaying success rate with a prior."""

    def __init__(self, prior: float, weight: float = PRIOR_N):
        self.successes, self.trials = prior * weight, weight

    def observe(self, success: bool, decay: float = DECAY) -> None:
        self.successes = decay * self.successes + float(success)
        self.trials = decay * self.trials + 1.0

    @property
    def value(self) -> float:
        return self.successes / self.trials

    def optimistic(self, z: float, trials: float | None = None) -> float:
        """An upper confidence bound: the estimate plus ``z`` standard errors of ``trials`` (default: its own
        decayed evidence). Thin evidence (a prior, one rejected block) leaves room above the mean; many
        observations leave little."""
        v, n = self.value, max(self.trials if trials is None else trials, 1e-9)
        return min(1.0, v + z * math.sqrt(max(v * (1 - v), 0.05) / n))

    def __deepcopy__(self, memo: dict) -> Beta:
        # Numbers only: a copy of the instance's fields is a deep copy, at a tenth of copy.deepcopy's generic walk
        # (an Acceptance, with a Beta per position, is copied at every replan: Acceptance.optimistic).
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def shrink(self, weight: float) -> None:
        """Keep the estimate but at most ``weight`` observations of evidence, so the next ones move it quickly."""
        if self.trials > weight:
            scale = weight / self.trials
            self.successes, self.trials = self.successes * scale, weight


class Acceptance:
    """Per-position acceptance α_i = P(draft i accepted | drafts before it accepted), decaying."""

    def __init__(self, max_k: int):
        self.positions = [Beta(PRIOR_ALPHA) for _ in range(max(1, max_k))]
        self.bonus_guess = Beta(0.8)  # the drafter's top-1 after a fully accepted block is the verifier's bonus
        self.correction_guess = Beta(0.3)  # the drafter's next-best token at a rejection is the verifier's token
        # Positions below this one have evidence of their own; those from it on were never tested and take the
        # deepest tested position's estimate as theirs (see _inherit).
        self.tested = 0

    def observe(self, drafted: int, accepted: int) -> None:
        for i in range(min(drafted, len(self.positions))):
            if i > accepted:
                break  # positions after the first rejection were not tested
            self.positions[i].observe(i < accepted)
            self.tested = max(self.tested, i + 1)
        self._inherit()

    def _inherit(self) -> None:
        """An untested position's prior is the deepest tested position's estimate, not the fixed PRIOR_ALPHA: after
        short blocks that were all accepted, longer ones are expected to be accepted too, so k can grow within the
        first request instead of waiting for each deeper position to be tried against a pessimistic prior (a new
        user's first request accepted 43 of 44 drafts and still ran k = 2.1 on average). The positions' weight
        stays the prior's, so the first test of a deeper position moves it at once."""
        if not 0 < self.tested < len(self.positions):
            return
        value = self.positions[self.tested - 1].value
        for beta in self.positions[self.tested:]:
            beta.successes = value * beta.trials

    def shrink(self, weight: float = PRIOR_N + 1) -> None:
        """Before a run of k = 0 rounds: the rare probe blocks that follow must be able to bring drafting back."""
        for beta in self.positions:
            beta.shrink(weight)

    def optimistic(self, z: float = 1.0, evidence: Acceptance | None = None) -> Acceptance:
        """A copy whose α_i are :meth:`Beta.optimistic` bounds (the guesses' rates as they are): the acceptance
        the evidence cannot yet rule out. Used to decide whether k = 0 may be chosen at all. ``evidence``: an
        estimate with more observations behind it (the node's, across sessions), whose counts bound the margin
        where they exceed this one's (a new session's estimate is shrunk on purpose, not uncertain)."""
        acc = copy.deepcopy(self)
        for i, beta in enumerate(acc.positions):
            trials = beta.trials
            if evidence is not None and i < len(evidence.positions):
                trials = max(trials, evidence.positions[i].trials)
            beta.successes = beta.optimistic(z, trials) * beta.trials
        return acc

    def to_dict(self) -> dict:
        """The per-position rates and the guesses' (what a node remembers of a pair between runs)."""
        return {"alpha": [b.value for b in self.positions], "bonus_guess": self.bonus_guess.value,
                "correction_guess": self.correction_guess.value}

    @classmethod
    def from_memory(cls, max_k: int, memory: dict, weight: float = PRIOR_N) -> Acceptance:
        """A fresh estimate whose prior is ``memory`` (from :meth:`to_dict`) at ``weight`` observations per rate."""
        acc = cls(max_k)
        alpha = [float(a) for a in memory.get("alpha", [])][: len(acc.positions)]
        pairs = [*zip(acc.positions, alpha), (acc.bonus_guess, memory.get("bonus_guess")),
                 (acc.correction_guess, memory.get("correction_guess"))]
        for beta, value in pairs:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
                beta.successes, beta.trials = float(value) * weight, weight
        if alpha:  # positions past those remembered start from the last one remembered (α decays along a block)
            acc.tested = len(alpha)
            for beta in acc.positions[len(alpha):]:
                beta.successes, beta.trials = alpha[-1] * weight, weight
        return acc

    @classmethod
    def realised(cls, max_k: int, accepted: list[int], drafted: list[int], guesses: Acceptance | None = None) -> \
            Acceptance:
        """The acceptance a request realised: α_i = accepted_i / drafted_i from its own counts (no prior; an
        untested position takes the deepest tested one's rate), the guesses' rates from ``guesses`` (the session's
        estimate). What :func:`ceiling` plans with."""
        acc = cls(max_k)
        weight = 1e6  # the counts are the estimate: no prior left
        for i, beta in enumerate(acc.positions):
            if i < len(drafted) and drafted[i] > 0:
                beta.successes, beta.trials = weight * accepted[i] / drafted[i], weight
                acc.tested = i + 1
            else:
                break
        if guesses is not None:
            for mine, theirs in ((acc.bonus_guess, guesses.bonus_guess),
                                 (acc.correction_guess, guesses.correction_guess)):
                mine.successes, mine.trials = theirs.value * weight, weight
        acc._inherit()
        return acc

    def alpha(self, i: int) -> float:
        return self.positions[min(i, len(self.positions) - 1)].value

    def survival(self, k: int) -> list[float]:
        """s[j] = P(the first j drafts are all accepted), j = 0..k."""
        s = [1.0]
        for i in range(k):
            s.append(s[-1] * self.alpha(i))
        return s

    def expected_tokens(self, k: int) -> float:
        return sum(self.survival(k))

    def outcome_hits(self, k: int, survival: list[float] | None = None,
                     alphas: list[float] | None = None) -> list[float]:
        """P(outcome r) · P(the drafter guessed its verifier token), r = 0..k, most likely first. ``survival``:
        :meth:`survival` over k or more positions, and ``alphas``: α_0 … α_(k-1) or more, where the caller has them
        already (:func:`plans` asks for every k)."""
        s = self.survival(k) if survival is None else survival
        a = [self.alpha(r) for r in range(k)] if alphas is None else alphas
        miss = self.correction_guess.value
        hits = [s[r] * (1 - a[r]) * miss for r in range(k)]
        hits.append(s[k] * self.bonus_guess.value)
        return sorted(hits, reverse=True)


class Calibration:
    """P(a drafted token is accepted | the drafter's own probability of it), in CALIBRATION_BINS bins of that
    probability, each a decaying rate whose prior is the bin's middle (a drafter that agrees with its target is
    about calibrated). It lets a synchronous block end where the drafter stops being sure (see
    :func:`block_should_end`) instead of at a fixed length."""

    def __init__(self) -> None:
        self.bins = [Beta((i + 0.5) / CALIBRATION_BINS) for i in range(CALIBRATION_BINS)]

    def _bin(self, prob: float) -> Beta:
        return self.bins[min(CALIBRATION_BINS - 1, max(0, int(prob * CALIBRATION_BINS)))]

    def observe(self, prob: float, accepted: bool) -> None:
        self._bin(prob).observe(accepted, decay=0.99)

    def acceptance(self, prob: float) -> float:
        return self._bin(prob).value


#: Bins of the drafter's probability in :class:`Calibration`.
CALIBRATION_BINS = 10


def block_should_end(probs: list[float], calibration: Calibration, costs: Costs, max_k: int) -> bool:
    """Whether a synchronous block of ``len(probs)`` drafted tokens (the drafter's probability of each) should go to
    the verifier now rather than grow: its expected rate — tokens (1 + Σ survival, each token's acceptance from
    ``calibration``) over the round's time (k full-core draft steps, one full-core verification, the overhead) —
    is at least what any longer block up to ``max_k`` could reach if the next tokens were as sure as the last."""
    k = len(probs)
    if k >= max_k:
        return True
    o = max(0.0, costs.overhead_s)
    d1 = costs.draft_full(1)
    survival, expected = 1.0, 1.0
    for p in probs:
        survival *= calibration.acceptance(p)
        expected += survival
    now = expected / max(k * d1 + costs.verify_full(k + 1) + o, 1e-9)
    a = calibration.acceptance(probs[-1]) if probs else 0.0
    for j in range(k + 1, max_k + 1):
        survival *= a
        expected += survival
        if expected / max(j * d1 + costs.verify_full(j + 1) + o, 1e-9) > now:
            return False
    return True


Curve = Callable[[int], float]  # seconds per forward over n new tokens


@dataclass
class Costs:
    """What a plan costs: the verifier's and drafter's forward time when they share the cores (overlap) and when
    each has them all (the other idles), and the round trip beyond the verifier's forward."""

    verify_share: Curve
    verify_full: Curve
    draft_share: Curve
    draft_full: Curve
    overhead_s: float = 0.0
    rollback_refeeds: bool = False  # a rejection costs the verifier a forward over the pending + accepted tokens

    def memoized(self) -> Costs:
        """These costs with each curve point computed once: a replan reads the same points for several
        acceptances (the session's, the optimistic one, the tree's)."""
        return replace(self, verify_share=_memo(self.verify_share), verify_full=_memo(self.verify_full),
                       draft_share=_memo(self.draft_share), draft_full=_memo(self.draft_full))


def rollback_s(acc: Acceptance, k: int, verify: Curve) -> float:
    """Expected re-feed time of a round of k drafts on a target that rolls back by re-feeding (shared.kv): with a
    drafted tokens accepted before a rejection, one forward over a + 1 tokens (the pending token and those a)."""
    s = acc.survival(k)
    return sum((s[a] - s[a + 1]) * verify(a + 1) for a in range(k))


def plans(acc: Acceptance, costs: Costs, max_k: int, rows_ok: bool, allow_solo: bool = True,
          allow_sync: bool = True, allow_overlap: bool = True) -> list[Plan]:
    """Every candidate plan with its expected rate. ``rows_ok``: the drafter can pre-draft several outcome rows
    (otherwise overlap extends the single all-accepted chain: one row)."""
    out: list[Plan] = []
    add = out.append
    o = max(0.0, costs.overhead_s)
    # Each curve point and acceptance product once per call (a replan weighs hundreds of plans every round, and on
    # a fast target its time is part of the round's).
    verify_full, verify_share = _memo(costs.verify_full), _memo(costs.verify_share)
    if allow_solo:  # the verifier steps at once: no round trip to the drafter
        add(Plan(0, False, 0, 1.0 / max(verify_full(1), 1e-9)))
    d1_full = costs.draft_full(1)
    # D_share(rows) for every row count a block may pre-draft (rows ≤ max_k + 1), read once
    draft_share = [0.0, *(costs.draft_share(rows) for rows in range(1, max_k + 2))] if allow_overlap else []
    d1_share = draft_share[1] if allow_overlap else 0.0
    survival = acc.survival(max_k)
    alphas = [acc.alpha(i) for i in range(max_k)] if allow_overlap and rows_ok else None
    e = 1.0
    for k in range(1, max_k + 1):
        e += survival[k]  # acc.expected_tokens(k)
        if allow_sync:
            t = k * d1_full + verify_full(k + 1) + o
            if costs.rollback_refeeds:
                t += rollback_s(acc, k, verify_full)
            add(Plan(k, False, 0, e / max(t, 1e-9)))
        if allow_overlap:
            tv = verify_share(k + 1) + o
            if costs.rollback_refeeds:
                tv += rollback_s(acc, k, verify_share)
            hits = acc.outcome_hits(k, survival, alphas) if rows_ok else [survival[k] * acc.bonus_guess.value]
            h = 0.0
            for rows, hit in enumerate(hits, 1):
                h += hit
                td = d1_share + k * draft_share[rows]
                t = (td if td > tv else tv) + (1 - h) * k * d1_share  # max(tv, td), without the call
                add(Plan(k, True, rows, e / (1e-9 if t < 1e-9 else t), h))  # max(t, 1e-9), NaN included
    return out


def _memo(curve: Curve) -> Curve:
    """``curve`` with each size's value computed once."""
    seen: dict[int, float] = {}

    def cost(n: int) -> float:
        if n not in seen:
            seen[n] = curve(n)
        return seen[n]

    return cost


def best_plan(acc: Acceptance, costs: Costs, max_k: int, rows_ok: bool, **allowed: bool) -> Plan:
    return max(plans(acc, costs, max_k, rows_ok, **allowed), key=lambda p: p.rate)


def ceiling(acc: Acceptance, costs: Costs, max_k: int, rows_ok: bool, allow_overlap: bool = True) -> Plan:
    """The best plan the cost model knows at acceptance ``acc`` (a request's realised one, :meth:`Acceptance.realised`)
    with the nodes' measured forward costs and no overhead: no round trip, no messaging, no Python between the
    forwards (a rollback's re-feed is a forward, so it stays). Its rate is the ceiling a request's realised decoding
    rate is held against (``ceiling_tokens_per_second`` in the metrics); k = 0 is a candidate, so where drafting
    cannot pay the ceiling is the target alone's rate."""
    return best_plan(acc, replace(costs, overhead_s=0.0), max_k, rows_ok, allow_overlap=allow_overlap)


class CostBook:
    """A node's view of both sides' cost curves (``shared.costs.curve.CostCurve``), shared by its sessions and
    refined by every round they run. ``share``: the curve at the thread count a node uses while the other node works
    too; ``full``: while the other node idles (the same curve when ``threads`` is a fixed number)."""

    def __init__(self, max_k: int = 16) -> None:
        self.acceptance = Acceptance(max_k)  # across sessions: where a new session's estimate starts
        self.calibration = Calibration()  # acceptance by the drafter's confidence, across sessions
        self.search = PlanSearch()  # what each plan realised, across sessions at batch 1
        self.solo_span: int | None = None  # rounds of the next k = 0 run (drafter_node.schedule; None: its minimum)
        self.sizes_blocks: bool | None = None  # the drafter sizes sync blocks by confidence (None: not seen yet)
        self.start_plan: str | None = None  # the label of the plan the last start-up report announced
        self.frozen = False  # fixed curves (tests): rounds do not refine them
        self.verify: dict[str, object] = {}
        self.draft: dict[str, object] = {}
        self.draft_profile = None  # the drafter's start-up profile (NodeProfile), unrefined
        self.verify_threads = {"share": 0, "full": 0}
        self.draft_threads = {"share": 0, "full": 0}
        self.overhead_s: float | None = None
        self._overheads: deque[float] = deque(maxlen=OVERHEAD_WINDOW)
        self.batch_sessions = 1.0  # sessions that share a verifier forward, recently (the commits' decoding; EMA)
        self.draft_batched = True  # the drafter advances all its sessions in one forward per step
        self.rollback_refeeds = False  # the verifier re-feeds the accepted tokens after a rejection (hybrid target)

    def session_acceptance(self) -> Acceptance:
        """A new session's acceptance estimate: the node's so far, with little weight, so the session's own text
        takes over within a few blocks."""
        acc = copy.deepcopy(self.acceptance)
        acc.shrink()
        for beta in (acc.bonus_guess, acc.correction_guess):
            beta.shrink(PRIOR_N + 1)
        return acc

    def fix_curves(self, verify, draft, overhead_s: float = 0.0) -> None:
        """Use these curves for both thread counts and never refine them (deterministic plans in tests)."""
        self.verify = {"share": verify, "full": verify}
        self.draft = {"share": draft, "full": draft}
        self.overhead_s = overhead_s
        self.frozen = True

    @staticmethod
    def _pick(profile, threads: dict[str, int]) -> dict[str, object]:
        return {role: profile.curve(count) for role, count in threads.items()}

    def set_verifier(self, profile, share: int, full: int) -> None:
        self.verify_threads = {"share": share, "full": full}
        self.verify = self._pick(profile, self.verify_threads)

    def set_drafter(self, profile, share: int, full: int) -> None:
        self.draft_threads = {"share": share, "full": full}
        self.draft_profile = profile  # as measured at start-up (``draft`` is refined by every step)
        if profile is not None:
            self.draft = self._pick(profile, self.draft_threads)

    def profiled_draft_s(self, rows: int, threads: int, context: int) -> float | None:
        """What the start-up profile says a drafter forward of ``rows`` rows costs (None: no profile): the node's
        forwards are reported against it (``forward_vs_profile``)."""
        if self.draft_profile is None or not threads:
            return None
        return self.draft_profile.curve(threads).cost(rows, context)

    def set_free_drafter(self) -> None:
        """A drafter without a model (prompt lookup): its steps cost nothing worth planning for."""
        from shared.costs.curve import CostCurve

        free = CostCurve(sizes=[1], seconds=[1e-5], prefix_len=0)
        self.draft = {"share": free, "full": free}

    @property
    def ready(self) -> bool:
        return bool(self.verify) and bool(self.draft)

    def _observe(self, curves: dict[str, object], threads: dict[str, int], n: int, seconds: float, used: int,
                 context: int) -> None:
        from shared.costs.curve import CostCurve

        if self.frozen:
            return
        role = "full" if used and used == threads["full"] and threads["full"] != threads["share"] else "share"
        curve = curves.get(role)
        if curve is None:  # no profile for this side: learn the curve from the rounds alone
            curve = CostCurve(sizes=[n], seconds=[seconds], prefix_len=context)
            curves[role] = curve
            if threads["full"] == threads["share"]:
                curves["full" if role == "share" else "share"] = curve
            return
        curve.observe(n, seconds, context)

    def observe_verify(self, n: int, seconds: float, threads: int, context: int) -> None:
        self._observe(self.verify, self.verify_threads, n, seconds, threads, context)

    def observe_draft(self, rows: int, seconds: float, threads: int, context: int) -> None:
        self._observe(self.draft, self.draft_threads, rows, seconds, threads, context)

    def observe_overhead(self, seconds: float) -> None:
        """Round trip (block sent → commit received) minus the verifier's forward: transit, queueing, decoding.
        The estimate is the median of the last OVERHEAD_WINDOW samples (the smallest while there are fewer than
        three): one round that waited behind a prefill or another session's forward must not stop drafting."""
        if self.frozen:
            return
        self._overheads.append(max(0.0, seconds))
        ordered = sorted(self._overheads)
        self.overhead_s = ordered[len(ordered) // 2] if len(ordered) >= 3 else ordered[0]

    def observe_batch(self, sessions: int) -> None:
        """A commit reports ``sessions`` sessions sharing the verifier's forwards (its ``decoding``)."""
        if sessions >= 1:
            self.batch_sessions = 0.8 * self.batch_sessions + 0.2 * float(sessions)

    def start_batch(self, sessions: int) -> None:
        """A new session will share forwards with ``sessions - 1`` others (its start's ``decoding``): an exact
        count, so the average jumps to it and the session's first plan is for the batch it joins."""
        if sessions >= 1:
            self.batch_sessions = float(sessions)

    @property
    def batch(self) -> int:
        """The batch size plans are made for: the recent number of sessions that share a verifier forward."""
        return max(1, round(self.batch_sessions))

    def costs(self, context: int, batch: int | None = None) -> Costs:
        """One session's round costs at ``batch`` sessions per forward (default: :attr:`batch`)."""
        b = self.batch if batch is None else max(1, int(batch))

        def together(curve) -> Curve:  # one forward over every session's n tokens, each row with its own context
            if b == 1:
                return lambda n: curve.cost(n, context)
            return lambda n: curve.cost(b * n, context) + (b - 1) * max(0.0, curve.cost(n, context)
                                                                       - curve.cost(n))

        def one_by_one(curve) -> Curve:  # a drafter that does not batch: one forward per session
            return lambda n: b * curve.cost(n, context)

        drafting = together if self.draft_batched else one_by_one
        vs = self.verify.get("share") or self.verify.get("full")
        vf = self.verify.get("full") or vs
        ds = self.draft.get("share") or self.draft.get("full")
        df = self.draft.get("full") or ds
        return Costs(together(vs), together(vf), drafting(ds), drafting(df), self.overhead_s or 0.0,
                     self.rollback_refeeds)

    def plans_by_batch(self, acc: Acceptance, max_k: int, rows_ok: bool, context: int,
                       batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), overlap: bool = True) -> list[dict]:
        """Per batch size: the plan the model picks and the batch's expected tokens/s with it and without drafting
        (the table that replaces a static per-batch-size k)."""
        table = []
        for b in batches:
            costs = self.costs(context, b)
            plan = best_plan(acc, costs, max_k, rows_ok, allow_overlap=overlap)
            table.append({"batch": b, "k": plan.k, "overlap": plan.overlap, "rows": plan.rows,
                          "tokens_per_s": b * plan.rate, "plain_tokens_per_s": b / max(costs.verify_full(1), 1e-9)})
        return table
