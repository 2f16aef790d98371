"""One pipespec node inside a Ray actor: the code that runs on the host Ray placed the node on.

The launcher (:mod:`runtime.ray_launch`) makes one :class:`NodeHost` actor per node and calls :meth:`NodeHost.serve`
on it, a call that lasts as long as the node serves: Ray watches the actor's process, and the launcher watches that
call. The ZeroMQ links stay the data plane, as with the process backend; Ray only places, starts and restarts the
process. Nothing here imports Ray at module level: the class is wrapped with ``ray.remote`` by the launcher.

No secret crosses Ray. Each node makes its own CURVE key pair here, on its host, in a private folder
(:func:`node_folder`; kept across Ray's restarts of the actor on the same host, removed by :meth:`NodeHost.close`
when the run stops the node), and hands back only its public key (:meth:`NodeHost.public_key`). What a node gets,
as call arguments:

- its typed config (a :class:`shared.config.Config`, endpoints filled in by the launcher, pickled by Ray; without
  the ``http`` section, which stays on the launching host);
- its peers' public keys (a drafter: the verifier's; the verifier: each drafter's and the client's, and later ones
  through :meth:`NodeHost.allow`, which its authenticator reads at the next handshake); every link of a Ray launch
  runs CURVE (:func:`runtime.ray_launch.ray_config`);
- for a drafter with ``launch.link_delay_ms``: the verifier's address, which it reaches through a
  :mod:`runtime.delay_proxy` on its own host.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from runtime import security
from shared.config import Config

#: Log lines each actor keeps for :meth:`NodeHost.log_tail` (its stdout also goes to Ray's log files on its host).
LOG_LINES = 2000


class NodeFailed(RuntimeError):
    """A node that failed to start or stopped with an error; the message carries the end of its log."""


class _Ring(logging.Handler):
    """The last :data:`LOG_LINES` formatted log lines of this process."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a log line must never take the node down
            self.handleError(record)


def host_facts() -> dict[str, Any]:
    """What a sweep table and ``pipespec serve --ray`` say about the host a node runs on."""
    from shared.costs.hardware import cpu_model_name, gpu_name

    try:
        gpu = gpu_name("cuda")
    except Exception:  # no CUDA build or no driver: no GPU this node could use
        gpu = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": socket.gethostname(), "cpu": cpu_model_name(), "cores": cores, "gpu": gpu}


def free_ports(ip: str, count: int, preferred: list[int] | tuple[int, ...] = ()) -> list[int]:
    """``count`` TCP ports free on ``ip`` now: the ``preferred`` ones where they are free (a restarted verifier
    binds its old ports, so drafters and clients reconnect by themselves), the kernel's choice otherwise."""
    ports: list[int] = []
    for port in [*preferred, *[0] * count]:
        if len(ports) == count:
            break
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT does not block
            try:
                s.bind((ip, port))
            except OSError:
                continue
            chosen = s.getsockname()[1]
        if chosen not in ports:
            ports.append(chosen)
    return ports


def write_keys(folder: Path, files: dict[str, bytes]) -> None:
    """Public keys (``{relative path: z85 public key}``, each path ``*.key``) as key files under ``folder`` (0700), as
    ``runtime.keys`` lays them out; a secret key, or a name that leaves the folder, is refused (secrets are made
    where they are used: :func:`make_pair`)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for relative, data in files.items():
        path = folder / relative
        if not path.resolve().is_relative_to(folder.resolve()):  # "../x" or an absolute name
            raise ValueError(f"key file name {relative!r} leaves the keys folder")
        if not relative.endswith(".key"):
            raise ValueError(f"key file {relative!r}: only public keys (NAME.key) are handed to a node")
        text = public_file(data)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.replace(tmp, path)  # an allow-list being read sees the old file or the new one, never half of one


def public_file(public: bytes) -> bytes:
    """A ``NAME.key`` file's text for the z85 public key ``public`` (as ``zmq.auth`` writes and reads them)."""
    if not isinstance(public, bytes) or len(public) != 40 or not public.isascii() or b'"' in public:
        raise ValueError("a CURVE public key is 40 z85 characters")
    return b"#   ZeroMQ CURVE Public Certificate\n\ncurve\n    public-key = \"" + public + b"\"\n"


