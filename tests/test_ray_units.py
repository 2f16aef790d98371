"""The Ray backend's parts that need no Ray cluster: placements, the feasibility check, the keys each node gets,
the config a Ray launch runs, ports, the CLI's ``--ray`` and ``scale``, what happens without Ray installed, and the
client following a verifier to a new address. (The backend itself runs in tests/test_ray.py, the ray tier.)"""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest
import zmq
import zmq.asyncio
import zmq.auth

from runtime import cli, keys, launch, launch_args
from runtime.client import AsyncClient
from runtime.config import ConfigError, load_config
from runtime.node_setup import node_names
from runtime.placement import Placement, PlacementError, parse_placement
from runtime.ray_launch import RayLaunchError, check_feasible, peer_keys, ray_config, without_http
from runtime.ray_node import NodeHost, free_ports, make_pair, write_keys
from shared.protocol import Ping, Pong, decode, encode

pytestmark = pytest.mark.unit


def test_placements_parse_into_bundles_and_bad_ones_name_the_key() -> None:
    p = parse_placement({"num_cpus": 2, "resources": {"gpu_host": 1}, "labels": {"zone": "b"}}, "drafter.placement")
    assert p == Placement(2.0, 0.0, {"gpu_host": 1.0}, {"zone": "b"})
    assert p.bundle() == {"CPU": 2.0, "gpu_host": 1.0}
    assert parse_placement(None, "verifier.placement", "cuda").bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert parse_placement(None, "verifier.placement", "cpu").bundle() == {"CPU": 1.0}
    bad = {
        "verifier.placement.gpus: unknown placement key": {"gpus": 1},
        "drafter.placement.num_cpus: must be a number ≥ 0": {"num_cpus": -1},
        "is not a custom resource name": {"resources": {"GPU": 1}},
        "asks for nothing": {"num_cpus": 0},
        "is not a label": {"labels": {"zone": True}},
        "a mapping of": [1],
    }
    for message, value in bad.items():
        with pytest.raises(PlacementError, match=message):
            parse_placement(value, "drafter.placement" if "num_cpus" in message else "verifier.placement")


def test_the_config_checks_placements_and_the_ray_only_keys() -> None:
    with pytest.raises(ConfigError, match=r"drafter.placement.resources"):
        load_config("cpu.yaml", {"drafter.placement": {"resources": {"CPU": 1}}})
    with pytest.raises(ConfigError, match=r"launch.link_delay_ms: only the ray backend"):
        load_config("cpu.yaml", {"launch.link_delay_ms": 5})
    with pytest.raises(ConfigError, match=r"launch.backend: must be one of process, inproc, ray"):
        load_config("cpu.yaml", {"launch.backend": "ssh"})
    config = load_config("cpu.yaml", {"launch.backend": "ray", "launch.link_delay_ms": 5})
    assert ray_config(config)["security"]["curve"] == "on", "every link of a Ray launch runs CURVE"
    with pytest.raises(ConfigError, match=r"verifier.allow_remote"):
        ray_config(load_config("cpu.yaml", {"launch.backend": "ray", "security.curve": "off"}))


def _host(address: str, resources: dict, labels: dict | None = None, alive: bool = True) -> dict:
    return {"Alive": alive, "NodeManagerAddress": address, "Resources": {"CPU": 1.0, **resources},
            "Labels": {"ray.io/node-id": "x", **(labels or {})}}


def test_a_placement_no_live_host_can_hold_is_refused_with_what_hosts_offer() -> None:
    hosts = [_host("10.0.0.1", {"gpu_host": 1.0}), _host("10.0.0.2", {"cpu_host": 2.0}, {"zone": "b"}),
             _host("10.0.0.3", {"tpu_host": 1.0}, alive=False)]
    fits = {"verifier": Placement(resources={"gpu_host": 1.0}), "drafter": Placement(labels={"zone": "b"})}
    check_feasible(hosts, fits)
    for wanted in (Placement(resources={"tpu_host": 1.0}), Placement(num_cpus=2.0, labels={"zone": "b"}),
                   Placement(labels={"zone": "c"})):
        with pytest.raises(RayLaunchError, match=r"no host of the Ray cluster can hold the drafter2 node") as err:
            check_feasible(hosts, {"drafter2": wanted})
        assert "10.0.0.2: CPU 1, cpu_host 2, label zone=b" in str(err.value)
        assert "drafter.placement" in str(err.value) and "10.0.0.3" not in str(err.value)


