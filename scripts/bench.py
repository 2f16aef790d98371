#!/usr/bin/env python
"""Benchmark pipespec against transformers on the CPU pair of ``configs/cpu.yaml``, side by side in one run.

Every row decodes the same chat prompts (templated with the target tokenizer, ``add_generation_prompt=True``),
greedily, for ``--max-new-tokens`` tokens, after one short warm-up generation:

- ``hf-target-1t``: transformers ``generate(do_sample=False)`` on the target alone, ``torch.set_num_threads(1)``;
  ``hf-target-2t``: the same at 2 threads
- ``hf-assisted-1t`` / ``hf-assisted-2t``: transformers assisted generation (``assistant_model=`` the drafter
  model) at 1 / 2 threads
- ``pipespec-sync``: ``cluster("cpu.yaml", overrides={"drafter.overlap": False})``, one thread per node
- ``pipespec-overlap``: ``cluster("cpu.yaml")`` (overlap on)

The transformers rows run in one subprocess per thread count (``--_hf-worker``), so the thread count is clean and
no model stays in memory while the pipespec nodes run. ``hf-target-1t`` is the reference: every other row's output
is compared with it token by token (mismatching prompts are counted, never hidden) and its tokens/s is the 1.0×.

The speed model (DESIGN.md): with α the measured acceptance, k the mean drafted block length and
c = (drafter step) / (target step), measured here on a cached 100-token prefix at 1 thread,
E = (1 − α^(k+1)) / (1 − α); the ideal overlapped speedup is E / max(1, k·c) and the synchronous bound E / (1 + k·c).
Efficiency = achieved speedup / ideal overlapped speedup.

Outputs in ``--out``: ``bench.md`` (header + table), ``bench.png`` (speedup bars), ``bench.json`` (raw numbers,
rewritten after every row so a late failure keeps the earlier rows).

Usage::

    .venv/bin/python scripts/bench.py                                  # all rows, 10 prompts, 128 new tokens
    .venv/bin/python scripts/bench.py --prompts 2 --max-new-tokens 16  # a quick smoke
    .venv/bin/python scripts/bench.py --rows hf-target-1t,pipespec     # a subset (keys or prefixes)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO_ROOT / "scripts" / "prompts" / "code_prompts.json"
CONFIG = "cpu.yaml"
WARMUP_TOKENS = 8
CALIB_PREFIX = 100  # cached prefix length for the c measurement
CALIB_REPS = 10

# key -> (label, kind, threads); the order is the run order and the table order.
ROWS: dict[str, tuple[str, str, int]] = {
    "hf-target-1t": ("hf target alone (1 thread)", "target", 1),
    "hf-target-2t": ("hf target alone (2 threads)", "target", 2),
    "hf-assisted-1t": ("hf assisted (1 thread)", "assisted", 1),
    "hf-assisted-2t": ("hf assisted (2 threads)", "assisted", 2),
    "pipespec-sync": ("pipespec sync (1+1 threads)", "sync", 1),
    "pipespec-overlap": ("pipespec overlap (1+1 threads)", "overlap", 1),
}
REFERENCE = "hf-target-1t"

_START = time.time()  # progress lines show seconds since this (the worker inherits the parent's)


def log(message: str) -> None:
    """One progress line on stderr with the elapsed time of the whole run."""
    print(f"[bench {time.time() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- speed model


def speed_model(alpha: float, k: float, c: float) -> dict[str, float]:
    """Leviathan et al.: expected tokens per verify E, ideal overlapped and synchronous speedups."""
    e = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return {"E": e, "ideal_overlap": e / max(1.0, k * c), "sync_bound": e / (1 + k * c)}


# ---------------------------------------------------------------------------------------------- hf worker


class DraftCounter:
    """Counts drafts and acceptances inside transformers' assisted generation (any strategy: assistant model,
    prompt lookup, early exit, different tokenizers) by wrapping the candidate generator ``generate`` builds."""

    def __init__(self) -> None:
        self.rounds = self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.draft_s = 0.0  # time inside the candidate generator (get_candidates)
        self.settings: dict[str, Any] = {}  # the assistant settings transformers used (its defaults unless set)
        self.generator = ""  # the candidate generator class transformers chose

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


def _calibrate(target: Any, draft: Any, prompt_ids: list[int], block: int) -> dict[str, Any]:
    """Median time of one cached forward: target over 1 and over ``block`` tokens, drafter over 1 token."""
    from shared.kv import CachedLM

    prefix = (prompt_ids * (CALIB_PREFIX // max(len(prompt_ids), 1) + 1))[:CALIB_PREFIX]

    def timed(model: Any, n_tokens: int) -> list[float]:
        lm = CachedLM(model)
        lm.feed(prefix)
        step = prefix[-n_tokens:]
        times = []
        for rep in range(CALIB_REPS + 2):  # two untimed warm-up forwards
            t0 = time.perf_counter()
            lm.feed(step)
            if rep >= 2:
                times.append(time.perf_counter() - t0)
            lm.crop(CALIB_PREFIX)
        return times

    t_target = timed(target, 1)
    t_block = timed(target, block)
    t_draft = timed(draft, 1)
    out = {
        "prefix_tokens": CALIB_PREFIX,
        "reps": CALIB_REPS,
        "target_step_ms": 1000 * statistics.median(t_target),
        "target_block_tokens": block,
        "target_block_ms": 1000 * statistics.median(t_block),
        "draft_step_ms": 1000 * statistics.median(t_draft),
    }
    out["c"] = out["draft_step_ms"] / out["target_step_ms"]
    return out


def hf_worker(job_path: Path) -> int:
    """Subprocess body: load the models at one thread count, optionally measure c, run the transformers rows."""
    global _START
    job = json.loads(job_path.read_text())
    _START = job["start"]
    threads: int = job["threads"]
    import torch
    import transformers

    from shared.models import load_causal_lm, set_threads

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    set_threads(threads)
    t0 = time.perf_counter()
    target = load_causal_lm(job["target_path"], "cpu", job["dtype"])
    need_draft = job["calibrate"] or "assisted" in job["modes"]
    draft = load_causal_lm(job["draft_path"], "cpu", job["dtype"]) if need_draft else None
    log(f"hf worker ({threads} thread(s)): models loaded in {time.perf_counter() - t0:.1f} s "
        f"(torch threads {torch.get_num_threads()})")
    result: dict[str, Any] = {"threads": threads, "calibration": None, "rows": {}}

    if job["calibrate"]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            result["calibration"] = cal = _calibrate(target, draft, job["prompt_ids"][0], job["block"])
        log(f"calibration ({threads} thread): target {cal['target_step_ms']:.1f} ms/1 tok, "
            f"{cal['target_block_ms']:.1f} ms/{cal['target_block_tokens']} tok, draft {cal['draft_step_ms']:.1f} "
            f"ms/1 tok, c = {cal['c']:.3f} ({time.perf_counter() - t0:.1f} s)")

    def generate(ids: list[int], max_new: int, assistant: Any) -> list[int]:
        input_ids = torch.tensor([ids], dtype=torch.long)
        extra = {"assistant_model": assistant} if assistant is not None else {}
        out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                              max_new_tokens=max_new, **extra)
        return out[0, len(ids):].tolist()

    for key in job["rows"]:
        label, kind, _ = ROWS[key]
        assistant = draft if kind == "assisted" else None
        counter = DraftCounter()
        generate(job["prompt_ids"][0], WARMUP_TOKENS, assistant)  # warm-up, untimed and uncounted
        per_prompt = []
        with counter.patched():
            for i, ids in enumerate(job["prompt_ids"]):
                t0 = time.perf_counter()
                tokens = generate(ids, job["max_new_tokens"], assistant)
                elapsed = time.perf_counter() - t0
                per_prompt.append({"token_ids": tokens, "new_tokens": len(tokens), "time_s": elapsed})
                log(f"{label}: prompt {i + 1}/{len(job['prompt_ids'])}: {len(tokens)} tokens in {elapsed:.2f} s "
                    f"({len(tokens) / elapsed:.2f} tok/s)")
        stats = None
        if kind == "assisted":
            stats = {name: getattr(counter, name) for name in
                     ("rounds", "drafts", "draft_tokens", "accepted_tokens", "draft_s")}
        result["rows"][key] = {"per_prompt": per_prompt, "hf_stats": stats}
        if kind == "assisted":
            result["assisted_settings"] = counter.settings
    Path(job["out"]).write_text(json.dumps(result))
    return 0


def run_hf_rows(keys: list[str], threads: int, calibrate: bool, ctx: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Start one worker subprocess for ``threads`` and return its result (or raise with the end of its stderr)."""
    job = {
        "start": _START, "threads": threads, "rows": keys, "calibrate": calibrate, "modes": [ROWS[k][1] for k in keys],
        "prompt_ids": ctx["prompt_ids"], "max_new_tokens": ctx["max_new_tokens"], "block": ctx["block"],
        "target_path": ctx["target_path"], "draft_path": ctx["draft_path"], "dtype": ctx["dtype"],
        "out": str(tmp / f"hf-{threads}t.out.json"),
    }
    job_path = tmp / f"hf-{threads}t.job.json"
    job_path.write_text(json.dumps(job))
    run_worker(Path(__file__), job_path, threads, f"hf worker ({threads} thread(s))")
    return json.loads(Path(job["out"]).read_text())


