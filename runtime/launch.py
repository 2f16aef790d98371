"""Launcher: ``python -m runtime.launch --config cpu.yaml`` starts the verifier and the drafter as processes, waits
until both are ready, and serves (or runs one generation with ``--prompt``); ``--role`` starts one node alone.

From Python: ``async with runtime.launch.cluster("cpu.yaml", overrides={...}) as client:`` does the same with real
subprocesses and yields an :class:`~runtime.client.AsyncClient` (with ``.processes`` and ``.config``).
``--http HOST:PORT`` (or the config's ``http`` section) also serves an OpenAI-compatible HTTP API on that client
(:func:`serve_http`, package ``http_server``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from runtime import security
from runtime.client import AsyncClient, Chunk, PipespecError
from runtime.config import (
    ConfigError,
    check_security,
    fill_run_dir,
    load_config,
    parse_overrides,
    typed,
)
from runtime.first_run import ProfileRelay, run_summary, startup_lines, type_line, with_reports
from runtime.keys import KeysError
from runtime.node_setup import (  # NODE_ENV, LaunchError: also named here by callers and tests
    NODE_ENV,
    Launcher,
    LaunchError,
    node_log_level,
    node_names,
    prepare_models,
    wait_until_serving,
)
from runtime.node_setup import progress as _progress
from runtime.paths import PACKAGE_ROOT
from shared.models import ModelLoadError
from shared.named_models import RegistryError
from shared.transport import ClientKeys
from weights.progress import quiet_library_bars

#: Node processes run in the folder that holds the packages (a checkout's root, or site-packages), so what they
#: import never depends on the caller's directory; paths in the config are made absolute before they start
#: (:func:`runtime.config.validate`).
REPO_ROOT = PACKAGE_ROOT


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if ``proc`` is still there after ``grace_s`` (a launcher or a helper process)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, so no node outlives it (Linux)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


#: What a node process runs after the interpreter. Tests name their own entry script in ``Cluster(entry=...)`` to
#: start a node with test behaviour injected as objects (tests/node_entry.py); production code reads no test switch.
NODE_ENTRY = ["-m", "runtime.launch"]


def node_pythonpath(current: str | None) -> str:
    """A node's PYTHONPATH: :data:`REPO_ROOT` first (a checkout need not be installed, and a worktree runs its own
    code), except when it is a site-packages folder, which the interpreter puts on the path itself (before it, it
    would come ahead of the standard library)."""
    import site

    site_dirs = {Path(d).resolve() for d in [*site.getsitepackages(), site.getusersitepackages()]}
    first = None if REPO_ROOT in site_dirs else str(REPO_ROOT)
    return os.pathsep.join(filter(None, [first, current]))


class Cluster:
    """The node processes of one config, started and supervised by this process."""

    def __init__(self, config: dict[str, Any], run_dir: str | None = None, env: dict[str, str] | None = None,
                 prefix: dict[str, list[str]] | None = None, entry: dict[str, list[str]] | None = None):
        """``prefix``: a command put before a role's node command (e.g. ``["ip", "netns", "exec", "ns1"]``);
        ``entry``: what a role's process runs instead of :data:`NODE_ENTRY` (tests inject behaviour this way)."""
        check_security(config, ("verifier", "drafter", "client"))
        self.own_run_dir = run_dir is None  # a folder we made is removed on a clean stop
        self.run_dir = _run_dir(run_dir)  # 0700: the ipc sockets in it are ours alone
        self.config = fill_run_dir(config, self.run_dir)
        self.env = env
        self.prefix = prefix or {}
        self.entry = entry or {}
        # The drafter we start proves in hello that it is ours (links without CURVE); a cluster without its own
        # drafter takes one from elsewhere, so it sets a secret only if it was given one.
        start_drafter = self.config["launch"]["start_drafter"]
        self.run_secret = security.run_secret() or (security.new_secret() if start_drafter else None)
        if self.run_secret:
            security.write_secret(self.run_dir, self.run_secret)
        self.processes: dict[str, subprocess.Popen] = {}
        self.config_path = Path(self.run_dir) / "config.json"
        self.config_path.write_text(json.dumps(self.config, indent=1))

    @property
    def client_address(self) -> str:
        return self.config["client"]["endpoint"]

    def client_keys(self) -> ClientKeys | None:
        """The keys the launcher's client connects with (None when the client link runs no CURVE)."""
        return security.client_keys_for(self.config)

    def node_hardware(self) -> dict[str, dict[str, Any]]:
        """Each node's host: this machine, for every process."""
        from runtime.ray_node import host_facts

        facts = {"ip": "local", **host_facts()}
        return {name: dict(facts) for name in self.processes}

    async def follow(self, client: AsyncClient) -> None:
        """Nothing to follow: a process backend's verifier keeps its address (the Ray backend's may move)."""

    def log_path(self, role: str) -> Path:
        return Path(self.run_dir) / f"{role}.log"

    def start_node(self, role: str, name: str | None = None) -> subprocess.Popen:
        """Start one node process; ``name`` (default: the role) keys ``processes`` and names its log."""
        name = name or role
        env = {**NODE_ENV, **os.environ, **(self.env or {})}
        env["PYTHONPATH"] = node_pythonpath(env.get("PYTHONPATH"))
        if self.run_secret:
            env[security.SECRET_ENV] = self.run_secret  # the environment, not argv: ps shows argv to everyone
        log = open(self.log_path(name), "ab")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(
            [*self.prefix.get(role, []), sys.executable, *self.entry.get(role, NODE_ENTRY), "--config",
             str(self.config_path), "--role", role],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.close()
        self.processes[name] = proc
        return proc

    @property
    def drafter_count(self) -> int:
        """Drafter processes this cluster starts: ``launch.drafters`` (0 with ``start_drafter: false``)."""
        return self.config["launch"]["drafters"] if self.config["launch"]["start_drafter"] else 0

    def start(self) -> None:
        self.start_node("verifier")
        for name in node_names(self.drafter_count):
            self.start_node("drafter", name)

    def log_tail(self, role: str, lines: int = 25) -> str:
        try:
            text = self.log_path(role).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def check_alive(self, roles: list[str] | None = None) -> None:
        for role, proc in self.processes.items():
            if roles and role not in roles:
                continue
            code = proc.poll()
            if code is not None:
                raise LaunchError(
                    f"the {role} node exited with code {code} during start-up. End of {self.log_path(role)}:\n"
                    + self.log_tail(role)
                )

    async def wait_ready(self, client: AsyncClient) -> dict[str, Any]:
        """Wait (bounded by ``launch.ready_timeout_s``) until the verifier answers and every drafter it started is
        in the pool."""
        timeout_s = self.config["launch"]["ready_timeout_s"]
        relay = ProfileRelay({name: self.log_path(name) for name in self.processes}, _progress)

        async def check() -> None:
            relay.poll()
            self.check_alive()

        try:
            return await wait_until_serving(client, self.drafter_count, timeout_s, check,
                                            lambda: f"nodes not ready after {timeout_s} s; logs in {self.run_dir}")
        finally:
            relay.close()

    def stop(self, timeout_s: float = 10.0, keep_logs: bool = False) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.own_run_dir and not keep_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def cluster(
    config: str | os.PathLike | dict | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    prefix: dict[str, list[str]] | None = None,
    entry: dict[str, list[str]] | None = None,
) -> AsyncIterator[AsyncClient]:
    """Start the nodes of ``config`` as subprocesses and yield a connected client (with the config's client keys
    when the client link runs CURVE); stop them on exit. ``prefix``, ``entry``: see :class:`Cluster`."""
    cfg = load_config(config, overrides)
    nodes = await start_launcher(cfg, env=env, prefix=prefix, entry=entry)
    failed = True
    try:
        client = AsyncClient(nodes.client_address, timeout_s=timeout_s or cfg["client"]["timeout_s"],
                             curve=nodes.client_keys())
        async with client:
            pong = await nodes.wait_ready(client)
            client.startup = await with_reports(client, pong, nodes.drafter_count)  # type: ignore[attr-defined]
            client.processes = nodes.processes  # type: ignore[attr-defined]
            client.config = nodes.config  # type: ignore[attr-defined]
            client.cluster = nodes  # type: ignore[attr-defined]
            async with _following(nodes, client):
                yield client
        failed = False
    finally:
        await asyncio.to_thread(nodes.stop, keep_logs=failed)


async def start_launcher(cfg: dict[str, Any], run_dir: str | None = None, env: dict[str, str] | None = None,
                         prefix: dict[str, list[str]] | None = None,
                         entry: dict[str, list[str]] | None = None) -> Launcher:
    """Start the nodes of a loaded config with its ``launch.backend``: child processes (:class:`Cluster`) or
    actors on a Ray cluster (:class:`runtime.ray_launch.RayCluster`); returns once they are starting."""
    if cfg["launch"]["backend"] == "ray":
        if prefix or entry:
            raise ConfigError("launch.backend ray starts nodes as Ray actors: a process prefix or entry does not "
                              "apply")
        from runtime.ray_launch import RayCluster

        nodes: Launcher = RayCluster(cfg, run_dir=_run_dir(run_dir), env=env)
    else:
        check_security(cfg)  # before any model is fetched
        await asyncio.to_thread(prepare_models, cfg)
        nodes = Cluster(cfg, run_dir=run_dir, env=env, prefix=prefix, entry=entry)
    try:
        if isinstance(nodes, Cluster):
            # in this thread: a node's death signal (PR_SET_PDEATHSIG) follows the thread that started it, and a
            # worker thread of to_thread may end while the nodes run
            nodes.start()
        else:
            await asyncio.to_thread(nodes.start)  # placing the nodes blocks on Ray
    except BaseException:
        await asyncio.to_thread(nodes.stop, keep_logs=True)
        raise
    return nodes


def _run_dir(run_dir: str | None) -> str:
    try:  # mkdtemp makes it 0700: what the launcher keeps there (keys, logs) is ours alone
        return security.private_run_dir(run_dir) if run_dir else tempfile.mkdtemp(prefix="pipespec-")
    except (security.RunDirError, OSError) as exc:
        raise LaunchError(str(exc)) from None


#: How often a launcher whose verifier may move (Ray) is asked where it is.
FOLLOW_S = 1.0


@contextlib.asynccontextmanager
async def _following(nodes: Launcher, client: AsyncClient) -> AsyncIterator[None]:
    """While the block runs, point ``client`` at the verifier wherever the launcher restarted it."""

    async def follow() -> None:
        while True:
            await asyncio.sleep(FOLLOW_S)
            try:
                await nodes.follow(client)
            except Exception as exc:  # a launcher that cannot answer now is asked again next time
                logging.getLogger("pipespec.launch").warning("following the verifier: %s", exc)

    task = asyncio.create_task(follow())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---------------------------------------------------------------------------------------------------- CLI


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config`` and ``--set``: the config every command starts from (``python -m runtime.launch`` and the
    ``pipespec`` subcommands share them)."""
    p.add_argument("--config", default="cpu.yaml",
                   help="config file, or the name of a bundled config (cpu.yaml, gpu.yaml, …; default cpu.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable; wins over every other flag)")


def add_ray_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="start the nodes as actors on a Ray cluster (launch.backend: ray) at ADDRESS, or on the one "
                        "RAY_ADDRESS or `ray start` on this host names, else on a new local one (docs/ray.md)")


def ray_overrides(address: str | None) -> dict[str, Any]:
    """The config keys ``--ray [ADDRESS]`` sets (none without the flag)."""
    if address is None:
        return {}
    return {"launch.backend": "ray", **({"launch.ray_address": address} if address else {})}


def add_run_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", help="folder for ipc sockets and logs (default: a new temporary folder)")


def add_generation_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    """The flags of one generation (``--prompt`` or ``--messages``, ``--json``, the sampling parameters)."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", help="run one generation on this text and exit")
    src.add_argument("--messages", help="run one generation on chat messages from this JSON file and exit")
    p.add_argument("--chat", action="store_true", help="send --prompt as one user message (chat template)")
    p.add_argument("--json", action="store_true", help="print {text, token_ids, metrics} as JSON")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="structured output: the text is JSON valid against the JSON schema in FILE")
    shape.add_argument("--regex", metavar="R", help="structured output: the text matches the regex R")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.launch", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--role", choices=["verifier", "drafter"], help="start one node alone (for multi-host setups)")
    add_generation_args(p)
    add_run_dir_arg(p)
    add_ray_arg(p)
    p.add_argument("--http", metavar="HOST:PORT",
                   help="also serve an OpenAI-compatible HTTP API there (e.g. 127.0.0.1:8000; sets http.host and "
                        "http.port; a non-loopback host needs http.api_key and http.allow_remote: true)")
    return p


