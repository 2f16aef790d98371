"""Benchmark every drafter type against the target alone and against transformers' own implementation of the
same strategy, interleaved prompt by prompt, on the real models of this machine (see docs/getting-started.md, "Models").

Each type runs on the prompts where it makes sense:

- ``edit`` prompts (``scripts/prompts/edit_prompts.json``: code-edit requests that repeat their input) for prompt
  lookup;
- ``code`` prompts (``scripts/prompts/code_prompts.json``) for the model-based types, or with ``--prompt-set`` a
  public set in their place: ``humaneval`` (``humaneval_prompts.json``, the first 20 HumanEval problems, each asked
  as a chat message) or ``chat`` (``mt_bench_prompts.json``, the first question of each of MT-Bench's 8 categories:
  open-ended answers where drafts are rarely accepted). The public sets are vendored subsets that name their
  package, version, license and selection in the file (``scripts/vendor_prompts.py`` remakes them).

When the prompts carry a ``category`` (``chat``), the report also breaks every row down per category: tokens/s,
α, τ and the ratio to the reference row on the same prompts in the same pass.

Every prompt set has its own reference row, transformers ``generate(do_sample=False)`` on the target alone in the
same dtype at all threads (``--hf-threads``); each other row's tokens/s is divided by it and its output compared
with it token by token (mismatches are counted, never hidden). Rows (greedy, chat template of the target, one
warm-up generation per row):

===================  ==========================================================================================
``target-code``      transformers target alone, code prompts (reference)
``hf-assistant``     transformers assisted generation with the 0.5B drafter
``pipespec-default``  ``configs/cpu.yaml`` as shipped: ``drafter.type: auto`` (``gguf`` where llama.cpp runs here,
                     else ``assistant``; the row's json says which)
``pipespec-assistant``  ``configs/cpu.yaml`` with ``drafter.type: assistant`` (the torch drafter)
``pipespec-ensemble``   ``configs/cpu.yaml`` with ``verification.ensemble_weight`` = ``--ensemble-weight`` (lossy by
                     design: its mismatches are expected; the point is the acceptance next to ``pipespec-assistant``)
``pipespec-gguf``    ``configs/gguf.yaml``: the 0.5B's GGUF drafts in llama.cpp for the torch target; compared with
                     ``hf-assistant`` (same strategy) and with ``llama-speculative`` (the same pair in llama.cpp)
``pipespec-gguf-target``  ``configs/gguf_target.yaml``: the target's Q4_K_M GGUF verifies in llama.cpp
                     (``verifier.backend: llama_cpp``) and the 0.5B's GGUF drafts in llama.cpp: the very pair of
                     ``llama-speculative-q4``, compared with it in the same pass (its tokens are llama.cpp's
                     Q4_K_M greedy, so its mismatches with the transformers target are expected)
``llama-target``     llama.cpp's ``llama-server``, the target alone as a bf16 GGUF (made once from its safetensors
                     with llama.cpp's ``convert_hf_to_gguf.py`` when missing)
``llama-speculative``   ``llama-server`` with the bf16 target and the 0.5B's GGUF as draft model (``draft-simple``,
                     ``--llama-draft-max`` / ``--llama-draft-min``, default 3 / 0: the server's own)
``llama-speculative-q4``  the same with the target's Q4_K_M GGUF (what CPU users usually run)
``ov-target``        OpenVINO GenAI's ``LLMPipeline``, the target alone (exported once from its safetensors with
                     ``optimum-cli export openvino --weight-format fp16``)
``ov-speculative``   OpenVINO GenAI speculative decoding: the same pipeline with the 0.5B's export as
                     ``draft_model``, ``num_assistant_tokens`` = ``--ov-draft-tokens`` (default 5)
``hf-early-exit``    transformers ``assistant_early_exit=E`` (E from ``configs/early_exit.yaml``)
``pipespec-early-exit`` ``configs/early_exit.yaml``
``hf-universal``     transformers universal assisted decoding (``assistant_model``, ``tokenizer``,
                     ``assistant_tokenizer``) with the drafter of ``configs/universal.yaml``
``pipespec-universal``  ``configs/universal.yaml``
``target-edit``      transformers target alone, edit prompts (reference)
``hf-prompt-lookup`` transformers ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size`` from
                     ``configs/prompt_lookup.yaml``
``pipespec-prompt-lookup`` ``configs/prompt_lookup.yaml``
===================  ==========================================================================================

The transformers rows share one persistent worker subprocess (``--hf-threads`` threads, ``--dtype``) that holds the
target and loads each assistant once; each pipespec row is one cluster kept open across prompts (the configs' thread
counts, one per node; ``--dtype`` overrides their dtype when it differs). For each prompt every row runs once before
the next prompt starts, in an order rotated per prompt. Each ``llama-*`` row is one ``llama-server`` process
(``--llama-bin DIR``, default ``$PIPESPEC_LLAMA_BIN`` or the folder ``scripts/build_llama_cpp.py --tools`` builds
into; a missing binary fails its row with the reason, not the run) on a loopback port, kept open across prompts,
fed the same prompt ids (greedy, no prompt cache), ``--llama-threads`` threads (default: the transformers rows');
its speed is the wall time around each request, its own ``timings`` and draft counters are kept in the json. When
not all setups fit in memory (``--memory-gib``) the rows are grouped into passes, each type with transformers' same
strategy and its reference, interleaved within the pass; the assistant pair, ``pipespec-gguf`` and the llama.cpp
rows are placed first, so they share pass 1 when memory allows. Each ``ov-*`` row is one OpenVINO GenAI worker
(:mod:`benchmarks.ov_genai`), kept open across prompts, in a virtual environment of its own (``--ov-venv``, default
``~/.cache/pipespec/openvino/venv``, made with pinned versions when missing: optimum-intel needs transformers < 5.6,
pipespec 5.x) running :mod:`benchmarks.ov_worker`, JSON lines over stdin/stdout; a missing or failed environment or
export fails its row with the reason, not the run. It is fed the same prompt ids, greedy (GenAI's sampled
speculative acceptance is not the standard lossless rule, see :mod:`benchmarks.ov_genai`), no prefix cache, the CPU
plugin asked for ``INFERENCE_PRECISION_HINT`` bf16 and ``INFERENCE_NUM_THREADS`` = ``--ov-threads`` (default: the
transformers rows'); what the plugin resolved them to is in the report (f32 on a CPU without native bf16). When an
``ov-*`` row runs, the transformers worker and the first OpenVINO worker also measure their target's forward over 1
and 9 new tokens on a cached 16-token prefix, shown as one table: the forward cost of each engine's target.
``mtp`` and ``mtp_drafter`` need checkpoints this machine does not have (DeepSeek-V3 / GLM-4.5 with MTP layers, a
Gemma 4 target with its -assistant); the table says so instead of inventing a row.

Outputs in ``--out`` (default ``results/``): ``types.md`` and ``types.json`` (rewritten after every prompt).

Usage::

    .venv/bin/python scripts/bench_types.py                                   # all rows, 5 prompts × 96 tokens
    .venv/bin/python scripts/bench_types.py --rows target-edit,hf-prompt-lookup,pipespec-prompt-lookup
    .venv/bin/python scripts/bench_types.py --rows target-code,hf-assistant,pipespec-assistant,pipespec-gguf,llama
    .venv/bin/python scripts/bench_types.py --rows target-code,hf-assistant,ov          # OpenVINO GenAI's rows
    .venv/bin/python scripts/bench_types.py --rows target-code,pipespec-gguf-target,llama-speculative-q4
                                              # the llama.cpp target beside llama.cpp's own speculative decoding
    .venv/bin/python scripts/bench_types.py --prompts 1 --max-new-tokens 8 --out /tmp/t   # a quick smoke
    .venv/bin/python scripts/bench_types.py --rows target-code,pipespec-gguf --prompt-set chat --prompts 8
    .venv/bin/python scripts/bench_types.py --dry-run                         # the passes, without running
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.llama_server import DEFAULT_BIN, default_bin_dir, server_version
from benchmarks.machine import available_threads, machine_info, memory_budget_gib
from benchmarks.models import DTYPE_TAGS, cluster_models, model_gib
from benchmarks.ov_genai import WEIGHT_FORMAT, default_venv, precision_label
from benchmarks.passes import (
    ClusterSetup,
    HFSetup,
    LlamaSetup,
    OVSetup,
    Row,
    Setup,
    pass_parser,
    plan_passes,
    plan_text,
    select_rows,
)
from benchmarks.progress import log, utc_now
from benchmarks.prompts import chat_prompts, load_prompts, prompt_dir
from benchmarks.results import write_result
from benchmarks.runner import run_report
from benchmarks.summary import anchor_run, speed_ratio, start_row, token_mismatches, tps, vs_anchor
from benchmarks.tables import curve_table_lines, fmt, header_lines, md_table
from shared.spec_rates import SpecCounts

PROMPT_SETS = {"code": prompt_dir() / "code_prompts.json",
               "humaneval": prompt_dir() / "humaneval_prompts.json",
               "chat": prompt_dir() / "mt_bench_prompts.json",
               "edit": prompt_dir() / "edit_prompts.json"}
#: The sets ``--prompt-set`` may put in place of ``code`` for the rows of ``code`` (the model-based types).
MODEL_SETS = ("code", "humaneval", "chat")
REFERENCES = {"code": "target-code", "edit": "target-edit"}

# key -> (label, drafter type, runner, prompt set, config); runner "hf:<strategy>" or "pipespec"; prompt set "code"
# stands for the one --prompt-set picks (see prompt_set_of). Table order.
ROWS: dict[str, tuple[str, str, str, str, str]] = {
    "target-code": ("hf target alone", "—", "hf:target", "code", "cpu.yaml"),
    "hf-assistant": ("hf assisted", "assistant", "hf:assistant", "code", "cpu.yaml"),
    "pipespec-default": ("pipespec default (cpu.yaml as shipped)", "auto", "pipespec", "code", "cpu.yaml"),
    "pipespec-assistant": ("pipespec assistant", "assistant", "pipespec", "code", "cpu.yaml"),
    "pipespec-ensemble": ("pipespec assistant + ensemble", "assistant+ensemble", "pipespec", "code", "cpu.yaml"),
    "pipespec-gguf": ("pipespec gguf", "gguf", "pipespec", "code", "gguf.yaml"),
    "pipespec-gguf-target": ("pipespec llama.cpp target (Q4_K_M) + gguf", "gguf", "pipespec", "code",
                             "gguf_target.yaml"),
    # llama.cpp's own server, the CPU user's alternative: "llama:<target GGUF>[+draft]" (benchmarks/llama_server.py)
    "llama-speculative": ("llama.cpp speculative (bf16 target)", "llama.cpp draft model", "llama:bf16+draft", "code",
                          "llama-server"),
    "llama-target": ("llama.cpp target alone (bf16)", "—", "llama:bf16", "code", "llama-server"),
    "llama-speculative-q4": ("llama.cpp speculative (Q4_K_M target)", "llama.cpp draft model", "llama:q4+draft",
                             "code", "llama-server"),
    # OpenVINO GenAI, another engine CPU users install: "ov:target[+draft]" (benchmarks/ov_genai.py)
    "ov-target": ("OpenVINO GenAI target alone", "—", "ov:target", "code", "openvino-genai"),
    "ov-speculative": ("OpenVINO GenAI speculative", "openvino draft model", "ov:target+draft", "code",
                       "openvino-genai"),
    "hf-early-exit": ("hf early exit", "early_exit", "hf:early_exit", "code", "early_exit.yaml"),
    "pipespec-early-exit": ("pipespec early_exit", "early_exit", "pipespec", "code", "early_exit.yaml"),
    "hf-universal": ("hf universal", "universal", "hf:universal", "code", "universal.yaml"),
    "pipespec-universal": ("pipespec universal", "universal", "pipespec", "code", "universal.yaml"),
    "target-edit": ("hf target alone (edit prompts)", "—", "hf:target", "edit", "prompt_lookup.yaml"),
    "hf-prompt-lookup": ("hf prompt lookup", "prompt_lookup", "hf:prompt_lookup", "edit", "prompt_lookup.yaml"),
    "pipespec-prompt-lookup": ("pipespec prompt_lookup", "prompt_lookup", "pipespec", "edit", "prompt_lookup.yaml"),
    # no transformers counterpart; its own benchmark (benchmarks/suffix.py) shows what it is for: earlier responses
    "pipespec-suffix": ("pipespec suffix", "suffix", "pipespec", "edit", "suffix.yaml"),
}
NOT_RUNNABLE = {
    "mtp": "needs a DeepSeek-V3 / GLM-4.5 checkpoint with MTP layers (none installable here)",
    "mtp_drafter": "needs a Gemma 4 target and its -assistant checkpoint (none installable here)",
}


#: Strategies whose transformers counterpart has another name: a draft model is transformers' assisted generation
#: whichever engine runs it.
SAME_STRATEGY = {"gguf": "assistant", "llama.cpp draft model": "assistant", "openvino draft model": "assistant",
                 "auto": "assistant"}
#: Pass units placed first, so that they share pass 1 with the references when memory allows: transformers' and
#: pipespec's assistant, the gguf drafter (compared with both) and llama.cpp; the ensemble row (whose point is its
#: acceptance, not a same-pass speed) and the other types after them.
UNITS_FIRST = ("auto", "assistant", "gguf", "llama.cpp", "openvino")
#: New-token counts of the forward-cost table (each engine's target on a cached prefix) when an ``ov-*`` row runs.
FORWARD_SIZES = [1, 9]
#: Their prefix and time budget per engine: the nodes' own short prefix (a 64-token prefill in emulated bf16 took
#: most of a minute on the busy AVX2 host, leaving no time for the 9-token forward).
CURVE_PREFIX, CURVE_BUDGET_S = 16, 60.0


def prompt_set_of(key: str, model_set: str = "code") -> str:
    """The prompt set row ``key`` runs: its own, or ``model_set`` (``--prompt-set``) for the rows of ``code``."""
    return model_set if ROWS[key][3] == "code" else ROWS[key][3]


def strategy_of(key: str) -> str:
    """The strategy group of a row: its drafter type without the ensemble suffix; references have none."""
    return ROWS[key][1].split("+")[0]


def is_llama(key: str) -> bool:
    return ROWS[key][2].startswith("llama:")


def is_ov(key: str) -> bool:
    return ROWS[key][2].startswith("ov:")


def unit_of(key: str) -> str:
    """The rows that must share a pass: transformers' and pipespec's rows of one drafter type, the ensemble row on
    its own; each llama.cpp row on its own (``llama.cpp:<key>``, placed in table order: ``llama-speculative``, the
    same pair as ``pipespec-gguf``, first, so it shares pass 1 with it when the three servers do not fit)."""
    if is_llama(key):
        return f"llama.cpp:{key}"
    return f"openvino:{key}" if is_ov(key) else ROWS[key][1]


def plan_units(keys: list[str]) -> list[list[str]]:
    """The rows that must share a pass, in the order the planner fills passes: the references first (measured in
    pass 1), then each :func:`unit_of` group (the :data:`UNITS_FIRST` ones first, the others in table order)."""
    grouped: dict[str, list[str]] = {}
    for key in keys:
        if key not in REFERENCES.values():
            grouped.setdefault(unit_of(key), []).append(key)
    def rank(group: str) -> int:
        base = group.split(":")[0]
        return UNITS_FIRST.index(base) if base in UNITS_FIRST else len(UNITS_FIRST)

    order = sorted(grouped, key=rank)  # stable: table order within a rank
    units = [[k for k in REFERENCES.values() if k in keys], *(grouped[g] for g in order)]
    return [u for u in units if u]


def hf_same_strategy(key: str) -> str | None:
    """The transformers row a pipespec or llama.cpp row is compared with."""
    strategy = SAME_STRATEGY.get(strategy_of(key), strategy_of(key))
    return next((k for k, row in ROWS.items() if row[2] == f"hf:{strategy}"), None)


def drafts_counted(key: str) -> bool:
    """Whether a row drafts (and so has α, τ): not the targets alone."""
    runner = ROWS[key][2]
    return runner != "hf:target" and (not runner.startswith(("llama:", "ov:")) or runner.endswith("+draft"))


def ratio_between(report: dict[str, Any], key: str, other: str) -> tuple[float | None, str]:
    """tokens/s of row ``key`` ÷ row ``other``'s: directly when both ran in one pass, else through their references
    (each row's ratio to the reference of its own pass); with how it was taken."""
    a, b = report["raw"].get(key), report["raw"].get(other)
    if not (a and b and a["per_prompt"] and b["per_prompt"]):
        return None, ""
    if a["pass"] == b["pass"]:
        return speed_ratio(a["per_prompt"], b["per_prompt"]), "same pass"
    ref = REFERENCES[ROWS[key][3]]
    ra, rb = vs_anchor(report, key, ref), vs_anchor(report, other, ref)
    return (ra / rb if ra and rb else None), "through the references"


# ---------------------------------------------------------------------------------------------- report


def draft_totals(pp: list[dict[str, Any]]) -> dict[str, Any]:
    """α, τ, k, drafts and rounds of a drafting row over the prompts ``pp`` (α 0 and τ 1 when it never drafted)."""
    counts = [p.get("stats") or p.get("metrics") for p in pp]
    s, rounds = SpecCounts.total(counts), sum(c["rounds"] for c in counts)
    if s.draft_tokens:
        return {"alpha": s.alpha, "tau": s.tau, "k": s.mean_k, "drafts": s.drafts, "rounds": rounds}
    return {"alpha": 0.0, "tau": 1.0, "drafts": 0, "rounds": rounds}


def by_category(pp: list[dict[str, Any]], categories: list[str], ref: list[dict[str, Any]] | None,
                counted: bool) -> dict[str, dict[str, Any]]:
    """A row's results per prompt category (``categories[i]`` is prompt i's), in the order categories first appear:
    prompts, new tokens, time, tokens/s, α / τ / k where the row drafts (``counted``), and ``vs_target``, tokens/s ÷
    the reference's on the same prompts (``ref``: its results in the row's pass; None: not measured there)."""
    groups: dict[str, list[int]] = {}
    for i, category in enumerate(categories[: len(pp)]):
        groups.setdefault(category, []).append(i)
    out: dict[str, dict[str, Any]] = {}
    for category, idx in groups.items():
        sel = [pp[i] for i in idx]
        entry: dict[str, Any] = {"prompts": len(sel), "new_tokens": sum(p["new_tokens"] for p in sel),
                                 "time_s": sum(p["time_s"] for p in sel), "tokens_per_s": tps(sel)}
        if counted:
            entry |= draft_totals(sel)
        entry["vs_target"] = None if ref is None else speed_ratio(sel, [ref[i] for i in idx if i < len(ref)])
        out[category] = entry
    return out


def summarize(key: str, report: dict[str, Any]) -> dict[str, Any]:
    label, kind, runner, prompt_set, config = ROWS[key]
    raw = report["raw"].get(key) or {"per_prompt": [], "pass": None}
    shown_set = prompt_set_of(key, report["meta"].get("prompt_set", "code"))
    row: dict[str, Any] = {"key": key, "label": label, "type": kind, "prompt_set": shown_set, "config": config}
    pp = start_row(row, raw)
    if not pp:
        return row
    if drafts_counted(key):
        row |= draft_totals(pp)
    row |= ceiling_summary(pp)
    ref_key = REFERENCES[prompt_set]
    row["vs_target"] = vs_anchor(report, key, ref_key)
    ref = report["raw"].get(ref_key)
    if ref and ref["per_prompt"] and key != ref_key:
        row["mismatches"] = len(token_mismatches(pp, ref["per_prompt"]))
        row["compared"] = min(len(pp), len(ref["per_prompt"]))
    same = hf_same_strategy(key) if runner == "pipespec" or is_llama(key) or is_ov(key) else None
    other = report["raw"].get(same or "")
    if other and other["per_prompt"]:
        if other["pass"] == raw["pass"]:
            row["vs_hf_same"] = speed_ratio(pp, other["per_prompt"])
        elif row["vs_target"] and vs_anchor(report, same, ref_key):  # across passes: through the references
            row["vs_hf_same"] = row["vs_target"] / vs_anchor(report, same, ref_key)
        row["hf_same_vs_target"] = vs_anchor(report, same, ref_key)
    if runner == "pipespec" or is_llama(key) or is_ov(key):  # the aims' yardstick: transformers' fastest
        row["vs_hf_fastest"], row["hf_fastest"] = vs_hf_fastest(report, key)
    if key in ("pipespec-gguf", "pipespec-default"):  # the same pair in llama.cpp (its target in bf16), OpenVINO
        row["vs_llama_speculative"], row["vs_llama_how"] = ratio_between(report, key, "llama-speculative")
        row["vs_ov_speculative"], row["vs_ov_how"] = ratio_between(report, key, "ov-speculative")
    if key == "pipespec-gguf-target":  # the same GGUF pair in llama.cpp's own speculative decoding
        row["vs_llama_speculative_q4"], row["vs_llama_q4_how"] = ratio_between(report, key, "llama-speculative-q4")
    if key == "ov-speculative":  # what GenAI's own speculative decoding gains over its target alone
        row["vs_ov_target"], row["vs_ov_target_how"] = ratio_between(report, key, "ov-target")
    categories = report["meta"].get("categories", {}).get(shown_set)
    if categories:
        row["categories"] = by_category(pp, categories, anchor_run(report, ref_key, raw["pass"]),
                                        drafts_counted(key))
    return row


def vs_hf_fastest(report: dict[str, Any], key: str) -> tuple[float | None, str | None]:
    """Row ``key``'s tokens/s ÷ the fastest transformers row of its prompt set (the target alone or the same
    strategy), each through the reference of its own pass (:func:`vs_anchor`); with that row's key."""
    prompt_set = ROWS[key][3]
    ref = REFERENCES[prompt_set]
    mine = vs_anchor(report, key, ref)
    hf = {k: vs_anchor(report, k, ref) for k, row in ROWS.items()
          if row[2].startswith("hf:") and row[3] == prompt_set and k in report["raw"]}
    hf = {k: v for k, v in hf.items() if v}
    if not mine or not hf:
        return None, None
    fastest = max(hf, key=hf.__getitem__)
    return mine / hf[fastest], fastest


def ceiling_summary(per_prompt: list[dict[str, Any]]) -> dict[str, Any]:
    """A pipespec row's ceilings (docs/metrics.md): the mean ceiling over its prompts, and its realised decoding rate
    as a fraction of the ceiling, mean and worst prompt (the aim is per request). Empty for rows without them."""
    metrics = [p.get("metrics") or {} for p in per_prompt]
    pairs = [(m["ceiling_tokens_per_second"], m["ceiling_fraction"]) for m in metrics
             if m.get("ceiling_tokens_per_second") and m.get("ceiling_fraction") is not None]
    if not pairs:
        return {}
    fractions = [f for _, f in pairs]
    return {"ceiling": sum(c for c, _ in pairs) / len(pairs), "ceiling_fraction": sum(fractions) / len(fractions),
            "ceiling_fraction_min": min(fractions)}


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta = report["meta"]
    lines = [
        "# pipespec drafter types benchmark",
        "",
        *header_lines(meta),
        f"- greedy; {meta['prompts']} prompts per set, max_new_tokens {meta['max_new_tokens']}",
        f"- ensemble weight w = {meta['ensemble_weight']}",
        "- vs target = tokens/s ÷ the target alone on the same prompts in the same pass (transformers, same dtype, "
        f"{meta['hf_threads']} threads); vs hf = ÷ transformers' same strategy (in brackets: that row's own ratio to "
        "the target); mismatches = prompts whose tokens differ from the target alone",
    ]
    for name, source in meta.get("prompt_sources", {}).items():
        lines.append(f"- `{name}` prompts: {source}")
    llama = meta.get("llama_cpp")
    if llama:
        lines += [f"- llama.cpp: `{llama['version'] or 'llama-server not found'}` ({llama['bin']}); one "
                  f"`llama-server` per row on a loopback port, `-t {llama['threads']} -tb {llama['threads']}` (the "
                  f"draft model the same), speculative rows `--spec-type draft-simple --spec-draft-n-max "
                  f"{llama['draft_max']} --spec-draft-n-min {llama['draft_min']}`; tokens/s from the wall time around "
                  "each `/completion` request (prompt ids in, greedy, no prompt cache; the server's own `timings` are "
                  "in types.json); its bf16 arithmetic is not torch's, so its mismatches with the transformers target "
                  "are counted like any row's"]
    ov = meta.get("openvino")
    if ov:
        lines += [f"- OpenVINO GenAI: {ov['versions'] or 'not started'}; one worker per row in its own environment "
                  f"(`{ov['venv']}`), the CPU plugin asked for `INFERENCE_PRECISION_HINT` {ov['precision_hint']} and "
                  f"`INFERENCE_NUM_THREADS` {ov['threads']}, resolved to {ov['resolved'] or '—'}; models exported "
                  f"with `optimum-cli export openvino --weight-format {ov['weight_format']}` from the same "
                  f"safetensors; speculative row `num_assistant_tokens` {ov['draft_tokens']}; greedy, prompt ids in, "
                  "no prefix cache; tokens/s from the wall time around each `generate` (GenAI's own metrics are in "
                  "types.json); its arithmetic is not torch's, so its mismatches are counted like any row's"]
    lines.append("")
    table, notes = [], []
    for r in report["rows"]:
        if "tokens_per_s" not in r:
            table.append([r["label"], r["type"], r["prompt_set"], f"`{r['config']}`", str(r["pass"] or "—"),
                          "error", *[""] * 9])
            notes.append(f"- {r['label']} failed: `{r['error'].splitlines()[0][:300]}`")
            continue
        if "error" in r:
            notes.append(f"- {r['label']} failed after {r['prompts']} prompt(s): `{r['error'].splitlines()[0][:300]}`")
        mism = f"{r['mismatches']}/{r['compared']}" if "mismatches" in r else "ref"
        hf_same = fmt(r.get("vs_hf_same"), ".2f", "×")
        if r.get("hf_same_vs_target"):
            hf_same += f" ({r['hf_same_vs_target']:.2f}×)"
        table.append([r["label"] + (" (partial)" if "error" in r else ""), r["type"], r["prompt_set"],
                      f"`{r['config']}`", str(r["pass"]), f"{r['tokens_per_s']:.2f}", fmt(r.get("alpha")),
                      fmt(r.get("tau")), fmt(r.get("k")), fmt(r.get("vs_target"), ".2f", "×"), hf_same,
                      fmt(r.get("vs_hf_fastest"), ".2f", "×"), mism,
                      fmt(r.get("ceiling")), _fraction(r)])
    for kind, why in NOT_RUNNABLE.items():
        table.append([f"pipespec {kind}", kind, "—", "—", "—", f"not run: {why}", *[""] * 9])
    lines += md_table(["row", "type", "prompts", "config", "pass", "tok/s", "α", "τ", "k", "vs target",
                       "vs hf same strategy", "vs hf fastest", "mismatches", "ceiling tok/s",
                       "÷ ceiling (worst prompt)"], table, "lllll" + "r" * 10)
    lines += ["", "ceiling: the cost model's best plan at the acceptance each request realised, from the nodes' "
              "measured forward costs with no overhead; ÷ ceiling: the request's decoding rate (after its first "
              "token) over it, mean over prompts (worst prompt in brackets)."]
    for key, r in report["raw"].items():
        if "hf" in r:
            notes.append(f"- {ROWS[key][0]}: transformers used `{r['hf']['generator']}` with "
                         f"{r['hf']['settings'] or '—'}")
    for r in report["rows"]:
        if r["key"] not in ("pipespec-gguf", "pipespec-default"):
            continue
        if r.get("vs_llama_speculative"):
            notes.append(f"- {r['label']} ÷ llama.cpp speculative (bf16 target), the same pair: "
                         f"{r['vs_llama_speculative']:.2f}× ({r['vs_llama_how']})")
        if r.get("vs_ov_speculative"):
            notes.append(f"- {r['label']} ÷ OpenVINO GenAI speculative, the same pair: "
                         f"{r['vs_ov_speculative']:.2f}× ({r['vs_ov_how']})")
    gguf_target = next((r for r in report["rows"] if r["key"] == "pipespec-gguf-target"), None)
    if gguf_target and gguf_target.get("vs_llama_speculative_q4"):
        notes.append(f"- {gguf_target['label']} ÷ llama.cpp speculative (Q4_K_M target), the same GGUF pair: "
                     f"{gguf_target['vs_llama_speculative_q4']:.2f}× ({gguf_target['vs_llama_q4_how']})")
    ovs = next((r for r in report["rows"] if r["key"] == "ov-speculative"), None)
    if ovs and ovs.get("vs_ov_target"):
        notes.append(f"- OpenVINO GenAI speculative ÷ its target alone: {ovs['vs_ov_target']:.2f}× "
                     f"({ovs['vs_ov_target_how']}); its α, τ, k count every verification step but the last of each "
                     "generation (GenAI's counters leave it out)")
    for key, info in report.get("setups", {}).items():
        if "command" in info:
            notes.append(f"- {ROWS[key][0]}: `{' '.join(Path(a).name if '/' in a else a for a in info['command'])}`")
    for ref in REFERENCES.values():
        repeats = report.get("anchor_runs", {}).get(ref, {})
        if repeats and ref in report["raw"]:
            own = report["raw"][ref]
            speeds = {own["pass"]: own["per_prompt"], **{int(p): r["per_prompt"] for p, r in repeats.items()}}
            notes.append(f"- `{ref}` per pass (a host that changed speed between passes shows here): " + ", ".join(
                f"pass {p} {fmt(tps(pp))} tok/s" for p, pp in sorted(speeds.items()) if pp))
    curves = curve_table_lines(report.get("curves", {}), "each engine's worker (transformers: its target; OpenVINO: "
                               "its exported stateful target, compiled with the pipeline's properties)", FORWARD_SIZES)
    if curves:
        lines += ["", *curves]
    # the breakdown after the main table's notes, which are about that table
    path.write_text("\n".join(lines + (["", "Notes:", *notes] if notes else []) + category_lines(report["rows"]))
                    + "\n")


def category_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The per-category table (empty when no row has categories): one line per category and row, categories in
    the order of the prompts, rows in table order."""
    with_categories = [r for r in rows if r.get("categories")]
    if not with_categories:
        return []
    order: list[str] = []
    for r in with_categories:
        order += [c for c in r["categories"] if c not in order]
    table = [[c, r["label"], r["prompt_set"], str(e["prompts"]), fmt(e["tokens_per_s"]), fmt(e.get("alpha")),
              fmt(e.get("tau")), fmt(e.get("vs_target"), ".2f", "×")]
             for c in order for r in with_categories if (e := r["categories"].get(c))]
    return ["", "## Per category", "",
            "vs target = the row's tokens/s ÷ the target alone's on the same prompts in the same pass.", "",
            *md_table(["category", "row", "prompts", "n", "tok/s", "α", "τ", "vs target"], table, "lll" + "r" * 5)]


def _fraction(r: dict[str, Any]) -> str:
    if r.get("ceiling_fraction") is None:
        return "—"
    return f"{100 * r['ceiling_fraction']:.0f} % ({100 * r['ceiling_fraction_min']:.0f} %)"


# ---------------------------------------------------------------------------------------------- main


def bf16_gguf_path(model: str) -> Path:
    """Where the bench keeps its bf16 GGUF of named model ``model`` (made once, when a row needs it)."""
    from shared.named_models import cache_root

    return cache_root() / "gguf" / f"{model}-bf16.gguf"


def llama_setup(key: str, bin_dir: Path, threads: int, ctx_size: int, draft_max: int, draft_min: int,
                target_model: str, draft_model: str) -> LlamaSetup:
    """The llama-server of a ``llama-*`` row: the target as a bf16 GGUF (made from its transformers folder when
    missing) or as its installed Q4_K_M GGUF, and the drafter's installed GGUF as draft model where the row drafts."""
    from shared.named_models import gguf_file_path
    from weights import resolve_model

    quant, _, drafted = ROWS[key][2].removeprefix("llama:").partition("+")
    hint = f"run 'python -m weights --gguf {target_model}' / '--gguf {draft_model}'"
    models: dict[str, float] = {}
    convert_from = None
    if quant == "bf16":
        target = bf16_gguf_path(target_model)
        convert_from = resolve_model(target_model)
        models["target"] = model_gib(convert_from, "bfloat16")
    else:
        target = gguf_file_path(target_model)
        models["target"] = file_gib(target)
    draft = gguf_file_path(draft_model) if drafted else None
    if draft is not None:
        models["draft"] = file_gib(draft)
    return LlamaSetup(key, bin_dir, target, models, threads, ctx_size=ctx_size, draft=draft, draft_max=draft_max,
                      draft_min=draft_min, convert_from=convert_from, missing_hint=hint)


def prompt_source(path: Path) -> str | None:
    """One line on where a vendored public prompt file comes from (dataset, package, version, license, selection);
    None for this project's own files (a plain JSON list)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        return None
    src = data["source"]
    return (f"{src['dataset']}, from the `{src['package']}` {src['version']} package ({data['license']}): "
            f"{src['selection']}")


def ov_setup(key: str, target_path: str, draft_path: str, threads: int, draft_tokens: int, venv: Path,
             curves: bool) -> OVSetup:
    """The OpenVINO GenAI worker of an ``ov-*`` row: the target's export, and the drafter's as its draft model
    where the row drafts; ``curves``: this worker measures its target's forward cost (:data:`FORWARD_SIZES`).
    Memory is budgeted as float32 weights: the CPU plugin runs f32 without native bf16 (checked by the worker and
    reported), and its fp16 weights may be unpacked to it."""
    drafted = ROWS[key][2].endswith("+draft")
    models = {"target": model_gib(target_path, "float32")}
    if drafted:
        models["draft"] = model_gib(draft_path, "float32")
    return OVSetup(key, target_path, models, threads, draft_path=draft_path if drafted else None,
                   draft_tokens=draft_tokens, venv=venv,
                   curves=[("OpenVINO target", "target", FORWARD_SIZES)] if curves else [])


def ov_meta(report: dict[str, Any]) -> dict[str, Any]:
    """The versions and resolved precision the first started OpenVINO worker reported (the setups' json)."""
    info = next((i["openvino"] for i in report.get("setups", {}).values() if "openvino" in i), None)
    if not info:
        return {}
    resolved = info.get("resolved", {})
    return {"versions": ", ".join(f"{k} {v.split('-')[0]}" for k, v in info.get("versions", {}).items()),
            "resolved": f"{precision_label(info)}, {resolved.get('INFERENCE_NUM_THREADS', '?')} threads"}


def file_gib(path: Path) -> float:
    """A GGUF's size (llama.cpp maps it whole); 1 GiB while it is missing (its row fails with the reason)."""
    return path.stat().st_size / 2**30 if path.is_file() else 1.0


def _parser() -> argparse.ArgumentParser:
    p = pass_parser(__doc__, list(ROWS), "dtype of every row: the transformers worker and, by override, the pipespec "
                                         "configs (default: the configs' own, bfloat16)")
    p.add_argument("--prompts", type=int, default=5, help="prompts per set, from the start of each file (default: 5)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt (default: 96)")
    p.add_argument("--prompt-set", choices=MODEL_SETS, default="code",
                   help="prompts of the model-based rows (target-code and the others on code prompts): code (ours), "
                        "humaneval (the first 20 HumanEval problems) or chat (one MT-Bench question per category, "
                        "with a per-category breakdown); default: code")
    p.add_argument("--ensemble-weight", type=float, default=0.7,
                   help="verification.ensemble_weight of the pipespec-ensemble row (default: 0.7)")
    p.add_argument("--llama-bin", type=Path, default=default_bin_dir(), metavar="DIR",
                   help="folder with llama.cpp's llama-server for the llama-* rows (default: $PIPESPEC_LLAMA_BIN, "
                        f"else {DEFAULT_BIN}; `python scripts/build_llama_cpp.py --tools DIR` builds DIR/build/bin)")
    p.add_argument("--llama-threads", type=int, default=None,
                   help="llama-server -t / -tb of the llama-* rows (default: the transformers rows' threads)")
    p.add_argument("--llama-draft-max", type=int, default=3,
                   help="--spec-draft-n-max of the llama-speculative rows (default: 3, llama-server's own)")
    p.add_argument("--llama-draft-min", type=int, default=0,
                   help="--spec-draft-n-min of the llama-speculative rows (default: 0, llama-server's own)")
    p.add_argument("--ov-venv", type=Path, default=default_venv(), metavar="DIR",
                   help=f"the OpenVINO environment of the ov-* rows, made when missing (default: {default_venv()})")
    p.add_argument("--ov-threads", type=int, default=None,
                   help="INFERENCE_NUM_THREADS of the ov-* rows (default: the transformers rows' threads)")
    p.add_argument("--ov-draft-tokens", type=int, default=5,
                   help="num_assistant_tokens of the ov-speculative row (default: 5)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    keys = select_rows(args.rows, list(ROWS), "bench_types")
    from runtime.config import load_config
    from shared.models import load_tokenizer
    from weights import resolve_model

    base = load_config("cpu.yaml")
    # transformers rows: --dtype, else the config's (bf16 for auto: the fastest transformers setup measured on CPUs
    # so far); pipespec rows keep their config's dtype (auto: chosen at start-up) unless --dtype is given
    dtype = args.dtype or (base["verifier"]["dtype"] if base["verifier"]["dtype"] != "auto" else "bfloat16")
    threads = args.hf_threads or available_threads()
    device = "cpu"
    target_path = resolve_model(base["verifier"]["model"])
    tokenizer = load_tokenizer(target_path)
    model_set = args.prompt_set
    files = {name: load_prompts(PROMPT_SETS[name])[: args.prompts] for name in (model_set, "edit")}
    prompts = {name: chat_prompts(tokenizer, [p["messages"] for p in items]) for name, items in files.items()}

    ov_keys = [k for k in keys if is_ov(k)]
    # with an OpenVINO row, the forward cost of each engine's target: transformers' here, OpenVINO's in its worker
    hf = HFSetup(f"hf-{DTYPE_TAGS[dtype]}-{threads}t", dtype, threads, device, target_path,
                 model_gib(target_path, dtype), curves=[("transformers target", "target", FORWARD_SIZES)]
                 if ov_keys else [])
    setups: dict[str, Setup] = {hf.key: hf}
    rows: dict[str, Row] = {}
    llama_threads = args.llama_threads or threads
    ov_threads = args.ov_threads or threads
    if args.ov_draft_tokens < 1:
        raise SystemExit(f"bench_types: --ov-draft-tokens must be ≥ 1, got {args.ov_draft_tokens}")
    # one context for every llama-server: the longest prompt (the warm-up's is the first) and its new tokens
    ctx_size = -(-(max(len(p["ids"]) for p in prompts[model_set]) + args.max_new_tokens + 64) // 256) * 256
    for key in keys:
        label, kind, runner, ref_set, config = ROWS[key]
        anchor = REFERENCES[ref_set] if REFERENCES[ref_set] in keys and key != REFERENCES[ref_set] else None
        prompt_set = prompt_set_of(key, model_set)
        if is_llama(key):
            setups[key] = llama_setup(key, args.llama_bin, llama_threads, ctx_size, args.llama_draft_max,
                                      args.llama_draft_min, base["verifier"]["model"],
                                      load_config("gguf.yaml")["drafter"]["model"])
            rows[key] = Row(key, label, key, prompt_set, anchor=anchor)
            continue
        if is_ov(key):
            setups[key] = ov_setup(key, target_path, resolve_model(base["drafter"]["model"]), ov_threads,
                                   args.ov_draft_tokens, args.ov_venv, curves=key == ov_keys[0])
            rows[key] = Row(key, label, key, prompt_set, anchor=anchor)
            continue
        d = load_config(config)["drafter"]
        if runner == "pipespec":
            overrides: dict[str, Any] = {}
            if kind.startswith("assistant"):  # cpu.yaml's own type is auto: these rows are the torch drafter's
                overrides["drafter.type"] = "assistant"
            if kind.endswith("ensemble"):
                overrides["verification.ensemble_weight"] = args.ensemble_weight
            v = load_config(config)
            for section in ("verifier", "drafter"):
                if args.dtype and v[section]["dtype"] != dtype:
                    overrides[f"{section}.dtype"] = dtype
            v = load_config(config, overrides)
            setups[key] = ClusterSetup(key, config, overrides, cluster_models(v),
                                       processes=2 if v["launch"]["start_drafter"] else 1)
            rows[key] = Row(key, label, key, prompt_set, anchor=anchor)
            continue
        strategy: dict[str, Any] = {"kind": runner.split(":", 1)[1]}
        models: dict[str, float] = {}
        if strategy["kind"] in ("assistant", "universal"):
            strategy["model"] = resolve_model(d["model"])
            models[strategy["model"]] = model_gib(strategy["model"], dtype)
        elif strategy["kind"] == "early_exit":
            strategy["assistant_early_exit"] = d["assistant_early_exit"]
        elif strategy["kind"] == "prompt_lookup":
            strategy |= {"prompt_lookup_num_tokens": d["prompt_lookup_num_tokens"],
                         "max_matching_ngram_size": d["max_matching_ngram_size"]}
        rows[key] = Row(key, label, hf.key, prompt_set, strategy=strategy, anchor=anchor, models=models)

    units = plan_units(list(rows))
    budget = memory_budget_gib(args.memory_gib)
    passes = plan_passes(units, rows, setups, budget)
    if args.dry_run:
        print(plan_text(passes, rows, setups, budget))
        return 0

    meta: dict[str, Any] = {
        "start": utc_now(), "end": None, "machine": machine_info(), "memory_budget_gib": budget,
        "models": f"target `{base['verifier']['model']}`; drafters as each row's config (assistant and ensemble "
                  f"`{base['drafter']['model']}`, universal `{load_config('universal.yaml')['drafter']['model']}`, "
                  "early exit the target's first layers, prompt lookup none)",
        "dtypes": f"transformers rows {dtype}; pipespec rows " + (
            f"{dtype}" if args.dtype else "their configs' (auto: chosen at start-up, see each request's "
            "verifier_dtype / drafter_dtype in types.json)"),
        "threads": f"transformers rows {threads} (one worker process); pipespec rows their configs' (auto: every "
                   "core while the other node idles, half while both work; one process per node)",
        "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "hf_threads": threads, "dtype": dtype,
        "ensemble_weight": args.ensemble_weight, "rows": keys, "prompt_set": model_set,
    }
    sources = {name: prompt_source(PROMPT_SETS[name]) for name in files}
    meta["prompt_sources"] = {name: text for name, text in sources.items() if text}
    categories = {name: [p["category"] for p in items] for name, items in files.items()
                  if items and all("category" in p for p in items)}
    if categories:
        meta["categories"] = categories
    if any(is_llama(k) for k in keys):
        meta["llama_cpp"] = {"bin": str(args.llama_bin), "version": server_version(args.llama_bin),
                             "threads": llama_threads, "draft_max": args.llama_draft_max,
                             "draft_min": args.llama_draft_min, "ctx_size": ctx_size}
        meta["models"] += ("; llama.cpp rows the same target as GGUF (bf16, made from its safetensors by llama.cpp's "
                           "convert_hf_to_gguf.py, or its Q4_K_M file) and the assistant's GGUF as draft model")
        meta["dtypes"] += ("; llama.cpp rows the GGUF's own tensor types (target bf16 or Q4_K_M, draft the 0.5B's "
                           "GGUF, mostly Q5_0)")
        meta["threads"] += f"; llama.cpp rows {llama_threads} (`-t`/`-tb`, one server process per row)"
    if ov_keys:
        meta["openvino"] = {"venv": str(args.ov_venv), "threads": ov_threads, "precision_hint": "bf16",
                            "draft_tokens": args.ov_draft_tokens, "weight_format": WEIGHT_FORMAT, "versions": None,
                            "resolved": None}
        meta["models"] += ("; OpenVINO rows the same target and assistant exported from their safetensors "
                           f"(`optimum-cli export openvino --weight-format {WEIGHT_FORMAT}`)")
        meta["dtypes"] += "; OpenVINO rows fp16 weights, the CPU plugin's resolved precision (see below)"
        meta["threads"] += f"; OpenVINO rows {ov_threads} (`INFERENCE_NUM_THREADS`, one worker process per row)"
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"rows: {', '.join(keys)}; {len(passes)} pass(es) within {budget:.1f} GiB")

    def write(report: dict[str, Any], final: bool) -> None:
        if "openvino" in meta:
            meta["openvino"] |= ov_meta(report)
        report["rows"] = [summarize(k, report) for k in keys if k in report["raw"]]
        write_result(args.out / "types.json", report)
        write_markdown(args.out / "types.md", report)

    return run_report(rows, setups, prompts, args.max_new_tokens, passes, meta, write, args.out / "types.md",
                      curve_prefix=CURVE_PREFIX, curve_budget_s=CURVE_BUDGET_S)


if __name__ == "__main__":
    sys.exit(main())
