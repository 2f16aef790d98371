"""Config loading and validation.

A config is YAML with four sections (``verifier``, ``drafter``, ``verification``, ``client``) plus optional
``launch``, ``security`` and ``http`` sections. Every key has a default below; an unknown key, a bad value, an unknown
drafter type, a missing model, a device this machine lacks or missing CURVE keys fails here — before any process
starts — with a :class:`ConfigError` that names the key. ``{run_dir}`` in an endpoint is replaced by the launcher's
private run folder.

Nothing here names a drafter type: the ``drafter`` section holds the keys every type has (below) plus every
registered type's own keys, and what a type needs (a model, the target's checkpoint, its own checks) comes from its
declaration (:class:`drafter_node.spec.DrafterSpec`, listed in ``drafter_node/types.py``).
"""

from __future__ import annotations

import copy
import importlib.util
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from drafter_node import type_choice
from drafter_node.spec import DrafterSpec
from drafter_node.types import DRAFTER_TYPES, drafter_spec, drafter_specs
from runtime.config_schema import (
    SECTIONS,
    Config,
    DrafterConfig,
)
from runtime.keys import KeysError, check_api_key, read_api_keys
from runtime.paths import PACKAGE_ROOT
from shared.settings import build, checked, declared, defaults, violation
from shared.transport import EndpointError, check_endpoint, curve_wanted


def bundled_config_dir() -> Path:
    """The bundled configs: package data ``runtime/configs/`` in an installed package (pyproject.toml maps the
    checkout's top-level ``configs/`` there), else a checkout's ``configs/``."""
    from importlib.resources import files

    packaged = Path(str(files("runtime") / "configs"))  # runtime is a plain folder: never imported from a zip
    return packaged if packaged.is_dir() else PACKAGE_ROOT / "configs"


CONFIG_DIR = bundled_config_dir()
DEFAULT_CONFIG = "cpu.yaml"

#: The ``drafter`` keys every type has (declared in runtime/config_schema.py); each type's own keys are in its spec.
DRAFTER_COMMON: dict[str, Any] = defaults(DrafterConfig)


def type_keys() -> dict[str, Any]:
    """Every registered drafter type's own keys with their defaults (a key two types declare: the first one's)."""
    keys: dict[str, Any] = {}
    for spec in drafter_specs():
        for key, default in spec.keys.items():
            if key in DRAFTER_COMMON:
                raise TypeError(f"drafter type {spec.name!r} declares drafter.{key}, a key every type has")
            keys.setdefault(key, default)
    return keys


#: Every section's keys and defaults, read off the declarations (the registered types' own keys as of import;
#: load_config asks the registry).
DEFAULTS: dict[str, dict[str, Any]] = {
    name: ({**DRAFTER_COMMON, **type_keys()} if name == "drafter" else defaults(cls)) for name, cls in SECTIONS.items()
}

#: Read when ``http.api_key`` is null: a key kept out of config files and argv (``ps`` shows argv to everyone).
HTTP_API_KEY_ENV = "PIPESPEC_HTTP_API_KEY"
#: Read when ``http.admin_key`` is null: the key of ``/metrics`` and ``/health``'s details, out of files and argv.
HTTP_ADMIN_KEY_ENV = "PIPESPEC_HTTP_ADMIN_KEY"
#: Keys whose values are secrets, and the environment variable that carries each instead of argv (``--set``).
SECRET_KEYS = {"http.api_key": HTTP_API_KEY_ENV, "http.admin_key": HTTP_ADMIN_KEY_ENV}


class ConfigError(ValueError):
    """A config problem, with the offending key in the message."""


