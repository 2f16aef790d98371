"""pipespec under concurrent requests: batched against unbatched verification, and transformers' batched generate.

At each concurrency N (``--concurrency``, default 1, 4, 16, 64) every row decodes the same N chat prompts (the
prompts of ``scripts/prompts/{agent,code,edit}_prompts.json`` in turn, repeated to reach N; templated with the
target's chat template), greedily, ``--max-new-tokens`` each. Rows (keys for ``--rows``; a key or a ``-``-separated
prefix, e.g. ``pipespec``):

- ``pipespec-batched``: one cluster of the config (``--config``, default ``configs/cpu.yaml``) with
  ``verifier.batching: true`` and ``drafter.batching: true``; the N requests sent at once with the async client
  (``asyncio.gather`` over ``AsyncClient.generate``);
- ``pipespec-unbatched``: the same with both switches false;
- ``hf-batched``: transformers ``generate(do_sample=False)`` on the target alone, the N prompts left-padded into one
  batch (no speculation);
- ``hf-assisted``: transformers assisted generation (``assistant_model=`` the config's drafter model) on each prompt
  in turn (it cannot batch).

The transformers rows run in one worker process (``benchmarks.workers.Worker``) at the dtype pipespec's verifier
resolved (``dtype: auto`` is measured at its start-up; the pipespec rows run first to learn it) and at the
verifier's full thread count (``ThreadPlan``: every core with ``threads: auto``); ``--hf-dtype`` and ``--hf-threads``
override them. The setups of all rows stay open and every level runs each row once, in an order rotated per level,
so a host that changes speed affects all rows alike (when they do not fit in memory together, ``--memory-gib``, they
run in passes that do, see ``benchmarks.passes.plan_passes``). Each setup does one untimed warm-up first.

Per row and N: total new tokens ÷ wall seconds; per-request latency p50 / p95 (pipespec: from its send to its done
message; batched generate: every request's latency is the batch's time; assisted: from the start of the row, since
requests queue); for pipespec the requests' mean ``verify_batch_mean`` / ``draft_batch_mean`` and, from the
verifier's ``ping()`` before and after the level, the level's target ``forwards`` with their ``mean_batch_sessions``
/ ``mean_batch_tokens``; greedy token identity against the ``hf-batched`` row (requests whose tokens differ).
Ratios per N: pipespec batched ÷ transformers batched generate, and pipespec batched ÷ pipespec unbatched.

Outputs in ``--out`` (default ``results/``): ``concurrency.json`` (rewritten after every level, so a late failure
keeps what was measured), ``concurrency.md``, ``concurrency.png`` (tokens/s against N, log x).

    .venv/bin/python scripts/bench_concurrency.py                                  # the real pair, tens of minutes
    .venv/bin/python scripts/bench_concurrency.py --concurrency 1,4 --rows pipespec,hf-batched
    .venv/bin/python scripts/bench_concurrency.py --random --concurrency 1,2 --max-new-tokens 4 --out /tmp/c  # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_info, memory_budget_gib, node_pids, peak_rss_gib
from benchmarks.models import build_random_pair, cluster_models, model_gib
from benchmarks.passes import ClusterSetup, HFSetup, Row, plan_passes, plan_text, rotated, select_rows
from benchmarks.progress import log, utc_now
from benchmarks.prompts import chat_prompts, load_prompts, prompt_dir
from benchmarks.results import read_result, write_result
from benchmarks.runner import WARMUP_TOKENS
from benchmarks.summary import token_mismatches
from benchmarks.tables import fmt, header_lines, md_table
from benchmarks.workers import Worker
from runtime.paths import results_dir
from shared.spec_rates import SpecCounts

#: This project's own prompt files, in the order the benchmark always took them (the vendored public sets beside
#: them, for scripts/bench_types.py, are not part of this workload; --prompt-files takes them too).
PROMPT_FILES = [prompt_dir() / name for name in ("agent_prompts.json", "code_prompts.json", "edit_prompts.json")]
HF_SETUP = "hf"
TOKEN_REF = "hf-batched"

ROW_DEFS: dict[str, dict[str, Any]] = {
    "pipespec-batched": {"label": "pipespec batched", "kind": "pipespec",
                         "overrides": {"verifier.batching": True, "drafter.batching": True}},
    "pipespec-unbatched": {"label": "pipespec unbatched", "kind": "pipespec",
                           "overrides": {"verifier.batching": False, "drafter.batching": False}},
    "hf-batched": {"label": "transformers batched generate", "kind": "hf_batched"},
    "hf-assisted": {"label": "transformers assisted", "kind": "hf_assisted"},
}
#: Rows run in one pass when both are asked for (see :func:`pass_units`): the headline ratio's two rows. (Host
#: speed on a shared VM drifts by 15-30 % over tens of minutes; rows in separate passes were measured up to 40
#: minutes apart.)
PAIRED = (("pipespec-batched", "hf-batched"),)
RATIOS = {"batched_vs_hf_batched": ("pipespec-batched", "hf-batched"),
          "batched_vs_unbatched": ("pipespec-batched", "pipespec-unbatched")}


# ---------------------------------------------------------------------------------------------- helpers


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100) with linear interpolation between the closest ranks (numpy's default);
    None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a ÷ b``, or None when either is missing or ``b`` is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def level_prompts(prompts: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The first ``n`` of ``prompts`` repeated in turn (prompt i is ``prompts[i % len(prompts)]``)."""
    if not prompts:
        raise ValueError("no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


def pong_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The target forwards between two pongs and their mean sessions / tokens (pongs carry running means)."""
    f0, f1 = before.get("forwards", 0), after.get("forwards", 0)
    n = f1 - f0
    out: dict[str, Any] = {"forwards": n}
    for name in ("mean_batch_sessions", "mean_batch_tokens"):
        total = after.get(name, 0.0) * f1 - before.get(name, 0.0) * f0
        out[name] = total / n if n > 0 else None
    return out


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"bench_concurrency: --concurrency wants integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit(f"bench_concurrency: --concurrency wants positive integers, got {text!r}")
    return sorted(set(levels))


def check_models_installed(cfg: dict[str, Any], sections: list[str]) -> None:
    """Named offline models must be converted already (this benchmark never downloads): a clear error if not."""
    from shared.named_models import MARKER_NAME, is_named_model, model_dir

    missing = []
    for section in sections:
        name = cfg[section].get("model")
        if isinstance(name, str) and is_named_model(name):
            folder = model_dir(name)
            if not (folder / MARKER_NAME).is_file() or not (folder / "config.json").is_file():
                missing.append((section, name, folder))
    if missing:
        lines = [f"  {section}.model {name}: not installed in {folder}" for section, name, folder in missing]
        names = " ".join(dict.fromkeys(name for _, name, _ in missing))
        raise SystemExit("bench_concurrency: models missing:\n" + "\n".join(lines) + "\ninstall them first with "
                         f"`.venv/bin/python -m weights {names}` (downloads and converts them once), or run "
                         "with --random for a small random pair")


def node_log_tails(client: Any) -> str:
    tails = {role: client.cluster.log_tail(role) for role in client.cluster.nodes()}
    return "\n".join(f"--- end of {role} log ---\n{text}" for role, text in tails.items())


# ---------------------------------------------------------------------------------------------- rows


class Progress:
    """Logs ``done/total`` every ``every_s`` while a level runs (a level at N = 64 can take many minutes)."""

    def __init__(self, label: str, total: int, every_s: float):
        self.label, self.total, self.every_s = label, total, every_s
        self.done = 0
        self.t0 = time.perf_counter()
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            log(f"{self.label}: {self.done}/{self.total} requests done after {time.perf_counter() - self.t0:.0f} s")

    def __enter__(self) -> Progress:
        if self.every_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._task:
            self._task.cancel()


async def run_pipespec_level(client: Any, label: str, prompts: list[dict[str, Any]], max_new_tokens: int,
                             timeout_s: float, progress_s: float) -> dict[str, Any]:
    """All ``prompts`` sent at once; each request's latency from its send to its done message."""
    before = await client.ping(timeout_s=60)

    with Progress(label, len(prompts), progress_s) as progress:
        async def one(p: dict[str, Any]) -> dict[str, Any]:
            source = {"messages": p["messages"]} if p.get("messages") else {"token_ids": p["ids"]}
            t = time.perf_counter()
            r = await client.generate(**source, max_new_tokens=max_new_tokens, do_sample=False)
            latency = time.perf_counter() - t
            progress.done += 1
            return {"token_ids": r.token_ids, "latency_s": latency, "metrics": r.metrics}

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        wall = time.perf_counter() - t0
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            exc = failed[0].exception()
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n{node_log_tails(client)}") from exc
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(prompts)} requests unfinished after {timeout_s:.0f} s")
    after = await client.ping(timeout_s=60)
    requests = [t.result() for t in tasks]
    for i, (p, r) in enumerate(zip(prompts, requests)):
        if r["metrics"].get("prompt_tokens") != len(p["ids"]):
            log(f"WARNING {label}: request {i + 1}: the verifier templated {r['metrics'].get('prompt_tokens')} "
                f"tokens, the bench {len(p['ids'])}")
    return {"wall_s": wall, "requests": requests, "pong_before": before, "pong_after": after}


