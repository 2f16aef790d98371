"""What rolling back a rejected draft costs on hybrid and state-space targets (shared/kv.py), against attention.

For each tiny family (Qwen3-Next, Mamba2, Falcon-H1, LFM2, and a Llama of the same width for attention only) on a
cached context of ``--context`` tokens: the verify forward of a round (``--k`` drafts + the pending token), and the
rollback after a rejection with ``a`` drafts accepted — for attention a crop (slicing), for recurrent state a restore
of the round's snapshot and a forward over the a + 1 kept tokens. Medians of ``--repeats`` rounds, float32, one
thread by default. The cost model charges the same re-feed (drafter_node.cost_model.rollback_s) from the target's
measured verify curve.

    python scripts/bench_rollback.py                     # tiny models, prints a table, writes results/rollback.json
    python scripts/bench_rollback.py --threads 2 --k 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.progress import utc_now
from benchmarks.results import write_result

ROOT = Path(__file__).resolve().parent.parent


def _median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def measure(model, context: int, k: int, accepted: int, repeats: int) -> dict[str, float]:
    """Verify-forward and rollback times (ms) of rounds of ``k`` drafts with ``accepted`` of them accepted."""
    from shared.kv import CachedLM

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(2, vocab, (context,), generator=g).tolist()
    verify, rollback = [], []
    lm = CachedLM(model)
    lm.feed(prompt[:-1])
    for _ in range(repeats + 1):  # the first round warms up
        base = lm.length
        fed = torch.randint(2, vocab, (k + 1,), generator=g).tolist()
        t0 = time.perf_counter()
        lm.feed(fed)
        t1 = time.perf_counter()
        lm.crop(base + 1 + accepted)  # the pending token and the accepted drafts stay
        t2 = time.perf_counter()
        lm.crop(base)  # back to the same context for the next round (not timed)
        verify.append(t1 - t0)
        rollback.append(t2 - t1)
    return {"verify_ms": _median_ms(verify[1:]), "rollback_ms": _median_ms(rollback[1:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "rollback.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from testkit.tiny_hybrid import HYBRID_FAMILIES, build_hybrid
    from testkit.tiny_models import build_model, build_tokenizer

    rows = []
    with tempfile.TemporaryDirectory(prefix="pipespec-rollback-") as tmp:
        root = Path(tmp)
        build_tokenizer(root / "tok")
        folders = {f: build_hybrid(root / f, f, root / "tok", seed=3) for f in HYBRID_FAMILIES}
        folders["llama (attention)"] = build_model(root / "llama", "llama", root / "tok", seed=3, layers=4)
        for name, folder in folders.items():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            for accepted in (0, args.k // 2, args.k - 1):
                row = {"model": name, "accepted": accepted,
                       **measure(model, args.context, args.k, accepted, args.repeats)}
                row["rollback_share"] = row["rollback_ms"] / row["verify_ms"]
                rows.append(row)
                print(f"{name:18s} a={accepted}  verify {row['verify_ms']:7.2f} ms  rollback {row['rollback_ms']:7.2f}"
                      f" ms  ({row['rollback_share']:.2f} of a verify forward)", flush=True)
    report = {"meta": {"date": utc_now(), "command": "python scripts/bench_rollback.py", "args": vars(args) | {
        "out": str(args.out)}, "dtype": "float32"}, "rows": rows}  # write_result adds the machine and git state
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, report)
    print(f"wrote {args.out}")
    return 0
