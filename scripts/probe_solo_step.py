#!/usr/bin/env python
"""ms per decoded token of the target stepping alone, four ways in one process, interleaved: the verifier's
``Session`` on the static and the dynamic KV backend (k = 0 rounds, as when the drafter cannot pay), a bare
``DynamicCache`` loop, and transformers ``generate``. Whether the verifier's step costs what transformers' step costs,
without the host's drift between separate runs::

    PYTHONPATH=. python scripts/probe_solo_step.py [--model qwen2.5-coder-1.5b-instruct] [--threads 2] [--reps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from shared.backend import DynamicBackend, StaticBackend
from shared.models import load_causal_lm, load_tokenizer, resolve_model, set_threads
from shared.sampling import GenerationParams
from verifier_node.session import Session


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="named model or folder")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=24, help="tokens timed per variant and repetition")
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    set_threads(args.threads)
    path = resolve_model(args.model)
    model = load_causal_lm(path, "cpu", args.dtype)
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function is_prime(n)."}],
                                           add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    n = args.tokens

    @torch.inference_mode()
    def bare() -> float:
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        t0 = time.perf_counter()
        for _ in range(n):
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1)
            token = int(out.logits[0, -1].argmax())
        return (time.perf_counter() - t0) / n

    def session(backend) -> float:
        params = GenerationParams.from_dict({"eos_token_ids": [], "max_new_tokens": n + 1}, 4096)
        s = Session(1, backend, tokenizer, prompt, params, b"probe", 1)
        s.prefill()
        steps, t0 = -1, 0.0
        while not s.finished:
            if steps == 0:
                t0 = time.perf_counter()  # after the first round (the prompt's last token), as in bare()
            plan = s.plan_round([], None)
            logits, _ = s.round_forward(plan)
            s.finish_round(plan, logits, None, 0.0)
            steps += 1
        s.close()
        return (time.perf_counter() - t0) / steps

    @torch.inference_mode()
    def generate() -> float:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=n + 1, do_sample=False)
        return ((time.perf_counter() - t1) - (t1 - t0)) / n  # the decode steps: minus the prefill's run

    static, dynamic = StaticBackend(model, 2, 2048), DynamicBackend(model)
    variants = {"session static": lambda: session(static), "session dynamic": lambda: session(dynamic),
                "bare loop": bare, "generate": generate}
    results: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps):
        for name, run in variants.items():
            results[name].append(run())
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {1000 * v[-1]:.1f}" for k, v in results.items()), flush=True)
    print(f"median ms per token ({args.model}, {args.dtype}, {args.threads} threads): "
          + ", ".join(f"{k} {1000 * statistics.median(v):.1f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
