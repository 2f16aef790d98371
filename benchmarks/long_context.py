"""Does pipespec's advantage hold at long contexts? A per-round cost that grows with the context (copying the
drafter's cache every block, say) shows up as a speedup that shrinks as the prompt grows.

Built on the spot, so no download is needed: a mid-size random Qwen2-style target (``--hidden``, ``--layers``,
``--heads`` / ``--kv-heads``; the vocabulary of the tiny test tokenizer; ``max_position_embeddings`` ≥ 4096) and a
1-layer assistant cut from it (the same embeddings, its first decoder layer, final norm and LM head), both saved
with ``save_pretrained`` and loaded back with ``from_pretrained``. The target's later layers write only
``--deep-scale`` of their output into the residual stream (their compute is unchanged), so the cut agrees with the
target on most tokens (α is measured and printed) and the comparison is about per-round costs, not acceptance.

Per prompt length (``--lengths``, random token prompts), interleaved — all rows of one length, then the next —
greedy, ``--max-new-tokens`` new tokens, end tokens off, one short warm-up per row:

- ``hf-target``: transformers ``generate`` on the target alone (``--hf-threads`` threads, one subprocess);
- ``hf-assisted``: transformers assisted generation (``assistant_model=`` the cut assistant) with the same
  constant k as pipespec and no confidence stop (``--hf-defaults``: transformers' own settings; recorded either way);
- ``pipespec``: ``runtime.launchers.cluster`` with a config dict: both models from the saved folders, ``--dtype``, one
  thread per node, overlap on, a fixed k (``num_draft_tokens`` ``--k``, ``draft_schedule: constant``).

tok/s is counted two ways: end to end (new tokens / request time, the prefill included) and decode only (tokens
after the first / time after the first token), since at long prompts the prefill alone can dominate a 64-token
request. The pipespec ÷ hf-assisted ratio per length and the long ÷ short ratio of those ratios are the result;
per-round costs (verification ms, drafting ms) and the drafter's per-block pre-drafting costs (building the rows, a
step, adopting a row, measured in the hf worker on the assistant) show what grows with the context.

Outputs in ``--out`` (default ``results/``): ``long_context.md`` and ``long_context.json``.

Usage::

    .venv/bin/python scripts/bench_long_context.py                        # hidden 1024, 16 layers, 64 and 3000
    .venv/bin/python scripts/bench_long_context.py --hidden 128 --layers 2 --lengths 16,200 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import progress
from benchmarks.machine import machine_info
from benchmarks.models import build_random_pair
from benchmarks.progress import log, utc_now
from benchmarks.results import write_result
from benchmarks.runner import WARMUP_TOKENS
from benchmarks.tables import fmt as _fmt
from benchmarks.tables import header_lines
from benchmarks.workers import DraftCounter, run_script_worker

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "bench_long_context.py"  # its one-job worker runs the script with --_hf-worker

HF_ROWS = ("hf-target", "hf-assisted")
ROWS = (*HF_ROWS, "pipespec")
CALIB_REPS = 5
CALIB_ROWS = 7  # outcome rows of a k = 6 block: k corrections + the bonus


# ---------------------------------------------------------------------------------------------- models


def build_models(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """Save the random target and its 1-layer cut into ``root`` (with the tiny tokenizer); return both folders."""
    return build_random_pair(root, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                             intermediate=args.intermediate or args.hidden * 11 // 4,
                             max_positions=max(4096, 2 * max(args.lengths) + args.max_new_tokens),
                             deep_scale=args.deep_scale, seed=args.seed)


def random_prompts(vocab: int, length: int, count: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed * 100_003 + length)
    return [torch.randint(2, vocab, (length,), generator=gen).tolist() for _ in range(count)]


# ---------------------------------------------------------------------------------------------- hf worker


class FirstTokenTimer:
    """A ``generate`` streamer that notes when the first new token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def calibrate_drafter(assistant: Any, prompt: list[int], k: int) -> dict[str, float]:
    """Median ms of the drafter's per-block work at this context: one plain step, building the outcome rows, one
    batched step of the rows, adopting a row (the parts the old copying implementation made grow)."""
    from drafter_node.base import DraftToken
    from drafter_node.branches import Branches
    from shared.kv import CachedLM

    lm = CachedLM(assistant)
    block = prompt[-k:]
    lm.feed(prompt)
    times: dict[str, list[float]] = {"plain_step": [], "build": [], "rows_step": [], "adopt": []}
    rows = [(r, 5 + r) for r in range(min(CALIB_ROWS, k + 1))]
    greedy = lambda logits, contexts: [DraftToken(int(x.argmax())) for x in logits]  # noqa: E731
    for _ in range(CALIB_REPS):
        t0 = time.perf_counter()
        lm.feed([3])
        times["plain_step"].append(time.perf_counter() - t0)
        lm.crop(len(prompt))
        t0 = time.perf_counter()
        branches = Branches(lm, len(prompt) - k, block, rows)
        times["build"].append(time.perf_counter() - t0)
        for _ in range(k):
            t0 = time.perf_counter()
            branches.step(greedy)
            times["rows_step"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        branches.adopt(len(rows) - 1, lm)
        times["adopt"].append(time.perf_counter() - t0)
        lm.crop(len(prompt))
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def hf_worker(job_path: Path) -> int:
    """Subprocess body: the transformers rows for one prompt length, then the drafter calibration."""
    job = json.loads(job_path.read_text())
    progress.set_start(job["start"])
    import torch
    import transformers

    from shared.models import load_causal_lm, set_threads

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    set_threads(job["threads"])
    target = load_causal_lm(job["target"], "cpu", job["dtype"])
    assistant = load_causal_lm(job["assistant"], "cpu", job["dtype"])
    if not job["hf_defaults"]:  # the same fixed block as pipespec: k drafts per round, no early stop on confidence
        assistant.generation_config.num_assistant_tokens = job["k"]
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
    config = copy.deepcopy(target.generation_config)
    config.eos_token_id = []  # no end token: every row makes exactly max_new_tokens
    config.pad_token_id, config.do_sample = 1, False
    out: dict[str, Any] = {}

    def generate(ids: list[int], max_new: int, extra: dict[str, Any], streamer: Any = None) -> list[int]:
        input_ids = torch.tensor([ids], dtype=torch.long)
        tokens = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=config, max_new_tokens=max_new, streamer=streamer, **extra)
        return tokens[0, len(ids):].tolist()

    for key in HF_ROWS:
        extra = {"assistant_model": assistant} if key == "hf-assisted" else {}
        generate(job["prompts"][0][:64], WARMUP_TOKENS, extra)
        counter = DraftCounter()
        per_prompt = []
        with counter.patched():
            for ids in job["prompts"]:
                timer = FirstTokenTimer()
                t0 = time.perf_counter()
                tokens = generate(ids, job["max_new_tokens"], extra, timer)
                elapsed = time.perf_counter() - t0
                per_prompt.append({"token_ids": tokens, "new_tokens": len(tokens), "time_s": elapsed,
                                   "first_token_s": (timer.first_at or t0) - t0})
                log(f"{key} @ {len(ids)}: {len(tokens)} tokens in {elapsed:.2f} s "
                    f"(first after {per_prompt[-1]['first_token_s']:.2f} s)")
        stats = {name: getattr(counter, name) for name in
                 ("rounds", "drafts", "draft_tokens", "accepted_tokens", "draft_s")}
        out[key] = {"per_prompt": per_prompt, "stats": stats if extra else None, "settings": counter.settings}
    out["drafter_costs_ms"] = calibrate_drafter(assistant, job["prompts"][0], job["k"])
    log(f"drafter per-block costs @ {len(job['prompts'][0])}: "
        + ", ".join(f"{name} {ms:.2f} ms" for name, ms in out["drafter_costs_ms"].items()))
    Path(job["out"]).write_text(json.dumps(out))
    return 0


