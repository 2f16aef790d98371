"""ZeroMQ socket setup with the project's safety defaults.

A socket listens on a network interface only with CURVE (encryption and an allow-list of public keys, checked by
pyzmq's own ``zmq.auth`` authenticator, one ZAP domain per allow-list) or, unencrypted, when a config says
``allow_remote: true``; a hard per-frame size cap in ZeroMQ itself (a frame past it drops the peer's connection
before any bytes reach Python); no linger on close, so a node never hangs on exit waiting for a dead peer.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

#: ZeroMQ drops any single frame larger than this outright; the per-message cap in ``protocol.decode`` is lower
#: and answers with an error reply instead.
HARD_FRAME_LIMIT = 512 * 1024 * 1024


#: ``security.curve``: ``auto`` (CURVE on every non-loopback tcp link), ``on`` (every link), ``off`` (none).
CURVE_MODES = ("auto", "on", "off")


class EndpointError(ValueError):
    """An endpoint string that is malformed or not allowed."""


@dataclass(frozen=True)
class ServerKeys:
    """What the verifier needs for CURVE: its key pair and one allow-list folder (``*.key`` files) per ZAP domain."""

    public: bytes
    secret: bytes
    allow: dict[str, Path]
    #: Public keys (z85) let in on a domain beyond its folder's: the run's own HTTP gateway, made per run.
    extra: dict[str, frozenset[bytes]] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientKeys:
    """What a connecting peer (drafter or client) needs: the verifier's public key and its own key pair."""

    server_public: bytes
    public: bytes
    secret: bytes


#: ZAP domain (allow-list) of each kind of peer the verifier lets in over CURVE.
DOMAINS = {"drafter": "pipespec-drafters", "client": "pipespec-clients"}
DRAFTER_DOMAIN = DOMAINS["drafter"]
CLIENT_DOMAIN = DOMAINS["client"]
#: The environment variable that carries the per-run secret from the launcher to its nodes (named in node errors;
#: only the launcher, ``runtime.security``, reads it).
SECRET_ENV = "PIPESPEC_RUN_SECRET"


@dataclass(frozen=True)
class VerifierLinks:
    """The verifier's link security, resolved by the launcher (``runtime.security.verifier_links``): which of its
    sockets run CURVE, its keys when either does, and the run secret a drafter's hello must show where the drafter
    link has no CURVE (None: no secret is asked)."""

    curve_drafters: bool = False
    curve_clients: bool = False
    keys: ServerKeys | None = None
    run_secret: str | None = None
    #: Under CURVE on the client link, the clients (z85 public keys, as ZAP's User-Id gives them) that may set
    #: ``generate.tenant``: trusted gateways such as the run's own HTTP server (docs/security.md).
    gateways: frozenset[str] = frozenset()


@dataclass(frozen=True)
class DrafterLinks:
    """The drafter's link security, resolved by the launcher (``runtime.security.drafter_links``): its CURVE keys
    (None: no CURVE) and their name in the keys folder, and the run secret it shows in hello on a link without
    CURVE."""

    keys: ClientKeys | None = None
    key_name: str | None = None
    run_secret: str | None = None


def secret_matches(expected: str, given: Any) -> bool:
    """Constant-time comparison of a peer's ``run_secret`` with ours."""
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def peer_user_id(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id of the peer that sent ``frame`` (received with ``copy=False``): under CURVE the z85 text of its
    public key; None on a link without a ZAP handler."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user_id or None


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


def curve_wanted(mode: str, endpoint: str) -> bool:
    """Whether the link on ``endpoint`` runs CURVE under ``security.curve = mode`` (both ends decide alike)."""
    if mode not in CURVE_MODES:
        raise ValueError(f"security.curve must be one of {', '.join(CURVE_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and not is_local_endpoint(endpoint))


def check_endpoint(endpoint: str, allow_remote: bool = False, curve: bool = False) -> None:
    """Raise :class:`EndpointError` for a malformed endpoint, or a non-loopback one to listen on without CURVE
    and without ``allow_remote``."""
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
    if not is_local_endpoint(endpoint) and not allow_remote and not curve:
        raise EndpointError(
            f"endpoint {endpoint!r} is not loopback or ipc: listening on a network interface needs CURVE "
            "(security.curve: auto or on, with security.keys_dir from `python -m runtime.keys init DIR`) or, "
            "unencrypted and unauthenticated, security.curve: off with allow_remote: true in that node's config "
            "section (a private network only)"
        )


def _configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    return sock


class _ZapLog:
    """The authenticator's logger: pyzmq reports a refused key at debug level; this shows it as a warning, once per
    key (a refused peer retries every 100 ms)."""

    def __init__(self, log: logging.Logger):
        self._log = log
        self._seen: set[str] = set()

    def debug(self, msg: str, *args) -> None:
        try:
            text = msg % args if args else msg
        except (TypeError, ValueError):
            text = f"{msg} {args}"
        if not text.startswith("DENIED"):
            self._log.debug("%s", text)
        elif text not in self._seen and len(self._seen) < 1024:
            self._seen.add(text)
            self._log.warning("refused a peer: %s", text)

    def __getattr__(self, name: str):
        return getattr(self._log, name)


class _FolderKeys:
    """A ZAP domain's allowed public keys (z85), as pyzmq's ``configure_curve_callback`` asks for them: its
    folder's ``*.key`` files, read again when they change (a key added or removed takes effect at the next handshake:
    the Ray backend adds a drafter's key when the drafter joins), plus the domain's extra keys (the run's gateway)."""

    def __init__(self, folder: Path, extra: frozenset[bytes] = frozenset()):
        self.folder = folder
        self.extra = extra
        self._seen: tuple | None = None
        self._keys: dict[bytes, Any] = {}

    def _signature(self) -> tuple:
        try:
            return tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in self.folder.iterdir()
                                if e.name.endswith(".key")))
        except OSError:
            return ()

    def callback(self, domain: str, key: bytes) -> bool:
        seen = self._signature()
        if seen != self._seen:
            try:
                self._keys = zmq.auth.load_certificates(self.folder)
            except Exception:  # an unreadable folder lets nobody in
                self._keys = {}
            self._seen = seen
        return key in self._keys or key in self.extra


