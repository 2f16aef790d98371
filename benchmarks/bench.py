"""Benchmark pipespec against the strongest transformers setups on this machine, interleaved prompt by prompt.

Every row decodes the same chat prompts (templated with the target tokenizer, ``add_generation_prompt=True``),
greedily, for ``--max-new-tokens`` tokens, after one warm-up generation of its own. Rows (keys for ``--rows``):

- ``hf-target-{fp32,bf16}-{1t,Nt}``: transformers ``generate(do_sample=False)`` on the target alone, float32 or
  bfloat16, at 1 thread or at all N usable threads (the affinity count); on a GPU machine one ``-gpu`` setup each
- ``hf-assisted-{fp32,bf16}-{1t,Nt}``: transformers assisted generation (``assistant_model=`` the drafter)
- ``pipespec-shipped``: ``cluster("cpu.yaml")`` as shipped
- ``pipespec-NAME``: a named variant of it (``--pipespec-variants``: sync, overlap or a ``draft_schedule`` value) or
  a ``--pipespec-set`` list of config overrides

transformers rows run in one persistent worker subprocess per (dtype, threads), holding its models across prompts;
each pipespec row is one cluster kept open across prompts. For each prompt every row runs once before the next
prompt starts, in an order rotated per prompt, so a host whose speed changes affects all rows alike. When the
setups do not all fit in memory (``--memory-gib``), they are grouped into passes that do, interleaved within a pass;
the reference row then runs in every pass and each row's speedup is taken against the reference of its own pass.

- speedup: tokens/s ÷ the reference (``--reference``, default the target alone in the config's dtype at all threads)
- vs best hf: speedup ÷ the best transformers row's speedup
- mismatches: prompts whose token ids differ from the target alone in the same dtype (1 thread where it ran)
- speed model (docs/architecture.md): with α the acceptance, k the mean drafted block, c = drafter ÷ target cost of a
  1-token cached forward (from the cost curves at the config's dtype and verifier threads),
  E = (1 − α^(k+1)) / (1 − α); ideal overlapped speedup E / max(1, k·c), synchronous bound E / (1 + k·c);
  efficiency = speedup over the target alone at the config's dtype and threads ÷ ideal

The transformers workers also measure cost curves: forward ms over 1..K new tokens on a cached prefix for the
target and 1..R for the drafter, per dtype and thread count.

Outputs in ``--out``: ``bench.md`` (header, tables), ``bench.png`` (speedup bars), ``costs.png`` (cost curves),
``bench.json`` (raw numbers, rewritten after every prompt so a late failure keeps what was measured).

Usage::

    .venv/bin/python scripts/bench.py                                       # all rows, 10 prompts × 128 tokens
    .venv/bin/python scripts/bench.py --prompts 1 --max-new-tokens 8 --out /tmp/b  # a quick smoke
    .venv/bin/python scripts/bench.py --rows hf-target-bf16,pipespec        # a subset (keys or prefixes)
    .venv/bin/python scripts/bench.py --dry-run                             # the passes, without running
    .venv/bin/python scripts/bench.py --pipespec-variants sync,constant --pipespec-set k8:drafter.max_draft_tokens=8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_info, memory_budget_gib, thread_variants
from benchmarks.models import DTYPE_TAGS, cluster_models, model_gib
from benchmarks.passes import ClusterSetup, HFSetup, Row, plan_passes, plan_text, select_rows
from benchmarks.plots import write_curve_plot
from benchmarks.progress import log, utc_now
from benchmarks.prompts import chat_prompts, prompt_dir
from benchmarks.results import read_result, write_result
from benchmarks.runner import run_report
from benchmarks.summary import start_row, token_mismatches, tps, vs_anchor
from benchmarks.tables import curve_table_lines, fmt, header_lines, md_table
from runtime.paths import results_dir
from shared.spec_rates import SpecCounts

DEFAULT_PROMPTS = prompt_dir() / "code_prompts.json"
CONFIG = "cpu.yaml"
HF_DTYPES = ("float32", "bfloat16")


def named_variants() -> dict[str, dict[str, Any]]:
    """The ``--pipespec-variants`` names and their config overrides."""
    from drafter_node.schedule import SCHEDULES

    return {"sync": {"drafter.overlap": False}, "overlap": {"drafter.overlap": True},
            **{s: {"drafter.draft_schedule": s} for s in SCHEDULES}}


# ---------------------------------------------------------------------------------------------- rows


def define_rows(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every row this run can have: key → its definition (kept in bench.json, so ``--replot`` needs no flags)."""
    defs: dict[str, dict[str, Any]] = {}
    for kind, what in (("target", "target alone"), ("assisted", "assisted")):
        for dtype in HF_DTYPES:
            for tag, threads, device in thread_variants():
                setup = f"hf-{DTYPE_TAGS[dtype]}-{tag}"
                threads_label = "GPU" if device == "cuda" else str(threads)
                defs[f"hf-{kind}-{DTYPE_TAGS[dtype]}-{tag}"] = {
                    "label": f"hf {what} {DTYPE_TAGS[dtype]}, " + (
                        "GPU" if device == "cuda" else f"{threads} thread" + "s" * (threads > 1)),
                    "kind": kind, "dtype": dtype, "threads": threads, "threads_label": threads_label,
                    "device": device, "setup": setup}
    for name, overrides in {"shipped": {}, **variants}.items():
        shown = ", ".join(f"{k}={v}" for k, v in overrides.items())
        defs[f"pipespec-{name}"] = {"label": f"pipespec {name}" + (f" ({shown})" if shown else f" ({CONFIG})"),
                                    "kind": "pipespec", "overrides": overrides}
    return defs


