"""Shared fixtures: tiny models saved once per test session, and a helper to run a cluster from a test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.utils import logging as transformers_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit.tiny_models import build_model, build_small_vocab_tokenizer, build_tokenizer

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A tiny model is built the first time a test asks for it, which may be inside a test that reads its own stderr
# (with pytest-xdist the order differs run to run): no "Writing model shards" bar there.
transformers_logging.disable_progress_bar()
# Under pytest-xdist each worker compiles into a cache folder of its own: a compile failed once while two workers
# shared the default one (the compiled backend fell back to eager and its test failed); separate folders rule out
# a race between them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor-{os.getuid()}-{os.environ['PYTEST_XDIST_WORKER']}"))


#: The tiers of pyproject.toml's markers; every test carries at least one: its own, or else its file's ``pytestmark``.
TIERS = ("unit", "process", "compile", "cluster", "statistical", "netns", "ci", "slow", "ray")
#: The tiers whose tests start node processes.
NODE_TIERS = ("cluster", "statistical", "netns", "ci", "slow")


def _tiers(item) -> list[str]:
    return [tier for tier in TIERS if item.get_closest_marker(tier)]


def _file_tier_is_the_default(items) -> None:
    """A file's ``pytestmark`` tier is the tier of its tests that name none of their own: a test (or a parameter)
    marked with another tier is in that tier only (a probe in a child process among unit tests: ``process``)."""
    modules = {item.getparent(pytest.Module) for item in items} - {None}
    defaults = {}
    for module in modules:
        defaults[module] = [mark for mark in module.own_markers if mark.name in TIERS]
        module.own_markers[:] = [mark for mark in module.own_markers if mark.name not in TIERS]
    for item in items:
        if not any(mark.name in TIERS for mark in item.iter_markers()):
            for mark in defaults.get(item.getparent(pytest.Module), []):
                item.add_marker(mark.name)  # tier marks take no arguments


def _refuse(what: str, nodeids: list[str], fix: str) -> None:
    if nodeids:
        more = " …" if len(nodeids) > 10 else ""
        raise pytest.UsageError(f"{what}: {', '.join(nodeids[:10])}{more}; {fix}")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the tiers it reads are settled here
def pytest_collection_modifyitems(config, items):
    _file_tier_is_the_default(items)
    _refuse(f"tests without a tier marker ({', '.join(TIERS)})", [i.nodeid for i in items if not _tiers(i)],
            "add `pytestmark = pytest.mark.<tier>` to the file")
    # `make test-fast` (-m unit) must stay under a minute: a test in another tier too (a compile warm-up, nodes)
    # is not a unit test; give the parameter its own marks (pytest.param(..., marks=...)) instead
    _refuse("unit tests that carry another tier too", [i.nodeid for i in items if "unit" in _tiers(i)
                                                       and len(_tiers(i)) > 1],
            "a test is `unit` or in another tier, not both")


@pytest.fixture(scope="session", autouse=True)
def profile_dir(tmp_path_factory):
    """Cost profiles of the test run's tiny models go to a folder of their own (nodes inherit the variable)."""
    os.environ["PIPESPEC_PROFILE_DIR"] = str(tmp_path_factory.mktemp("profiles"))



