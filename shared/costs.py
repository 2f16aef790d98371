"""Per-node cost profiles: how long one forward of a node's model takes for n new tokens, measured on the spot.

A :class:`CostCurve` holds a few measured points (n new tokens in one batch-1 forward on a cached prefix → seconds)
and answers ``cost(n, context)`` for any n by interpolation; ``observe`` refines it online from real rounds. A
:class:`NodeProfile` is what one node measured of itself (one curve per CPU thread count, or one for a GPU) and can
be sent to a peer (``to_dict`` / ``from_dict``, the latter validates: it comes from the network).

:func:`load_or_measure` measures within a time budget and caches the result on disk, keyed by everything that
changes the numbers (checkpoint, device, dtype, thread counts, library versions, CPU model), so a node pays for the
measurement once per machine. :func:`resolve_auto_dtype` implements ``dtype: auto``: on a GPU the half type the
device supports, on a CPU whichever of float32 / bfloat16 is faster here (bfloat16 only wins on CPUs with native
bf16 support, and the memory it saves does not always make up for the conversion elsewhere).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import gc
import hashlib
import itertools
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "AUTO_CPU_DTYPES",
    "CostCurve",
    "NodeProfile",
    "cpu_model_name",
    "hardware_flags",
    "load_or_measure",
    "measure_curve",
    "profile_cache_dir",
    "profile_key",
    "profile_score",
    "resolve_auto_dtype",
    "sizes_up_to",
]

ProgressFn = Callable[[str], None]

#: Bumped whenever what a profile means or how it is measured changes (old cache files then miss).
PROFILE_FORMAT = 1
PROFILE_DTYPES = ("float32", "bfloat16", "float16")
#: The candidates ``dtype: auto`` compares on a CPU.
AUTO_CPU_DTYPES = ("float32", "bfloat16")

MAX_WIRE_POINTS = 64  # from_dict: the most points a peer's curve may have
MAX_OBSERVED_POINTS = 32  # observe: the most points a curve grows to
MAX_SIZE = 4096
MAX_SECONDS = 3600.0
MAX_PREFIX = 1 << 20
MAX_CURVES = 8
MAX_THREADS_KEY = 1024
MAX_NAME = 512
#: The context term may lower a cost to this fraction of the base at most (a noisy slope must not zero it).
CONTEXT_FLOOR = 0.5
#: CostCurve.observe: a sample slower than this multiple of the current estimate counts as this multiple.
OUTLIER_FACTOR = 2.0
#: Size ladder for :func:`sizes_up_to`: dense where verification costs change most, sparse beyond.
SIZE_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


# ------------------------------------------------------------------------------------------ validation helpers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(what: str, value: Any, low: int, high: int) -> int:
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{what}: must be an integer in [{low}, {high}], got {_short(value)}")
    return int(value)


def _check_seconds(what: str, value: Any, allow_zero: bool = False) -> float:
    ok = _is_number(value) and (value >= 0 if allow_zero else value > 0) and value <= MAX_SECONDS
    if not ok:
        bound = "[0" if allow_zero else "(0"
        raise ValueError(f"{what}: must be a finite number of seconds in {bound}, {MAX_SECONDS:g}], "
                         f"got {_short(value)}")
    return float(value)


def _check_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise ValueError(f"{what}: must be a non-empty string of at most {MAX_NAME} characters, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------------ cost curve


@dataclass
class CostCurve:
    """Forward time of one model, in seconds, over n new tokens in ONE batch-1 forward on a cached prefix."""

    sizes: list[int]  # measured n, ascending, >= 1
    seconds: list[float]  # time per forward for each size (min of repeats)
    prefix_len: int  # cached prefix the points were measured on
    per_context_token_s: float = 0.0  # extra seconds per forward per cached prefix token (coarse slope, >= 0)

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError(f"CostCurve: sizes and seconds must be non-empty and of one length "
                             f"({len(self.sizes)} vs {len(self.seconds)})")
        if any(b <= a for a, b in itertools.pairwise(self.sizes)):
            raise ValueError(f"CostCurve: sizes must be strictly ascending, got {self.sizes}")

    def base_cost(self, n: int) -> float:
        """Seconds for ``n`` new tokens at the measured prefix length (no context term)."""
        if n <= 0:
            return 0.0
        sizes, seconds = self.sizes, self.seconds
        if n <= sizes[0]:
            return seconds[0]
        if n >= sizes[-1]:
            if len(sizes) == 1:
                return seconds[-1]
            slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
            return seconds[-1] + max(0.0, slope) * (n - sizes[-1])  # never cheaper beyond the last point
        i = bisect.bisect_left(sizes, n)
        if sizes[i] == n:
            return seconds[i]
        x0, x1, y0, y1 = sizes[i - 1], sizes[i], seconds[i - 1], seconds[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def _context_delta(self, context: int | None) -> float:
        return 0.0 if context is None else self.per_context_token_s * (context - self.prefix_len)

    def cost(self, n: int, context: int | None = None) -> float:
        """Seconds for one forward of ``n`` new tokens on a cached prefix of ``context`` tokens (default: the
        measured prefix length)."""
        base = self.base_cost(n)
        if base == 0.0:
            return 0.0
        return max(base + self._context_delta(context), CONTEXT_FLOOR * base)

    def observe(self, n: int, seconds: float, context: int | None = None, weight: float = 0.2) -> None:
        """Move the curve toward one measured forward (``n`` new tokens took ``seconds`` on ``context`` cached
        tokens) by an exponential moving average of ``weight``; an unmeasured ``n`` becomes a new point."""
        if not _is_int(n) or not 1 <= n <= MAX_SIZE or not _is_number(seconds) or seconds <= 0:
            return
        if not _is_number(weight):
            return
        weight = min(1.0, max(0.0, float(weight)))
        delta = self._context_delta(context)
        # Invert cost() = max(base + delta, F·base): below the cost where the floor takes over, base = seconds / F.
        floor_cost = CONTEXT_FLOOR * -delta / (1 - CONTEXT_FLOOR) if delta < 0 else 0.0
        base = seconds - delta if seconds >= floor_cost else seconds / CONTEXT_FLOOR
        if base <= 0:  # the context term alone exceeds the sample (the slope is off): take it as measured
            base = seconds
        base = min(MAX_SECONDS, base)
        i = bisect.bisect_left(self.sizes, n)
        # A slow sample counts as at most OUTLIER_FACTOR × the estimate: one forward that shared the cores with a
        # prefill, a page fault or another job must not turn a plan around; a lasting slowdown still moves the
        # curve (by up to weight × (factor − 1) per sample). Fast samples are taken as they are (a forward cannot
        # be faster than the hardware allows). A full-weight sample replaces the estimate as it is.
        if i < len(self.sizes) and self.sizes[i] == n:
            if weight < 1.0:
                base = min(base, OUTLIER_FACTOR * self.seconds[i])
            self.seconds[i] += weight * (base - self.seconds[i])
            return
        start = self.base_cost(n)
        if weight < 1.0:
            base = min(base, OUTLIER_FACTOR * start)
        while len(self.sizes) >= MAX_OBSERVED_POINTS:
            self._drop_flattest_point()
        i = bisect.bisect_left(self.sizes, n)
        self.sizes.insert(i, n)
        self.seconds.insert(i, start + weight * (base - start))

    def _drop_flattest_point(self) -> None:
        """Remove the interior point its neighbours predict best (the curve changes least without it)."""
        if len(self.sizes) < 3:
            del self.sizes[-1], self.seconds[-1]
            return
        best, best_err = 1, math.inf
        for j in range(1, len(self.sizes) - 1):
            x0, x, x1 = self.sizes[j - 1], self.sizes[j], self.sizes[j + 1]
            y0, y, y1 = self.seconds[j - 1], self.seconds[j], self.seconds[j + 1]
            err = abs(y0 + (y1 - y0) * (x - x0) / (x1 - x0) - y)
            if err < best_err:
                best, best_err = j, err
        del self.sizes[best], self.seconds[best]

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds), "prefix_len": self.prefix_len,
                "per_context_token_s": self.per_context_token_s}

    @classmethod
    def from_dict(cls, d: Any) -> CostCurve:
        """Build a curve from ``to_dict`` output, validating every field (unknown keys are ignored)."""
        if not isinstance(d, dict):
            raise ValueError(f"cost curve: must be a mapping, got {type(d).__name__}")
        sizes, seconds = d.get("sizes"), d.get("seconds")
        for name, value in (("sizes", sizes), ("seconds", seconds)):
            if not isinstance(value, list) or not 1 <= len(value) <= MAX_WIRE_POINTS:
                raise ValueError(f"cost curve: {name} must be a list of 1..{MAX_WIRE_POINTS} entries, "
                                 f"got {_short(value) if not isinstance(value, list) else f'{len(value)} entries'}")
        if len(sizes) != len(seconds):
            raise ValueError(f"cost curve: sizes and seconds differ in length ({len(sizes)} vs {len(seconds)})")
        sizes = [_check_int(f"cost curve: sizes[{i}]", s, 1, MAX_SIZE) for i, s in enumerate(sizes)]
        seconds = [_check_seconds(f"cost curve: seconds[{i}]", s) for i, s in enumerate(seconds)]
        if any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"cost curve: sizes must be strictly ascending, got {_short(sizes)}")
        prefix = _check_int("cost curve: prefix_len", d.get("prefix_len"), 0, MAX_PREFIX)
        slope = _check_seconds("cost curve: per_context_token_s", d.get("per_context_token_s", 0.0), allow_zero=True)
        return cls(sizes, seconds, prefix, slope)


# ------------------------------------------------------------------------------------------ node profile


@dataclass
class NodeProfile:
    """What one node measured of itself: per thread count, the cost curve of its model in its chosen dtype."""

    model: str
    device: str
    dtype: str  # "float32" | "bfloat16" | "float16" (the chosen one)
    curves: dict[int, CostCurve]  # thread count -> curve (CPU: e.g. {1: ..., 2: ...}; GPU: {0: ...})
    measured_s: float = 0.0
    cached: bool = False
    candidates: dict[str, float] = field(default_factory=dict)  # dtype -> score of the auto choice (empty: explicit)
    quiet: bool = True  # nothing else used the CPU while it was measured (a busy profile is re-measured next start)
    key: str = ""  # its cache key on this machine (not sent to peers)

    def curve(self, threads: int) -> CostCurve:
        """The curve for ``threads`` (exact key, else the nearest one; a tie goes to the fewer threads)."""
        if threads in self.curves:
            return self.curves[threads]
        if not self.curves:
            raise KeyError("this profile holds no cost curve")
        return self.curves[min(self.curves, key=lambda k: (abs(k - threads), k))]

    def to_dict(self) -> dict:
        return {"model": self.model, "device": self.device, "dtype": self.dtype,
                "curves": {str(t): c.to_dict() for t, c in sorted(self.curves.items())},
                "measured_s": self.measured_s, "cached": self.cached, "candidates": dict(self.candidates),
                "quiet": self.quiet}

    @classmethod
    def from_dict(cls, d: Any) -> NodeProfile:
        """Build a profile from ``to_dict`` output, validating every field (unknown keys are ignored)."""
        if not isinstance(d, dict):
            raise ValueError(f"node profile: must be a mapping, got {type(d).__name__}")
        model = _check_name("node profile: model", d.get("model"))
        device = _check_name("node profile: device", d.get("device"))
        dtype = d.get("dtype")
        if dtype not in PROFILE_DTYPES:
            raise ValueError(f"node profile: dtype must be one of {', '.join(PROFILE_DTYPES)}, got {_short(dtype)}")
        raw_curves = d.get("curves")
        if not isinstance(raw_curves, dict) or not 1 <= len(raw_curves) <= MAX_CURVES:
            raise ValueError(f"node profile: curves must be a mapping of 1..{MAX_CURVES} thread counts to curves")
        curves: dict[int, CostCurve] = {}
        for key, value in raw_curves.items():
            # JSON object keys are strings; msgpack may carry ints.
            threads = int(key) if isinstance(key, str) and key.isdigit() and len(key) <= 5 else key
            threads = _check_int("node profile: curves key", threads, 0, MAX_THREADS_KEY)
            if threads in curves:
                raise ValueError(f"node profile: thread count {threads} appears twice")
            curves[threads] = CostCurve.from_dict(value)
        measured = _check_seconds("node profile: measured_s", d.get("measured_s", 0.0), allow_zero=True)
        cached = d.get("cached", False)
        if not isinstance(cached, bool):
            raise ValueError(f"node profile: cached must be true or false, got {_short(cached)}")
        raw_candidates = d.get("candidates", {})
        if not isinstance(raw_candidates, dict) or len(raw_candidates) > len(PROFILE_DTYPES):
            raise ValueError("node profile: candidates must be a mapping of dtype to score")
        candidates = {}
        for name, score in raw_candidates.items():
            if name not in PROFILE_DTYPES:
                raise ValueError(f"node profile: candidate dtype must be one of {', '.join(PROFILE_DTYPES)}, "
                                 f"got {_short(name)}")
            candidates[name] = _check_seconds(f"node profile: candidates[{name}]", score)
        quiet = d.get("quiet", True)
        if not isinstance(quiet, bool):
            raise ValueError(f"node profile: quiet must be true or false, got {_short(quiet)}")
        return cls(model, device, dtype, curves, measured, cached, candidates, quiet)


def profile_score(profile: NodeProfile, sizes: list[int]) -> float:
    """Geometric mean of the forward cost over every (thread count, size) pair: the number ``dtype: auto`` compares.

    Both candidates are evaluated at the same requested sizes (interpolated where a budget left a size unmeasured),
    so a candidate that measured fewer sizes is not favoured."""
    logs = [math.log(curve.cost(n)) for curve in profile.curves.values() for n in sizes if n >= 1]
    if not logs:
        raise ValueError("profile_score: no sizes to score")
    return math.exp(sum(logs) / len(logs))


#: Acceptance assumed by :func:`verify_score` before any drafter is known.
VERIFY_SCORE_ALPHA = 0.7


def verify_score(profile: NodeProfile, sizes: list[int]) -> float:
    """Seconds per committed token of a verifier at its best (thread count, block size), with a free drafter whose
    drafts are accepted with probability VERIFY_SCORE_ALPHA: min over n of cost(n) / E(n − 1), with
    E(k) = (1 − α^(k+1)) / (1 − α). What ``dtype: auto`` compares for a verifier, whose speed is one of those
    shapes (k = 0 with every core when drafting does not pay), not their mean."""
    a = VERIFY_SCORE_ALPHA
    best = math.inf
    for curve in profile.curves.values():
        for n in sizes:
            if n >= 1:
                best = min(best, curve.cost(n) * (1 - a) / (1 - a**n))
    if best == math.inf:
        raise ValueError("verify_score: no sizes to score")
    return best


# ------------------------------------------------------------------------------------------ hardware


def _cpuinfo_field(name: str) -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            key, sep, value = line.partition(":")
            if sep and key.strip() == name:
                return value.strip()
    return None


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere ``platform.processor()``)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


def hardware_flags() -> dict:
    """What decides whether bfloat16 pays on this CPU, and the GPU's name (None without CUDA)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    gpu = None
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError, AssertionError):
            gpu = torch.cuda.get_device_name(0)
    return {"avx2": "avx2" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": bool(flags & {"amx_bf16", "amx_tile"}), "gpu": gpu}


def _is_cpu(device: str) -> bool:
    return device == "cpu"


def _gpu_name(device: str) -> str | None:
    if device.startswith("cuda") or device == "auto":
        if not torch.cuda.is_available():
            return None
        index = int(device.split(":")[1]) if ":" in device else 0
        with contextlib.suppress(RuntimeError, AssertionError):
            return torch.cuda.get_device_name(index)
    return None


# ------------------------------------------------------------------------------------------ cache


def profile_cache_dir() -> Path:
    """Where profiles are cached: ``$PIPESPEC_PROFILE_DIR`` if set, else ``$PIPESPEC_CACHE/profiles`` (default
    ``~/.cache/pipespec/profiles``)."""
    from shared.named_models import cache_root

    override = os.environ.get("PIPESPEC_PROFILE_DIR")
    return Path(override).expanduser() if override else cache_root() / "profiles"


def _thread_keys(device: str, threads: list[int]) -> list[int]:
    """The curve keys a profile holds: the thread counts on a CPU, a single 0 on a GPU (threads do not matter)."""
    if not _is_cpu(device):
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
        "threads": _thread_keys(device, threads),
        "sizes": sorted({int(n) for n in sizes}),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_model_name(),
        "gpu": _gpu_name(device),
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


def _read_cached(key: str) -> NodeProfile | None:
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
    return _write_cached(key, profile)


def _write_cached(key: str, profile: NodeProfile) -> bool:
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


# ------------------------------------------------------------------------------------------ measuring


def sizes_up_to(max_n: int) -> list[int]:
    """A size ladder 1, 2, 3, 4, 6, 8, 12, … clipped to ``max_n``, with ``max_n`` itself last."""
    if max_n < 1:
        raise ValueError(f"sizes_up_to: max_n must be ≥ 1, got {max_n}")
    return sorted({n for n in SIZE_LADDER if n < max_n} | {max_n})


def _shape_first_order(sizes: list[int]) -> list[int]:
    """The smallest size, the largest, then each time the size nearest the middle of the widest unmeasured gap:
    the curve's shape is known early, so a budget that runs out leaves a curve that interpolates well."""
    if len(sizes) <= 2:
        return list(sizes)
    order = [sizes[0], sizes[-1]]
    left = list(sizes[1:-1])
    while left:
        done = sorted(order)

        def gap_score(n: int, done: list[int] = done) -> tuple[float, float]:
            i = bisect.bisect_left(done, n)
            lo, hi = done[i - 1], done[i]
            return (-(hi - lo), abs(n - (lo + hi) / 2))  # widest gap first, then nearest its middle

        pick = min(left, key=gap_score)
        order.append(pick)
        left.remove(pick)
    return order


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        count = torch.cuda.device_count()

        def sync() -> None:
            for index in range(count):  # accelerate may have spread the model over several GPUs
                torch.cuda.synchronize(index)

        return sync
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


#: Cached prefix the curves are measured on: short, because a prefill in emulated bf16 on a CPU costs as much as
#: that many one-token forwards and would eat the start-up budget; the context term comes from a 4× longer prefix.
PROFILE_PREFIX = 16


def measure_curve(model, sizes: list[int], prefix_len: int = PROFILE_PREFIX, budget_s: float = 8.0,
                  repeats: int = 2) -> CostCurve:
    """Measure ``model``'s forward time for each n in ``sizes`` new tokens on a cached prefix of ``prefix_len``
    random tokens at the current thread count (see :func:`measure_curves`)."""
    return measure_curves(model, sizes, [0], prefix_len, budget_s, repeats)[0]


@torch.inference_mode()
def measure_curves(model, sizes: list[int], threads: list[int], prefix_len: int = PROFILE_PREFIX,
                   budget_s: float = 8.0, repeats: int = 2) -> dict[int, CostCurve]:
    """One curve per thread count in ``threads`` (0: leave the thread count as it is), all on one cached prefix of
    ``prefix_len`` random tokens (one prefill, at the largest thread count): for each n in ``sizes``, one warm-up
    and up to ``repeats`` more forwards of n new tokens per thread count (while the budget allows), the minimum kept.

    Sizes are measured shape-first (smallest, largest, then the middles); a size whose estimated forward time would
    overrun ``budget_s`` is skipped (the curve interpolates over it), but the first size is always measured (so a
    model slower than the budget overruns it by about one prefill and one forward per thread count). If the budget
    allows, one more point on a 4× longer prefix sets ``per_context_token_s``. The thread count is restored."""
    from shared.kv import CachedLM

    wanted = sorted({int(n) for n in sizes if int(n) >= 1})
    if not wanted:
        raise ValueError(f"measure_curve: no size ≥ 1 in {sizes!r}")
    if prefix_len < 0:
        raise ValueError(f"measure_curve: prefix_len must be ≥ 0, got {prefix_len}")
    keys = sorted({int(t) for t in threads}) or [0]
    repeats = max(1, int(repeats))
    start = time.perf_counter()
    previous = torch.get_num_threads()
    lm = CachedLM(model)
    sync = _synchronizer(lm._device)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(1234)

    def use(t: int) -> None:
        if t:
            torch.set_num_threads(t)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def forward(ids: list[int]) -> float:
        sync()
        t0 = time.perf_counter()
        lm.feed(ids)
        sync()
        return time.perf_counter() - t0

    def left() -> float:
        return budget_s - (time.perf_counter() - start)

    def fastest(ids: list[int], keep: int) -> float:
        """The minimum over a warm-up and up to ``repeats`` more forwards, as many as the budget allows. The warm-up
        counts too: a slow one (first use of a shape) never wins the minimum, a normal one is not wasted when a
        large model leaves the budget room for a single forward."""
        best = forward(ids)
        lm.crop(keep)
        for _ in range(repeats):
            if best > left():
                break
            best = min(best, forward(ids))
            lm.crop(keep)
        return max(best, 1e-9)

    try:
        use(keys[-1])
        prefill_s = forward(tokens(prefix_len)) if prefix_len else 0.0
        measured: dict[int, dict[int, float]] = {t: {} for t in keys}

        def estimate(t: int, n: int) -> float:
            points = dict(measured[t])
            if prefix_len and prefill_s > 0 and prefix_len not in points:
                points[prefix_len] = prefill_s  # an upper bound (first-call overheads), fine for a budget guess
            if not points:
                return 0.0
            ks = sorted(points)
            return CostCurve(ks, [points[k] for k in ks], prefix_len).base_cost(n)

        for n in _shape_first_order(wanted):
            for t in keys:
                if measured[t] and estimate(t, n) > left():  # not even one forward fits: interpolate over n
                    continue
                use(t)
                measured[t][n] = fastest(tokens(n), prefix_len)
        fill_from_richest(measured)
        curves = {}
        for t in keys:
            ks = sorted(measured[t])
            curves[t] = CostCurve(ks, nondecreasing([measured[t][k] for k in ks]), prefix_len)
        long_len = 4 * prefix_len
        max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if _is_int(max_pos):
            long_len = min(long_len, max_pos - 1)
        if long_len > prefix_len:
            first = wanted[0]  # compared at the same size on both prefixes
            need = estimate(keys[-1], long_len - prefix_len) + sum(2 * c.base_cost(first) for c in curves.values())
            if need <= left():
                use(keys[-1])
                lm.feed(tokens(long_len - prefix_len))
                for t, curve in curves.items():
                    use(t)
                    best = fastest(tokens(first), long_len)
                    curve.per_context_token_s = max(0.0, (best - curve.base_cost(first)) / (long_len - prefix_len))
        return curves
    finally:
        torch.set_num_threads(previous)


def nondecreasing(seconds: list[float]) -> list[float]:
    """Each point at most every later one (a running minimum from the right). A forward over more tokens does not
    cost less; a point above a later one is a sample the machine slowed (one measurement of 6 tokens at 691 ms
    between 290 ms for 4 and 302 ms for 9 kept the planner off k = 5 for good)."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def fill_from_richest(measured: dict[int, dict[int, float]]) -> None:
    """Give every thread count's points the shape of the most measured one where the budget left them out: a size
    measured at one thread count but not at another gets own(first) · rich(n) / rich(first). A lone point would
    otherwise extrapolate flat (a forward over 9 tokens costing what one does), which no CPU does."""
    if len(measured) < 2:
        return
    rich = max(measured.values(), key=len)
    for points in measured.values():
        if points is rich or not points:
            continue
        first = min(points)
        if first not in rich:
            continue
        for n, seconds in rich.items():
            if n not in points:
                points[n] = points[first] * seconds / rich[first]


def _describe(curve: CostCurve) -> str:
    points = ", ".join(f"{n} tok {s * 1e3:.1f} ms" for n, s in zip(curve.sizes, curve.seconds))
    return f"{points}; context +{curve.per_context_token_s * 1e6:.2f} µs/token"


def load_or_measure(model, model_path: str, device: str, dtype: str, threads: list[int], sizes: list[int],
                    budget_s: float = 20.0, progress: ProgressFn | None = None, *, variant: str = "",
                    fresh: bool = False) -> NodeProfile:
    """The profile of ``model`` (loaded from ``model_path`` on ``device`` in ``dtype``): from the disk cache, or
    measured within ``budget_s`` (split over the thread counts) and cached. ``fresh`` skips the cache lookup (the
    new measurement still replaces the cached one)."""
    if dtype not in PROFILE_DTYPES:
        raise ValueError(f"load_or_measure: dtype must be one of {', '.join(PROFILE_DTYPES)}, got {dtype!r}")
    keys = _thread_keys(device, threads)
    key = profile_key(model_path, device, dtype, threads, sizes, variant=variant)
    name = Path(model_path).name or model_path
    if not fresh:
        cached = _read_cached(key)
        if cached is not None and cached.dtype == dtype and sorted(cached.curves) == keys:
            if progress:
                progress(f"profile of {name} {dtype} on {device}: cached")
            return cached
    started = time.perf_counter()
    where = ", ".join(f"{t} thread{'s' if t != 1 else ''}" if t else device for t in keys)
    if progress:
        progress(f"profiling {name} {dtype} at {where} (budget {budget_s:.1f} s) ...")
    with measuring_alone(device, progress):
        curves, quiet = measure_quietly(model, sizes, keys, budget_s, device, progress)
    if progress:
        for t, curve in curves.items():
            progress(f"profiling {name} {dtype} {t or device}{' threads' if t else ''}: {_describe(curve)}")
    profile = NodeProfile(model=name, device=device, dtype=dtype, curves=curves,
                          measured_s=time.perf_counter() - started, quiet=quiet, key=key)
    if not _write_cached(key, profile) and progress:
        progress(f"cannot write the profile cache in {profile_cache_dir()} (measuring again next time)")
    return profile


#: A profile is *quiet* when other processes used at most this many cores on average while it was measured.
QUIET_MAX_CORES = 0.25
#: How long to let a busy machine settle before measuring again.
BUSY_RETRY_PAUSE_S = 1.0


def _cpu_times() -> tuple[float, float] | None:
    """(seconds of CPU every process used, seconds this process used) so far; None where /proc is not there."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = os.sysconf("SC_CLK_TCK")
        busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return None
    own = os.times()
    return busy / ticks, own.user + own.system


def others_cores(before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float) -> float:
    """Cores other processes kept busy on average between two :func:`_cpu_times` readings (0 when unknown)."""
    if before is None or after is None or wall_s <= 0:
        return 0.0
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s


def measure_quietly(model, sizes: list[int], keys: list[int], budget_s: float, device: str,
                    progress: ProgressFn | None = None) -> tuple[dict[int, CostCurve], bool]:
    """:func:`measure_curves`, checked for a quiet machine: when other processes kept more than QUIET_MAX_CORES
    busy meanwhile (CPU only), measure once more after a pause and keep each point's minimum of both. Returns the
    curves and whether either measurement was quiet (a busy profile is used, but re-measured at the next start)."""
    t0, before = time.perf_counter(), _cpu_times()
    curves = measure_curves(model, sizes, keys, budget_s=budget_s)
    busy = others_cores(before, _cpu_times(), time.perf_counter() - t0) if _is_cpu(device) else 0.0
    if busy <= QUIET_MAX_CORES:
        return curves, True
    if progress:
        progress(f"the machine was busy while profiling (other processes used {busy:.1f} cores): measuring again")
    time.sleep(BUSY_RETRY_PAUSE_S)
    t0, before = time.perf_counter(), _cpu_times()
    again = measure_curves(model, sizes, keys, budget_s=budget_s)
    busy_again = others_cores(before, _cpu_times(), time.perf_counter() - t0)
    for t, curve in curves.items():
        other = again.get(t)
        if other is not None and other.sizes == curve.sizes:
            curve.seconds = [min(a, b) for a, b in zip(curve.seconds, other.seconds)]
    quiet = busy_again <= QUIET_MAX_CORES
    if not quiet and progress:
        progress(f"still busy ({busy_again:.1f} cores used by others): using the faster of both measurements now "
                 "and measuring again at the next start")
    return curves, quiet


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


#: Longest wait for another node's measurement on this machine before measuring anyway.
MEASURE_LOCK_WAIT_S = 180.0


_HOLDING_LOCK = False  # this process holds the measuring lock already (nested use is a no-op)


@contextlib.contextmanager
def measuring_alone(device: str, progress: ProgressFn | None = None) -> Iterator[None]:
    """Hold a machine-wide lock (a file in the profile folder) while loading and measuring on a CPU: two nodes that
    start together would otherwise time their forwards while the other loads or measures on the same cores, and
    cache those numbers. Waits at most MEASURE_LOCK_WAIT_S; re-entrant within a process."""
    global _HOLDING_LOCK
    if not _is_cpu(device) or _HOLDING_LOCK:
        yield
        return
    folder = profile_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / ".measure.lock", "a+")  # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + MEASURE_LOCK_WAIT_S
        waited = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    if progress:
                        progress("another process kept measuring; measuring alongside it")
                    break
                if not waited and progress:
                    progress("waiting for another node's measurement on this machine ...")
                waited = True
                time.sleep(0.1)
        _HOLDING_LOCK = True
        yield
    finally:
        _HOLDING_LOCK = False
        handle.close()  # releases the lock


