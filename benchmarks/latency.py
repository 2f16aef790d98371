"""pipespec's speed against the latency of the link between its verifier and its drafter.

The two nodes run on two "hosts": Linux network namespaces joined by a veth pair (``testkit/netns.py``; needs root
and iproute2), over tcp with CURVE (``security.curve: auto``, keys from ``runtime.keys`` in a temporary folder), with
``runtime.delay_proxy`` in the drafter's namespace adding a fixed one-way delay (``--delays``, ms; a round trip gains
twice that). The client talks to the verifier over ipc, so only the verifier ↔ drafter link is delayed.

Models are built on the spot (no download), as in ``scripts/bench_long_context.py``: a random Qwen2-style target
(``--hidden``, ``--layers``) and a 1-layer assistant cut from it that agrees with it on most tokens. Rows:

- ``target alone``: transformers ``generate`` on the target, at 1 thread and at every core (the reference);
- at each delay, pipespec with the ``cost`` schedule (as shipped: the plan follows the measured round trip) and
  with a fixed block (``constant`` k = ``--k``, overlap on); one thread per node, float32, greedy.

Each row decodes the same random prompts (``--prompts`` × ``--max-new-tokens``, end tokens off) after one warm-up
request; tok/s is new tokens over the client's request time, summed over the prompts. Outputs: ``--out``
(default ``results/``) ``latency.md`` and ``latency.json``.

    sudo .venv/bin/python scripts/bench_latency.py                       # 0, 1, 5, 20 ms
    sudo .venv/bin/python scripts/bench_latency.py --hidden 256 --layers 4 --prompts 1 --delays 0,20
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
from benchmarks.tables import header_lines
from testkit.netns import NetnsError, NetnsPair, delay_proxy, netns_pair

REPO_ROOT = Path(__file__).resolve().parent.parent

VERIFIER_PORT, PROXY_PORT = 5555, 6555


def build_models(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """Save a random Qwen2-style target and its 1-layer cut into ``root`` (see
    ``benchmarks.models.build_random_pair``)."""
    return build_random_pair(root, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                             intermediate=args.hidden * 11 // 4, max_positions=1024, deep_scale=args.deep_scale,
                             seed=args.seed)


def random_prompts(vocab: int, args: argparse.Namespace) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]


def run_reference(target: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """transformers ``generate`` on the target alone, at 1 thread and at every core."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    config = model.generation_config
    config.eos_token_id, config.pad_token_id, config.do_sample = [], 1, False
    rows = {}
    for threads in sorted({1, len(os.sched_getaffinity(0))}):
        torch.set_num_threads(threads)
        outputs, spent, tokens = [], 0.0, 0
        for i, ids in enumerate([prompts[0], *prompts]):  # the first is a warm-up
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config,
                                     max_new_tokens=args.max_new_tokens)
            elapsed = time.perf_counter() - t0
            if i:
                outputs.append(out[0, len(ids):].tolist())
                spent += elapsed
                tokens += len(outputs[-1])
        rows[f"target alone, {threads} thread{'s' if threads > 1 else ''}"] = {
            "tokens_per_second": tokens / spent, "outputs": outputs, "threads": threads}
        log(f"target alone, {threads} thread(s): {tokens / spent:.2f} tok/s")
    return rows


def pipespec_config(target: Path, assistant: Path, keys: Path, net: NetnsPair, schedule: str,
                    args: argparse.Namespace) -> dict[str, Any]:
    drafter = {"type": "assistant", "model": str(assistant), "dtype": "float32", "threads": 1,
               "profile_s": args.profile_s, "verifier_endpoint": f"tcp://{net.b}:{PROXY_PORT}",
               "draft_schedule": schedule}
    if schedule == "constant":
        drafter.update(num_draft_tokens=args.k, overlap=True)
    return {
        "verifier": {"model": str(target), "dtype": "float32", "threads": 1, "profile_s": args.profile_s,
                     "endpoint": f"tcp://{net.a}:{VERIFIER_PORT}"},
        "drafter": drafter,
        "client": {"timeout_s": 600},
        "launch": {"ready_timeout_s": 300},
        "security": {"curve": "auto", "keys_dir": str(keys)},
    }


async def run_pipespec(config: dict[str, Any], net: NetnsPair, prompts: list[list[int]],
                       args: argparse.Namespace) -> dict[str, Any]:
    from runtime.launchers import cluster

    params = {"max_new_tokens": args.max_new_tokens, "eos_token_ids": [], "do_sample": False}
    async with cluster(config, prefix={"verifier": net.exec("a"), "drafter": net.exec("b")}) as client:
        await client.generate(token_ids=prompts[0], **params)  # warm-up
        outputs, metrics, spent = [], [], 0.0
        for ids in prompts:
            t0 = time.perf_counter()
            r = await client.generate(token_ids=ids, **params)
            spent += time.perf_counter() - t0
            outputs.append(r.token_ids)
            metrics.append(r.metrics)
    tokens = sum(len(o) for o in outputs)
    drafted = sum(m["draft_tokens"] for m in metrics)
    plans: dict[str, int] = {}
    for m in metrics:
        for name, count in (m.get("plans") or {}).items():
            plans[name] = plans.get(name, 0) + count
    return {
        "tokens_per_second": tokens / spent, "outputs": outputs,
        "acceptance_rate": sum(m["accepted_tokens"] for m in metrics) / drafted if drafted else None,
        "rounds": sum(m["rounds"] for m in metrics), "solo_rounds": sum(m.get("solo_rounds", 0) for m in metrics),
        "plans": plans, "draft_transit_ms": sum(m["draft_transit_ms"] or 0 for m in metrics) / len(metrics),
    }


