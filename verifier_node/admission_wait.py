"""The admission wait: a request that cannot be admitted *now* (the session limit, the KV budget, its tenant's
sessions or share of the budget: a ``busy`` from :mod:`verifier_node.admission`) waits here, for at most
``verifier.admission_wait_s``, before its ``busy`` goes to the client. The intake retries the waiting requests, in
the order they came, each time the sessions change (one ended, a vanished client's freed its budget) and at least
every :data:`RETRY_EVERY_S`.

Bounded: ``verifier.max_waiting_requests`` in all and, where tenants have a session cap, that many of one tenant (so
one key cannot take every place). A waiting request holds no KV and no session; it is cancelled like one being
prepared, and dropped with its client when the client vanishes. No sockets, no clock of its own: pure bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.protocol import ProtocolError
from verifier_node.request_prep import PrepJob

#: The longest between two retries of the waiting requests while nothing else changes.
RETRY_EVERY_S = 0.1


@dataclass
class Waiting:
    """One request waiting for room: its job, whether it is prepared (its prompt tokenised, its grammar built), when
    its wait ends and the ``busy`` it gets then (the last reason it did not fit)."""

    job: PrepJob
    prepared: bool
    deadline: float
    refusal: ProtocolError


class AdmissionWait:
    """The bounded wait (see the module's docstring). ``wait_s``: how long one request may wait (0: none waits);
    ``max_waiting``: places in all; ``per_tenant``: places of one tenant (None: no bound of its own)."""

    def __init__(self, wait_s: float, max_waiting: int, per_tenant: int | None = None):
        self.wait_s = wait_s
        self.max_waiting = max_waiting
        self.per_tenant = per_tenant
        self._waiting: dict[tuple[bytes, int], Waiting] = {}  # in arrival order (dicts keep it)

    def __contains__(self, key: tuple[bytes, int]) -> bool:
        return key in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def clients(self) -> set[bytes]:
        return {peer for peer, _ in self._waiting}

    def keys(self) -> list[tuple[bytes, int]]:
        """The ``(client, request_id)`` of every waiting request."""
        return list(self._waiting)

    def add(self, job: PrepJob, prepared: bool, refusal: ProtocolError, now: float) -> None:
        """Let ``job`` wait; ``refusal`` (its ``busy``) is raised instead where waiting is off or its places are
        taken (the message then says so)."""
        if self.wait_s <= 0:
            raise refusal
        if len(self._waiting) >= self.max_waiting:
            raise ProtocolError(f"{refusal} (and {self.max_waiting} requests already wait for room, "
                                "verifier.max_waiting_requests)", "busy", job.msg.request_id)
        if self.per_tenant is not None and self.held_by(job.scope) >= self.per_tenant:
            raise ProtocolError(f"{refusal} (and {self.per_tenant} of your requests already wait for room)", "busy",
                                job.msg.request_id)
        self._waiting[job.key] = Waiting(job, prepared, now + self.wait_s, refusal)

    def held_by(self, tenant: str | None) -> int:
        """Places taken by ``tenant``'s requests."""
        return sum(1 for w in self._waiting.values() if w.job.scope == tenant)

    def cancel(self, key: tuple[bytes, int]) -> PrepJob | None:
        """Drop request ``key`` (cancelled, or its client vanished); its job, or None if it was not waiting."""
        entry = self._waiting.pop(key, None)
        return None if entry is None else entry.job

    def expired(self, now: float) -> list[Waiting]:
        """The requests whose wait has ended (taken out: their ``busy`` goes to their clients)."""
        done = [w for w in self._waiting.values() if w.deadline <= now]
        for w in done:
            del self._waiting[w.job.key]
        return done

    def retry(self, attempt: Callable[[Waiting], None]) -> None:
        """``attempt`` each waiting request in arrival order: one it returns from has left the wait (admitted, or
        failed and answered by ``attempt``); one it raises a ``busy`` :class:`ProtocolError` for waits on, with that
        as its reason."""
        for key, entry in list(self._waiting.items()):
            if self._waiting.get(key) is not entry:
                continue  # cancelled meanwhile
            try:
                attempt(entry)
            except ProtocolError as exc:
                if exc.code != "busy":
                    raise
                entry.refusal = exc
                continue
            self._waiting.pop(key, None)
