"""Two hosts for real: the verifier and the drafter run in two Linux network namespaces joined by a veth pair and
talk over tcp with CURVE (``security.curve: auto``: both addresses are non-loopback), through the delaying proxy.
Greedy output stays identical to transformers, and a peer on the drafter's host without a key gets nothing.

Needs root and iproute2 (``ip netns``), as on this project's machines and CI. Unprivileged it skips with the reason;
as root a machine that cannot make namespaces fails it (set ``PIPESPEC_NO_NETNS=1`` to skip it there).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config

from runtime.keys import client_keys, init, peer_keys
from runtime.launch import cluster
from shared.protocol import SCHEMA_VERSION
from testkit.netns import NetnsPair, delay_proxy, netns_pair, unavailable_reason
from testkit.tiny_models import reference_greedy

REPO_ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.netns

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7]]
VERIFIER_PORT, PROXY_PORT = 5555, 6555


@pytest.fixture
def net():
    if os.environ.get("PIPESPEC_NO_NETNS"):
        pytest.skip("PIPESPEC_NO_NETNS is set")
    reason = unavailable_reason()
    if reason and os.geteuid() != 0:  # unprivileged: cannot run here; as root (CI) a missing namespace is a failure
        pytest.skip(f"the two-host test needs network namespaces: {reason}")
    if reason:
        pytest.fail(f"the two-host test needs two network namespaces, and {reason}: run it as root with iproute2, "
                    "or set PIPESPEC_NO_NETNS=1 to skip it on a machine without them")
    with netns_pair() as pair:
        yield pair


def node_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


# A peer on the drafter's host that says hello to the verifier: with no CURVE, with a key no allow-list holds,
# with a client key, and (the control: it must be heard) with the drafter key; it prints what got any reply.
STRANGER = r"""
import json, sys
import msgpack, zmq
job = json.load(sys.stdin)
heard = {}
for name, keys in job["attempts"].items():
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    if keys == "random":
        keys = [job["server"], *[k.decode() for k in zmq.curve_keypair()]]
    if keys:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (k.encode() for k in keys)
    sock.connect(job["endpoint"])
    sock.send(msgpack.packb({"v": job["version"], "type": "hello", "drafter_type": "stranger",
                             "tokenizer_id": "not-the-target", "capabilities": {}}))
    heard[name] = bool(sock.poll(job["wait_ms"][name]))
    sock.close()
print(json.dumps(heard))
"""


def stranger_on(net: NetnsPair, side: str, endpoint: str, keys: Path) -> dict[str, bool]:
    client, drafter = client_keys(keys), peer_keys(keys, "drafter", "drafter")
    job = {
        "endpoint": endpoint, "version": SCHEMA_VERSION, "server": client.server_public.decode(),
        "attempts": {"no CURVE": None, "unknown key": "random",
                     "client key": [k.decode() for k in (client.server_public, client.public, client.secret)],
                     "drafter key": [k.decode() for k in (drafter.server_public, drafter.public, drafter.secret)]},
        "wait_ms": {"no CURVE": 1500, "unknown key": 1500, "client key": 1500, "drafter key": 10_000},
    }
    done = subprocess.run([*net.exec(side), sys.executable, "-c", STRANGER], input=json.dumps(job),
                          capture_output=True, text=True, timeout=60, env=node_env(), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def netns_of(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_two_namespaces_over_curve_tcp(tiny, tmp_path, net):
    target = tiny("llama")
    expected = [reference_greedy(target, p, 24) for p in PROMPTS]
    keys = tmp_path / "keys"
    init(keys, clients=["client"], drafters=["drafter"])
    config = tiny_config(target, tiny("llama", "random"), num_draft_tokens=3)
    config["verifier"]["endpoint"] = f"tcp://{net.a}:{VERIFIER_PORT}"
    config["drafter"]["verifier_endpoint"] = f"tcp://{net.b}:{PROXY_PORT}"  # the proxy on the drafter's host
    config["security"] = {"keys_dir": str(keys)}  # curve: auto, the default

    async def main():
        out = {}
        async with cluster(config, prefix={"verifier": net.exec("a"), "drafter": net.exec("b")}) as client:
            out["ns"] = {role: netns_of(proc.pid) for role, proc in client.cluster.processes.items()}
            out["results"] = await asyncio.gather(*(
                client.generate(token_ids=p, max_new_tokens=24, eos_token_ids=[]) for p in PROMPTS))
            direct = f"tcp://{net.a}:{VERIFIER_PORT}"
            out["direct"] = await asyncio.to_thread(stranger_on, net, "b", direct, keys)
            out["proxied"] = await asyncio.to_thread(stranger_on, net, "b", f"tcp://{net.b}:{PROXY_PORT}", keys)
            out["pong"] = await client.ping()
            out["log"] = client.cluster.log_tail("verifier", 400)
        return out

    with delay_proxy(net, "b", f"{net.b}:{PROXY_PORT}", f"{net.a}:{VERIFIER_PORT}", delay_ms=2):
        out = asyncio.run(main())
    assert out["ns"]["verifier"] == os.stat(f"/run/netns/{net.names['a']}").st_ino
    assert out["ns"]["drafter"] == os.stat(f"/run/netns/{net.names['b']}").st_ino
    assert out["ns"]["verifier"] != out["ns"]["drafter"] != netns_of(os.getpid())
    for result, want in zip(out["results"], expected):
        assert result.token_ids == want
        assert result.metrics["drafts"] > 0, "the drafter in the other namespace never contributed a block"
    for path in ("direct", "proxied"):
        heard = out[path]
        assert heard["drafter key"], f"{path}: the control (a drafter key) was not heard: the check is broken"
        assert not heard["no CURVE"] and not heard["unknown key"] and not heard["client key"], (path, heard)
    assert out["pong"]["drafter_connected"]
    assert "CURVE: drafter link on" in out["log"]
