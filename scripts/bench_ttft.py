#!/usr/bin/env python
"""``python scripts/bench_ttft.py --help``: the entry point of :mod:`benchmarks.ttft`, whose docstring says what it
measures."""

import sys
from pathlib import Path

# The repo root first on the path, as ``python -m`` from the root would put it: a checkout need not be installed,
# and one whose venv is installed from another checkout (a worktree) still runs its own code.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ttft import main

if __name__ == "__main__":
    sys.exit(main())
