"""scripts/gpu_check.py end to end on the CPU (``--smoke``): a subprocess that builds its tiny models, starts real
clusters and prints one table. Greedy float32 output with a random drafter must match transformers on every prompt,
the overhead part must report the cluster's metrics, and no part may end in an error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from node_entry import python_command

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "gpu_check.py"


def run_script(*args: str, pythonpath: str = str(REPO_ROOT), fresh: bool = False) -> subprocess.CompletedProcess:
    """The script, forked from the session's zygote with the clusters it starts (tests/node_entry.py), or where the
    test changes what it can import (``fresh``) in an interpreter of its own."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), *args] if fresh else python_command(str(SCRIPT), *args)
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)


@pytest.mark.ci  # the benchmark script end to end: CI runs it (make test-ci)
def test_gpu_check_smoke_on_cpu(tmp_path):
    # the budget only bounds a badly overloaded machine: every part must run here
    proc = run_script("--device", "cpu", "--smoke", "--budget", "400", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    table = [line for line in proc.stdout.splitlines() if line.startswith("| a |")]
    identity = [line for line in table if "float32" in line and "drafter" in line]
    assert len(identity) == 1, proc.stdout  # the random drafter
    for line in [*identity, next(line for line in table if "float32: all cases" in line)]:
        n, total = map(int, re.search(r"(\d+)/(\d+) prompts match", line).groups())
        assert n == total and total > 0, line

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (tmp_path / "gpu_check.md").read_text().count("| a |") == len(table)
    (run,) = report["raw"]["identity"]
    assert run["drafter"] == "random" and run["acceptance"] < 0.9  # a drafter really rejected, and rolled back
    assert run["got"] == run["expected"] and all(len(tokens) == run["tokens"] for tokens in run["got"])
    pipespec = report["raw"]["overhead"]["pipespec"]
    assert pipespec["rounds"] >= 1 and pipespec["tokens_per_second"] > 0
    assert len(pipespec["token_ids"]) == report["raw"]["overhead"]["new_tokens"]
    assert not [row for row in report["rows"] if row["result"] == "ERROR"], report["rows"]
    assert report["meta"]["device"] == "cpu" and report["meta"]["versions"]["torch"]


def test_spent_budget_skips_every_part_with_a_note(tmp_path):
    proc = run_script("--device", "cpu", "--smoke", "--budget", "0", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    pre, *parts = report["rows"]
    assert pre["part"] == "pre" and pre["result"] == "ok"  # the cached-forward check always runs: it is cheap
    assert {row["part"] for row in parts} == {"a", "b", "c"}
    assert all(row["result"] == "skipped" and "time budget" in row["detail"] for row in parts)
    assert any("skipped after the 0 s budget" in note for note in report["notes"])
    assert "skipped after the 0 s budget" in proc.stdout


def test_missing_package_is_named_with_the_wheel_advice(tmp_path):
    shadow = tmp_path / "zmq"  # a zmq that cannot be imported, ahead of the real one
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('no zmq on this machine')\n")
    proc = run_script("--device", "cpu", "--smoke", pythonpath=os.pathsep.join([str(tmp_path), str(REPO_ROOT)]),
                      fresh=True)
    assert proc.returncode == 2
    assert "missing Python packages: zmq (pip package pyzmq" in proc.stderr
    assert "--install-wheels" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""
