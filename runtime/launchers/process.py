"""The ``process`` launcher (``launch.backend: process``, the default): each node a child process of this one on
this machine (``python -m runtime.launch --role X``), its output in a log file of the run folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from runtime import security
from runtime.client import AsyncClient
from runtime.config import check_security, fill_run_dir
from runtime.first_run import ProfileRelay
from runtime.launchers.base import LaunchOptions, NodeState, Started, drafter_count, make_run_dir
from runtime.node_setup import NODE_ENV, LaunchError, node_names, prepare_models, progress, wait_until_serving
from runtime.paths import PACKAGE_ROOT

#: Node processes run in the folder that holds the packages (a checkout's root, or site-packages), so what they
#: import never depends on the caller's directory; paths in the config are made absolute before they start
#: (:func:`runtime.config.validate`).
REPO_ROOT = PACKAGE_ROOT
#: What a node process runs after the interpreter. Tests name their own entry script in ``entry`` to start a node
#: with test behaviour injected as objects (tests/node_entry.py); production code reads no test switch.
NODE_ENTRY = ["-m", "runtime.launch"]


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if ``proc`` is still there after ``grace_s`` (a launcher or a helper process)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, so no node outlives it (Linux)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def node_pythonpath(current: str | None) -> str:
    """A node's PYTHONPATH: :data:`REPO_ROOT` first (a checkout need not be installed, and a worktree runs its own
    code), except when it is a site-packages folder, which the interpreter puts on the path itself (before it, it
    would come ahead of the standard library)."""
    import site

    site_dirs = {Path(d).resolve() for d in [*site.getsitepackages(), site.getusersitepackages()]}
    first = None if REPO_ROOT in site_dirs else str(REPO_ROOT)
    return os.pathsep.join(filter(None, [first, current]))


class ProcessLauncher:
    """The node processes of one config, started and supervised by this process."""

    def __init__(self, config: dict[str, Any], options: LaunchOptions | None = None):
        options = options or LaunchOptions()
        options.refuse_hooks("process")
        check_security(config)  # before any model is fetched or folder made
        self.own_run_dir = options.run_dir is None  # a folder we made is removed on a clean stop
        self.run_dir = make_run_dir(options.run_dir)  # 0700: the ipc sockets in it are ours alone
        self.config = fill_run_dir(config, self.run_dir)
        self.env = dict(options.env or {})
        self.prefix = dict(options.prefix)
        self.entry = dict(options.entry)
        # The drafter we start proves in hello that it is ours (links without CURVE); a cluster without its own
        # drafter takes one from elsewhere, so it sets a secret only if it was given one.
        self.run_secret = security.run_secret() or (
            security.new_secret() if self.config["launch"]["start_drafter"] else None)
        if self.run_secret:
            security.write_secret(self.run_dir, self.run_secret)
        # the run's HTTP server names tenants with a key of its own, drawn now: its secret stays in this process
        self.gateway = security.new_gateway(self.config)
        #: Node name -> its process (this launcher's own; not part of the launcher protocol).
        self.processes: dict[str, subprocess.Popen] = {}
        self.config_path = Path(self.run_dir) / "config.json"
        self.config_path.write_text(json.dumps(self.config, indent=1))

    @property
    def drafter_count(self) -> int:
        return drafter_count(self.config)

    async def start(self) -> Started:
        await asyncio.to_thread(prepare_models, self.config)
        # in this thread: a node's death signal (PR_SET_PDEATHSIG) follows the thread that started it, and a worker
        # thread of to_thread may end while the nodes run
        self.start_node("verifier")
        for name in node_names(self.drafter_count):
            self.start_node("drafter", name)
        return Started(client_address=self.config["client"]["endpoint"],
                       client_keys=security.client_keys_for(self.config), drafters=self.drafter_count,
                       config=self.config, run_dir=self.run_dir, gateway_keys=self.gateway)

    def log_path(self, name: str) -> Path:
        return Path(self.run_dir) / f"{name}.log"

    def start_node(self, role: str, name: str | None = None) -> subprocess.Popen:
        """Start one node process; ``name`` (default: the role) keys ``processes`` and names its log."""
        name = name or role
        env = {**NODE_ENV, **os.environ, **self.env}
        env["PYTHONPATH"] = node_pythonpath(env.get("PYTHONPATH"))
        if self.run_secret:
            env[security.SECRET_ENV] = self.run_secret  # the environment, not argv: ps shows argv to everyone
        if role == "verifier" and self.gateway is not None:
            env[security.GATEWAY_ENV] = self.gateway.public.decode()  # public: the verifier lets it in
        log = open(self.log_path(name), "ab")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(
            [*self.prefix.get(role, []), sys.executable, *self.entry.get(role, NODE_ENTRY), "--config",
             str(self.config_path), "--role", role],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.close()
        self.processes[name] = proc
        return proc

    async def client_address(self) -> str:
        return self.config["client"]["endpoint"]  # a process's verifier keeps its address

    def nodes(self) -> dict[str, NodeState]:
        from runtime.ray_node import host_facts

        host = {"ip": "local", **host_facts()}
        return {name: NodeState(name, "verifier" if name == "verifier" else "drafter",
                                "serving" if proc.poll() is None else "stopped", host)
                for name, proc in self.processes.items()}

    def log_tail(self, name: str, lines: int = 25) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def check_alive(self, roles: list[str] | None = None) -> None:
        for name, proc in self.processes.items():
            if roles and name not in roles:
                continue
            code = proc.poll()
            if code is not None:
                raise LaunchError(
                    f"the {name} node exited with code {code} during start-up. End of {self.log_path(name)}:\n"
                    + self.log_tail(name)
                )

    async def wait_ready(self, client: AsyncClient) -> dict[str, Any]:
        """Wait (bounded by ``launch.ready_timeout_s``) until the verifier answers and every drafter it started is
        in the pool."""
        timeout_s = self.config["launch"]["ready_timeout_s"]
        relay = ProfileRelay({name: self.log_path(name) for name in self.processes}, progress)

        async def check() -> None:
            relay.poll()
            self.check_alive()

        try:
            return await wait_until_serving(client, self.drafter_count, timeout_s, check,
                                            lambda: f"nodes not ready after {timeout_s} s; logs in {self.run_dir}")
        finally:
            relay.close()

    def stop(self, timeout_s: float = 10.0, keep_logs: bool = False) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.own_run_dir and not keep_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)

