"""What a drafter node remembers of a (drafter, target) pair between runs: its acceptance estimate.

A new node's cost schedule starts from a prior (``drafter_node.cost_model.PRIOR_ALPHA``) that knows nothing of the
pair. With ``drafter.remember_acceptance`` (the default) the node writes its across-session acceptance (per-position
α and the guess rates) to a small JSON file in the profile cache when sessions end, and a later node of the same pair
starts from it, so its first request plans with the pair's real acceptance instead of a guess. The file holds only
rates (no text, no token ids); a missing, unreadable or malformed file means the plain prior.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

from drafter_node.cost_model import Acceptance
from shared.costs.cache import profile_cache_dir

log = logging.getLogger("pipespec.drafter")

#: A remembered file larger than this is not read (it holds a few dozen numbers).
MAX_BYTES = 16 * 1024
#: Writes are at most this often (sessions may end many times a second under load).
SAVE_EVERY_S = 5.0
#: Observations each remembered rate counts as: enough to start from, few enough for a session's text to take over.
REMEMBERED_WEIGHT = 4.0


def memory_path(drafter_type: str, drafter_model: str | None, target: str, dtypes: str = "") -> Path:
    """The file for one pair: a hash of the drafter type, its model, the target's name and the nodes' dtypes
    (``dtypes``: e.g. "bfloat16/float32"; a pair's acceptance in bf16 is not its acceptance in float32)."""
    key = [drafter_type, drafter_model or "", target] + ([dtypes] if dtypes else [])
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return profile_cache_dir() / "acceptance" / f"{digest}.json"


def _rate(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= 1


def load(path: Path, max_k: int) -> tuple[Acceptance, int] | None:
    """The remembered acceptance as a prior (and how many requests it came from), or None."""
    try:
        if path.stat().st_size > MAX_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    alpha = data.get("alpha")
    if not isinstance(alpha, list) or not alpha or len(alpha) > 1024 or not all(_rate(a) for a in alpha):
        return None
    if not all(_rate(data.get(k, 0.5)) for k in ("bonus_guess", "correction_guess")):
        return None
    requests = data.get("requests", 0)
    requests = requests if isinstance(requests, int) and not isinstance(requests, bool) and requests >= 0 else 0
    return Acceptance.from_memory(max_k, data, REMEMBERED_WEIGHT), requests


class PairMemory:
    """The node's handle on one pair's file: load once at the welcome, save (rate-limited) as sessions end."""

    def __init__(self, path: Path, requests: int = 0):
        self.path = path
        self.requests = requests
        self._last_save = 0.0

    def session_ended(self, acc: Acceptance) -> None:
        self.requests += 1
        now = time.monotonic()
        if now - self._last_save >= SAVE_EVERY_S:
            self._last_save = now
            self.save(acc)

    def save(self, acc: Acceptance) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({**acc.to_dict(), "requests": self.requests}), encoding="utf-8")
            os.replace(tmp, self.path)  # atomic: a node starting meanwhile reads the old file or the new one
        except OSError as exc:
            log.debug("could not remember the pair's acceptance in %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
