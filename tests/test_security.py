"""Security: the keys CLI, CURVE with pyzmq's own ``zmq.auth`` (one allow-list per role), the private run folder and
the per-run secret on ipc, and the config rules. Real sockets, a real authenticator, real node processes."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
import zmq
import zmq.asyncio
from conftest import tiny_config

from runtime import security
from runtime.client import AsyncClient, PipespecError
from runtime.config import ConfigError, check_security, load_config, typed
from runtime.delay_proxy import serve as serve_proxy
from runtime.keys import add, client_keys, init, peer_keys, server_keys
from runtime.launch import Cluster, LaunchError, cluster, serve_http
from runtime.launchers import LaunchOptions
from shared.models import load_tokenizer, tokenizer_id
from shared.protocol import Capabilities, Generate, Hello, decode, encode
from shared.transport import Authenticator, ClientKeys, bind_router, connect_dealer
from testkit.tiny_models import reference_greedy
from weights import install

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 33, 2, 60]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def keys(tmp_path) -> Path:
    folder = tmp_path / "keys"
    init(folder, clients=["client"], drafters=["drafter"])
    return folder


def stranger(keys: Path) -> ClientKeys:
    """A well-formed key pair that no allow-list holds, with the right server key."""
    public, secret = zmq.curve_keypair()
    return ClientKeys(server_keys(keys).public, public, secret)


# ---------------------------------------------------------------------------------------------------- keys CLI


def run_keys(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "runtime.keys", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO_ROOT)


def test_keys_cli_writes_private_key_folders_and_never_overwrites(tmp_path):
    folder = tmp_path / "k"
    done = run_keys("init", str(folder), "--clients", "alice", "bob", "--drafters", "gpu1")
    assert done.returncode == 0, done.stderr
    expected = {"server.key", "server.key_secret", "clients/alice.key", "clients/alice.key_secret",
                "clients/bob.key", "clients/bob.key_secret", "drafters/gpu1.key", "drafters/gpu1.key_secret"}
    assert {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} == expected
    assert len(done.stdout.splitlines()) == len(expected) and "wrote secret key" in done.stdout
    for sub in (folder, folder / "clients", folder / "drafters"):
        assert stat.S_IMODE(sub.stat().st_mode) == 0o700, sub
    for secret in folder.rglob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    public, secret = zmq.auth.load_certificate(folder / "clients" / "alice.key_secret")
    assert len(public) == len(secret) == 40  # z85 of 32-byte Curve25519 keys
    assert zmq.auth.load_certificate(folder / "clients" / "alice.key") == (public, None)

    before = (folder / "server.key_secret").read_bytes()
    again = run_keys("init", str(folder))
    assert again.returncode == 2 and "exists" in again.stderr and "--force" in again.stderr
    assert (folder / "server.key_secret").read_bytes() == before
    assert not (folder / "clients" / "client.key").exists()  # a refusal writes nothing

    added = run_keys("add-drafter", "gpu2", "--dir", str(folder))
    assert added.returncode == 0 and (folder / "drafters" / "gpu2.key_secret").is_file()
    assert run_keys("add-client", "alice", "--dir", str(folder)).returncode == 2
    forced = run_keys("init", str(folder), "--force")
    assert forced.returncode == 0
    assert (folder / "server.key_secret").read_bytes() != before
    assert run_keys("add-client", "../evil", "--dir", str(folder)).returncode == 2
    assert "add-client" in run_keys("--help").stdout


# ------------------------------------------------------------------------------------ CURVE at the socket level


def reaches(ctx: zmq.Context, router: zmq.Socket, endpoint: str, curve: ClientKeys | None, wait_ms: int) -> bool:
    """Whether a message from a DEALER with ``curve`` keys arrives at ``router`` within ``wait_ms``."""
    dealer = connect_dealer(ctx, endpoint, curve)
    # Bounded send: a DEALER whose handshake was refused has no pipe, so a plain send would block for ever (this
    # test hung a whole suite run when the refusal happened before the send).
    dealer.setsockopt(zmq.SNDTIMEO, wait_ms)
    try:
        try:
            dealer.send(b"hello")
        except zmq.Again:
            return False
        if not router.poll(wait_ms):
            return False
        router.recv_multipart()
        return True
    finally:
        dealer.close(linger=0)


def test_curve_allow_lists_are_separate_per_role(keys):
    ctx = zmq.Context()
    auth = Authenticator(ctx, server_keys(keys))
    try:
        ends = {role: f"tcp://127.0.0.1:{free_port()}" for role in ("drafter", "client")}
        routers = {"drafter": bind_router(ctx, ends["drafter"], auth=auth, domain=security.DRAFTER_DOMAIN),
                   "client": bind_router(ctx, ends["client"], auth=auth, domain=security.CLIENT_DOMAIN)}
        good = {"drafter": peer_keys(keys, "drafter", "drafter"), "client": client_keys(keys)}
        wrong_server = ClientKeys(zmq.curve_keypair()[0], good["client"].public, good["client"].secret)
        for role in routers:
            assert reaches(ctx, routers[role], ends[role], good[role], 5000), f"{role} key refused on its socket"
        other = {"drafter": "client", "client": "drafter"}
        for role in routers:
            for name, keys_used in ((f"{other[role]} key", good[other[role]]), ("unknown key", stranger(keys)),
                                    ("no CURVE", None), ("wrong server key", wrong_server)):
                assert not reaches(ctx, routers[role], ends[role], keys_used, 700), f"{name} got into {role} socket"
        for role in routers:  # still serving the right keys after the refusals
            assert reaches(ctx, routers[role], ends[role], good[role], 5000)
        for sock in routers.values():
            sock.close(linger=0)
    finally:
        auth.close()
        ctx.destroy(linger=0)


def test_bind_without_curve_on_a_network_address_names_curve(keys):
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="CURVE"):
            bind_router(ctx, "tcp://0.0.0.0:5555")
    finally:
        ctx.destroy(linger=0)


@contextlib.contextmanager
def proxy_thread(listen_port: int, connect_port: int, delay_s: float, tap=None):
    """The delay proxy on its own event loop in a thread (the tests' sockets here are synchronous)."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def main():
        holder["stop"] = asyncio.Event()
        holder["server"] = await serve_proxy(("127.0.0.1", listen_port), ("127.0.0.1", connect_port), delay_s, tap)
        started.set()
        await holder["stop"].wait()
        holder["server"].close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:  # connections still open
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10), "the proxy did not start"
    try:
        yield
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("curve", [True, False], ids=["curve", "plain-control"])
def test_curve_traffic_is_unreadable_on_the_wire(keys, curve):
    """A tap on the link sees the marker in plain text (the control) and never with CURVE."""
    marker = b"PROMPT-SECRET-8d41"
    seen = bytearray()
    ctx = zmq.Context()
    auth = Authenticator(ctx, server_keys(keys)) if curve else None
    try:
        port, proxy_port = free_port(), free_port()
        router = bind_router(ctx, f"tcp://127.0.0.1:{port}", auth=auth, domain=security.CLIENT_DOMAIN)
        with proxy_thread(proxy_port, port, 0.0, tap=lambda _d, data: seen.extend(data)):
            dealer = connect_dealer(ctx, f"tcp://127.0.0.1:{proxy_port}", client_keys(keys) if curve else None)
            dealer.send_multipart(encode(Generate(request_id=1, params={}, prompt=marker.decode())))
            assert router.poll(5000), "nothing arrived through the proxy"
            _, *body = router.recv_multipart()
            assert decode(body).prompt == marker.decode()
            dealer.close(linger=0)
        router.close(linger=0)
    finally:
        if auth is not None:
            auth.close()
        ctx.destroy(linger=0)
    assert len(seen) > len(marker)
    assert (marker in seen) is not curve