def make_pair(folder: Path, name: str) -> bytes:
    """A CURVE key pair made here (``folder/NAME.key`` 0644, ``NAME.key_secret`` 0600, ``folder`` 0700), or the one
    already there (an actor Ray restarted on this host); returns the public key (z85)."""
    import zmq.auth

    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    if not (public_path.is_file() and secret_path.is_file()):
        old = os.umask(0o077)  # the secret is born private
        try:
            zmq.auth.create_certificates(folder, name)
        finally:
            os.umask(old)
        os.chmod(public_path, 0o644)
    return zmq.auth.load_certificate(public_path)[0]


def node_folder(actor_name: str | None, create: bool = True) -> Path:
    """The private folder of the node actor ``actor_name`` on this host, ``TMPDIR/pipespec-ray-UID/ACTOR`` (its
    parent refused if another user made it first or others can open it; None: a new folder of its own)."""
    if actor_name is None:
        return Path(tempfile.mkdtemp(prefix="pipespec-ray-"))
    parent = Path(tempfile.gettempdir()) / f"pipespec-ray-{os.getuid()}"
    folder = parent / "".join(c if c.isalnum() or c in "-_." else "_" for c in actor_name)
    if create:
        security.private_run_dir(parent)
        folder.mkdir(mode=0o700, exist_ok=True)
    return folder


#: The names of a node's own key pair in its keys folder (each node has a folder of its own, so one name serves).
SERVER, OWN_KEY = "server", "drafter"


