"""How the installer (and the launcher) report progress: a callable taking one line (the default prints it to
stderr, timed), and :func:`progress_bar`, a tqdm bar on a terminal that falls back to a few plain lines (every
quarter) when stderr is not one — a log file gets lines, not thousands of carriage returns.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

ProgressFn = Callable[[str], None]

_T0: float | None = None

#: A plain-line bar reports when it passes each of these fractions of its total (and once at the end).
PLAIN_STEPS = (0.25, 0.5, 0.75)


def default_progress(message: str) -> None:
    """Print ``message`` to stderr as ``[pipespec +12.3s] message`` (seconds since the first message)."""
    global _T0
    now = time.monotonic()
    if _T0 is None:
        _T0 = now
    print(f"[pipespec +{now - _T0:.1f}s] {message}", file=sys.stderr, flush=True)


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stderr) is a terminal, where a redrawn bar reads well."""
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed, or not a real file
        return False


def _count(n: float) -> str:
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


class PlainBar:
    """The non-terminal stand-in for a tqdm bar: one line per quarter of ``total`` passed, through ``progress``."""

    def __init__(self, total: float, desc: str, progress: ProgressFn, fmt: Callable[[float], str] = _count):
        self.total, self.desc, self.progress, self.fmt = total, desc, progress, fmt
        self.n = 0.0
        self._steps = list(PLAIN_STEPS)
        self._closed = False

    def update(self, n: float = 1) -> None:
        self.n += n
        passed = False
        while self._steps and self.total and self.n / self.total >= self._steps[0] - 1e-9:
            self._steps.pop(0)
            passed = True
        if passed and self.n < self.total:
            self.progress(f"{self.desc}: {self.n / self.total:.0%} ({self.fmt(self.n)} of {self.fmt(self.total)})")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.total and self.n >= self.total:
                self.progress(f"{self.desc}: 100% ({self.fmt(self.total)})")


@contextlib.contextmanager
def progress_bar(total: float, desc: str, *, progress: ProgressFn = default_progress, unit: str = "it",
                 fmt: Callable[[float], str] = _count, stream: TextIO | None = None,
                 terminal: bool | None = None) -> Iterator[Any]:
    """A bar with ``update(n)``: tqdm on a terminal (``stream``, default stderr), else a :class:`PlainBar` whose
    lines go to ``progress``. ``terminal`` overrides the check (tests)."""
    stream = stream if stream is not None else sys.stderr
    if terminal if terminal is not None else is_terminal(stream):
        from tqdm import tqdm

        scale = unit == "B"
        with tqdm(total=total, desc=f"[pipespec] {desc}", unit=unit, unit_scale=scale, unit_divisor=1024 if scale
                  else 1000, file=stream, dynamic_ncols=True, leave=True) as bar:
            yield bar
        return
    bar = PlainBar(total, desc, progress, fmt)
    try:
        yield bar
    finally:
        bar.close()


def quiet_library_bars(stream: TextIO | None = None) -> None:
    """Turn off transformers' and huggingface_hub's own tqdm bars (loading, converting, writing shards) when
    ``stream`` (default stderr) is not a terminal: in a log file each redraw would be one more carriage return."""
    if is_terminal(stream):
        return
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
