"""pipespec on a small, fast target (the regime of a GPU), against transformers, over several consecutive runs.

Models are built on the spot (``benchmarks.models.build_random_pair``): a random Qwen2-style target (``--layers`` 8,
``--hidden`` 256 by default) whose later layers write only ``--deep-scale`` of their output into the residual
stream, and a 1-layer assistant cut from it, so acceptance is close to 1 while the target still pays for every
layer. float32, greedy, end tokens off, random prompts of ``--prompt-len`` tokens.

Rows, measured side by side in one invocation (each pipespec run is a fresh cluster, so each run re-plans from its
start-up profiles; the transformers rows run once per run too, interleaved with them):

- ``hf target``: transformers ``generate`` on the target alone, at every core (the reference of each run);
- ``hf assisted``: transformers assisted generation with the cut assistant, at every core;
- ``pipespec``: the ``cpu.yaml`` settings (``cost`` schedule, ``threads: auto``) with the two folders.

For each pipespec run the table shows tokens/s, the ratio to that run's ``hf target``, acceptance, τ (mean
committed tokens per round), rounds, and the per-round breakdown the verifier reports
(``metrics["round_timing"]``: forward, acceptance, publish, wait for the draft, idle), with the per-round overhead
over the bare forward. Outputs: ``--out`` (default ``results/``) ``fast_target.md`` and ``fast_target.json``.

    .venv/bin/python scripts/bench_fast_target.py                      # 5 runs, 256 tokens
    .venv/bin/python scripts/bench_fast_target.py --runs 1 --max-new-tokens 32 --out /tmp/ft   # a smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_info
from benchmarks.models import build_random_pair
from benchmarks.progress import log, utc_now
from benchmarks.results import write_result
from benchmarks.tables import header_lines, md_table

REPO_ROOT = Path(__file__).resolve().parent.parent


def hf_rows(target: Path, assistant: Path, prompt: list[int], max_new_tokens: int, threads: int) -> dict[str, Any]:
    """transformers on the target alone and assisted by the cut, at 1 thread and at ``threads`` threads: each the
    fastest of HF_REPEATS generations after a warm-up; each row keeps its faster thread count (the strongest
    transformers setup is the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    helper = AutoModelForCausalLM.from_pretrained(str(assistant), dtype=torch.float32).eval()
    for m in (model, helper):
        m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 1
    x = torch.tensor([prompt])
    out: dict[str, Any] = {}
    for name, extra in (("hf target", {}), ("hf assisted", {"assistant_model": helper})):
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            times, ids = [], None
            for _ in range(1 + HF_REPEATS):  # the first is a warm-up
                t0 = time.perf_counter()
                with torch.no_grad():
                    ids = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, **extra)
                times.append(time.perf_counter() - t0)
            best = min(times[1:])
            new = ids[0, len(prompt):].tolist()
            row = {"tokens_per_second": len(new) / best, "seconds": best, "token_ids": new, "threads": count}
            if name not in out or row["tokens_per_second"] > out[name]["tokens_per_second"]:
                out[name] = row
    torch.set_num_threads(threads)
    return out


#: Timed transformers generations per row and thread count (the fastest is kept).
HF_REPEATS = 3


async def pipespec_run(target: Path, assistant: Path, prompt: list[int], max_new_tokens: int,
                       overrides: list[str]) -> dict[str, Any]:
    from runtime.launchers import cluster

    config = REPO_ROOT / "configs" / "cpu.yaml"
    sets = [f"verifier.model={target}", f"drafter.model={assistant}", "verifier.dtype=float32",
            "drafter.dtype=float32", *overrides]
    params = {"max_new_tokens": max_new_tokens, "eos_token_ids": [], "do_sample": False}
    async with cluster(config, sets) as client:
        await client.generate(token_ids=prompt, **{**params, "max_new_tokens": 8})  # warm-up
        t0 = time.perf_counter()
        r = await client.generate(token_ids=prompt, **params)
        seconds = time.perf_counter() - t0
    return {"tokens_per_second": len(r.token_ids) / seconds, "seconds": seconds, "token_ids": r.token_ids,
            "metrics": r.metrics}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="consecutive runs (default 5)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--deep-scale", type=float, default=0.005)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="pipespec config override")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    return p