class _DelayProxy:
    """:mod:`runtime.delay_proxy` on loopback in a thread of its own, in front of the verifier's drafter socket."""

    def __init__(self, connect: tuple[str, int], delay_ms: float):
        from runtime import delay_proxy

        self.loop = asyncio.new_event_loop()
        started: dict[str, Any] = {}
        ready = threading.Event()

        async def start() -> None:
            try:
                server = await delay_proxy.serve(("127.0.0.1", 0), connect, delay_ms / 1000)
                started["port"] = server.sockets[0].getsockname()[1]
            except Exception as exc:  # reported to the caller below
                started["error"] = exc
            ready.set()

        def run() -> None:
            self.loop.run_until_complete(start())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="delay-proxy", daemon=True)
        self.thread.start()
        if not ready.wait(10) or "error" in started:
            raise NodeFailed(f"the link delay proxy did not start: {started.get('error', 'timed out')}")
        self.port: int = started["port"]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class NodeHost:
    """A Ray actor that runs one node (the launcher wraps it with ``ray.remote``; ``max_concurrency`` > 1, so
    :meth:`stop`, :meth:`log_tail` and :meth:`facts` answer while :meth:`serve` runs)."""

    def __init__(self, name: str, actor_name: str | None = None):
        self.name = name
        self.node: Any = None
        self.stopping = threading.Event()
        self.ring = _Ring()
        self.ring.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s"))
        self.started_at = time.time()  # a restarted actor is a new instance: the launcher compares this
        self.work_dir = node_folder(actor_name)  # 0700: the keys go in here (kept across restarts on this host)

    @property
    def keys_dir(self) -> Path:
        return self.work_dir / "keys"

    def public_key(self, role: str) -> bytes:
        """This node's public key (z85), its pair made here on first use; the secret never leaves this host."""
        if role == "verifier":
            return make_pair(self.keys_dir, SERVER)
        return make_pair(self.keys_dir / "drafters", OWN_KEY)

    def allow(self, peers: dict[str, bytes]) -> None:
        """The verifier: add public keys to its allow-lists (``{"drafters/NAME.key": key}``); its authenticator
        reads them at the next handshake."""
        write_keys(self.keys_dir, peers)

    def disallow(self, names: list[str]) -> None:
        """The verifier: remove allow-list entries (``"drafters/NAME.key"``), e.g. of a drafter scaled away."""
        for relative in names:
            path = self.keys_dir / relative
            if relative.endswith(".key") and path.resolve().is_relative_to(self.keys_dir.resolve()):
                path.unlink(missing_ok=True)

    def facts(self) -> dict[str, Any]:
        """This actor's host: ``ip`` (the address Ray knows it by), ``node_id``, ``pid``, ``started_at`` and
        :func:`host_facts`."""
        import ray

        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "started_at": self.started_at, **host_facts()}

    def free_ports(self, count: int, preferred: list[int] | tuple[int, ...] = ()) -> list[int]:
        import ray

        return free_ports(ray.util.get_node_ip_address(), count, preferred)

    def serve(self, role: str, config: Config, peers: dict[str, bytes], link_delay_ms: float = 0.0) -> int:
        """Run the node until :meth:`stop` (returns 0) or until it fails (raises :class:`NodeFailed` with the end
        of its log); ``peers``: the public keys it needs (see the module docstring)."""
        from runtime.launchers.node import build_node, install_models, links_for
        from runtime.node_setup import node_log_level
        from weights.progress import quiet_library_bars

        root = logging.getLogger()
        if self.ring not in root.handlers:
            root.addHandler(self.ring)
        root.setLevel(node_log_level())
        quiet_library_bars()
        self.stopping.clear()
        proxy = None
        try:
            config, proxy = self._on_this_host(role, config, peers, link_delay_ms)
            install_models(config, role)
            # every link runs CURVE, so no run secret is asked or shown
            self.node = build_node(role, config, links_for(role, config, None))
            if self.stopping.is_set():  # stop() came while the model loaded
                return 0
            code = self.node.serve()
            return int(code or 0)
        except Exception as exc:
            logging.getLogger("pipespec.ray").exception("%s failed", self.name)
            raise NodeFailed(f"{self.name} ({role}) failed: {exc}\nEnd of its log:\n{self.log_tail(25)}") from None
        finally:
            self.node = None
            if proxy is not None:
                proxy.close()

    def _on_this_host(self, role: str, config: Config, peers: dict[str, bytes],
                      link_delay_ms: float) -> tuple[Config, _DelayProxy | None]:
        """``config`` with this host's keys folder (its own pair and ``peers``' public keys), and for a drafter with a
        link delay its verifier address through a :class:`_DelayProxy` started here."""
        self.public_key(role)
        if role == "verifier":  # the allow-lists are the ones handed now (a restarted verifier gets them again)
            for sub in ("drafters", "clients"):
                shutil.rmtree(self.keys_dir / sub, ignore_errors=True)
                (self.keys_dir / sub).mkdir(mode=0o700)
        write_keys(self.keys_dir, peers)
        security_ = dataclasses.replace(config.security, keys_dir=str(self.keys_dir), drafter_key=OWN_KEY)
        config = dataclasses.replace(config, security=security_)
        if role != "drafter" or link_delay_ms <= 0:
            return config, None
        host, port = security.drafter_link(config.as_dict()).removeprefix("tcp://").rsplit(":", 1)
        proxy = _DelayProxy((host.strip("[]"), int(port)), link_delay_ms)
        drafter = dataclasses.replace(config.drafter, verifier_endpoint=f"tcp://127.0.0.1:{proxy.port}")
        return dataclasses.replace(config, drafter=drafter), proxy

    def stop(self) -> None:
        """Ask the node to stop (its :meth:`serve` call then returns)."""
        self.stopping.set()
        node = self.node
        if node is not None:
            node.stop()

    def close(self) -> None:
        """Stop the node and remove its folder and keys from this host (the run stops this node for good)."""
        self.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(list(self.ring.lines)[-lines:])