async def test_delay_proxy_delays_each_way_and_keeps_order():
    async def echo(reader, writer):
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
        writer.close()

    backend = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = backend.sockets[0].getsockname()[1]
    delay = 0.04
    proxy = await serve_proxy(("127.0.0.1", 0), ("127.0.0.1", port), delay)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    writer.write(b"x")
    assert await asyncio.wait_for(reader.readexactly(1), 10) == b"x"
    assert loop.time() - t0 >= 2 * delay * 0.95  # a round trip crosses the proxy twice (a lower bound only)
    payload = b"".join(i.to_bytes(4, "big") for i in range(20_000))  # many chunks, each delayed, none reordered
    for i in range(0, len(payload), 1000):
        writer.write(payload[i:i + 1000])
        await asyncio.sleep(0)
    assert await asyncio.wait_for(reader.readexactly(len(payload)), 20) == payload
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # the end crossed the proxy, which then closed
    writer.close()
    proxy.close()
    backend.close()
    with pytest.raises(ValueError):
        await serve_proxy(("127.0.0.1", 0), ("127.0.0.1", port), -1.0)


# ------------------------------------------------------------------------------------------------ clusters


async def hello_reply(endpoint: str, curve: ClientKeys | None, wait_ms: int, **fields) -> dict | None:
    """Say hello on a drafter socket as a stranger would; the reply, or None when none came within ``wait_ms``."""
    ctx = zmq.asyncio.Context()
    sock = connect_dealer(ctx, endpoint, curve)
    try:
        hello = {"drafter_type": "stranger", "tokenizer_id": "not-the-target", "capabilities": Capabilities(), **fields}
        await sock.send_multipart(encode(Hello(**hello)))
        if not await sock.poll(wait_ms):
            return None
        reply = decode(await sock.recv_multipart())
        return {"type": reply.TYPE, **reply.to_dict()}
    finally:
        sock.close(linger=0)
        ctx.term()


