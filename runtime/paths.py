"""Where pipespec's own folders are, in a checkout and in an installed copy (which has no repository root)."""

from __future__ import annotations

from pathlib import Path

#: The folder that holds the ``runtime`` package: a checkout's root, or site-packages (or a ``--target`` folder).
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def in_checkout() -> bool:
    """Running from a source checkout (editable installs included), not from an installed copy."""
    return (PACKAGE_ROOT / "pyproject.toml").is_file()


def results_dir() -> Path:
    """Default output folder of the profiler and the benchmarks: a checkout's ``results/``, else ``./results``."""
    return PACKAGE_ROOT / "results" if in_checkout() else Path.cwd() / "results"