def test_each_node_makes_its_own_pair_and_is_handed_only_public_keys(tmp_path) -> None:
    """A node's pair is made in its own 0700 folder (secret 0600) and kept across a restart of its actor on that
    host; the controller hands each node only public keys: the verifier every drafter's and the client's, a drafter
    the verifier's; a secret or a name leaving the folder is refused; close() removes the folder."""
    hosts = {name: NodeHost(name) for name in ("verifier", "drafter", "drafter2")}
    keys_of = {name: host.public_key("verifier" if name == "verifier" else "drafter") for name, host in hosts.items()}
    assert len(set(keys_of.values())) == 3 and all(len(k) == 40 for k in keys_of.values())
    assert hosts["drafter"].public_key("drafter") == keys_of["drafter"], "the pair made once is kept"
    secret = hosts["verifier"].keys_dir / "server.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600 and hosts["verifier"].work_dir.stat().st_mode & 0o777 == 0o700
    client = make_pair(tmp_path / "client" / "clients", "client")
    nodes = [(name, "verifier" if name == "verifier" else "drafter", key) for name, key in keys_of.items()]
    verifier = peer_keys("verifier", nodes, ("client", client))
    assert verifier == {"drafters/drafter.key": keys_of["drafter"], "drafters/drafter2.key": keys_of["drafter2"],
                        "clients/client.key": client}
    assert peer_keys("drafter", nodes, ("client", client)) == {"server.key": keys_of["verifier"]}
    with pytest.raises(RayLaunchError, match="verifier's public key"):
        peer_keys("drafter", nodes[1:], ("client", client))
    write_keys(tmp_path / "node", verifier)
    assert keys.allowed_count(tmp_path / "node" / "drafters") == 2
    assert keys.public_key(tmp_path / "node", "client", "client") == client
    z85_secret = zmq.auth.load_certificate(secret)[1]
    for name, data in {"../outside.key": client, str(tmp_path / "outside.key"): client,
                       "server.key_secret": z85_secret, "server.key": b"not a key"}.items():
        with pytest.raises(ValueError, match=r"leaves the keys folder|only public keys|40 z85 characters"):
            write_keys(tmp_path / "evil", {name: data})
    assert not (tmp_path / "outside.key").exists() and not list((tmp_path / "evil").rglob("*_secret"))
    for host in hosts.values():
        host.close()
        assert not host.work_dir.exists(), "a node stopped for good leaves no keys on its host"


def test_a_node_folder_is_private_and_refused_when_others_can_open_it(tmp_path, monkeypatch) -> None:
    import tempfile

    from runtime.ray_node import node_folder
    from runtime.security import RunDirError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = node_folder("pipespec:drafter:ab12")
    assert node_folder("pipespec:drafter:ab12") == first, "a restarted actor finds its folder again"
    assert first.parent.stat().st_mode & 0o777 == 0o700 and ":" not in first.name
    first.parent.chmod(0o755)
    with pytest.raises(RunDirError, match="open to other users"):
        node_folder("pipespec:drafter:cd34")


def test_the_http_section_stays_on_the_launching_host() -> None:
    config = load_config("cpu.yaml", {"launch.backend": "ray", "http.api_key": "k" * 32,
                                      "http.host": "127.0.0.1"})
    for shipped in (without_http(config), ray_config(config)):
        assert "k" * 32 not in repr(shipped) and shipped["http"]["api_key"] is None
    assert config["http"]["api_key"] == "k" * 32, "the launching host's own config keeps it"


def test_free_ports_keep_a_free_preferred_port_and_skip_a_taken_one() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        first = free_ports("127.0.0.1", 1)[0]
        ports = free_ports("127.0.0.1", 2, [first, taken])
    assert ports[0] == first and taken not in ports and len(set(ports)) == 2


def test_node_names_match_the_process_backend() -> None:
    assert node_names(3) == ["drafter", "drafter2", "drafter3"]
    assert node_names(2, start=2) == ["drafter3", "drafter4"]


def test_ray_flags_set_the_backend_and_are_refused_where_they_mean_nothing() -> None:
    args = cli.parser().parse_args(["generate", "--ray", "10.0.0.1:6379", "--prompt", "x"])
    config = cli.build_config(args)
    assert config["launch"]["backend"] == "ray" and config["launch"]["ray_address"] == "10.0.0.1:6379"
    args = cli.parser().parse_args(["serve", "--ray"])
    config = cli.build_config(args, serve=True)
    assert config["launch"]["backend"] == "ray" and config["launch"]["ray_address"] is None
    assert launch_args.ray_overrides(None) == {}
    assert launch_args.launcher_overrides("ray", "h:1") == {"launch.backend": "ray", "launch.ray_address": "h:1"}
    assert launch.main(["--role", "verifier", "--ray"]) == 2


