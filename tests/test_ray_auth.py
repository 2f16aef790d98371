"""Ray closed by default, without a Ray cluster: the decision (refuse a cluster that answers without a token, or
that cannot be checked, unless launch.ray_insecure), the probe over real gRPC servers on loopback (one that asks for
a token, one that does not), which endpoints of a cluster are probed, the private local cluster's environment, what
``connect`` does with each address, and the verifier's allow-list taking a drafter's key while it runs (real
ZeroMQ CURVE sockets). The real clusters are in tests/test_ray.py (the ray tier)."""

from __future__ import annotations

import sys
import types
from concurrent import futures

import grpc
import pytest
import zmq

from runtime import ray_auth, ray_launch
from runtime.ray_auth import FIX, Probe, RayAuthError, decide, endpoints, private_cluster_env, probe
from runtime.ray_node import NodeHost, free_ports, make_pair

pytestmark = pytest.mark.unit


def test_a_cluster_that_answers_without_a_token_is_refused_with_the_fix_named() -> None:
    closed = [Probe("GCS 10.0.0.1:6379", "token"), Probe("raylet 10.0.0.2:4100", "token")]
    assert decide(closed, insecure=False) == [] and decide(closed, insecure=True) == []
    for probes, said in (([*closed, Probe("raylet 10.0.0.3:4100", "open")], "answers without a token: raylet "
                          "10.0.0.3:4100"),
                         ([Probe("GCS 10.0.0.1:6379", "unchecked", "UNAVAILABLE: connection refused")],
                          "could not be checked: GCS 10.0.0.1:6379 (UNAVAILABLE"),
                         ([], "showed no endpoint")):
        with pytest.raises(RayAuthError) as err:
            decide(probes, insecure=False)
        message = str(err.value)
        assert said in message and FIX in message
        for fix in ("RAY_AUTH_MODE=token", "ray get-auth-token --generate", "every host", "launch.ray_insecure"):
            assert fix in message
    warnings = decide([Probe("GCS 10.0.0.1:6379", "open")], insecure=True)
    assert len(warnings) == 1 and "launch.ray_insecure" in warnings[0] and "GCS 10.0.0.1:6379" in warnings[0]


def _grpc_server(ask_token: bool) -> tuple[grpc.Server, str]:
    """A gRPC server on loopback answering the GCS method probed, refusing calls without a token if ``ask_token``
    (as Ray's servers do in token mode)."""

    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        if ask_token and not any(k == "authorization" for k, _ in context.invocation_metadata()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing")
        return b""

    service, method = ray_auth.GCS_METHOD.strip("/").split("/")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {
        method: grpc.unary_unary_rpc_method_handler(answer)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_probe_tells_a_server_that_asks_for_a_token_from_one_that_does_not() -> None:
    servers = {ask: _grpc_server(ask) for ask in (True, False)}
    try:
        closed = probe("GCS", servers[True][1], ray_auth.GCS_METHOD, timeout_s=10)
        open_ = probe("GCS", servers[False][1], ray_auth.GCS_METHOD, timeout_s=10)
        other = probe("raylet", servers[True][1], ray_auth.RAYLET_METHOD, timeout_s=10)  # not served there
    finally:
        for server, _ in servers.values():
            server.stop(None)
    nobody = probe("GCS", f"127.0.0.1:{free_ports('127.0.0.1', 1)[0]}", ray_auth.GCS_METHOD, timeout_s=5)
    assert (closed.verdict, open_.verdict, other.verdict, nobody.verdict) == ("token", "open", "unchecked",
                                                                              "unchecked")
    assert "UNAUTHENTICATED" in closed.detail and "UNAVAILABLE" in nobody.detail
    with pytest.raises(RayAuthError, match=r"answers without a token: GCS 127\.0\.0\.1"):
        decide([closed, open_], insecure=False)


def test_every_live_host_is_probed_and_a_ray_client_address_too() -> None:
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.2", "NodeManagerPort": 4100},
             {"Alive": False, "NodeManagerAddress": "10.0.0.3", "NodeManagerPort": 4100},
             {"Alive": True, "NodeManagerAddress": "10.0.0.4", "NodeManagerPort": 4200}]
    assert endpoints("10.0.0.1:6379", nodes) == [("GCS", "10.0.0.1:6379", ray_auth.GCS_METHOD),
                                                ("raylet", "10.0.0.2:4100", ray_auth.RAYLET_METHOD),
                                                ("raylet", "10.0.0.4:4200", ray_auth.RAYLET_METHOD)]
    assert endpoints(None, [], "10.0.0.1:10001") == [("Ray Client", "10.0.0.1:10001", ray_auth.CLIENT_METHOD)]
    seen: list[str] = []
    fake = types.SimpleNamespace(get_runtime_context=lambda: types.SimpleNamespace(gcs_address="10.0.0.1:6379"),
                                 nodes=lambda: nodes)

    def prober(what: str, address: str, method: str) -> Probe:
        seen.append(address)
        return Probe(f"{what} {address}", "open" if address.endswith("4200") else "token")

    with pytest.raises(RayAuthError, match=r"raylet 10.0.0.4:4200"):
        ray_auth.check_cluster(fake, insecure=False, prober=prober)
    assert seen == ["10.0.0.1:6379", "10.0.0.2:4100", "10.0.0.4:4200"]
    assert len(ray_auth.check_cluster(fake, insecure=True, prober=prober)) == 3


def test_the_private_local_cluster_gets_token_auth_and_a_token_of_its_own() -> None:
    first, second = private_cluster_env(False, {}), private_cluster_env(False, {})
    assert first["RAY_AUTH_MODE"] == "token" and len(first["RAY_AUTH_TOKEN"]) == 64
    assert first["RAY_AUTH_TOKEN"] != second["RAY_AUTH_TOKEN"], "a fresh token per run"
    assert private_cluster_env(False, {"RAY_AUTH_TOKEN_PATH": "/t"}) == {"RAY_AUTH_MODE": "token"}
    assert private_cluster_env(False, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x"}) == {"RAY_AUTH_MODE": "token"}
    with pytest.raises(RayAuthError, match="RAY_AUTH_MODE=disabled starts the local Ray without token"):
        private_cluster_env(False, {"RAY_AUTH_MODE": "disabled"})
    assert private_cluster_env(True, {"RAY_AUTH_MODE": "disabled"}) == {}


class _FakeRay(types.ModuleType):
    """``import ray`` for :func:`runtime.ray_launch.connect`: records init and shutdown."""

    def __init__(self) -> None:
        super().__init__("ray")
        self.calls: list[tuple] = []
        self.up = False

    def is_initialized(self) -> bool:
        return self.up

    def init(self, address: str | None = None, **_: object) -> None:
        self.calls.append(("init", address))
        self.up = True

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))
        self.up = False


