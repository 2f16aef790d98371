"""The drafter's start-up report (:class:`shared.protocol.StartReport`): what both nodes chose (dtype and why, thread
counts), the measured costs (verifying 1 and k + 1 tokens, one draft step) and the plan the cost model implies for a
new session, taken from the very schedule a session runs (:class:`drafter_node.schedule.CostSchedule` on a copy of the
node's :class:`~drafter_node.cost_model.CostBook`), so the launcher's start-up lines and the schedule never disagree.
"""

from __future__ import annotations

import copy

from drafter_node.cost_model import CostBook, best_plan, plans
from drafter_node.schedule import CostSchedule
from drafter_node.settings import DrafterConfig
from shared.costs.curve import NodeProfile
from shared.costs.dtype_choice import dtype_reason
from shared.protocol import MAX_REPORT_CHARS, StartReport, ThreadCounts

#: The context (tokens already in the cache) the start-up plan is made for: a short chat prompt.
REPORT_CONTEXT = 64


def start_report(settings: DrafterConfig, book: CostBook, *, block_len: int | None = None, free: bool = False,
                 drafter_profile: NodeProfile | None = None, verifier_profile: NodeProfile | None = None,
                 drafter_threads: ThreadCounts | None = None, verifier_threads: ThreadCounts | None = None,
                 drafter_dtype: str | None = None, verifier_dtype: str | None = None) -> StartReport:
    """The report for a node whose ``book`` knows what it knows now (after the welcome). ``block_len``: a drafter
    type's fixed block (MTP heads); ``free``: a drafter without a model (prompt lookup)."""
    report = StartReport(schedule=settings.draft_schedule, drafter_threads=drafter_threads,
                         verifier_threads=verifier_threads)
    if verifier_profile is not None:
        report.verifier_dtype = verifier_profile.dtype
        report.verifier_dtype_why = dtype_reason(verifier_profile)[:MAX_REPORT_CHARS]
    elif verifier_dtype:
        report.verifier_dtype, report.verifier_dtype_why = verifier_dtype, "not profiled"
    if drafter_profile is not None:
        report.drafter_dtype = drafter_profile.dtype
        report.drafter_dtype_why = dtype_reason(drafter_profile)[:MAX_REPORT_CHARS]
    elif drafter_dtype:
        report.drafter_dtype = drafter_dtype
        report.drafter_dtype_why = "no model to measure" if free else "not profiled"
    elif free:
        report.drafter_dtype_why = "no model: copies tokens from the prompt"
    if not book.ready:
        return report  # "unmeasured": the plan is learned from the rounds
    max_k = block_len if block_len is not None else settings.max_draft_tokens
    start = min(block_len if block_len is not None else settings.num_draft_tokens, max_k)
    schedule = _new_session_schedule(settings, book, block_len)
    costs = schedule.book.costs(REPORT_CONTEXT, 1)
    if settings.draft_schedule == "cost":
        plan = schedule.plan
        if plan.solo:
            report.decision = "unsure" if schedule.drafting_can_pay() else "cannot_pay"
        else:
            report.decision = "unsure" if schedule.explored else "pays"
    else:  # a fixed rule: k as configured; what the cost model expects of it
        k = min(settings.num_draft_tokens, max_k)
        report.decision = "fixed"
        overlap = settings.overlap
        candidates = [p for p in plans(schedule.acc, costs, max(k, 1), True, allow_solo=False,
                                       allow_overlap=overlap, allow_sync=not overlap) if p.k == k]
        plan = max(candidates, key=lambda p: p.rate) if candidates else best_plan(schedule.acc, costs, max_k, True)
    solo_rate = 1.0 / max(costs.verify_full(1), 1e-9)
    report.k, report.overlap = plan.k, plan.overlap
    report.speedup = round(plan.rate / solo_rate, 3) if plan.rate > 0 else 1.0
    report.alpha = round(schedule.acc.alpha(0), 3)
    report.verify_k = plan.k if plan.k >= 1 else max(1, start)
    report.verify_1_s = costs.verify_full(1)
    report.verify_k_s = (costs.verify_share if plan.overlap else costs.verify_full)(report.verify_k + 1)
    report.draft_s = 0.0 if free else costs.draft_full(1)
    return report


def _new_session_schedule(settings: DrafterConfig, book: CostBook, block_len: int | None) -> CostSchedule:
    """The cost schedule a new session would start with, on a copy of ``book``."""
    max_k = block_len if block_len is not None else settings.max_draft_tokens
    start = min(block_len if block_len is not None else settings.num_draft_tokens, max_k)
    book = copy.deepcopy(book)  # planning refines nothing, but a schedule's first plan counts itself in the book
    return CostSchedule(start, max_k, book, lambda: REPORT_CONTEXT, settings.overlap, rows_ok=True,
                        tree=settings.tree)


def start_plan_label(settings: DrafterConfig, book: CostBook, block_len: int | None = None) -> str | None:
    """The label (:attr:`~drafter_node.cost_model.Plan.label`) of the plan the start-up report announces, which
    each session's ``plan_check`` confirms or corrects; None unless the ``cost`` schedule plans from known costs."""
    if settings.draft_schedule != "cost" or not book.ready:
        return None
    return _new_session_schedule(settings, book, block_len).plan.label
