"""The verifier's drafter pool: every authorised drafter that said hello (type, host, capabilities, load, liveness),
and which one a session should use.

A drafter is *alive* while messages from it keep coming (it heartbeats every 0.25 s when idle); after
``HEARTBEAT_TIMEOUT_S`` of silence it is dead for new work and its sessions move to a live drafter when one fits
(else they take plain steps and stay with it, so a drafter that was only busy picks them up again); after
``FORGET_AFTER_S`` of silence it leaves the pool, and anything it sends later is answered with ``not_connected``
(which makes a drafter node say hello again).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from shared.protocol import Capabilities, StartReport

#: Silent this long: not alive (no wait for its drafts; its sessions move to a live drafter that fits).
HEARTBEAT_TIMEOUT_S = 3.0
#: Silent this long: removed from the pool.
FORGET_AFTER_S = 30.0


class DrafterLink:
    """One connected drafter as the verifier sees it: routing id, announced type, host and capabilities, and the
    sessions it serves."""

    def __init__(self, routing_id: bytes, drafter_type: str, capabilities: Capabilities, host: str | None = None):
        self.routing_id = routing_id
        self.id = ""  # short, stable name in the pool ("d1", "d2", …), given by DrafterPool.join
        self.type = drafter_type
        self.host = host or "?"  # decode checked its type and length (Hello.validate)
        self.sends_q = capabilities.sends_q
        self.greedy_q = self.sends_q and capabilities.greedy_q
        self.needs_hidden = capabilities.needs_hidden_states
        self.kv_layers: list[int] = capabilities.needs_kv_layers
        self.dtype: str | None = None  # the drafter's model dtype, from its profile (None: unknown / no model)
        self.block_s = 0.0  # drafting its longest block at every core, from its profile (0: unknown / no model)
        self.last_seen = time.monotonic()
        self.sessions: set[int] = set()
        self.joined = 0  # join order: ties in load go to the earlier drafter
        self.reported_dead = False
        self.report: StartReport | None = None  # its start-up report (a heartbeat after the welcome), for pongs

    def refresh(self, hello: DrafterLink) -> None:
        """Take a new hello's announcement (same routing id: the same drafter, said hello again)."""
        for name in ("type", "host", "sends_q", "greedy_q", "needs_hidden", "kv_layers", "dtype", "block_s",
                     "last_seen"):
            setattr(self, name, getattr(hello, name))
        self.reported_dead = False

    def alive(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) - self.last_seen < HEARTBEAT_TIMEOUT_S

    def describe(self, now: float | None = None) -> dict[str, Any]:
        """The entry of ``pong.drafters``."""
        return {"id": self.id, "type": self.type, "host": self.host, "sessions": len(self.sessions),
                "alive": self.alive(now)}

    def label(self) -> str:
        return f"{self.id} ({self.type}@{self.host})"


class DrafterPool:
    """The drafters of one verifier, by routing id."""

    def __init__(self) -> None:
        self.links: dict[bytes, DrafterLink] = {}
        self._joins = 0

    def join(self, link: DrafterLink) -> tuple[DrafterLink, bool]:
        """Add a drafter that said hello; a hello from a routing id already in the pool re-registers that drafter
        (same id and sessions, the new announcement). Returns the pool's link and whether it was there before."""
        old = self.links.get(link.routing_id)
        if old is not None:
            old.refresh(link)  # sessions hold the old object: update it in place
            return old, True
        self._joins += 1
        link.id, link.joined = f"d{self._joins}", self._joins
        self.links[link.routing_id] = link
        return link, False

    def get(self, routing_id: bytes) -> DrafterLink | None:
        return self.links.get(routing_id)

    def live(self, now: float | None = None) -> list[DrafterLink]:
        now = now if now is not None else time.monotonic()
        return [d for d in self.links.values() if d.alive(now)]

    def dead(self, now: float) -> list[DrafterLink]:
        return [d for d in self.links.values() if not d.alive(now)]

    def types(self) -> set[str]:
        return {d.type for d in self.links.values()}

    def pick(self, fits: Callable[[DrafterLink], bool], exclude: Collection[str] = (),
             now: float | None = None) -> DrafterLink | None:
        """The least-loaded live drafter that ``fits`` (and is not in ``exclude``, by id), or None."""
        candidates = [d for d in self.live(now) if d.id not in exclude and fits(d)]
        return min(candidates, key=lambda d: (len(d.sessions), d.joined), default=None)

    def forget_silent(self, now: float) -> list[DrafterLink]:
        """Remove and return the drafters silent for ``FORGET_AFTER_S``."""
        gone = [d for d in self.links.values() if now - d.last_seen >= FORGET_AFTER_S]
        for d in gone:
            del self.links[d.routing_id]
        return gone

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [d.describe(now) for d in sorted(self.links.values(), key=lambda d: d.joined)]
