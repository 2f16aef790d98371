"""ZeroMQ socket setup with the project's safety defaults.

Loopback or ipc endpoints only unless a config says ``allow_remote: true``; a hard per-frame size cap in ZeroMQ
itself (a frame past it drops the peer's connection before any bytes reach Python); no linger on close, so a node
never hangs on exit waiting for a dead peer.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlparse

import zmq

#: ZeroMQ drops any single frame larger than this outright; the per-message cap in ``protocol.decode`` is lower
#: and answers with an error reply instead.
HARD_FRAME_LIMIT = 512 * 1024 * 1024


class EndpointError(ValueError):
    """An endpoint string that is malformed or not allowed."""


def is_local_endpoint(endpoint: str) -> bool:
    """``ipc://`` and ``inproc://`` are local; ``tcp://`` is local when its host is a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        raise EndpointError(f"endpoint {endpoint!r}: use ipc://PATH or tcp://HOST:PORT")
    host = urlparse(f"tcp://{rest}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str, allow_remote: bool = False) -> None:
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise EndpointError(f"endpoint {endpoint!r}: use ipc://PATH or tcp://HOST:PORT")
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        parsed = urlparse(f"tcp://{rest}")
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None:
            raise EndpointError(f"endpoint {endpoint!r}: tcp needs HOST:PORT")
    elif scheme == "ipc" and not rest:
        raise EndpointError(f"endpoint {endpoint!r}: ipc needs a path")
    if not is_local_endpoint(endpoint) and not allow_remote:
        raise EndpointError(
            f"endpoint {endpoint!r} is not loopback or ipc; set allow_remote: true in that node's config section "
            "to listen on a network interface (traffic is unencrypted: use a private network)"
        )


def _configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    return sock


def bind_router(ctx: zmq.Context, endpoint: str, allow_remote: bool = False) -> zmq.Socket:
    check_endpoint(endpoint, allow_remote)
    sock = _configure(ctx.socket(zmq.ROUTER))
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.bind(endpoint)
    return sock


def connect_dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = _configure(ctx.socket(zmq.DEALER))
    sock.connect(endpoint)
    return sock