def parse_variants(names: str, sets: list[str]) -> dict[str, dict[str, Any]]:
    """``--pipespec-variants`` names and ``--pipespec-set [NAME:]KEY=VALUE,...`` lists → name → overrides."""
    from runtime.config import parse_overrides

    known = named_variants()
    variants: dict[str, dict[str, Any]] = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in known:
            raise SystemExit(f"bench: unknown pipespec variant {name!r} (known: {', '.join(known)})")
        variants[name] = known[name]
    for i, item in enumerate(sets, 1):
        name, sep, rest = item.partition(":")
        if not sep or "=" in name:
            name, rest = f"set{i}", item
        variants[name] = parse_overrides([kv for kv in rest.split(",") if kv.strip()])
    return variants


# ---------------------------------------------------------------------------------------------- summaries


def speed_model(alpha: float, k: float, c: float) -> dict[str, float]:
    """Leviathan et al.: expected tokens per verify E, ideal overlapped and synchronous speedups."""
    e = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return {"E": e, "ideal_overlap": e / max(1.0, k * c), "sync_bound": e / (1 + k * c)}


def _weighted(per_prompt: list[dict], name: str, weight: str) -> float | None:
    """A per-request metric averaged with weights (e.g. busy fractions by elapsed time, ms/round by rounds)."""
    total = sum(p["metrics"][weight] for p in per_prompt)
    if not total:
        return None
    return sum(p["metrics"][name] * p["metrics"][weight] for p in per_prompt) / total


def c_value(report: dict[str, Any]) -> float | None:
    """Drafter ÷ target cost of a 1-token cached forward at the pipespec config's dtype and verifier threads."""
    entry = report.get("curves", {}).get(report["meta"].get("c_setup") or "")
    if not entry or not {"target", "drafter"} <= set(entry["curves"]):
        return None
    first = {name: dict(zip(c["sizes"], c["seconds"])).get(1) for name, c in entry["curves"].items()}
    return first["drafter"] / first["target"] if first["drafter"] and first["target"] else None


