"""The soak's bookkeeping (benchmarks/soak_books.py): how each request's end is counted, memory slopes and
flatness, stalls split by fault windows, and the report's tables. No cluster: plain data in, figures out."""

from __future__ import annotations

import json

import pytest

from benchmarks.soak_books import (
    Outcome,
    classify_answer,
    classify_stream,
    memory_summary,
    outcome_table,
    report_lines,
    slope_mib_per_h,
    stall_summary,
    summarise,
)

pytestmark = pytest.mark.unit


def _answer(finish: str | None, **choice) -> bytes:
    return json.dumps({"choices": [{"finish_reason": finish, **choice}]}).encode()


def _err(code: str = "verifier_gone", message: str = "the verifier went away") -> dict:
    return {"error": {"message": message, "type": "server_error", "code": code}}


def test_a_finished_answer_is_completed_and_a_missing_one_lost():
    assert classify_answer(200, _answer("length", text="abc")) == ("completed", "length")
    assert classify_answer(None, b"") == ("lost", "no answer")


@pytest.mark.parametrize("status", [400, 429, 503])
def test_an_error_with_a_message_is_a_clear_failure(status):
    result, detail = classify_answer(status, json.dumps(_err("busy")).encode())
    assert result == "failed" and detail == f"{status} busy"


@pytest.mark.parametrize("status,body", [
    (500, b"Internal Server Error"),            # a 5xx without an OpenAI error body
    (503, json.dumps(_err(message=" ")).encode()),  # an error without a message says nothing
    (200, _answer(None, text="abc")),            # answered, never finished
    (200, b"<html>"),                            # not JSON
])
def test_answers_that_are_neither_done_nor_a_clear_error_are_unclear(status, body):
    assert classify_answer(status, body)[0] == "unclear"


def test_a_structured_answer_must_keep_its_schema_when_it_stops():
    good = _answer("stop", message={"content": '{"a": 1, "b": true}'})
    assert classify_answer(200, good, ["a", "b"])[0] == "completed"
    assert classify_answer(200, _answer("stop", message={"content": '{"a": 1}'}), ["a", "b"])[0] == "unclear"
    assert classify_answer(200, _answer("stop", message={"content": "{"}), ["a"])[0] == "unclear"
    # cut by max_tokens: a prefix of valid JSON is all it could be
    assert classify_answer(200, _answer("length", message={"content": '{"a'}), ["a"])[0] == "completed"


def _chunk(finish: str | None = None) -> dict:
    return {"choices": [{"text": "x", "finish_reason": finish}]}


def test_stream_outcomes():
    assert classify_stream(200, [_chunk(), _chunk("stop")], True) == ("completed", "stop")
    assert classify_stream(200, [_chunk(), _err()], False)[0] == "failed"
    assert classify_stream(503, [], False, body=json.dumps(_err()).encode())[0] == "failed"
    assert classify_stream(200, [_chunk(), _chunk()], False)[0] == "unclear"  # cut without an error
    assert classify_stream(200, [_chunk()], True)[0] == "unclear"  # [DONE] without a finish reason
    assert classify_stream(200, [_chunk()], False, timed_out=True)[0] == "lost"
    assert classify_stream(None, [], False, timed_out=True)[0] == "lost"


def test_a_hang_up_is_cancelled_only_once_the_stream_began():
    assert classify_stream(200, [_chunk(), _chunk(), _chunk()], False, hung_up=True)[0] == "cancelled"
    assert classify_stream(200, [_chunk(), _err()], False, hung_up=True)[0] == "failed"


def test_slope_is_mib_per_hour_and_needs_samples():
    points = [(t, 100 + t / 36) for t in range(0, 600, 60)]  # 1 MiB per 36 s = 100 MiB/h
    assert slope_mib_per_h(points) == pytest.approx(100)
    assert slope_mib_per_h(points[:3]) is None
    assert slope_mib_per_h([(5.0, 1.0)] * 10) is None  # no time span


def _samples(name, pid, start, n, mib):
    return [{"t": start + 10 * i, "name": name, "pid": pid, "mib": mib(i)} for i in range(n)]


def test_each_process_life_gets_its_own_slope_after_its_warm_up():
    # the verifier grows fast while warming up, then stays flat; killed at 300 s, its next life is flat too
    first = _samples("verifier", 11, 0, 30, lambda i: 200 + (50 * i if i < 5 else 250))
    second = _samples("verifier", 12, 310, 30, lambda i: 420.0)
    leaking = _samples("drafter", 21, 0, 60, lambda i: 100 + 2 * i)  # 2 MiB per 10 s = 720 MiB/h
    summary = memory_summary(first + second + leaking, warmup_s=60)
    lives = summary["verifier"]["lives"]
    assert [life["pid"] for life in lives] == [11, 12]
    assert lives[0]["slope_mib_per_h"] == pytest.approx(0) and lives[0]["first_mib"] == 450
    assert lives[0]["max_mib"] == 450
    assert summary["drafter"]["lives"][0]["slope_mib_per_h"] == pytest.approx(720)
    result = summarise([], [], first + second + leaking, warmup_s=60, fault_window_s=5, max_slope_mib_per_h=50)
    assert result["flat"] == {"verifier": True, "drafter": False}
    assert result["aims"]["memory_flat"] is False and result["aims"]["held"] is False