def find_config(name: str | os.PathLike) -> Path:
    """A path as given, or a bare file name looked up in ``configs/``."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    candidate = CONFIG_DIR / path.name
    if path.parent == Path(".") and candidate.exists():
        return candidate
    known = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config file {str(name)!r} not found (bundled configs: {known})")


def load_config(
    source: str | os.PathLike | dict | None = None, overrides: dict[str, Any] | list[str] | None = None
) -> dict[str, Any]:
    """Read a config (file name, path or dict), apply overrides, fill defaults and validate."""
    if source is None:
        source = DEFAULT_CONFIG
    if isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        path = find_config(source)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the config: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("a config must be a mapping of sections")
    config = merge_defaults(raw)
    for key, value in parse_overrides(overrides).items():
        set_key(config, key, value)
    config["drafter"].update(type_choice.resolve(config["drafter"]))  # drafter.type auto: before anything reads it
    validate(config)
    return config


def merge_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """The defaults with ``raw``'s values over them; the drafter types' own keys stay unset until
    :func:`validate` knows the type (its spec's defaults then fill them)."""
    config = copy.deepcopy(DEFAULTS)
    config["drafter"] = copy.deepcopy(DRAFTER_COMMON)
    for section, values in raw.items():
        if section not in DEFAULTS:
            raise ConfigError(f"{section}: unknown config section (known: {', '.join(DEFAULTS)})")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a mapping of keys")
        for key, value in values.items():
            set_key(config, f"{section}.{key}", value)
    return config


def parse_overrides(overrides: dict[str, Any] | list[str] | None) -> dict[str, Any]:
    """``["drafter.overlap=false", ...]`` (values parsed as YAML) or a ``{"drafter.overlap": False}`` dict."""
    if not overrides:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    parsed = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: use section.key=value")
        parsed[key.strip()] = yaml.safe_load(value) if value.strip() else None
        if key.strip() in SECRET_KEYS and parsed[key.strip()] is not None:
            raise ConfigError(f"--set {key.strip()}=…: a secret on the command line is visible to every user of this "
                              f"host (ps shows argv): set ${SECRET_KEYS[key.strip()]}, or put it in a config file only "
                              "you can read")
    return parsed


def set_key(config: dict[str, Any], dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    if section not in DEFAULTS:
        raise ConfigError(f"{dotted}: unknown config section {section!r} (known: {', '.join(DEFAULTS)})")
    known = {**DRAFTER_COMMON, **type_keys()} if section == "drafter" else DEFAULTS[section]
    if key not in known:
        raise ConfigError(f"{dotted}: unknown key (known in {section}: {', '.join(known)})")
    config[section][key] = value


def _check_model(config: dict[str, Any], dotted: str) -> None:
    """A named model, a saved model's folder (made absolute: the nodes run in another directory) or a hub id."""
    from shared.named_models import NAMED_MODELS

    section, key = dotted.split(".")
    value = config[section][key]
    if not value or not isinstance(value, str):
        raise ConfigError(f"{dotted}: missing model (a named model, a local folder or a hub id)")
    if value in NAMED_MODELS:
        return
    path = Path(value).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ConfigError(f"{dotted}: folder {value!r} has no config.json (not a saved transformers model)")
        config[section][key] = absolute(value)
        return
    if value.startswith((".", "/", "~")):
        raise ConfigError(f"{dotted}: folder {value!r} does not exist")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", value):
        raise ConfigError(
            f"{dotted}: {value!r} is not a named model ({', '.join(NAMED_MODELS)}), an existing folder, "
            "or a hub id of the form org/name"
        )


def absolute(path: str) -> str:
    """``path`` against the caller's directory (``~`` expanded); an absolute path as it is."""
    expanded = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.abspath(expanded)


def _check_device(dotted: str, value: Any, config_hint: str) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"cpu|auto|mps|cuda(:\d+)?", value):
        raise ConfigError(f"{dotted}: device must be cpu, cuda, cuda:N, mps or auto, got {value!r}")
    if value.startswith("cuda") or value == "auto":
        import torch

        have = torch.cuda.device_count()
        index = int(value.split(":")[1]) if ":" in value else 0
        if index >= have:
            raise ConfigError(
                f"{dotted}: {value} requested but this machine has {have} CUDA device(s); "
                f"{config_hint}"
            )


def validate(config: dict[str, Any]) -> None:
    v, d = config["verifier"], config["drafter"]
    hint = "on a machine without GPUs use configs/cpu.yaml (--config cpu.yaml)"
    llama_target = v["backend"] == "llama_cpp"  # shared/llama_target_check.py checks its model file
    if not llama_target:
        _check_model(config, "verifier.model")
    _check_device("verifier.device", v["device"], hint)
    if not isinstance(d["type"], str) or d["type"] not in DRAFTER_TYPES:
        known = ", ".join((type_choice.AUTO, *DRAFTER_TYPES))
        raise ConfigError(f"drafter.type: unknown drafter type {d['type']!r} (known: {known})")
    spec = drafter_spec(d["type"])
    from shared.llama_target_check import check_config as check_llama_cpp

    _run_hook(check_llama_cpp, config, spec.target_states)
    _check_requires(spec)
    _fill_type_keys(d, spec)
    if spec.model_defaults_to_target and d["model"] is None:
        d["model"] = v["model"]
    if spec.needs_model and not spec.model_file:  # a model file is the type's own check to make
        _check_model(config, "drafter.model")
    if spec.reads_target:
        if d["target_model"] is None:
            d["target_model"] = v["model"]
        _check_model(config, "drafter.target_model")
    d.update(_run_hook(spec.check, read_only(config)) or {})
    check_model_dependent(config)
    _check_device("drafter.device", d["device"], hint)
    _curve_from_yaml_bool(config["security"])
    _check_declared(config, spec)
    _check_ensemble(config)
    for dotted in ("verifier.endpoint", "client.endpoint", "drafter.verifier_endpoint"):
        section, key = dotted.split(".")
        value = config[section][key]
        if value is None and dotted == "drafter.verifier_endpoint":
            continue
        try:
            check_endpoint(str(value).replace("{run_dir}", "/tmp/x"), allow_remote=True)
        except EndpointError as exc:
            raise ConfigError(f"{dotted}: {exc}") from None
    if v["endpoint"] == config["client"]["endpoint"]:
        raise ConfigError("client.endpoint: must differ from verifier.endpoint (drafters and clients are separate)")
    _check_security(config)
    _check_http(config)
    _check_launch(config)
    from runtime.security import tenant_link_problem

    if problem := tenant_link_problem(config):
        raise ConfigError(problem)


def _check_launch(config: dict[str, Any]) -> None:
    """The placements parse (whatever the backend, so a config is checked before it moves to Ray), and the keys
    only the Ray backend reads are not set for the process backend."""
    from runtime.placement import PlacementError, parse_placement

    for role in ("verifier", "drafter"):
        try:
            parse_placement(config[role]["placement"], f"{role}.placement", config[role]["device"])
        except PlacementError as exc:
            raise ConfigError(str(exc)) from None
    launch = config["launch"]
    if launch["backend"] != "ray" and launch["link_delay_ms"]:
        raise ConfigError("launch.link_delay_ms: only the ray backend adds link delay (launch.backend: ray); on one "
                          "machine use python -m runtime.delay_proxy (docs/deployment.md)")


def _check_declared(config: dict[str, Any], spec: DrafterSpec) -> None:
    """Every key whose declaration says what it may be (a kind, bounds, choices, extra values such as ``auto``)
    against it; free-form strings (models, devices, endpoints, paths) have their own checks above and below."""
    own = declared(spec.settings) if spec.settings is not None else ()
    keyed = [(name, key, meta) for name, cls in SECTIONS.items() for key, _, meta in declared(cls)]
    for section, key, meta in [*keyed, *(("drafter", key, meta) for key, _, meta in own)]:
        if not checked(meta):
            continue
        value = config[section][key]
        if value is None and meta.nullable and not (section == "drafter" and key in spec.keys):
            continue  # an unset key of another drafter type; the configured type's own null key is checked
        why = violation(meta, value)
        if why is None:
            continue
        hint = f" ({meta.hint})" if meta.hint else ""
        raise ConfigError(f"{section}.{key}: {why}, got {value!r}{hint}")


def _check_security(config: dict[str, Any]) -> None:
    """The ``security`` section's values, and that every endpoint is either safe to use or refused here: CURVE
    needs a keys folder, and listening on a network interface without CURVE needs ``allow_remote: true``."""
    from runtime.keys import KeysError, check_name

    sec = config["security"]  # curve: checked against its declared choices
    for key in ("drafter_key", "client_key"):
        try:
            check_name(sec[key])
        except KeysError as exc:
            raise ConfigError(f"security.{key}: {exc}") from None
    if sec["keys_dir"] is not None and (not isinstance(sec["keys_dir"], str) or not sec["keys_dir"]):
        raise ConfigError(f"security.keys_dir: a folder path, got {sec['keys_dir']!r}")
    if sec["keys_dir"] is not None and Path(sec["keys_dir"]).expanduser().is_dir():
        sec["keys_dir"] = absolute(sec["keys_dir"])  # the nodes run in another directory
    endpoints = {"verifier.endpoint": config["verifier"]["endpoint"], "client.endpoint": config["client"]["endpoint"],
                 "drafter.verifier_endpoint": config["drafter"]["verifier_endpoint"]}
    for dotted, endpoint in endpoints.items():
        if endpoint is None:
            continue
        curve = curve_wanted(sec["curve"], endpoint)
        if curve and sec["keys_dir"] is None:
            why = "security.curve: on" if sec["curve"] == "on" else \
                "security.curve: auto turns CURVE on for every non-loopback address"
            raise ConfigError(
                f"security.keys_dir: {dotted} {endpoint!r} needs CURVE keys ({why}): run `python -m runtime.keys "
                "init DIR` and set security.keys_dir: DIR (or, on a private network only, security.curve: off with "
                "verifier.allow_remote: true)"
            )
        if curve and not Path(sec["keys_dir"]).expanduser().is_dir():
            raise ConfigError(f"security.keys_dir: folder {sec['keys_dir']!r} does not exist: create keys with "
                              f"`python -m runtime.keys init {sec['keys_dir']}`")
        if dotted != "drafter.verifier_endpoint":  # the verifier listens on these
            try:
                check_endpoint(endpoint.replace("{run_dir}", "/tmp/x"), config["verifier"]["allow_remote"], curve)
            except EndpointError as exc:
                raise ConfigError(f"{dotted}: {exc}") from None


def _check_http(config: dict[str, Any]) -> None:
    """The ``http`` section: a loopback address by default; any other address needs both an ``api_key`` (Bearer
    token) and ``http.allow_remote: true`` — the same rule as the nodes' ``allow_remote``, plus the key, since HTTP
    has no CURVE."""
    h = config["http"]
    for key, env in (("api_key", HTTP_API_KEY_ENV), ("admin_key", HTTP_ADMIN_KEY_ENV)):
        if h[key] is None and os.environ.get(env):
            h[key] = os.environ[env]
        if h[key] is not None:
            try:  # the same rule as every key of http.api_keys_file
                check_api_key(h[key], f"http.{key}")
            except KeysError as exc:
                raise ConfigError(f"{exc}, or null") from None
    if h["api_keys_file"] is not None:
        try:  # read here too, so a bad file stops the start with its line, not the first request
            named = set(read_api_keys(h["api_keys_file"]).values())
        except KeysError as exc:
            raise ConfigError(f"http.api_keys_file: {exc}") from None
        if config["verifier"].get("tenants") is None:  # the fair per-tenant defaults (verifier_node/admission.py)
            config["verifier"]["tenants"] = len(named | ({"default"} if h["api_key"] is not None else set()))
    # allow_remote, port, default_max_tokens, max_body_bytes and scrape_timeout_s: checked against their declarations
    if h["model_name"] is not None and (not isinstance(h["model_name"], str) or not h["model_name"]
                                        or len(h["model_name"]) > 256):
        raise ConfigError(f"http.model_name: a non-empty name (at most 256 characters), or null for the target's "
                          f"name, got {h['model_name']!r}")
    hosts = h["allowed_hosts"]
    if not isinstance(hosts, (list, tuple)) or not all(
            isinstance(x, str) and x and len(x) <= 253 and x.isprintable() and not any(c in x for c in " /@")
            for x in hosts):
        raise ConfigError(f"http.allowed_hosts: a list of host names (without port), got {hosts!r}")
    h["allowed_hosts"] = [x.lower().rstrip(".") for x in hosts]
    host = h["host"]
    if host is None:
        return
    if not isinstance(host, str) or not host:
        raise ConfigError(f"http.host: an IP address or localhost, got {host!r}")
    if host != "localhost":
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"http.host: {host!r} is not an IP address or localhost (name the interface's "
                              "address, e.g. 127.0.0.1 or 0.0.0.0)") from None
        if not address.is_loopback:
            keyed = h["api_key"] or h["api_keys_file"]
            missing = [what for what, ok in (("http.api_key or http.api_keys_file (Bearer tokens clients must send)",
                                              keyed),
                                             ("http.allow_remote: true", h["allow_remote"])) if not ok]
            if missing:
                raise ConfigError(
                    f"http.host: {host!r} is not a loopback address: serving HTTP on a network interface needs "
                    f"{' and '.join(missing)}; plain HTTP is not encrypted, so put a TLS proxy in front of it "
                    "beyond a private network (or use --http 127.0.0.1:PORT)")


