"""Result files: one compact JSON object per run, recording what produced it — the git revision, whether the tree had
uncommitted changes, and the machine (:func:`benchmarks.machine.machine_info`) — beside the results.

Older files (pretty-printed, without ``meta.git``) read the same: :func:`read_result` is plain ``json.loads``.
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_info

REPO_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def git_state() -> dict[str, Any]:
    """``{"revision": sha or None, "dirty": bool or None}`` of the checkout, once per process (the state the run
    started from; None where this is not a git checkout or git is missing)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    revision = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"revision": revision.strip() if revision else None, "dirty": bool(status.strip()) if status is not None
            else None}


def write_result(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` as one compact JSON line. Its ``meta`` gets the git state and the machine where it
    has none yet: a run that rewrites its file after every prompt keeps the state it started from, and a report
    rebuilt from an older file keeps what :func:`read_result` found."""
    meta = report.setdefault("meta", {})
    meta.setdefault("machine", machine_info())
    meta.setdefault("git", git_state())
    path.write_text(json.dumps(report, separators=(",", ":"), ensure_ascii=False) + "\n")


def read_result(path: Path) -> dict[str, Any]:
    """A result file, written by :func:`write_result` or by an older version of the scripts (pretty-printed, no
    ``meta.git``: its revision is recorded as unknown, never as the checkout's of today)."""
    report = json.loads(path.read_text())
    if isinstance(report, dict):
        report.setdefault("meta", {}).setdefault("git", {"revision": None, "dirty": None})
    return report
