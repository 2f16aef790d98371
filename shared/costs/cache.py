"""The profiles' disk cache: where it is, the key of a profile (everything that changes the numbers: checkpoint,
device, dtype, thread counts, library versions, CPU model), reading and writing entries atomically, and
:class:`CurveCheck`, which flags an entry for re-measuring when a serving node's forwards disagree with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from shared.costs.curve import NodeProfile
from shared.costs.hardware import cpu_model_name, gpu_name, is_cpu

#: Bumped whenever what a profile means or how it is measured changes (old cache files then miss).
PROFILE_FORMAT = 1


def profile_cache_dir() -> Path:
    """Where profiles are cached: ``$PIPESPEC_PROFILE_DIR`` if set, else ``$PIPESPEC_CACHE/profiles`` (default
    ``~/.cache/pipespec/profiles``)."""
    from shared.named_models import cache_root

    override = os.environ.get("PIPESPEC_PROFILE_DIR")
    return Path(override).expanduser() if override else cache_root() / "profiles"


def thread_keys(device: str, threads: list[int]) -> list[int]:
    """The curve keys a profile holds: the thread counts on a CPU, a single 0 on a GPU (threads do not matter)."""
    if not is_cpu(device):
        return [0]
    keys = sorted({int(t) for t in threads})
    if not keys or keys[0] < 1:
        raise ValueError(f"thread counts must be ≥ 1, got {threads!r}")
    return keys


def _checkpoint_fingerprint(model_path: str) -> dict:
    """What identifies a checkpoint's contents cheaply: its config, its weight index, its weight files' sizes and
    mtimes. A hub id (no local folder) is identified by its name alone."""
    path = Path(model_path).expanduser()
    if not path.is_dir():
        return {"id": model_path}
    path = path.resolve()
    info: dict[str, Any] = {"path": str(path)}
    for name in ("config.json", "model.safetensors.index.json"):
        with contextlib.suppress(OSError):
            info[name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    files = []
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        with contextlib.suppress(OSError):
            st = weights.stat()
            files.append([weights.name, st.st_size, st.st_mtime_ns])
    info["weights"] = files
    return info


def profile_key(model_path: str, device: str, dtype: str, threads: list[int], sizes: list[int], *,
                variant: str = "") -> str:
    """The cache key of a profile: a SHA-256 over everything that changes the numbers.

    ``variant`` tells apart models built differently from one checkpoint (e.g. ``early_exit:8``: the target cut to
    8 layers)."""
    import transformers

    parts = {
        "format": PROFILE_FORMAT,
        "checkpoint": _checkpoint_fingerprint(model_path),
        "variant": variant,
        "device": device,
        "dtype": dtype,
        "threads": thread_keys(device, threads),
        "sizes": sorted({int(n) for n in sizes}),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_model_name(),
        "gpu": gpu_name(device),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _cached_file(key: str) -> NodeProfile | None:
    """The profile in the cache file of ``key`` as written, or None when there is none or it cannot be read."""
    path = profile_cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        return NodeProfile.from_dict(data.get("profile"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def read_cached(key: str) -> NodeProfile | None:
    """The cached profile under ``key``, or None when there is none, it cannot be read, or it was measured on a busy
    machine or found wrong by a node's rounds (``quiet`` false, see :func:`mark_stale`): then it is re-measured."""
    profile = _cached_file(key)
    if profile is None or not profile.quiet:
        return None
    profile.cached = True
    profile.key = key
    return profile


def mark_stale(key: str) -> bool:
    """Flag the cached profile under ``key`` for re-measuring at its node's next start (its numbers disagree with
    the forwards the node times while it serves). True if a cached file was flagged."""
    profile = _cached_file(key)
    if profile is None:
        return False
    profile.quiet = False
    return write_cached(key, profile)


def write_cached(key: str, profile: NodeProfile) -> bool:
    folder = profile_cache_dir()
    tmp = folder / f".{key}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        data = profile.to_dict()
        data["cached"] = False
        tmp.write_text(json.dumps({"key": key, "profile": data}, indent=1), encoding="utf-8")
        os.replace(tmp, folder / f"{key}.json")  # atomic: a reader never sees half a file
        return True
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False


class CurveCheck:
    """Whether a node's own forwards, timed while it serves, still match its profile: the median ratio of measured
    to predicted time over the last WINDOW forwards (taken while the other node idles, so both are timed alone).
    Off by more than MARGIN either way, the profile is wrong for this machine now (measured while it was busy, or
    the machine changed): :func:`mark_stale` re-measures it at the next start."""

    WINDOW = 32
    MIN_SAMPLES = 16
    MARGIN = 1.3

    def __init__(self, profile: NodeProfile | None = None) -> None:
        self.profile = profile  # the node's own (cached) profile; None: nothing to check
        self.ratios: list[float] = []
        self.flagged = False

    def forward(self, threads: int, n: int, context: int, seconds: float) -> float | None:
        """One forward of the node's, timed alone (``n`` new tokens or rows on ``context`` cached tokens at
        ``threads`` threads): when the profile turns out off, flag its cache file (:func:`mark_stale`) and return
        the median ratio, once; else None."""
        if self.profile is None or not self.profile.key:
            return None
        ratio = self.observe(self.profile.curve(threads).cost(n, context), seconds)
        if ratio is not None:
            mark_stale(self.profile.key)
        return ratio

    def observe(self, predicted_s: float, measured_s: float) -> float | None:
        """Add one forward; return the median ratio once it is off by more than MARGIN (once), else None."""
        if self.flagged or predicted_s <= 0 or measured_s <= 0:
            return None
        self.ratios.append(measured_s / predicted_s)
        del self.ratios[: -self.WINDOW]
        if len(self.ratios) < self.MIN_SAMPLES:
            return None
        median = sorted(self.ratios)[len(self.ratios) // 2]
        if median > self.MARGIN or median < 1 / self.MARGIN:
            self.flagged = True
            return median
        return None