def run_hf(prompts: list[list[int]], ctx: dict[str, Any], tmp: Path) -> dict[str, Any]:
    length = len(prompts[0])
    job = {"start": _bench_start(), "threads": ctx["hf_threads"], "prompts": prompts, "k": ctx["k"],
           "hf_defaults": ctx["hf_defaults"],
           "max_new_tokens": ctx["max_new_tokens"], "dtype": ctx["dtype"], "target": str(ctx["target"]),
           "assistant": str(ctx["assistant"]), "out": str(tmp / f"hf-{length}.out.json")}
    job_path = tmp / f"hf-{length}.job.json"
    job_path.write_text(json.dumps(job))
    run_script_worker(SCRIPT, job_path, ctx["hf_threads"], f"hf worker @ {length}")
    return json.loads(Path(job["out"]).read_text())


def _bench_start() -> float:
    return progress.start_time()


# ---------------------------------------------------------------------------------------------- pipespec


def pipespec_config(ctx: dict[str, Any]) -> dict[str, Any]:
    return {
        "verifier": {"model": str(ctx["target"]), "dtype": ctx["dtype"], "threads": 1},
        "drafter": {"type": "assistant", "model": str(ctx["assistant"]), "dtype": ctx["dtype"], "threads": 1,
                    "overlap": True, "num_draft_tokens": ctx["k"], "draft_schedule": "constant"},
        "client": {"timeout_s": 1800},
    }


