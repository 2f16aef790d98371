#!/usr/bin/env python
"""Shared machinery of ``scripts/bench.py`` and ``scripts/bench_types.py``: rows that run interleaved, prompt by
prompt, in long-lived processes, and the report parts both benchmarks print.

- **Setups** hold models across prompts: an :class:`HFSetup` is one persistent worker subprocess per (dtype,
  threads) holding the target and any assistants it was asked for, driven over stdin/stdout JSON lines (one request
  per generation, see :func:`worker_main`); a :class:`ClusterSetup` is one ``runtime.launch.cluster`` kept open.
- **Rows** (:class:`Row`) are what the tables show: a transformers strategy in a worker, or a pipespec cluster.
- **Passes** (:func:`plan_passes`): the setups that fit in memory together. Within a pass every row decodes prompt i
  before any row starts prompt i + 1, in an order rotated per prompt, so a host whose speed changes slows all rows
  alike. A row's ratios are taken against its anchor (the reference row) measured in the same pass; the anchor is
  repeated in every pass that needs it.
- **Reports**: :func:`header_lines` (machine, software, times, passes), :func:`md_table`, the cost-curve table and
  plot.

Run as a script only as a worker: ``bench_common.py --worker SPEC_JSON`` (started by :class:`Worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

WARMUP_TOKENS = 8
PROCESS_GIB = 0.5  # resident memory of one Python process with torch and transformers, before any model (measured)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

from shared.costs.hardware import cpu_model_name, hardware_flags  # noqa: E402
from shared.costs.measure import measure_curve  # noqa: E402

_START = time.time()  # progress lines show seconds since this (workers get the parent's through their spec)


def log(message: str) -> None:
    """One progress line on stderr with the elapsed time of the whole run."""
    print(f"[bench {time.time() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------- machine


def available_threads() -> int:
    """The CPUs this process may run on (the affinity count), else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def thread_variants() -> list[tuple[str, int, str]]:
    """(tag, threads, device) of the transformers setups: 1 thread and all threads on a CPU machine (one when they
    are the same), one setup on the GPU of a GPU machine."""
    n = available_threads()
    if gpu_name():
        return [("gpu", n, "cuda")]
    return [(f"{t}t", t, "cpu") for t in sorted({1, n})]


def _meminfo_gib(field_name: str) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 2**20
    return None


def memory_budget_gib(requested: float | None) -> float:
    """``--memory-gib`` if given, else 90 % of the memory available now."""
    if requested:
        return requested
    available = _meminfo_gib("MemAvailable")
    return 0.9 * available if available else 16.0


def peak_rss_gib(pid: int) -> float | None:
    """High-water mark of a process's resident memory (Linux), for checking the planner's estimates."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return None


def machine_info() -> dict[str, Any]:
    versions = {}
    for pkg in ("torch", "transformers", "pyzmq"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    flags = hardware_flags()
    return {"cpu": cpu_model_name(), "cores": available_threads(), "logical_cpus": os.cpu_count(),
            "flags": {k: bool(flags.get(k)) for k in ("avx2", "avx512_bf16", "amx")}, "gpu": gpu_name(),
            "memory_gib": _meminfo_gib("MemTotal"), "python": platform.python_version(), "versions": versions}


def header_lines(meta: dict[str, Any]) -> list[str]:
    """The lines every benchmark report starts with: times, machine, software, models, dtypes, threads, passes."""
    m = meta["machine"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["flags"].items())
    memory = f"{m['memory_gib']:.1f} GiB memory" if m.get("memory_gib") else "memory unknown"
    end = f"{meta['end'][11:19]} UTC ({_duration(meta['start'], meta['end'])})" if meta.get("end") else "not finished"
    lines = [f"- date (UTC): {meta['start'][:10]}; run {meta['start'][11:19]} – {end}",
             f"- machine: {m['cpu']}; {m['cores']} cores usable ({m['logical_cpus']} logical CPUs); {flags}; "
             f"{memory}; GPU: {m['gpu'] or 'none'}",
             f"- software: python {m['python']}, " + ", ".join(f"{k} {v}" for k, v in m["versions"].items())]
    for name in ("models", "dtypes", "threads"):
        if meta.get(name):
            lines.append(f"- {name}: {meta[name]}")
    passes = meta.get("passes") or []
    if passes:
        lines.append(f"- interleaving: every row decodes prompt i before any row starts prompt i + 1, the row order "
                     f"rotated by one per prompt; one warm-up generation of {WARMUP_TOKENS} tokens per row first")
    if len(passes) > 1:
        lines.append(f"- {len(passes)} passes (not all setups fit in the memory budget of "
                     f"{meta['memory_budget_gib']:.1f} GiB at once); rows are interleaved within a pass only, and "
                     "each row's ratios are taken against the reference measured in its own pass:")
        for p in passes:
            times = f"{p['start'][11:19]} – {(p.get('end') or '')[11:19] or 'not finished'} UTC" if p.get("start") \
                else "not started"
            lines.append(f"  - pass {p['index']} ({times}, estimated {p['estimated_gib']:.1f} GiB): "
                         + ", ".join(f"`{k}`" for k in p["rows"]))
    return lines


def _duration(start: str, end: str) -> str:
    seconds = (dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)).total_seconds()
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


# ---------------------------------------------------------------------------------------------- tables


def fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def md_table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """A markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(r) + " |" for r in [header, rule, *rows]]