def check_security(config: dict[str, Any], roles: tuple[str, ...] = ("verifier", "drafter", "client")) -> None:
    """The key files the given roles will load exist and can be read (``roles``: what this process starts: the
    launcher's cluster all three, ``--role X`` only X); a cluster whose verifier and drafter would disagree about
    CURVE on their link is refused."""
    from runtime import security
    from runtime.keys import KeysError

    links = security.curve_links(config)
    if {"verifier", "drafter"} <= set(roles) and config["launch"]["start_drafter"] \
            and links["verifier"] != links["drafter"]:
        raise ConfigError(
            f"security.curve: the verifier listens on {config['verifier']['endpoint']!r} "
            f"{'with' if links['verifier'] else 'without'} CURVE but the drafter connects to "
            f"{security.drafter_link(config)!r} {'with' if links['drafter'] else 'without'} it (auto decides by "
            "address): set security.curve: on, or use the same kind of address on both sides"
        )
    # the verifier's: its keys and those of security.gateway_clients
    loaders = {"verifier": security.verifier_links, "drafter": security.drafter_keys,
               "client": security.client_keys_for}
    for role in roles:
        if role == "drafter" and not config["launch"]["start_drafter"] and "verifier" in roles:
            continue  # a cluster without its own drafter: a drafter joins from elsewhere with its own keys
        try:
            loaders[role](config)
        except KeysError as exc:
            raise ConfigError(f"security.keys_dir: {exc}") from None


