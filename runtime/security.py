"""What a config's nodes use to keep strangers out: CURVE per link (with the keys of ``security.keys_dir``), the
launcher's private run folder, and the per-run secret its drafter shows in ``hello`` on links without CURVE.

Every function takes a config :func:`runtime.config.load_config` returned (merged with its declared defaults), so
the keys are read without fallbacks: their defaults are declared once (``shared/config_sections.py``).

See docs/deployment.md, "Security", for the setup and the threat model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import zmq

from runtime.keys import KeysError, peer_keys, public_key, server_keys, server_public_key

# SECRET_ENV travels in the environment, not argv: ``ps`` shows every user a process's arguments, while
# ``/proc/PID/environ`` is readable by its own user only. The constants live in shared/ because the nodes name them.
from shared.transport import (
    CLIENT_DOMAIN,
    DRAFTER_DOMAIN,
    SECRET_ENV,
    ClientKeys,
    DrafterLinks,
    ServerKeys,
    VerifierLinks,
    curve_wanted,
    secret_matches,
)

__all__ = ["CLIENT_DOMAIN", "DRAFTER_DOMAIN", "SECRET_ENV", "KeysError", "secret_matches"]

log = logging.getLogger("pipespec.security")

#: The z85 public key of the run's own HTTP gateway, given to the verifier process in its environment: the launcher
#: draws the pair per run (:func:`new_gateway`) and keeps the secret half in its own memory.
GATEWAY_ENV = "PIPESPEC_HTTP_GATEWAY"


class RunDirError(ValueError):
    """A run folder that other users could open."""


def drafter_link(config: dict[str, Any]) -> str:
    """The endpoint the drafter connects to."""
    return config["drafter"]["verifier_endpoint"] or config["verifier"]["endpoint"]


def curve_links(config: dict[str, Any]) -> dict[str, bool]:
    """Which links run CURVE: ``verifier`` (the drafter socket the verifier binds), ``drafter`` (the endpoint the
    drafter connects to) and ``client`` (the client socket)."""
    mode = config["security"]["curve"]
    return {
        "verifier": curve_wanted(mode, config["verifier"]["endpoint"]),
        "drafter": curve_wanted(mode, drafter_link(config)),
        "client": curve_wanted(mode, config["client"]["endpoint"]),
    }


def _keys_dir(config: dict[str, Any]) -> str:
    keys_dir = config["security"]["keys_dir"]
    if not keys_dir:
        raise KeysError("CURVE is on but security.keys_dir is not set: run `python -m runtime.keys init DIR` and set "
                        "security.keys_dir: DIR")
    return keys_dir


def verifier_keys(config: dict[str, Any]) -> ServerKeys | None:
    """The verifier's keys when either of its sockets runs CURVE (raises ``KeysError`` when they are missing)."""
    links = curve_links(config)
    return server_keys(_keys_dir(config)) if links["verifier"] or links["client"] else None


def drafter_keys(config: dict[str, Any]) -> ClientKeys | None:
    """The drafter's keys (``security.drafter_key``) when its link runs CURVE."""
    if not curve_links(config)["drafter"]:
        return None
    return peer_keys(_keys_dir(config), "drafter", config["security"]["drafter_key"])


def client_keys_for(config: dict[str, Any]) -> ClientKeys | None:
    """The launcher's client keys (``security.client_key``) when the client link runs CURVE."""
    if not curve_links(config)["client"]:
        return None
    return peer_keys(_keys_dir(config), "client", config["security"]["client_key"])


# ------------------------------------------------------------------------------------------ run folder, secret


def private_run_dir(path: str | os.PathLike, make_private: bool = False) -> str:
    """Create ``path`` 0700 if it is missing; refuse one that is not ours (someone may have made it first, in
    ``/tmp``) or that other users can open (its ipc sockets would then be open to them). ``make_private``: a folder
    of ours that others can open is made 0700 instead (the launcher's own default folder)."""
    folder = Path(path).expanduser()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise RunDirError(f"run folder {str(folder)!r} belongs to another user (uid {info.st_uid}): use a folder "
                          "of your own, or leave --run-dir out")
    if make_private and stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(folder, 0o700)
        info = folder.stat()
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise RunDirError(f"run folder {str(folder)!r} is open to other users (mode "
                          f"{stat.S_IMODE(info.st_mode):04o}); its ipc sockets would be too: `chmod 700 {folder}`, "
                          "or leave --run-dir out")
    return str(folder)


#: The launcher also keeps the secret in its run folder (0600 in a 0700 folder), so a node started later with
#: ``--role ... --run-dir`` of the same folder can join: whoever can open the folder is already this user.
SECRET_FILE = "run_secret"


def new_secret() -> str:
    return secrets.token_hex(32)


def write_secret(run_dir: str, secret: str) -> None:
    fd = os.open(Path(run_dir) / SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)


