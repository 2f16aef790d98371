"""Several Ray hosts on one machine (``ray.cluster_utils.Cluster``), for the Ray tier and ``scripts/ray_faults.py``.

    hosts = RayHosts({"target": {"num_cpus": 1, "resources": {"gpu_host": 1}},
                      "draft": {"num_cpus": 2, "resources": {"cpu_host": 2}, "labels": {"zone": "b"}}})
    hosts.nodes["draft"]            # the Ray node of that host (``.node_id``)
    hosts.replace("draft")          # remove that host and add a new one with the same resources

The head has no CPUs, so every node lands on a named host. This process joins the cluster (namespace
``pipespec``), as a launcher would. The cluster asks for Ray's token authentication (a fresh token, in this
process's environment, which the hosts and any child process inherit), as docs/ray.md starts one; ``auth=False``
starts one without (``RAY_AUTH_MODE=disabled``), which the launcher refuses unless ``launch.ray_insecure``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from typing import Any


class RayHosts:
    """A head with no CPUs and one worker node per named host spec (``ray.cluster_utils.Cluster.add_node``
    keyword arguments)."""

    def __init__(self, specs: dict[str, dict[str, Any]], auth: bool = True):
        import ray
        from ray._raylet import Config
        from ray.cluster_utils import Cluster

        if auth:
            os.environ.update({"RAY_AUTH_MODE": "token",
                               "RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)})
        else:
            os.environ["RAY_AUTH_MODE"] = "disabled"
        Config.initialize("")  # this process reads the mode again (as Ray's own token setup does)

        started = time.monotonic()
        self.ray = ray
        self.specs = specs
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        self.nodes = {name: self.cluster.add_node(**spec) for name, spec in specs.items()}
        ray.init(address=self.cluster.address, namespace="pipespec", log_to_driver=False)
        self.up_s = time.monotonic() - started

    @property
    def address(self) -> str:
        return self.cluster.address

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name))

    def add(self, name: str) -> None:
        self.nodes[name] = self.cluster.add_node(**self.specs[name])

    def shutdown(self) -> None:
        self.ray.shutdown()
        self.cluster.shutdown()


async def live_drafters(client: Any) -> set[str]:
    """The ids of the drafters the verifier counts as alive now."""
    from runtime.client import live_drafters as alive

    return {d["id"] for d in alive(await client.ping(timeout_s=2))}


async def until_drafters(client: Any, count: int, timeout_s: float = 120, besides: set[str] = frozenset()) -> float:
    """Seconds until the verifier's pool has ``count`` live drafters, not counting those in ``besides`` (drafters
    that were there before a fault: the verifier counts a drafter whose host vanished as alive until its heartbeat
    times out). AssertionError after ``timeout_s``."""
    from runtime.client import PipespecError

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(TimeoutError, PipespecError):
            if len(await live_drafters(client) - besides) == count:
                return time.monotonic() - t0
        await asyncio.sleep(0.2)
    raise AssertionError(f"the pool did not reach {count} live drafters in {timeout_s} s")


async def until_served(client: Any, request: dict[str, Any], timeout_s: float = 180) -> tuple[Any, float]:
    """Retry ``request`` (``generate`` keyword arguments) while the verifier is gone; the result and the seconds
    until it succeeded."""
    from runtime.client import PipespecError

    t0 = time.monotonic()
    while True:
        try:
            return await client.generate(**request), time.monotonic() - t0
        except PipespecError as exc:
            if exc.code != "verifier_gone" or time.monotonic() - t0 > timeout_s:
                raise
            await asyncio.sleep(0.25)