def forward_ratios(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Each node's forwards against its start-up profile (the bare forward), over the prompts: the verifier's
    ``forward_vs_profile`` alone / shared, weighted by forwards, and the drafter's, weighted by blocks."""
    out: dict[str, float] = {}
    for kind in ("alone", "shared"):
        parts = [(m["forward_vs_profile"][kind]["forwards"], m["forward_vs_profile"][kind]["ratio"])
                 for m in metrics if kind in (m.get("forward_vs_profile") or {})]
        if sum(n for n, _ in parts):
            out[f"verifier_vs_profile_{kind}"] = sum(n * r for n, r in parts) / sum(n for n, _ in parts)
            out[f"verifier_forwards_{kind}"] = sum(n for n, _ in parts)
    drafter = [(m.get("drafts", 0), m["drafter_timing"]["forward_vs_profile"]) for m in metrics
               if "forward_vs_profile" in (m.get("drafter_timing") or {})]
    if sum(n for n, _ in drafter):
        out["drafter_vs_profile"] = sum(n * r for n, r in drafter) / sum(n for n, _ in drafter)
    return out


def summarize(key: str, report: dict[str, Any], c: float | None) -> dict[str, Any]:
    """Totals, ratios, speed-model bounds and the token-identity check of one row."""
    meta = report["meta"]
    d = meta["row_defs"][key]
    row: dict[str, Any] = {"key": key, "label": d["label"], "kind": d["kind"], "threads": d["threads_label"]}
    pp = start_row(row, report["raw"].get(key))
    if not pp:
        return row
    time_s = row["time_s"]
    spec: dict[str, Any] | None = None
    if d["kind"] == "target":
        row["verifier_busy"] = 1.0
    elif d["kind"] == "assisted":
        spec = {name: sum(p["stats"][name] for p in pp) for name in ("drafts", "draft_tokens", "accepted_tokens",
                                                                       "rounds")}
        draft_s = sum(p["stats"]["draft_s"] for p in pp)
        # in-process: the assistant's share is measured, the rest of the time is the target's (and Python's)
        row |= {"drafter_busy": draft_s / time_s, "verifier_busy": 1 - draft_s / time_s, "message_ms_per_round": 0.0}
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
            "solo_rounds": sum(m.get("solo_rounds", 0) for m in ms),
            "plans": {name: sum((m.get("plans") or {}).get(name, 0) for m in ms)
                      for name in sorted({n for m in ms for n in (m.get("plans") or {})})},
            "dtypes": "/".join(sorted({f"{m.get('verifier_dtype')}+{m.get('drafter_dtype')}" for m in ms})),
            **forward_ratios(ms),
        }
    if spec:
        row |= spec
        if spec["draft_tokens"]:
            counts = SpecCounts.of(spec)
            row |= {"alpha": counts.alpha, "tau": counts.tau, "k": counts.mean_k}
    speedup = vs_anchor(report, key, meta.get("reference"))
    if speedup is not None:
        row["speedup"] = speedup
    dtype = d.get("dtype") or ""
    if dtype == "auto" and pp:  # compare with the target alone in the dtype the verifier chose
        dtype = pp[0].get("metrics", {}).get("verifier_dtype") or ""
    token_ref = meta["token_refs"].get(dtype)
    ref = report["raw"].get(token_ref or "")
    if key == token_ref:
        row["mismatches"] = "ref"
    elif ref and ref["per_prompt"]:
        detail = token_mismatches(pp, ref["per_prompt"])
        row |= {"mismatches": f"{len(detail)}/{min(len(pp), len(ref['per_prompt']))}", "mismatch_detail": detail,
                "token_ref": token_ref}
    if d["kind"] == "pipespec" and c is not None and "alpha" in row:
        model = speed_model(row["alpha"], row["k"], c)
        row |= {"E": model["E"], "ideal": model["ideal_overlap"]}
        base = meta.get("c_target_row")  # the target alone at the config's dtype and threads, like c
        base_ratio = vs_anchor(report, base, meta.get("reference")) if base in report["raw"] else None
        if speedup is not None and base_ratio:
            row["efficiency"] = speedup / base_ratio / row["ideal"]
        if not d["overlap"]:
            row["sync_bound"] = model["sync_bound"]
    return row


