"""Core leases: the CPU cores a node's forward may use, shared with the other nodes on this machine.

A torch forward at N OpenMP threads waits at every parallel region for its slowest thread, so when two processes'
forwards ask for more threads than the machine has cores together, both collapse: on a 2-core host a 2-thread
forward of the 1.5B target took 10× its time while a 1-thread forward of the 0.5B drafter ran beside it, where a
1-thread forward beside the same load lost under 20 %. The nodes plan their thread counts so this never happens
(``threads: auto``: every core while the other node idles, a share while both work), but a plan is a guess: a
verifier whose wait for a draft ran out starts a plain step while the drafter is still drafting at every core, a
drafter starts its next block while the verifier's forward is still running.

So each forward on a CPU holds a lease on the cores it runs on: one lock file per core in a machine-wide folder
(``flock``: the kernel frees a dead process's locks). A forward takes as many free cores as it wants, at least one
(waiting for one if every core is leased: running anyway would slow both forwards far more than the wait), runs at
that many threads, and gives them back. Python work between forwards holds no lease: short wake-ups of another
process cost a forward little. The lease costs a few system calls per forward.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("pipespec.cores")

#: Longest wait for a core when every core is leased: a peer's forward that long is stuck (a stopped process keeps
#: its locks). The forward then runs at one thread without a lease, and so do the forwards of the next
#: NO_WAIT_AFTER_TIMEOUT_S, so a hung peer costs this node one wait, not one per forward.
LEASE_WAIT_S = 2.0
NO_WAIT_AFTER_TIMEOUT_S = 10.0

#: Set to ``0`` to run without leases (to measure what they save; the nodes then use their planned counts as is).
LEASES_ENV = "PIPESPEC_CORE_LEASES"


def leases_for(device: str, cores: int, apply: Callable[[int], None]) -> CoreLeases | None:
    """A node's core leases: on a CPU device unless ``PIPESPEC_CORE_LEASES=0``; None elsewhere (a GPU's forwards
    use one host thread)."""
    if not str(device).startswith("cpu") or os.environ.get(LEASES_ENV, "1") == "0":
        return None
    return CoreLeases(cores, apply)


def lease_dir() -> Path:
    """The machine-wide folder of core lock files (the cache folder's ``locks/cores``)."""
    from shared.named_models import cache_root

    return cache_root() / "locks" / "cores"


class CoreLeases:
    """Leases on ``cores`` CPU cores (lock files ``core0`` … in ``folder``), for one process's forwards.

    ``apply(n)`` sets the process's thread count (``shared.models.set_threads``); it is called only when the
    granted count changes. ``granted`` is the count of the last lease (the threads the forward ran with)."""

    def __init__(self, cores: int, apply: Callable[[int], None], folder: Path | None = None):
        self.cores = max(1, int(cores))
        self.apply = apply
        self.granted = 0
        self.waits = 0  # leases that had to wait for a core (every core leased by other forwards)
        self.shortened = 0  # leases granted fewer cores than wanted
        self._threads = 0  # the count apply() last set
        self._no_wait_until = 0.0  # after a wait timed out: do not wait again before this (monotonic)
        folder = folder or lease_dir()
        self._files = []
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._files = [open(folder / f"core{i}", "a+") for i in range(self.cores)]  # noqa: SIM115
        except OSError as exc:  # no lease folder: forwards run at their wanted count, as before leases
            log.warning("core leases are off (%s): two nodes on one CPU may oversubscribe its cores", exc)
        # Start the search at a per-process core so two processes asking together take different ones.
        self._start = os.getpid() % self.cores

    @contextlib.contextmanager
    def hold(self, wanted: int) -> Iterator[int]:
        """Lease up to ``wanted`` cores (at least one) for one forward; yields the count granted, which is also the
        thread count in force during the ``with`` block."""
        wanted = max(1, min(int(wanted), self.cores))
        held = self._take(wanted) if self._files else []
        count = len(held) if held else wanted if not self._files else 1
        if count < wanted:
            self.shortened += 1
        if count != self._threads:
            self.apply(count)
            self._threads = count
        self.granted = count
        try:
            yield count
        finally:
            for handle in held:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _take(self, wanted: int) -> list:
        order = [self._files[(self._start + i) % self.cores] for i in range(self.cores)]
        held = []
        for handle in order:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            held.append(handle)
            if len(held) == wanted:
                break
        if held:
            return held
        if time.monotonic() < self._no_wait_until:
            return []
        self.waits += 1  # every core is leased: wait for the first to free up (bounded)
        deadline = time.monotonic() + LEASE_WAIT_S
        while time.monotonic() < deadline:
            for handle in order:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return [handle]
                except OSError:
                    continue
            time.sleep(0.002)  # ~500 wake-ups a second: next to nothing taken from the forwards running
        log.warning("no CPU core free for %.0f s (another process holds every core lease): running at one thread "
                    "without a lease for %.0f s", LEASE_WAIT_S, NO_WAIT_AFTER_TIMEOUT_S)
        self._no_wait_until = time.monotonic() + NO_WAIT_AFTER_TIMEOUT_S
        return []

    def close(self) -> None:
        for handle in self._files:
            handle.close()
        self._files = []
