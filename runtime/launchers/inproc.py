"""The ``inproc`` launcher (``launch.backend: inproc``, ``--launcher inproc``): the verifier and the drafters as
threads of this process, linked over ``inproc://`` ZeroMQ endpoints of one shared context (the way vLLM's tests run
on its in-process executor).

No interpreter starts, no model is loaded twice for nothing and a test can hand the nodes objects (``hooks``: an
acceptance rule, fixed cost curves) instead of an entry script. The nodes share this process's torch threads, so
its timings are not a deployment's: it is for tests and debugging. :func:`inproc_cluster` is the short way in::

    async with inproc_cluster("cpu.yaml", {"verifier.model": tiny, "drafter.model": tiny}) as client:
        result = await client.generate(token_ids=[1, 2, 3], max_new_tokens=8)

Stopping is bounded (:data:`STOP_TIMEOUT_S`) and joins every node thread; a thread that does not end in time is
named in a :class:`~runtime.node_setup.LaunchError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import zmq

from runtime import security
from runtime.client import AsyncClient
from runtime.config import typed
from runtime.launchers.base import LaunchOptions, NodeState, Started, drafter_count, make_run_dir
from runtime.launchers.node import Node, build_node, links_for
from runtime.node_setup import LaunchError, node_names, prepare_models, wait_until_serving
from shared.config import Config

#: How long stop() waits for the node threads to end (a serve loop ends within its poll timeout).
STOP_TIMEOUT_S = 30.0
#: Log lines kept per node for log_tail().
LOG_LINES = 2000


class _NodeLog(logging.Handler):
    """The last :data:`LOG_LINES` log lines of each node thread, by thread name."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names
        self.lines: dict[str, collections.deque[str]] = {}
        self.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        name = record.threadName.removeprefix("pipespec-")
        if name in self.names:
            try:
                self.lines.setdefault(name, collections.deque(maxlen=LOG_LINES)).append(self.format(record))
            except Exception:  # a log line must never take a node down
                self.handleError(record)


class _NodeThread:
    """One node: built and served in its own thread."""

    def __init__(self, name: str, role: str, build: Any):
        self.name, self.role = name, role
        self.node: Node | None = None
        self.state = "starting"
        self.error: str | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(build,), name=f"pipespec-{name}", daemon=True)

    def _run(self, build: Any) -> None:
        try:
            node = build()
            self.node = node
            if self.stopping.is_set():  # stop() came while the model loaded: serve() would close the sockets
                node.stop()
            self.state = "serving"
            node.serve()
            self.state = "stopped"
        except BaseException as exc:  # reported by check_alive / wait_ready, not lost in a thread
            logging.getLogger("pipespec.inproc").exception("%s failed", self.name)
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self.stopping.set()
        if self.node is not None:
            self.node.stop()


def inproc_config(config: dict[str, Any], tag: str) -> dict[str, Any]:
    """``config`` with the verifier's two sockets on ``inproc://`` endpoints named after ``tag``."""
    cfg = copy.deepcopy(config)
    cfg["verifier"]["endpoint"] = f"inproc://pipespec-{tag}-drafters"
    cfg["client"]["endpoint"] = f"inproc://pipespec-{tag}-clients"
    cfg["drafter"]["verifier_endpoint"] = None
    return cfg