@pytest.fixture(scope="session", autouse=True)
def node_zygote(request, tmp_path_factory):
    """When the session starts node processes: one warm interpreter (tests/node_zygote.py) that every test node is
    forked from, and every node a test starts without an entry of its own goes through tests/node_entry.py so that
    it is forked too. Saves the import of torch and transformers in each node (seconds per cluster).
    ``PIPESPEC_TEST_NO_ZYGOTE=1`` starts every node in a fresh interpreter instead (to compare, or to rule it out)."""
    from node_entry import restore, route_nodes_here
    from node_zygote import ZYGOTE_ENV, zygote_env_value

    from runtime.launchers import process as launch

    starts_nodes = any(item.get_closest_marker(tier) for item in request.session.items for tier in NODE_TIERS)
    if not starts_nodes or os.environ.get("PIPESPEC_TEST_NO_ZYGOTE", "") not in ("", "0"):
        yield None
        return
    path = str(tmp_path_factory.mktemp("zygote") / "zygote.sock")
    env = {**launch.NODE_ENV, **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(launch.REPO_ROOT), env.get("PYTHONPATH")]))
    log = open(Path(path).with_suffix(".log"), "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("node_zygote.py")), path], env=env,
                            cwd=launch.REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=launch._die_with_parent)
    log.close()
    os.environ[ZYGOTE_ENV] = zygote_env_value(path)
    replaced = route_nodes_here()
    yield proc
    restore(replaced)
    os.environ.pop(ZYGOTE_ENV, None)
    launch.stop_process(proc, grace_s=5)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tokenizer_dir(model_dir) -> Path:
    folder = model_dir / "tokenizer"
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny(model_dir, tokenizer_dir):
    """``tiny(arch, role)`` → folder of a saved tiny model; role ``target`` or ``random`` (a different drafter)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, role: str = "target") -> Path:
        key = (arch, role)
        if key not in cache:
            seed = {"target": 1, "random": 2}[role]
            layers = 2 if role == "target" else 1
            cache[key] = build_model(model_dir / f"{arch}-{role}", arch, tokenizer_dir, seed=seed, layers=layers)
        return cache[key]

    return get


def tiny_config(target: Path, drafter: Path | None, **drafter_keys) -> dict:
    """A config dict for tiny models: float32, one thread per node, generous but bounded waits, no start-up cost
    profile (tests/test_costs.py and tests/test_cost_e2e.py exercise it; here it would only serialise start-ups)."""
    config = {
        "verifier": {"model": str(target), "dtype": "float32", "threads": 1, "draft_timeout_ms": 3000, "profile_s": 0},
        "drafter": {"model": str(drafter or target), "dtype": "float32", "threads": 1, "profile_s": 0,
                    "draft_schedule": "constant", **drafter_keys},
        "client": {"timeout_s": 120},
        "launch": {"ready_timeout_s": 120},
    }
    return config


@contextlib.contextmanager
def http_launcher(config: dict, folder: Path, **extra):
    """A launcher subprocess serving ``config`` over HTTP, started the way a user starts it (``python -m
    runtime.launch --config X --http 127.0.0.1:PORT``): a namespace with ``port``, ``base_url``, ``address`` (the
    client link), ``model`` (the target's path as text) and ``extra``; stopped on exit."""
    import yaml

    from benchmarks.http_overhead import free_port, start_launcher
    from runtime.launch import stop_process

    path = folder / "http.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc, address, _ = start_launcher(path, port, timeout_s=150)
    try:
        yield SimpleNamespace(port=port, base_url=f"http://127.0.0.1:{port}/v1", address=address,
                              model=config["verifier"]["model"], **extra)
    finally:
        stop_process(proc)


def http_refusal(endpoint: str, **fields) -> str | None:
    """The ``param`` of the 400 an HTTP request body with ``fields`` gets from the schema and the server's checks
    (None: taken). ``endpoint``: ``chat`` (one user turn) or ``completions`` (a text prompt)."""
    from http_server.errors import OpenAIError
    from http_server.schemas import ChatRequest, CompletionRequest, check_supported

    base = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
    try:
        check_supported((ChatRequest if endpoint == "chat" else CompletionRequest)(**{**base, **fields}))
    except OpenAIError as exc:
        return exc.param
    except ValueError as exc:  # pydantic's ValidationError: the app answers it with a 400 naming its loc
        return ".".join(str(p) for p in exc.errors()[0]["loc"])
    return None


@pytest.fixture(scope="session")
def sharp_pair(tmp_path_factory):
    """A target and a clearly different drafter, sharpened, over a 12-token vocabulary (for sampling tests)."""
    root = tmp_path_factory.mktemp("sharp")
    build_small_vocab_tokenizer(root / "tok")
    target = build_model(root / "target", "llama", root / "tok", seed=11, sharpen=1.2)
    drafter = build_model(root / "drafter", "llama", root / "tok", seed=12, layers=1, sharpen=1.2)
    return target, drafter




#: How :func:`start_cluster` starts nodes when a test does not say: ``inproc`` (threads of the test process: one
#: sampling check of 800 requests took 7.7 s of CPU against 21 s as processes, busy 2-core machine) or ``process``
#: (each node a process forked from the session's zygote). ``PIPESPEC_TEST_LAUNCHER`` overrides it for every test
#: that leaves the choice open (to compare, or to rule one out). Tests that start clusters with
#: ``runtime.launch.cluster`` itself keep real node processes.
DEFAULT_LAUNCHER = "inproc"
LAUNCHERS = ("process", "inproc")


def launcher_for(choice: str | None = None) -> str:
    """The launcher a test's cluster starts with: the test's own ``choice``, else ``PIPESPEC_TEST_LAUNCHER``, else
    :data:`DEFAULT_LAUNCHER`."""
    name = choice or os.environ.get("PIPESPEC_TEST_LAUNCHER") or DEFAULT_LAUNCHER
    if name not in LAUNCHERS:
        raise ValueError(f"test launcher {name!r}: one of {', '.join(LAUNCHERS)}")
    return name


def start_cluster(config: dict, hooks: Mapping[str, str] | None = None, launcher: str | None = None, **kwargs):
    """``runtime.launch.cluster`` for a test: ``async with start_cluster(config) as client``. The one place that
    chooses how a test's nodes start (:func:`launcher_for`). ``hooks``: role → a tests/node_entry.py hook
    (``"accept_all"``, or ``"name=argument"``) the node runs with: the process launcher gets it as the node's entry
    script (forked from the session's zygote like every test node), the in-process one as the objects the hook
    builds. ``kwargs`` go to ``cluster``."""
    from node_entry import HOOKS, node_entry

    from runtime.launchers import LaunchOptions, cluster

    parsed = {role: hook.split("=", 1) for role, hook in (hooks or {}).items()}
    if launcher_for(launcher) == "inproc":
        objects = {role: HOOKS[name](arg[0] if arg else None) for role, (name, *arg) in parsed.items()}
        config = {**config, "launch": {**config.get("launch", {}), "backend": "inproc"}}
        return cluster(config, options=LaunchOptions(hooks=objects), **kwargs)
    entry = {role: node_entry(*hook) for role, hook in parsed.items()}
    return cluster(config, entry=entry or None, **kwargs)


@contextlib.asynccontextmanager
async def peer_socket(endpoint: str):
    """A raw DEALER socket to a node, for tests that play a (hostile) peer by hand."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


async def peer_messages(sock, stop):
    """What a hand-played drafter receives until ``stop`` is set, decoded; it heartbeats while nothing comes (the
    verifier drops a drafter that stays silent)."""
    from shared.protocol import Heartbeat, decode, encode

    while not stop.is_set():
        if not await sock.poll(50):
            await sock.send_multipart(encode(Heartbeat()))
            continue
        yield decode(await sock.recv_multipart())


def hand_played(target: Path) -> tuple[dict, str]:
    """A config whose launcher starts the verifier only (the test plays the drafter by hand) and the target's
    tokenizer id, which that drafter's hello must announce."""
    from shared.models import load_tokenizer, tokenizer_id

    config = tiny_config(target, None)
    config["launch"]["start_drafter"] = False
    return config, tokenizer_id(load_tokenizer(str(target)))


async def wait_for_drafter(client, tries: int = 100) -> None:
    """Until the verifier reports a live drafter (bounded: about 5 s)."""
    for _ in range(tries):
        if (await client.ping())["drafter_connected"]:
            return
        await asyncio.sleep(0.05)


def greedy_outputs(config: dict, prompts: list[list[int]], max_new_tokens: int, launcher: str | None = None) -> list:
    """Every prompt sent at once to a cluster of ``config`` (greedy, end tokens off); the results in prompt order.
    ``launcher``: see :func:`start_cluster`."""
    async def main():
        async with start_cluster(config, launcher=launcher) as client:
            return await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=max_new_tokens,
                                                          eos_token_ids=[]) for p in prompts))

    return asyncio.run(main())
