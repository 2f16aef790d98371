"""Ray closed by default: the Ray backend joins only a cluster that asks for Ray's token authentication.

A Ray cluster runs whatever code anyone who reaches its ports submits (the ShadowRay class, CVE-2023-48022), and in
Ray 2.60 ``ray start --head`` turns token authentication on only when a token already exists on that host. So
before a run places anything, the launcher makes one call without a token to the cluster's GCS and to every live
host's raylet (and, for a ``ray://`` address, to the Ray Client server): each must answer ``UNAUTHENTICATED``. A
cluster that answers, or that cannot be checked, is refused with the fix named, unless ``launch.ray_insecure: true``
says the operator means it (then each open endpoint is logged as a warning).

``launch.ray_address: null`` starts a private Ray of this process (``ray.init(address="local")``) with token
authentication and a fresh token of its own, instead of joining whatever ``ray start`` cluster runs on this host;
``auto`` joins that one, checked like any other.

The probe calls are plain gRPC (TLS with Ray's own certificates when ``RAY_USE_TLS`` is set), so this process's
token, if any, is never sent with them.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pipespec.ray")

#: Environment variables of Ray's token authentication (ray/_private/authentication).
AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
#: One probe call waits at most this long (a host that does not answer is "not checked", so refused).
PROBE_TIMEOUT_S = 10.0
#: The gRPC methods probed: cheap reads every server of that kind has (their request messages are empty).
GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
RAYLET_METHOD = "/ray.rpc.NodeManagerService/GetSystemConfig"
CLIENT_METHOD = "/ray.rpc.RayletDriver/ClusterInfo"
#: What to do, said in every refusal.
FIX = ("start the cluster with Ray's token authentication: `ray get-auth-token --generate` on one host, the same "
       "token on every host (~/.ray/auth_token, or RAY_AUTH_TOKEN), and RAY_AUTH_MODE=token in the environment of "
       "every `ray start` and of this process (docs/ray.md, \"Start the cluster\"); to join it anyway, set "
       "launch.ray_insecure: true")


class RayAuthError(RuntimeError):
    """The cluster does not ask for token authentication (or could not be checked) and ray_insecure is off."""


@dataclass(frozen=True)
class Probe:
    """One endpoint of the cluster and how it answered a call without a token."""

    what: str  # "GCS 10.0.0.1:6379", "raylet 10.0.0.2:41233", "Ray Client 10.0.0.1:10001"
    verdict: str  # "token": refused us (UNAUTHENTICATED); "open": answered; "unchecked": anything else
    detail: str = ""


def verdict_of(code_name: str | None) -> str:
    """The verdict for a gRPC status code name (None: the call succeeded)."""
    if code_name is None:
        return "open"
    return "token" if code_name == "UNAUTHENTICATED" else "unchecked"


def _channel(address: str) -> Any:
    import grpc

    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        from ray._common.tls_utils import load_certs_from_env

        chain, key, ca = load_certs_from_env()
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(
            certificate_chain=chain, private_key=key, root_certificates=ca))
    return grpc.insecure_channel(address)


def probe(what: str, address: str, method: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Call ``method`` (an empty request) at ``address`` without a token; how the server answered."""
    import grpc

    channel = _channel(address)
    try:
        call = channel.unary_unary(method, request_serializer=lambda _: b"", response_deserializer=lambda b: b)
        call(None, timeout=timeout_s)
        return Probe(f"{what} {address}", "open")
    except grpc.RpcError as exc:
        code = exc.code()
        name = code.name if code is not None else "UNKNOWN"
        return Probe(f"{what} {address}", verdict_of(name), f"{name}: {exc.details()}")
    finally:
        channel.close()


def endpoints(gcs_address: str | None, nodes: Iterable[dict[str, Any]], client_address: str | None = None
              ) -> list[tuple[str, str, str]]:
    """``(what, host:port, method)`` for the cluster's GCS, each live host's raylet and the Ray Client server."""
    out = []
    if client_address:
        out.append(("Ray Client", client_address, CLIENT_METHOD))
    if gcs_address:
        out.append(("GCS", gcs_address, GCS_METHOD))
    for node in nodes:
        if node.get("Alive") and node.get("NodeManagerPort"):
            out.append(("raylet", f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}", RAYLET_METHOD))
    return out


def decide(probes: list[Probe], insecure: bool) -> list[str]:
    """The warnings to log for a cluster whose endpoints answered ``probes``; :class:`RayAuthError` naming the fix
    when one answered without a token or could not be checked, unless ``insecure``."""
    if not probes:
        raise RayAuthError(f"the Ray cluster showed no endpoint to check for token authentication; {FIX}")
    open_ = [p for p in probes if p.verdict == "open"]
    unchecked = [p for p in probes if p.verdict == "unchecked"]
    if not open_ and not unchecked:
        return []
    said = []
    if open_:
        said.append("answers without a token: " + ", ".join(p.what for p in open_))
    if unchecked:
        said.append("could not be checked: " + ", ".join(f"{p.what} ({p.detail})" for p in unchecked))
    if insecure:
        return [f"launch.ray_insecure: joining a Ray cluster without token authentication ({'; '.join(said)}): "
                "whoever reaches its ports runs code on every host, reads the prompts and controls the nodes"]
    raise RayAuthError("the Ray cluster does not ask for token authentication, so anyone who reaches its ports "
                       f"runs code on every host ({'; '.join(said)}). To fix: {FIX}")


def check_cluster(ray: Any, insecure: bool, client_address: str | None = None,
                  prober: Callable[..., Probe] = probe) -> list[Probe]:
    """Probe the cluster this process is connected to and apply :func:`decide` (warnings logged)."""
    try:
        gcs = ray.get_runtime_context().gcs_address
    except Exception:  # a Ray Client connection has no GCS address here: the client server is probed instead
        gcs = None
    try:
        nodes = ray.nodes()
    except Exception:
        nodes = []
    probes = [prober(*e) for e in endpoints(gcs, nodes, client_address)]
    for warning in decide(probes, insecure):
        log.warning("%s", warning)
    return probes


def private_cluster_env(insecure: bool, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Before ``ray.init(address="local")``: the environment changes that start the private cluster with token
    authentication and a token of its own (its GCS and raylets inherit them). ``RAY_AUTH_MODE=disabled`` is
    refused unless ``insecure``; a token the operator configured (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``) is
    kept."""
    environ = os.environ if environ is None else environ
    mode = environ.get(AUTH_MODE_ENV, "").lower()
    if mode and mode != "token":
        if insecure:
            return {}
        raise RayAuthError(f"{AUTH_MODE_ENV}={environ[AUTH_MODE_ENV]} starts the local Ray without token "
                           f"authentication: unset it (pipespec then starts it with a token of its own), or set "
                           "launch.ray_insecure: true")
    changes = {AUTH_MODE_ENV: "token"}
    if not environ.get(TOKEN_ENV) and not environ.get(TOKEN_PATH_ENV):
        changes[TOKEN_ENV] = secrets.token_hex(32)  # as `ray get-auth-token --generate` makes them
    return changes


def start_private(ray: Any, insecure: bool, **init: Any) -> None:
    """``ray.init`` of a new local cluster of this process, token authentication on (:func:`private_cluster_env`)."""
    changes = private_cluster_env(insecure)
    os.environ.update(changes)
    if changes:
        from ray._raylet import Config

        Config.initialize("")  # as Ray's own _enable_token_auth: this process reads the mode again
    ray.init(address="local", **init)