def _timing_cells(m: dict[str, Any]) -> list[str]:
    t = m.get("round_timing") or {}
    ms = t.get("ms_per_round") or {}
    keys = ("forward", "accept", "publish", "draft_wait", "other")
    return [f"{ms.get(k, 0.0):.2f}" for k in keys] + [f"{t.get('overhead_ms_per_round', 0.0):.2f}"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    threads = len(os.sched_getaffinity(0))
    started = utc_now()
    runs = []
    with tempfile.TemporaryDirectory(prefix="pipespec-fast-") as tmp:
        target, assistant = build_random_pair(
            Path(tmp), hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
            intermediate=args.hidden * 11 // 4, max_positions=4096, deep_scale=args.deep_scale, seed=args.seed)
        g = torch.Generator().manual_seed(args.seed + 1)
        prompt = torch.randint(2, 150, (args.prompt_len,), generator=g).tolist()
        for i in range(args.runs):
            hf = hf_rows(target, assistant, prompt, args.max_new_tokens, threads)
            ps = asyncio.run(pipespec_run(target, assistant, prompt, args.max_new_tokens, args.set))
            ps["speedup"] = ps["tokens_per_second"] / hf["hf target"]["tokens_per_second"]
            ps["vs_assisted"] = ps["tokens_per_second"] / hf["hf assisted"]["tokens_per_second"]
            ps["identical"] = ps["token_ids"] == hf["hf target"]["token_ids"]
            m = ps["metrics"]
            log(f"run {i + 1}: pipespec {ps['tokens_per_second']:.1f} tok/s = {ps['speedup']:.2f}x target alone "
                f"({hf['hf target']['tokens_per_second']:.1f}), {ps['vs_assisted']:.2f}x assisted "
                f"({hf['hf assisted']['tokens_per_second']:.1f}); acceptance {m['acceptance_rate']:.2f}, "
                f"tau {m['mean_accepted_length']:.2f}, {m['rounds']} rounds, plans {m.get('plans')}, "
                f"timing {m.get('round_timing')}, drafter {m.get('drafter_timing')}, plan rates {m.get('plan_rates')}")
            runs.append({"hf": {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in hf.items()},
                         "pipespec": {k: v for k, v in ps.items() if k != "token_ids"}})
    meta = {"machine": machine_info(), "start": started, "end": utc_now(),
            "command": "scripts/bench_fast_target.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "models": f"random Qwen2 target {args.layers} layers hidden {args.hidden} (deep_scale {args.deep_scale}), "
                      f"1-layer cut assistant, float32", "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "hf_threads": threads}
    args.out.mkdir(parents=True, exist_ok=True)
    write_result(args.out / "fast_target.json", {"meta": meta, "runs": runs})
    rows = []
    for i, r in enumerate(runs, 1):
        ps, m = r["pipespec"], r["pipespec"]["metrics"]
        rows.append([str(i), f"{r['hf']['hf target']['tokens_per_second']:.1f}",
                     f"{r['hf']['hf assisted']['tokens_per_second']:.1f}", f"{ps['tokens_per_second']:.1f}",
                     f"**{ps['speedup']:.2f}×**", f"{ps['vs_assisted']:.2f}×", f"{m['acceptance_rate']:.2f}",
                     f"{m['mean_accepted_length']:.2f}", str(m["rounds"]), *_timing_cells(m),
                     "yes" if ps["identical"] else "**no**"])
    lines = ["# pipespec on a small, fast target", "", *header_lines(meta), "",
             *md_table(["run", "hf target tok/s", "hf assisted tok/s", "pipespec tok/s", "÷ target", "÷ assisted",
                        "acceptance", "τ", "rounds", "forward ms", "accept ms", "publish ms", "draft wait ms",
                        "other ms", "overhead ms/round", "identical"], rows, "r" * 17), ""]
    (args.out / "fast_target.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
