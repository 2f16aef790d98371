"""Which clients are gone, so their sessions and waiting requests end and free what they hold (docs/security.md,
"Per-tenant shares and vanished clients").

Two signs: silence and a closed connection. A client that sends nothing (no ``ping``: clients ping every 0.5 s while
requests are in flight) for ``client.heartbeat_timeout_s`` is gone. A client whose connection closed (its socket
closed, its process ended: the client socket's monitor reports the file descriptor) is gone after
:data:`CLOSED_GRACE_S` unless it speaks meanwhile: a ROUTER does not say which peer a closed descriptor carried, so
the peers last heard on it are suspects, and a new connection that got the same descriptor number clears itself with
its next message. ``inproc://`` peers have no descriptor: silence alone applies to them.

Bound (what docs/security.md states): a closed client's sessions end within ``CLOSED_GRACE_S`` + :data:`SWEEP_S`
(plus the round then running), a silent one's within ``heartbeat_timeout_s`` + ``SWEEP_S``. No sessions here: the
server asks :meth:`ClientLiveness.gone` and ends what those clients hold.
"""

from __future__ import annotations

import contextlib
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

#: How long a client whose connection closed may take to show it is still there (a reused descriptor's new peer
#: pings within 0.5 s) before its sessions end.
CLOSED_GRACE_S = 1.0
#: The longest between two looks for gone clients.
SWEEP_S = 0.25


class ClientLiveness:
    """When each client was last heard, on which descriptor, and which descriptors closed (see the module's
    docstring). ``timeout_s``: the silence after which a client is gone. ``sock``: the client ROUTER to monitor for
    closed connections (None: silence only)."""

    def __init__(self, timeout_s: float, sock: zmq.Socket | None = None):
        self.timeout_s = timeout_s
        self.seen: dict[bytes, float] = {}
        self._fd: dict[bytes, int] = {}
        self._closed: dict[bytes, float] = {}  # suspect peer → when its descriptor closed
        self._next_sweep = 0.0
        self.monitor: zmq.Socket | None = None
        self._sock = sock
        if sock is not None:
            self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def heard(self, peer: bytes, frame: zmq.Frame | None = None, now: float | None = None) -> None:
        """A message from ``peer`` (``frame``: one of its frames, which knows the descriptor it came on)."""
        self.seen[peer] = time.monotonic() if now is None else now
        self._closed.pop(peer, None)
        if frame is not None:
            with contextlib.suppress(zmq.ZMQError, AttributeError):
                fd = frame.get(zmq.SRCFD)
                if fd >= 0:
                    self._fd[peer] = fd

    def read_monitor(self, now: float | None = None) -> None:
        """Take the monitor's closed-connection events (never blocks)."""
        if self.monitor is None:
            return
        now = time.monotonic() if now is None else now
        for _ in range(1000):  # bounded, like every drain
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.closed(int(event["value"]), now)

    def closed(self, fd: int, now: float) -> None:
        """The connection on descriptor ``fd`` closed: the peers last heard on it are suspects."""
        for peer in [p for p, f in self._fd.items() if f == fd]:
            del self._fd[peer]
            self._closed[peer] = now

    def due(self, now: float | None = None) -> bool:
        """Whether it is time to look for gone clients (at most every :data:`SWEEP_S`)."""
        now = time.monotonic() if now is None else now
        if now < self._next_sweep:
            return False
        self._next_sweep = now + SWEEP_S
        return True

    def gone(self, holding: set[bytes], now: float | None = None) -> dict[bytes, str]:
        """Of the clients in ``holding`` (those with sessions or waiting requests), the gone ones and why. Forgets
        gone clients that hold nothing."""
        now = time.monotonic() if now is None else now
        out: dict[bytes, str] = {}
        for peer in holding:
            since = self._closed.get(peer)
            silent = now - self.seen.get(peer, now)
            if since is not None and now - since > CLOSED_GRACE_S:
                out[peer] = "its connection closed"
            elif silent > self.timeout_s:
                out[peer] = f"nothing from it for {silent:.1f} s"
        for peer in [p for p in self.seen if p not in holding and (now - self.seen[p] > self.timeout_s
                                                                    or p in self._closed)]:
            self.forget(peer)  # bounded: peers that are gone and hold nothing
        return out

    def forget(self, peer: bytes) -> None:
        self.seen.pop(peer, None)
        self._fd.pop(peer, None)
        self._closed.pop(peer, None)

    def close(self) -> None:
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                if self._sock is not None and not self._sock.closed:
                    self._sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