async def worker_call(worker: Worker, timeout_s: float, op: str, **request: Any) -> dict[str, Any]:
    """A worker request bounded by ``timeout_s``: past it the worker is killed (its rows then fail)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(worker.call, op, **request), timeout_s)
    except asyncio.TimeoutError:
        worker.proc.kill()
        raise TimeoutError(f"transformers worker: no answer to {op!r} within {timeout_s:.0f} s (killed)") from None


async def run_hf_batched_level(worker: Worker, prompts: list[dict[str, Any]], max_new_tokens: int,
                               timeout_s: float) -> dict[str, Any]:
    a = await worker_call(worker, timeout_s, "generate_batch", ids=[p["ids"] for p in prompts],
                          max_new_tokens=max_new_tokens)
    return {"wall_s": a["time_s"], "padded_width": a["width"],
            "requests": [{"token_ids": t, "latency_s": a["time_s"]} for t in a["token_ids"]]}


async def run_hf_assisted_level(worker: Worker, assistant: str, label: str, prompts: list[dict[str, Any]],
                                max_new_tokens: int, timeout_s: float, progress_s: float) -> dict[str, Any]:
    """One prompt after the other; a request's latency counts from the start of the row (requests queue)."""
    deadline = time.monotonic() + timeout_s
    requests = []
    t0 = time.perf_counter()
    last_log = t0
    for p in prompts:
        a = await worker_call(worker, max(1.0, deadline - time.monotonic()), "generate", ids=p["ids"],
                              max_new_tokens=max_new_tokens, strategy={"kind": "assistant", "model": assistant})
        requests.append({"token_ids": a["token_ids"], "latency_s": time.perf_counter() - t0, "stats": a["stats"],
                         "generate_s": a["time_s"]})
        if progress_s > 0 and time.perf_counter() - last_log > progress_s:
            last_log = time.perf_counter()
            log(f"{label}: {len(requests)}/{len(prompts)} requests done after {last_log - t0:.0f} s")
    return {"wall_s": time.perf_counter() - t0, "requests": requests}


