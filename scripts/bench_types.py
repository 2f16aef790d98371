#!/usr/bin/env python
"""Benchmark every drafter type against the target alone and against transformers' own implementation of the
same strategy, side by side in one run, on the real models of this machine (see MODELS.md).

Each type runs on the prompts where it makes sense:

- ``edit`` prompts (``scripts/prompts/edit_prompts.json``: code-edit requests that repeat their input) for prompt
  lookup;
- ``code`` prompts (``scripts/prompts/code_prompts.json``) for the model-based types.

Every prompt set has its own reference row, transformers ``generate(do_sample=False)`` on the target alone at one
thread; each other row's tokens/s is divided by it and its output compared with it token by token (mismatches are
counted, never hidden). Rows (greedy, chat template of the target, one warm-up generation per row):

===================  ==========================================================================================
``target-code``      transformers target alone, code prompts (reference)
``hf-assistant``     transformers assisted generation with the 0.5B drafter
``pipespec-assistant``  ``configs/cpu.yaml``
``hf-early-exit``    transformers ``assistant_early_exit=E`` (E from ``configs/early_exit.yaml``)
``pipespec-early-exit`` ``configs/early_exit.yaml``
``hf-universal``     transformers universal assisted decoding (``assistant_model``, ``tokenizer``,
                     ``assistant_tokenizer``) with the drafter of ``configs/universal.yaml``
``pipespec-universal``  ``configs/universal.yaml``
``pipespec-ensemble``   ``configs/cpu.yaml`` with ``verification.ensemble_weight`` = ``--ensemble-weight`` (lossy by
                     design: its mismatches are expected; the point is the acceptance next to ``pipespec-assistant``)
``target-edit``      transformers target alone, edit prompts (reference)
``hf-prompt-lookup`` transformers ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size`` from
                     ``configs/prompt_lookup.yaml``
``pipespec-prompt-lookup`` ``configs/prompt_lookup.yaml``
===================  ==========================================================================================

transformers rows run in one subprocess at ``--hf-threads`` threads (default 1); pipespec rows use the configs'
thread counts (one per node). ``mtp`` and ``mtp_drafter`` need checkpoints this machine does not have (DeepSeek-V3 /
GLM-4.5 with MTP layers, a Gemma 4 target with its -assistant); the table says so instead of inventing a row.

Outputs in ``--out`` (default ``results/``): ``types.md`` and ``types.json`` (rewritten after every row).

Usage::

    .venv/bin/python scripts/bench_types.py                                   # all rows, 4 prompts × 64 tokens
    .venv/bin/python scripts/bench_types.py --rows target-edit,hf-prompt-lookup,pipespec-prompt-lookup
    .venv/bin/python scripts/bench_types.py --prompts 1 --max-new-tokens 8   # a quick smoke
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import REPO_ROOT, WARMUP_TOKENS, DraftCounter, _fmt, header_lines, log, machine_info, run_worker

PROMPT_SETS = {"code": REPO_ROOT / "scripts" / "prompts" / "code_prompts.json",
               "edit": REPO_ROOT / "scripts" / "prompts" / "edit_prompts.json"}
REFERENCES = {"code": "target-code", "edit": "target-edit"}


# key -> (label, drafter type, runner, prompt set, config); runner "hf:<strategy>" or "pipespec". Run order.
ROWS: dict[str, tuple[str, str, str, str, str]] = {
    "target-code": ("hf target alone", "—", "hf:target", "code", "cpu.yaml"),
    "hf-assistant": ("hf assisted", "assistant", "hf:assistant", "code", "cpu.yaml"),
    "hf-early-exit": ("hf early exit", "early_exit", "hf:early_exit", "code", "early_exit.yaml"),
    "hf-universal": ("hf universal", "universal", "hf:universal", "code", "universal.yaml"),
    "target-edit": ("hf target alone (edit prompts)", "—", "hf:target", "edit", "prompt_lookup.yaml"),
    "hf-prompt-lookup": ("hf prompt lookup", "prompt_lookup", "hf:prompt_lookup", "edit", "prompt_lookup.yaml"),
    "pipespec-assistant": ("pipespec assistant", "assistant", "pipespec", "code", "cpu.yaml"),
    "pipespec-early-exit": ("pipespec early_exit", "early_exit", "pipespec", "code", "early_exit.yaml"),
    "pipespec-universal": ("pipespec universal", "universal", "pipespec", "code", "universal.yaml"),
    "pipespec-ensemble": ("pipespec assistant + ensemble", "assistant+ensemble", "pipespec", "code", "cpu.yaml"),
    "pipespec-prompt-lookup": ("pipespec prompt_lookup", "prompt_lookup", "pipespec", "edit", "prompt_lookup.yaml"),
}
NOT_RUNNABLE = {
    "mtp": "needs a DeepSeek-V3 / GLM-4.5 checkpoint with MTP layers (none installable here)",
    "mtp_drafter": "needs a Gemma 4 target and its -assistant checkpoint (none installable here)",
}


def hf_same_strategy(key: str) -> str | None:
    """The transformers row a pipespec row is compared with."""
    kind = ROWS[key][1].split("+")[0]
    return next((k for k, row in ROWS.items() if row[2] == f"hf:{kind}"), None)


# ---------------------------------------------------------------------------------------------- hf worker


def hf_worker(job_path: Path) -> int:
    """Subprocess body: load the target once and each drafter when first needed; run the transformers rows."""
    import bench

    job = json.loads(job_path.read_text())
    bench._START = job["start"]
    import torch
    import transformers

    from runtime.config import load_config
    from shared.models import load_causal_lm, load_tokenizer, resolve_model, set_threads

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    set_threads(job["threads"])
    target_path = resolve_model(load_config("cpu.yaml")["verifier"]["model"])
    target = load_causal_lm(target_path, "cpu", job["dtype"])
    target_tokenizer = load_tokenizer(target_path)
    log(f"hf worker: target loaded ({job['threads']} thread(s))")
    out: dict[str, Any] = {}

    def generation_kwargs(strategy: str, config: str) -> dict[str, Any]:
        d = load_config(config)["drafter"]
        if strategy == "target":
            return {}
        if strategy == "prompt_lookup":
            return {"prompt_lookup_num_tokens": d["prompt_lookup_num_tokens"],
                    "max_matching_ngram_size": d["max_matching_ngram_size"]}
        if strategy == "early_exit":
            return {"assistant_early_exit": d["assistant_early_exit"]}
        draft_path = resolve_model(d["model"])
        kwargs = {"assistant_model": load_causal_lm(draft_path, "cpu", job["dtype"])}
        if strategy == "universal":
            kwargs |= {"tokenizer": target_tokenizer, "assistant_tokenizer": load_tokenizer(draft_path)}
        return kwargs

    for key in job["rows"]:
        label, _, runner, prompt_set, config = ROWS[key]
        strategy = runner.split(":", 1)[1]
        kwargs = generation_kwargs(strategy, config)
        prompts = job["prompt_ids"][prompt_set]

        def generate(ids: list[int], max_new: int, kwargs: dict[str, Any] = kwargs) -> list[int]:
            input_ids = torch.tensor([ids], dtype=torch.long)
            tokens = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                     max_new_tokens=max_new, **kwargs)
            return tokens[0, len(ids):].tolist()

        counter = DraftCounter()
        try:
            generate(prompts[0], WARMUP_TOKENS)
            per_prompt = []
            with counter.patched():
                for i, ids in enumerate(prompts):
                    t0 = time.perf_counter()
                    tokens = generate(ids, job["max_new_tokens"])
                    elapsed = time.perf_counter() - t0
                    per_prompt.append({"token_ids": tokens, "new_tokens": len(tokens), "time_s": elapsed})
                    log(f"{label}: prompt {i + 1}/{len(prompts)}: {len(tokens)} tokens in {elapsed:.2f} s")
        except Exception as exc:  # transformers' own strategy may fail on this model: report it as the row
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{label} failed: {out[key]['error']}")
            continue
        stats = {name: getattr(counter, name) for name in ("drafts", "draft_tokens", "accepted_tokens", "rounds")}
        out[key] = {"per_prompt": per_prompt, "stats": stats if strategy != "target" else None,
                    "settings": counter.settings, "generator": counter.generator}
        kwargs.clear()  # free the assistant before the next row loads its own
    Path(job["out"]).write_text(json.dumps(out))
    return 0


def run_hf_rows(keys: list[str], ctx: dict[str, Any], tmp: Path) -> dict[str, Any]:
    job = {"start": _bench_start(), "threads": ctx["hf_threads"], "rows": keys, "prompt_ids": ctx["prompt_ids"],
           "max_new_tokens": ctx["max_new_tokens"], "dtype": ctx["dtype"], "out": str(tmp / "hf.out.json")}
    job_path = tmp / "hf.job.json"
    job_path.write_text(json.dumps(job))
    run_worker(Path(__file__), job_path, ctx["hf_threads"], "hf worker")
    return json.loads(Path(job["out"]).read_text())


def _bench_start() -> float:
    import bench

    return bench._START


# ---------------------------------------------------------------------------------------------- pipespec rows


async def run_pipespec_row(key: str, ctx: dict[str, Any]) -> dict[str, Any]:
    from runtime.launch import cluster

    label, kind, _, prompt_set, config = ROWS[key]
    overrides = {"verification.ensemble_weight": ctx["ensemble_weight"]} if kind.endswith("ensemble") else None
    messages_list = ctx["messages"][prompt_set]
    async with cluster(config, overrides=overrides) as client:
        try:
            await client.generate(messages=messages_list[0], max_new_tokens=WARMUP_TOKENS, do_sample=False)
            per_prompt = []
            for i, messages in enumerate(messages_list):
                t0 = time.perf_counter()
                r = await client.generate(messages=messages, max_new_tokens=ctx["max_new_tokens"], do_sample=False)
                elapsed = time.perf_counter() - t0
                per_prompt.append({"token_ids": r.token_ids, "new_tokens": len(r.token_ids), "time_s": elapsed,
                                   "metrics": r.metrics})
                log(f"{label}: prompt {i + 1}/{len(messages_list)}: {len(r.token_ids)} tokens in {elapsed:.2f} s, "
                    f"α {r.metrics['acceptance_rate']:.2f}, τ {r.metrics['mean_accepted_length']:.2f}")
        except Exception as exc:
            tails = {role: client.cluster.log_tail(role) for role in client.processes}
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n" + "\n".join(
                f"--- end of {role} log ---\n{text}" for role, text in tails.items())) from exc
    stats = {name: sum(p["metrics"][name] for p in per_prompt)
             for name in ("drafts", "draft_tokens", "accepted_tokens", "rounds")}
    return {"per_prompt": per_prompt, "stats": stats}


# ---------------------------------------------------------------------------------------------- report


def _tps(raw: dict[str, Any]) -> float:
    pp = raw["per_prompt"]
    return sum(p["new_tokens"] for p in pp) / sum(p["time_s"] for p in pp)


def summarize(key: str, raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    label, kind, runner, prompt_set, config = ROWS[key]
    row: dict[str, Any] = {"key": key, "label": label, "type": kind, "prompt_set": prompt_set, "config": config}
    r = raw[key]
    if "error" in r:
        return row | {"error": r["error"]}
    pp = r["per_prompt"]
    row |= {"prompts": len(pp), "new_tokens": sum(p["new_tokens"] for p in pp),
            "time_s": sum(p["time_s"] for p in pp), "tokens_per_s": _tps(r)}
    s = r.get("stats")
    if s and s["draft_tokens"]:
        row |= {"alpha": s["accepted_tokens"] / s["draft_tokens"], "tau": 1 + s["accepted_tokens"] / s["drafts"],
                "k": s["draft_tokens"] / s["drafts"], "drafts": s["drafts"], "rounds": s["rounds"]}
    elif s:
        row |= {"alpha": 0.0, "tau": 1.0, "drafts": 0, "rounds": s["rounds"]}
    ref_key = REFERENCES[prompt_set]
    ref = raw.get(ref_key)
    if ref and "error" not in ref:
        row["vs_target"] = row["tokens_per_s"] / _tps(ref)
        if key != ref_key:
            row["mismatches"] = sum(p["token_ids"] != q["token_ids"] for p, q in zip(pp, ref["per_prompt"]))
    same = hf_same_strategy(key) if runner == "pipespec" else None
    if same and same in raw and "error" not in raw[same]:
        row["vs_hf_same"] = row["tokens_per_s"] / _tps(raw[same])
    return row


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta = report["meta"]
    lines = [
        "# pipespec drafter types benchmark",
        "",
        *header_lines(meta),
        f"- target `{meta['target']}` ({meta['dtype']}); drafters as in each row's config; greedy; "
        f"{meta['prompts']} prompts per set, max_new_tokens {meta['max_new_tokens']}, one warm-up per row",
        f"- threads: transformers rows {meta['hf_threads']} (one process); pipespec rows one per node (two processes)",
        f"- ensemble weight w = {meta['ensemble_weight']}",
        "- vs target = tokens/s ÷ the target alone on the same prompts; vs hf = ÷ transformers' same strategy; "
        "mismatches = prompts whose tokens differ from the target alone",
        "",
        "| row | type | prompts | config | tok/s | α | τ | k | vs target | vs hf same strategy | mismatches |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['type']} | {r['prompt_set']} | `{r['config']}` | error |" + " |" * 6)
            notes.append(f"- {r['label']} failed: `{r['error'].splitlines()[0][:300]}`")
            continue
        mism = f"{r['mismatches']}/{r['prompts']}" if "mismatches" in r else "ref"
        lines.append(
            f"| {r['label']} | {r['type']} | {r['prompt_set']} | `{r['config']}` | {r['tokens_per_s']:.2f} | "
            f"{_fmt(r.get('alpha'))} | {_fmt(r.get('tau'))} | {_fmt(r.get('k'))} | "
            f"{_fmt(r.get('vs_target'), '.2f', '×')} | {_fmt(r.get('vs_hf_same'), '.2f', '×')} | {mism} |")
    for kind, why in NOT_RUNNABLE.items():
        lines.append(f"| pipespec {kind} | {kind} | — | — | not run: {why} |" + " |" * 6)
    for key, info in report.get("hf_settings", {}).items():
        notes.append(f"- {ROWS[key][0]}: transformers used `{info['generator']}` with {info['settings'] or '—'}")
    path.write_text("\n".join(lines + (["", "Notes:", *notes] if notes else [])) + "\n")


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="rows: " + ", ".join(ROWS))
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of row keys (default: all)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per set (from the start of each file)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--hf-threads", type=int, default=1)
    p.add_argument("--ensemble-weight", type=float, default=0.7)
    p.add_argument("--_hf-worker", dest="hf_worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    if args.hf_worker:
        return hf_worker(args.hf_worker)
    keys = [k.strip() for k in args.rows.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise SystemExit(f"bench_types: unknown rows {unknown} (rows: {', '.join(ROWS)})")
    keys = [k for k in ROWS if k in keys]
    from runtime.config import load_config
    from shared.models import load_tokenizer, resolve_model

    cfg = load_config("cpu.yaml")
    tokenizer = load_tokenizer(resolve_model(cfg["verifier"]["model"]))
    messages, prompt_ids = {}, {}
    for name, path in PROMPT_SETS.items():
        messages[name] = [p["messages"] for p in json.loads(path.read_text())[: args.prompts]]
        prompt_ids[name] = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                               return_dict=True)["input_ids"]) for m in messages[name]]
    ctx = {"messages": messages, "prompt_ids": prompt_ids, "max_new_tokens": args.max_new_tokens,
           "hf_threads": args.hf_threads, "dtype": cfg["verifier"]["dtype"], "ensemble_weight": args.ensemble_weight}
    meta = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine_info(),
            "target": cfg["verifier"]["model"], "dtype": cfg["verifier"]["dtype"], "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens, "hf_threads": args.hf_threads,
            "ensemble_weight": args.ensemble_weight, "rows": keys}
    args.out.mkdir(parents=True, exist_ok=True)
    raw: dict[str, dict[str, Any]] = {}

    def save() -> dict[str, Any]:
        report = {"meta": meta, "rows": [summarize(k, raw) for k in keys if k in raw], "raw": raw,
                  "hf_settings": {k: {"generator": v.get("generator"), "settings": v.get("settings")}
                                  for k, v in raw.items() if ROWS[k][2].startswith("hf:") and v.get("generator")}}
        (args.out / "types.json").write_text(json.dumps(report, indent=1))
        write_markdown(args.out / "types.md", report)
        return report

    hf_keys = [k for k in keys if ROWS[k][2].startswith("hf:")]
    if hf_keys:
        with tempfile.TemporaryDirectory(prefix="pipespec-bench-types-") as tmp:
            try:
                raw.update(run_hf_rows(hf_keys, ctx, Path(tmp)))
            except RuntimeError as exc:
                raw.update({k: {"error": str(exc)} for k in hf_keys})
        save()
    for key in (k for k in keys if ROWS[k][2] == "pipespec"):
        t0 = time.perf_counter()
        log(f"{ROWS[key][0]}: starting the nodes of {ROWS[key][4]}")
        try:
            raw[key] = asyncio.run(run_pipespec_row(key, ctx))
        except Exception as exc:  # keep the other rows
            raw[key] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{ROWS[key][0]} failed: {raw[key]['error']}")
        log(f"{ROWS[key][0]}: done in {time.perf_counter() - t0:.1f} s")
        save()
    save()
    print((args.out / "types.md").read_text())
    return 1 if any("error" in v for v in raw.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