def test_curve_cluster_over_tcp_is_exact_and_admits_only_its_keys(tiny, keys):
    target = tiny("llama")
    expected = reference_greedy(target, PROMPT, 24)
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    config["verifier"]["endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    config["client"]["endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    config["security"] = {"curve": "on", "keys_dir": str(keys)}
    add(keys, "client", "other")  # an allowed client that is not a gateway
    api_keys = keys.parent / "api-keys"
    api_keys.write_text("alice:alice-" + "k" * 20 + "\n")
    api_keys.chmod(0o600)
    drafter_end, client_end = config["verifier"]["endpoint"], config["client"]["endpoint"]

    async def main():
        out = {}
        async with cluster(config) as client:
            assert client.curve == client_keys(keys)
            # only the run's own HTTP gateway key, drawn for this run, may name the tenant: not the client key an
            # operator hands out, nor another client key
            gateway = client.started.gateway_keys
            assert gateway is not None and gateway.public not in {client_keys(keys).public}
            async with AsyncClient(client_end, timeout_s=30, curve=gateway) as gw:
                out["result"] = await gw.generate(token_ids=PROMPT, max_new_tokens=24, eos_token_ids=[],
                                                  tenant="alice")
            try:
                await client.generate(token_ids=PROMPT, max_new_tokens=2, tenant="alice")
            except PipespecError as exc:
                out["client key names a tenant"] = exc
            async with AsyncClient(client_end, timeout_s=30, curve=peer_keys(keys, "client", "other")) as other:
                try:
                    await other.generate(token_ids=PROMPT, max_new_tokens=2, tenant="alice")
                except PipespecError as exc:
                    out["other names a tenant"] = exc
                out["other as itself"] = await other.generate(token_ids=PROMPT, max_new_tokens=2)
            for name, curve in (("no keys", None), ("unknown key", stranger(keys)),
                                ("drafter key", peer_keys(keys, "drafter", "drafter"))):
                async with AsyncClient(client_end, timeout_s=1.0, curve=curve) as other:
                    try:
                        await other.ping(timeout_s=1.0)
                        out[name] = "answered"
                    except TimeoutError:
                        out[name] = "nothing"
            # on the drafter socket: a drafter key is heard (and refused for its tokenizer: the control), a client
            # key, an unknown key and no CURVE get nothing at all
            out["hello drafter key"] = await hello_reply(drafter_end, peer_keys(keys, "drafter", "drafter"), 5000)
            for name, curve in (("client key", client_keys(keys)), ("unknown key", stranger(keys)),
                                ("no CURVE", None)):
                out[f"hello {name}"] = await hello_reply(drafter_end, curve, 1000)
            # the run's HTTP server talks to the verifier with the gateway key: a tenant's API key is served
            served = copy.deepcopy(client.config)
            served["http"].update(host="127.0.0.1", port=free_port(), api_keys_file=str(api_keys))
            async with serve_http(client, served) as http, openai.AsyncOpenAI(
                    base_url=f"{http.url}/v1", api_key="alice-" + "k" * 20, max_retries=0, timeout=60) as oai:
                out["http alice"] = await oai.completions.create(model=http.model_name, prompt=PROMPT,
                                                                 max_tokens=4, temperature=0)
            out["after"] = await client.generate(token_ids=PROMPT, max_new_tokens=24, eos_token_ids=[])
            out["pong"] = await client.ping()
            out["log"] = client.cluster.log_tail("verifier", 400)
        return out, gateway

    out, gateway = asyncio.run(main())
    assert out["result"].token_ids == expected == out["after"].token_ids
    assert out["result"].metrics["drafts"] > 0 and out["after"].metrics["drafts"] > 0
    assert out["no keys"] == out["unknown key"] == out["drafter key"] == "nothing"
    assert out["http alice"].usage.completion_tokens == 4
    for refused in (out["other names a tenant"], out["client key names a tenant"]):
        assert refused.code == "unauthorized" and "gateway" in str(refused)
    assert len(out["other as itself"].token_ids) == 2
    assert out["hello drafter key"] is not None and out["hello drafter key"]["code"] == "tokenizer_mismatch"
    assert out["hello client key"] is out["hello unknown key"] is out["hello no CURVE"] is None
    assert out["pong"]["drafter_connected"], "the real drafter must still be connected"
    assert "refused a peer" in out["log"] and security.DRAFTER_DOMAIN in out["log"]
    # which keys are gateways is said at start: the run's HTTP server's only
    said = [line for line in out["log"].splitlines() if "gateway clients" in line]
    assert len(said) == 1 and "the run's HTTP server" in said[0] and gateway.public.decode()[:8] in said[0]


def test_ipc_hello_without_the_run_secret_is_refused(tiny):
    target = tiny("llama")
    expected = reference_greedy(target, PROMPT, 20)
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    tok = tokenizer_id(load_tokenizer(str(target)))

    async def main():
        out = {}
        async with cluster(config) as client:
            nodes = client.cluster
            out["mode"] = stat.S_IMODE(os.stat(nodes.run_dir).st_mode)
            out["secret"] = secret = nodes.run_secret
            pid = client.cluster.processes["verifier"].pid
            out["argv"] = Path(f"/proc/{pid}/cmdline").read_bytes()
            out["environ"] = Path(f"/proc/{pid}/environ").read_bytes()
            end = client.config["verifier"]["endpoint"]
            for name, extra in (("none", {}), ("wrong", {"run_secret": "0" * 64}), ("empty", {"run_secret": ""})):
                out[name] = await hello_reply(end, None, 5000, tokenizer_id=tok, **extra)
            # the right secret passes the check: the hello is then judged on its tokenizer (refused: the control)
            out["right"] = await hello_reply(end, None, 5000, run_secret=secret)
            out["result"] = await client.generate(token_ids=PROMPT, max_new_tokens=20, eos_token_ids=[])
            out["pong"] = await client.ping()
            out["log"] = nodes.log_tail("verifier", 400)
        return out

    out = asyncio.run(main())
    assert out["mode"] == 0o700
    secret = out["secret"]
    assert secret and len(secret) == 64
    assert secret.encode() not in out["argv"], "the secret must not be visible in ps"
    assert f"{security.SECRET_ENV}={secret}".encode() in out["environ"]
    for name in ("none", "wrong", "empty"):
        assert out[name] is not None and out[name]["code"] == "unauthorized", (name, out[name])
    assert out["right"]["code"] == "tokenizer_mismatch"
    assert out["result"].token_ids == expected and out["result"].metrics["drafts"] > 0
    assert out["pong"]["drafter_connected"]
    assert "refused a hello" in out["log"]


def test_a_run_folder_others_can_open_is_refused(tiny, tmp_path):
    config = load_config(tiny_config(tiny("llama"), None))
    shared_dir = tmp_path / "shared-run"
    shared_dir.mkdir(mode=0o755)
    os.chmod(shared_dir, 0o755)
    with pytest.raises(LaunchError, match="open to other users"):
        Cluster(config, LaunchOptions(run_dir=str(shared_dir)))
    assert security.private_run_dir(shared_dir, make_private=True) == str(shared_dir)  # the launcher's default
    assert stat.S_IMODE(os.stat(shared_dir).st_mode) == 0o700
    fresh = Cluster(config, LaunchOptions(run_dir=str(tmp_path / "new" / "run")))  # made 0700
    assert stat.S_IMODE(os.stat(fresh.run_dir).st_mode) == 0o700
    assert fresh.run_secret and not fresh.processes
    kept = Path(fresh.run_dir) / security.SECRET_FILE  # for a --role drafter --run-dir joining this run later
    assert kept.read_text() == fresh.run_secret and stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert security.read_secret(fresh.run_dir) == fresh.run_secret


# ------------------------------------------------------------------------------------------------ config rules


@pytest.fixture
def no_downloads(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("load_config tried to fetch a model")

    monkeypatch.setattr(install, "ensure_model", forbidden)


def test_a_drafter_whose_key_is_not_allowed_stops_with_a_clear_error(no_downloads, keys, capsys):
    """The real drafter node against a verifier's drafter socket (the same Authenticator and bind_router) whose
    allow-list lacks its key: it stops with exit status 2 and says which file is missing, instead of retrying."""
    from drafter_node.node import DrafterNode
    from drafter_node.prompt_lookup import PromptLookupDrafter

    (keys / "drafters" / "drafter.key").unlink()  # out of the allow-list; the drafter keeps its pair
    ctx = zmq.Context()
    auth = Authenticator(ctx, server_keys(keys))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = bind_router(ctx, endpoint, auth=auth, domain=security.DRAFTER_DOMAIN)
    config = load_config("prompt_lookup.yaml", {"verifier.endpoint": endpoint, "security.curve": "on",
                                                "security.keys_dir": str(keys), "drafter.profile_s": 0})
    sections = typed(config)
    node = DrafterNode.from_config(sections, drafter=PromptLookupDrafter(sections.drafter, sections.drafter_type),
                                   links=security.drafter_links(config))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", node._loop()))
    try:
        thread.start()
        thread.join(20)
        if thread.is_alive():
            node.stop()
            thread.join(5)
        assert result.get("rc") == 2, "the drafter kept retrying a key the verifier refuses"
        err = capsys.readouterr().err
        assert "refused this drafter's CURVE key" in err and "drafters/drafter.key" in err
        assert not router.poll(0), "a message of the refused drafter reached the verifier's socket"
    finally:
        node.connection.close()
        router.close(linger=0)
        auth.close()
        ctx.destroy(linger=0)


def config_error(overrides: dict) -> str:
    try:
        config = load_config("cpu.yaml", overrides)
    except ConfigError as exc:
        return str(exc)
    pytest.fail(f"accepted: {config['security']} {config['verifier']['endpoint']}")


REMOTE = {"verifier.endpoint": "tcp://0.0.0.0:5555"}


def test_security_config_errors_are_clear(no_downloads, tmp_path):
    assert "security.curve" in config_error({"security.curve": "maybe"})
    message = config_error(REMOTE)
    assert "security.keys_dir" in message and "python -m runtime.keys init" in message
    assert "does not exist" in config_error({**REMOTE, "security.keys_dir": str(tmp_path / "nope")})
    message = config_error({**REMOTE, "security.curve": "off"})
    assert message.startswith("verifier.endpoint") and "CURVE" in message and "allow_remote" in message
    assert "security.keys_dir" in config_error({"security.curve": "on"})  # on: ipc too
    assert "drafter.verifier_endpoint" in config_error({"drafter.verifier_endpoint": "tcp://10.0.0.5:5555"})
    assert "security.drafter_key" in config_error({"security.drafter_key": "../x"})
    assert "security.keys_dir" in config_error({"security.keys_dir": 5})
    assert "unknown key" in config_error({"security.cert": "x"})


def test_security_config_accepts_curve_or_explicit_plain(no_downloads, keys):
    plain = load_config("cpu.yaml", {**REMOTE, "security.curve": "off", "verifier.allow_remote": True})
    assert security.curve_links(plain) == {"verifier": False, "drafter": False, "client": False}
    curve = load_config("cpu.yaml", {**REMOTE, "security.keys_dir": str(keys)})  # no allow_remote needed
    assert security.curve_links(curve) == {"verifier": True, "drafter": True, "client": False}
    assert load_config("cpu.yaml")["security"] == {"curve": "auto", "keys_dir": None, "drafter_key": "drafter",
                                                    "client_key": "client", "gateway_clients": None}
    check_security(load_config("cpu.yaml"))  # ipc, no keys: nothing to load
    # YAML reads a bare on / off as booleans (a config file or --set security.curve=off)
    assert load_config("cpu.yaml", ["security.curve=off"])["security"]["curve"] == "off"
    assert load_config("cpu.yaml", ["security.curve=on", f"security.keys_dir={keys}"])["security"]["curve"] == "on"


def test_check_security_names_the_missing_key_file(no_downloads, keys, tmp_path):
    both_curve = {"verifier.endpoint": "tcp://0.0.0.0:5555", "drafter.verifier_endpoint": "tcp://10.1.1.1:5555",
                  "security.keys_dir": str(keys)}
    config = load_config("cpu.yaml", both_curve)
    check_security(config)
    # a gateway named that the client allow-list lacks
    gateway = load_config("cpu.yaml", {**both_curve, "security.curve": "on", "security.gateway_clients": "client,gw"})
    with pytest.raises(ConfigError, match=r"clients/gw\.key"):
        check_security(gateway, ("verifier",))
    (keys / "drafters" / "drafter.key_secret").unlink()
    with pytest.raises(ConfigError, match="add-drafter drafter"):
        check_security(config)
    check_security(config, ("verifier",))  # the verifier needs only the public keys
    # a drafter host holds just the server's public key and its own pair
    drafter_host = tmp_path / "drafter-host"
    (drafter_host / "drafters").mkdir(parents=True)
    init(tmp_path / "fresh", clients=[], drafters=["gpu"])
    shutil.copy(tmp_path / "fresh" / "server.key", drafter_host)
    shutil.copy(tmp_path / "fresh" / "drafters" / "gpu.key_secret", drafter_host / "drafters")
    there = load_config("cpu.yaml", {**both_curve, "security.keys_dir": str(drafter_host),
                                     "security.drafter_key": "gpu"})
    check_security(there, ("drafter",))
    os.chmod(drafter_host / "drafters" / "gpu.key_secret", 0o644)  # as a careless copy leaves it
    with pytest.raises(ConfigError, match="chmod 600"):
        check_security(there, ("drafter",))
    os.chmod(drafter_host / "drafters" / "gpu.key_secret", 0o600)
    with pytest.raises(ConfigError, match=r"server\.key_secret"):
        check_security(there, ("verifier",))


def test_check_security_refuses_a_cluster_whose_ends_disagree(no_downloads, keys):
    config = load_config("cpu.yaml", {**REMOTE, "drafter.verifier_endpoint": "tcp://127.0.0.1:5555",
                                      "security.keys_dir": str(keys)})
    with pytest.raises(ConfigError, match=r"security\.curve: on"):
        check_security(config)
    check_security(config, ("verifier",))  # each end alone is fine



# ------------------------------------------------------------------------------------------ tenants (issue 43)
def test_a_keys_file_with_a_plain_tcp_client_link_is_refused(no_downloads, keys, tmp_path):
    keys_file = tmp_path / "api-keys"
    keys_file.write_text("alice:" + "a" * 20 + "\nbob:" + "b" * 20 + "\n")
    keys_file.chmod(0o600)
    tcp = {"http.api_keys_file": str(keys_file), "client.endpoint": f"tcp://127.0.0.1:{free_port()}"}
    for curve in ("off", "auto"):  # auto runs no CURVE on loopback
        message = config_error({**tcp, "security.curve": curve})
        assert "client.endpoint" in message and "without CURVE" in message and "ipc://" in message, message
    load_config("cpu.yaml", {"http.api_keys_file": str(keys_file)})  # ipc in the private run folder: fine
    load_config("cpu.yaml", {**tcp, "security.curve": "on", "security.keys_dir": str(keys)})  # CURVE: fine
    load_config("cpu.yaml", {"client.endpoint": tcp["client.endpoint"]})  # no keys file: one user, fine


def test_tenant_ids_are_keyed_hashes_drawn_per_verifier():
    import hashlib

    from shared.protocol import Generate
    from verifier_node.tenancy import TenantRule

    msg = Generate(request_id=1, params={}, prompt="x", tenant="alice")
    one, two = TenantRule(), TenantRule()
    assert one.tenant_of(msg, None) == one.tenant_of(msg, None)  # stable within a run
    assert one.tenant_of(msg, None) != two.tenant_of(msg, None)  # another run, another key
    # not the unsalted hash anyone could recompute from a guessed name
    assert one.tenant_of(msg, None) != hashlib.sha256(b"name:alice").hexdigest()[:32]
    assert len(one.tenant_of(msg, None)) == 32


def test_only_the_runs_own_http_key_and_named_keys_are_gateways(no_downloads, keys, caplog):
    add(keys, "client", "partner")
    curve = {"client.endpoint": f"tcp://127.0.0.1:{free_port()}", "security.curve": "on",
             "security.keys_dir": str(keys)}
    config = load_config("cpu.yaml", curve)
    gateway = security.new_gateway(config)
    assert gateway is not None and gateway.server_public == server_keys(keys).public
    with caplog.at_level("INFO", logger="pipespec.security"):
        links = security.verifier_links(config, http_gateway=gateway.public.decode())
        security.log_gateways(config, links.gateways, gateway.public.decode())
    assert links.gateways == {gateway.public.decode()}  # not security.client_key
    assert links.keys.extra == {security.CLIENT_DOMAIN: frozenset({gateway.public})}
    assert "the run's HTTP server" in caplog.text and gateway.public.decode()[:8] in caplog.text
    named = security.verifier_links(load_config("cpu.yaml", {**curve, "security.gateway_clients": "partner"}))
    assert named.gateways == {peer_keys(keys, "client", "partner").public.decode()}
    assert security.new_gateway(load_config("cpu.yaml")) is None  # ipc: no CURVE, no gateway key to draw


def test_the_authenticator_lets_the_gateway_key_in_and_no_other_stranger(keys):
    """The verifier's client socket with the run's gateway key as an extra key: that key is answered, a stranger
    is not, and the folder's own client keys still are."""
    import dataclasses

    gateway_public, gateway_secret = zmq.curve_keypair()
    server = dataclasses.replace(server_keys(keys), extra={security.CLIENT_DOMAIN: frozenset({gateway_public})})
    ctx = zmq.Context()
    auth = Authenticator(ctx, server)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = bind_router(ctx, endpoint, auth=auth, domain=security.CLIENT_DOMAIN)
    heard = {}
    try:
        for name, curve in (("gateway", ClientKeys(server.public, gateway_public, gateway_secret)),
                            ("client", client_keys(keys)), ("stranger", stranger(keys))):
            dealer = connect_dealer(ctx, endpoint, curve=curve)
            dealer.send(name.encode())
            heard[name] = router.poll(3000 if name != "stranger" else 1000) and router.recv_multipart()[-1]
            dealer.close(linger=0)
    finally:
        router.close(linger=0)
        auth.close()
        ctx.destroy(linger=0)
    assert heard == {"gateway": b"gateway", "client": b"client", "stranger": 0}
