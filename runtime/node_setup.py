"""What every launch backend does for a node, wherever it runs: the node's environment and log level, installing
named models before it loads them, and the error a launcher raises when a node cannot start.

Every launcher (``runtime/launchers/``: processes, threads of this process, Ray actors) uses these; the launcher
protocol itself is :class:`runtime.launchers.base.Launcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.client import AsyncClient

from runtime.config import check_model_dependent


class LaunchError(RuntimeError):
    """A node failed to start; the message carries the end of its log."""


def node_names(drafters: int, start: int = 0) -> list[str]:
    """The names of drafter nodes ``start`` … ``start + drafters - 1``: ``drafter``, ``drafter2``, ``drafter3``, …"""
    return ["drafter" if i == 0 else f"drafter{i + 1}" for i in range(start, start + drafters)]


async def wait_until_serving(client: AsyncClient, drafters: int, timeout_s: float, check: Callable[[], Awaitable[None]],
                             not_ready: Callable[[], str]) -> dict[str, Any]:
    """The verifier's pong once it answers with ``drafters`` live drafters in its pool; ``check()`` runs before each
    ping (it raises for a node that failed), and after ``timeout_s`` a :class:`LaunchError` says ``not_ready()``."""
    from runtime.client import live_drafters

    deadline = time.monotonic() + timeout_s
    while True:
        await check()
        with contextlib.suppress(TimeoutError):
            pong = await client.ping(timeout_s=1.0)
            if len(live_drafters(pong)) >= drafters:
                return pong
        if time.monotonic() > deadline:
            raise LaunchError(not_ready())
        await asyncio.sleep(0.2)


def progress(message: str) -> None:
    """One ``[pipespec]`` progress line on stderr."""
    print(f"[pipespec] {message}", file=sys.stderr, flush=True)


def prepare_models(config: dict[str, Any]) -> None:
    """Install and convert named offline models once, in the foreground, with progress (nodes then load fast)."""
    from drafter_node.types import drafter_spec
    from shared.named_models import is_named_model
    from weights import install  # looked up at call time, so tests can forbid installing

    for section in ("verifier", "drafter"):
        name = config[section]["model"]  # a validated config has every key
        if section == "drafter" and not config["launch"]["start_drafter"]:
            continue
        if isinstance(name, str) and is_named_model(name):
            if section == "drafter" and drafter_spec(config["drafter"]["type"]).model_file:
                install.ensure_gguf(name, progress=progress)
            else:
                install.ensure_model(name, progress=progress)
    check_model_dependent(config)


#: Set for every node process unless the environment sets it already. libgomp (torch's OpenMP on Linux) lets a
#: worker thread spin for 300,000 iterations after each parallel region before it sleeps; two nodes on one machine
#: then steal each other's cores at every hand-off (the node that just finished spins while the other starts), which
#: made a synchronous round's publish 5 ms and its forwards 2x slower on a 2-core machine. 10,000 still covers the
#: gaps between the regions of one forward.
NODE_ENV = {"GOMP_SPINCOUNT": "10000"}
#: A node's log level (``debug`` adds, e.g., the drafter's reason for each round's plan); default ``info``.
LOG_LEVEL_ENV = "PIPESPEC_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def node_log_level() -> str:
    """A node's log level from ``PIPESPEC_LOG_LEVEL`` (one of LOG_LEVELS, any case; anything else: ``INFO``)."""
    level = os.environ.get(LOG_LEVEL_ENV, "info").strip().upper()
    return level if level in LOG_LEVELS else "INFO"