# ---------------------------------------------------------------------------------------------- summaries


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_level(key: str, n: int, raw: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    """One table row: throughput, latency percentiles, batching figures, token identity against ``ref``."""
    row: dict[str, Any] = {"n": n, "key": key, "label": ROW_DEFS[key]["label"]}
    if raw.get("error"):
        row["error"] = raw["error"]
        return row
    reqs = raw["requests"]
    tokens = sum(len(r["token_ids"]) for r in reqs)
    latencies = [r["latency_s"] for r in reqs]
    row |= {"requests": len(reqs), "new_tokens": tokens, "wall_s": raw["wall_s"],
            "tokens_per_s": ratio(tokens, raw["wall_s"]),
            "latency_p50_s": percentile(latencies, 50), "latency_p95_s": percentile(latencies, 95)}
    if ROW_DEFS[key]["kind"] == "pipespec":
        ms = [r["metrics"] for r in reqs]
        row |= {"verify_batch_mean": _mean([m.get("verify_batch_mean", 0.0) for m in ms]),
                "draft_batch_mean": _mean([m.get("draft_batch_mean", 0.0) for m in ms]),
                "acceptance": SpecCounts.total(ms).alpha,
                "rounds": sum(m.get("rounds", 0) for m in ms),
                "dtypes": "/".join(sorted({f"{m.get('verifier_dtype')}+{m.get('drafter_dtype')}" for m in ms})),
                **pong_delta(raw["pong_before"], raw["pong_after"]),
                "pong_forwards_total": raw["pong_after"].get("forwards")}
    elif ROW_DEFS[key]["kind"] == "hf_assisted":
        row["acceptance"] = SpecCounts.total(r["stats"] for r in reqs).alpha
    if key == TOKEN_REF:
        row["mismatches"] = "ref"
    elif ref and not ref.get("error"):
        detail = token_mismatches(reqs, ref["requests"])
        row |= {"mismatches": f"{len(detail)}/{min(len(reqs), len(ref['requests']))}", "mismatch_detail": detail}
    return row


def summarize(report: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, dict[str, float | None]]]:
    rows, ratios = [], {}
    for n in report["meta"]["concurrency"]:
        level = report["raw"].get(str(n), {})
        summaries = {k: summarize_level(k, n, level[k], level.get(TOKEN_REF)) for k in report["meta"]["rows"]
                     if k in level}
        rows += summaries.values()
        tps = {k: s.get("tokens_per_s") for k, s in summaries.items()}
        if summaries:
            ratios[str(n)] = {name: ratio(tps.get(a), tps.get(b)) for name, (a, b) in RATIOS.items()}
    return rows, ratios


# ---------------------------------------------------------------------------------------------- reports

