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

from runtime import cli, keys, launch, launch_args
from runtime.client import AsyncClient
from runtime.config import ConfigError, load_config
from runtime.node_setup import node_names
from runtime.placement import Placement, PlacementError, parse_placement
from runtime.ray_launch import RayLaunchError, check_feasible, key_material, ray_config
from runtime.ray_node import free_ports, write_keys
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


def test_each_node_gets_only_the_keys_it_needs_and_writes_them_privately(tmp_path) -> None:
    keys.init(tmp_path / "k", clients=["client"], drafters=["drafter"])
    verifier = key_material(tmp_path / "k", "verifier")
    drafter = key_material(tmp_path / "k", "drafter")
    client = key_material(tmp_path / "k", "client")
    assert set(verifier) == {"server.key", "server.key_secret", "drafters/drafter.key", "clients/client.key"}
    assert set(drafter) == {"server.key", "drafters/drafter.key", "drafters/drafter.key_secret"}
    assert set(client) == {"server.key", "clients/client.key", "clients/client.key_secret"}
    write_keys(tmp_path / "node", drafter)
    assert (tmp_path / "node").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "node" / "drafters" / "drafter.key_secret").stat().st_mode & 0o777 == 0o600
    assert keys.peer_keys(tmp_path / "node", "drafter", "drafter").public == keys.peer_keys(
        tmp_path / "k", "drafter", "drafter").public
    for name in ("../outside.key", str(tmp_path / "outside.key")):  # up and out, or an absolute name
        with pytest.raises(ValueError, match=r"leaves the keys folder"):
            write_keys(tmp_path / "evil", {name: b"x"})
    assert not (tmp_path / "outside.key").exists()


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
    from runtime.ray_node import NodeHost
    from testkit.tiny_models import reference_greedy

    target = tiny("llama", "target")
    ports = free_ports("127.0.0.1", 2)
    config = ray_config(load_config(tiny_config(target, target), {
        "verifier.endpoint": f"tcp://127.0.0.1:{ports[0]}", "client.endpoint": f"tcp://127.0.0.1:{ports[1]}"}))
    keys.init(tmp_path / "keys", clients=["client"], drafters=["drafter"])
    shipped = pickle.loads(pickle.dumps(typed(config)))  # what Ray hands the actor
    hosts = {role: NodeHost(role) for role in ("verifier", "drafter")}
    done: dict[str, object] = {}

    def serve(role: str) -> None:
        try:
            done[role] = hosts[role].serve(role, shipped, key_material(tmp_path / "keys", role))
        except Exception as exc:  # reported below
            done[role] = exc

    threads = [threading.Thread(target=serve, args=(role,), daemon=True) for role in hosts]
    for t in threads:
        t.start()
    write_keys(tmp_path / "client", key_material(tmp_path / "keys", "client"))

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
            host.stop()
        for t in threads:
            t.join(30)
    assert result.token_ids == reference_greedy(target, [5, 17, 33], 8)
    assert result.metrics["drafts"] > 0
    assert done == {"verifier": 0, "drafter": 0}, done
