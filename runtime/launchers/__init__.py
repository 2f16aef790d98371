"""The launchers, as a registry: ``launch.backend`` (or ``--launcher NAME``) names one of :data:`LAUNCHERS`.

- ``process`` (default): each node a child process on this machine (:mod:`runtime.launchers.process`);
- ``inproc``: every node a thread of this process over ``inproc://`` (:mod:`runtime.launchers.inproc`; tests);
- ``ray``: each node an actor on a Ray cluster (:mod:`runtime.ray_launch`; needs Ray).

Each is a class made as ``cls(config, options)`` that follows :class:`~runtime.launchers.base.Launcher`: ``await
start()`` returns a :class:`~runtime.launchers.base.Started`. :func:`cluster` starts one and yields a connected
client; nothing here asks which launcher it is. A new launcher is one module plus its line in :data:`LAUNCHERS`
(and its name in ``shared.config_sections.LAUNCH_BACKENDS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from runtime.client import AsyncClient
from runtime.config import load_config
from runtime.first_run import with_reports
from runtime.launchers.base import Launcher, LaunchOptions, NodeState, Started
from runtime.node_setup import LaunchError
from shared.config_sections import LAUNCH_BACKENDS

__all__ = ["LAUNCHERS", "LaunchOptions", "Launcher", "NodeState", "Started", "cluster", "following",
           "launcher_class", "start_launcher"]

#: ``launch.backend`` → the launcher class, ``"module:Class"`` (imported when chosen: Ray is optional).
LAUNCHERS: dict[str, str] = {
    "process": "runtime.launchers.process:ProcessLauncher",
    "inproc": "runtime.launchers.inproc:InprocLauncher",
    "ray": "runtime.ray_launch:RayCluster",
}
if set(LAUNCHERS) != set(LAUNCH_BACKENDS):  # the config's choices are declared in shared/, below this registry
    raise TypeError(f"runtime.launchers.LAUNCHERS {tuple(LAUNCHERS)} and LAUNCH_BACKENDS {LAUNCH_BACKENDS} differ")

#: How often a client asks a launcher whose verifier may move where it is now.
FOLLOW_S = 1.0


def launcher_class(name: str) -> type:
    """The launcher registered as ``name``."""
    try:
        module, _, cls = LAUNCHERS[name].partition(":")
    except KeyError:
        raise LaunchError(f"unknown launcher {name!r} (known: {', '.join(LAUNCHERS)})") from None
    return getattr(importlib.import_module(module), cls)


async def start_launcher(config: dict[str, Any], options: LaunchOptions | None = None) -> tuple[Launcher, Started]:
    """Start the nodes of a loaded config with the launcher its ``launch.backend`` names; returns the launcher and
    what it started, once the nodes are starting (a start that fails stops what it started, keeping the logs)."""
    launcher: Launcher = launcher_class(config["launch"]["backend"])(config, options or LaunchOptions())
    try:
        started = await launcher.start()
    except BaseException:
        await asyncio.to_thread(launcher.stop, keep_logs=True)
        raise
    return launcher, started


def connect(started: Started, timeout_s: float) -> AsyncClient:
    """A client for what a launcher started (its keys, and its ZeroMQ context where the endpoints are inproc)."""
    return AsyncClient(started.client_address, timeout_s=timeout_s, curve=started.client_keys,
                       context=started.context)


@contextlib.asynccontextmanager
async def cluster(
    config: str | os.PathLike | dict | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    prefix: dict[str, list[str]] | None = None,
    entry: dict[str, list[str]] | None = None,
    options: LaunchOptions | None = None,
) -> AsyncIterator[AsyncClient]:
    """Start the nodes of ``config`` with its launcher and yield a connected client (``.startup``: the ready pong
    with the drafters' reports, ``.config``: the config the nodes run, ``.cluster``: the launcher); stop them on
    exit. ``env``, ``prefix``, ``entry`` (or ``options``): see :class:`LaunchOptions`."""
    cfg = load_config(config, overrides)
    options = options or LaunchOptions(env=env, prefix=prefix or {}, entry=entry or {})
    launcher, started = await start_launcher(cfg, options)
    failed = True
    try:
        async with connect(started, timeout_s or cfg["client"]["timeout_s"]) as client:
            pong = await launcher.wait_ready(client)
            client.startup = await with_reports(client, pong, started.drafters)  # type: ignore[attr-defined]
            client.config = started.config  # type: ignore[attr-defined]
            client.cluster = launcher  # type: ignore[attr-defined]
            client.started = started  # type: ignore[attr-defined]
            async with following(launcher, started, client):
                yield client
        failed = False
    finally:
        await asyncio.to_thread(launcher.stop, keep_logs=failed)


@contextlib.asynccontextmanager
async def following(launcher: Launcher, started: Started, client: AsyncClient) -> AsyncIterator[None]:
    """While the block runs, point ``client`` at the verifier wherever the launcher brought it back (only for a
    launcher whose verifier may move)."""

    async def follow() -> None:
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                address = await launcher.client_address()
                if address != client.address:
                    logging.getLogger("pipespec.launch").warning("the verifier moved to %s; the client follows",
                                                                 address)
                    key = getattr(launcher, "client_server_key", lambda: None)()  # a verifier on a new host
                    await client.retarget(address, server_key=key)
            except Exception as exc:  # a launcher that cannot answer now is asked again next time
                logging.getLogger("pipespec.launch").warning("following the verifier: %s", exc)

    if not started.verifier_may_move:
        yield
        return
    task = asyncio.create_task(follow())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
