"""benchmarks/results.py: a result file is one compact JSON line recording the git revision, a dirty flag and the
machine; an older pretty-printed file reads back with its revision unknown, and rewriting it keeps it unknown."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks.results import REPO_ROOT, git_state, read_result, write_result

pytestmark = pytest.mark.unit


def test_a_result_file_is_one_compact_line_with_revision_dirty_flag_and_machine(tmp_path):
    path = tmp_path / "r.json"
    write_result(path, {"meta": {"start": "2026-01-01T00:00:00+00:00"}, "rows": [{"a": 1}, {"b": [1, 2]}]})
    text = path.read_text()
    assert text.count("\n") == 1 and text.endswith("\n") and ", " not in text and ": " not in text
    report = json.loads(text)
    assert report["rows"] == [{"a": 1}, {"b": [1, 2]}]
    meta = report["meta"]
    assert meta["start"] == "2026-01-01T00:00:00+00:00"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert meta["git"]["revision"] == head.stdout.strip()
        assert isinstance(meta["git"]["dirty"], bool)
    machine = meta["machine"]
    assert set(machine["flags"]) >= {"avx512_bf16", "amx"}
    assert machine["cores"] >= 1 and machine["cpu"]
    assert {"torch", "transformers"} <= set(machine["versions"])
    assert set(machine["topology"]) == {"threads_per_core", "cores_per_socket", "sockets"}


def test_an_older_file_reads_with_its_revision_unknown_and_keeps_it(tmp_path):
    path = tmp_path / "old.json"
    old = {"meta": {"machine": {"cpu": "AMD EPYC", "cores": 2}}, "raw": {"x": [1]}}
    path.write_text(json.dumps(old, indent=1))
    report = read_result(path)
    assert report["meta"]["git"] == {"revision": None, "dirty": None}
    write_result(path, report)
    again = read_result(path)
    assert again["meta"]["git"] == {"revision": None, "dirty": None}  # never today's revision for an old run
    assert again["meta"]["machine"] == {"cpu": "AMD EPYC", "cores": 2} and again["raw"] == {"x": [1]}
    assert git_state() is git_state()  # the state a run started from, read once
