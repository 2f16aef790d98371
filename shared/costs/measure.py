"""Measuring a node's cost curves on the spot: forwards of n new tokens timed on a cached prefix within a time
budget, repeated when other processes kept the CPU busy, under a machine-wide lock so two nodes starting together
do not time each other's work; :func:`load_or_measure` takes a profile from the disk cache or measures and caches it.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from shared.costs.cache import profile_cache_dir, profile_key, read_cached, thread_keys, write_cached
from shared.costs.curve import PROFILE_DTYPES, CostCurve, NodeProfile
from shared.costs.hardware import is_cpu
from shared.target import SequenceHandle, Target

ProgressFn = Callable[[str], None]

#: Size ladder for :func:`sizes_up_to`: dense where verification costs change most, sparse beyond.
SIZE_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


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


def measure_curve(model: Any, sizes: list[int], prefix_len: int = PROFILE_PREFIX, budget_s: float = 8.0,
                  repeats: int = 2) -> CostCurve:
    """Measure a target's forward time for each n in ``sizes`` new tokens on a cached prefix of ``prefix_len``
    random tokens at the current thread count (see :func:`measure_curves`)."""
    return measure_curves(model, sizes, [0], prefix_len, budget_s, repeats)[0]


class _Measurement:
    """One :func:`measure_curves` run: forwards of random tokens on handles of the target, within a budget."""

    def __init__(self, target: Target, prefix_len: int, budget_s: float, repeats: int):
        self.target, self.prefix_len, self.budget_s, self.repeats = target, prefix_len, budget_s, repeats
        self.start = time.perf_counter()
        self.lm = target.open()
        self.sync = _synchronizer(torch.device(target.device))
        self.vocab = target.input_vocab_size or target.vocab_size
        self.generator = torch.Generator().manual_seed(1234)
        self.prefill_s = 0.0
        self.measured: dict[int, dict[int, float]] = {}

    @staticmethod
    def use(threads: int) -> None:
        if threads:
            torch.set_num_threads(threads)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.generator).tolist()

    def forward(self, ids: list[int]) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.lm.feed(ids)
        self.sync()
        return time.perf_counter() - t0

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def fastest(self, ids: list[int], keep: int) -> float:
        """The minimum over a warm-up and up to ``repeats`` more forwards, as many as the budget allows. The warm-up
        counts too: a slow one (first use of a shape) never wins the minimum, a normal one is not wasted when a
        large model leaves the budget room for a single forward."""
        best = self.forward(ids)
        self.lm.crop(keep)
        for _ in range(self.repeats):
            if best > self.left():
                break
            best = min(best, self.forward(ids))
            self.lm.crop(keep)
        return max(best, 1e-9)

    def estimate(self, threads: int, n: int) -> float:
        """A guess of a forward of ``n`` tokens at ``threads`` from what is measured so far (the prefill an upper
        bound at its size: first-call overheads, fine for a budget guess)."""
        points = dict(self.measured[threads])
        if self.prefix_len and self.prefill_s > 0 and self.prefix_len not in points:
            points[self.prefix_len] = self.prefill_s
        if not points:
            return 0.0
        ks = sorted(points)
        return CostCurve(ks, [points[k] for k in ks], self.prefix_len).base_cost(n)

    def curves(self, wanted: list[int], keys: list[int]) -> dict[int, CostCurve]:
        """The curves at each thread count in ``keys``: one prefill, then the sizes shape-first while the budget
        allows (a size whose estimate overruns it is interpolated over; the first is always measured)."""
        self.use(keys[-1])
        self.prefill_s = self.forward(self.tokens(self.prefix_len)) if self.prefix_len else 0.0
        self.measured = {t: {} for t in keys}
        for n in _shape_first_order(wanted):
            for t in keys:
                if self.measured[t] and self.estimate(t, n) > self.left():  # not even one forward fits
                    continue
                self.use(t)
                self.measured[t][n] = self.fastest(self.tokens(n), self.prefix_len)
        fill_from_richest(self.measured)
        curves = {}
        for t in keys:
            ks = sorted(self.measured[t])
            curves[t] = CostCurve(ks, nondecreasing([self.measured[t][k] for k in ks]), self.prefix_len)
        return curves

    def add_context_slopes(self, curves: dict[int, CostCurve], first: int, keys: list[int]) -> None:
        """Set each curve's ``per_context_token_s`` from forwards of ``first`` tokens on a 4× longer prefix paired
        with the same forward on the first (:func:`_context_slope`), if the budget allows."""
        long_len = 4 * self.prefix_len
        if self.target.max_positions:
            long_len = min(long_len, self.target.max_positions - 1)
        if long_len <= self.prefix_len:
            return
        need = self.estimate(keys[-1], long_len) + sum(2 * SLOPE_PAIRS * c.base_cost(first) for c in curves.values())
        if need > self.left():
            return
        self.use(keys[-1])
        long_lm = self.target.open()
        try:
            long_lm.feed(self.tokens(long_len))
            for t, curve in curves.items():
                self.use(t)
                curve.per_context_token_s = _context_slope(self.lm, long_lm, self.tokens(first), self.sync)
        finally:
            long_lm.close()

    def close(self) -> None:
        self.lm.close()


@torch.inference_mode()
def measure_curves(target: Target | Any, sizes: list[int], threads: list[int], prefix_len: int = PROFILE_PREFIX,
                   budget_s: float = 8.0, repeats: int = 2) -> dict[int, CostCurve]:
    """One curve per thread count in ``threads`` (0: leave the thread count as it is), all on one cached prefix of
    ``prefix_len`` random tokens (one prefill, at the largest thread count): for each n in ``sizes``, one warm-up
    and up to ``repeats`` more forwards of n new tokens per thread count (while the budget allows), the minimum kept.

    ``target``: a :class:`~shared.target.Target` whose handles are measured, or a loaded torch model (measured on
    dynamic caches, :func:`shared.target_torch.as_target`).

    Sizes are measured shape-first (smallest, largest, then the middles); a size whose estimated forward time would
    overrun ``budget_s`` is skipped (the curve interpolates over it), but the first size is always measured (so a
    model slower than the budget overruns it by about one prefill and one forward per thread count). If the budget
    allows, forwards on a 4× longer prefix, each paired with one on the first (:func:`_context_slope`), set
    ``per_context_token_s``. The thread count is restored."""
    from shared.target_torch import as_target

    wanted = sorted({int(n) for n in sizes if int(n) >= 1})
    if not wanted:
        raise ValueError(f"measure_curve: no size ≥ 1 in {sizes!r}")
    if prefix_len < 0:
        raise ValueError(f"measure_curve: prefix_len must be ≥ 0, got {prefix_len}")
    keys = sorted({int(t) for t in threads}) or [0]
    previous = torch.get_num_threads()
    run = _Measurement(as_target(target), prefix_len, budget_s, max(1, int(repeats)))
    try:
        curves = run.curves(wanted, keys)
        run.add_context_slopes(curves, wanted[0], keys)  # compared at the same size on both prefixes
        return curves
    finally:
        run.close()
        torch.set_num_threads(previous)


#: Pairs of forwards (short prefix, long prefix) behind a curve's per-context slope.
SLOPE_PAIRS = 3


def _context_slope(short: SequenceHandle, long: SequenceHandle, ids: list[int], sync: Callable[[], None]) -> float:
    """Seconds per cached token: the median over SLOPE_PAIRS of a forward of ``ids`` on the long prefix minus the
    same forward on the short one, each pair timed back to back. A slope from one long-prefix forward against the
    curve's minimum, measured seconds earlier, took a host's passing slow-down for context cost (5.3 ms per cached
    token for a 0.5B model on a 2-core Xeon, about 1,000× its attention's cost, which priced every drafting plan
    out)."""
    span = long.length - short.length
    if span <= 0:
        return 0.0
    diffs = []
    for _ in range(SLOPE_PAIRS):
        pair = []
        for lm in (short, long):
            keep = lm.length
            sync()
            t0 = time.perf_counter()
            lm.feed(ids)
            sync()
            pair.append(time.perf_counter() - t0)
            lm.crop(keep)
        diffs.append(pair[1] - pair[0])
    return max(0.0, statistics.median(diffs) / span)


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
    keys = thread_keys(device, threads)
    key = profile_key(model_path, device, dtype, threads, sizes, variant=variant)
    name = Path(model_path).name or model_path
    if not fresh:
        cached = read_cached(key)
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
    if not write_cached(key, profile) and progress:
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
                    progress: ProgressFn | None = None,
                    measure: Callable[[], dict[int, CostCurve]] | None = None) -> tuple[dict[int, CostCurve], bool]:
    """:func:`measure_curves`, checked for a quiet machine: when other processes kept more than QUIET_MAX_CORES
    busy meanwhile (CPU only), measure once more after a pause and keep each point's minimum of both. Returns the
    curves and whether either measurement was quiet (a busy profile is used, but re-measured at the next start).
    ``measure``: what measures the curves instead of :func:`measure_curves` (a model that is not torch's)."""
    if measure is None:
        def measure() -> dict[int, CostCurve]:
            return measure_curves(model, sizes, keys, budget_s=budget_s)
    t0, before = time.perf_counter(), _cpu_times()
    curves = measure()
    busy = others_cores(before, _cpu_times(), time.perf_counter() - t0) if is_cpu(device) else 0.0
    if busy <= QUIET_MAX_CORES:
        return curves, True
    if progress:
        progress(f"the machine was busy while profiling (other processes used {busy:.1f} cores): measuring again")
    time.sleep(BUSY_RETRY_PAUSE_S)
    t0, before = time.perf_counter(), _cpu_times()
    again = measure()
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


#: Longest wait for another node's measurement on this machine before measuring anyway.
MEASURE_LOCK_WAIT_S = 180.0


_HOLDING_LOCK = False  # this process holds the measuring lock already (nested use is a no-op)


@contextlib.contextmanager
def measuring_alone(device: str, progress: ProgressFn | None = None) -> Iterator[None]:
    """Hold a machine-wide lock (a file in the profile folder) while loading and measuring on a CPU: two nodes that
    start together would otherwise time their forwards while the other loads or measures on the same cores, and
    cache those numbers. Waits at most MEASURE_LOCK_WAIT_S; re-entrant within a process."""
    global _HOLDING_LOCK
    if not is_cpu(device) or _HOLDING_LOCK:
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