def parse_http_address(text: str) -> dict[str, Any]:
    """``HOST:PORT``, ``[V6]:PORT`` or a bare ``PORT`` (loopback) → ``{"http.host": …, "http.port": …}``."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit():
        raise ConfigError(f"--http {text!r}: use HOST:PORT, e.g. --http 127.0.0.1:8000")
    return {"http.host": host, "http.port": int(port)}


def _run_role(config: dict[str, Any], role: str, run_dir: str | None, hooks: dict[str, Any] | None = None) -> int:
    """Run one node in this process; ``hooks``: keyword arguments for the node's ``run`` (tests inject objects)."""
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
    prepare_models({**config, "launch": {**config["launch"], "start_drafter": role == "drafter"}})
    if role == "verifier":
        from verifier_node.server import run

        print(f"verifier: drafters connect to {config['verifier']['endpoint']}; clients to "
              f"{config['client']['endpoint']}", flush=True)
        run(typed(config), security.verifier_links(config, secret), **(hooks or {}))
        return 0
    from drafter_node.node import run

    return run(typed(config), security.drafter_links(config, secret), **(hooks or {}))


def _load_messages(path: str) -> list[dict[str, str]]:
    try:
        messages = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--messages {path}: cannot read a JSON list of messages: {exc}") from None
    if not isinstance(messages, list):
        raise ConfigError(f"--messages {path}: expected a JSON list of {{role, content}} objects")
    return messages


