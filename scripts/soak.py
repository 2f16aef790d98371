#!/usr/bin/env python
"""``python scripts/soak.py --help``: the entry point of :mod:`benchmarks.soak` (a soak with faults on a Ray
cluster on this machine), whose docstring says what it measures."""

import sys
from pathlib import Path

# The repo root first on the path, as ``python -m`` from the root would put it (see scripts/bench_http.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.soak import main

if __name__ == "__main__":
    sys.exit(main())
