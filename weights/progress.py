"""How the installer reports progress: a callable taking one line (the default prints it to stderr, timed)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

ProgressFn = Callable[[str], None]

_T0: float | None = None


def default_progress(message: str) -> None:
    """Print ``message`` to stderr as ``[pipespec +12.3s] message`` (seconds since the first message)."""
    global _T0
    now = time.monotonic()
    if _T0 is None:
        _T0 = now
    print(f"[pipespec +{now - _T0:.1f}s] {message}", file=sys.stderr, flush=True)
