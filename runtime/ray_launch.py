"""The Ray launch backend (``launch.backend: ray``, ``pipespec serve --ray``): the nodes as actors on a Ray cluster.

Ray places and supervises the node processes; the hot path stays off Ray, as in vLLM's Ray executor. Each node
is a :class:`runtime.ray_node.NodeHost` actor whose long-running ``serve`` call is the node; the nodes bind on
their own host's address (``ray.util.get_node_ip_address()``, a free port) and the launcher hands the endpoints
to the peers. Every link runs CURVE; each node makes its own key pair on its host and hands back only the public key,
the client's pair is made in the launching process, and the ``http`` section (API keys) never leaves the launching
host, so no secret crosses Ray. The cluster itself must ask for Ray's token authentication (:mod:`runtime.ray_auth`)
unless ``launch.ray_insecure``. Per-round data never touches Ray's object store.

Who does what:

- :class:`Controller`, one actor on the launching host (named, so ``pipespec scale`` finds it): reserves a
  placement group with one bundle per node (``verifier.placement``, ``drafter.placement``,
  ``launch.placement_strategy``), gathers the nodes' public keys, starts the node actors, watches their ``serve``
  calls and brings a node back after Ray restarts its actor (``launch.max_restarts``): a drafter rejoins the pool
  (a new key of a new host goes into the verifier's allow-list), a verifier binds its old ports where it can
  (drafters and clients reconnect by themselves) and otherwise the drafters are pointed at its new address and
  key. ``scale(n)`` adds or removes drafters.
- :class:`RayCluster`, in the launching process: the ``ray`` launcher of the registry (``runtime/launchers/``):
  start, wait until ready, check alive, log tail, stop, and the client address now (a verifier that came back
  elsewhere has a new one: :func:`runtime.launchers.following` moves the client there).

Ray is an optional dependency (``pip install 'pipespec[ray]'``); nothing else imports this module.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from runtime import keys as keyfiles
from runtime.config import ConfigError, typed
from runtime.launchers.base import LaunchOptions, NodeState, Started, drafter_count, make_run_dir
from runtime.node_setup import LaunchError, node_names, wait_until_serving
from runtime.placement import Placement, parse_placement

log = logging.getLogger("pipespec.ray")

#: Ray namespace of pipespec's named actors (the controller of each run).
NAMESPACE = "pipespec"
#: The controller's name when ``launch.ray_name`` is not given; ``pipespec scale`` looks it up.
DEFAULT_NAME = "pipespec"
#: Calls to a node actor that should answer at once (facts, stop, log tail) wait at most this long.
CALL_TIMEOUT_S = 30.0
#: How often the controller looks at its nodes' serve calls.
WATCH_S = 0.25
#: Concurrent calls one node actor takes: serve (the node), stop, log tail, facts.
NODE_CONCURRENCY = 4
#: Events (placed, serving, ended, back, …) the controller keeps for ``status()``; older ones are dropped.
EVENTS_KEPT = 1000
#: Times a node that fails while its actor lives is served again when ``launch.max_restarts`` is -1.
NODE_RETRIES = 3
INSTALL_HINT = "the ray backend needs Ray: pip install 'pipespec[ray]'"


class RayLaunchError(LaunchError):
    """The Ray backend could not place or start the nodes; the message says why and what to change."""


def import_ray():
    """``ray``, or :class:`RayLaunchError` saying what to install."""
    try:
        import ray
    except ImportError:
        raise RayLaunchError(INSTALL_HINT) from None
    return ray


def connect(address: str | None, insecure: bool = False) -> Any:
    """Join the Ray cluster at ``address`` (``"auto"``: the one ``ray start`` runs on this host; ``None``: start a
    private local one, token authentication on), then check that it asks for token authentication
    (:mod:`runtime.ray_auth`; refused unless ``insecure``); a process already connected stays connected, and is
    checked too."""
    from runtime.ray_auth import RayAuthError, check_cluster, start_private

    ray = import_ray()
    options = {"namespace": NAMESPACE, "log_to_driver": False, "include_dashboard": False,
               "configure_logging": False}
    joined = not ray.is_initialized()
    try:
        if joined:
            if address is None:
                start_private(ray, insecure, **options)
            else:
                ray.init(address=address, **options)
        client = address.removeprefix("ray://") if address and address.startswith("ray://") else None
        check_cluster(ray, insecure, client)
    except RayAuthError as exc:
        if joined and ray.is_initialized():
            ray.shutdown()  # no work of ours stays on a cluster we refused
        raise RayLaunchError(str(exc)) from None
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise RayLaunchError(f"cannot reach the Ray cluster at {address or 'a new local Ray'}: {exc}") from None
    return ray


def ray_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config the nodes get: every link runs CURVE (``security.curve: auto`` becomes ``on``: the links are
    between hosts, and even on one host a node's address is its network address); ``off`` stays off and then
    needs ``verifier.allow_remote: true``, as elsewhere. The ``http`` section is left out (:func:`without_http`)."""
    cfg = without_http(config)
    if cfg["security"]["curve"] == "off" and not cfg["verifier"]["allow_remote"]:
        raise ConfigError("security.curve: off with launch.backend: ray sends every link in the clear between "
                          "hosts: set verifier.allow_remote: true to mean it, or leave security.curve at auto")
    if cfg["security"]["curve"] == "auto":
        cfg["security"]["curve"] = "on"
    if cfg["security"]["gateway_clients"] is None:  # this launcher draws the client pair per run (_start); its
        cfg["security"]["gateway_clients"] = cfg["security"]["client_key"]  # HTTP server names tenants with it
    return cfg