def read_secret(run_dir: str) -> str | None:
    """The secret a launcher left in ``run_dir``, or None."""
    try:
        return (Path(run_dir) / SECRET_FILE).read_text().strip() or None
    except OSError:
        return None


def run_secret() -> str | None:
    """The per-run secret this process was given (``$PIPESPEC_RUN_SECRET``), or None; read by the process entry
    point only (``runtime.launch``), which passes it on as a parameter."""
    return os.environ.get(SECRET_ENV) or None


def verifier_links(config: dict[str, Any], run_secret: str | None = None,
                   http_gateway: str | None = None) -> VerifierLinks:
    """Everything the verifier needs to keep strangers out, resolved here so the node reads no keys or env;
    ``run_secret``: the launcher's, asked of drafters on a link without CURVE (None: none is asked);
    ``http_gateway``: the z85 public key of the run's HTTP gateway (:func:`new_gateway`), let in on the client link
    and allowed to name tenants there."""
    curve = curve_links(config)
    keys = verifier_keys(config)
    gateways = gateway_keys(config) if curve["client"] else frozenset()
    if curve["client"] and http_gateway and keys is not None:
        keys = dataclasses.replace(keys, extra={CLIENT_DOMAIN: frozenset({http_gateway.encode()})})
        gateways |= {http_gateway}
    return VerifierLinks(curve_drafters=curve["verifier"], curve_clients=curve["client"],
                         keys=keys, run_secret=None if curve["verifier"] else run_secret, gateways=gateways)


def new_gateway(config: dict[str, Any]) -> ClientKeys | None:
    """A CURVE key pair drawn for this run's HTTP server, where the client link runs CURVE (None: it does not): the
    verifier lets its public key in and lets it name tenants (:data:`GATEWAY_ENV`); the secret never leaves this
    process. So the client key an operator hands out (``security.client_key``) names no tenant but its own."""
    if not curve_links(config)["client"]:
        return None
    public, secret = zmq.curve_keypair()
    return ClientKeys(server_public_key(_keys_dir(config)), public, secret)


def run_gateway() -> str | None:
    """The run's HTTP gateway public key this (verifier) process was given (``$PIPESPEC_HTTP_GATEWAY``), or None;
    read by the process entry point only."""
    return os.environ.get(GATEWAY_ENV) or None


def tenant_link_problem(config: dict[str, Any]) -> str | None:
    """Why ``config``'s tenants would not be kept apart (None: they are): an ``http.api_keys_file`` (several
    tenants) with a client link on tcp without CURVE, where every local user who reaches the port is a trusted
    client that may name any tenant in ``generate.tenant``, past every API key."""
    endpoint = str(config["client"]["endpoint"])
    if not config["http"]["api_keys_file"] or not endpoint.startswith("tcp://") or curve_links(config)["client"]:
        return None
    return (f"http.api_keys_file: the client link client.endpoint {endpoint!r} runs without CURVE, so every local "
            "user who reaches it may run requests as any tenant, past the API keys: use an ipc:// client endpoint "
            "(the default, in the private run folder), or security.curve: on with security.keys_dir "
            "(docs/security.md)")


def log_gateways(config: dict[str, Any], gateways: frozenset[str], http_gateway: str | None = None) -> None:
    """Say at start who may name a request's tenant on the client link: everyone (no CURVE), or which keys."""
    if not curve_links(config)["client"]:
        log.info("client link without CURVE: every client that reaches it may name a request's tenant")
        return
    named = [f"{n.strip()} ({public_key(_keys_dir(config), 'client', n.strip()).decode()[:8]}…)"
             for n in (config["security"]["gateway_clients"] or "").split(",") if n.strip()]
    if http_gateway:
        named.append(f"the run's HTTP server (a key of this run, {http_gateway[:8]}…)")
    log.info("gateway clients, which may name a request's tenant: %s", ", ".join(named) or "none")


def gateway_keys(config: dict[str, Any]) -> frozenset[str]:
    """The z85 public keys of ``security.gateway_clients`` (null: none), the clients besides the run's own HTTP
    server that may name a request's tenant under CURVE."""
    names = config["security"]["gateway_clients"]
    if not names:  # the run's own HTTP server has a key of its own (verifier_links): no other client is one
        return frozenset()
    return frozenset(public_key(_keys_dir(config), "client", n.strip()).decode()  # z85 text, as ZAP's User-Id
                     for n in names.split(",") if n.strip())


def drafter_links(config: dict[str, Any], run_secret: str | None = None) -> DrafterLinks:
    """Everything the drafter needs to be let in: CURVE keys where its link runs CURVE, else ``run_secret``."""
    keys = drafter_keys(config)
    return DrafterLinks(keys=keys, key_name=config["security"]["drafter_key"] if keys else None,
                        run_secret=None if keys else run_secret)
