"""Sweeps: a grid of pipespec configs (drafter type, model pair, k or schedule, placement, added link latency), each
point run on its own cluster, the results in one table and one plot.

``pipespec bench --sweep SWEEP.yaml`` runs every point with the backend its config names (the process backend by
default: every node on this machine); ``pipespec bench --ray SWEEP.yaml [--ray-address ADDR]`` sets
``launch.backend: ray`` (and ``launch.ray_address``) on every point, so each point's nodes run where its placements
say. The sweep file::

    base: cpu.yaml              # a config file (relative to the sweep file, else as --config finds it) or the
                                # name of a bundled config (default cpu.yaml)
    set: {drafter.overlap: true}  # dotted config overrides for every point (optional)
    prompts: 2                  # the first N benchmark prompts (scripts/prompts/code_prompts.json), or a list of
                                # strings, each sent as one user message (default 2)
    max_new_tokens: 32          # per prompt (default 32)
    grid:                       # the product of the axes, the first axis varying slowest; each axis a list
      drafter.type: [assistant, prompt_lookup]  # a dotted config key: each value sets it
      k: [4, 8]                 # drafter.num_draft_tokens = K with drafter.draft_schedule: constant (unless `set`
                                # or another axis sets the schedule: then K is where it starts); a type with a
                                # block length of its own (prompt_lookup, suffix) gets K there too; a type whose k
                                # is fixed (mtp) makes the point invalid
      schedule: [cost, constant]  # drafter.draft_schedule
      link_delay_ms: [0, 5]     # launch.link_delay_ms (the ray backend only: invalid with the process backend)
      pair:                     # any other name: each value a mapping of overrides (dotted keys, or k, schedule,
        - {name: qwen-1.5b+0.5b, verifier.model: qwen2.5-coder-1.5b-instruct,   # link_delay_ms); `name` labels
           drafter.model: qwen2.5-coder-0.5b-instruct}                          # the value (default AXIS#N)
      placement:
        - {name: drafter-on-cpu-host, drafter.placement: {resources: {cpu_host: 1}}}

A point's config is ``base``, then ``set``, then its axis values, then the command line's (``--ray``). A point
whose config does not validate is reported as skipped with the error and the sweep goes on; a sweep file that is
wrong (an unknown key, an axis that is not a list, two axes setting one key, ...) is one error naming the key,
before anything runs. Each point, one after another (not interleaved: a host whose speed drifts moves the points
apart): start the cluster, one warm-up generation of :data:`benchmarks.runner.WARMUP_TOKENS` tokens on a prompt of
its own (:data:`WARMUP_MESSAGES`: a drafter that learns across requests has seen none of the measured ones), then
the prompts greedily, one at a time. Recorded per point: tokens/s (all new tokens ÷ the generations' wall time), α
(accepted ÷ drafted tokens), τ (1 + accepted tokens ÷ drafts), mean k (drafted tokens ÷ drafts), the verifier's and
drafters' busy fractions (weighted by each request's time), each node's hardware (:func:`node_hardware`), and
whether the output token ids equal those of the first point that ran with the same target model and verifier dtype
(greedy decoding must give the same tokens: a mismatch is reported, never hidden).

Outputs in ``--out`` (default ``results/``): ``sweep.md`` (a header with the date, machine, command and sweep, then
one table), ``sweep.json`` (the points with every prompt's token ids and metrics; rewritten as each point starts,
after every prompt and after every point, so a late failure keeps what was measured) and ``sweep.png`` (tokens/s
per point, bars labelled by the point's axis values). ``--dry-run`` prints the points (and the skipped ones with
their errors) without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.progress import log, utc_now
from benchmarks.prompts import prompt_dir
from benchmarks.results import write_result
from benchmarks.runner import WARMUP_TOKENS
from benchmarks.summary import token_mismatches
from benchmarks.tables import fmt, header_lines, md_table

#: The keys of a sweep file.
FILE_KEYS = ("base", "set", "prompts", "max_new_tokens", "grid")
#: Named axes (also allowed as keys of a mapping value): the config key each sets.
NAMED_AXES = {"k": "drafter.num_draft_tokens", "schedule": "drafter.draft_schedule",
              "link_delay_ms": "launch.link_delay_ms"}
DEFAULT_PROMPTS = 2
DEFAULT_MAX_NEW_TOKENS = 32
PROMPTS_FILE = "code_prompts.json"
#: What each point's warm-up generation decodes (none of the measured prompts).
WARMUP_MESSAGES = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]


class SweepError(ValueError):
    """A sweep file that cannot run; the message names the file and the key."""


@dataclass(frozen=True)
class Value:
    """One value of an axis: its label and the config overrides it sets (``k``: the named k axis's value, whose
    schedule and block-length keys depend on the rest of the point)."""

    label: str
    overrides: dict[str, Any]
    k: int | None = None


@dataclass(frozen=True)
class Axis:
    name: str
    values: list[Value]


@dataclass
class Sweep:
    """A sweep file, read and checked (:func:`read_sweep`)."""

    path: str
    base: str  # the base config's path, or a bundled config's name
    set: dict[str, Any]
    prompts: int | list[str]
    max_new_tokens: int
    axes: list[Axis]
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class Point:
    """One point of the grid: its axis labels, its overrides over the base config, and why it cannot run (None: it
    can)."""

    index: int
    labels: dict[str, str]
    overrides: dict[str, Any]
    error: str | None = None

    @property
    def label(self) -> str:
        return ", ".join(f"{short_name(a)}={v}" for a, v in self.labels.items()) or "base"


def short_name(axis: str) -> str:
    """An axis as the labels show it: a config key's last part (``drafter.type`` → ``type``), else its name."""
    return axis.rsplit(".", 1)[-1]


