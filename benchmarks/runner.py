"""The interleaved run: passes of rows, prompt by prompt, every row decoding prompt i before any row starts prompt
i + 1 in an order rotated per prompt, so a host whose speed changes slows all rows alike."""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.llama_server import LlamaServer
from benchmarks.machine import node_pids, peak_rss_gib
from benchmarks.ov_genai import OVWorker
from benchmarks.passes import HFSetup, LlamaSetup, OVSetup, Pass, Row, Setup, rotated
from benchmarks.progress import log, utc_now
from benchmarks.workers import Worker

WARMUP_TOKENS = 8


class Runner:
    """Runs passes of rows interleaved prompt by prompt and keeps every result (see :meth:`state`).

    ``prompts``: prompt set name → list of ``{"ids": [...], "messages": [...]}``; a row decodes prompt i of its own
    set (a cluster gets the messages, templated by its verifier, or the ids where there are no messages).
    ``on_update`` is called after every prompt (the scripts rewrite their json there). ``warmup_prompts``: prompt
    set name → the prompt its rows warm up on (default: the set's first; a benchmark of a drafter that learns across
    requests warms up on an unrelated one, so that request 1 is new to it).
    """

    def __init__(self, rows: dict[str, Row], setups: dict[str, Setup], prompts: dict[str, list[dict[str, Any]]],
                 max_new_tokens: int, on_update: Callable[[], None], curve_prefix: int = 64,
                 curve_budget_s: float = 20.0, curve_repeats: int = 2,
                 warmup_prompts: dict[str, dict[str, Any]] | None = None):
        self.rows, self.setups, self.prompts = rows, setups, prompts
        self.warmup_prompts = warmup_prompts or {}
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
            for skey, handle in list(handles.items()):  # after its curves: the pipeline's copy of the weights
                if isinstance(handle, OVWorker):
                    try:
                        load_s = await asyncio.to_thread(handle.load)
                    except Exception as exc:
                        for r in rows:
                            if r.setup == skey:
                                fail(r, f"{type(exc).__name__}: {exc}")
                        continue
                    self.setup_info.setdefault(skey, {})["load_s"] = load_s
            live = [r for r in rows if not r.curves_only and r.key not in failed]
            for r in live:  # warm-up, untimed
                try:
                    await self._generate(r, handles[r.setup], 0, WARMUP_TOKENS, warmup=True)
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
                pids = [handle.proc.pid] if isinstance(handle, (Worker, LlamaServer, OVWorker)) else node_pids(handle)
                peaks = [peak_rss_gib(pid) or 0.0 for pid in pids]
                info = self.setup_info.setdefault(skey, {})
                info["peak_rss_gib"] = max(info.get("peak_rss_gib", 0.0), sum(peaks))

    async def _open(self, setup: Setup, stack: contextlib.AsyncExitStack) -> Any:
        if isinstance(setup, HFSetup):
            worker = Worker(setup)
            stack.callback(worker.close)
            await asyncio.to_thread(worker.call, "ready")
            return worker
        if isinstance(setup, LlamaSetup):
            server = LlamaServer(setup)
            stack.callback(server.close)
            await asyncio.to_thread(server.start)
            self.setup_info.setdefault(setup.key, {})["command"] = server.command  # what the table's notes show
            return server
        if isinstance(setup, OVSetup):
            ov = OVWorker(setup)
            stack.callback(ov.close)
            info = await asyncio.to_thread(ov.start)
            self.setup_info.setdefault(setup.key, {})["openvino"] = {**info, "exports": ov.exports}
            return ov
        from runtime.launchers import cluster

        log(f"{setup.key}: starting the nodes of {setup.config}" + (f" with {setup.overrides}" if setup.overrides
                                                                   else ""))
        return await stack.enter_async_context(cluster(setup.config, overrides=setup.overrides or None))

    async def _measure_curves(self, setup: Setup, worker: Worker | OVWorker) -> None:
        # an OpenVINO worker's dtype is what its CPU plugin resolved the precision hint to
        dtype = worker.curve_dtype if isinstance(worker, OVWorker) else setup.dtype
        entry = self.curves.setdefault(setup.key, {"dtype": dtype, "threads_label": setup.threads_label,
                                                   "threads": setup.threads, "models": {}, "curves": {}})
        for name, model, sizes in setup.curves:
            t0 = time.perf_counter()
            try:
                c = await asyncio.to_thread(worker.call, "curve", model=model, sizes=sizes, **self.curve_args)
            except RuntimeError as exc:  # WorkerError, or the OpenVINO worker's error answer
                log(f"{setup.key}: {name} cost curve failed: {exc}")
                continue
            path = setup.target_path if model == "target" else setup.draft_path if isinstance(setup, OVSetup) else model
            entry["models"][name] = Path(path or model).name
            entry["curves"][name] = c
            log(f"{setup.key}: {name} cost curve in {time.perf_counter() - t0:.1f} s: "
                + ", ".join(f"{n}: {1000 * s:.0f} ms" for n, s in zip(c["sizes"], c["seconds"])))

    async def _generate(self, row: Row, handle: Any, i: int, max_new_tokens: int,
                        warmup: bool = False) -> dict[str, Any]:
        prompt = self.prompts[row.prompt_set][i]
        if warmup:
            prompt = self.warmup_prompts.get(row.prompt_set, prompt)
        at = time.time()  # when it started: the order the rows ran in, to the microsecond
        if isinstance(handle, Worker):
            a = await asyncio.to_thread(handle.call, "generate", ids=prompt["ids"], max_new_tokens=max_new_tokens,
                                        strategy=row.strategy)
            return {"token_ids": a["token_ids"], "new_tokens": len(a["token_ids"]), "time_s": a["time_s"],
                    "stats": a["stats"], "at": at, "hf": {"generator": a["generator"], "settings": a["settings"]}}
        if isinstance(handle, OVWorker):
            return {**await asyncio.to_thread(handle.generate, prompt["ids"], max_new_tokens), "at": at}
        if isinstance(handle, LlamaServer):
            a = await asyncio.to_thread(handle.generate, prompt["ids"], max_new_tokens)
            return {"token_ids": a["token_ids"], "new_tokens": len(a["token_ids"]), "time_s": a["time_s"],
                    "stats": a["stats"], "at": at, "llama": {"timings": a["timings"], "stop_type": a["stop_type"]}}
        t0 = time.perf_counter()
        try:
            source = {"messages": prompt["messages"]} if prompt.get("messages") else {"token_ids": prompt["ids"]}
            r = await handle.generate(**source, max_new_tokens=max_new_tokens, do_sample=False)
        except Exception as exc:  # keep the node logs with the error text
            tails = {role: handle.cluster.log_tail(role) for role in handle.cluster.nodes()}
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n" + "\n".join(
                f"--- end of {role} log ---\n{text}" for role, text in tails.items())) from exc
        elapsed = time.perf_counter() - t0
        if r.metrics.get("prompt_tokens") != len(prompt["ids"]):
            log(f"WARNING {row.label}: prompt {i + 1}: the verifier templated {r.metrics.get('prompt_tokens')} "
                f"tokens, the bench {len(prompt['ids'])}")
        return {"token_ids": r.token_ids, "new_tokens": len(r.token_ids), "time_s": elapsed, "metrics": r.metrics,
                "at": at}


def run_report(rows: dict[str, Row], setups: dict[str, Setup], prompts: dict[str, list[dict[str, Any]]],
               max_new_tokens: int, passes: list[Pass], meta: dict[str, Any],
               write: Callable[[dict[str, Any], bool], None], markdown: Path, **runner_args: Any) -> int:
    """Run ``passes`` with a :class:`Runner`, the report rewritten after every prompt: ``write(report, final)`` adds
    its ``rows`` and writes the files (``final``: once, at the end). Prints ``markdown`` at the end; returns the exit
    status, 1 when a row failed. ``runner_args``: the Runner's optional arguments."""

    def save(final: bool = False) -> dict[str, Any]:
        meta["passes"] = runner.passes
        report = {"meta": meta, **runner.state()}
        write(report, final)
        return report

    runner = Runner(rows, setups, prompts, max_new_tokens, save, **runner_args)
    asyncio.run(runner.run(passes))
    meta["end"] = utc_now()
    report = save(final=True)
    print(markdown.read_text())
    return 1 if any("error" in r for r in report["rows"]) else 0