COLUMNS = ["N", "row", "requests", "new tokens", "wall s", "tok/s", "latency p50 s", "latency p95 s",
           "verify batch mean", "draft batch mean", "forwards", "mean batch sessions", "mean batch tokens",
           "α", "mismatches vs hf batched"]


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        if "error" in r:
            out.append([str(r["n"]), r["label"], "failed (see notes)", *[""] * (len(COLUMNS) - 3)])
            continue
        out.append([str(r["n"]), r["label"], str(r["requests"]), str(r["new_tokens"]), f"{r['wall_s']:.2f}",
                    fmt(r["tokens_per_s"]), fmt(r["latency_p50_s"]), fmt(r["latency_p95_s"]),
                    fmt(r.get("verify_batch_mean")), fmt(r.get("draft_batch_mean")),
                    str(r["forwards"]) if "forwards" in r else "—", fmt(r.get("mean_batch_sessions")),
                    fmt(r.get("mean_batch_tokens"), ".1f"), fmt(r.get("acceptance")), str(r.get("mismatches", "—"))])
    return out


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta, rows, ratios = report["meta"], report["rows"], report["ratios"]
    load = meta.get("load") or [None, None]
    lines = ["# pipespec under concurrent requests", "", *header_lines(meta),
             f"- config: `{meta['config']}`" + (f" with {meta['overrides']}" if meta.get("overrides") else "")
             + "; pipespec rows add `verifier.batching` and `drafter.batching` (both true, or both false); "
             f"verifier.max_batch_sessions {meta['max_batch_sessions']}, max_batch_tokens {meta['max_batch_tokens']}",
             f"- prompts: {len(meta['prompt_tokens'])} chat prompts from {', '.join(meta['prompt_files'])} "
             f"({min(meta['prompt_tokens'])}–{max(meta['prompt_tokens'])} tokens with the target's chat template), "
             f"repeated in turn to reach N; greedy, max_new_tokens {meta['max_new_tokens']}",
             f"- load average (1 min) at the start / end: {fmt(load[0])} / {fmt(load[1])} (above 0: other work on "
             "the same cores)"]
    lines.append("- order: every setup is started and warmed up once (pipespec: one request of "
                 f"{WARMUP_TOKENS} tokens; transformers: a batch of two and one assisted request), "
                 + ("all at once (no node profiles at start-up), " if meta.get("parallel_start") else "")
                 + "then at each N every row (of the pass) runs once, its N requests, in an order rotated by one per "
                 "level")
    for p in meta.get("pass_plan") or []:
        if len(meta["pass_plan"]) > 1:
            lines.append(f"- pass {p['index']} ({p['start'][11:19] if p.get('start') else '?'} – "
                         f"{(p.get('end') or '')[11:19] or 'not finished'} UTC, estimated "
                         f"{p['estimated_gib']:.1f} GiB): " + ", ".join(f"`{k}`" for k in p["rows"]))
    lines += ["", *md_table(COLUMNS, table_rows(rows), "rl" + "r" * (len(COLUMNS) - 2)), ""]
    lines += ["Ratios of total tokens/s:", "",
              *md_table(["N", "pipespec batched ÷ transformers batched generate",
                         "pipespec batched ÷ pipespec unbatched"],
                        [[n, fmt(r["batched_vs_hf_batched"], ".2f", "×"), fmt(r["batched_vs_unbatched"], ".2f", "×")]
                         for n, r in ratios.items()], "rrr"), ""]
    lines += [
        "Notes:",
        "- tok/s: all the level's new tokens ÷ its wall time (pipespec: from the first send to the last done "
        "message; batched generate: the one `generate` call; assisted: from the first request to the last).",
        "- latency: pipespec from a request's send to its done message; batched generate: every request's latency "
        "is the batch's time; assisted (sequential): from the start of the row, since requests queue.",
        "- verify / draft batch mean: the requests' `verify_batch_mean` (sessions in the target forwards of a "
        "request's rounds) and `draft_batch_mean` (rows per batched drafter step; 0 when the drafter reported no "
        "batched steps), averaged over the requests. forwards, mean batch sessions / tokens: the verifier's "
        "verification forwards during the level and their mean sessions / tokens, from its `ping()` before and "
        "after the level. The first is a mean over requests' rounds, the second over forwards, so a few large "
        "batches raise the first more (a forward of 4 sessions counts once in the second, in 4 rounds in the first).",
        "- mismatches: requests whose greedy tokens differ from the transformers batched row's for the same prompt "
        "(same dtype). Left padding changes a batched row's arithmetic (other shapes and kernels), so in bfloat16 a "
        "near-tie can come out the other way in either row; the counts are reported as measured.",
    ]
    for r in rows:
        if r.get("mismatch_detail"):
            detail = ", ".join(f"request {m['prompt'] + 1} from token {m['first_diff']}" for m in r["mismatch_detail"])
            lines.append(f"- N = {r['n']}, {r['label']}: differs from {ROW_DEFS[TOKEN_REF]['label']} on {detail}.")
    for r in rows:
        if "error" in r:
            lines += [f"- N = {r['n']}, {r['label']} failed:", "", "```", r["error"], "```"]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["meta"]["concurrency"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for key in report["meta"]["rows"]:
        points = [(r["n"], r["tokens_per_s"]) for r in report["rows"]
                  if r["key"] == key and r.get("tokens_per_s") is not None]
        if points:
            ax.plot([n for n, _ in points], [v for _, v in points], marker="o", label=ROW_DEFS[key]["label"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests N")
    ax.set_ylabel("total tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title(f"Throughput against concurrency ({report['meta']['max_new_tokens']} new tokens per request, greedy)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(out: Path, report: dict[str, Any], final: bool = False) -> None:
    report["rows"], report["ratios"] = summarize(report)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "concurrency.json", report)
    write_markdown(out / "concurrency.md", report)
    if final:
        write_plot(out / "concurrency.png", report)
        log(f"wrote {out / 'concurrency.md'}, {out / 'concurrency.json'}, {out / 'concurrency.png'}")


# ---------------------------------------------------------------------------------------------- the run


class Bench:
    """Opens the setups of each pass, warms them up, then runs every level: each row once, rotated per level."""

    def __init__(self, args: argparse.Namespace, report: dict[str, Any], rows: dict[str, Row],
                 setups: dict[str, ClusterSetup | HFSetup], prompts: list[dict[str, Any]], assistant: str | None,
                 before_save: Callable[[], None], parallel_start: bool = False, hf_dtype_known: bool = False):
        self.args, self.report, self.rows, self.setups = args, report, rows, setups
        self.parallel_start, self.hf_dtype_known = parallel_start, hf_dtype_known
        self.prompts, self.assistant = prompts, assistant
        self.before_save = before_save  # fills the header lines that depend on what the run found
        self.meta = report["meta"]

    def save(self, final: bool = False) -> None:
        """Rewrite the json and markdown (and the plot when ``final``); a report bug mid-run only warns."""
        try:
            self.before_save()
            write_reports(self.args.out, self.report, final)
        except Exception:
            if final:
                raise
            import traceback

            log("WARNING: writing the report failed:\n" + traceback.format_exc())

    def record(self, n: int, key: str, result: dict[str, Any]) -> None:
        self.report["raw"].setdefault(str(n), {})[key] = result

    async def run(self, passes: list[Any]) -> None:
        self.meta["pass_plan"] = [{"index": i, "rows": p.rows, "estimated_gib": p.estimated_gib, "start": None,
                                "end": None} for i, p in enumerate(passes, 1)]
        for info, p in zip(self.meta["pass_plan"], passes):
            info["start"] = utc_now()
            if len(passes) > 1:
                log(f"pass {info['index']}/{len(passes)} (estimated {p.estimated_gib:.1f} GiB): {', '.join(p.rows)}")
            await self.run_pass(p.rows)
            info["end"] = utc_now()
            self.save()

    async def run_pass(self, keys: list[str]) -> None:
        args = self.args
        failed: dict[str, str] = {}
        async with contextlib.AsyncExitStack() as stack:
            handles: dict[str, Any] = {}

            async def start(skey: str) -> None:
                t0 = time.perf_counter()
                try:
                    handles[skey] = await self.open(skey, stack, keys)
                except Exception as exc:  # a setup that does not start fails its rows, not the run
                    message = f"{type(exc).__name__}: {exc}"
                    log(f"{skey} failed to start: {message.splitlines()[0][:300]}")
                    for k in keys:
                        if self.rows[k].setup == skey:
                            failed[k] = message
                    return
                log(f"{skey}: ready and warmed up in {time.perf_counter() - t0:.1f} s")

            # Clusters first: their warm-up tells the dtype the verifier resolved, which the transformers rows use
            # (unless it is known already). One at a time where nodes profile at start-up (a profile measured while
            # other processes load would be off, and it is cached); all at once where none does.
            order = sorted(dict.fromkeys(self.rows[k].setup for k in keys), key=lambda s: s == HF_SETUP)
            if self.parallel_start:
                first = [s for s in order if s != HF_SETUP or self.hf_dtype_known]
                await asyncio.gather(*(start(s) for s in first))
                order = [s for s in order if s not in first]
            for skey in order:
                await start(skey)
            for li, n in enumerate(args.concurrency):
                prompts = level_prompts(self.prompts, n)
                for key in rotated(keys, li):
                    label = f"N = {n}, {ROW_DEFS[key]['label']}"
                    if key in failed:
                        self.record(n, key, {"error": failed[key]})
                        continue
                    log(f"{label}: {n} request(s)")
                    try:
                        result = await self.run_level(key, handles[self.rows[key].setup], prompts, label)
                    except Exception as exc:
                        message = f"{type(exc).__name__}: {exc}"
                        log(f"{label} failed: {message.splitlines()[0][:300]}")
                        self.record(n, key, {"error": message})
                        handle = handles[self.rows[key].setup]
                        if isinstance(handle, Worker) and handle.proc.poll() is not None:
                            for k in keys:  # a killed or dead worker: its other rows cannot run either
                                if self.rows[k].setup == HF_SETUP:
                                    failed[k] = f"the transformers worker failed earlier: {message.splitlines()[0]}"
                        self.save()
                        continue
                    self.record(n, key, result)
                    s = summarize_level(key, n, result, None)
                    extra = ""
                    if "verify_batch_mean" in s:
                        extra = (f"; verify batch {s['verify_batch_mean']:.2f}, draft batch "
                                 f"{s['draft_batch_mean']:.2f}, {s['forwards']} forwards")
                    log(f"{label}: {s['new_tokens']} tokens in {s['wall_s']:.2f} s ({fmt(s['tokens_per_s'])} tok/s), "
                        f"latency p50 {fmt(s['latency_p50_s'])} s / p95 {fmt(s['latency_p95_s'])} s{extra}")
                    self.meta["end"] = utc_now()
                    self.save()
            for skey, handle in handles.items():  # memory high-water marks, to check the planner's estimates
                pids = [handle.proc.pid] if isinstance(handle, Worker) else node_pids(handle)
                self.meta["peak_rss_gib"][skey] = sum(peak_rss_gib(pid) or 0.0 for pid in pids)

    async def open(self, skey: str, stack: contextlib.AsyncExitStack, keys: list[str]) -> Any:
        """Start setup ``skey`` for the rows ``keys`` of this pass and warm it up."""
        args, setup = self.args, self.setups[skey]
        first = self.prompts[0]
        if isinstance(setup, HFSetup):
            if not args.hf_dtype:
                setup.dtype = self.meta.get("verifier_dtype") or self.meta["hf_dtype_fallback"]
            self.meta["hf_dtype"], self.meta["hf_threads"] = setup.dtype, setup.threads
            log(f"{skey}: starting the transformers worker ({setup.dtype}, {setup.threads} thread(s))")
            worker = Worker(setup)
            stack.callback(worker.close)
            await worker_call(worker, args.start_timeout_s, "ready")
            await worker_call(worker, args.level_timeout_s, "generate_batch",
                              ids=[first["ids"], self.prompts[-1]["ids"]], max_new_tokens=WARMUP_TOKENS)
            if self.assistant and any(self.rows[k].setup == skey and ROW_DEFS[k]["kind"] == "hf_assisted"
                                      for k in keys):  # the assistant loads only in a pass that uses it
                await worker_call(worker, args.level_timeout_s, "generate", ids=first["ids"],
                                  max_new_tokens=WARMUP_TOKENS, strategy={"kind": "assistant",
                                                                          "model": self.assistant})
            return worker
        from runtime.launchers import cluster

        log(f"{skey}: starting the nodes with {setup.overrides}")
        # the client's bound on each wait for a reply: a level's bound (at N = 64 on two cores a request can wait
        # minutes between replies while the other sessions' prefills run)
        client = await stack.enter_async_context(cluster(setup.config, overrides=setup.overrides,
                                                         timeout_s=args.level_timeout_s))
        source = {"messages": first["messages"]} if first.get("messages") else {"token_ids": first["ids"]}
        r = await asyncio.wait_for(client.generate(**source, max_new_tokens=WARMUP_TOKENS, do_sample=False),
                                   args.level_timeout_s)
        dtypes = {"verifier": r.metrics.get("verifier_dtype"), "drafter": r.metrics.get("drafter_dtype")}
        self.meta["pipespec_dtypes"][skey] = dtypes
        self.meta.setdefault("verifier_dtype", dtypes["verifier"])
        return client

    async def run_level(self, key: str, handle: Any, prompts: list[dict[str, Any]], label: str) -> dict[str, Any]:
        args, kind = self.args, ROW_DEFS[key]["kind"]
        if kind == "pipespec":
            return await run_pipespec_level(handle, label, prompts, args.max_new_tokens, args.level_timeout_s,
                                            args.progress_s)
        if kind == "hf_batched":
            return await run_hf_batched_level(handle, prompts, args.max_new_tokens, args.level_timeout_s)
        if not self.assistant:
            raise RuntimeError("the config's drafter has no assistant model (drafter.type is not assistant)")
        return await run_hf_assisted_level(handle, self.assistant, label, prompts, args.max_new_tokens,
                                           args.level_timeout_s, args.progress_s)


def random_config(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A small random target and its 1-layer cut (``benchmarks.models.build_random_pair``), float32, one thread per
    node, a fixed block (no start-up profile): a run of seconds."""
    target, assistant = build_random_pair(root / "models", hidden=args.hidden, layers=args.layers, heads=4,
                                          kv_heads=2, intermediate=args.hidden * 2, max_positions=1024,
                                          deep_scale=0.05, seed=args.seed)
    return {
        "verifier": {"model": str(target), "dtype": "float32", "threads": 1, "profile_s": 0},
        "drafter": {"type": "assistant", "model": str(assistant), "dtype": "float32", "threads": 1, "profile_s": 0,
                    "draft_schedule": "constant", "num_draft_tokens": 4},
        "client": {"timeout_s": 300},
        "launch": {"ready_timeout_s": 300},
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="rows: " + ", ".join(ROW_DEFS))
    p.add_argument("--concurrency", type=parse_levels, default=parse_levels("1,4,16,64"),
                   help="comma list of concurrency levels N (default: 1,4,16,64)")
    p.add_argument("--config", default="cpu.yaml", help="pipespec config (a path or a name in configs/; default "
                   "cpu.yaml); its verifier model is the transformers rows' target, its drafter model their assistant")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key for both pipespec rows (repeatable)")
    p.add_argument("--random", action="store_true",
                   help="a small random target and its 1-layer cut instead of --config's models (a smoke run)")
    p.add_argument("--hidden", type=int, default=64, help="--random: hidden size (default 64)")
    p.add_argument("--layers", type=int, default=2, help="--random: target layers (default 2)")
    p.add_argument("--seed", type=int, default=0, help="--random: weights seed")
    p.add_argument("--rows", default=",".join(ROW_DEFS),
                   help="comma list of row keys or prefixes (default: all): " + ", ".join(ROW_DEFS))
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per request (default: 32)")
    p.add_argument("--prompt-files", type=Path, nargs="+", default=PROMPT_FILES,
                   help="JSON lists of {id, messages} (default: scripts/prompts/ agent_prompts.json, "
                        "code_prompts.json, edit_prompts.json)")
    p.add_argument("--hf-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the transformers rows' dtype (default: the one pipespec's verifier resolved)")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="the transformers rows' threads (default: the verifier's full thread count)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory the setups of one pass may use together (default: 90%% of MemAvailable at start)")
    p.add_argument("--level-timeout-s", type=float, default=7200.0,
                   help="most seconds one row may take at one level (default 7200)")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="most seconds a worker may take to load")
    p.add_argument("--progress-s", type=float, default=30.0, help="progress line period within a level (0: none)")
    p.add_argument("--out", type=Path, default=results_dir(), help="output folder (default: results/)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the rows, prompts, threads, dtypes and passes, and exit without starting anything")
    p.add_argument("--replot", action="store_true", help="only rebuild the .md and .png from --out's concurrency.json")
    return p


def pass_units(keys: list[str]) -> list[list[str]]:
    """The rows that must share a pass (``benchmarks.passes.plan_passes``): each ratio the aims name is only as good as
    the host stays steady between its two rows, so the rows of each pair in ``PAIRED`` run in one pass, level by
    level in rotated order, whenever both are asked for; the other rows go wherever they fit (at worst a pass of
    their own, the transformers worker started again there)."""
    units, placed = [], set()
    for pair in PAIRED:
        if all(k in keys for k in pair) and not placed & set(pair):
            units.append(list(pair))
            placed |= set(pair)
    return units + [[k] for k in keys if k not in placed]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.replot:
        report = read_result(args.out / "concurrency.json")  # older, pretty-printed files read the same
        write_reports(args.out, report, final=True)
        return 0
    keys = select_rows(args.rows, list(ROW_DEFS), "bench_concurrency")
    with tempfile.TemporaryDirectory(prefix="pipespec-concurrency-") as tmp:
        if args.random:
            os.environ.setdefault("PIPESPEC_PROFILE_DIR", str(Path(tmp) / "profiles"))
            source: str | dict[str, Any] = random_config(Path(tmp), args)
        else:
            source = args.config
        return run(args, keys, source)


def run(args: argparse.Namespace, keys: list[str], source: str | dict[str, Any]) -> int:
    from runtime.config import ConfigError, load_config, parse_overrides
    from shared.models import ThreadPlan, concrete_dtype, load_tokenizer
    from weights import resolve_model

    try:
        user = parse_overrides(args.set)
        cfg = load_config(source, user)
        configs = {k: load_config(source, {**user, **ROW_DEFS[k]["overrides"]}) for k in keys
                   if ROW_DEFS[k]["kind"] == "pipespec"}
    except ConfigError as exc:
        raise SystemExit(f"bench_concurrency: {exc}") from None
    hf_rows = [k for k in keys if ROW_DEFS[k]["kind"] != "pipespec"]
    assistant_row = "hf-assisted" in keys
    need = ["verifier"]
    if (configs and cfg["launch"]["start_drafter"]) or (assistant_row and cfg["drafter"]["type"] == "assistant"):
        need.append("drafter")
    check_models_installed(cfg, need)
    target = resolve_model(cfg["verifier"]["model"])
    assistant = resolve_model(cfg["drafter"]["model"]) if cfg["drafter"]["type"] == "assistant" else None
    if assistant_row and not assistant:
        log(f"WARNING: drafter.type is {cfg['drafter']['type']!r}, not assistant: the hf-assisted row will fail")
    messages = []
    for f in args.prompt_files:
        messages += [p["messages"] for p in load_prompts(Path(f))]
    prompts = chat_prompts(load_tokenizer(target), messages)

    v, d = cfg["verifier"], cfg["drafter"]
    vthreads = ThreadPlan.for_node(v["threads"], v["device"], d["device"])
    dthreads = ThreadPlan.for_node(d["threads"], d["device"], v["device"])
    hf_threads = args.hf_threads or vthreads.full
    setups: dict[str, ClusterSetup | HFSetup] = {}
    rows: dict[str, Row] = {}
    for k in keys:
        if ROW_DEFS[k]["kind"] == "pipespec":
            c = configs[k]
            setups[k] = ClusterSetup(k, source, {**user, **ROW_DEFS[k]["overrides"]}, cluster_models(c),
                                     processes=1 + (c["launch"]["drafters"] if c["launch"]["start_drafter"] else 0))
            rows[k] = Row(k, ROW_DEFS[k]["label"], k)
        else:
            if HF_SETUP not in setups:
                # the verifier's dtype unless given; auto may become float32: budget for the larger
                sized = args.hf_dtype or (v["dtype"] if v["dtype"] != "auto" else "float32")
                setups[HF_SETUP] = HFSetup(HF_SETUP, sized, hf_threads, cfg["verifier"]["device"], target,
                                           model_gib(target, sized))
            models = {"drafter": model_gib(assistant, setups[HF_SETUP].dtype)} if k == "hf-assisted" and assistant \
                else {}
            rows[k] = Row(k, ROW_DEFS[k]["label"], HF_SETUP, models=models)
    units = pass_units(keys)
    budget = memory_budget_gib(args.memory_gib)
    passes = plan_passes(units, rows, setups, budget)

    models = (f"target `{v['model']}`, drafter `{d['model']}` ({d['type']})" if not args.random else
              f"random Qwen2-style target (hidden {args.hidden}, {args.layers} layers) and its 1-layer cut "
              "(benchmarks.models.build_random_pair)")
    meta: dict[str, Any] = {
        "start": utc_now(), "end": None, "machine": machine_info(), "load": [os.getloadavg()[0], None],
        "config": "random pair (--random)" if args.random else str(args.config), "overrides": args.set,
        "models": models, "random": args.random, "rows": keys, "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens, "prompt_files": [Path(f).name for f in args.prompt_files],
        "prompt_tokens": [len(p["ids"]) for p in prompts], "memory_budget_gib": budget,
        "max_batch_sessions": v["max_batch_sessions"], "max_batch_tokens": v["max_batch_tokens"],
        "hf_dtype_fallback": args.hf_dtype or concrete_dtype(v["dtype"], v["device"]),
        "pipespec_dtypes": {}, "peak_rss_gib": {},
        "verifier_threads": {"config": v["threads"], "share": vthreads.share, "full": vthreads.full},
        "drafter_threads": {"config": d["threads"], "share": dthreads.share, "full": dthreads.full},
    }
    report: dict[str, Any] = {"meta": meta, "raw": {}}

    def describe() -> None:  # the dtype and thread lines of the header, once the values are known
        pd = meta["pipespec_dtypes"]
        shown = "; ".join(f"{k}: verifier {x['verifier']}, drafter {x['drafter']}" for k, x in pd.items())
        meta["dtypes"] = (f"pipespec config verifier `{v['dtype']}`, drafter `{d['dtype']}`"
                          + (f", resolved {shown}" if shown else "")
                          + (f"; transformers rows {meta['hf_dtype']}" if meta.get("hf_dtype") else "")
                          + (" (`--hf-dtype`)" if args.hf_dtype else " (the verifier's)" if pd else ""))
        vt, dt = meta["verifier_threads"], meta["drafter_threads"]
        meta["threads"] = (f"pipespec verifier `{vt['config']}` → {vt['share']} while the drafter computes, "
                           f"{vt['full']} while it idles; drafter `{dt['config']}` → {dt['share']} / {dt['full']}; "
                           "one process per node")
        if hf_rows:
            meta["threads"] += (f"; transformers rows {hf_threads} (one worker process; "
                                + ("`--hf-threads`" if args.hf_threads else "the verifier's full count") + ")")

    def before_save() -> None:
        describe()
        meta["load"][1] = os.getloadavg()[0]

    before_save()
    # no node measures a start-up profile: the setups may start at once (a profile taken meanwhile would be off)
    quiet = all(c[role]["profile_s"] == 0 for c in configs.values() for role in ("verifier", "drafter"))
    meta["parallel_start"] = quiet
    bench = Bench(args, report, rows, setups, prompts, assistant, before_save, parallel_start=quiet,
                  hf_dtype_known=bool(args.hf_dtype) or v["dtype"] != "auto")
    log(f"rows: {', '.join(keys)}; concurrency {', '.join(map(str, args.concurrency))}; {len(prompts)} prompts "
        f"({min(meta['prompt_tokens'])}–{max(meta['prompt_tokens'])} tokens), max_new_tokens {args.max_new_tokens}; "
        f"{len(passes)} pass(es) within {budget:.1f} GiB")
    if configs and max(args.concurrency) > v["max_sessions"]:
        log(f"WARNING: N = {max(args.concurrency)} is above verifier.max_sessions ({v['max_sessions']}): requests "
            "past it are refused (busy); raise it with --set verifier.max_sessions=N")
    if args.dry_run:
        print("\n".join([*(line for line in header_lines(meta)[3:]),
                         plan_text(passes, rows, setups, budget)]))
        return 0
    asyncio.run(bench.run(passes))
    meta["end"] = utc_now()
    bench.save(final=True)
    print((args.out / "concurrency.md").read_text())
    return 1 if any("error" in r for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