def _auto_gpu_dtype(device: str) -> str | None:
    if device.startswith("cuda") or device == "auto":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    if device == "mps":
        return "float16"
    return None


def _free(model: Any) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def resolve_auto_dtype(load: Callable[[str], Any], model_path: str, device: str, threads: list[int],
                       sizes: list[int], budget_s: float = 20.0, progress: ProgressFn | None = None, *,
                       variant: str = "", fresh: bool = False,
                       score: Callable[[NodeProfile, list[int]], float] | None = None) -> tuple[Any, NodeProfile]:
    """``dtype: auto``: pick the dtype for this node and return ``(model loaded in it, its profile)``.

    ``load(dtype_name)`` loads the model. A GPU takes bfloat16 where supported, else float16 (MPS: float16). A CPU
    measures float32 and bfloat16 (half the budget each) and keeps the one with the lower ``score`` (default
    :func:`profile_score`; a verifier passes :func:`verify_score`);
    both profiles are cached, so a later start looks both up and loads only the winner. At most one candidate is
    in memory at a time. ``profile.candidates`` holds the scores."""
    score = score or profile_score
    gpu_dtype = _auto_gpu_dtype(device)
    if gpu_dtype is not None:
        model = load(gpu_dtype)
        profile = load_or_measure(model, model_path, device, gpu_dtype, threads, sizes, budget_s, progress,
                                  variant=variant, fresh=fresh)
        profile.candidates = {gpu_dtype: score(profile, sizes)}
        return model, profile

    profiles: dict[str, NodeProfile | None] = {}
    for dtype in AUTO_CPU_DTYPES:
        cached = None
        if not fresh:
            cached = _read_cached(profile_key(model_path, device, dtype, threads, sizes, variant=variant))
            if cached is not None and progress:
                progress(f"profile of {Path(model_path).name} {dtype} on {device}: cached")
        profiles[dtype] = cached
    # Measure the likelier loser first, so the model in memory at the end is most often the winner.
    flags = hardware_flags()
    native_bf16 = flags["avx512_bf16"] or flags["amx"]
    order = ["float32", "bfloat16"] if native_bf16 else ["bfloat16", "float32"]
    held: tuple[str, Any] | None = None
    for dtype in order:
        if profiles[dtype] is not None:
            continue
        if held is not None:
            _free(held[1])
            held = None
        model = load(dtype)
        profiles[dtype] = load_or_measure(model, model_path, device, dtype, threads, sizes, budget_s / 2, progress,
                                          variant=variant, fresh=fresh)
        held = (dtype, model)
        del model
    scores = {dtype: score(p, sizes) for dtype, p in profiles.items() if p is not None}
    winner = min(scores, key=lambda d: (scores[d], d != "bfloat16"))  # a tie goes to the smaller footprint
    if held is not None and held[0] == winner:
        model = held[1]
    else:
        if held is not None:
            _free(held[1])
        held = None
        model = load(winner)
    profile = profiles[winner]
    assert profile is not None
    profile.candidates = scores
    if progress:
        listed = ", ".join(f"{d} {s * 1e3:.1f} ms" for d, s in scores.items())
        progress(f"dtype auto for {Path(model_path).name}: {winner} (score {listed})")
    return model, profile
