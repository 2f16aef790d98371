#!/usr/bin/env python
"""ms per single-token decode step of a small random Qwen2 (8 layers, hidden 256: the regime where Python overhead
dominates) on a dynamic cache, eager static slots and the compiled step (``backend: compiled``), with the compile
time per bucket; and ms per step of a drafter's pre-drafted outcome rows (4 rows of one block, flattened into the
session's slot: :class:`drafter_node.branches.Branches`) on eager static slots and the compiled step. One thread;
run it niced on a shared machine::

    PYTHONPATH=. nice -n 19 python scripts/bench_compiled_step.py [--mode max-autotune-no-cudagraphs]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from drafter_node.base import DraftToken
from drafter_node.branches import Branches
from shared.backend import CompiledBackend, StaticBackend
from shared.kv import CachedLM


def step_ms(lm, prefix: list[int], steps: int, reps: int) -> float:
    """Median over ``reps`` of the mean ms of ``steps`` one-token decode steps after ``prefix``."""
    lm.feed(prefix, last_logits_only=True)
    runs = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        for i in range(steps):
            lm.feed([3 + i])
        if rep:
            runs.append(1000 * (time.perf_counter() - t0) / steps)
        lm.crop(len(prefix))
    return statistics.median(runs)


def rows_step_ms(backend, prefix: list[int], reps: int, depth: int = 6) -> float:
    """Median over ``reps`` of the mean ms of a pre-draft step of 4 outcome rows of a 5-token block after ``prefix``
    (through ``backend.feed_rows``, as the drafter node runs them), ``depth`` steps deep."""
    block, rows = [11, 12, 13, 14, 15], [(5, 40), (4, 41), (3, 42), (2, 43)]
    lm = backend.open()
    lm.feed(prefix + block, last_logits_only=True)

    def greedy(logits, contexts):
        return [DraftToken(int(row.argmax())) for row in logits]

    runs = []
    for rep in range(reps + 1):
        branches = Branches(backend, lm, len(prefix), block, rows)
        t0 = time.perf_counter()
        for _ in range(depth):
            step = branches.batch_step(greedy)
            step.finish(backend.feed_rows(step.rows))
        if rep:
            runs.append(1000 * (time.perf_counter() - t0) / depth)
        branches.discard(lm)
    lm.close()
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default=None, help="torch.compile mode (default: None, inductor's default)")
    p.add_argument("--buckets", default="1,2,4,8,16")
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--slot-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    prefix = torch.randint(2, 1000, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    compiled = CompiledBackend(model, 2, args.slot_tokens, buckets, mode=args.mode)  # a slot for each measurement
    compiled.warm_up()
    ms = {"dynamic": step_ms(CachedLM(model), prefix, args.steps, args.reps),
          "static": step_ms(StaticBackend(model, 1, args.slot_tokens).open(), prefix, args.steps, args.reps),
          "compiled": step_ms(compiled.open(), prefix, args.steps, args.reps)}
    print(f"mode {args.mode}; prefix {args.prefix}, slot {args.slot_tokens}; ms per 1-token step: "
          + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    rows = {"static": rows_step_ms(StaticBackend(model, 1, args.slot_tokens), prefix, args.reps),
            "compiled": rows_step_ms(compiled, prefix, args.reps)}
    print("ms per pre-draft step of 4 outcome rows: " + ", ".join(f"{k} {v:.2f}" for k, v in rows.items()))
    print("compile s per bucket: " + ", ".join(f"{b}: {s:.1f}" for b, s in compiled.compile_s.items())
          + (f"; FAILED: {compiled.failure}" if compiled.failure else ""))


if __name__ == "__main__":
    main()
