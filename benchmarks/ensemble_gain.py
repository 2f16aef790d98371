"""Acceptance gain of static ensemble verification: the same prompts at ``verification.ensemble_weight`` = None
(lossless) and w (default 0.7), side by side — acceptance rate, τ (mean accepted length), tokens/s.

Each weight runs in its own cluster of real node processes (``runtime.launchers.cluster``) after one short warm-up
generation; prompts are the chat prompts of ``scripts/prompts/code_prompts.json`` (templated by the verifier),
greedy unless ``--do-sample``. Totals are over all prompts: acceptance = accepted / drafted tokens,
τ = 1 + accepted / drafts, tokens/s = new tokens / summed request time. ``differs`` counts prompts whose output is
not the lossless row's (ensemble is lossy by design: its output distribution is w·p + (1 − w)·q).

Usage::

    .venv/bin/python scripts/ensemble_gain.py                                 # 10 prompts, 128 tokens, None vs 0.7
    .venv/bin/python scripts/ensemble_gain.py --prompts 1 --max-new-tokens 24 # a quick smoke
    .venv/bin/python scripts/ensemble_gain.py --weights none,0.5,0.7,0.9 --json results/ensemble_gain.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.results import write_result

REPO_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_PROMPTS = REPO_ROOT / "scripts" / "prompts" / "code_prompts.json"
WARMUP_TOKENS = 8


def log(message: str) -> None:
    print(f"[ensemble_gain] {message}", file=sys.stderr, flush=True)


def load_prompts(path: Path | str | None, count: int) -> list[dict[str, Any]]:
    """The first ``count`` entries ``{id, messages}`` of a prompts file (default: the benchmark's code prompts)."""
    items = json.loads(Path(path or DEFAULT_PROMPTS).read_text(encoding="utf-8"))
    if count < 1 or count > len(items):
        raise ValueError(f"--prompts must be in 1..{len(items)}")
    return items[:count]


def parse_weight(text: str) -> float | None:
    return None if text.strip().lower() in ("none", "null", "off", "") else float(text)


async def run_weight(
    config: str, overrides: dict[str, Any], prompts: list[dict[str, Any]], max_new_tokens: int,
    weight: float | None, params: dict[str, Any],
) -> dict[str, Any]:
    from runtime.launchers import cluster

    label = "lossless" if weight is None else f"w={weight}"
    log(f"{label}: starting the nodes")
    per_prompt = []
    async with cluster(config, overrides={**overrides, "verification.ensemble_weight": weight}) as client:
        await client.generate(messages=prompts[0]["messages"], max_new_tokens=WARMUP_TOKENS, **params)
        for i, item in enumerate(prompts, 1):
            t0 = time.monotonic()
            r = await client.generate(messages=item["messages"], max_new_tokens=max_new_tokens, **params)
            m = r.metrics
            per_prompt.append({"id": item.get("id", str(i)), "token_ids": r.token_ids, "metrics": m})
            log(f"{label}: prompt {i}/{len(prompts)} {item.get('id', '')}: {m['new_tokens']} tokens in "
                f"{time.monotonic() - t0:.1f} s, acceptance {m['acceptance_rate']:.2f}, "
                f"τ {m['mean_accepted_length']:.2f}, {m['tokens_per_second']:.2f} tok/s")
    total = {key: sum(p["metrics"][key] for p in per_prompt)
             for key in ("new_tokens", "drafts", "draft_tokens", "accepted_tokens", "elapsed_s", "rounds")}
    return {
        "weight": weight,
        **total,
        "acceptance_rate": total["accepted_tokens"] / total["draft_tokens"] if total["draft_tokens"] else 0.0,
        "mean_accepted_length": 1 + total["accepted_tokens"] / total["drafts"] if total["drafts"] else 1.0,
        "tokens_per_second": total["new_tokens"] / total["elapsed_s"] if total["elapsed_s"] else 0.0,
        "per_prompt": per_prompt,
    }


async def measure(
    config: str, prompts: list[dict[str, Any]], max_new_tokens: int, weights: list[float | None],
    overrides: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per weight (in order); ``differs`` compares each row's outputs with the first lossless row's."""
    rows = [await run_weight(config, overrides or {}, prompts, max_new_tokens, w, params or {}) for w in weights]
    reference = next((r for r in rows if r["weight"] is None), None)
    for row in rows:
        if reference is not None:
            row["differs"] = sum(a["token_ids"] != b["token_ids"]
                                 for a, b in zip(row["per_prompt"], reference["per_prompt"]))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| weight | new tokens | acceptance | τ | tok/s | time s | differs from lossless |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = "None (lossless)" if r["weight"] is None else f"{r['weight']}"
        differs = "—" if r.get("differs") is None else f"{r['differs']}/{len(r['per_prompt'])}"
        lines.append(
            f"| {label} | {r['new_tokens']} | {r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | "
            f"{r['tokens_per_second']:.2f} | {r['elapsed_s']:.1f} | "
            f"{differs} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="cpu.yaml", help="config file or bare name in configs/ (default cpu.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--prompts", type=int, default=10, help="number of prompts from the start of the file")
    p.add_argument("--prompts-file", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--weights", default="none,0.7", help="comma list; 'none' = lossless (default none,0.7)")
    p.add_argument("--do-sample", action="store_true", help="sample (seeded per prompt) instead of greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows (with per-prompt metrics) to this file")
    args = p.parse_args(argv)

    from runtime.config import parse_overrides

    prompts = load_prompts(args.prompts_file, args.prompts)
    weights = [parse_weight(w) for w in args.weights.split(",")]
    params = {"do_sample": True, "seed": args.seed} if args.do_sample else {}
    rows = asyncio.run(measure(args.config, prompts, args.max_new_tokens, weights, parse_overrides(args.set),
                               params))
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"{'sampling' if args.do_sample else 'greedy'}, config {args.config}")
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, {"meta": {}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
