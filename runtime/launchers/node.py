"""One node, wherever it runs: :func:`build_node` is what every host calls (a node process's main, a Ray actor, a
thread of the in-process launcher), and :func:`run_node_process` is a node process's main
(``python -m runtime.launch --role X``).

A host resolves what differs between hosts (its config dict's run folder, its keys, its secret: the ``links``) and
then builds the node the same way: install named models, build the typed config once, build the node. It serves
with ``node.serve()`` and stops with ``node.stop()`` from any thread.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any, Protocol

from runtime import security
from runtime.config import check_security, fill_run_dir, typed
from runtime.node_setup import LaunchError, node_log_level, prepare_models
from shared.config import Config

ROLES = ("verifier", "drafter")


class Node(Protocol):
    """What a host does with a built node: serve it (in the thread that built it) and stop it (any thread)."""

    def serve(self) -> Any: ...

    def stop(self) -> None: ...


def install_models(config: Config, role: str) -> None:
    """Install the named models a ``role`` node loads (in the foreground, with progress: the node then loads fast)."""
    if role not in ROLES:
        raise LaunchError(f"unknown node role {role!r} (one of {', '.join(ROLES)})")
    plain = config.as_dict()
    prepare_models({**plain, "launch": {**plain["launch"], "start_drafter": role == "drafter"}})


def node_config(config: dict[str, Any], role: str) -> Config:
    """The typed config of a node that got a loaded config dict (a node process), built once, its models
    installed."""
    sections = typed(config)
    install_models(sections, role)
    return sections


def build_node(role: str, config: Config, links: Any, **hooks: Any) -> Node:
    """The verifier or a drafter, loaded and bound/connected: :meth:`VerifierServer.from_config` or
    :meth:`DrafterNode.from_config` with ``links`` (``runtime.security.verifier_links`` / ``drafter_links``).
    ``hooks``: their keyword arguments that tests inject (an acceptance rule, fixed cost curves, …)."""
    if role == "verifier":
        from verifier_node.server import VerifierServer

        return VerifierServer.from_config(config, links=links, **hooks)
    if role == "drafter":
        from drafter_node.node import DrafterNode

        return DrafterNode.from_config(config, links=links, **hooks)
    raise LaunchError(f"unknown node role {role!r} (one of {', '.join(ROLES)})")


def links_for(role: str, config: Config | dict[str, Any], secret: str | None) -> Any:
    """The node's CURVE keys and run secret (what hello shows where a link has no CURVE)."""
    plain = config.as_dict() if isinstance(config, Config) else config
    if role == "verifier":  # with the run's HTTP gateway key, where a process launcher gave one
        gateway = security.run_gateway()
        links = security.verifier_links(plain, secret, gateway)
        security.log_gateways(plain, links.gateways, gateway)  # who may name tenants, said once at start
        return links
    return security.drafter_links(plain, secret)


def run_node_process(config: dict[str, Any], role: str, run_dir: str | None,
                     hooks: dict[str, Any] | None = None) -> int:
    """A node process's main: one node until SIGTERM / SIGINT; ``hooks``: see :func:`build_node`."""
    from shared.signals import stop_on_signals
    from weights.progress import quiet_library_bars

    logging.basicConfig(level=node_log_level(), format=f"%(asctime)s {role} %(levelname)s %(message)s")
    quiet_library_bars()  # a node's output is a log file: no redrawn loading bars in it
    check_security(config, (role,))
    if "{run_dir}" in json.dumps(config):
        try:  # the default folder is ours by name: made private if an older version left it open
            default = os.path.join(tempfile.gettempdir(), f"pipespec-{os.getuid()}")
            run_dir = security.private_run_dir(run_dir or default, make_private=run_dir is None)
        except (security.RunDirError, OSError) as exc:
            raise LaunchError(str(exc)) from None
        config = fill_run_dir(config, run_dir)
    # the secret of the launcher that started this process, or of the launcher whose run folder this node joins
    secret = security.run_secret() or (security.read_secret(run_dir) if run_dir else None)
    sections = node_config(config, role)
    if role == "verifier":
        print(f"verifier: drafters connect to {config['verifier']['endpoint']}; clients to "
              f"{config['client']['endpoint']}", flush=True)
    node = build_node(role, sections, links_for(role, config, secret), **(hooks or {}))
    stop_on_signals(node.stop)
    return int(node.serve() or 0)
