"""One session's decode path against transformers' ``generate``, in one process (no nodes, no sockets): the target
alone, greedy, the same prompt, at a fixed thread count. Prints, per repetition, ``generate``'s time for
``--max-new-tokens``, a bare prefill forward with and without an attention mask, ``CachedLM.feed`` (prefill plus
one-token steps, the verifier's cache path) and ``Session.verify`` rounds without drafts (the verifier's round),
each checked token for token against ``generate``. Used to tell a slow code path from a slow host: on the 2-core
AVX2 VM all three took 24–27 s for 32 tokens of the 1.5B model (docs/benchmarks.md, "Concurrency").

    .venv/bin/python scripts/bench_one_session.py --model qwen2.5-coder-1.5b-instruct --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a named model or a path")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-file", default=str(REPO / "scripts/prompts/code_prompts.json"))
    args = p.parse_args(argv)

    import torch

    from benchmarks.prompts import chat_prompts  # the benchmarks' templating, as the verifier templates messages
    from shared.kv import CachedLM
    from shared.models import load_causal_lm, load_tokenizer, set_threads
    from shared.sampling import GenerationParams
    from verifier_node.session import Session
    from weights import resolve_model

    set_threads(args.threads)
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, "cpu", args.dtype)
    ids = chat_prompts(tok, [json.loads(Path(args.prompt_file).read_text())[0]["messages"]])[0]["ids"]
    n = args.max_new_tokens
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads, attention "
          f"{model.config._attn_implementation}, prompt {len(ids)} tokens, {n} new tokens", flush=True)

    def generate() -> tuple[float, list[int]]:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
        return time.perf_counter() - t0, out[0, len(ids):].tolist()

    def prefill(mask: bool) -> float:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=x, logits_to_keep=1, **({"attention_mask": torch.ones_like(x)} if mask else {}))
        return time.perf_counter() - t0

    def cached() -> tuple[float, list[float], list[int]]:
        lm, t0 = CachedLM(model), time.perf_counter()
        lm.feed(ids[:-1], last_logits_only=True)
        tp, steps, last, out = time.perf_counter() - t0, [], ids[-1], []
        for _ in range(n):
            t = time.perf_counter()
            logits, _ = lm.feed([last])
            last = int(logits[-1].argmax())
            out.append(last)
            steps.append(time.perf_counter() - t)
        return tp, steps, out

    def rounds() -> tuple[float, list[float], list[int]]:
        s = Session(1, model, tok, ids, GenerationParams(max_new_tokens=n, do_sample=False), b"c", 1)
        t0 = time.perf_counter()
        s.prefill()
        tp, steps = time.perf_counter() - t0, []
        while not s.finished:
            t = time.perf_counter()
            s.verify([], None)
            steps.append(time.perf_counter() - t)
        return tp, steps, s.generated

    generate()  # warm-up
    for _ in range(args.repeats):
        g, ref = generate()
        print(f"generate: {g:.2f} s", flush=True)
        print(f"bare prefill: {prefill(True):.2f} s with a mask, {prefill(False):.2f} s without", flush=True)
        for name, fn in (("CachedLM.feed", cached), ("Session.verify", rounds)):
            tp, steps, out = fn()
            print(f"{name}: prefill {tp:.2f} s, steps mean {statistics.mean(steps):.3f} s, total "
                  f"{tp + sum(steps):.2f} s, same tokens as generate: {out[:len(ref)] == ref}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