def build_random_pair(root: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                      max_positions: int, deep_scale: float, seed: int) -> tuple[Path, Path]:
    """Save a random Qwen2-style target and its 1-layer cut (the same embeddings, first layer, norm and LM head) with
    the tests' tiny tokenizer into ``root``; return both folders. The target's later layers write only
    ``deep_scale`` of their output into the residual stream (their compute is unchanged), so the cut agrees with it
    on most tokens (α ≈ 1): a drafter whose acceptance is known, without downloading anything."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if str(REPO_ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "tests"))
    from tiny_models import build_tokenizer, save_tiny

    tokenizer = build_tokenizer(root / "tokenizer")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        eos_token_id=0, pad_token_id=1, bos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(deep_scale)
            layer.mlp.down_proj.weight.mul_(deep_scale)
    target_dir = save_tiny(target, tokenizer, root / "target")  # a fresh random LM head, shared with the cut
    cut_config = copy.deepcopy(config)
    cut_config.num_hidden_layers = 1
    if isinstance(getattr(cut_config, "layer_types", None), list):
        cut_config.layer_types = cut_config.layer_types[:1]
    assistant = AutoModelForCausalLM.from_config(cut_config)
    missing, _ = assistant.load_state_dict(target.state_dict(), strict=False)  # layers 1.. of the target are unused
    if missing:
        raise RuntimeError(f"the cut assistant lacks {missing}")
    assistant.generation_config = copy.deepcopy(target.generation_config)
    assistant_dir = root / "assistant"
    assistant.save_pretrained(assistant_dir)
    tokenizer.save_pretrained(assistant_dir)
    return target_dir, assistant_dir


def start_row(row: dict[str, Any], raw: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Fill a summary row's error and totals (prompts, new tokens, time, tokens/s) from one row's raw results;
    return its per-prompt records (empty: nothing finished, and the row says so)."""
    raw = raw or {"per_prompt": [], "pass": None}
    row["pass"] = raw["pass"]
    if raw.get("error"):
        row["error"] = raw["error"]
    pp = raw["per_prompt"]
    if not pp:
        row.setdefault("error", "no prompt finished")
        return pp
    row |= {"prompts": len(pp), "new_tokens": sum(p["new_tokens"] for p in pp),
            "time_s": sum(p["time_s"] for p in pp), "tokens_per_s": tps(pp)}
    return pp


def tps(per_prompt: list[dict[str, Any]]) -> float | None:
    time_s = sum(p["time_s"] for p in per_prompt)
    return sum(p["new_tokens"] for p in per_prompt) / time_s if time_s else None


def speed_ratio(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float | None:
    """tokens/s of ``a`` ÷ tokens/s of ``b`` over the prompts both have (a run cut short compares what it has)."""
    n = min(len(a), len(b))
    ta, tb = tps(a[:n]), tps(b[:n])
    return ta / tb if n and ta and tb else None


def token_mismatches(pp: list[dict[str, Any]], ref: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Prompts whose token ids differ from ``ref``'s, with the first differing position."""
    out = []
    for i, (p, r) in enumerate(zip(pp, ref)):
        a, b = p["token_ids"], r["token_ids"]
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"prompt": i, "first_diff": first})
    return out


def anchor_run(data: dict[str, Any], anchor: str, pass_index: int) -> list[dict[str, Any]] | None:
    """The anchor row's per-prompt results measured in pass ``pass_index`` (its own run or a repeat)."""
    own = data["raw"].get(anchor)
    if own and own["pass"] == pass_index:
        return own["per_prompt"]
    repeat = data.get("anchor_runs", {}).get(anchor, {}).get(str(pass_index))
    return repeat["per_prompt"] if repeat else None


def vs_anchor(data: dict[str, Any], key: str, anchor: str | None) -> float | None:
    """A row's tokens/s ÷ its anchor's in the same pass (1.0 for the anchor itself)."""
    raw = data["raw"].get(key)
    if not anchor or not raw or not raw["per_prompt"]:
        return None
    if key == anchor:
        return 1.0
    ref = anchor_run(data, anchor, raw["pass"])
    return speed_ratio(raw["per_prompt"], ref) if ref else None