def write_reports(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "latency.json", report)
    ref_key = next(k for k in report["reference"] if k.endswith(" 1 thread"))
    ref = report["reference"][ref_key]
    best = max(r["tokens_per_second"] for r in report["reference"].values())
    lines = ["# pipespec against link latency (verifier and drafter in two network namespaces, tcp + CURVE)", "",
             *header_lines(report["meta"]),
             f"- load average (1 min) at the start / end: {report['meta']['load'][0]:.2f} / "
             f"{os.getloadavg()[0]:.2f} (anything above 0 is other work on the same cores)", "",
             "| row | added one-way latency | tok/s | ÷ target alone, 1 thread | ÷ fastest target alone | α "
             "| rounds (alone) | plans | draft transit ms | output = target alone |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for key, r in report["reference"].items():
        same = "ref" if key == ref_key else f"{sum(a == b for a, b in zip(r['outputs'], ref['outputs']))}/" \
                                            f"{len(ref['outputs'])}"
        lines.append(f"| transformers, {key} | — | {r['tokens_per_second']:.2f} | "
                     f"{r['tokens_per_second'] / ref['tokens_per_second']:.2f}× | "
                     f"{r['tokens_per_second'] / best:.2f}× | — | — | — | — | {same} |")
    for row in report["rows"]:
        r = row["result"]
        if "error" in r:
            lines.append(f"| pipespec, `{row['schedule']}` | {row['delay_ms']:g} ms | failed: {r['error'][:80]} "
                         "| | | | | | | |")
            continue
        same = sum(a == b for a, b in zip(r["outputs"], ref["outputs"]))
        plans = ", ".join(f"{k} {v}" for k, v in r["plans"].items()) or "—"
        alpha = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "—"
        lines.append(f"| pipespec, `{row['schedule']}` | {row['delay_ms']:g} ms | {r['tokens_per_second']:.2f} | "
                     f"{r['tokens_per_second'] / ref['tokens_per_second']:.2f}× | "
                     f"{r['tokens_per_second'] / best:.2f}× | {alpha} | {r['rounds']} ({r['solo_rounds']}) | "
                     f"{plans} | {r['draft_transit_ms']:.1f} | {same}/{len(ref['outputs'])} |")
    lines += ["", "`draft transit ms`: mean time from a draft's send to the verifier reading it: the added one-way "
              "latency, the link's own, and the wait while the verifier is still computing the previous round (and, "
              "on a loaded host, descheduled). `rounds (alone)`: verification rounds, and those the plan gave to the "
              "verifier alone (k = 0). `plans`: the cost schedule's choices per planning step."]
    (out / "latency.md").write_text("\n".join(lines) + "\n")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", default="0,1,5,20", help="added one-way latencies in ms (comma-separated)")
    p.add_argument("--schedules", default="cost,constant", help="pipespec rows per delay")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--deep-scale", type=float, default=0.005, help="how much the cut's missing layers write")
    p.add_argument("--k", type=int, default=4, help="block length of the constant rows")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--profile-s", type=float, default=5, help="start-up cost profile budget per node (cached)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    delays = [float(d) for d in args.delays.split(",") if d.strip()]
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    meta = {"start": utc_now(), "machine": machine_info(), "load": os.getloadavg(),
            "models": f"random Qwen2-style target (hidden {args.hidden}, {args.layers} layers) + its 1-layer cut; "
                      f"{args.prompts} random prompts of {args.prompt_len} tokens × {args.max_new_tokens} new tokens, "
                      "greedy",
            "dtypes": "float32", "threads": "one per pipespec node; the reference at 1 thread and at every core"}
    from runtime.keys import init

    with tempfile.TemporaryDirectory(prefix="pipespec-latency-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("PIPESPEC_PROFILE_DIR", str(root / "profiles"))
        target, assistant = build_models(root, args)
        from transformers import AutoConfig

        prompts = random_prompts(AutoConfig.from_pretrained(str(target)).vocab_size, args)
        reference = run_reference(target, prompts, args)
        init(root / "keys", clients=["client"], drafters=["drafter"])
        report = {"meta": meta, "args": {k: str(v) for k, v in vars(args).items()}, "reference": reference,
                  "rows": []}
        try:
            with netns_pair() as net:
                for delay in delays:
                    for schedule in schedules:
                        config = pipespec_config(target, assistant, root / "keys", net, schedule, args)
                        with delay_proxy(net, "b", f"{net.b}:{PROXY_PORT}", f"{net.a}:{VERIFIER_PORT}", delay):
                            try:
                                result = asyncio.run(run_pipespec(config, net, prompts, args))
                            except Exception as exc:  # one failed row must not lose the others
                                result = {"error": f"{type(exc).__name__}: {exc}"}
                        report["rows"].append({"delay_ms": delay, "schedule": schedule, "result": result})
                        tps = result.get("tokens_per_second")
                        log(f"pipespec {schedule} @ {delay:g} ms: "
                            + (f"{tps:.2f} tok/s" if tps else result.get("error", "?")))
                        meta["end"] = utc_now()
                        write_reports(args.out, report)
        except NetnsError as exc:
            print(f"bench_latency: {exc}", file=sys.stderr)
            return 2
    print((args.out / "latency.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
