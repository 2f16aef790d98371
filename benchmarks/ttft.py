"""Time to first token of one long prompt: pipespec with a config against transformers' own prefill of the same
prompt on the same cores.

The prompt is ``--length`` token ids: random ids of the target's vocabulary (``--seed``), or the tokens of
``--prompt-file`` tiled to that length. Rows, interleaved per repetition (``--reps``), greedy, ``--max-new-tokens``
new tokens, end tokens off, one short warm-up each:

- ``hf-target``: transformers ``generate`` on the config's target (``verifier.model``) in one subprocess at
  ``--hf-threads`` threads (default 2), in the dtype the verifier chose (from its metrics; ``--dtype`` to force);
  its first token is timed with a streamer: the prefill and the first token's logits;
- ``pipespec``: ``runtime.launchers.cluster`` with the config (``--set`` overrides, as the CLI's); its first token is
  the verifier's ``time_to_first_token_s``, the request time the client's.

The result is the first-token ratio pipespec ÷ hf-target (≤ 1.0: the prefill costs no more than the target's own)
and the end-to-end ratio. Outputs in ``--out`` (default ``results/``): ``ttft.md`` and ``ttft.json``.

Usage::

    .venv/bin/python scripts/bench_ttft.py --config configs/cpu.yaml --length 1500
    .venv/bin/python scripts/bench_ttft.py --config configs/gguf.yaml --length 1500 --max-new-tokens 64 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import progress
from benchmarks.long_context import FirstTokenTimer
from benchmarks.progress import log, utc_now
from benchmarks.results import write_result
from benchmarks.workers import run_script_worker

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "bench_ttft.py"  # its one-job worker runs the script with --_hf-worker
WARMUP_PROMPT = 32
WARMUP_TOKENS = 4


def make_prompt(tokenizer: Any, vocab: int, length: int, seed: int, prompt_file: Path | None) -> list[int]:
    """``length`` token ids: ``prompt_file``'s tokens tiled, else random ids below ``vocab`` (the target's)."""
    if length < 2:
        raise SystemExit("--length must be at least 2")
    if prompt_file is not None:
        ids = tokenizer(prompt_file.read_text(), add_special_tokens=False)["input_ids"]
        if not ids:
            raise SystemExit(f"--prompt-file {prompt_file} has no tokens")
        return (ids * (length // len(ids) + 1))[:length]
    import torch

    gen = torch.Generator().manual_seed(seed)
    high = min(len(tokenizer), vocab, 30_000)  # ids past the special tokens of a large vocabulary; any id of a tiny one
    return torch.randint(min(100, high // 2), high, (length,), generator=gen).tolist()


def hf_worker(job_path: Path) -> int:
    """Subprocess body: transformers' rows (warm-up, then each repetition) on the target alone."""
    job = json.loads(job_path.read_text())
    progress.set_start(job["start"])
    import torch
    import transformers

    from shared.models import load_causal_lm, set_threads

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    set_threads(job["threads"])
    model = load_causal_lm(job["model"], "cpu", job["dtype"])
    config = model.generation_config
    config.eos_token_id, config.pad_token_id, config.do_sample = [], 0, False
    for key in ("temperature", "top_p", "top_k"):
        setattr(config, key, None)

    def generate(ids: list[int], new: int, streamer: Any = None) -> list[int]:
        input_ids = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=config, max_new_tokens=new, min_new_tokens=new, streamer=streamer)
        return out[0, len(ids):].tolist()

    generate(job["prompt"][:WARMUP_PROMPT], WARMUP_TOKENS)
    runs = []
    for rep in range(job["reps"]):
        timer = FirstTokenTimer()
        t0 = time.perf_counter()
        tokens = generate(job["prompt"], job["max_new_tokens"], timer)
        elapsed = time.perf_counter() - t0
        runs.append({"token_ids": tokens, "time_s": elapsed, "first_token_s": (timer.first_at or t0) - t0})
        log(f"hf-target rep {rep + 1}: first token {runs[-1]['first_token_s']:.2f} s, {len(tokens)} tokens in "
            f"{elapsed:.2f} s")
    Path(job["out"]).write_text(json.dumps(runs))
    return 0