def _constraint(args: argparse.Namespace) -> dict[str, Any]:
    """``--json-schema FILE`` / ``--regex R`` as the client's structured-output argument."""
    if getattr(args, "json_schema", None):
        try:
            return {"json_schema": Path(args.json_schema).read_text()}
        except OSError as exc:
            raise ConfigError(f"--json-schema {args.json_schema}: cannot read the schema: {exc}") from None
    return {"regex": args.regex} if getattr(args, "regex", None) else {}


async def _one_shot(args: argparse.Namespace, config: dict[str, Any]) -> int:
    params = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "temperature": args.temperature,
              "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, **_constraint(args)}
    messages = _load_messages(args.messages) if args.messages else None
    prompt = args.prompt
    if args.chat and prompt is not None:
        prompt, messages = None, [{"role": "user", "content": args.prompt}]
    if config["drafter"]["type_reason"]:
        _progress(type_line(config))
    async with cluster(config) as client:
        for line in startup_lines(client.startup):
            _progress(line)
        await _show_hosts(client.cluster)
        if args.json:
            r = await client.generate(prompt, messages=messages, **params)
            print(json.dumps({"text": r.text, "token_ids": r.token_ids, "metrics": r.metrics}))
            return 0
        shown = ""
        async for item in client.stream(prompt, messages=messages, include_result=True, **params):
            if isinstance(item, Chunk):
                shown += item.text
                print(item.text, end="", flush=True)
            else:
                # the stream holds back a trailing half character; the final text has all of it
                print(item.text[len(shown):] if item.text.startswith(shown) else "")
                print(format_metrics(item.metrics), file=sys.stderr)
                _progress(run_summary(item.metrics, client.startup.get("reports")))
    return 0