async def run_pipespec(prompts: list[list[int]], ctx: dict[str, Any]) -> dict[str, Any]:
    from runtime.launchers import cluster

    params = {"max_new_tokens": ctx["max_new_tokens"], "eos_token_ids": [], "do_sample": False}
    async with cluster(pipespec_config(ctx)) as client:
        try:
            await client.generate(token_ids=prompts[0][:64], **(params | {"max_new_tokens": WARMUP_TOKENS}))
            per_prompt = []
            for ids in prompts:
                t0 = time.perf_counter()
                r = await client.generate(token_ids=ids, **params)
                elapsed = time.perf_counter() - t0
                m = r.metrics
                # the verifier's own clock for the first token; the request time as the client saw it
                per_prompt.append({"token_ids": r.token_ids, "new_tokens": len(r.token_ids), "time_s": elapsed,
                                   "first_token_s": m["time_to_first_token_s"] or 0.0, "metrics": m})
                log(f"pipespec @ {len(ids)}: {len(r.token_ids)} tokens in {elapsed:.2f} s, α "
                    f"{m['acceptance_rate']:.2f}, {m['rounds']} rounds, pre-draft hits {m['predraft_hit_rate']:.2f}")
        except Exception as exc:  # keep the node logs with the error text
            tails = {role: client.cluster.log_tail(role) for role in client.cluster.nodes()}
            raise RuntimeError(f"{type(exc).__name__}: {exc}\n" + "\n".join(
                f"--- end of {role} log ---\n{text}" for role, text in tails.items())) from exc
    return {"per_prompt": per_prompt}


# ---------------------------------------------------------------------------------------------- report