def run_worker(script: Path, job_path: Path, threads: int, label: str) -> None:
    """Run ``script --_hf-worker job_path`` in a subprocess at ``threads`` threads, passing its progress through;
    raise with the end of its stderr if it fails."""
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
        raise RuntimeError(f"{label} exited with code {code}:\n" + "\n".join(tail))


# ---------------------------------------------------------------------------------------------- pipespec rows


async def run_pipespec_row(key: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """Start the nodes of cpu.yaml (overlap on or off), warm up, then decode every prompt once."""
    from runtime.launch import cluster

    label, kind, _ = ROWS[key]
    overrides = {"drafter.overlap": False} if kind == "sync" else None
    t0 = time.perf_counter()
    async with cluster(CONFIG, overrides=overrides) as client:
        log(f"{label}: nodes ready in {time.perf_counter() - t0:.1f} s")
        try:
            await client.generate(messages=ctx["messages"][0], max_new_tokens=WARMUP_TOKENS, do_sample=False)
            per_prompt = []
            for i, messages in enumerate(ctx["messages"]):
                t0 = time.perf_counter()
                r = await client.generate(messages=messages, max_new_tokens=ctx["max_new_tokens"], do_sample=False)
                elapsed = time.perf_counter() - t0
                m = r.metrics
                per_prompt.append({"token_ids": r.token_ids, "new_tokens": len(r.token_ids), "time_s": elapsed,
                                   "metrics": m})
                if m.get("prompt_tokens") != len(ctx["prompt_ids"][i]):
                    log(f"WARNING {label}: prompt {i + 1}: the verifier templated {m.get('prompt_tokens')} tokens, "
                        f"the bench {len(ctx['prompt_ids'][i])}")
                log(f"{label}: prompt {i + 1}/{len(ctx['messages'])}: {len(r.token_ids)} tokens in {elapsed:.2f} s "
                    f"({len(r.token_ids) / elapsed:.2f} tok/s), α {m['acceptance_rate']:.2f}, "
                    f"τ {m['mean_accepted_length']:.2f}, {m['rounds']} rounds")
        except Exception as exc:  # keep the node logs with the error text
            tails = {role: client.cluster.log_tail(role) for role in client.processes}
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n" + "\n".join(
                f"--- end of {role} log ---\n{text}" for role, text in tails.items())) from exc
    return {"per_prompt": per_prompt}


