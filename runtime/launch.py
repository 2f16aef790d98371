"""Launcher: ``python -m runtime.launch --config cpu.yaml`` starts the verifier and the drafter, waits
until both are ready, and serves (or runs one generation with ``--prompt``); ``--role`` starts one node alone.

``--launcher`` (``launch.backend``) picks how the nodes run: child processes (``process``, the default), threads of
this process (``inproc``) or Ray actors (``ray``, also ``--ray``); the launchers are in ``runtime/launchers/``.
``--http HOST:PORT`` (or the config's ``http`` section) also serves an OpenAI-compatible HTTP API on the client
(:func:`serve_http`, package ``http_server``).

From Python: ``async with runtime.launchers.cluster("cpu.yaml", overrides={...}) as client:`` (also importable from
here) starts the nodes and yields an :class:`~runtime.client.AsyncClient`.

This module and ``runtime.cli`` are commands, the top of the layers (tests/test_layers.py): they may import the
HTTP server and the benchmarks; nothing in the packages imports them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from runtime.client import AsyncClient, Chunk, PipespecError
from runtime.config import ConfigError, load_config, parse_overrides, typed
from runtime.first_run import run_summary, startup_lines, type_line, with_reports
from runtime.keys import KeysError
from runtime.launch_args import (
    add_config_args,
    add_generation_args,
    add_launcher_arg,
    add_ray_arg,
    add_run_dir_arg,
    constraint,
    launcher_overrides,
    load_messages,
    parse_http_address,
)
from runtime.launchers import Launcher, LaunchOptions, cluster, connect, following, start_launcher
from runtime.launchers.node import run_node_process
from runtime.launchers.process import NODE_ENTRY, REPO_ROOT, ProcessLauncher, stop_process
from runtime.node_setup import NODE_ENV, LaunchError
from runtime.node_setup import progress as _progress
from shared.models import ModelLoadError
from shared.named_models import RegistryError
from shared.transport import ClientKeys

#: The process launcher under its old name (tests start one with ``entry=`` / ``prefix=``).
Cluster = ProcessLauncher

__all__ = ["NODE_ENTRY", "NODE_ENV", "REPO_ROOT", "USER_ERRORS", "Cluster", "LaunchError", "cluster",
           "format_metrics", "main", "parse_http_address", "report_errors", "run_command", "serve_http",
           "start_launcher", "stop_process"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.launch", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    p.add_argument("--role", choices=["verifier", "drafter"], help="start one node alone (for multi-host setups)")
    add_generation_args(p)
    add_run_dir_arg(p)
    add_launcher_arg(p)
    add_ray_arg(p)
    p.add_argument("--http", metavar="HOST:PORT",
                   help="also serve an OpenAI-compatible HTTP API there (e.g. 127.0.0.1:8000; sets http.host and "
                        "http.port; a non-loopback host needs http.api_key and http.allow_remote: true)")
    return p


async def _one_shot(args: argparse.Namespace, config: dict[str, Any]) -> int:
    params = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "temperature": args.temperature,
              "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, **constraint(args)}
    messages = load_messages(args.messages) if args.messages else None
    prompt = args.prompt
    if args.chat and prompt is not None:
        prompt, messages = None, [{"role": "user", "content": args.prompt}]
    if config["drafter"]["type_reason"]:
        _progress(type_line(config))
    async with cluster(config) as client:
        for line in startup_lines(client.startup):
            _progress(line)
        await asyncio.to_thread(_show_hosts, client.cluster)
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


def _show_hosts(launcher: Launcher) -> None:
    """Where each node landed, when that is not this machine (the Ray launcher)."""
    for name, node in launcher.nodes().items():
        hw = node.host
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
    launcher, started = await start_launcher(config, LaunchOptions(run_dir=run_dir))
    try:
        async with connect(started, config["client"]["timeout_s"]) as client:
            pong = await with_reports(client, await launcher.wait_ready(client), started.drafters)
            _ready_lines(pong, started)
            await asyncio.to_thread(_show_hosts, launcher)
            async with contextlib.AsyncExitStack() as stack:
                await stack.enter_async_context(following(launcher, started, client))
                if config["http"]["host"] is not None:
                    server = await stack.enter_async_context(serve_http(client, config, pong,
                                                                        gateway=started.gateway_keys))
                    _progress(f"serving OpenAI-compatible HTTP on {server.url} (model {server.model_name})")
                print(f"logs: {started.run_dir}  (Ctrl-C to stop)", flush=True)
                while not stop.is_set():
                    try:
                        await asyncio.wait_for(stop.wait(), 1.0)
                    except asyncio.TimeoutError:
                        await asyncio.to_thread(launcher.check_alive, ["verifier"])
    finally:
        await asyncio.to_thread(launcher.stop)
        print("pipespec stopped", file=sys.stderr)
    return 0


def _ready_lines(pong: dict[str, Any], started: Any) -> None:
    """What the cluster runs and where a client reaches it."""
    drafters = ", ".join(f"{d['id']} {d['type']}@{d['host']}" for d in pong.get("drafters") or []) or "none"
    print(f"pipespec ready: target {pong.get('target')}, drafters: {drafters}", flush=True)
    for line in startup_lines(pong):
        _progress(line)
    print(f"client address: {started.client_address}", flush=True)
    if started.client_keys is not None and started.verifier_may_move:  # keys this launcher generated for the run
        print(f"client keys: {started.run_dir}/keys (runtime.keys.client_keys(FOLDER))", flush=True)


@contextlib.asynccontextmanager
async def serve_http(client: AsyncClient, config: dict[str, Any], pong: dict[str, Any] | None = None,
                     gateway: ClientKeys | None = None):
    """Serve ``config["http"]`` (host and port set) over ``client`` until the block ends; yields the
    :class:`http_server.serve.HttpServer` (``.url``, ``.model_name``). The model's id is ``http.model_name`` or the
    target's name from the verifier's pong. ``gateway``: the run's own HTTP gateway keys (default: those of the
    :func:`~runtime.launchers.cluster` that made ``client``): the server then talks to the verifier on a client of
    its own with them, the one key that may name tenants under CURVE."""
    from http_server.serve import HttpServer, HttpStartError

    pong = pong or await client.ping()
    gateway = gateway or getattr(getattr(client, "started", None), "gateway_keys", None)
    try:
        sections = typed(config)
        async with contextlib.AsyncExitStack() as stack:
            if gateway is not None:
                client = await stack.enter_async_context(AsyncClient(client.address, timeout_s=client.timeout_s,
                                                                     curve=gateway))
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
        return run_node_process(config, role, run_dir, hooks)
    return _run_async(_one_shot(generation, config) if generation is not None else _serve(config, run_dir))


def main(argv: list[str] | None = None, hooks: dict[str, Any] | None = None) -> int:
    """The CLI; ``hooks`` go to a ``--role`` node's ``run`` (tests/node_entry.py injects test behaviour)."""
    args = _parser().parse_args(argv)

    def run() -> int:
        if args.role and (args.ray is not None or args.launcher is not None):
            raise ConfigError("--ray and --launcher start every node: they go without --role")
        overrides = {**launcher_overrides(args.launcher, args.ray), **parse_overrides(args.set)}
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
