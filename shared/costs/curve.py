"""The cost curve type: how long one forward of a node's model takes for n new tokens, and a node's profile.

A :class:`CostCurve` holds a few measured points (n new tokens in one batch-1 forward on a cached prefix → seconds)
and answers ``cost(n, context)`` for any n by interpolation; ``observe`` refines it online from real rounds. A
:class:`NodeProfile` is what one node measured of itself (one curve per CPU thread count, or one for a GPU) and can
be sent to a peer (``to_dict`` / ``from_dict``, the latter validates: it comes from the network). The scores here
are what ``dtype: auto`` compares. Only the standard library is imported (no torch): the wire and the cost model
use these types without loading a model.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

#: The dtypes a profile may be measured in.
PROFILE_DTYPES = ("float32", "bfloat16", "float16")
#: A profile's ``dtype``: a torch dtype, or "gguf" (a llama.cpp model in its GGUF file's own tensor types).
WEIGHT_FORMATS = (*PROFILE_DTYPES, "gguf")

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
        if dtype not in WEIGHT_FORMATS:
            raise ValueError(f"node profile: dtype must be one of {', '.join(WEIGHT_FORMATS)}, got {_short(dtype)}")
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