# ---------------------------------------------------------------------------------------------- aggregation


def _weighted(per_prompt: list[dict], name: str, weight: str) -> float | None:
    """A per-request metric averaged with weights (e.g. busy fractions by elapsed time, ms/round by rounds)."""
    total = sum(p["metrics"][weight] for p in per_prompt)
    if not total:
        return None
    return sum(p["metrics"][name] * p["metrics"][weight] for p in per_prompt) / total


def summarize(key: str, raw: dict[str, Any], ref: dict[str, Any] | None, c: float | None) -> dict[str, Any]:
    """Totals, speed-model bounds and the token-identity check of one row."""
    label, kind, threads = ROWS[key]
    pp = raw["per_prompt"]
    new_tokens = sum(p["new_tokens"] for p in pp)
    time_s = sum(p["time_s"] for p in pp)
    row: dict[str, Any] = {"key": key, "label": label, "threads": threads, "prompts": len(pp),
                           "new_tokens": new_tokens, "time_s": time_s, "tokens_per_s": new_tokens / time_s}
    spec: dict[str, Any] | None = None
    if kind == "target":
        row |= {"verifier_busy": 1.0}
    elif kind == "assisted":
        s = raw["hf_stats"]
        spec = {"drafts": s["drafts"], "draft_tokens": s["draft_tokens"], "accepted_tokens": s["accepted_tokens"],
                "rounds": s["rounds"]}
        # in-process: the assistant's share is measured, the rest of the time is the target's (and Python's)
        row |= {"drafter_busy": s["draft_s"] / time_s, "verifier_busy": 1 - s["draft_s"] / time_s,
                "message_ms_per_round": 0.0}
    else:
        ms = [p["metrics"] for p in pp]
        spec = {name: sum(m[name] for m in ms) for name in
                ("drafts", "draft_tokens", "accepted_tokens", "rounds", "fallback_rounds", "stale_drafts",
                 "predraft_hits", "rolled_back_draft_tokens")}
        row |= {
            "verifier_busy": _weighted(pp, "verifier_busy_fraction", "elapsed_s"),
            "drafter_busy": _weighted(pp, "drafter_busy_fraction", "elapsed_s"),
            "message_ms_per_round": _weighted(pp, "message_overhead_ms_per_round", "rounds"),
            "draft_transit_ms": _weighted(pp, "draft_transit_ms", "drafts"),
            "bytes_per_round": _weighted(pp, "bytes_per_round", "rounds"),
            "server_elapsed_s": sum(m["elapsed_s"] for m in ms),
            "mean_ttft_s": statistics.mean(m["time_to_first_token_s"] or 0.0 for m in ms),
        }
    if spec:
        row |= spec
        if spec["draft_tokens"]:
            row["alpha"] = spec["accepted_tokens"] / spec["draft_tokens"]
            row["tau"] = 1 + spec["accepted_tokens"] / spec["drafts"]
            row["k"] = spec["draft_tokens"] / spec["drafts"]
    if ref is not None:
        ref_tps = sum(p["new_tokens"] for p in ref["per_prompt"]) / sum(p["time_s"] for p in ref["per_prompt"])
        row["speedup"] = row["tokens_per_s"] / ref_tps
        diverge = []
        for i, (p, r) in enumerate(zip(pp, ref["per_prompt"])):
            if p["token_ids"] != r["token_ids"]:
                first = next((j for j, (a, b) in enumerate(zip(p["token_ids"], r["token_ids"])) if a != b),
                             min(len(p["token_ids"]), len(r["token_ids"])))
                diverge.append({"prompt": i, "first_diff": first})
        if key != REFERENCE:
            row["mismatches"] = len(diverge)
            row["mismatch_detail"] = diverge
    if c is not None and "alpha" in row:
        model = speed_model(row["alpha"], row["k"], c)
        row["E"] = model["E"]
        if kind in ("sync", "overlap"):
            row["ideal"] = model["ideal_overlap"]
            if "speedup" in row:
                row["efficiency"] = row["speedup"] / row["ideal"]
        if kind == "sync":
            row["sync_bound"] = model["sync_bound"]
    return row


