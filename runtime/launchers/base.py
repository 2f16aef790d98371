"""What every launcher is: the :class:`Launcher` protocol, the typed result of its ``start()`` (:class:`Started`),
what a caller may ask of a start (:class:`LaunchOptions`) and a node's state as any launcher reports it
(:class:`NodeState`).

A launcher starts the nodes of one loaded config and supervises them; what it runs them in (child processes,
threads of this process, Ray actors) is its own business. Nothing outside a launcher asks which one it is.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from runtime import security
from runtime.node_setup import LaunchError

if TYPE_CHECKING:
    from runtime.client import AsyncClient
    from shared.transport import ClientKeys


@dataclass(frozen=True)
class LaunchOptions:
    """What a caller may ask of a start besides the config. ``run_dir``: the launcher's private folder (default:
    a new temporary one); ``env``: extra environment of the nodes; ``prefix`` / ``entry``: per role, a command put
    before a node process's command and what the process runs instead of ``python -m runtime.launch`` (tests inject
    behaviour this way; only the process launcher has processes, the others refuse them); ``hooks``: per role,
    keyword arguments of the node's ``from_config`` (objects: only the in-process launcher can hand them over)."""

    run_dir: str | None = None
    env: Mapping[str, str] | None = None
    prefix: Mapping[str, list[str]] = field(default_factory=dict)
    entry: Mapping[str, list[str]] = field(default_factory=dict)
    hooks: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def refuse_process_options(self, launcher: str, why: str) -> None:
        """A :class:`LaunchError` when a process prefix or entry was asked of a launcher without processes."""
        if self.prefix or self.entry:
            raise LaunchError(f"launch.backend {launcher} {why}: a process prefix or entry does not apply")

    def refuse_hooks(self, launcher: str) -> None:
        """A :class:`LaunchError` when objects were to be handed to nodes in other processes."""
        if self.hooks:
            raise LaunchError(f"launch.backend {launcher} starts the nodes in other processes: hooks (objects) "
                              "need launch.backend inproc (a process node takes them through its entry script)")


@dataclass(frozen=True)
class Started:
    """What ``Launcher.start()`` returns once every node is starting (not yet serving: ``wait_ready`` waits)."""

    #: Where the verifier takes clients now.
    client_address: str
    #: The keys a client connects with (None: the client link runs no CURVE).
    client_keys: ClientKeys | None
    #: Drafters this launch started (``launch.drafters``, 0 with ``start_drafter: false``).
    drafters: int
    #: The config the nodes run (endpoints filled in).
    config: dict[str, Any]
    #: The launcher's private folder (logs, keys, sockets).
    run_dir: str
    #: The verifier may come back at another address (a supervisor that restarts it elsewhere): a client then
    #: follows :meth:`Launcher.client_address`.
    verifier_may_move: bool = False
    #: The ZeroMQ context a client must share (``inproc://`` endpoints live in one context); None: its own.
    context: Any = None
    #: The keys of the run's own HTTP gateway, drawn per run (``runtime.security.new_gateway``): the one client
    #: that may name tenants under CURVE. None: the client link runs no CURVE, or this launcher draws none.
    gateway_keys: Any = None


@dataclass(frozen=True)
class NodeState:
    """One node as a launcher reports it: ``name`` (``verifier``, ``drafter``, ``drafter2``, …), ``role``, ``state``
    (``starting``, ``serving``, ``restarting``, ``failed``, ``stopped``) and ``host``: where it runs (``ip``
    ``local`` for this machine; ``host``, ``cpu``, ``cores``, ``gpu``)."""

    name: str
    role: str
    state: str
    host: Mapping[str, Any] = field(default_factory=dict)


class Launcher(Protocol):
    """A launch backend, made as ``cls(config, options)`` from the registry (:mod:`runtime.launchers`)."""

    async def start(self) -> Started: ...  # start every node; returns once they are starting

    async def wait_ready(self, client: AsyncClient) -> dict[str, Any]: ...  # the verifier's pong, once all serve

    async def client_address(self) -> str: ...  # where the verifier takes clients now (it may have moved)

    def check_alive(self, roles: list[str] | None = None) -> None: ...  # LaunchError for a node that failed

    def nodes(self) -> dict[str, NodeState]: ...  # every node by name

    def log_tail(self, name: str, lines: int = 25) -> str: ...  # the end of a node's log

    def stop(self, timeout_s: float = 10.0, keep_logs: bool = False) -> None: ...  # bounded; idempotent


def drafter_count(config: Mapping[str, Any]) -> int:
    """Drafters a launch of ``config`` starts: ``launch.drafters`` (0 with ``start_drafter: false``)."""
    return config["launch"]["drafters"] if config["launch"]["start_drafter"] else 0


def make_run_dir(run_dir: str | None) -> str:
    """The launcher's private folder (0700: keys, logs and sockets in it are ours alone): ``run_dir``, made
    private, or a new temporary one."""
    try:
        return security.private_run_dir(run_dir) if run_dir else tempfile.mkdtemp(prefix="pipespec-")
    except (security.RunDirError, OSError) as exc:
        raise LaunchError(str(exc)) from None