def _curve_from_yaml_bool(sec: dict[str, Any]) -> None:
    """YAML 1.1 reads a bare on / off as true / false (a config file or ``--set security.curve=off``)."""
    if isinstance(sec["curve"], bool):
        sec["curve"] = "on" if sec["curve"] else "off"


def _check_ensemble(config: dict[str, Any]) -> None:
    """Static ensemble verification needs q; the weight's own range is checked against its declaration."""
    if config["verification"]["ensemble_weight"] is None:
        return
    kind = config["drafter"]["type"]
    spec = drafter_spec(kind)
    if not spec.sends_q:
        raise ConfigError(
            "verification.ensemble_weight: static ensemble verification requires the draft distribution q from a "
            f"drafter model. It is not supported with {spec.title} (drafter.type: {kind})."
        )


def check_model_dependent(config: dict[str, Any]) -> None:
    """The drafter type's checks that need the model's own config.json (its spec's ``check_model``); a model that
    is not a local folder yet is skipped: a named model not converted yet (the launcher calls this again after
    converting) or a hub id (the drafter then checks when it starts)."""
    from shared.named_models import is_named_model, model_dir

    def local(name: Any) -> Path | None:
        if not isinstance(name, str) or not name:
            return None
        folder = Path(model_dir(name) if is_named_model(name) else Path(name).expanduser())
        return folder if (folder / "config.json").exists() else None

    _run_hook(drafter_spec(config["drafter"]["type"]).check_model, read_only(config), local)