# ---------------------------------------------------------------------------------------------- reports


def machine_info() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = {}
    for pkg in ("torch", "transformers", "pyzmq"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {"cpu": model, "cores": cores, "python": platform.python_version(), "versions": versions}


def header_lines(meta: dict[str, Any]) -> list[str]:
    """The date and machine lines every benchmark report starts with (see :func:`machine_info`)."""
    m = meta["machine"]
    return [f"- date: {meta['date']}",
            f"- machine: {m['cpu']}, {m['cores']} cores; python {m['python']}, "
            + ", ".join(f"{k} {v}" for k, v in m["versions"].items())]


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta, rows = report["meta"], report["rows"]
    cal = report.get("calibration")
    lines = [
        "# pipespec benchmark",
        "",
        *header_lines(meta),
        f"- models: target `{meta['target']}`, drafter `{meta['drafter']}` ({meta['dtype']}); config `{CONFIG}` "
        f"(num_draft_tokens {meta['num_draft_tokens']}, draft_schedule {meta['draft_schedule']})",
        "- threads: hf rows 1 or 2 as named (one process); pipespec rows one thread per node "
        f"(verifier {meta['verifier_threads']}, drafter {meta['drafter_threads']})",
        f"- transformers assisted settings: {meta.get('assisted_settings') or '—'}",
        f"- prompts: {meta['prompts']} from `{meta['prompts_file']}` (chat template of the target, greedy); "
        f"max_new_tokens {meta['max_new_tokens']}; one warm-up generation of {WARMUP_TOKENS} tokens per row",
    ]
    if cal:
        lines.append(
            f"- c = {cal['c']:.3f}: drafter {cal['draft_step_ms']:.1f} ms / target {cal['target_step_ms']:.1f} ms per "
            f"1-token forward on a cached {cal['prefix_tokens']}-token prefix, median of {cal['reps']}, 1 thread "
            f"(target over {cal['target_block_tokens']} tokens: {cal['target_block_ms']:.1f} ms)")
    lines += [
        f"- reference: `{ROWS[REFERENCE][0]}`; speedup = tokens/s ÷ reference; mismatches = prompts whose token ids "
        "differ from the reference",
        "- ideal = E/max(1, k·c) with E = (1 − α^(k+1))/(1 − α), k = mean drafted block; efficiency = speedup ÷ "
        "ideal; sync bound = E/(1 + k·c)",
        "",
        "| row | new tokens | time s | tok/s | speedup | mismatches | α | τ | k | verifier busy | drafter busy "
        "| msg ms/round | ideal | efficiency | sync bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    errors = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | error (see below) |" + " |" * 13)
            errors.append(r)
            continue
        mism = "ref" if r["key"] == REFERENCE else "—" if "mismatches" not in r else f"{r['mismatches']}/{r['prompts']}"
        lines.append(
            f"| {r['label']} | {r['new_tokens']} | {r['time_s']:.1f} | {r['tokens_per_s']:.2f} | "
            f"{_fmt(r.get('speedup'), '.2f', '×')} | {mism} | {_fmt(r.get('alpha'))} | {_fmt(r.get('tau'))} | "
            f"{_fmt(r.get('k'))} | {_fmt(r.get('verifier_busy'))} | {_fmt(r.get('drafter_busy'))} | "
            f"{_fmt(r.get('message_ms_per_round'))} | {_fmt(r.get('ideal'), '.2f', '×')} | "
            f"{_fmt(r.get('efficiency'), '.0%')} | {_fmt(r.get('sync_bound'), '.2f', '×')} |")
    pipe = [r for r in rows if r["key"].startswith("pipespec") and "error" not in r]
    if pipe:
        lines += ["", "Pipeline details (sums over the prompts; per-round and per-draft values are weighted means):",
                  "",
                  "| row | rounds | fallback rounds | stale drafts | pre-draft hits | rolled-back draft tokens | "
                  "draft transit ms | bytes/round | mean TTFT s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in pipe:
            lines.append(
                f"| {r['label']} | {r['rounds']} | {r['fallback_rounds']} | {r['stale_drafts']} | {r['predraft_hits']} "
                f"| {r['rolled_back_draft_tokens']} | {_fmt(r.get('draft_transit_ms'))} | "
                f"{_fmt(r.get('bytes_per_round'), '.0f')} | {_fmt(r.get('mean_ttft_s'))} |")
    notes = ["", "Notes:",
             "- hf assisted busy fractions: time inside the assistant's `get_candidates` ÷ wall time; the verifier "
             "share is the rest (in-process, no messages)."]
    if REFERENCE not in {r["key"] for r in rows}:
        notes.append(f"- `{REFERENCE}` was not run, so speedups, mismatches and efficiencies are not available.")
    for r in rows:
        if r.get("mismatch_detail"):
            detail = ", ".join(f"prompt {d['prompt']} from token {d['first_diff']}" for d in r["mismatch_detail"])
            notes.append(f"- {r['label']}: output differs from the reference on {detail}.")
    for r in errors:
        notes += [f"- {r['label']} failed:", "", "```", r["error"], "```"]
    path.write_text("\n".join(lines + notes) + "\n")


def write_plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if "speedup" in r]
    if not shown:
        log("no speedups to plot (the reference row did not run)")
        path.unlink(missing_ok=True)  # never leave an earlier run's plot next to this run's table
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = {"target": "#9e9e9e", "assisted": "#f4a261", "sync": "#2a9d8f", "overlap": "#264653"}
    xs = range(len(shown))
    bars = ax.bar(xs, [r["speedup"] for r in shown], color=[colors[ROWS[r["key"]][1]] for r in shown])
    for bar, r in zip(bars, shown):
        ax.annotate(f"{r['speedup']:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    top = max(r["speedup"] for r in shown)
    for name, style, text in (("ideal", {"color": "crimson"}, "ideal overlapped bound E/max(1, k·c)"),
                              ("sync_bound", {"color": "dimgray"}, "synchronous bound E/(1 + k·c)")):
        marks = [(i, r[name]) for i, r in enumerate(shown) if name in r]
        if marks:
            ax.scatter([i for i, _ in marks], [v for _, v in marks], marker="_", s=900, zorder=3, label=text, **style)
            top = max(top, *(v for _, v in marks))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylim(0, top * 1.3)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), [r["label"] for r in shown], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"tokens/s ÷ {ROWS[REFERENCE][0]}")
    ax.set_title("Greedy decoding speed relative to the target alone (1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main


def select_rows(spec: str) -> list[str]:
    """``"hf-target-1t,pipespec"`` → keys, in run order; a token matches a key or a ``-``-separated prefix."""
    wanted = set()
    for token in filter(None, (t.strip() for t in spec.split(","))):
        hits = [k for k in ROWS if k == token or k.startswith(token + "-")]
        if not hits:
            raise SystemExit(f"bench: unknown row {token!r} (rows: {', '.join(ROWS)})")
        wanted.update(hits)
    return [k for k in ROWS if k in wanted]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="rows: " + ", ".join(ROWS))
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results", help="output folder (default: results/)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of row keys or prefixes (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=10, help="number of prompts (from the start of the prompts file)")
    p.add_argument("--prompts-file", type=Path, default=DEFAULT_PROMPTS,
                   help="JSON list of {id, messages} (default: scripts/prompts/code_prompts.json)")
    p.add_argument("--replot", action="store_true",
                   help="only rebuild bench.md and bench.png from the bench.json already in --out")
    p.add_argument("--_hf-worker", dest="hf_worker", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    if args.hf_worker:
        return hf_worker(args.hf_worker)
    if args.replot:
        return replot(args.out)
    keys = select_rows(args.rows)
    from runtime.config import load_config
    from shared.models import load_tokenizer, resolve_model

    cfg = load_config(CONFIG)
    prompts = json.loads(args.prompts_file.read_text())[: args.prompts]
    if len(prompts) < args.prompts:
        log(f"WARNING: only {len(prompts)} prompts in {args.prompts_file}")
    target_path = resolve_model(cfg["verifier"]["model"])
    tokenizer = load_tokenizer(target_path)
    messages = [p["messages"] for p in prompts]
    prompt_ids = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]) for m in messages]
    ctx = {"messages": messages, "prompt_ids": prompt_ids, "max_new_tokens": args.max_new_tokens,
           "block": cfg["drafter"]["num_draft_tokens"] + 1, "target_path": target_path,
           "draft_path": resolve_model(cfg["drafter"]["model"]), "dtype": cfg["verifier"]["dtype"]}
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine_info(),
        "target": cfg["verifier"]["model"], "drafter": cfg["drafter"]["model"], "dtype": cfg["verifier"]["dtype"],
        "num_draft_tokens": cfg["drafter"]["num_draft_tokens"], "draft_schedule": cfg["drafter"]["draft_schedule"],
        "verifier_threads": cfg["verifier"]["threads"], "drafter_threads": cfg["drafter"]["threads"],
        "prompts": len(prompts), "prompt_ids": [p.get("id") for p in prompts], "prompts_file": str(args.prompts_file),
        "prompt_tokens": [len(ids) for ids in prompt_ids], "max_new_tokens": args.max_new_tokens, "rows": keys,
    }
    log(f"rows: {', '.join(keys)}; {len(prompts)} prompts ({min(meta['prompt_tokens'])}–"
        f"{max(meta['prompt_tokens'])} tokens), max_new_tokens {args.max_new_tokens}")

    raw: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    calibration = None
    need_c = any(k.startswith(("pipespec", "hf-assisted-1t")) for k in keys)

    def save() -> dict[str, Any]:
        ref = raw.get(REFERENCE)
        c = calibration["c"] if calibration else None
        rows = [summarize(k, raw[k], ref, c) if k in raw else {"key": k, "label": ROWS[k][0], "error": errors[k]}
                for k in keys if k in raw or k in errors]
        report = {"meta": meta, "calibration": calibration, "rows": rows, "raw": raw}
        (args.out / "bench.json").write_text(json.dumps(report, indent=1))
        return report

    with tempfile.TemporaryDirectory(prefix="pipespec-bench-") as tmp:
        for threads in (1, 2):  # one worker per thread count; the 1-thread one also measures c
            hf_keys = [k for k in keys if k.startswith("hf") and ROWS[k][2] == threads]
            calibrate = threads == 1 and need_c
            if not hf_keys and not calibrate:
                continue
            t0 = time.perf_counter()
            try:
                out = run_hf_rows(hf_keys, threads, calibrate, ctx, Path(tmp))
            except RuntimeError as exc:
                log(f"hf rows at {threads} thread(s) failed: {exc}")
                errors.update(dict.fromkeys(hf_keys, str(exc)))
                continue
            raw.update(out["rows"])
            calibration = out["calibration"] or calibration
            meta["assisted_settings"] = out.get("assisted_settings") or meta.get("assisted_settings")
            log(f"hf worker ({threads} thread(s)) done in {time.perf_counter() - t0:.1f} s")
            save()
    for key in (k for k in keys if k.startswith("pipespec")):
        t0 = time.perf_counter()
        try:
            raw[key] = asyncio.run(run_pipespec_row(key, ctx))
            log(f"{ROWS[key][0]}: done in {time.perf_counter() - t0:.1f} s")
        except Exception as exc:  # report a runtime failure in the table, keep the other rows
            errors[key] = f"{type(exc).__name__}: {exc}"
            log(f"{ROWS[key][0]} failed after {time.perf_counter() - t0:.1f} s: {errors[key]}")
        save()

    write_reports(args.out, save())
    return 1 if errors else 0


def write_reports(out: Path, report: dict[str, Any]) -> None:
    write_markdown(out / "bench.md", report)
    write_plot(out / "bench.png", report["rows"])
    log(f"wrote {out / 'bench.md'}, {out / 'bench.png'}, {out / 'bench.json'}")
    print((out / "bench.md").read_text())


def replot(out: Path) -> int:
    """Recompute the rows from the raw numbers of an earlier run and rewrite the markdown and the plot."""
    report = json.loads((out / "bench.json").read_text())
    raw, meta = report["raw"], report["meta"]
    c = report["calibration"]["c"] if report.get("calibration") else None
    errors = {r["key"]: r["error"] for r in report["rows"] if "error" in r}
    report["rows"] = [summarize(k, raw[k], raw.get(REFERENCE), c) if k in raw
                      else {"key": k, "label": ROWS[k][0], "error": errors[k]}
                      for k in meta["rows"] if k in raw or k in errors]
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    write_reports(out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
