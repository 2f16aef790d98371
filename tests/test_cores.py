"""Core leases (shared/cores.py): a forward takes the free cores it wants, at least one, waits (bounded) when every
core is leased, and a dead process's leases are free again. Leases of one process held through two ``CoreLeases``
objects conflict as those of two processes do (``flock`` locks belong to open files)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from shared import cores as cores_mod
from shared.cores import CoreLeases, leases_for

pytestmark = pytest.mark.unit


def _leases(tmp_path, applied=None) -> CoreLeases:
    return CoreLeases(2, (applied if applied is not None else []).append, folder=tmp_path)


def test_a_forward_alone_gets_every_core_it_wants_and_the_threads_follow(tmp_path):
    applied: list[int] = []
    leases = _leases(tmp_path, applied)
    with leases.hold(2) as granted:
        assert granted == 2
    with leases.hold(2) as granted:
        assert granted == 2
    with leases.hold(1) as granted:
        assert granted == 1
    assert applied == [2, 1]  # set only when the count changes
    assert leases.waits == leases.shortened == 0


def test_a_forward_beside_another_gets_the_cores_left_never_more(tmp_path):
    drafter, verifier = _leases(tmp_path), _leases(tmp_path)
    with drafter.hold(1) as first, verifier.hold(2) as second:
        assert (first, second) == (1, 1)  # 1 + 1 threads on 2 cores, not 1 + 2
    assert verifier.shortened == 1
    with verifier.hold(2) as alone:
        assert alone == 2


def test_a_forward_waits_for_a_core_while_another_holds_them_all(tmp_path):
    holder, waiter = _leases(tmp_path), _leases(tmp_path)
    held = threading.Event()

    def hold_all_briefly():
        with holder.hold(2):
            held.set()
            time.sleep(0.3)

    thread = threading.Thread(target=hold_all_briefly)
    thread.start()
    held.wait(5)
    t0 = time.monotonic()
    with waiter.hold(2) as granted:
        waited = time.monotonic() - t0
    thread.join()
    assert granted == 1 and waiter.waits == 1
    assert waited >= 0.1  # it did wait for the other forward to end, not run beside it


def test_a_stuck_holder_costs_one_bounded_wait_then_none(tmp_path, monkeypatch):
    monkeypatch.setattr(cores_mod, "LEASE_WAIT_S", 0.2)
    holder, waiter = _leases(tmp_path), _leases(tmp_path)
    with holder.hold(2):
        t0 = time.monotonic()
        with waiter.hold(2) as granted:
            assert granted == 1
        assert time.monotonic() - t0 >= 0.2
        t1 = time.monotonic()
        with waiter.hold(2) as granted:  # within the no-wait window: at once, one thread, no lease
            assert granted == 1
        assert time.monotonic() - t1 < 0.1
    assert waiter.waits == 1


def test_a_dead_process_leases_are_free_again(tmp_path, monkeypatch):
    monkeypatch.setattr(cores_mod, "LEASE_WAIT_S", 0.2)
    script = ("import sys; from shared.cores import CoreLeases; l = CoreLeases(2, lambda n: None, "
              f"folder=__import__('pathlib').Path({str(tmp_path)!r})); h = l.hold(2); h.__enter__(); print('held', "
              "flush=True); sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        leases = _leases(tmp_path)
        with leases.hold(2) as granted:
            assert granted == 1 and leases.waits == 1  # the child holds both: a bounded wait, then one thread
        child.kill()
        child.wait(10)
        with leases.hold(2) as granted:
            assert granted == 2
    finally:
        child.kill()


def test_leases_only_on_a_cpu_and_off_by_the_environment(monkeypatch):
    assert leases_for("cuda:0", 2, lambda n: None) is None
    monkeypatch.setenv(cores_mod.LEASES_ENV, "0")
    assert leases_for("cpu", 2, lambda n: None) is None
    monkeypatch.delenv(cores_mod.LEASES_ENV)
    leases = leases_for("cpu", 2, lambda n: None)
    assert isinstance(leases, CoreLeases)
    leases.close()