def test_scale_checks_its_count_before_reaching_for_a_cluster(capsys) -> None:
    assert cli.main(["scale", "--drafters", "99", "--ray", "10.0.0.1:1"]) == 2
    assert "--drafters: an integer in [0, 16]" in capsys.readouterr().err


def test_without_ray_the_ray_commands_say_what_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as where it is not installed
    assert cli.main(["generate", "--ray", "--prompt", "x", "--max-new-tokens", "1"]) == 2
    assert cli.main(["scale", "--drafters", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("the ray backend needs Ray: pip install 'pipespec[ray]'") == 2 and "Traceback" not in err


async def _answer_pings(sock: zmq.asyncio.Socket, target: str, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if await sock.poll(50):
            frames = await sock.recv_multipart()
            if isinstance(decode(frames[1:]), Ping):
                await sock.send_multipart([frames[0], *encode(Pong(drafter_connected=False, target=target))])


async def test_a_client_follows_the_verifier_to_its_new_address(tmp_path) -> None:
    """AsyncClient.retarget: the next request goes to the verifier at the new address."""
    ctx = zmq.asyncio.Context()
    old, new = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    old.bind(f"ipc://{tmp_path}/old.ipc")
    new.bind(f"ipc://{tmp_path}/new.ipc")
    stop = asyncio.Event()
    peers = [asyncio.create_task(_answer_pings(old, "old", stop)), asyncio.create_task(_answer_pings(new, "new", stop))]
    try:
        async with AsyncClient(f"ipc://{tmp_path}/old.ipc", timeout_s=10) as client:
            assert (await client.ping())["target"] == "old"
            await client.retarget(f"ipc://{tmp_path}/new.ipc")
            assert client.address.endswith("new.ipc")
            assert (await client.ping())["target"] == "new"
    finally:
        stop.set()
        await asyncio.gather(*peers)
        old.close(0)
        new.close(0)
        ctx.term()


def test_a_node_host_serves_the_typed_config_it_was_handed(tiny, tmp_path) -> None:
    """What a Ray actor runs, without Ray: the controller's typed config, pickled as Ray pickles a call argument,
    and the run's key files; the host writes its keys, builds the node with the one ``build_node`` and serves. A
    verifier and a drafter host on loopback over CURVE give transformers' greedy output."""
    import pickle
    import threading

    from conftest import tiny_config

    from runtime.config import typed
    from testkit.tiny_models import reference_greedy

    target = tiny("llama", "target")
    ports = free_ports("127.0.0.1", 2)
    config = ray_config(load_config(tiny_config(target, target), {
        "verifier.endpoint": f"tcp://127.0.0.1:{ports[0]}", "client.endpoint": f"tcp://127.0.0.1:{ports[1]}"}))
    shipped = pickle.loads(pickle.dumps(typed(config)))  # what Ray hands the actor
    hosts = {role: NodeHost(role) for role in ("verifier", "drafter")}
    public = {role: host.public_key(role) for role, host in hosts.items()}
    client = make_pair(tmp_path / "client" / "clients", "client")
    nodes = [(role, role, key) for role, key in public.items()]
    done: dict[str, object] = {}

    def serve(role: str) -> None:
        try:
            peers = pickle.loads(pickle.dumps(peer_keys(role, nodes, ("client", client))))
            assert all(len(v) == 40 for v in peers.values()), "only public keys cross"
            done[role] = hosts[role].serve(role, shipped, peers)
        except Exception as exc:  # reported below
            done[role] = exc

    threads = [threading.Thread(target=serve, args=(role,), daemon=True) for role in hosts]
    for t in threads:
        t.start()
    write_keys(tmp_path / "client", {"server.key": public["verifier"]})

    async def main():
        async with AsyncClient(config["client"]["endpoint"], timeout_s=60,
                               curve=keys.client_keys(tmp_path / "client")) as client:
            for _ in range(300):
                if len((await client.ping(timeout_s=5.0)).get("drafters") or []) >= 1:
                    break
                await asyncio.sleep(0.2)
            return await client.generate(token_ids=[5, 17, 33], max_new_tokens=8, eos_token_ids=[])

    try:
        result = asyncio.run(main())
    finally:
        for host in hosts.values():
            host.close()
        for t in threads:
            t.join(30)
    assert result.token_ids == reference_greedy(target, [5, 17, 33], 8)
    assert result.metrics["drafts"] > 0
    assert done == {"verifier": 0, "drafter": 0}, done
