"""The first run's wording functions (runtime/first_run.py) and the progress fallback off a terminal
(weights/progress.py), without node processes."""

from __future__ import annotations

import io

import pytest

from runtime.first_run import ProfileRelay, plan_words, run_summary, startup_lines
from weights.progress import PlainBar, progress_bar

pytestmark = pytest.mark.unit

PAYS = {"decision": "pays", "schedule": "cost", "k": 4, "overlap": True, "speedup": 1.6, "alpha": 0.6,
        "verify_1_s": 0.29, "verify_k_s": 0.31, "verify_k": 4, "draft_s": 0.095, "verifier_dtype": "bfloat16",
        "verifier_dtype_why": "dtype auto: measured faster here", "verifier_threads": {"share": 1, "full": 2},
        "drafter_dtype": "bfloat16", "drafter_dtype_why": "as configured", "drafter_threads": {"share": 2, "full": 2},
        "drafter": "d1"}
CANNOT = {**PAYS, "decision": "cannot_pay", "k": 0, "overlap": False, "speedup": 1.0, "verify_k_s": 1.2}


def test_plan_words_state_the_decision():
    assert plan_words(PAYS).startswith("speculation pays here: overlap k = 4, expected 1.6× the target alone")
    assert plan_words(CANNOT).startswith("speculation cannot pay on this hardware: running the target alone, "
                                         "expected 1.0×")
    assert "probe" in plan_words({**CANNOT, "decision": "unsure"})
    assert "learned from the first rounds" in plan_words({"decision": "unmeasured"})


def test_startup_lines_name_dtypes_threads_and_costs():
    lines = startup_lines({"target": "t", "drafter_connected": True, "reports": [PAYS]})
    assert lines == [
        "verifier: bfloat16 (dtype auto: measured faster here), 1 thread while both nodes compute, 2 while the "
        "other waits",
        "drafter: bfloat16 (as configured), 2 threads",
        "plan: " + plan_words(PAYS) + "; measured draft step 95 ms, verify 1 token 290 ms, 5 tokens 310 ms",
    ]
    assert "no drafter connected" in startup_lines({"target": "t", "drafter_connected": False})[0]


def test_run_summary_says_what_happened():
    alone = {"new_tokens": 64, "draft_tokens": 0, "accepted_tokens": 0, "rounds": 64, "solo_rounds": 64,
             "drafts": 0, "tokens_per_second": 3.3, "elapsed_s": 19.4}
    assert run_summary(alone, [CANNOT]).startswith(
        "target alone for all 64 tokens: the cost model found speculation cannot pay (draft step 95 ms, verify 1 "
        "token 290 ms")
    spec = {"new_tokens": 64, "draft_tokens": 50, "accepted_tokens": 41, "rounds": 20, "solo_rounds": 0,
            "drafts": 12, "acceptance_rate": 0.82, "mean_accepted_length": 4.4, "tokens_per_second": 5.0,
            "elapsed_s": 12.8}
    text = run_summary(spec, [PAYS])
    assert text.startswith("speculated: 41 of 64 tokens from drafts, acceptance 0.82 (41/50), τ 4.40, k 4.2 on "
                           "average (cost schedule); 1.6× the target alone expected at start-up")
    assert "the target alone: 3.45 tok/s" in text
    # one probe rejected, then k = 0: the summary says the model stopped drafting
    probe = {**alone, "draft_tokens": 1, "drafts": 1, "solo_rounds": 60, "acceptance_rate": 0.0,
             "mean_accepted_length": 1.0}
    assert "60 of 64 rounds the target alone (k = 0" in run_summary(probe, [{**PAYS, "decision": "unsure"}])


def test_plain_bar_prints_a_few_lines_off_a_terminal():
    lines: list[str] = []
    stream = io.StringIO()  # not a terminal
    with progress_bar(1000, "profiling", progress=lines.append, stream=stream) as bar:
        assert isinstance(bar, PlainBar)
        for _ in range(1000):
            bar.update(1)
    assert lines == ["profiling: 25% (250 of 1000)", "profiling: 50% (500 of 1000)",
                     "profiling: 75% (750 of 1000)", "profiling: 100% (1000)"]
    assert stream.getvalue() == "" and not any("\r" in line for line in lines)


def test_a_terminal_gets_a_tqdm_bar():
    stream = io.StringIO()
    with progress_bar(10, "downloading", stream=stream, terminal=True) as bar:
        bar.update(10)
    assert "downloading" in stream.getvalue() and "10/10" in stream.getvalue()


def test_profile_relay_relays_the_profiling_lines_of_node_logs(tmp_path):
    log = tmp_path / "verifier.log"
    log.write_text("2026-12-04 21:19:41,541 verifier INFO verifier: profiling m bfloat16 at 1 thread (budget 20.0 s)"
                   " ...\nLoading weights: 100%\n2026-12-04 21:19:42,000 verifier INFO verifier: profiling m bfloat16 "
                   "1 threads: 1 tok 5.0 ms\n2026-12-04 21:19:43,000 verifier INFO dtype auto: dtype auto for m: "
                   "bfloat16 (score ...)\n2026-12-04 21:19:44,000 verifier INFO half a li")
    out: list[str] = []
    relay = ProfileRelay({"verifier": log}, out.append, terminal=False)
    relay.poll()
    assert out == ["verifier: profiling m bfloat16 at 1 thread (budget 20.0 s) ...",
                   "verifier: dtype auto for m: bfloat16 (score ...)"]
    relay.poll()
    assert len(out) == 2  # nothing new; the incomplete last line waits
    relay.close()
