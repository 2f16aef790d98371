"""The command-line flags the launcher's commands share (``python -m runtime.launch`` and the ``pipespec``
subcommands): the config, the launcher, the run folder, one generation, and what they turn into (config overrides,
messages, a structured-output constraint).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from runtime.config import ConfigError
from shared.config_sections import LAUNCH_BACKENDS


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


def add_launcher_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--launcher", choices=LAUNCH_BACKENDS,
                   help="how the nodes run (launch.backend): process (child processes, the default), inproc "
                        "(threads of this process: tests, debugging) or ray (actors on a Ray cluster; see --ray)")


def launcher_overrides(launcher: str | None, ray_address: str | None) -> dict[str, Any]:
    """The config keys ``--launcher NAME`` and ``--ray [ADDRESS]`` set (none without them)."""
    if launcher is not None and ray_address is not None and launcher != "ray":
        raise ConfigError(f"--ray starts the nodes on Ray: it goes without --launcher {launcher}")
    return {**({"launch.backend": launcher} if launcher else {}), **ray_overrides(ray_address)}


def parse_http_address(text: str) -> dict[str, Any]:
    """``HOST:PORT``, ``[V6]:PORT`` or a bare ``PORT`` (loopback) → ``{"http.host": …, "http.port": …}``."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit():
        raise ConfigError(f"--http {text!r}: use HOST:PORT, e.g. --http 127.0.0.1:8000")
    return {"http.host": host, "http.port": int(port)}


def load_messages(path: str) -> list[dict[str, str]]:
    try:
        messages = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--messages {path}: cannot read a JSON list of messages: {exc}") from None
    if not isinstance(messages, list):
        raise ConfigError(f"--messages {path}: expected a JSON list of {{role, content}} objects")
    return messages


def constraint(args: argparse.Namespace) -> dict[str, Any]:
    """``--json-schema FILE`` / ``--regex R`` as the client's structured-output argument."""
    if getattr(args, "json_schema", None):
        try:
            return {"json_schema": Path(args.json_schema).read_text()}
        except OSError as exc:
            raise ConfigError(f"--json-schema {args.json_schema}: cannot read the schema: {exc}") from None
    return {"regex": args.regex} if getattr(args, "regex", None) else {}
