"""The Ray launch backend on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a head
with no CPUs and worker nodes with distinct custom resources and labels, started once for the tier.

Placement lands each node where its config says; greedy output equals transformers' ``generate``; a drafter's
host removed mid-request costs no request and no token, and the drafter comes back on a host added later; a
verifier actor killed is restarted and serves again, drafting resumes, and the HTTP front end answers again;
``pipespec scale`` adds and removes drafters from another process; the docs' recipe (docs/ray.md) runs as written.
The tier's cluster asks for Ray's token authentication, as the docs start it: every node makes its own key pair on
its host and no secret (a node's or the client's secret key, the HTTP API key) is handed to Ray, and the key
folders leave with the nodes; a cluster started without token authentication is refused, with the fix named,
unless ``launch.ray_insecure``.

Run with ``make test-ray`` (it installs the ``ray`` extra); the default ``make test`` leaves this tier out.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import tiny_config
from docs_check import RAY_HEAD, ROOT, commands, parse_ray_start, ray_blocks

from benchmarks.http_overhead import free_port
from runtime.client import PipespecError
from runtime.launch import LaunchError, cluster, serve_http
from runtime.ray_launch import scale
from testkit.ray_hosts import live_drafters, until_drafters, until_served
from testkit.tiny_models import reference_greedy

pytestmark = pytest.mark.ray

PROMPTS = [[5, 17, 33, 2, 60], [7, 8, 9], [100, 3, 44, 12]]
PIPESPEC = [sys.executable, "-c", "import sys; from runtime.cli import main; sys.exit(main())"]
#: docs/ray.md's recipe: its config, its shell commands, and the hosts its `ray start` lines declare (a target host
#: and a drafter host with room for two drafters and a label): the tier's cluster is the one the docs describe.
RECIPE = ray_blocks(ROOT / "docs" / "ray.md")
RECIPE_CONFIG = yaml.safe_load(next(b.text for b in RECIPE if b.lang == "yaml"))
RECIPE_COMMANDS = [t for b in RECIPE if b.lang != "yaml" for t in commands(b.text)]
HEAD, TARGET_START, DRAFT_START = [parse_ray_start(t[1:]) for t in RECIPE_COMMANDS if t[:2] == ["ray", "start"]]
HOSTS = {name: {"num_cpus": start["num_cpus"], "resources": start["resources"], "labels": start["labels"]}
         for name, start in (("target", TARGET_START), ("draft", DRAFT_START))}


@pytest.fixture(scope="module")
def hosts():
    try:
        from testkit.ray_hosts import RayHosts

        assert HEAD["head"] and HEAD["num_cpus"] == 0, "the recipe's head runs no node"
        h = RayHosts(HOSTS)
    except ImportError:
        pytest.fail("the ray tier needs Ray: run it with `make test-ray` (it installs pipespec[ray])")
    print(f"\nRay cluster (head + 2 hosts) up in {h.up_s:.1f} s")
    yield h
    h.shutdown()


def ray_config(tiny, **launch) -> dict:
    """Tiny models, placed as the recipe's config places its nodes."""
    config = tiny_config(tiny("llama"), tiny("llama", "random"))
    for role in ("verifier", "drafter"):
        config[role]["placement"] = RECIPE_CONFIG[role]["placement"]
    config["launch"].update({"backend": "ray", **launch})
    return config


async def generate_all(client, prompts=PROMPTS, n: int = 40):
    return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=n, eos_token_ids=[]) for p in prompts))


#: A cluster of the recipe's hosts started without token authentication (as `ray start --head` does where no token
#: exists on the host), in a process of its own: it prints its address and lives until its stdin closes.
OPEN_CLUSTER = """
import json, sys
from testkit.ray_hosts import RayHosts
hosts = RayHosts(json.loads(sys.argv[1]), auth=False)
print("ADDRESS", hosts.address, flush=True)
sys.stdin.read()
hosts.shutdown()
"""


def _address(proc: subprocess.Popen, timeout_s: float) -> str:
    """The address the open cluster's process prints (past anything Ray prints before it)."""
    import select

    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and select.select([proc.stdout], [], [], left)[0]:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("ADDRESS "):
            return line.split()[1]
    raise AssertionError(f"no address from the open cluster in {timeout_s} s")