def test_stalls_are_split_by_fault_windows():
    quiet = Outcome("stream", "alpha", "completed", 200, start=0, end=10, gaps=[0.1, 0.3])
    faulted = Outcome("stream", "beta", "completed", 200, start=95, end=120, gaps=[0.1, 7.5])
    plain = Outcome("plain", "alpha", "completed", 200, start=95, end=96)
    stalls = stall_summary([quiet, faulted, plain], [(100.0, 130.0)])
    assert stalls["quiet"]["streams"] == 1 and stalls["quiet"]["max_s"] == 0.3
    assert stalls["during a fault"]["max_s"] == 7.5


def test_the_table_counts_every_result_and_refuses_unknown_ones():
    outcomes = [Outcome("plain", "alpha", r) for r in ("completed", "completed", "failed", "lost")]
    outcomes.append(Outcome("cancel", "beta", "cancelled"))
    table = outcome_table(outcomes)
    assert table["plain"] == {"completed": 2, "failed": 1, "cancelled": 0, "unclear": 0, "lost": 1}
    assert list(table)[-1] == "all" and table["all"]["cancelled"] == 1
    with pytest.raises(ValueError):
        outcome_table([Outcome("plain", "alpha", "fine")])


def test_the_aims_and_the_report():
    outcomes = [Outcome("plain", "alpha", "completed", 200, start=1, end=2),
                Outcome("plain", "beta", "failed", 503, "503 verifier_gone", start=3, end=4)]
    samples = _samples("launcher (HTTP + client)", 7, 0, 20, lambda i: 300.0)
    faults = [{"node": "verifier", "at_s": 2.5, "killed_pid": 5, "new_pid": 6, "back_after_s": 9.0,
               "served_again_after_s": None}]
    summary = summarise(outcomes, faults, samples, warmup_s=0, fault_window_s=5, max_slope_mib_per_h=50)
    assert summary["aims"] == {"lost": 0, "unclear": 0, "memory_flat": True, "held": True}
    assert summary["reasons"] == [("failed: 503 verifier_gone", 1)]
    text = "\n".join(report_lines({"summary": summary, "faults": faults}))
    assert "| all | 1 | 1 | 0 | 0 | 0 |" in text and "| 2.5 | verifier | 5 | 6 | 9.0 | — | — |" in text
    lost = summarise([*outcomes, Outcome("stream", "alpha", "lost")], [], samples, warmup_s=0, fault_window_s=5,
                     max_slope_mib_per_h=50)
    assert lost["aims"]["lost"] == 1 and lost["aims"]["held"] is False


def test_only_lives_long_enough_and_real_processes_are_judged():
    short_leak = _samples("drafter", 31, 0, 10, lambda i: 100 + 5 * i)  # 90 s of samples: too short to judge
    summed = _samples("other ray processes (sum)", 0, 0, 60, lambda i: 100 + 9 * i)  # idle workers come and go
    long_flat = _samples("verifier", 32, 0, 60, lambda i: 300.0)
    result = summarise([], [], short_leak + summed + long_flat, warmup_s=0, fault_window_s=5,
                       max_slope_mib_per_h=50, min_steady_s=300)
    assert result["flat"] == {"drafter": None, "other ray processes (sum)": None, "verifier": True}
    assert result["aims"]["memory_flat"] is True
    assert "| drafter | 1 |" in "\n".join(report_lines({"summary": result, "faults": []}))
    assert "not judged" in "\n".join(report_lines({"summary": result, "faults": []}))


def test_the_result_file_keeps_every_request_that_did_not_complete():
    from benchmarks.soak import compact

    rows = [Outcome("stream", "alpha", "completed", 200, "stop", 1, 2, [0.1, 0.4]).as_dict(),
            Outcome("plain", "beta", "failed", 503, "503 verifier_gone", 3, 4).as_dict(),
            Outcome("cancel", "beta", "cancelled", 200, "after 3 events", 5, 6).as_dict(),
            Outcome("plain", "alpha", "lost", None, "no answer", 7, 157).as_dict()]
    samples = _samples("verifier", 5, 0, 3, lambda i: 10.0 + i)
    small = compact({"outcomes": rows, "memory_samples": samples, "summary": {}})
    assert [o["result"] for o in small["requests_not_completed"]] == ["failed", "lost"]
    assert small["stream_stalls"] == [[1, 2, 0.4]]
    assert small["memory_samples"] == {"verifier": [[0, 5, 10.0], [10, 5, 11.0], [20, 5, 12.0]]}
    assert compact(small) == small


def test_after_a_fault_the_outage_is_read_from_the_requests():
    from benchmarks.soak import after_fault

    rows = [Outcome("plain", "alpha", "completed", 200, start=95, end=101).as_dict(),  # begun before the fault
            Outcome("plain", "alpha", "failed", 503, start=100.5, end=100.6).as_dict(),
            Outcome("plain", "beta", "failed", 503, start=112, end=112.1).as_dict(),
            Outcome("plain", "beta", "completed", 200, start=113, end=115).as_dict(),
            Outcome("plain", "beta", "failed", 503, start=190, end=190.1).as_dict()]  # a later, other failure
    assert after_fault(rows, {"at_s": 100.0}) == {"served_again_after_s": 15.0, "last_failure_begun_s": 12.0}
    assert after_fault(rows[:3], {"at_s": 100.0}) == {"served_again_after_s": None, "last_failure_begun_s": 12.0}