class InprocLauncher:
    """The nodes of one config as threads of this process (see the module docstring)."""

    def __init__(self, config: dict[str, Any], options: LaunchOptions | None = None):
        options = options or LaunchOptions()
        options.refuse_process_options("inproc", "runs the nodes as threads of this process")
        if options.env:
            raise LaunchError("launch.backend inproc runs the nodes in this process: set their environment here")
        self.hooks: Mapping[str, Mapping[str, Any]] = options.hooks or {}
        self.own_run_dir = options.run_dir is None
        self.run_dir = make_run_dir(options.run_dir)
        self.config = inproc_config(config, uuid.uuid4().hex[:12])
        self.secret = security.new_secret()  # what the drafters' hellos show (inproc links run no CURVE)
        self.threads: dict[str, _NodeThread] = {}
        self.sections: Config | None = None
        self.log = _NodeLog(set())

    @property
    def drafter_count(self) -> int:
        return drafter_count(self.config)

    async def start(self) -> Started:
        await asyncio.to_thread(prepare_models, self.config)  # both nodes' models, once
        self.sections = typed(self.config)  # the one typed config both nodes take
        logging.getLogger().addHandler(self.log)
        for name in ["verifier", *node_names(self.drafter_count)]:
            role = "verifier" if name == "verifier" else "drafter"
            self.log.names.add(name)
            node = _NodeThread(name, role, lambda role=role: self._build(role))
            self.threads[name] = node
            node.thread.start()
        return Started(client_address=self.config["client"]["endpoint"], client_keys=None,
                       drafters=self.drafter_count, config=self.config, run_dir=self.run_dir,
                       context=zmq.Context.instance())

    def _build(self, role: str) -> Node:
        return build_node(role, self.sections, links_for(role, self.config, self.secret), **self.hooks.get(role, {}))

    async def client_address(self) -> str:
        return self.config["client"]["endpoint"]

    def nodes(self) -> dict[str, NodeState]:
        from runtime.ray_node import host_facts

        host = {"ip": "local", **host_facts(), "pid": os.getpid()}
        return {name: NodeState(name, t.role, t.state, host) for name, t in self.threads.items()}

    def log_tail(self, name: str, lines: int = 25) -> str:
        return "\n".join(list(self.log.lines.get(name, ()))[-lines:])

    def check_alive(self, roles: list[str] | None = None) -> None:
        for name, t in self.threads.items():
            if (not roles or t.role in roles) and t.state == "failed":
                raise LaunchError(f"the {name} node failed: {t.error}. End of its log:\n{self.log_tail(name)}")

    async def wait_ready(self, client: AsyncClient) -> dict[str, Any]:
        timeout_s = self.config["launch"]["ready_timeout_s"]

        async def check() -> None:
            self.check_alive()

        return await wait_until_serving(client, self.drafter_count, timeout_s, check,
                                        lambda: f"nodes not ready after {timeout_s} s; verifier log:\n"
                                                f"{self.log_tail('verifier')}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, keep_logs: bool = False) -> None:
        """Stop every node and join its thread (drafters first: they leave the verifier's pool on their own)."""
        order = sorted(self.threads.values(), key=lambda t: t.role == "verifier")
        for t in order:
            t.stop()
        deadline = time.monotonic() + timeout_s
        stuck = []
        for t in order:
            t.thread.join(max(0.0, deadline - time.monotonic()))
            if t.thread.is_alive():
                stuck.append(t.name)
        logging.getLogger().removeHandler(self.log)
        if self.own_run_dir and not keep_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if stuck:
            raise LaunchError(f"inproc nodes did not stop within {timeout_s:g} s: {', '.join(stuck)}")


@contextlib.asynccontextmanager
async def inproc_cluster(config: Any = None, overrides: Mapping[str, Any] | list[str] | None = None, *,
                         hooks: Mapping[str, Mapping[str, Any]] | None = None,
                         timeout_s: float | None = None) -> AsyncIterator[AsyncClient]:
    """:func:`runtime.launchers.cluster` with ``launch.backend: inproc``: both nodes as threads here, a connected
    client yielded. ``hooks``: per role, keyword arguments of the node's ``from_config`` (e.g.
    ``{"verifier": {"accept": rule}}``, ``{"drafter": {"fixed_costs": curves}}``)."""
    from runtime.config import load_config, parse_overrides
    from runtime.launchers import cluster

    cfg = load_config(config, {**parse_overrides(overrides), "launch.backend": "inproc"})
    async with cluster(cfg, timeout_s=timeout_s, options=LaunchOptions(hooks=hooks or {})) as client:
        yield client