def format_metrics(m: dict[str, Any]) -> str:
    """One readable block of the metrics docs/metrics.md names."""
    return (
        f"[pipespec] {m['new_tokens']} tokens in {m['elapsed_s']:.2f} s ({m['tokens_per_second']:.2f} tok/s), "
        f"{m['rounds']} rounds, acceptance {m['acceptance_rate']:.2f} ({m['accepted_tokens']}/{m['draft_tokens']}), "
        f"τ {m['mean_accepted_length']:.2f}, busy verifier {m['verifier_busy_fraction']:.2f} / drafter "
        f"{m['drafter_busy_fraction']:.2f}, pre-draft hits {m['predraft_hits']}, fallback rounds "
        f"{m['fallback_rounds']}, message overhead {m['message_overhead_ms_per_round']:.2f} ms/round, "
        f"rounds alone (k = 0) {m.get('solo_rounds', 0)}, plans {_plans(m.get('plans'))}, dtype verifier "
        f"{m.get('verifier_dtype') or '?'} / drafter {m.get('drafter_dtype') or '—'}"
    )


def _plans(plans: Any) -> str:
    if not isinstance(plans, dict) or not plans:
        return "—"
    return " / ".join(f"{name} {count}" for name, count in plans.items())


async def _show_hosts(nodes: Launcher) -> None:
    """Where each node landed, when that is not this machine (the Ray backend)."""
    for name, hw in (await asyncio.to_thread(nodes.node_hardware)).items():
        if hw.get("ip") != "local":
            _progress(f"{name} on {hw['host']} ({hw['ip']}): {hw['cpu']}, {hw['cores']} cores"
                      + (f", {hw['gpu']}" if hw.get("gpu") else ""))


