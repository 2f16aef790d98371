"""Benchmark the ``suffix`` drafter on a repetitive, agent-like workload against ``prompt_lookup`` and the target
alone, on one machine in one run, and show the cross-request effect (acceptance on request N against request 1).

The workload (``scripts/prompts/agent_prompts.json``) is a sequence of requests as an agent sends them: tool calls
that answer with the same JSON pattern and different arguments, then code edits that wrap different functions in
the same retry pattern (a pattern the prompts describe but do not contain). Every row runs the requests in that
order, and each pipespec row is one cluster kept open across them, so one drafter process serves them all: the
suffix drafter's cache of earlier responses grows from request to request (the warm-up generation uses an
unrelated prompt, so request 1 is new to it).

Rows (greedy, the target's chat template):

==================  ===============================================================================================
``target``          transformers ``generate`` on the target alone (the reference: tokens/s ratios, token identity)
``prompt-lookup``   pipespec ``configs/prompt_lookup.yaml``
``suffix``          pipespec ``configs/suffix.yaml``
``suffix-nocache``  the same with ``drafter.suffix_max_cached_requests: 0``: the request's own tokens only, what
                    the cross-request cache adds is the difference to ``suffix``
==================  ===============================================================================================

Reported per row: acceptance α (accepted ÷ drafted tokens), τ (1 + accepted ÷ blocks drafted: tokens per drafting
round), k (tokens per block), tokens/s and its ratio to the target alone in the same pass, and prompts whose tokens
differ from the target's; per request index, α and τ of each pipespec row, and for ``suffix`` the first request of
each family against the rest (the cross-request effect). Output: ``--out`` (default ``results/``) ``suffix.json``
and ``suffix.md``, rewritten after every request.

Usage::

    .venv/bin/python scripts/bench_suffix.py                       # the 16 requests × 160 tokens on the real models
    .venv/bin/python scripts/bench_suffix.py --requests 4          # the first 2 of each family
    .venv/bin/python scripts/bench_suffix.py --tiny --out /tmp/s   # tiny random models built on the spot: a smoke run
    .venv/bin/python scripts/bench_suffix.py --dry-run             # the passes, without running
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.machine import available_threads, machine_info, memory_budget_gib
from benchmarks.models import DTYPE_TAGS, cluster_models, model_gib
from benchmarks.passes import ClusterSetup, HFSetup, Row, pass_parser, plan_passes, plan_text, select_rows
from benchmarks.progress import log, utc_now
from benchmarks.prompts import chat_prompts, prompt_dir
from benchmarks.results import write_result
from benchmarks.runner import run_report
from benchmarks.summary import start_row, token_mismatches, vs_anchor
from benchmarks.tables import fmt, header_lines, md_table
from shared.spec_rates import SpecCounts

PROMPT_FILE = "agent_prompts.json"
#: The warm-up request: nothing like the workload, so the suffix cache starts with nothing useful.
WARMUP = [{"role": "user", "content": "Name three colours."}]
REFERENCE = "target"
TINY_POSITIONS = 512  # max_position_embeddings of testkit's tiny models
# key → (label, drafter type, config, overrides); the reference runs in transformers.
ROWS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "target": ("hf target alone", "—", "suffix.yaml", {}),
    "prompt-lookup": ("pipespec prompt_lookup", "prompt_lookup", "prompt_lookup.yaml", {}),
    "suffix": ("pipespec suffix", "suffix", "suffix.yaml", {}),
    "suffix-nocache": ("pipespec suffix, no cross-request cache", "suffix", "suffix.yaml",
                       {"drafter.suffix_max_cached_requests": 0}),
}


def load_workload(n: int | None) -> list[dict[str, Any]]:
    """The first ``n`` requests of each family, interleaving nothing: the families in file order (all when None)."""
    items = json.loads((prompt_dir() / PROMPT_FILE).read_text())
    if n is None:
        return items
    families = list(dict.fromkeys(p["family"] for p in items))
    per = max(1, -(-n // len(families)))  # ceil: --requests 4 → 2 of each
    out = [p for f in families for p in [q for q in items if q["family"] == f][:per]]
    return out[:n]


# ---------------------------------------------------------------------------------------------- report


def _alpha_tau(metrics: list[dict[str, Any]]) -> tuple[float | None, float | None, float | None]:
    s = SpecCounts.total(metrics)
    if not s.drafts:
        return (0.0, 1.0, 0.0) if metrics else (None, None, None)
    return s.alpha, s.tau, s.mean_k


def summarize(key: str, report: dict[str, Any]) -> dict[str, Any]:
    label, kind, config, overrides = ROWS[key]
    raw = report["raw"].get(key)
    row: dict[str, Any] = {"key": key, "label": label, "type": kind,
                           "config": config if key != REFERENCE else "—", "overrides": overrides}
    pp = start_row(row, raw)
    if not pp:
        return row
    if key != REFERENCE:
        row["alpha"], row["tau"], row["k"] = _alpha_tau([p["metrics"] for p in pp])
        row["per_request"] = [dict(zip(("alpha", "tau", "k"), _alpha_tau([p["metrics"]]))) for p in pp]
    row["vs_target"] = vs_anchor(report, key, REFERENCE)
    ref = report["raw"].get(REFERENCE)
    if ref and ref["per_prompt"] and key != REFERENCE:
        row["mismatches"] = len(token_mismatches(pp, ref["per_prompt"]))
        row["compared"] = min(len(pp), len(ref["per_prompt"]))
    return row


def cross_request(row: dict[str, Any], families: list[str]) -> dict[str, dict[str, Any]]:
    """Per family: α of its first request and the mean α of its later ones (over the requests the row finished)."""
    out: dict[str, dict[str, Any]] = {}
    per = row.get("per_request") or []
    for family in dict.fromkeys(families):
        alphas = [per[i]["alpha"] for i, f in enumerate(families[: len(per)]) if f == family]
        if alphas and alphas[0] is not None:
            later = [a for a in alphas[1:] if a is not None]
            out[family] = {"first": alphas[0], "later_mean": sum(later) / len(later) if later else None,
                           "last": alphas[-1], "requests": len(alphas)}
    return out


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta = report["meta"]
    lines = ["# pipespec suffix decoding benchmark", "", *header_lines(meta),
             f"- workload: `{PROMPT_FILE}`, {len(meta['requests'])} requests in order through one cluster per row, "
             f"greedy, max_new_tokens {meta['max_new_tokens']}",
             "- α = accepted ÷ drafted tokens; τ = 1 + accepted ÷ blocks drafted (tokens per drafting round); "
             "k = tokens per block; vs target = tokens/s ÷ the target alone (transformers) in the same pass; "
             "mismatches = requests whose tokens differ from the target alone", ""]
    table, notes = [], []
    for r in report["rows"]:
        if "tokens_per_s" not in r:
            table.append([r["label"], r["type"], "error", *[""] * 5])
            notes.append(f"- {r['label']} failed: `{r['error'].splitlines()[0][:300]}`")
            continue
        if "error" in r:
            notes.append(f"- {r['label']} failed after {r['prompts']} request(s): "
                         f"`{r['error'].splitlines()[0][:300]}`")
        mism = f"{r['mismatches']}/{r['compared']}" if "mismatches" in r else "ref"
        table.append([r["label"] + (" (partial)" if "error" in r else ""), r["type"], f"{r['tokens_per_s']:.2f}",
                      fmt(r.get("alpha")), fmt(r.get("tau")), fmt(r.get("k")), fmt(r.get("vs_target"), ".2f", "×"),
                      mism])
    lines += md_table(["row", "type", "tok/s", "α", "τ", "k", "vs target", "mismatches"], table, "ll" + "r" * 6)

    drafting = [r for r in report["rows"] if r.get("per_request")]
    if drafting:
        lines += ["", "Per request (α / τ), in the order they ran:", ""]
        per_rows = []
        for i, req in enumerate(meta["requests"]):
            cells = []
            for r in drafting:
                pr = r["per_request"][i] if i < len(r["per_request"]) else None
                cells.append(f"{fmt(pr['alpha'])} / {fmt(pr['tau'])}" if pr else "—")
            per_rows.append([str(i + 1), req["id"], req["family"], *cells])
        lines += md_table(["#", "request", "family", *[r["label"] for r in drafting]], per_rows,
                          "rll" + "r" * len(drafting))
    families = [req["family"] for req in meta["requests"]]
    for r in report["rows"]:
        if r["key"].startswith("suffix") and r.get("per_request"):
            for family, c in cross_request(r, families).items():
                if c["requests"] < 2:
                    continue
                later = "on request 2" if c["requests"] == 2 else f"on requests 2–{c['requests']} (mean)"
                notes.append(f"- cross-request, {r['label']}, {family}: α on its request 1 {fmt(c['first'])}, "
                             f"{later} {fmt(c['later_mean'])}, on the last {fmt(c['last'])}")
    path.write_text("\n".join(lines + (["", "Notes:", *notes] if notes else [])) + "\n")


# ---------------------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = pass_parser(__doc__, list(ROWS), "dtype of every row (default: the configs' own; the reference bfloat16 where "
                                         "they say auto)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests to run: the first N/2 of each family (default: all 16)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per request (default 160, 24 --tiny)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random models built on the spot (seconds, no download): a smoke run, numbers meaningless")
    return p


def _tiny_configs(root: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    """A tiny random target and the row configs over it (float32, one thread per node, constant schedule)."""
    from testkit.tiny_models import build_model, build_tokenizer

    build_tokenizer(root / "tok")
    target = str(build_model(root / "target", "qwen2", root / "tok", seed=1))
    node = {"dtype": "float32", "threads": 1, "profile_s": 0}
    base = {"verifier": {"model": target, **node}, "client": {"timeout_s": 120}, "launch": {"ready_timeout_s": 300}}
    configs = {
        "prompt_lookup.yaml": {**base, "drafter": {"type": "prompt_lookup", **node, "draft_schedule": "constant"}},
        "suffix.yaml": {**base, "drafter": {"type": "suffix", **node, "draft_schedule": "constant"}},
    }
    return target, configs


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    keys = select_rows(args.rows, list(ROWS), "bench_suffix")
    if REFERENCE not in keys:
        keys.insert(0, REFERENCE)  # every ratio and identity check is against it
    args.max_new_tokens = args.max_new_tokens or (24 if args.tiny else 160)
    with tempfile.TemporaryDirectory(prefix="pipespec-bench-suffix-") as tmp:
        return _run(args, keys, Path(tmp))


def _run(args: argparse.Namespace, keys: list[str], tmp: Path) -> int:
    from runtime.config import load_config
    from shared.models import load_tokenizer
    from weights import resolve_model

    tiny_configs: dict[str, dict[str, Any]] = {}
    if args.tiny:
        target_path, tiny_configs = _tiny_configs(tmp)
        dtype, threads = "float32", 1
    else:
        base = load_config("suffix.yaml")
        dtype = args.dtype or (base["verifier"]["dtype"] if base["verifier"]["dtype"] != "auto" else "bfloat16")
        threads = args.hf_threads or available_threads()
        target_path = resolve_model(base["verifier"]["model"])
    tokenizer = load_tokenizer(target_path)
    workload = load_workload(args.requests)
    prompts = {"agent": chat_prompts(tokenizer, [p["messages"] for p in workload])}
    if args.tiny:  # the tiny target holds 512 positions: a request that does not fit is left out, and said so
        fits = [i for i, p in enumerate(prompts["agent"]) if len(p["ids"]) + args.max_new_tokens <= TINY_POSITIONS]
        for i in sorted(set(range(len(workload))) - set(fits)):
            log(f"--tiny: request {workload[i]['id']} left out (longer than the tiny target's {TINY_POSITIONS} "
                "positions)")
        workload = [workload[i] for i in fits]
        prompts["agent"] = [prompts["agent"][i] for i in fits]
    warmup = {"agent": chat_prompts(tokenizer, [WARMUP])[0]}

    hf = HFSetup(f"hf-{DTYPE_TAGS[dtype]}-{threads}t", dtype, threads, "cpu", target_path,
                 model_gib(target_path, dtype))
    setups: dict[str, HFSetup | ClusterSetup] = {hf.key: hf}
    rows: dict[str, Row] = {REFERENCE: Row(REFERENCE, ROWS[REFERENCE][0], hf.key, "agent",
                                           strategy={"kind": "target"})}
    for key in keys:
        if key == REFERENCE:
            continue
        label, _, config_name, own = ROWS[key]
        config: str | dict[str, Any] = tiny_configs.get(config_name, config_name)
        overrides = dict(own)
        loaded = load_config(config)
        for section in ("verifier", "drafter"):
            if args.dtype and not args.tiny and loaded[section]["dtype"] != dtype:
                overrides[f"{section}.dtype"] = dtype
        loaded = load_config(config, overrides)
        setups[key] = ClusterSetup(key, config, overrides, cluster_models(loaded))
        rows[key] = Row(key, label, key, "agent", anchor=REFERENCE)

    units = [[REFERENCE], *[[k] for k in keys if k != REFERENCE]]
    budget = memory_budget_gib(args.memory_gib)
    passes = plan_passes(units, rows, setups, budget)
    if args.dry_run:
        print(plan_text(passes, rows, setups, budget))
        return 0

    meta: dict[str, Any] = {
        "start": utc_now(), "end": None, "machine": machine_info(), "memory_budget_gib": budget,
        "models": ("tiny random Qwen2-style target built on the spot (smoke run: the numbers mean nothing)"
                   if args.tiny else f"target `{load_config('suffix.yaml')['verifier']['model']}`; no drafter model"),
        "dtypes": f"transformers row {dtype}; pipespec rows " + (
            dtype if args.dtype or args.tiny else "their configs' (auto: chosen at start-up)"),
        "threads": f"transformers row {threads}; pipespec rows their configs' " + (
            "(1 per node)" if args.tiny else "(auto)"),
        "requests": [{"id": p["id"], "family": p["family"]} for p in workload],
        "max_new_tokens": args.max_new_tokens, "tiny": args.tiny, "rows": keys,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"rows: {', '.join(keys)}; {len(workload)} requests; {len(passes)} pass(es) within {budget:.1f} GiB")

    def write(report: dict[str, Any], final: bool) -> None:
        report["rows"] = [summarize(k, report) for k in keys if k in report["raw"]]
        write_result(args.out / "suffix.json", report)
        write_markdown(args.out / "suffix.md", report)

    return run_report(rows, setups, prompts, args.max_new_tokens, passes, meta, write, args.out / "suffix.md",
                      warmup_prompts=warmup)


if __name__ == "__main__":
    sys.exit(main())