class Authenticator:
    """The ZAP handler of one context: one thread, one CURVE allow-list per domain (its folder read again when its
    key files change). Start it before binding (a CURVE socket without a ZAP handler would accept any key) and
    :meth:`close` it after the sockets."""

    def __init__(self, ctx: zmq.Context, keys: ServerKeys, log: logging.Logger | None = None):
        self.keys = keys
        self._auth: ThreadAuthenticator | None = ThreadAuthenticator(
            ctx, log=_ZapLog(log or logging.getLogger("pipespec.auth")))
        self._auth.start()
        try:
            for domain, folder in keys.allow.items():
                # a callback for every domain, since pyzmq asks only the callbacks once one is set
                provider = _FolderKeys(Path(folder), frozenset(keys.extra.get(domain, ())))
                self._auth.configure_curve_callback(domain=domain, credentials_provider=provider)
        except BaseException:
            self.close()
            raise

    def secure(self, sock: zmq.Socket, domain: str) -> None:
        """Make ``sock`` a CURVE server whose peers must hold a key of ``domain``'s allow-list."""
        if self._auth is None or domain not in self.keys.allow:
            raise ValueError(f"no running authenticator for ZAP domain {domain!r}")
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True
        sock.zap_domain = domain.encode()

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def bind_router(
    ctx: zmq.Context, endpoint: str, allow_remote: bool = False, *, auth: Authenticator | None = None,
    domain: str = "",
) -> zmq.Socket:
    """A ROUTER bound to ``endpoint``; with ``auth``, a CURVE server for the keys of ``domain``."""
    check_endpoint(endpoint, allow_remote, curve=auth is not None)
    sock = _configure(ctx.socket(zmq.ROUTER))
    # No ROUTER_HANDOVER: with it, a peer that announces another's routing id takes over that peer's pipe and its
    # replies. pipespec's peers announce none (each connection, a reconnection included, gets a fresh one from
    # ZeroMQ), so a duplicate can only be a hijack; without handover ZeroMQ ignores the newcomer.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    if auth is not None:
        auth.secure(sock, domain)
    sock.bind(endpoint)
    return sock


def make_dealer(ctx: zmq.Context, curve: ClientKeys | None = None, heartbeat_ms: tuple[int, int] | None = None
                ) -> zmq.Socket:
    """A DEALER, not yet connected (so a monitor can be attached first). ``curve``: a CURVE client that knows the
    verifier's public key. ``heartbeat_ms = (interval, timeout)``: ZMTP heartbeats, answered by the peer's ZeroMQ I/O
    thread even while its Python thread is busy, so a connection to a dead or unreachable host is dropped after
    ``timeout`` ms (a monitor then sees ``EVENT_DISCONNECTED``) while a merely busy peer is not."""
    sock = _configure(ctx.socket(zmq.DEALER))
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    if heartbeat_ms is not None:
        sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms[0])
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_ms[1])
    return sock


def connect_dealer(ctx: zmq.Context, endpoint: str, curve: ClientKeys | None = None) -> zmq.Socket:
    """A DEALER connected to ``endpoint``; with ``curve``, a CURVE client that knows the verifier's public key."""
    sock = make_dealer(ctx, curve)
    sock.connect(endpoint)
    return sock


class AuthWatch:
    """Tells a CURVE peer that the verifier refused its key (libzmq reports the ZAP denial as a handshake event),
    so it can stop with a clear error instead of retrying in silence."""

    def __init__(self, sock: zmq.Socket):
        self._sock = sock
        self._monitor: zmq.Socket | None = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def refused(self) -> bool:
        """Whether a handshake failed on authentication since the last call (never blocks)."""
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor is not None and self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return True
        return False

    def close(self) -> None:
        if self._monitor is not None:
            if not self._sock.closed:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