async def run_pipespec(config: str, overrides: list[str], prompt: list[int], new_tokens: int,
                       reps: int) -> list[dict[str, Any]]:
    from runtime.launchers import cluster

    params = {"max_new_tokens": new_tokens, "eos_token_ids": [], "do_sample": False}
    runs = []
    async with cluster(config, overrides) as client:
        await client.generate(token_ids=prompt[:WARMUP_PROMPT], **(params | {"max_new_tokens": WARMUP_TOKENS}))
        for rep in range(reps):
            t0 = time.perf_counter()
            r = await client.generate(token_ids=prompt, **params)
            elapsed = time.perf_counter() - t0
            m = r.metrics
            runs.append({"token_ids": r.token_ids, "time_s": elapsed, "first_token_s": m["time_to_first_token_s"],
                         "metrics": m})
            log(f"pipespec rep {rep + 1}: first token {m['time_to_first_token_s']:.2f} s, {len(r.token_ids)} tokens "
                f"in {elapsed:.2f} s ({m.get('drafts', 0)} drafts, {m.get('rounds', 0)} rounds)")
    return runs


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {"first_token_s": statistics.median(r["first_token_s"] for r in runs),
            "time_s": statistics.median(r["time_s"] for r in runs),
            "new_tokens": statistics.median(len(r["token_ids"]) for r in runs)}


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    meta, rows = report["meta"], report["rows"]
    lines = ["# Time to first token: pipespec against the target's own prefill", "",
             f"- started {meta['start']}, {meta['machine']['cpu']}, {meta['machine']['cores']} cores; 1-minute load "
             f"average {meta['load_average_at_start']:.1f} at the start, {meta['load_average_at_end']:.1f} at the end",
             f"- config {meta['config']} {' '.join(meta['overrides'])}; target {meta['target']} ({meta['dtype']})",
             f"- prompt {meta['length']} tokens ({meta['prompt']}), {meta['max_new_tokens']} new tokens, greedy, "
             f"{meta['reps']} repetition(s), medians; transformers at {meta['hf_threads']} thread(s)", "",
             "| row | first token s | request s | new tokens |", "|---|---:|---:|---:|"]
    for key, r in rows.items():
        lines.append(f"| {key} | {r['first_token_s']:.2f} | {r['time_s']:.2f} | {r['new_tokens']:.0f} |")
    lines += ["", f"pipespec ÷ hf-target: first token {report['first_token_ratio']:.2f}×, request time "
                  f"{report['time_ratio']:.2f}× (≤ 1.0: no slower); outputs equal: {report['identical']}"]
    path.write_text("\n".join(lines) + "\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a pipespec config (configs/cpu.yaml, configs/gguf.yaml, ...); required")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides, as the CLI's --set")
    p.add_argument("--length", type=int, default=1500, help="prompt tokens")
    p.add_argument("--prompt-file", type=Path, default=None, help="text whose tokens are tiled to --length")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--hf-threads", type=int, default=2)
    p.add_argument("--dtype", default=None, help="transformers' dtype (default: the verifier's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    p.add_argument("--_hf-worker", dest="hf_worker", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.hf_worker:
        return hf_worker(args.hf_worker)
    if not args.config:
        raise SystemExit("--config is required (a pipespec config: configs/cpu.yaml, configs/gguf.yaml, ...)")
    from benchmarks.machine import machine_info
    from runtime.config import load_config
    from shared.models import load_tokenizer, resolve_model

    cfg = load_config(args.config, args.overrides)
    target = resolve_model(cfg["verifier"]["model"])
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target).vocab_size
    prompt = make_prompt(load_tokenizer(target), vocab, args.length, args.seed, args.prompt_file)
    meta = {"start": utc_now(), "machine": machine_info(), "config": str(args.config), "overrides": args.overrides,
            "target": cfg["verifier"]["model"], "length": args.length, "max_new_tokens": args.max_new_tokens,
            "reps": args.reps, "hf_threads": args.hf_threads, "load_average_at_start": os.getloadavg()[0],
            "prompt": str(args.prompt_file) if args.prompt_file else f"random ids, seed {args.seed}"}
    pipespec = asyncio.run(run_pipespec(args.config, args.overrides, prompt, args.max_new_tokens, args.reps))
    meta["dtype"] = args.dtype or pipespec[0]["metrics"].get("verifier_dtype") or "float32"
    with tempfile.TemporaryDirectory(prefix="pipespec-ttft-") as tmp:
        job = {"start": progress.start_time(), "threads": args.hf_threads, "model": target, "dtype": meta["dtype"],
               "prompt": prompt, "max_new_tokens": args.max_new_tokens, "reps": args.reps,
               "out": str(Path(tmp) / "hf.json")}
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        run_script_worker(SCRIPT, job_path, args.hf_threads, "hf worker")
        hf = json.loads(Path(job["out"]).read_text())
    meta["load_average_at_end"] = os.getloadavg()[0]
    rows = {"hf-target": summary(hf), "pipespec": summary(pipespec)}
    report = {"meta": meta, "rows": rows,
              "first_token_ratio": rows["pipespec"]["first_token_s"] / rows["hf-target"]["first_token_s"],
              "time_ratio": rows["pipespec"]["time_s"] / rows["hf-target"]["time_s"],
              "identical": all(a["token_ids"] == b["token_ids"] for a, b in zip(pipespec, hf)),
              "raw": {"hf-target": hf, "pipespec": pipespec}}
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(args.out / "ttft.json", report)
    write_markdown(args.out / "ttft.md", report)
    print((args.out / "ttft.md").read_text())
    return 0