def test_a_cluster_without_token_auth_is_refused_unless_ray_insecure(tiny, tmp_path):
    """Run first, before the tier's (token) cluster is up. `pipespec generate --ray ADDRESS` against a cluster that
    answers without a token stops at once with the fix named and starts nothing there; with
    launch.ray_insecure: true it runs, with a warning."""
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["PYTHONPATH"] = str(ROOT)
    log = (tmp_path / "open-cluster.log").open("w")
    head = subprocess.Popen([sys.executable, "-c", OPEN_CLUSTER, json.dumps(HOSTS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    try:
        try:
            address = _address(head, 180)
        except AssertionError:
            raise AssertionError((tmp_path / "open-cluster.log").read_text()[-3000:]) from None
        config = ray_config(tiny)
        (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
        argv = [*PIPESPEC, "generate", "--config", "tiny.yaml", "--ray", address, "--max-new-tokens", "8",
                "--prompt", "def fib(n):"]
        t0 = time.monotonic()
        refused = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        refused_s = time.monotonic() - t0
        insecure = subprocess.run([*argv, "--set", "launch.ray_insecure=true"], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=300)
    finally:
        head.stdin.close()
        try:
            head.wait(120)
        except subprocess.TimeoutExpired:
            head.kill()
        log.close()
    print(f"\nopen cluster refused {refused_s:.1f} s after the start")
    assert refused.returncode == 2, refused.stderr[-3000:]
    for said in ("does not ask for token authentication", "answers without a token: GCS", "RAY_AUTH_MODE=token",
                 "ray get-auth-token --generate", "every host", "launch.ray_insecure: true"):
        assert said in refused.stderr, (said, refused.stderr[-3000:])
    assert "verifier on " not in refused.stderr, "nothing is placed on a refused cluster"
    assert insecure.returncode == 0, insecure.stderr[-3000:]
    assert "verifier on " in insecure.stderr and "launch.ray_insecure: joining a Ray cluster without token" in (
        insecure.stderr), insecure.stderr[-3000:]


def test_no_secret_crosses_ray_and_the_keys_leave_with_the_nodes(hosts, tiny, monkeypatch):
    """On the tier's token cluster: every endpoint refuses a call without a token; each node's secret key is made
    and kept on its host (its folder holds its own pair and its peers' public keys only); what the launching
    process hands Ray carries no secret key and no HTTP API key; the nodes' folders are gone once the run stops."""
    import secrets as secrets_

    import zmq.auth
    from ray.actor import ActorClass, ActorMethod

    from runtime import ray_auth
    from runtime.ray_node import node_folder

    sent: list[str] = []
    for cls in (ActorClass, ActorMethod):
        def recording(self, *args, _original=cls._remote, **kwargs):
            sent.append(repr((args, kwargs.get("args"), kwargs.get("kwargs"))))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "_remote", recording)
    api_key = f"pipespec-test-{secrets_.token_urlsafe(24)}"
    config = ray_config(tiny)
    config["http"] = {"api_key": api_key}
    target = tiny("llama")

    async def main():
        async with cluster(config) as client:
            probes = ray_auth.check_cluster(hosts.ray, insecure=False)
            status = client.cluster.status()
            folders = {name: node_folder(n["actor"], create=False) for name, n in status["nodes"].items()}
            pairs = {name: sorted(str(p.relative_to(f)) for p in f.rglob("*.key*")) for name, f in folders.items()}
            node_secrets = {name: zmq.auth.load_certificate(next(f.rglob("*.key_secret")))
                            for name, f in folders.items()}
            client_dir = os.path.join(client.cluster.run_dir, "keys")
            client_secret = zmq.auth.load_certificate(os.path.join(client_dir, "clients", "client.key_secret"))[1]
            result = await client.generate(token_ids=PROMPTS[0], max_new_tokens=16, eos_token_ids=[])
            return probes, status, folders, pairs, node_secrets, client_secret, result

    probes, status, folders, pairs, node_secrets, client_secret, result = asyncio.run(main())
    assert result.token_ids == reference_greedy(target, PROMPTS[0], 16)
    assert len(probes) >= 4 and {p.verdict for p in probes} == {"token"}, probes  # the GCS and 3 raylets
    assert pairs["verifier"] == ["keys/clients/client.key", "keys/drafters/drafter.key", "keys/server.key",
                                 "keys/server.key_secret"]
    assert pairs["drafter"] == ["keys/drafters/drafter.key", "keys/drafters/drafter.key_secret", "keys/server.key"]
    assert status["server_key"] == node_secrets["verifier"][0]
    everything = "\n".join(sent)
    assert sent and "without_http" not in everything
    for secret in (api_key.encode(), client_secret, *(pair[1] for pair in node_secrets.values())):
        assert secret and secret.decode() not in everything and repr(secret) not in everything
    assert not any(f.exists() for f in folders.values()), "a stopped node leaves no keys on its host"


PRIVATE = """
from runtime import ray_auth
from runtime.ray_launch import connect
ray = connect(None)
probes = ray_auth.check_cluster(ray, False)
print("RESULT", ray.get_runtime_context().gcs_address, ",".join(sorted({p.verdict for p in probes})), flush=True)
ray.shutdown()
"""


def test_ray_address_null_starts_a_private_cluster_with_token_auth(hosts):
    """launch.ray_address: null does not join the cluster this machine runs (the tier's, named by RAY_ADDRESS and
    by Ray's current-cluster file): it starts a Ray of its own, which asks for a token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(PYTHONPATH=str(ROOT), RAY_ADDRESS=hosts.address)
    out = subprocess.run([sys.executable, "-c", PRIVATE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    _, gcs, verdicts = next(line for line in out.stdout.splitlines() if line.startswith("RESULT")).split()
    assert gcs != hosts.address and verdicts == "token", out.stdout


def test_nodes_land_where_their_placement_says_and_output_is_greedy(hosts, tiny):
    target = tiny("llama")

    async def main():
        t0 = time.monotonic()
        async with cluster(ray_config(tiny)) as client:
            ready_s = time.monotonic() - t0
            status = client.cluster.status()
            results = await generate_all(client)
            return status, results, client.cluster.placed_s, ready_s, client.cluster.node_hardware()

    status, results, placed_s, ready_s, hardware = asyncio.run(main())
    print(f"\nplacement group reserved in {placed_s * 1000:.1f} ms; nodes ready {ready_s:.1f} s after the start")
    nodes = status["nodes"]
    assert nodes["verifier"]["node_id"] == hosts.nodes["target"].node_id
    assert nodes["drafter"]["node_id"] == hosts.nodes["draft"].node_id
    assert set(hardware) == {"verifier", "drafter"} and hardware["verifier"]["cpu"]
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, prompt, 40)
    assert sum(r.metrics["draft_tokens"] for r in results) > 0, "the drafter on the other host never drafted"
    assert status["client_address"].startswith("tcp://") and "127.0.0.1" not in status["client_address"]


def test_a_placement_no_host_can_hold_is_refused_at_once(hosts, tiny):
    config = ray_config(tiny)
    config["drafter"]["placement"] = {"resources": {"tpu_host": 1}}

    async def main():
        async with cluster(config):
            raise AssertionError("a drafter that no host can hold was placed")

    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"no host of the Ray cluster can hold the drafter node .*tpu_host") as err:
        asyncio.run(main())
    assert "draft_host 2" in str(err.value), "the error says what the hosts offer"
    assert time.monotonic() - t0 < 60
    with pytest.raises(ValueError):  # nothing left behind: the run's name is free again
        hosts.ray.get_actor("pipespec", namespace="pipespec")


def test_scale_adds_and_removes_drafters_from_another_process(hosts, tiny):
    target = tiny("llama")

    async def main():
        async with cluster(ray_config(tiny)) as client:
            out = await asyncio.to_thread(
                subprocess.run, [*PIPESPEC, "scale", "--drafters", "2", "--ray", hosts.address],
                capture_output=True, text=True, timeout=180, cwd=ROOT)
            assert out.returncode == 0, out.stderr[-3000:]
            assert "drafter2: drafter serving" in out.stdout, out.stdout
            joined_s = await until_drafters(client, 2)
            two = await generate_all(client)
            status = await asyncio.to_thread(scale, 0, hosts.address)
            await until_drafters(client, 0)
            none = await generate_all(client, PROMPTS[:1])
            return out, joined_s, two, status, none

    _, joined_s, two, status, none = asyncio.run(main())
    print(f"\nsecond drafter in the pool {joined_s:.1f} s after `pipespec scale` returned")
    assert [n for n, s in status["nodes"].items() if s["role"] == "drafter"] == []
    for prompt, result in zip(PROMPTS, two):
        assert result.token_ids == reference_greedy(target, prompt, 40)
    assert none[0].token_ids == reference_greedy(target, PROMPTS[0], 40)
    assert none[0].metrics["draft_tokens"] == 0


def test_verifier_killed_is_restarted_and_http_and_drafting_resume(hosts, tiny):
    if shutil.which("curl") is None:
        pytest.fail("curl is needed to check the HTTP front end")
    target = tiny("llama")
    config = ray_config(tiny)
    config["http"] = {"host": "127.0.0.1", "port": free_port(), "model_name": "tiny"}

    def curl(url: str) -> subprocess.CompletedProcess:
        return subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "60", "-H",
                               "Content-Type: application/json", "-d",
                               '{"model": "tiny", "prompt": "hello", "max_tokens": 8}', url],
                              capture_output=True, text=True, timeout=90)

    async def main():
        async with cluster(config) as client, serve_http(client, client.config) as server:
            await until_drafters(client, 1)
            assert (await asyncio.to_thread(curl, f"{server.url}/v1/completions")).stdout == "200"
            in_flight = [asyncio.create_task(client.generate(token_ids=p, max_new_tokens=400, eos_token_ids=[]))
                         for p in PROMPTS]
            await asyncio.sleep(0.3)
            before = client.address
            actor = hosts.ray.get_actor(client.cluster.status()["nodes"]["verifier"]["actor"], namespace="pipespec")
            hosts.ray.kill(actor, no_restart=False)
            killed = time.monotonic()
            failed = await asyncio.gather(*in_flight, return_exceptions=True)
            result, _ = await until_served(client, {"token_ids": PROMPTS[0], "max_new_tokens": 40,
                                                     "eos_token_ids": []})
            served_s = time.monotonic() - killed
            await until_drafters(client, 1)
            drafting = await generate_all(client)
            http = await asyncio.to_thread(curl, f"{server.url}/v1/completions")
            return failed, result, served_s, drafting, http, before, client.address, client.cluster.status()

    failed, result, served_s, drafting, http, before, after, status = asyncio.run(main())
    print(f"\nverifier killed: {sum(isinstance(f, Exception) for f in failed)} of {len(failed)} requests in flight "
          f"failed; a request succeeded {served_s:.1f} s after the kill")
    assert all((isinstance(f, PipespecError) and f.code == "verifier_gone") or
               (not isinstance(f, Exception) and f.token_ids == reference_greedy(target, p, 400))
               for f, p in zip(failed, PROMPTS)), failed
    assert result.token_ids == reference_greedy(target, PROMPTS[0], 40)
    assert sum(r.metrics["draft_tokens"] for r in drafting) > 0, "drafting did not resume after the restart"
    assert http.stdout == "200", http
    assert before == after, "a verifier restarted on its host binds its old address"
    events = [e["event"] for e in status["events"] if e["node"] == "verifier"]
    assert events.count("serving") == 2 and "back" in events, status["events"]


def test_docs_recipe_runs_on_a_local_multi_node_cluster(hosts, tiny, tmp_path):
    """docs/ray.md's recipe as written, on the tier's cluster (its hosts are the recipe's): its config with tiny
    models, its `pipespec` commands as subprocesses (HEAD:6379 → the cluster's address)."""
    config = RECIPE_CONFIG
    pipespec = [t[1:] for t in RECIPE_COMMANDS if t[0] == "pipespec"]
    (tmp_path / "ray.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    tiny_keys = [f"--set=verifier.model={tiny('llama')}", f"--set=drafter.model={tiny('llama', 'random')}"]
    for role in ("verifier", "drafter"):
        tiny_keys += [f"--set={role}.dtype=float32", f"--set={role}.threads=1", f"--set={role}.profile_s=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    background: list[subprocess.Popen] = []
    try:
        for argv in pipespec:
            argv = [a.replace(RAY_HEAD, hosts.address) for a in argv]
            if argv[-1] == "&":
                argv = [*argv[:-1], *tiny_keys, "--port", str(free_port())]
                proc = subprocess.Popen([*PIPESPEC, *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                background.append(proc)
                deadline = time.monotonic() + 180
                lines = []
                while time.monotonic() < deadline:
                    line = proc.stdout.readline()
                    lines.append(line)
                    if line.startswith("logs:") or (not line and proc.poll() is not None):
                        break
                assert any(x.startswith("client address:") for x in lines), "".join(lines)[-3000:]
                continue
            if argv[0] in ("generate", "serve"):
                argv = [*argv, *tiny_keys]
            out = subprocess.run([*PIPESPEC, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=300)
            assert out.returncode == 0, f"pipespec {' '.join(argv)}:\n{out.stderr[-3000:]}"
            if argv[0] == "scale":
                assert "drafter2: drafter serving" in out.stdout, out.stdout
            if argv[0] == "generate":
                assert "verifier on " in out.stderr and "drafter on " in out.stderr, out.stderr[-2000:]
    finally:
        for proc in background:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert all(p.returncode == 0 for p in background), [p.returncode for p in background]


def test_a_sweep_runs_each_point_on_the_cluster_with_its_link_delay(hosts, tiny, tmp_path):
    """``pipespec bench --ray SWEEP``: each point's nodes where the placement says, the link delay applied (a draft's
    transit takes at least the added one-way delay), greedy output identical across the points."""
    import json

    from benchmarks import sweep as sw

    config = ray_config(tiny)
    del config["launch"]["backend"]  # --ray sets it on every point
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    spec = {"base": "tiny.yaml", "prompts": ["def add(a, b):"], "max_new_tokens": 24,
            "grid": {"link_delay_ms": [0, 20]}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    out = tmp_path / "out"
    assert sw.main(["--ray", str(tmp_path / "sweep.yaml"), "--ray-address", hosts.address, "--out", str(out)],
                   prog="pipespec bench") == 0
    report = json.loads((out / "sweep.json").read_text())
    assert [p["status"] for p in report["points"]] == ["ok", "ok"], report["points"]
    assert [r["mismatches"] for r in report["rows"]] == ["ref", "0/1 vs #1"]
    for point in report["points"]:
        assert point["backend"] == "ray"
        assert point["hardware"]["verifier"]["ip"] != "local" and point["hardware"]["drafter"]["cpu"]
    delayed = report["points"][1]["per_prompt"][0]["metrics"]
    assert delayed["draft_tokens"] > 0 and delayed["draft_transit_ms"] >= 20, delayed


def test_drafter_host_removed_mid_request_then_back_on_a_new_host(hosts, tiny):
    """Last in the tier: it takes the drafter host away (and adds another)."""
    target = tiny("llama")

    async def main():
        async with cluster(ray_config(tiny)) as client:
            await until_drafters(client, 1)
            before = await live_drafters(client)
            in_flight = [asyncio.create_task(client.generate(token_ids=p, max_new_tokens=300, eos_token_ids=[]))
                         for p in PROMPTS]
            await asyncio.sleep(0.3)
            hosts.remove("draft")
            removed = time.monotonic()
            results = await asyncio.gather(*in_flight)
            done_s = time.monotonic() - removed
            hosts.add("draft")
            added = time.monotonic()
            back_s = await until_drafters(client, 1, timeout_s=180, besides=before)
            again = await generate_all(client)
            return results, done_s, back_s, again, time.monotonic() - added, client.cluster.status()

    results, done_s, back_s, again, _, status = asyncio.run(main())
    print(f"\ndrafter host removed: every request completed {done_s:.1f} s later; the drafter was back in the "
          f"pool {back_s:.1f} s after a new host joined")
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, prompt, 300)
    for prompt, result in zip(PROMPTS, again):
        assert result.token_ids == reference_greedy(target, prompt, 40)
    assert sum(r.metrics["draft_tokens"] for r in again) > 0, "the drafter back on the new host never drafted"
    assert status["nodes"]["drafter"]["node_id"] == hosts.nodes["draft"].node_id
