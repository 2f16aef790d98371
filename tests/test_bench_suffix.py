"""benchmarks/suffix.py: the workload file, the per-row and per-request summary and the cross-request notes
(unit), and one end-to-end smoke run on tiny random models (cluster)."""

from __future__ import annotations

import json

import pytest

import benchmarks.suffix as bs


def _metrics(drafts: int, drafted: int, accepted: int) -> dict[str, int]:
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted}


@pytest.mark.unit
def test_workload_has_both_families_and_takes_the_first_of_each():
    items = bs.load_workload(None)
    assert len(items) == 16 and {p["family"] for p in items} == {"tool_call", "code_edit"}
    assert len({p["id"] for p in items}) == 16
    four = bs.load_workload(4)
    assert [p["family"] for p in four] == ["tool_call", "tool_call", "code_edit", "code_edit"]
    assert [p["id"] for p in four][:2] == [p["id"] for p in items][:2]


@pytest.mark.unit
def test_summary_per_request_and_cross_request(tmp_path):
    def run(metrics, tokens):
        return [{"token_ids": t, "new_tokens": len(t), "time_s": 1.0, "metrics": m, "at": 0.0}
                for m, t in zip(metrics, tokens)]

    ref = [{"token_ids": [1, 2], "new_tokens": 2, "time_s": 2.0, "at": 0.0},
           {"token_ids": [3, 4], "new_tokens": 2, "time_s": 2.0, "at": 0.0},
           {"token_ids": [5, 6], "new_tokens": 2, "time_s": 2.0, "at": 0.0}]
    suffix = run([_metrics(2, 8, 2), _metrics(2, 8, 6), _metrics(0, 0, 0)], [[1, 2], [3, 4], [5, 7]])
    report = {"raw": {"target": {"pass": 1, "per_prompt": ref}, "suffix": {"pass": 1, "per_prompt": suffix}},
              "anchor_runs": {}}
    row = bs.summarize("suffix", report)
    assert row["alpha"] == pytest.approx(8 / 16) and row["tau"] == pytest.approx(1 + 8 / 4)
    assert row["mismatches"] == 1 and row["compared"] == 3 and row["vs_target"] == pytest.approx(2.0)
    assert [r["alpha"] for r in row["per_request"]] == [0.25, 0.75, 0.0]  # no draft: α 0, τ 1
    c = bs.cross_request(row, ["a", "a", "a"])
    assert c["a"] == {"first": 0.25, "later_mean": 0.375, "last": 0.0, "requests": 3}
    report["rows"] = [bs.summarize(k, report) for k in ("target", "suffix")]
    report["meta"] = {"start": "2026-01-01T00:00:00", "end": None, "max_new_tokens": 2,
                      "requests": [{"id": f"r{i}", "family": "a"} for i in range(3)],
                      "machine": {"cpu": "x", "cores": 2, "logical_cpus": 2, "flags": {}, "memory_gib": 1.0,
                                  "gpu": None, "python": "3", "versions": {}}}
    bs.write_markdown(tmp_path / "suffix.md", report)
    text = (tmp_path / "suffix.md").read_text()
    assert "| 2 | r1 | a | 0.75 / 4.00 |" in text
    assert "α on its request 1 0.25, on requests 2–3 (mean) 0.38, on the last 0.00" in text


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_smoke_run_on_tiny_models(tmp_path):
    code = bs.main(["--tiny", "--requests", "2", "--rows", "suffix", "--max-new-tokens", "8", "--out",
                    str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "suffix.json").read_text())
    rows = {r["key"]: r for r in report["rows"]}
    assert set(rows) == {"target", "suffix", "suffix-nocache"}  # "suffix" selects both; the reference always runs
    assert rows["suffix"]["mismatches"] == 0 and len(rows["suffix"]["per_request"]) == 2
    assert "Per request" in (tmp_path / "suffix.md").read_text()