@pytest.mark.parametrize("address, verdict, insecure, expect", [
    (None, "token", False, [("private",)]),
    ("auto", "token", False, [("init", "auto")]),
    ("10.0.0.1:6379", "open", False, [("init", "10.0.0.1:6379"), ("shutdown",)]),
    ("10.0.0.1:6379", "open", True, [("init", "10.0.0.1:6379")]),
    ("ray://10.0.0.1:10001", "token", False, [("init", "ray://10.0.0.1:10001")]),
])
def test_connect_starts_a_private_cluster_for_null_and_checks_every_other(monkeypatch, address, verdict, insecure,
                                                                           expect) -> None:
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    checked: list[object] = []

    def start_private(ray, insecure_, **_):
        ray.calls.append(("private",))
        ray.up = True

    def check_cluster(ray, insecure_, client=None):
        checked.append(client)
        return decide([Probe("GCS x", verdict)], insecure_)

    monkeypatch.setattr(ray_auth, "start_private", start_private)
    monkeypatch.setattr(ray_auth, "check_cluster", check_cluster)
    if "shutdown" in {c[0] for c in expect}:
        with pytest.raises(ray_launch.RayLaunchError, match="does not ask for token authentication"):
            ray_launch.connect(address, insecure)
    else:
        ray_launch.connect(address, insecure)
    assert fake.calls == expect
    assert checked == ["10.0.0.1:10001" if address and address.startswith("ray://") else None]


def test_the_verifier_takes_a_drafters_key_while_it_runs(tmp_path) -> None:
    """NodeHost.allow adds a public key to the verifier's allow-list; its authenticator lets that key in at the next
    handshake without a restart, and NodeHost.disallow shuts it out again (real CURVE sockets on loopback)."""
    from runtime import keys
    from shared.transport import DRAFTER_DOMAIN, Authenticator, bind_router, connect_dealer

    verifier = NodeHost("verifier")
    server_public = verifier.public_key("verifier")
    for sub in ("drafters", "clients"):
        (verifier.keys_dir / sub).mkdir(mode=0o700)
    drafter_dir = tmp_path / "drafter"
    drafter_public = make_pair(drafter_dir / "drafters", "drafter")
    (drafter_dir / "server.key").write_bytes((verifier.keys_dir / "server.key").read_bytes())
    curve = keys.peer_keys(drafter_dir, "drafter", "drafter")
    ctx = zmq.Context()
    auth = Authenticator(ctx, keys.server_keys(verifier.keys_dir))
    endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    router = bind_router(ctx, endpoint, auth=auth, domain=DRAFTER_DOMAIN)

    def reaches() -> bool:
        dealer = connect_dealer(ctx, endpoint, curve)
        try:
            dealer.send(b"hello")
            return bool(router.poll(1500))
        finally:
            dealer.close(0)
            while router.poll(0):
                router.recv_multipart()

    try:
        assert curve.server_public == server_public
        assert not reaches(), "a key outside the allow-list is refused"
        verifier.allow({"drafters/drafter.key": drafter_public})
        assert reaches(), "the key added while the verifier runs is let in"
        verifier.disallow(["drafters/drafter.key"])
        assert not reaches(), "a key removed is shut out again"
    finally:
        router.close(0)
        auth.close()
        ctx.term()
        verifier.close()