async def _serve(config: dict[str, Any], run_dir: str | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if config["drafter"]["type_reason"]:
        _progress(type_line(config))
    nodes = await start_launcher(config, run_dir=run_dir)
    try:
        async with AsyncClient(nodes.client_address, timeout_s=config["client"]["timeout_s"],
                               curve=nodes.client_keys()) as client:
            pong = await with_reports(client, await nodes.wait_ready(client), nodes.drafter_count)
            drafters = ", ".join(f"{d['id']} {d['type']}@{d['host']}" for d in pong.get("drafters") or []) or "none"
            print(f"pipespec ready: target {pong.get('target')}, drafters: {drafters}", flush=True)
            for line in startup_lines(pong):
                _progress(line)
            await _show_hosts(nodes)
            print(f"client address: {nodes.client_address}", flush=True)
            if config["launch"]["backend"] == "ray":
                print(f"client keys: {nodes.run_dir}/keys (runtime.keys.client_keys(FOLDER))", flush=True)
            async with contextlib.AsyncExitStack() as stack:
                await stack.enter_async_context(_following(nodes, client))
                if config["http"]["host"] is not None:
                    server = await stack.enter_async_context(serve_http(client, config, pong))
                    _progress(f"serving OpenAI-compatible HTTP on {server.url} (model {server.model_name})")
                print(f"logs: {nodes.run_dir}  (Ctrl-C to stop)", flush=True)
                while not stop.is_set():
                    try:
                        await asyncio.wait_for(stop.wait(), 1.0)
                    except asyncio.TimeoutError:
                        await asyncio.to_thread(nodes.check_alive, ["verifier"])
    finally:
        await asyncio.to_thread(nodes.stop)
        print("pipespec stopped", file=sys.stderr)
    return 0


@contextlib.asynccontextmanager
async def serve_http(client: AsyncClient, config: dict[str, Any], pong: dict[str, Any] | None = None):
    """Serve ``config["http"]`` (host and port set) over ``client`` until the block ends; yields the
    :class:`http_server.serve.HttpServer` (``.url``, ``.model_name``). The model's id is ``http.model_name`` or the
    target's name from the verifier's pong."""
    from http_server.serve import HttpServer, HttpStartError

    pong = pong or await client.ping()
    try:
        sections = typed(config)
        server = HttpServer(client, sections.http, model_name=str(pong.get("target") or sections.verifier.model),
                            max_sessions=sections.verifier.max_sessions)
        async with server:
            yield server
    except HttpStartError as exc:
        raise LaunchError(str(exc)) from None


def _run_async(coro) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


#: What a command reports as one ``pipespec: error:`` line and exit code 2, without a traceback.
USER_ERRORS = (ConfigError, LaunchError, PipespecError, TimeoutError, ModelLoadError, RegistryError, KeysError)


def report_errors(run: Callable[[], int]) -> int:
    """``run()``, with a user error (:data:`USER_ERRORS`) printed as one line and exit code 2, Ctrl-C as 130."""
    try:
        return run()
    except USER_ERRORS as exc:
        print(f"pipespec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run_command(config: dict[str, Any], *, role: str | None = None, generation: argparse.Namespace | None = None,
                run_dir: str | None = None, hooks: dict[str, Any] | None = None) -> int:
    """Run a loaded config: one node (``role``), one generation (``generation``: the :func:`add_generation_args`
    flags) or the cluster until SIGINT/SIGTERM."""
    if run_dir is not None:
        run_dir = os.path.abspath(os.path.expanduser(run_dir))  # the nodes run in another directory
    if role:
        return _run_role(config, role, run_dir, hooks)
    return _run_async(_one_shot(generation, config) if generation is not None else _serve(config, run_dir))


def main(argv: list[str] | None = None, hooks: dict[str, Any] | None = None) -> int:
    """The CLI; ``hooks`` go to a ``--role`` node's ``run`` (tests/node_entry.py injects test behaviour)."""
    args = _parser().parse_args(argv)

    def run() -> int:
        if args.role and args.ray is not None:
            raise ConfigError("--ray starts every node as a Ray actor: it goes without --role")
        overrides = {**ray_overrides(args.ray), **parse_overrides(args.set)}
        if args.http is not None:
            if args.role or args.prompt is not None or args.messages:
                raise ConfigError("--http serves the cluster's API: it goes without --role, --prompt and --messages")
            overrides.update(parse_http_address(args.http))
        config = load_config(args.config, overrides)
        one_shot = args.prompt is not None or args.messages
        return run_command(config, role=args.role, generation=args if one_shot else None, run_dir=args.run_dir,
                           hooks=hooks)

    return report_errors(run)


if __name__ == "__main__":
    sys.exit(main())