def summarize_all(report: dict[str, Any]) -> list[dict[str, Any]]:
    c = c_value(report)
    rows = [summarize(k, report, c) for k in report["meta"]["rows"] if k in report["raw"]]
    hf = [r["speedup"] for r in rows if r["kind"] != "pipespec" and "speedup" in r]
    for r in rows:
        if hf and "speedup" in r:
            r["vs_best_hf"] = r["speedup"] / max(hf)
    return rows


# ---------------------------------------------------------------------------------------------- reports


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta, rows = report["meta"], report["rows"]
    c = c_value(report)
    ref = meta.get("reference")
    lines = ["# pipespec benchmark", "", *header_lines(meta),
             f"- pipespec: config `{CONFIG}` (num_draft_tokens {meta['num_draft_tokens']}, draft_schedule "
             f"{meta['draft_schedule']}, overlap {meta['overlap']}), variants as named",
             f"- prompts: {meta['prompts']} from `{meta['prompts_file']}` (chat template of the target, greedy), "
             f"{min(meta['prompt_tokens'])}–{max(meta['prompt_tokens'])} prompt tokens; max_new_tokens "
             f"{meta['max_new_tokens']}",
             f"- transformers assisted settings: {meta.get('assisted_settings') or '—'}",
             f"- speedup = tokens/s ÷ `{ref}` in the same pass; vs best hf = speedup ÷ the best transformers row's; "
             "mismatches = prompts whose token ids differ from the target alone in the same dtype" if ref else
             "- no target-alone row ran: no speedups",
             "- ideal = E/max(1, k·c) with E = (1 − α^(k+1))/(1 − α), k = mean drafted block, "
             + (f"c = {c:.3f} (1-token forward, drafter ÷ target, `{meta['c_setup']}` cost curves)" if c else
                "c not measured") + f"; efficiency = speedup over `{meta.get('c_target_row')}` ÷ ideal; "
             "sync bound = E/(1 + k·c)", ""]
    table, errors = [], []
    for r in rows:
        if "tokens_per_s" not in r:
            table.append([r["label"], r["threads"], str(r["pass"] or "—"), "error (see notes)", *[""] * 14])
            errors.append(r)
            continue
        if "error" in r:
            errors.append(r)
        table.append([
            r["label"] + (" (partial)" if "error" in r else ""), r["threads"], str(r["pass"]), str(r["new_tokens"]),
            f"{r['time_s']:.1f}", f"{r['tokens_per_s']:.2f}", fmt(r.get("speedup"), ".2f", "×"),
            fmt(r.get("vs_best_hf"), ".2f", "×"), str(r.get("mismatches", "—")), fmt(r.get("alpha")),
            fmt(r.get("tau")), fmt(r.get("k")), fmt(r.get("verifier_busy")), fmt(r.get("drafter_busy")),
            fmt(r.get("message_ms_per_round")), fmt(r.get("ideal"), ".2f", "×"), fmt(r.get("efficiency"), ".0%"),
            fmt(r.get("sync_bound"), ".2f", "×")])
    lines += md_table(["row", "threads", "pass", "new tokens", "time s", "tok/s", "speedup", "vs best hf",
                       "mismatches", "α", "τ", "k", "verifier busy", "drafter busy", "msg ms/round", "ideal",
                       "efficiency", "sync bound"], table, "lll" + "r" * 15)
    pipe = [r for r in rows if r["kind"] == "pipespec" and "rounds" in r]
    if pipe:
        lines += ["", "Pipeline details (sums over the prompts; per-round and per-draft values are weighted means):",
                  "", *md_table(["row", "dtypes (verifier+drafter)", "rounds", "rounds alone (k = 0)", "plans",
                                 "fallback rounds", "stale drafts", "pre-draft hits", "rolled-back draft tokens",
                                 "draft transit ms", "bytes/round", "mean TTFT s"],
                                [[r["label"], r.get("dtypes") or "—", str(r["rounds"]), str(r.get("solo_rounds", "—")),
                                  ", ".join(f"{k} {v}" for k, v in (r.get("plans") or {}).items()) or "—",
                                  str(r["fallback_rounds"]), str(r["stale_drafts"]),
                                  str(r["predraft_hits"]), str(r["rolled_back_draft_tokens"]),
                                  fmt(r.get("draft_transit_ms")), fmt(r.get("bytes_per_round"), ".0f"),
                                  fmt(r.get("mean_ttft_s"))] for r in pipe], "ll" + "r" * 10)]
    if any("verifier_vs_profile_alone" in r or "verifier_vs_profile_shared" in r for r in pipe):
        lines += ["", "Each node's forward against the bare forward (its start-up profile: the model over a "
                  "transformers `DynamicCache` at the same tokens, threads and context, timed on a quiet machine); "
                  "verifier *alone*: no drafter computing meanwhile, *shared*: a drafter computing at the same time:",
                  "", *md_table(["row", "verifier alone", "forwards", "verifier shared", "forwards", "drafter"],
                                [[r["label"], fmt(r.get("verifier_vs_profile_alone"), ".2f", "×"),
                                  str(r.get("verifier_forwards_alone", "—")),
                                  fmt(r.get("verifier_vs_profile_shared"), ".2f", "×"),
                                  str(r.get("verifier_forwards_shared", "—")),
                                  fmt(r.get("drafter_vs_profile"), ".2f", "×")] for r in pipe], "l" + "r" * 5)]
    curve_lines = curve_table_lines(report.get("curves", {}))
    if curve_lines:
        lines += ["", *curve_lines]
    notes = ["", "Notes:",
             "- hf assisted busy fractions: time inside the assistant's `get_candidates` ÷ wall time; the verifier "
             "share is the rest (in-process, no messages)."]
    repeats = report.get("anchor_runs", {}).get(ref or "", {})
    if ref and repeats and ref in report["raw"]:
        own = report["raw"][ref]
        speeds = {own["pass"]: own["per_prompt"], **{int(p): r["per_prompt"] for p, r in repeats.items()}}
        notes.append(f"- `{ref}` per pass (a host that changed speed between passes shows here): " + ", ".join(
            f"pass {p} {fmt(tps(pp))} tok/s" for p, pp in sorted(speeds.items()) if pp))
    for r in rows:
        if r.get("mismatch_detail"):
            detail = ", ".join(f"prompt {m['prompt'] + 1} from token {m['first_diff']}" for m in r["mismatch_detail"])
            notes.append(f"- {r['label']}: output differs from `{r['token_ref']}` on {detail}.")
    for r in errors:
        notes += [f"- {r['label']} failed:", "", "```", r["error"], "```"]
    path.write_text("\n".join(lines + notes) + "\n")