def without_http(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``http`` section at the defaults: the API keys and the keys file's name stay on the
    launching host, where the HTTP server runs; nothing on the nodes reads that section."""
    from runtime.config import DEFAULTS

    cfg = copy.deepcopy(config)
    cfg["http"] = copy.deepcopy(DEFAULTS["http"])
    return cfg


def placements(config: dict[str, Any]) -> tuple[Placement, Placement]:
    """The verifier's and each drafter's :class:`Placement` (the config was checked at load)."""
    return (parse_placement(config["verifier"]["placement"], "verifier.placement", config["verifier"]["device"]),
            parse_placement(config["drafter"]["placement"], "drafter.placement", config["drafter"]["device"]))


def check_feasible(nodes: list[dict[str, Any]], wanted: dict[str, Placement]) -> None:
    """Refuse at once a placement no live host of the cluster could ever hold (Ray would wait for it forever)."""
    alive = [n for n in nodes if n.get("Alive")]
    for name, placement in wanted.items():
        need = placement.bundle()
        fits = [n for n in alive
                if all(n["Resources"].get(r, 0) >= amount for r, amount in need.items() if amount)
                and all(n.get("Labels", {}).get(k) == v for k, v in placement.labels.items())]
        if not fits:
            offered = "; ".join(
                f"{n['NodeManagerAddress']}: "
                + ", ".join(f"{k} {v:g}" for k, v in sorted(n["Resources"].items())
                            if not k.startswith("node:") and k not in ("memory", "object_store_memory"))
                + "".join(f", label {k}={v}" for k, v in sorted(n.get("Labels", {}).items())
                          if not k.startswith("ray.io/"))
                for n in alive) or "no live hosts"
            raise RayLaunchError(f"no host of the Ray cluster can hold the {name} node ({placement.describe()}); "
                                 f"hosts offer: {offered}. Change {name.rstrip('0123456789')}.placement or start "
                                 "a host with `ray start --resources=... --labels=...`")


def peer_keys(role: str, nodes: list[tuple[str, str, bytes | None]], client: tuple[str, bytes]
              ) -> dict[str, bytes]:
    """The public keys a node of ``role`` is handed (``{relative path: z85}``): the verifier each drafter's
    (``drafters/NAME.key``) and the client's (``clients/NAME.key``), a drafter the verifier's (``server.key``).
    ``nodes``: ``(name, role, public key)`` of the run's nodes; ``client``: the client key's name and public key."""
    if role == "verifier":
        return {**{f"drafters/{name}.key": key for name, r, key in nodes if r == "drafter" and key},
                f"clients/{client[0]}.key": client[1]}
    server = [key for _, r, key in nodes if r == "verifier" and key]
    if not server:
        raise RayLaunchError("the verifier's public key is not known yet")
    return {"server.key": server[0]}


class _Node:
    """The controller's record of one node actor."""

    def __init__(self, name: str, role: str, actor: tuple[str, Any], placement: Placement, group: Any, bundle: int):
        self.name, self.role, self.placement = name, role, placement
        self.actor_name, self.actor = actor  # Ray's name for it (ray.get_actor finds it) and its handle
        self.group, self.bundle = group, bundle  # the placement group and the bundle it sits in
        self.serving: Any = None  # the ObjectRef of the running serve call
        self.facts: dict[str, Any] = {}
        self.state = "starting"  # starting, serving, restarting, failed, stopped
        self.restarts = 0
        self.public: bytes | None = None  # its CURVE public key, made on its host
        self.error: str | None = None
        self.repointing = False  # stopped on purpose, to serve again towards a verifier that moved


class Controller:
    """The run's supervisor, a Ray actor on the launching host (see the module docstring)."""

    def __init__(self, config: dict[str, Any], env: dict[str, str]):
        self.ray = import_ray()
        self.config = ray_config(config)
        self.env = env
        self.nodes: dict[str, _Node] = {}
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENTS_KEPT)
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.watcher: threading.Thread | None = None
        self.client_key: tuple[str, bytes] = (self.config["security"]["client_key"], b"")
        self.verifier_ports: list[int] = []

    # -------------------------------------------------------------------------------------------- start

    def _event(self, node: str, what: str, **detail: Any) -> None:
        entry = {"t": time.time(), "node": node, "event": what, **detail}
        self.events.append(entry)
        log.info("%s: %s %s", node, what, detail or "")

    def _actor(self, name: str, placement: Placement, group: Any, bundle: int) -> tuple[str, Any]:
        """A node actor in ``bundle`` of ``group``: its Ray name (``launch.ray_name:NODE:ID``) and handle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from runtime.ray_node import NodeHost

        cls = self.ray.remote(NodeHost)
        # unique per actor: a drafter scaled away and back gets a new actor while Ray may still hold the old name
        actor_name = f"{self.config['launch']['ray_name']}:{name}:{uuid.uuid4().hex[:8]}"
        return actor_name, cls.options(
            name=actor_name, namespace=NAMESPACE,
            max_restarts=self.config["launch"]["max_restarts"], max_task_retries=0,
            max_concurrency=NODE_CONCURRENCY, num_cpus=placement.num_cpus, num_gpus=placement.num_gpus,
            resources=placement.resources or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
            runtime_env={"env_vars": self.env},
        ).remote(name, actor_name)

    def _group(self, wanted: list[Placement], strategy: str) -> Any:
        from ray.util.placement_group import placement_group

        labels = [p.labels for p in wanted]
        return placement_group([p.bundle() for p in wanted], strategy=strategy,
                               bundle_label_selector=labels if any(labels) else None)

    def _wait_placed(self, group: Any, names: list[str], timeout_s: float) -> float:
        t0 = time.monotonic()
        try:
            self.ray.get(group.ready(), timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise RayLaunchError(f"Ray placed no hosts for {', '.join(names)} within {timeout_s:g} s: the hosts "
                                 "that could hold them are busy (`ray status` shows what is in use)") from None
        return time.monotonic() - t0

    def start(self, drafters: int, client_public: bytes) -> dict[str, Any]:
        """Place and start the verifier and ``drafters`` drafters, the client being the one whose public key is
        ``client_public``; returns :meth:`status` (with the verifier's public key) once every node's ``serve`` call
        is under way (the launcher then waits for the verifier's pong)."""
        self.client_key = (self.client_key[0], client_public)
        verifier_at, drafter_at = placements(self.config)
        names = ["verifier", *node_names(drafters)]
        wanted = {"verifier": verifier_at, **{n: drafter_at for n in names[1:]}}
        check_feasible(self.ray.nodes(), wanted)
        group = self._group(list(wanted.values()), self.config["launch"]["placement_strategy"])
        placed_s = self._wait_placed(group, names, self.config["launch"]["ready_timeout_s"])
        self._event("cluster", "placed", seconds=round(placed_s, 3), nodes=len(names))
        with self.lock:
            for i, name in enumerate(names):
                self.nodes[name] = _Node(name, "verifier" if i == 0 else "drafter",
                                         self._actor(name, wanted[name], group, i), wanted[name], group, i)
            for name in names:  # every public key first: the verifier's allow-list holds the drafters'
                self._first_serve(self.nodes[name], keys_only=True)
            for name in names:  # the verifier first: the drafters connect to its address
                self._first_serve(self.nodes[name])
        self.watcher = threading.Thread(target=self._watch, name="pipespec-ray-watch", daemon=True)
        self.watcher.start()
        return {**self.status(), "placed_s": placed_s}

    def _first_serve(self, node: _Node, keys_only: bool = False) -> None:
        """:meth:`_serve` (or only :meth:`_public_key`), with an actor that cannot start on its host said in
        words."""
        try:
            if keys_only:  # the first call to a new actor also waits for its process to start on its host
                self._public_key(node, self.config["launch"]["ready_timeout_s"])
            else:
                self._serve(node)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as exc:
            first = str(exc).strip().splitlines()[-1][:500] if str(exc).strip() else type(exc).__name__
            raise RayLaunchError(f"the {node.name} actor did not start on its host ({first}); every host needs the "
                                 "same Python, pipespec and Ray versions (pip install 'pipespec[ray]')") from None

    def _public_key(self, node: _Node, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        """Ask ``node`` for its public key (made on its host); a drafter's new key goes into the verifier's
        allow-list. Whether the key changed (an actor back on another host has a new pair)."""
        public = self.ray.get(node.actor.public_key.remote(node.role), timeout=timeout_s)
        changed, node.public = public != node.public, public
        verifier = self.nodes.get("verifier")
        if changed and node.role == "drafter" and verifier is not None and verifier.state == "serving":
            self.ray.get(verifier.actor.allow.remote({f"drafters/{node.name}.key": public}), timeout=CALL_TIMEOUT_S)
        return changed

    def _peers(self, role: str) -> dict[str, bytes]:
        return peer_keys(role, [(n.name, n.role, n.public) for n in self.nodes.values()], self.client_key)

    def _serve(self, node: _Node) -> None:
        """Start ``node``'s serve call (the verifier first picks its ports: its old ones where it can)."""
        node.facts = self.ray.get(node.actor.facts.remote(), timeout=CALL_TIMEOUT_S)
        self._public_key(node)
        if node.role == "verifier":
            self.verifier_ports = self.ray.get(node.actor.free_ports.remote(2, self.verifier_ports),
                                               timeout=CALL_TIMEOUT_S)
            ip = node.facts["ip"]
            self.config["verifier"]["endpoint"] = f"tcp://{ip}:{self.verifier_ports[0]}"
            self.config["client"]["endpoint"] = f"tcp://{ip}:{self.verifier_ports[1]}"
            self.config["drafter"]["verifier_endpoint"] = None
        # the node's typed config, built here once; Ray pickles it into the call with the public keys it needs
        node.serving = node.actor.serve.remote(node.role, typed(self.config), self._peers(node.role),
                                               self.config["launch"]["link_delay_ms"] if node.role == "drafter" else 0)
        node.state = "serving"
        self._event(node.name, "serving", ip=node.facts["ip"], pid=node.facts["pid"])

    # ---------------------------------------------------------------------------------------- supervision

    def _watch(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                calls = {n.serving: n for n in self.nodes.values() if n.serving is not None}
            if not calls:
                self.stopping.wait(WATCH_S)
                continue
            done, _ = self.ray.wait(list(calls), num_returns=1, timeout=WATCH_S)
            for ref in done:
                if not self.stopping.is_set():
                    self._ended(calls[ref], ref)

    def _ended(self, node: _Node, ref: Any) -> None:
        """A node's serve call ended while the run goes on: find out why and bring the node back."""
        ray = self.ray
        node.serving = None
        try:
            ray.get(ref)
            why, actor_died = "stopped by itself", False
        except ray.exceptions.RayActorError as exc:
            why, actor_died = f"its actor died ({type(exc).__name__})", True
        except ray.exceptions.RayTaskError as exc:
            why, actor_died = str(exc.cause if exc.cause is not None else exc).splitlines()[0], False
        except Exception as exc:  # anything else from Ray: treat as the node's failure
            why, actor_died = repr(exc), False
        if node.repointing and not actor_died:
            node.repointing = False  # stopped to follow a verifier that moved: not a failure
            self._event(node.name, "following the verifier")
            threading.Thread(target=self._revive, args=(node, time.monotonic()), daemon=True).start()
            return
        self._event(node.name, "ended", why=why)
        node.restarts += 1
        limit = self.config["launch"]["max_restarts"]
        # Ray counts actor restarts itself; a node that failed with its actor alive (its model would not load, its
        # serve loop raised) is served again here, at most max_restarts times (NODE_RETRIES without a limit)
        if not actor_died and node.restarts > (NODE_RETRIES if limit == -1 else limit):
            node.state, node.error = "failed", why
            self._event(node.name, "given up", restarts=node.restarts - 1)
            return
        node.state = "restarting"
        threading.Thread(target=self._revive, args=(node, time.monotonic()), daemon=True).start()

    def _revive(self, node: _Node, since: float) -> None:
        """Wait until Ray has the actor back (a restart, maybe on another host), then serve again."""
        ray = self.ray
        deadline = since + self.config["launch"]["ready_timeout_s"]
        while not self.stopping.is_set() and time.monotonic() < deadline:
            try:
                with self.lock:
                    old = (self.config["verifier"]["endpoint"], node.public)
                    self._serve(node)
                    moved = node.role == "verifier" and (self.config["verifier"]["endpoint"], node.public) != old
                self._event(node.name, "back", seconds=round(time.monotonic() - since, 3), host=node.facts["ip"])
                if moved:
                    self._repoint_drafters()
                return
            except ray.exceptions.ActorDiedError:
                break  # dead for good (a restarting actor is "unavailable", not "died")
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError,
                    ray.exceptions.RayActorError):
                time.sleep(0.5)
        node.state = "failed"
        node.error = node.error or "Ray did not bring its actor back (restarts used up, or no host can hold it)"
        self._event(node.name, "given up", restarts=node.restarts)

    def _repoint_drafters(self) -> None:
        """The verifier came back at another address (or with another key): restart each drafter's serve call
        towards it."""
        for node in list(self.nodes.values()):
            if node.role == "drafter" and node.state == "serving":
                node.repointing = True
                try:
                    self.ray.get(node.actor.stop.remote(), timeout=CALL_TIMEOUT_S)
                except Exception:  # a drafter that cannot stop is restarted by its own watch
                    log.warning("%s did not stop to follow the verifier", node.name)

    # ------------------------------------------------------------------------------------------- control

    def scale(self, drafters: int) -> dict[str, Any]:
        """Run ``drafters`` drafters: start new ones (each placed on its own) or stop the newest."""
        from ray.util.placement_group import remove_placement_group

        if drafters < 0:
            raise ValueError(f"drafters must be ≥ 0, got {drafters}")
        with self.lock:
            current = [n for n in self.nodes.values() if n.role == "drafter"]
        _, drafter_at = placements(self.config)
        if drafters > len(current):
            taken = {n.name for n in current}
            new = [n for n in node_names(drafters + len(taken)) if n not in taken][: drafters - len(current)]
            check_feasible(self.ray.nodes(), dict.fromkeys(new, drafter_at))
            for name in new:
                group = self._group([drafter_at], "PACK")
                seconds = self._wait_placed(group, [name], self.config["launch"]["ready_timeout_s"])
                self._event(name, "placed", seconds=round(seconds, 3))
                with self.lock:
                    self.nodes[name] = _Node(name, "drafter", self._actor(name, drafter_at, group, 0), drafter_at,
                                             group, 0)
                    self._first_serve(self.nodes[name], keys_only=True)
                    self._first_serve(self.nodes[name])
        for node in sorted(current, key=lambda n: (len(n.name), n.name))[drafters:][::-1]:
            with self.lock:
                self.nodes.pop(node.name)
                node.serving = None
            self._stop_node(node)
            verifier = self.nodes.get("verifier")
            if verifier is not None:  # its key leaves the verifier's allow-list with it
                with contextlib.suppress(Exception):
                    self.ray.get(verifier.actor.disallow.remote([f"drafters/{node.name}.key"]), timeout=CALL_TIMEOUT_S)
            if node.bundle == 0 and node.group is not None and len(node.group.bundle_specs) == 1:
                remove_placement_group(node.group)  # a drafter scaled in earlier had a group of its own
            self._event(node.name, "removed")
        return self.status()

    def _stop_node(self, node: _Node) -> None:
        """Stop the node for good: it removes its folder and keys from its host, then its actor is killed."""
        with contextlib.suppress(Exception):  # dead or unreachable: killed below (a host that left took its keys)
            self.ray.get(node.actor.close.remote(), timeout=CALL_TIMEOUT_S)
        self.ray.kill(node.actor, no_restart=True)
        node.state = "stopped"

    def status(self) -> dict[str, Any]:
        """The client address and each node's role, state, host facts and restarts; the run's events."""
        with self.lock:
            nodes = {n.name: {"actor": n.actor_name, "role": n.role,
                              "state": n.state, "restarts": n.restarts, "error": n.error,
                              "placement": n.placement.describe(), **n.facts} for n in self.nodes.values()}
            verifier = self.nodes.get("verifier")
            server_key = verifier.public if verifier is not None else None
        return {"client_address": self.config["client"]["endpoint"], "server_key": server_key, "nodes": nodes,
                "events": list(self.events)}

    def node_failures(self) -> list[dict[str, str]]:
        """The nodes that failed for good: ``{name, role, error}`` each (the launcher's liveness check)."""
        with self.lock:
            return [{"name": n.name, "role": n.role, "error": n.error or "failed"}
                    for n in self.nodes.values() if n.state == "failed"]

    def log_tail(self, name: str, lines: int = 25) -> str:
        node = self.nodes.get(name)
        if node is None:
            return ""
        try:
            return self.ray.get(node.actor.log_tail.remote(lines), timeout=CALL_TIMEOUT_S)
        except Exception as exc:  # the actor is gone: say so instead of a log
            return f"(no log: {type(exc).__name__})"

    def stop(self) -> None:
        """Stop every node (each removes its keys from its host) and free their placement groups."""
        from ray.util.placement_group import remove_placement_group

        self.stopping.set()
        if self.watcher is not None:
            self.watcher.join(5)
        groups = {id(n.group): n.group for n in self.nodes.values() if n.group is not None}
        for node in list(self.nodes.values()):
            self._stop_node(node)
        for group in groups.values():
            with contextlib.suppress(Exception):  # already gone with its hosts
                remove_placement_group(group)


def node_env() -> dict[str, str]:
    """The environment of every node actor: :data:`runtime.node_setup.NODE_ENV` and this process's ``PIPESPEC_*``
    settings (log level, profile folder), never its secrets."""
    import os

    from runtime.config import HTTP_API_KEY_ENV
    from runtime.node_setup import NODE_ENV
    from runtime.security import SECRET_ENV

    private = {SECRET_ENV, HTTP_API_KEY_ENV}
    ours = {k: v for k, v in os.environ.items() if k.startswith("PIPESPEC_") and k not in private}
    return {**NODE_ENV, **ours}


class RayCluster:
    """The ``ray`` launcher (:class:`runtime.launchers.base.Launcher`), over a :class:`Controller` actor."""

    def __init__(self, config: dict[str, Any], options: LaunchOptions | None = None):
        options = options or LaunchOptions()
        options.refuse_process_options("ray", "starts nodes as Ray actors")
        options.refuse_hooks("ray")
        self.config = config
        self.run_dir = make_run_dir(options.run_dir)
        self.env = {**node_env(), **(options.env or {})}
        self.ray = connect(config["launch"]["ray_address"], config["launch"]["ray_insecure"])
        self.controller: Any = None
        self.last_status: dict[str, Any] = {}
        self.placed_s: float | None = None

    @property
    def drafter_count(self) -> int:
        return drafter_count(self.config)

    async def start(self) -> Started:
        """Place and start the nodes (blocking on Ray, so in a worker thread)."""
        await asyncio.to_thread(self._start)
        return Started(client_address=self.last_status["client_address"],
                       client_keys=keyfiles.client_keys(Path(self.run_dir) / "keys",
                                                        self.config["security"]["client_key"]),
                       drafters=self.drafter_count,
                       config=self.config, run_dir=self.run_dir, verifier_may_move=True)

    def _start(self) -> None:
        """Make the client's key pair here, create the controller on this host (the config without its ``http``
        section) and have it place and start the nodes."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from runtime.ray_node import make_pair, write_keys

        name = self.config["launch"]["ray_name"]
        try:
            self.ray.get_actor(name, namespace=NAMESPACE)
            raise RayLaunchError(f"a pipespec run named {name!r} is already on this Ray cluster: stop it, or give "
                                 "this one another launch.ray_name")
        except ValueError:
            pass  # no such actor: the name is free
        here = self.ray.get_runtime_context().get_node_id()
        self.controller = self.ray.remote(Controller).options(
            name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=16, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            runtime_env={"env_vars": self.env},
        ).remote(without_http(self.config), self.env)
        keys_dir = Path(self.run_dir) / "keys"
        keys_dir.mkdir(mode=0o700, exist_ok=True)
        client_public = make_pair(keys_dir / "clients", self.config["security"]["client_key"])
        started = unwrapped(self.ray, self.controller.start.remote(self.drafter_count, client_public))
        write_keys(keys_dir, {"server.key": started["server_key"]})
        self.placed_s = started.pop("placed_s")
        self.last_status = started

    def status(self, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        self.last_status = self.ray.get(self.controller.status.remote(), timeout=timeout_s)
        return self.last_status

    def check_alive(self, roles: list[str] | None = None) -> None:
        """Raise :class:`RayLaunchError` when a node (of ``roles``) failed for good."""
        failures = self.ray.get(self.controller.node_failures.remote(), timeout=CALL_TIMEOUT_S)
        for failure in failures:
            if not roles or failure["role"] in roles:
                raise RayLaunchError(f"{failure['name']}: {failure['error']}")

    def log_tail(self, name: str, lines: int = 25) -> str:
        return self.ray.get(self.controller.log_tail.remote(name, lines), timeout=CALL_TIMEOUT_S)

    def nodes(self) -> dict[str, NodeState]:
        """Each node's role, state and host (address, name, CPU, cores, GPU), as the controller knows them now."""
        keys = ("ip", "host", "cpu", "cores", "gpu")
        return {name: NodeState(name, n["role"], n["state"], {k: n.get(k) for k in keys})
                for name, n in self.status()["nodes"].items()}

    def node_hardware(self) -> dict[str, dict[str, Any]]:
        """Each node's host: address, name, CPU, cores, GPU."""
        return {name: dict(node.host) for name, node in self.nodes().items()}

    def scale(self, drafters: int) -> dict[str, Any]:
        """Run ``drafters`` drafters (:meth:`Controller.scale`); returns the new status."""
        self.last_status = unwrapped(self.ray, self.controller.scale.remote(check_drafters(drafters)))
        return self.last_status

    async def wait_ready(self, client: Any) -> dict[str, Any]:
        """Until the verifier answers and every drafter started is in its pool (``launch.ready_timeout_s``)."""
        timeout_s = self.config["launch"]["ready_timeout_s"]

        async def check() -> None:
            await asyncio.to_thread(self.check_alive)

        pong = await wait_until_serving(
            client, self.drafter_count, timeout_s, check,
            lambda: f"nodes not ready after {timeout_s} s; verifier log:\n{self.log_tail('verifier')}")
        await asyncio.to_thread(self.status)  # where each node runs now
        return pong

    async def client_address(self) -> str:
        """Where the verifier takes clients now (a restart may have moved it to another host)."""
        return (await asyncio.to_thread(self.status))["client_address"]

    def client_server_key(self) -> bytes | None:
        """The verifier's public key as of the last :meth:`status` (a verifier back on another host made a new
        pair there); :func:`runtime.launchers.following` hands it to the client with the new address."""
        return self.last_status.get("server_key")

    def stop(self, timeout_s: float = 30.0, keep_logs: bool = False) -> None:
        import shutil

        if self.controller is not None:
            try:
                self.ray.get(self.controller.stop.remote(), timeout=timeout_s)
            except Exception as exc:  # the cluster went away: its actors went with it
                log.warning("stopping the Ray nodes: %s", exc)
            self.ray.kill(self.controller, no_restart=True)
            self.controller = None
        if not keep_logs:
            shutil.rmtree(Path(self.run_dir) / "keys", ignore_errors=True)


def unwrapped(ray: Any, ref: Any, timeout_s: float | None = None) -> Any:
    """``ray.get(ref)``, with an error the actor raised re-raised as itself (a launch error, a config error) instead
    of Ray's wrapper, and a dead controller said in words."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if exc.cause is not None else exc
        if isinstance(cause, (LaunchError, ConfigError, ValueError)):
            raise RayLaunchError(str(cause)) from None
        raise RayLaunchError(f"the pipespec controller failed: {cause}") from None
    except ray.exceptions.RayActorError as exc:
        raise RayLaunchError(f"the pipespec controller is gone ({type(exc).__name__}): its launcher stopped or "
                             "its host left the cluster") from None


def check_drafters(drafters: int) -> int:
    from runtime.config_schema import MAX_LAUNCHED_DRAFTERS

    if isinstance(drafters, bool) or not isinstance(drafters, int) or not 0 <= drafters <= MAX_LAUNCHED_DRAFTERS:
        raise ConfigError(f"--drafters: an integer in [0, {MAX_LAUNCHED_DRAFTERS}], got {drafters!r}")
    return drafters


def scale(drafters: int, address: str | None = "auto", name: str | None = None, insecure: bool = False
          ) -> dict[str, Any]:
    """Run ``drafters`` drafters in the pipespec run ``name`` (``launch.ray_name``) on the Ray cluster at
    ``address`` (``"auto"``: the one this host knows), from any process; returns the run's status. A cluster
    without token authentication is refused unless ``insecure`` (``--ray-insecure``)."""
    check_drafters(drafters)
    ray = connect(address or "auto", insecure)
    name = name or DEFAULT_NAME
    try:
        controller = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise RayLaunchError(f"no pipespec run named {name!r} on this Ray cluster: start one with `pipespec serve "
                             "--ray`, or give its launch.ray_name with --name") from None
    return unwrapped(ray, controller.scale.remote(drafters))


def status_lines(status: dict[str, Any]) -> list[str]:
    """One line per node: name, role, state, host and placement."""
    lines = []
    for name, node in status["nodes"].items():
        where = f"{node.get('host', '?')} ({node.get('ip', '?')})"
        lines.append(f"{name}: {node['role']} {node['state']} on {where}, restarts {node['restarts']}, placement "
                     f"{node['placement']}" + (f", error: {node['error']}" if node.get("error") else ""))
    return lines


def scale_command(drafters: int, address: str | None, name: str | None, insecure: bool = False) -> int:
    """``pipespec scale --drafters N``: prints the run's nodes afterwards."""
    status = scale(drafters, address or "auto", name, insecure)
    for line in status_lines(status):
        print(line)
    return 0
