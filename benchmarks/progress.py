"""Progress lines of a benchmark run on stderr, each with the seconds since the run began (a worker process takes
its parent's start, so the lines of all processes share one clock)."""

from __future__ import annotations

import datetime as dt
import sys
import time

_START = time.time()


def start_time() -> float:
    """When this run began (``time.time()``), for a worker's spec."""
    return _START


def set_start(start: float) -> None:
    """Count from ``start``: a worker process logs on its parent's clock."""
    global _START
    _START = start


def log(message: str) -> None:
    """One progress line on stderr with the elapsed time of the whole run."""
    print(f"[bench {time.time() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