def _check_requires(spec: DrafterSpec) -> None:
    """The optional packages the type needs are installed: looked up, not imported (the loader stays light and a
    package that is slow to import is imported by the drafter alone)."""
    for module, install in spec.requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a dotted name whose parent package is missing
            found = False
        if not found:
            raise ConfigError(f"drafter.type: {spec.name} ({spec.title}) needs the Python package {module!r}, "
                              f"which is not installed: {install}")


def _fill_type_keys(d: dict[str, Any], spec: DrafterSpec) -> None:
    """Every type's own keys present (so code may read any of them), unset ones at their default: the configured
    type's own default where it declares the key. Keys stay in the order of :data:`DEFAULTS`."""
    filled = {**DRAFTER_COMMON, **type_keys(), **spec.keys, **d}
    d.clear()
    d.update(copy.deepcopy(filled))


def read_only(config: dict[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    """A view of ``config`` a drafter type's hook reads but cannot change (its sections too): a hook returns what it
    normalised instead (:data:`drafter_node.spec.Normalised`)."""
    return MappingProxyType({name: MappingProxyType(section) for name, section in config.items()})


def _run_hook(hook, *args: Any) -> Any:
    """A drafter type's check and what it returns; its ValueError (the message names the key) becomes a
    :class:`ConfigError`."""
    try:
        return hook(*args)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def fill_run_dir(config: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Replace ``{run_dir}`` in endpoints by a concrete folder."""
    config = copy.deepcopy(config)
    for section, key in (("verifier", "endpoint"), ("client", "endpoint"), ("drafter", "verifier_endpoint")):
        if isinstance(config[section][key], str):
            config[section][key] = config[section][key].replace("{run_dir}", run_dir)
    return config


def typed(config: dict[str, Any]) -> Config:
    """The frozen sections of a config :func:`load_config` returned (its ``drafter.type``'s own keys in
    ``drafter_type``: see :meth:`drafter_node.spec.DrafterSpec.own_settings`). The result pickles (a node on a Ray
    cluster gets it as a call argument)."""
    own = drafter_spec(config["drafter"]["type"]).own_settings(config["drafter"])
    sections = {name: build(cls, config[name]) for name, cls in SECTIONS.items()}
    return Config(drafter_type=own, **sections)


def load_typed(source: str | os.PathLike | dict | None = None,
               overrides: dict[str, Any] | list[str] | None = None) -> Config:
    """:func:`load_config`, as frozen sections."""
    return typed(load_config(source, overrides))