# ---------------------------------------------------------------------------------------------- the sweep file


def _label(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _check_key(dotted: str, where: str) -> None:
    """``dotted`` names a config key (any drafter type's keys included)."""
    from runtime.config import ConfigError, merge_defaults, set_key

    if not isinstance(dotted, str) or "." not in dotted:
        raise SweepError(f"{where}: {dotted!r} is not a config key (section.key)")
    try:
        set_key(merge_defaults({}), dotted, None)
    except ConfigError as exc:
        raise SweepError(f"{where}: {exc}") from None


def _scalar(value: Any, where: str) -> Any:
    if isinstance(value, (dict, list)):
        raise SweepError(f"{where}: a single value (number, string or boolean), got {value!r}")
    return value


def _named(name: str, value: Any, where: str) -> tuple[dict[str, Any], int | None]:
    """The overrides of a named axis's value (and k's value)."""
    value = _scalar(value, where)
    if name == "k":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SweepError(f"{where}: k must be a positive integer, got {value!r}")
        return {NAMED_AXES[name]: value}, value
    return {NAMED_AXES[name]: value}, None


def _mapping_value(axis: str, i: int, value: Any) -> Value:
    where = f"grid.{axis}[{i}]"
    if not isinstance(value, dict):
        raise SweepError(f"{where}: axis {axis!r} is not a config key or a named axis ({', '.join(NAMED_AXES)}), "
                         f"so each value is a mapping of overrides with a name; got {value!r}")
    name = value.get("name", f"{axis}#{i + 1}")
    if not isinstance(name, str) or not name:
        raise SweepError(f"{where}.name: a non-empty string, got {name!r}")
    overrides: dict[str, Any] = {}
    k = None
    for key, v in value.items():
        if key == "name":
            continue
        if key in NAMED_AXES:
            more, k_value = _named(key, v, f"{where}.{key}")
            k = k_value if k_value is not None else k
            overrides |= more
        else:
            _check_key(key, f"{where}.{key}")
            overrides[key] = v
    if not overrides:
        raise SweepError(f"{where}: sets nothing (give it config keys besides its name)")
    return Value(name, overrides, k)


def _axis(name: Any, values: Any) -> Axis:
    if not isinstance(name, str) or not name:
        raise SweepError(f"grid: axis names are strings, got {name!r}")
    where = f"grid.{name}"
    if not isinstance(values, list) or not values:
        raise SweepError(f"{where}: a non-empty list of values, got {values!r}")
    out = []
    for i, value in enumerate(values):
        if name in NAMED_AXES:
            overrides, k = _named(name, value, f"{where}[{i}]")
            out.append(Value(_label(value), overrides, k))
        elif "." in name:
            _check_key(name, where)
            out.append(Value(_label(value), {name: value}))
        else:
            out.append(_mapping_value(name, i, value))
    labels = [v.label for v in out]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise SweepError(f"{where}: the value {twice[0]!r} comes twice (name the values of an axis apart)")
    return Axis(name, out)


def _base(value: Any, folder: Path) -> str:
    from runtime.config import DEFAULT_CONFIG, ConfigError, find_config

    if value is None:
        value = DEFAULT_CONFIG
    if not isinstance(value, str) or not value:
        raise SweepError(f"base: a config file or the name of a bundled config, got {value!r}")
    beside = folder / Path(value).expanduser()
    if beside.is_file():
        return str(beside.resolve())
    try:
        found = find_config(value)
    except ConfigError as exc:
        raise SweepError(f"base: {exc}") from None
    return str(found.resolve())


def read_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file (the format is in the module's docstring); :class:`SweepError` names the key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SweepError(f"{path}: cannot read the sweep file: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SweepError(f"{path}: not valid YAML: {exc}") from None
    try:
        return _parse(raw, path)
    except SweepError as exc:
        raise SweepError(f"{path}: {exc}") from None


def _parse(raw: Any, path: Path) -> Sweep:
    if not isinstance(raw, dict):
        raise SweepError(f"a sweep file is a mapping of {', '.join(FILE_KEYS)}")
    unknown = [k for k in raw if k not in FILE_KEYS]
    if unknown:
        raise SweepError(f"{unknown[0]}: unknown key (a sweep file has {', '.join(FILE_KEYS)})")
    base = _base(raw.get("base"), path.parent)
    overrides = raw.get("set") or {}
    if not isinstance(overrides, dict):
        raise SweepError(f"set: a mapping of dotted config keys to values, got {overrides!r}")
    for key in overrides:
        _check_key(key, f"set.{key}")
    prompts = raw.get("prompts", DEFAULT_PROMPTS)
    if isinstance(prompts, list):
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise SweepError("prompts: a positive number of benchmark prompts, or a list of non-empty strings")
    else:
        available = len(benchmark_prompts(None))
        if isinstance(prompts, bool) or not isinstance(prompts, int) or not 1 <= prompts <= available:
            raise SweepError(f"prompts: a number of benchmark prompts from 1 to {available} (or a list of strings), "
                             f"got {prompts!r}")
    max_new = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise SweepError(f"max_new_tokens: a positive integer, got {max_new!r}")
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict):
        raise SweepError(f"grid: a mapping of axis → list of values, got {grid!r}")
    axes = [_axis(name, values) for name, values in grid.items()]
    sweep = Sweep(str(path), base, dict(overrides), prompts, max_new, axes, raw)
    _check_conflicts(sweep)
    return sweep


def _check_conflicts(sweep: Sweep) -> None:
    """Two axes that set one config key (in any combination of their values) make the point's value depend on
    their order: the file is wrong."""
    sets = {a.name: {key for v in a.values for key in v.overrides} for a in sweep.axes}
    for a, b in itertools.combinations(sweep.axes, 2):
        shared = sorted(sets[a.name] & sets[b.name])
        if shared:
            raise SweepError(f"grid.{b.name}: sets {shared[0]}, as grid.{a.name} does (one axis per key)")


# ---------------------------------------------------------------------------------------------- the grid


def _base_type(base: str) -> str:
    """The base config's drafter type (without validating the base: a point's overrides may complete it)."""
    from drafter_node.types import DEFAULT_DRAFTER_TYPE
    from runtime.config import find_config

    try:
        raw = yaml.safe_load(find_config(base).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError, ValueError):
        return DEFAULT_DRAFTER_TYPE
    drafter = raw.get("drafter") if isinstance(raw, dict) else None
    kind = drafter.get("type") if isinstance(drafter, dict) else None
    return kind if isinstance(kind, str) else DEFAULT_DRAFTER_TYPE


def expand(sweep: Sweep, extra: dict[str, Any] | None = None) -> list[Point]:
    """Every point of the grid, in order (the first axis varying slowest), with its overrides; a point whose config
    does not validate carries the error. ``extra``: overrides over every point's (the command line's)."""
    from drafter_node.types import DRAFTER_TYPES, drafter_spec
    from runtime.config import ConfigError, load_config

    base_type = _base_type(sweep.base)
    points = []
    combos = itertools.product(*(a.values for a in sweep.axes)) if sweep.axes else [()]
    for index, combo in enumerate(combos, 1):
        explicit: dict[str, Any] = {}
        for value in combo:
            explicit |= value.overrides
        overrides = {**sweep.set, **explicit, **(extra or {})}
        k = next((v.k for v in combo if v.k is not None), None)
        point = Point(index, {a.name: v.label for a, v in zip(sweep.axes, combo)}, overrides)
        points.append(point)
        if k is not None:
            kind = overrides.get("drafter.type", base_type)
            spec = drafter_spec(kind) if kind in DRAFTER_TYPES else None  # an unknown type: load_config says so
            if spec is not None and spec.fixed_k:
                point.error = f"k: drafter.type {kind}: {spec.fixed_k}, so k cannot be set"
                continue
            if "drafter.draft_schedule" not in overrides:
                overrides["drafter.draft_schedule"] = "constant"
            block_key = f"drafter.{spec.block_length_key}" if spec is not None and spec.block_length_key else None
            if block_key and block_key not in explicit:
                overrides[block_key] = k
        try:
            load_config(sweep.base, overrides)
        except ConfigError as exc:
            point.error = str(exc)
    return points


# ---------------------------------------------------------------------------------------------- running


def benchmark_prompts(n: int | None) -> list[list[dict[str, str]]]:
    """The chat messages of the first ``n`` benchmark prompts (all of them: None)."""
    prompts = json.loads((prompt_dir() / PROMPTS_FILE).read_text(encoding="utf-8"))
    return [p["messages"] for p in prompts[:n]]


def sweep_messages(sweep: Sweep) -> list[list[dict[str, str]]]:
    """The chat messages each point decodes, in order."""
    if isinstance(sweep.prompts, list):
        return [[{"role": "user", "content": text}] for text in sweep.prompts]
    return benchmark_prompts(sweep.prompts)


async def node_hardware(client: Any) -> dict[str, dict[str, Any]]:
    """Each node's hardware, ``{node name: {"ip", "host", "cpu", "cores", "gpu", "threads"}}``: where the launcher
    says each node runs (:meth:`runtime.launchers.base.Launcher.nodes`), with the threads each node reported at
    start-up (else its config's)."""
    nodes = await asyncio.to_thread(client.cluster.nodes)
    out = {name: dict(node.host) for name, node in nodes.items()}
    config = client.config
    reports = (client.startup or {}).get("reports") or []
    drafters = [n for n in out if n != "verifier"]
    for name, hw in out.items():
        role = "verifier" if name == "verifier" else "drafter"
        threads = config[role]["threads"]
        if role == "verifier" and reports:
            threads = (reports[0].get("verifier_threads") or {}).get("full", threads)
        elif len(reports) == len(drafters):
            threads = (reports[drafters.index(name)].get("drafter_threads") or {}).get("full", threads)
        hw["threads"] = threads
    return out


def _log_tails(client: Any) -> str:
    nodes = client.cluster
    return "\n".join(f"--- end of {name} log ---\n{nodes.log_tail(name)}" for name in nodes.nodes())


async def _generate(client: Any, messages: list[dict[str, str]], max_new_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        r = await client.generate(messages=messages, max_new_tokens=max_new_tokens, do_sample=False)
    except Exception as exc:  # keep the node logs with the error text
        raise RuntimeError(f"{type(exc).__name__}: {exc}\n{_log_tails(client)}".rstrip()) from exc
    return {"token_ids": list(r.token_ids), "new_tokens": len(r.token_ids), "time_s": time.perf_counter() - t0,
            "metrics": r.metrics}


async def run_point(sweep: Sweep, point: Point, record: dict[str, Any], messages: list[list[dict[str, str]]],
                    save: Any) -> None:
    """Start the point's cluster, warm up, decode every prompt into ``record`` (``save()`` after each prompt)."""
    from runtime.launchers import cluster

    t0 = time.perf_counter()
    async with cluster(sweep.base, overrides=point.overrides) as client:
        record["start_s"] = time.perf_counter() - t0
        config = client.config
        record["target"] = config["verifier"]["model"]
        record["drafter"] = {"type": config["drafter"]["type"], "model": config["drafter"].get("model")}
        record["backend"] = config["launch"]["backend"]
        record["hardware"] = await node_hardware(client)
        record["startup"] = (client.startup or {}).get("reports") or []
        log(f"point {point.index}: ready in {record['start_s']:.1f} s; hardware: {hardware_text(record['hardware'])}")
        await _generate(client, WARMUP_MESSAGES, WARMUP_TOKENS)
        for i, m in enumerate(messages):
            result = await _generate(client, m, sweep.max_new_tokens)
            record["per_prompt"].append(result)
            met = result["metrics"]
            log(f"point {point.index} ({point.label}): prompt {i + 1}/{len(messages)}: {result['new_tokens']} "
                f"tokens in {result['time_s']:.2f} s ({result['new_tokens'] / result['time_s']:.2f} tok/s), "
                f"α {met.get('acceptance_rate', 0.0):.2f}, τ {met.get('mean_accepted_length', 0.0):.2f}")
            save()


def new_report(sweep: Sweep, points: list[Point], command: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The report before anything ran: every point pending or skipped."""
    meta = {"start": utc_now(), "end": None, "command": command, "sweep_file": sweep.path, "sweep": sweep.raw,
            "base": sweep.base, "set": sweep.set, "command_set": extra,
            "prompts": sweep.prompts if isinstance(sweep.prompts, list) else f"{sweep.prompts} from {PROMPTS_FILE}",
            "max_new_tokens": sweep.max_new_tokens, "warmup_tokens": WARMUP_TOKENS,
            "axes": [a.name for a in sweep.axes]}
    records = [{"index": p.index, "label": p.label, "axes": p.labels, "overrides": p.overrides,
                "status": "skipped" if p.error else "pending", "error": p.error, "per_prompt": []} for p in points]
    return {"meta": meta, "points": records}


async def run_sweep(sweep: Sweep, points: list[Point], out: Path, report: dict[str, Any]) -> dict[str, Any]:
    """Run every point that can run, in order, writing the reports after each prompt (json) and point (all)."""
    records = {r["index"]: r for r in report["points"]}

    def save(final: bool = False) -> None:
        try:
            write_reports(out, report, final)
        except Exception:  # a report bug must not end a long run; the final write raises it again
            if final:
                raise
            log("WARNING: writing the report failed:\n" + traceback.format_exc())

    runnable = [p for p in points if not p.error]
    for p in points:
        if p.error:
            log(f"point {p.index}/{len(points)} ({p.label}): skipped: {p.error.splitlines()[0]}")
    save()
    for n, point in enumerate(runnable, 1):
        record = records[point.index]
        record["status"] = "running"
        save()  # a run that dies now shows which point it was on
        log(f"point {point.index}/{len(points)} ({point.label}), {n} of {len(runnable)} to run: starting with "
            + ", ".join(f"{k}={_label(v)}" for k, v in point.overrides.items()))
        try:
            await run_point(sweep, point, record, sweep_messages(sweep), save)
            record["status"] = "ok"
        except Exception as exc:  # a point that fails is reported; the next one runs
            record |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            log(f"point {point.index} ({point.label}) failed: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        save(final=n == len(runnable))
    if not runnable:
        save(final=True)
    return report


# ---------------------------------------------------------------------------------------------- summaries


def _weighted(per_prompt: list[dict[str, Any]], name: str, weight: str) -> float | None:
    parts = [(p["metrics"].get(weight) or 0.0, p["metrics"].get(name)) for p in per_prompt]
    total = sum(w for w, v in parts if v is not None)
    return sum(w * v for w, v in parts if v is not None) / total if total else None


def summarize_point(record: dict[str, Any]) -> dict[str, Any]:
    """The table row of one point: its status and, where prompts finished, the totals and ratios."""
    row = {k: record.get(k) for k in ("index", "label", "axes", "status", "error", "target", "hardware")}
    pp = record.get("per_prompt") or []
    if not pp:
        return row
    time_s = sum(p["time_s"] for p in pp)
    ms = [p["metrics"] for p in pp]
    drafts, drafted, accepted = (sum(m.get(n, 0) for m in ms) for n in ("drafts", "draft_tokens", "accepted_tokens"))
    dtypes = sorted({str(m.get("verifier_dtype")) for m in ms})
    row |= {"prompts": len(pp), "new_tokens": sum(p["new_tokens"] for p in pp), "time_s": time_s,
            "tokens_per_s": sum(p["new_tokens"] for p in pp) / time_s if time_s else None,
            "alpha": accepted / drafted if drafted else None, "tau": 1 + accepted / drafts if drafts else None,
            "k": drafted / drafts if drafts else None,
            "verifier_busy": _weighted(pp, "verifier_busy_fraction", "elapsed_s"),
            "drafter_busy": _weighted(pp, "drafter_busy_fraction", "elapsed_s"),
            "verifier_dtype": "/".join(dtypes)}
    return row


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every point's row, with the token-identity check: a point's outputs against those of the first point with
    finished prompts and the same target model and verifier dtype (``mismatches`` "ref" for that one, else
    "D/N vs #I": D of the N prompts both decoded differ)."""
    rows = [summarize_point(r) for r in report["points"]]
    refs: dict[tuple[str, str], dict[str, Any]] = {}
    records = {r["index"]: r for r in report["points"]}
    for row in rows:
        if not row.get("prompts"):
            continue
        group = (str(row["target"]), row["verifier_dtype"])
        ref = refs.setdefault(group, row)
        if ref is row:
            row["mismatches"] = "ref"
            continue
        mine, theirs = records[row["index"]]["per_prompt"], records[ref["index"]]["per_prompt"]
        detail = token_mismatches(mine, theirs)
        row |= {"mismatches": f"{len(detail)}/{min(len(mine), len(theirs))} vs #{ref['index']}",
                "mismatch_detail": detail, "token_ref": ref["index"]}
    return rows


# ---------------------------------------------------------------------------------------------- reports


def hardware_text(nodes: dict[str, dict[str, Any]] | None, role: str | None = None) -> str:
    """``name: host, GPU or CPU, N threads`` per node (of ``role``: ``verifier``, or ``drafter`` for every
    drafter node)."""
    parts = []
    for name, hw in (nodes or {}).items():
        if role and (name == "verifier") != (role == "verifier"):
            continue
        threads = hw.get("threads")
        what = hw.get("gpu") or hw.get("cpu") or "?"
        parts.append((name, f"{hw.get('host') or '?'}: {what}" + (f", {threads} thread{'s' * (threads != 1)}"
                                                                     if threads is not None else "")))
    named = role is None or len(parts) > 1
    return "; ".join(f"{name} {text}" if named else text for name, text in parts) or "—"


def _status(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return "ok"
    return {"skipped": "skipped (see notes)", "failed": "failed (see notes)"}.get(row["status"], row["status"])


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta, rows = report["meta"], report["rows"]
    prompts = meta["prompts"]
    shown_prompts = f"{len(prompts)} given in the sweep file" if isinstance(prompts, list) else prompts
    extra = ", ".join(f"{k}={_label(v)}" for k, v in (meta.get("command_set") or {}).items())
    lines = ["# pipespec sweep", "", *header_lines(meta),
             "- nodes: the machine above ran the sweep; where each point's nodes ran is in its hardware columns",
             f"- command: `{meta['command']}`",
             f"- sweep file: `{meta['sweep_file']}`; base config `{meta['base']}`"
             + (f"; set on every point: {', '.join(f'{k}={_label(v)}' for k, v in meta['set'].items())}"
                if meta["set"] else "") + (f"; from the command line: {extra}" if extra else ""),
             f"- prompts: {shown_prompts}, chat-templated by the target, greedy; max_new_tokens "
             f"{meta['max_new_tokens']}; one warm-up generation of {meta['warmup_tokens']} tokens per point (on a "
             "prompt of its own); the points ran one after another, each on its own cluster",
             "- tok/s = new tokens ÷ the generations' wall time; α = accepted ÷ drafted tokens; τ = 1 + accepted "
             "tokens ÷ drafts; mean k = drafted tokens ÷ drafts; busy = the node's busy fraction (weighted by each "
             "request's time); mismatches = prompts whose token ids differ from those of the point named (the first "
             "with the same target model and verifier dtype; ref: that point)", ""]
    axes = meta["axes"]
    header = ["#", *axes, "status", "tok/s", "α", "τ", "mean k", "verifier busy", "drafter busy", "verifier hardware",
              "drafter hardware", "mismatches"]
    body = []
    for r in rows:
        body.append([str(r["index"]), *(f"`{r['axes'].get(a, '')}`" for a in axes), _status(r),
                     fmt(r.get("tokens_per_s")), fmt(r.get("alpha")), fmt(r.get("tau")), fmt(r.get("k"), ".1f"),
                     fmt(r.get("verifier_busy"), ".0%"), fmt(r.get("drafter_busy"), ".0%"),
                     hardware_text(r.get("hardware"), "verifier") if r.get("hardware") else "—",
                     hardware_text(r.get("hardware"), "drafter") if r.get("hardware") else "—",
                     r.get("mismatches", "—")])
    lines += md_table(header, body, "r" + "l" * len(axes) + "lrrrrrrllr")
    notes = []
    targets = sorted({str(r["target"]) for r in rows if r.get("target")})
    if targets:
        notes.append("- target models: " + ", ".join(f"`{t}`" for t in targets))
    for r in rows:
        if r.get("mismatch_detail"):
            detail = ", ".join(f"prompt {m['prompt'] + 1} from token {m['first_diff']}" for m in r["mismatch_detail"])
            notes.append(f"- point {r['index']} ({r['label']}): output differs from point {r['token_ref']} on "
                         f"{detail}.")
    same: dict[tuple[str, str], list[dict[str, Any]]] = {}  # one note per status and error text
    for r in rows:
        if r["status"] in ("skipped", "failed") and r.get("error"):
            same.setdefault((r["status"], r["error"].rstrip()), []).append(r)
    for (status, error), group in same.items():
        which = f"point {group[0]['index']} ({group[0]['label']})" if len(group) == 1 else \
            "points " + ", ".join(str(r["index"]) for r in group)
        notes += [f"- {which} {status}:", "", "```text", error, "```"]
    if notes:
        lines += ["", "Notes:", "", *notes]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_plot(path: Path, report: dict[str, Any]) -> None:
    """Tokens/s per point that ran, each bar labelled by the point's axis values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in report["rows"] if r.get("tokens_per_s")]
    if not shown:
        log("no point finished a prompt: no plot")
        path.unlink(missing_ok=True)  # never leave an earlier run's plot next to this run's table
        return
    targets = sorted({str(r["target"]) for r in shown})
    palette = ["#264653", "#2a9d8f", "#e9c46a", "#f4a261", "#e76f51", "#8ab17d"]
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(shown) + 2), 5.0))
    xs = list(range(len(shown)))
    bars = ax.bar(xs, [r["tokens_per_s"] for r in shown],
                  color=[palette[targets.index(str(r["target"])) % len(palette)] for r in shown])
    for bar, r in zip(bars, shown):
        mark = "" if r.get("mismatches") in ("ref", None) or r["mismatches"].startswith("0/") else " ≠"
        ax.annotate(f"{r['tokens_per_s']:.2f}{mark}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    labels = ["\n".join([f"#{r['index']}", *(f"{short_name(a)}={v}" for a, v in r["axes"].items())]) for r in shown]
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylim(0, max(r["tokens_per_s"] for r in shown) * 1.2)
    ax.set_ylabel("tokens/s")
    meta = report["meta"]
    skipped = sum(r["status"] != "ok" for r in report["rows"])
    ax.set_title(f"pipespec sweep: tokens/s per point (greedy, max_new_tokens {meta['max_new_tokens']})"
                 + (f"; {skipped} point(s) skipped or failed" if skipped else ""), fontsize=9)
    if len(targets) > 1:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=palette[i % len(palette)], label=Path(t).name) for i, t in enumerate(targets)],
                  fontsize=7, title="target", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(out: Path, report: dict[str, Any], final: bool) -> None:
    """sweep.json and sweep.md; sweep.png too when ``final``."""
    report["rows"] = summarize(report)
    if final:
        report["meta"]["end"] = utc_now()
    write_result(out / "sweep.json", report)
    write_markdown(out / "sweep.md", report)
    if final:
        write_plot(out / "sweep.png", report)
        log(f"wrote {out / 'sweep.md'}, {out / 'sweep.png'}, {out / 'sweep.json'}")


# ---------------------------------------------------------------------------------------------- main


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="The sweep file's format: docs/benchmarks.md, \"Sweeps\", or pydoc "
                                       "benchmarks.sweep.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--sweep", type=Path, metavar="SWEEP.yaml",
                       help="run the sweep with the backend its configs name (the process backend by default)")
    which.add_argument("--ray", type=Path, metavar="SWEEP.yaml",
                       help="run the sweep on Ray: launch.backend ray on every point (needs Ray installed)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="with --ray: the cluster to join (ray://HOST:PORT or HOST:PORT; default: a local Ray)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: results/)")
    p.add_argument("--dry-run", action="store_true", help="print the points and the skipped ones, run nothing")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(prog)
    args = p.parse_args(argv)
    name = p.prog
    if args.ray_address and not args.ray:
        p.error("--ray-address goes with --ray")
    extra: dict[str, Any] = {}
    if args.ray:
        extra["launch.backend"] = "ray"
        if args.ray_address:
            extra["launch.ray_address"] = args.ray_address
    try:
        sweep = read_sweep(args.ray or args.sweep)
        points = expand(sweep, extra)
    except SweepError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    runnable = [p for p in points if not p.error]
    log(f"sweep {sweep.path}: {len(points)} point(s), {len(runnable)} to run, {len(points) - len(runnable)} skipped")
    if args.dry_run:
        for point in points:
            what = f"skipped: {point.error}" if point.error else ", ".join(
                f"{k}={_label(v)}" for k, v in point.overrides.items()) or "the base config"
            print(f"{point.index:3d}  {point.label}: {what}")
        return 0
    if args.ray and importlib.util.find_spec("ray") is None:  # a dry run needs no Ray: it only expands the grid
        from runtime.ray_launch import INSTALL_HINT

        print(f"{name}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    from runtime.paths import results_dir

    out = args.out or results_dir()
    out.mkdir(parents=True, exist_ok=True)
    command = f"{prog or 'python -m benchmarks.sweep'} {shlex.join(argv)}"
    report = new_report(sweep, points, command, extra)
    asyncio.run(run_sweep(sweep, points, out, report))
    print((out / "sweep.md").read_text(encoding="utf-8"))
    return 1 if any(r["status"] == "failed" for r in report["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