# ---------------------------------------------------------------------------------------------- cost curves


def curve_table_lines(curves: dict[str, dict[str, Any]]) -> list[str]:
    """One table row per (model, dtype, threads): forward ms over n new tokens on a cached prefix."""
    entries = [(setup, name, c) for setup, info in curves.items() for name, c in info["curves"].items()]
    if not entries:
        return []
    width = max(max(c["sizes"]) for _, _, c in entries)
    rows = []
    for setup, name, c in entries:
        info = curves[setup]
        ms = dict(zip(c["sizes"], c["seconds"]))
        rows.append([f"{name} `{info['models'][name]}`", DTYPE_TAGS[info["dtype"]], info["threads_label"],
                     *(fmt(1000 * ms[n], ".0f") if n in ms else "" for n in range(1, width + 1))])
    prefix = entries[0][2]["prefix_len"]
    return [f"Forward cost, ms, of n new tokens on a cached {prefix}-token prefix (fastest of the repeats; measured "
            "inside the transformers workers; blank: not measured, the time budget ran out):", "",
            *md_table(["model", "dtype", "threads", *(str(n) for n in range(1, width + 1))], rows,
                      "lll" + "r" * width)]


def write_curve_plot(path: Path, curves: dict[str, dict[str, Any]]) -> None:
    """Forward ms against new tokens, one panel per model, one line per (dtype, threads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = sorted({name for info in curves.values() for name in info["curves"]}, reverse=True)
    if not names:
        path.unlink(missing_ok=True)
        return
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for info in curves.values():
            c = info["curves"].get(name)
            if c:
                ax.plot(c["sizes"], [1000 * s for s in c["seconds"]], marker="o", markersize=3,
                        label=f"{DTYPE_TAGS[info['dtype']]}, {info['threads_label']}")
        model = next(info["models"][name] for info in curves.values() if name in info["curves"])
        ax.set_title(f"{name}: {model}", fontsize=9)
        ax.set_xlabel("new tokens in one forward (cached prefix)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- rows and passes


def model_gib(path: str, dtype: str, fraction: float = 1.0) -> float:
    """Resident size of a model folder's weights loaded in ``dtype`` (from the safetensors sizes and the stored
    dtype); ``fraction`` for drafters that load part of a checkpoint."""
    folder = Path(path)
    stored = 2
    with contextlib.suppress(OSError, ValueError):
        cfg = json.loads((folder / "config.json").read_text())
        stored = DTYPE_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), 2)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) or sum(
        f.stat().st_size for f in folder.glob("*.bin"))
    widen = 1.1 if DTYPE_BYTES[dtype] > stored else 1.0  # loading bf16 weights as fp32 peaks above the result
    return widen * fraction * size * DTYPE_BYTES[dtype] / stored / 2**30


def _sized_dtype(dtype: str) -> str:
    """``auto`` may become float32: budget memory for the larger."""
    return "float32" if dtype == "auto" else dtype


def cluster_models(cfg: dict[str, Any]) -> dict[str, float]:
    """GiB of the models a cluster of the loaded config ``cfg`` holds: the target in the verifier and the drafter's
    model (none for prompt lookup; for early exit its first layers plus, roughly, the embeddings and LM head)."""
    from weights import resolve_model

    v, d = cfg["verifier"], cfg["drafter"]
    models = {"verifier": model_gib(resolve_model(v["model"]), _sized_dtype(v["dtype"]))}
    if not cfg["launch"]["start_drafter"] or d["type"] == "prompt_lookup":
        return models
    path = resolve_model(d.get("model") or v["model"])
    fraction = 1.0
    if d["type"] == "early_exit" and d.get("assistant_early_exit"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
            fraction = min(1.0, d["assistant_early_exit"] / layers + 0.3)
    models["drafter"] = model_gib(path, _sized_dtype(d["dtype"]), fraction)
    return models


@dataclass
class HFSetup:
    """One persistent transformers worker: the target at one dtype and thread count, assistants loaded on demand."""

    key: str
    dtype: str
    threads: int
    device: str
    target_path: str
    target_gib: float
    curves: list[tuple[str, str, list[int]]] = field(default_factory=list)  # (name, "target" or a path, sizes)
    curve_models: dict[str, float] = field(default_factory=dict)  # GiB of the models the curves need

    processes = 1

    @property
    def base_models(self) -> dict[str, float]:
        return {"target": self.target_gib}

    @property
    def threads_label(self) -> str:
        return "GPU" if self.device == "cuda" else f"{self.threads} thread" + ("s" if self.threads > 1 else "")


@dataclass
class ClusterSetup:
    """One pipespec cluster (a verifier and a drafter process) of ``config`` with ``overrides``."""

    key: str
    config: str | dict[str, Any]
    overrides: dict[str, Any]
    models: dict[str, float]
    processes: int = 2
    curves: list[tuple[str, str, list[int]]] = field(default_factory=list)
    curve_models: dict[str, float] = field(default_factory=dict)

    @property
    def base_models(self) -> dict[str, float]:
        return self.models


Setup = HFSetup | ClusterSetup


@dataclass
class Row:
    """A table row. ``strategy`` (transformers rows): the worker's generate request; ``anchor``: the row whose
    same-pass speed this row's ratio is taken against; ``models``: GiB this row needs loaded in its setup;
    ``curves_only``: no generations, the row only brings its setup (and its cost curves) into a pass."""

    key: str
    label: str
    setup: str
    prompt_set: str = "default"
    strategy: dict[str, Any] | None = None
    anchor: str | None = None
    models: dict[str, float] = field(default_factory=dict)
    curves_only: bool = False


@dataclass
class Pass:
    rows: list[str] = field(default_factory=list)  # keys, in the order the rows were added
    owned: set[str] = field(default_factory=set)  # rows measured for the table here (the others repeat an anchor)
    curves: set[str] = field(default_factory=set)  # setups whose cost curves are measured in this pass
    estimated_gib: float = 0.0


def pass_gib(keys: list[str], curves: set[str], rows: dict[str, Row], setups: dict[str, Setup]) -> float:
    need: dict[str, dict[str, float]] = {}
    for key in keys:
        s = setups[rows[key].setup]
        models = need.setdefault(s.key, dict(s.base_models))
        models.update(rows[key].models)
        if s.key in curves:
            models.update(s.curve_models)
    return sum(setups[s].processes * PROCESS_GIB + sum(m.values()) for s, m in need.items())


def plan_passes(units: list[list[str]], rows: dict[str, Row], setups: dict[str, Setup],
                budget_gib: float) -> list[Pass]:
    """Pack units (lists of row keys that must share a pass, e.g. the rows of one setup, or a pipespec row with
    transformers' same strategy) into passes that fit ``budget_gib``, first fit in the given order; each pass
    also gets the anchors of its rows. A unit too large for any pass gets a pass of its own (and a warning)."""
    passes: list[Pass] = []
    curved: set[str] = set()
    for unit in units:
        for p in [*passes, None]:
            new = [k for k in unit if p is None or k not in p.rows]
            anchors = [rows[k].anchor for k in unit if rows[k].anchor]
            keys = (p.rows if p else []) + new + [a for a in dict.fromkeys(anchors)
                                                  if a not in new and (p is None or a not in p.rows)]
            unit_setups = {rows[k].setup for k in unit} - curved
            curves = (p.curves if p else set()) | {s for s in unit_setups if setups[s].curves}
            gib = pass_gib(keys, curves, rows, setups)
            if p is None or gib <= budget_gib:
                if p is None:
                    p = Pass()
                    passes.append(p)
                    if gib > budget_gib:
                        log(f"WARNING: {', '.join(unit)} need about {gib:.1f} GiB, more than the budget of "
                            f"{budget_gib:.1f} GiB; running them anyway")
                p.rows, p.curves, p.estimated_gib = keys, curves, gib
                p.owned.update(unit)
                curved |= curves
                break
    return passes


def plan_text(passes: list[Pass], rows: dict[str, Row], setups: dict[str, Setup], budget_gib: float) -> str:
    """The passes, their setups and estimated memory, for ``--dry-run``."""
    lines = [f"{len(passes)} pass(es) within a memory budget of {budget_gib:.1f} GiB:"]
    for i, p in enumerate(passes, 1):
        lines.append(f"pass {i}: estimated {p.estimated_gib:.1f} GiB")
        for skey in dict.fromkeys(rows[k].setup for k in p.rows):
            keys = [k for k in p.rows if rows[k].setup == skey]
            shown = ", ".join(k + ("" if k in p.owned else " (reference repeat)") for k in keys)
            curves = " + cost curves" if skey in p.curves else ""
            lines.append(f"  {skey}: {shown}{curves}")
    return "\n".join(lines)


def select_rows(spec: str, keys: list[str], script: str) -> list[str]:
    """``"hf-target-bf16,pipespec"`` → the matching ``keys`` in their order; a token matches a key or a
    ``-``-separated prefix of keys."""
    wanted = set()
    for token in filter(None, (t.strip() for t in spec.split(","))):
        hits = [k for k in keys if k == token or k.startswith(token + "-")]
        if not hits:
            raise SystemExit(f"{script}: unknown row {token!r} (rows: {', '.join(keys)})")
        wanted.update(hits)
    return [k for k in keys if k in wanted]


def rotated(items: list[Any], i: int) -> list[Any]:
    """``items`` rotated left by ``i`` (the row order for prompt ``i``)."""
    if not items:
        return []
    i %= len(items)
    return items[i:] + items[:i]


# ---------------------------------------------------------------------------------------------- worker (parent side)


def run_script_worker(script: Path, job_path: Path, threads: int, label: str) -> None:
    """Run ``script --_hf-worker job_path`` in a subprocess at ``threads`` threads (a one-job worker, for scripts
    whose rows need no persistent process), passing its progress through; raise with the end of its stderr if it
    fails."""
    n = str(threads)
    env = {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script), "--_hf-worker", str(job_path)], env=env, cwd=REPO_ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail: deque[str] = deque(maxlen=30)
    assert proc.stderr is not None
    for line in proc.stderr:  # pass progress through, keep the end for an error report
        sys.stderr.write(line)
        tail.append(line.rstrip())
    code = proc.wait()
    if code != 0:
        raise WorkerError(f"{label} exited with code {code}:\n" + "\n".join(tail))


class WorkerError(RuntimeError):
    """A worker request failed; the message carries the error (and the end of the worker's log if it died)."""


class Worker:
    """Parent side of one persistent transformers worker: a subprocess at a fixed thread count and dtype."""

    def __init__(self, setup: HFSetup):
        self.setup = setup
        n = str(setup.threads)
        env = {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        spec = {"start": _START, "key": setup.key, "dtype": setup.dtype, "threads": setup.threads,
                "device": setup.device, "target": setup.target_path}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                                     env=env, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.tail: deque[str] = deque(maxlen=30)
        self._stderr = threading.Thread(target=self._pass_stderr, daemon=True)
        self._stderr.start()

    def _pass_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # progress through to our stderr, the end kept for an error report
            sys.stderr.write(line)
            self.tail.append(line.rstrip())

    def call(self, op: str, **request: Any) -> dict[str, Any]:
        """Send one request, wait for its answer (blocking); raise :class:`WorkerError` on an error answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = self.proc.wait()
            self._stderr.join(5)
            raise WorkerError(f"worker {self.setup.key} exited with code {code}:\n" + "\n".join(self.tail))
        answer = json.loads(line)
        if "error" in answer:
            raise WorkerError(answer["error"])
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(WorkerError):
                self.call("quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._stderr.join(5)


# ---------------------------------------------------------------------------------------------- worker (child side)


class DraftCounter:
    """Counts drafts and acceptances inside transformers' assisted generation (any strategy: assistant model,
    prompt lookup, early exit, different tokenizers) by wrapping the candidate generator ``generate`` builds."""

    def __init__(self) -> None:
        self.rounds = self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.draft_s = 0.0  # time inside the candidate generator (get_candidates)
        self.settings: dict[str, Any] = {}  # the assistant settings transformers used (its defaults unless set)
        self.generator = ""  # the candidate generator class transformers chose

    def stats(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("rounds", "drafts", "draft_tokens", "accepted_tokens",
                                                       "draft_s")}

    def _wrap(self, gen: Any) -> Any:
        get, update = gen.get_candidates, gen.update_candidate_strategy
        counter = self
        self.generator = type(gen).__name__
        cfg = getattr(gen, "assistant_generation_config", None) or getattr(gen, "generation_config", None)
        if cfg is not None and not self.settings:
            self.settings = {name: getattr(cfg, name, None) for name in (
                "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit")
                if getattr(cfg, name, None) is not None}

        def get_candidates(input_ids: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return get(input_ids, **kwargs)
            finally:
                counter.draft_s += time.perf_counter() - t0

        def update_candidate_strategy(input_ids: Any, scores: Any, num_matches: Any) -> Any:
            drafted = int(scores.shape[1]) - 1  # scores cover the candidates + the bonus position
            counter.rounds += 1
            if drafted > 0:
                counter.drafts += 1
                counter.draft_tokens += drafted
                counter.accepted_tokens += int(num_matches)
            return update(input_ids, scores, num_matches)

        gen.get_candidates = get_candidates
        gen.update_candidate_strategy = update_candidate_strategy
        return gen

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        from transformers.generation.utils import GenerationMixin

        build = GenerationMixin._get_candidate_generator
        counter = self

        def _get_candidate_generator(model: Any, *args: Any, **kwargs: Any) -> Any:
            return counter._wrap(build(model, *args, **kwargs))

        GenerationMixin._get_candidate_generator = _get_candidate_generator
        try:
            yield
        finally:
            GenerationMixin._get_candidate_generator = build


def worker_main(spec_json: str) -> int:
    """Child side: load the target, then answer JSON-line requests on stdin until ``quit``.

    Requests: ``ready``; ``generate`` (``ids``, ``max_new_tokens``, ``strategy``: ``{"kind": "target" | "assistant"
    | "universal" | "early_exit" | "prompt_lookup", ...}``) → ``token_ids``, ``time_s`` (around ``generate`` only),
    ``stats``, ``generator``, ``settings``; ``generate_batch`` (``ids``: a list of prompts, ``max_new_tokens``): the
    target alone on all of them left-padded into one batch, greedy → ``token_ids`` (one list per prompt, cut after
    its first end token, so no padding), ``time_s``, ``width`` (the padded prompt length); ``curve`` (``model``:
    ``"target"`` or a path, ``sizes``, ``prefix_len``, ``budget_s``, ``repeats``) → ``sizes``, ``seconds``,
    ``prefix_len``; ``quit``. A failing request answers ``{"error": ...}`` and the worker goes on.
    """
    global _START
    spec = json.loads(spec_json)
    _START = spec["start"]
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    import torch
    import transformers

    from shared.devices import input_device
    from shared.models import load_causal_lm, load_tokenizer, set_threads

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    set_threads(spec["threads"])
    t0 = time.perf_counter()
    target = load_causal_lm(spec["target"], spec["device"], spec["dtype"])
    load_s = time.perf_counter() - t0
    log(f"worker {spec['key']}: target loaded in {load_s:.1f} s (torch threads {torch.get_num_threads()})")
    models: dict[str, Any] = {"target": target}
    tokenizers: dict[str, Any] = {}

    def model(path: str) -> Any:
        if path not in models:
            t0 = time.perf_counter()
            models[path] = load_causal_lm(path, spec["device"], spec["dtype"])
            log(f"worker {spec['key']}: {Path(path).name} loaded in {time.perf_counter() - t0:.1f} s")
        return models[path]

    def tokenizer(path: str) -> Any:
        if path not in tokenizers:
            tokenizers[path] = load_tokenizer(path)
        return tokenizers[path]

    def generate_kwargs(s: dict[str, Any]) -> dict[str, Any]:
        kind = s["kind"]
        if kind == "target":
            return {}
        if kind == "prompt_lookup":
            return {"prompt_lookup_num_tokens": s["prompt_lookup_num_tokens"],
                    "max_matching_ngram_size": s["max_matching_ngram_size"]}
        if kind == "early_exit":
            return {"assistant_early_exit": s["assistant_early_exit"]}
        if kind not in ("assistant", "universal"):
            raise ValueError(f"unknown strategy {kind!r}")
        kwargs = {"assistant_model": model(s["model"])}
        if kind == "universal":
            kwargs |= {"tokenizer": tokenizer(spec["target"]), "assistant_tokenizer": tokenizer(s["model"])}
        return kwargs

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op in ("ready", "quit"):
            return {"load_s": load_s}
        if op == "curve":
            with torch.inference_mode():
                c = measure_curve(model(req["model"]) if req["model"] != "target" else target, req["sizes"],
                                  prefix_len=req["prefix_len"], budget_s=req["budget_s"], repeats=req["repeats"])
            return {"sizes": list(c.sizes), "seconds": list(c.seconds), "prefix_len": c.prefix_len}
        if op == "generate":
            kwargs = generate_kwargs(req["strategy"])
            ids = torch.tensor([req["ids"]], dtype=torch.long, device=input_device(target))
            counter = DraftCounter()
            with counter.patched():
                t0 = time.perf_counter()
                out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=req["max_new_tokens"], **kwargs)
                tokens = out[0, ids.shape[1]:].tolist()  # .tolist() waits for a GPU too
                elapsed = time.perf_counter() - t0
            return {"token_ids": tokens, "time_s": elapsed, "stats": counter.stats(), "generator": counter.generator,
                    "settings": counter.settings}
        if op == "generate_batch":
            return generate_batch(target, req["ids"], req["max_new_tokens"])
        raise ValueError(f"unknown request {op!r}")

    while line := sys.stdin.readline():
        req = json.loads(line)
        try:
            answer = handle(req)
        except Exception as exc:  # a strategy transformers refuses on this model is a row error, not a dead worker
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(answer) + "\n")
        if req["op"] == "quit":
            break
    return 0


def generate_batch(model: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """Greedy ``generate`` on ``prompts`` left-padded into one batch (with the attention mask): the new tokens of each
    prompt, cut after its first end token (rows that end early are padded by ``generate`` until the batch ends)."""
    import torch

    from shared.devices import input_device

    if not prompts or not all(prompts):
        raise ValueError("generate_batch needs at least one prompt, none of them empty")
    config = model.generation_config
    eos = config.eos_token_id
    eos = [] if eos is None else [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    width = max(len(p) for p in prompts)
    device = input_device(model)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=pad)
    rows = out[:, width:].tolist()  # .tolist() waits for a GPU too
    elapsed = time.perf_counter() - t0
    token_ids = []
    for row in rows:
        end = next((i for i, t in enumerate(row) if t in eos), None)
        token_ids.append(row if end is None else row[: end + 1])
    return {"token_ids": token_ids, "time_s": elapsed, "width": width}


# ---------------------------------------------------------------------------------------------- the interleaved run


class Runner:
    """Runs passes of rows interleaved prompt by prompt and keeps every result (see :meth:`state`).

    ``prompts``: prompt set name → list of ``{"ids": [...], "messages": [...]}``; a row decodes prompt i of its own
    set (a cluster gets the messages, templated by its verifier, or the ids where there are no messages).
    ``on_update`` is called after every prompt (the scripts rewrite their json there).
    """

    def __init__(self, rows: dict[str, Row], setups: dict[str, Setup], prompts: dict[str, list[dict[str, Any]]],
                 max_new_tokens: int, on_update: Callable[[], None], curve_prefix: int = 64,
                 curve_budget_s: float = 20.0, curve_repeats: int = 2):
        self.rows, self.setups, self.prompts = rows, setups, prompts
        self.max_new_tokens, self.on_update = max_new_tokens, on_update
        self.curve_args = {"prefix_len": curve_prefix, "budget_s": curve_budget_s, "repeats": curve_repeats}
        self.raw: dict[str, dict[str, Any]] = {}  # row key → {"pass", "per_prompt", "error"?, "hf"?}
        self.anchor_runs: dict[str, dict[str, Any]] = {}  # anchor key → {pass index: per_prompt}
        self.curves: dict[str, dict[str, Any]] = {}  # setup key → {dtype, threads_label, models, curves}
        self.setup_info: dict[str, dict[str, Any]] = {}  # setup key → load time, peak memory
        self.passes: list[dict[str, Any]] = []

    def state(self) -> dict[str, Any]:
        return {"raw": self.raw, "anchor_runs": self.anchor_runs, "curves": self.curves,
                "setups": self.setup_info, "passes": self.passes}

    def _update(self) -> None:
        try:
            self.on_update()
        except Exception:  # a report bug must not end a long run; the final report raises it again
            log("WARNING: writing the report failed:\n" + traceback.format_exc())

    async def run(self, passes: list[Pass]) -> None:
        self.passes = [{"index": i, "rows": p.rows, "estimated_gib": p.estimated_gib, "start": None, "end": None}
                       for i, p in enumerate(passes, 1)]
        for info, p in zip(self.passes, passes):
            info["start"] = utc_now()
            log(f"pass {info['index']}/{len(passes)} (estimated {p.estimated_gib:.1f} GiB): {', '.join(p.rows)}")
            await self._run_pass(info["index"], p)
            info["end"] = utc_now()
            self._update()

    def _results(self, key: str, index: int, p: Pass) -> dict[str, Any]:
        if key in p.owned:
            return self.raw.setdefault(key, {"pass": index, "per_prompt": []})
        return self.anchor_runs.setdefault(key, {}).setdefault(str(index), {"pass": index, "per_prompt": []})

    async def _run_pass(self, index: int, p: Pass) -> None:
        rows = [self.rows[k] for k in p.rows]
        for r in rows:
            if not r.curves_only:
                self._results(r.key, index, p)
        failed: dict[str, str] = {}

        def fail(row: Row, message: str) -> None:
            failed[row.key] = message
            if not row.curves_only:
                self._results(row.key, index, p)["error"] = message
            log(f"{row.label} failed: {message.splitlines()[0][:300]}")

        async with contextlib.AsyncExitStack() as stack:
            handles: dict[str, Any] = {}
            for skey in dict.fromkeys(r.setup for r in rows):  # start every setup of the pass, in row order
                t0 = time.perf_counter()
                try:
                    handles[skey] = await self._open(self.setups[skey], stack)
                except Exception as exc:  # a setup that does not start fails its rows, not the run
                    for r in rows:
                        if r.setup == skey:
                            fail(r, f"{type(exc).__name__}: {exc}")
                    continue
                self.setup_info.setdefault(skey, {})["start_s"] = time.perf_counter() - t0
                log(f"{skey}: ready in {time.perf_counter() - t0:.1f} s")
            for skey in sorted(p.curves & set(handles)):
                await self._measure_curves(self.setups[skey], handles[skey])
            live = [r for r in rows if not r.curves_only and r.key not in failed]
            for r in live:  # warm-up, untimed
                try:
                    await self._generate(r, handles[r.setup], 0, WARMUP_TOKENS)
                except Exception as exc:
                    fail(r, f"{type(exc).__name__}: {exc}")
            n = max((len(self.prompts[r.prompt_set]) for r in live), default=0)
            for i in range(n):
                for r in rotated(live, i):
                    if r.key in failed or i >= len(self.prompts[r.prompt_set]):
                        continue
                    try:
                        result = await self._generate(r, handles[r.setup], i, self.max_new_tokens)
                    except Exception as exc:
                        fail(r, f"{type(exc).__name__}: {exc}")
                        continue
                    results = self._results(r.key, index, p)
                    hf = result.pop("hf", None)
                    if hf and hf["generator"]:  # what transformers chose for this strategy, once per row
                        results.setdefault("hf", hf)
                    results["per_prompt"].append(result)
                    extra = (f", α {result['metrics']['acceptance_rate']:.2f}, "
                             f"τ {result['metrics']['mean_accepted_length']:.2f}" if "metrics" in result else "")
                    log(f"{r.label}: prompt {i + 1}/{len(self.prompts[r.prompt_set])}: {result['new_tokens']} tokens "
                        f"in {result['time_s']:.2f} s ({result['new_tokens'] / result['time_s']:.2f} tok/s){extra}")
                self._update()
            for skey, handle in handles.items():  # memory high-water marks, to check the planner's estimates
                pids = [handle.proc.pid] if isinstance(handle, Worker) else [q.pid for q in handle.processes.values()]
                peaks = [peak_rss_gib(pid) or 0.0 for pid in pids]
                info = self.setup_info.setdefault(skey, {})
                info["peak_rss_gib"] = max(info.get("peak_rss_gib", 0.0), sum(peaks))

    async def _open(self, setup: Setup, stack: contextlib.AsyncExitStack) -> Any:
        if isinstance(setup, HFSetup):
            worker = Worker(setup)
            stack.callback(worker.close)
            await asyncio.to_thread(worker.call, "ready")
            return worker
        from runtime.launch import cluster

        log(f"{setup.key}: starting the nodes of {setup.config}" + (f" with {setup.overrides}" if setup.overrides
                                                                   else ""))
        return await stack.enter_async_context(cluster(setup.config, overrides=setup.overrides or None))

    async def _measure_curves(self, setup: Setup, worker: Worker) -> None:
        entry = self.curves.setdefault(setup.key, {"dtype": setup.dtype, "threads_label": setup.threads_label,
                                                   "threads": setup.threads, "models": {}, "curves": {}})
        for name, model, sizes in setup.curves:
            t0 = time.perf_counter()
            try:
                c = await asyncio.to_thread(worker.call, "curve", model=model, sizes=sizes, **self.curve_args)
            except WorkerError as exc:
                log(f"{setup.key}: {name} cost curve failed: {exc}")
                continue
            entry["models"][name] = Path(setup.target_path if model == "target" else model).name
            entry["curves"][name] = c
            log(f"{setup.key}: {name} cost curve in {time.perf_counter() - t0:.1f} s: "
                + ", ".join(f"{n}: {1000 * s:.0f} ms" for n, s in zip(c["sizes"], c["seconds"])))

    async def _generate(self, row: Row, handle: Any, i: int, max_new_tokens: int) -> dict[str, Any]:
        prompt = self.prompts[row.prompt_set][i]
        at = time.time()  # when it started: the order the rows ran in, to the microsecond
        if isinstance(handle, Worker):
            a = await asyncio.to_thread(handle.call, "generate", ids=prompt["ids"], max_new_tokens=max_new_tokens,
                                        strategy=row.strategy)
            return {"token_ids": a["token_ids"], "new_tokens": len(a["token_ids"]), "time_s": a["time_s"],
                    "stats": a["stats"], "at": at, "hf": {"generator": a["generator"], "settings": a["settings"]}}
        t0 = time.perf_counter()
        try:
            source = {"messages": prompt["messages"]} if prompt.get("messages") else {"token_ids": prompt["ids"]}
            r = await handle.generate(**source, max_new_tokens=max_new_tokens, do_sample=False)
        except Exception as exc:  # keep the node logs with the error text
            tails = {role: handle.cluster.log_tail(role) for role in handle.processes}
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n" + "\n".join(
                f"--- end of {role} log ---\n{text}" for role, text in tails.items())) from exc
        elapsed = time.perf_counter() - t0
        if r.metrics.get("prompt_tokens") != len(prompt["ids"]):
            log(f"WARNING {row.label}: prompt {i + 1}: the verifier templated {r.metrics.get('prompt_tokens')} "
                f"tokens, the bench {len(prompt['ids'])}")
        return {"token_ids": r.token_ids, "new_tokens": len(r.token_ids), "time_s": elapsed, "metrics": r.metrics,
                "at": at}


def chat_prompts(tokenizer: Any, messages: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """``{"ids", "messages"}`` per prompt: the target's chat template with the generation prompt, as the verifier
    templates ``messages``."""
    return [{"messages": m, "ids": list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                                      return_dict=True)["input_ids"])}
            for m in messages]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2]))
    sys.exit(f"usage: {Path(__file__).name} --worker SPEC_JSON (started by the benchmarks, not by hand)")
