"""scripts/bench_http.py on tiny models, briefly: it starts a launcher with --http, measures both paths, finds the
same text on each and writes its report."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest
from node_entry import python_command

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_bench_http_tiny_smoke(tmp_path):
    out = subprocess.run(python_command(str(REPO_ROOT / "scripts" / "bench_http.py"), "--tiny", "--reps", "2",
                          "--max-tokens", "6", "--out", str(tmp_path)), cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "http_overhead.json").read_text())
    r = report["results"]
    assert r["text_mismatches"] == 0
    assert len(r["non_streamed"]["http_ms"]) == len(r["non_streamed"]["client_ms"]) == 2
    # the added latency is the difference of the two medians (in ms), not a placeholder
    ns = r["non_streamed"]
    assert abs(ns["added_ms"] - (statistics.median(ns["http_ms"]) - statistics.median(ns["client_ms"]))) < 0.01
    assert report["meta"]["machine"]["cores"] >= 1 and report["meta"]["threads"]
    md = (tmp_path / "http_overhead.md").read_text()
    assert "added by HTTP" in md and "machine:" in md
