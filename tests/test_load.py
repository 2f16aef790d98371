"""The load test (benchmarks/load.py) in short: a launcher on tiny models serves plain, streamed, structured,
never-reading and hostile HTTP clients at once; nothing may be lost (every request served or refused with its
documented error), and each hostile case gets the answer its case allows. The stall and memory figures it also
reports are for the benchmark run (scripts/load_test.py), not asserted here: timings are noise on a shared CI core."""

from __future__ import annotations

import json

import pytest

from benchmarks.load import main

pytestmark = pytest.mark.cluster


def test_mixed_load_loses_nothing(tmp_path):
    rc = main(["--tiny", "--duration", "8", "--quiet-s", "2", "--streams", "2", "--plain", "1",
               "--structured", "1", "--never-reading", "2", "--hold-s", "4", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "load.json").read_text())
    results = report["results"]
    assert results["lost"] == [], results["lost"][:5]
    assert rc == 0
    outcomes = results["outcomes"]
    # every kind of client ran, and the plain ones were served
    assert outcomes["stream"].get("served", 0) > 0 and outcomes["plain"].get("served", 0) > 0
    assert outcomes["structured"].get("served", 0) > 0
    assert any(kind.startswith("hostile: ") for kind in outcomes)
    assert results["stalls"]["mixed_gaps"] > 0
    assert (tmp_path / "load.md").read_text().startswith("# Load test")