def write_plot(path: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in report["rows"] if "speedup" in r]
    if not shown:
        log("no speedups to plot (no target-alone row ran)")
        path.unlink(missing_ok=True)  # never leave an earlier run's plot next to this run's table
        return
    defs = report["meta"]["row_defs"]
    colors = {("target", "float32"): "#cfcfcf", ("target", "bfloat16"): "#9e9e9e",
              ("assisted", "float32"): "#f9c99b", ("assisted", "bfloat16"): "#f4a261"}
    fig, ax = plt.subplots(figsize=(max(9.0, 0.75 * len(shown)), 4.8))
    xs = range(len(shown))
    bars = ax.bar(xs, [r["speedup"] for r in shown],
                  color=[colors.get((r["kind"], defs[r["key"]].get("dtype")), "#264653") for r in shown])
    for bar, r in zip(bars, shown):
        ax.annotate(f"{r['speedup']:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    top = max(r["speedup"] for r in shown)
    base = next((r.get("speedup") for r in report["rows"] if r["key"] == report["meta"].get("c_target_row")), None)
    for name, style, text in (("ideal", {"color": "crimson"}, "ideal overlapped bound E/max(1, k·c)"),
                              ("sync_bound", {"color": "dimgray"}, "synchronous bound E/(1 + k·c)")):
        marks = [(i, r[name] * base) for i, r in enumerate(shown) if name in r and base]  # bounds are over c's base
        if marks:
            ax.scatter([i for i, _ in marks], [v for _, v in marks], marker="_", s=700, zorder=3, label=text, **style)
            top = max(top, *(v for _, v in marks))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylim(0, top * 1.3)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), [r["label"] for r in shown], rotation=25, ha="right", fontsize=7)
    ax.set_ylabel(f"tokens/s ÷ {report['meta']['reference']}")
    ax.set_title("Greedy decoding speed relative to the target alone (interleaved prompt by prompt)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(out: Path, report: dict[str, Any], final: bool) -> None:
    """bench.json and bench.md (after every prompt); the plots too when ``final``."""
    report["rows"] = summarize_all(report)
    write_result(out / "bench.json", report)
    write_markdown(out / "bench.md", report)
    if final:
        write_plot(out / "bench.png", report)
        write_curve_plot(out / "costs.png", report.get("curves", {}))
        log(f"wrote {out / 'bench.md'}, {out / 'bench.png'}, {out / 'costs.png'}, {out / 'bench.json'}")


# ---------------------------------------------------------------------------------------------- main


def _parser(prog: str | None = None) -> argparse.ArgumentParser:
    variants = ", ".join(named_variants())
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="rows on this machine: " + ", ".join(define_rows({})) + f", pipespec-NAME (variants: {variants})")
    p.add_argument("--out", type=Path, default=results_dir(), help="output folder (default: results/)")
    p.add_argument("--rows", default="hf,pipespec",
                   help="comma list of row keys or key prefixes, e.g. hf-target-bf16,pipespec (default: all rows)")
    p.add_argument("--reference", default=None,
                   help="the row speedups are taken against (default: hf-target-<config dtype>-<all threads>, else "
                        "a selected target-alone row, the config's dtype first); it runs in every pass")
    p.add_argument("--pipespec-variants", default="sync",
                   help=f"comma list of named pipespec variants to add as rows pipespec-NAME ({variants}; "
                        "default: sync; '' for none)")
    p.add_argument("--pipespec-set", action="append", default=[], metavar="[NAME:]KEY=VALUE,...",
                   help="add a row pipespec-NAME (default NAME setN) running cpu.yaml with these config overrides, "
                        "e.g. k8:drafter.max_draft_tokens=8,drafter.draft_schedule=constant; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default: 128)")
    p.add_argument("--prompts", type=int, default=10,
                   help="number of prompts, from the start of the prompts file (default: 10)")
    p.add_argument("--prompts-file", type=Path, default=DEFAULT_PROMPTS,
                   help="JSON list of {id, messages} (default: scripts/prompts/code_prompts.json)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory the setups of one pass may use together (default: 90%% of MemAvailable at start)")
    p.add_argument("--curve-target-tokens", type=int, default=16, metavar="K",
                   help="target cost curve over 1..K new tokens (default: 16)")
    p.add_argument("--curve-drafter-tokens", type=int, default=8, metavar="R",
                   help="drafter cost curve over 1..R new tokens (default: 8)")
    p.add_argument("--curve-budget-s", type=float, default=20.0,
                   help="time budget of one cost curve; sizes past it are left out (default: 20)")
    p.add_argument("--no-curves", action="store_true", help="skip the cost curves (and so c and the speed model)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the rows, the passes and their estimated memory, and exit without running (named models "
                        "that are missing are installed first, as a run would)")
    p.add_argument("--replot", action="store_true",
                   help="only rebuild bench.md, bench.png and costs.png from the bench.json already in --out")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--ray", "--sweep") or a.startswith(("--ray=", "--sweep=")) for a in argv):
        from benchmarks import sweep  # a sweep file (benchmarks/sweep.py) instead of this benchmark's rows

        return sweep.main(argv, prog=prog)
    args = _parser(prog).parse_args(argv)
    if args.replot:
        report = read_result(args.out / "bench.json")  # older, pretty-printed files read the same
        write_reports(args.out, report, final=True)
        return 0
    from runtime.config import load_config
    from shared.models import load_tokenizer
    from weights import resolve_model

    defs = define_rows(parse_variants(args.pipespec_variants, args.pipespec_set))
    keys = select_rows(args.rows, list(defs), "bench")
    cfg = load_config(CONFIG)
    for key in keys:  # a bad override fails here, before any model loads
        if defs[key]["kind"] == "pipespec":
            v = load_config(CONFIG, defs[key]["overrides"])
            defs[key] |= {"dtype": v["verifier"]["dtype"], "overlap": v["drafter"]["overlap"],
                          "threads_label": f"{v['verifier']['threads']}+{v['drafter']['threads']}",
                          "config": v}
    prompts_all = json.loads(args.prompts_file.read_text())[: args.prompts]
    if len(prompts_all) < args.prompts:
        log(f"WARNING: only {len(prompts_all)} prompts in {args.prompts_file}")
    target_path = resolve_model(cfg["verifier"]["model"])
    draft_path = resolve_model(cfg["drafter"]["model"])
    prompts = chat_prompts(load_tokenizer(target_path), [p["messages"] for p in prompts_all])

    # setups: one worker per (dtype, threads) with rows, one cluster per pipespec row
    setups: dict[str, HFSetup | ClusterSetup] = {}
    rows: dict[str, Row] = {}
    all_threads = thread_variants()[-1]
    # c compares the drafter and target where pipespec runs them: the config's dtype and verifier threads
    # dtype/threads auto: pipespec chooses at start-up (its rows report what); transformers rows are named setups,
    # and the reference is bf16 at every core (the fastest transformers setup on CPUs measured so far)
    vdtype = cfg["verifier"]["dtype"] if cfg["verifier"]["dtype"] != "auto" else "bfloat16"
    vthreads = cfg["verifier"]["threads"] if cfg["verifier"]["threads"] != "auto" else all_threads[1]
    c_setup = f"hf-{DTYPE_TAGS[vdtype]}-{vthreads}t"
    if all_threads[2] != cfg["verifier"]["device"]:
        c_setup = ""  # e.g. transformers on a GPU, pipespec's config on the CPU: no such setup here

    def hf_setup(key: str, dtype: str, threads: int, device: str) -> HFSetup:
        if key not in setups:
            curves = [] if args.no_curves else [
                ("target", "target", list(range(1, args.curve_target_tokens + 1))),
                ("drafter", draft_path, list(range(1, args.curve_drafter_tokens + 1)))]
            setups[key] = HFSetup(key, dtype, threads, device, target_path, model_gib(target_path, dtype), curves,
                                  {"drafter": model_gib(draft_path, dtype)})
        return setups[key]

    for key in keys:
        d = defs[key]
        if d["kind"] == "pipespec":
            v = d.pop("config")
            setups[key] = ClusterSetup(key, CONFIG, d["overrides"], cluster_models(v),
                                       processes=2 if v["launch"]["start_drafter"] else 1)
            rows[key] = Row(key, d["label"], key)
        else:
            s = hf_setup(d["setup"], d["dtype"], d["threads"], d["device"])
            strategy = {"kind": "target"} if d["kind"] == "target" else {"kind": "assistant", "model": draft_path}
            rows[key] = Row(key, d["label"], s.key, strategy=strategy,
                            models={} if d["kind"] == "target" else {"drafter": s.curve_models["drafter"]})
    needs_c = any(defs[k]["kind"] == "pipespec" for k in keys) and not args.no_curves
    if needs_c and c_setup and c_setup not in setups:
        tag = c_setup.rsplit("-", 1)[1]
        variant = next((v for v in thread_variants() if v[0] == tag), None)
        if variant:  # only the cost curves of the pipespec setting are needed (for c), no rows
            hf_setup(c_setup, vdtype, variant[1], variant[2])
            rows[f"curves-{c_setup}"] = Row(f"curves-{c_setup}", f"cost curves {c_setup}", c_setup, curves_only=True)
        else:
            log(f"WARNING: no transformers setup at {cfg['verifier']['threads']} thread(s) here: c is not measured")

    dtag = DTYPE_TAGS[vdtype]
    targets = [k for k in keys if defs[k]["kind"] == "target"]
    reference = args.reference or f"hf-target-{dtag}-{all_threads[0]}"
    if reference not in targets:
        if args.reference:
            raise SystemExit(f"bench: --reference {args.reference} is not a selected target-alone row")
        reference = next(iter(sorted(targets, key=lambda k: not k.startswith(f"hf-target-{dtag}"))), None)
    for row in rows.values():
        if row.key != reference and not row.curves_only:
            row.anchor = reference
    token_refs = {}
    for dtype in HF_DTYPES:
        found = [k for k in targets if defs[k]["dtype"] == dtype]
        if found:
            token_refs[dtype] = found[0]  # the 1-thread one where it ran (definition order)

    # units: the rows of one setup share a pass. The reference's setup comes first, so it is measured in pass 1,
    # then the pipespec rows, so they share a pass with it (and its assisted row) where memory allows
    units: dict[str, list[str]] = {}
    order = sorted(rows, key=lambda k: (k != reference, defs.get(k, {}).get("kind") != "pipespec"))
    for key in order:
        units.setdefault(rows[key].setup, [])
        if key not in units[rows[key].setup]:
            units[rows[key].setup].append(key)
    budget = memory_budget_gib(args.memory_gib)
    passes = plan_passes(list(units.values()), rows, setups, budget)

    meta: dict[str, Any] = {
        "start": utc_now(), "end": None, "machine": machine_info(), "memory_budget_gib": budget,
        "models": f"target `{cfg['verifier']['model']}`, drafter `{cfg['drafter']['model']}`",
        "dtypes": "transformers rows as named (fp32 = float32, bf16 = bfloat16); pipespec rows their config's "
                  f"({cfg['verifier']['dtype']} in {CONFIG})",
        "threads": "transformers rows as named, one worker process each (OMP/MKL threads and torch.set_num_threads"
                   "); pipespec rows verifier+drafter threads of their config, one process each",
        "num_draft_tokens": cfg["drafter"]["num_draft_tokens"], "draft_schedule": cfg["drafter"]["draft_schedule"],
        "overlap": cfg["drafter"]["overlap"], "prompts": len(prompts), "prompt_ids": [p.get("id") for p in prompts_all],
        "prompts_file": str(args.prompts_file), "prompt_tokens": [len(p["ids"]) for p in prompts],
        "max_new_tokens": args.max_new_tokens, "rows": keys, "row_defs": {k: defs[k] for k in keys},
        "reference": reference, "token_refs": token_refs, "c_setup": c_setup,
        "c_target_row": f"hf-target-{dtag}-{c_setup.rsplit('-', 1)[1]}" if c_setup else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"rows: {', '.join(keys)}; reference {reference}; {len(prompts)} prompts "
        f"({min(meta['prompt_tokens'])}–{max(meta['prompt_tokens'])} tokens), max_new_tokens {args.max_new_tokens}; "
        f"{len(passes)} pass(es) within {budget:.1f} GiB")

    if args.dry_run:
        print(plan_text(passes, rows, setups, budget))
        return 0

    def write(report: dict[str, Any], final: bool) -> None:
        meta["assisted_settings"] = next((r["hf"]["settings"] for k, r in report["raw"].items()
                                          if defs.get(k, {}).get("kind") == "assisted" and "hf" in r), None)
        write_reports(args.out, report, final)

    return run_report(rows, setups, {"default": prompts}, args.max_new_tokens, passes, meta, write,
                      args.out / "bench.md", curve_budget_s=args.curve_budget_s)


if __name__ == "__main__":
    sys.exit(main())