def summarize(key: str, raw: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    pp = raw["per_prompt"]
    new = sum(p["new_tokens"] for p in pp)
    total = sum(p["time_s"] for p in pp)
    after_first = sum(p["time_s"] - p["first_token_s"] for p in pp)
    row: dict[str, Any] = {
        "row": key, "new_tokens": new, "time_s": total, "tok_s": new / total,
        "decode_tok_s": (new - len(pp)) / after_first if after_first > 0 else None,
        "first_token_s": statistics.mean(p["first_token_s"] for p in pp),
        "mismatches": sum(p["token_ids"] != q["token_ids"] for p, q in zip(pp, reference["per_prompt"])),
    }
    s = raw.get("stats")
    if s and s["draft_tokens"]:
        row |= {"alpha": s["accepted_tokens"] / s["draft_tokens"], "rounds": s["rounds"]}
    if key == "pipespec":
        ms = [p["metrics"] for p in pp]
        drafted = sum(m["draft_tokens"] for m in ms)
        elapsed = sum(m["elapsed_s"] for m in ms)
        row |= {"alpha": sum(m["accepted_tokens"] for m in ms) / drafted if drafted else 0.0,
                "rounds": sum(m["rounds"] for m in ms),
                "verifier_busy": sum(m["verifier_busy_fraction"] * m["elapsed_s"] for m in ms) / elapsed,
                "drafter_busy": sum(m["drafter_busy_fraction"] * m["elapsed_s"] for m in ms) / elapsed,
                "predraft_hit_rate": statistics.mean(m["predraft_hit_rate"] for m in ms)}
    elif key == "hf-target":
        row["rounds"] = new  # one forward per token
    # A round after the first token: the prefills (and the first round, which waits on them) left out.
    if row.get("rounds", 0) > len(pp):
        row["round_ms"] = 1000 * after_first / (row["rounds"] - len(pp))
    return row


def ratios(rows: dict[int, dict[str, dict[str, Any]]], lengths: list[int]) -> dict[str, Any]:
    """pipespec ÷ each transformers row per length (decode and end to end), and the longest ÷ the shortest."""
    out: dict[str, Any] = {}
    for measure in ("decode_tok_s", "tok_s"):
        for ref in HF_ROWS:
            per = {}
            for length in lengths:
                a, b = rows[length]["pipespec"].get(measure), rows[length][ref].get(measure)
                per[length] = a / b if a and b else None
            short, long = per[lengths[0]], per[lengths[-1]]
            out[f"{measure}:{ref}"] = {"per_length": per, "long_over_short": long / short if short and long else None}
    return out


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta = report["meta"]
    m = meta["model"]
    lines = [
        "# Long-context benchmark: per-round costs as the prompt grows",
        "",
        *header_lines(meta),
        f"- 1-minute load average: {meta['load_average_at_start']:.1f} at the start, {meta['load_average_at_end']:.1f} "
        "at the end (other work on the machine slows every row)",
        f"- target: random Qwen2-style, hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads / "
        f"{m['kv_heads']} KV heads, intermediate {m['intermediate']}, vocab {m['vocab']}; assistant: its first "
        f"layer (same embeddings, norm, head); dtype {meta['dtype']}",
        f"- threads: transformers rows {meta['hf_threads']} (one process); pipespec one per node (two processes); "
        f"pipespec k = {meta['k']} constant, overlap on",
        f"- greedy, {meta['prompts']} random-token prompt(s) per length, {meta['max_new_tokens']} new tokens, no end "
        f"token; decode tok/s = tokens after the first ÷ time after the first token",
        f"- transformers assistant settings: {report.get('hf_settings') or '—'}",
        "",
        "| length | row | tok/s (end to end) | decode tok/s | first token s | α | rounds | ms per round after the "
        "first | pre-draft hits | busy: verifier / drafter | mismatches |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in meta["lengths"]:
        for key in ROWS:
            r = report["rows"][str(length)][key]
            busy = f"{r['verifier_busy']:.0%} / {r['drafter_busy']:.0%}" if "verifier_busy" in r else "—"
            lines.append(
                f"| {length} | {key} | {r['tok_s']:.2f} | {_fmt(r['decode_tok_s'])} | {r['first_token_s']:.2f} | "
                f"{_fmt(r.get('alpha'))} | {r.get('rounds', '—')} | {_fmt(r.get('round_ms'), '.1f')} | "
                f"{_fmt(r.get('predraft_hit_rate'))} | {busy} | {r['mismatches']} |")
    lines += ["", "| pipespec ÷ | " + " | ".join(str(n) for n in meta["lengths"]) + " | longest ÷ shortest |",
              "|---|" + "---:|" * (len(meta["lengths"]) + 1)]
    for name, v in report["ratios"].items():
        measure, ref = name.split(":")
        label = f"{ref}, {'decode' if measure == 'decode_tok_s' else 'end to end'}"
        lines.append(f"| {label} | " + " | ".join(_fmt(v["per_length"].get(n, v["per_length"].get(str(n))), ".2f", "×")
                                                       for n in meta["lengths"])
                     + f" | {_fmt(v['long_over_short'])} |")
    lines += ["", "Drafter per-block costs (assistant, median ms, in the transformers worker's process):", "",
              "| length | plain step | build rows | rows step (7 rows) | adopt a row |", "|---:|---:|---:|---:|---:|"]
    for length in meta["lengths"]:
        c = report["drafter_costs_ms"][str(length)]
        lines.append(f"| {length} | {c['plain_step']:.2f} | {c['build']:.3f} | {c['rows_step']:.2f} | "
                     f"{c['adopt']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 11/4 × hidden)")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 3000])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=1, help="random prompts per length")
    p.add_argument("--k", type=int, default=6, help="pipespec's constant draft length")
    p.add_argument("--hf-threads", type=int, default=1)
    p.add_argument("--hf-defaults", action="store_true",
                   help="transformers' own assistant settings (default: the same constant k as pipespec, no "
                        "confidence stop)")
    p.add_argument("--deep-scale", type=float, default=0.005,
                   help="scale of what the target's layers after the first write into the residual stream")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    p.add_argument("--_hf-worker", dest="hf_worker", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.hf_worker:
        return hf_worker(args.hf_worker)
    args.lengths = sorted(args.lengths)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pipespec-long-context-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        target, assistant = build_models(root / "models", args)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(target)
        log(f"models built in {time.perf_counter() - t0:.1f} s")
        ctx = {"target": target, "assistant": assistant, "k": args.k, "dtype": args.dtype,
               "hf_threads": args.hf_threads, "max_new_tokens": args.max_new_tokens, "hf_defaults": args.hf_defaults}
        meta = {"start": utc_now(), "machine": machine_info(),
                "dtype": args.dtype, "hf_threads": args.hf_threads, "k": args.k, "lengths": args.lengths,
                "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                          "intermediate": config.intermediate_size, "vocab": config.vocab_size}}
        meta["load_average_at_start"] = os.getloadavg()[0]
        log(f"machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; dtype {args.dtype}; "
            f"transformers rows at {args.hf_threads} thread(s), pipespec 1 thread per node")
        raw: dict[str, Any] = {}
        for length in args.lengths:  # interleaved: every row of one length, then the next
            prompts = random_prompts(config.vocab_size, length, args.prompts, args.seed)
            hf = run_hf(prompts, ctx, root)
            raw[str(length)] = {"hf": hf, "pipespec": asyncio.run(run_pipespec(prompts, ctx))}
    meta["load_average_at_end"] = os.getloadavg()[0]
    meta["end"] = utc_now()
    rows = {n: {key: summarize(key, raw[str(n)]["hf"][key] if key in HF_ROWS else raw[str(n)]["pipespec"],
                               raw[str(n)]["hf"]["hf-target"]) for key in ROWS} for n in args.lengths}
    report = {"meta": meta, "rows": {str(n): r for n, r in rows.items()}, "ratios": ratios(rows, args.lengths),
              "drafter_costs_ms": {str(n): raw[str(n)]["hf"]["drafter_costs_ms"] for n in args.lengths},
              "hf_settings": raw[str(args.lengths[0])]["hf"]["hf-assisted"]["settings"], "raw": raw}
    write_result(args.out / "long_context.json", report)
    write_markdown(args.out / "long_context.md", report)
    print((args.out / "long_context.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
