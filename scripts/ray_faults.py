"""What a placement takes and what a node failure costs on the Ray backend, measured on a multi-node Ray cluster on
this machine (``ray.cluster_utils.Cluster``: a head with no CPUs, two target hosts, one drafter host).

One run of pipespec (``launch.backend: ray``), then, each with ``--requests`` greedy requests in flight:

- ``drafter actor killed``: its process dies (``ray.kill``), Ray restarts it on its host;
- ``drafter host removed``: its host leaves the cluster; a new host joins after the requests end;
- ``verifier actor killed``: Ray restarts it on its host;
- ``verifier host removed``: its host leaves; Ray restarts it on the other target host.

For each: requests that failed and requests whose tokens differ from a run without faults (greedy), seconds until a
request is served again, until the drafter is back in the pool, and whether the verifier's address changed.

    .venv/bin/python scripts/ray_faults.py                                   # tiny random models, about 2 minutes
    .venv/bin/python scripts/ray_faults.py --target qwen2.5-coder-1.5b-instruct \\
        --drafter qwen2.5-coder-0.5b-instruct --dtype bfloat16 --threads 1  # the real pair

Writes ``--out`` (default ``results/ray_faults``): ``ray_faults.md`` and ``ray_faults.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import machine_info
from benchmarks.progress import log, utc_now
from benchmarks.tables import md_table

HOSTS = {
    "target": {"num_cpus": 1, "resources": {"gpu_host": 1}},
    "target-spare": {"num_cpus": 1, "resources": {"gpu_host": 1}},
    "draft": {"num_cpus": 1, "resources": {"cpu_host": 1}},
}
PROMPTS = [[5, 17, 33, 2, 60], [7, 8, 9], [100, 3, 44, 12], [9, 9, 1, 4], [61, 62, 63]]


def _config(args: argparse.Namespace, target: str, drafter: str) -> dict[str, Any]:
    node = {"dtype": args.dtype, "threads": args.threads, "profile_s": 0}
    return {"verifier": {"model": target, **node, "placement": {"resources": {"gpu_host": 1}}},
            "drafter": {"model": drafter, **node, "draft_schedule": "constant",
                        "placement": {"resources": {"cpu_host": 1}}},
            "client": {"timeout_s": 300}, "launch": {"backend": "ray", "ready_timeout_s": 900, "max_restarts": -1}}


async def _since(t0: float, wait: Any) -> float:
    """Seconds from ``t0`` (monotonic) until ``wait`` is done."""
    await wait
    return time.monotonic() - t0


async def _in_turn(first: Any, then: Any) -> None:
    """``first`` (a task, or None), then ``then``."""
    if first is not None:
        await first
    await then


async def measure(args: argparse.Namespace, target: str, drafter: str) -> dict[str, Any]:
    from runtime.launch import cluster
    from testkit.ray_hosts import RayHosts, live_drafters, until_drafters, until_served

    hosts = RayHosts(HOSTS)
    log(f"Ray cluster: head + {len(HOSTS)} hosts up in {hosts.up_s:.1f} s")
    out: dict[str, Any] = {"cluster_up_s": hosts.up_s, "scenarios": []}
    try:
        t0 = time.monotonic()
        async with cluster(_config(args, target, drafter)) as client:
            out["placement_group_s"] = client.cluster.placed_s
            out["ready_s"] = time.monotonic() - t0
            log(f"placement group reserved in {client.cluster.placed_s * 1000:.1f} ms; every node serving "
                f"{out['ready_s']:.1f} s after the start")
            reference = [r.token_ids for r in await asyncio.gather(*(
                client.generate(token_ids=p, max_new_tokens=args.max_new_tokens, eos_token_ids=[])
                for p in PROMPTS[: args.requests]))]

            def actor(name: str) -> Any:
                return hosts.ray.get_actor(client.cluster.status()["nodes"][name]["actor"], namespace="pipespec")

            async def kill(name: str) -> None:
                hosts.ray.kill(actor(name), no_restart=False)

            def host_of(name: str) -> str:
                node_id = client.cluster.status()["nodes"][name]["node_id"]
                return next(h for h, n in hosts.nodes.items() if n.node_id == node_id)

            async def remove(name: str) -> None:
                hosts.remove(host_of(name))

            faults = [("drafter actor killed", lambda: kill("drafter"), None),
                      ("drafter host removed", lambda: remove("drafter"), "draft"),
                      ("verifier actor killed", lambda: kill("verifier"), None),
                      ("verifier host removed", lambda: remove("verifier"), "target")]
            for name, fault, re_add in faults:
                await until_drafters(client, 1, timeout_s=600)
                before = client.address
                # a drafter fault: the one that comes back is another (the verifier counts the old one as alive
                # until its heartbeat times out); a verifier fault: the new verifier knows no drafter yet
                old_drafters = await live_drafters(client) if name.startswith("drafter") else set()
                requests = [asyncio.create_task(client.generate(token_ids=p, max_new_tokens=args.max_new_tokens,
                                                                eos_token_ids=[]))
                            for p in PROMPTS[: args.requests]]
                await asyncio.sleep(args.fault_after_s)
                t_fault = time.monotonic()

                await fault()
                verifier_fault = name.startswith("verifier")
                # measured beside the requests in flight: when a request is served again (a verifier fault; a
                # drafter fault never stops serving), when a drafter is back in the pool (a removed drafter host:
                # only once a new host joins, after the requests)
                served = asyncio.create_task(_since(t_fault, until_served(
                    client, {"token_ids": PROMPTS[0], "max_new_tokens": 4, "eos_token_ids": []}))) \
                    if verifier_fault else None
                # after a verifier fault, only the new verifier's pool counts (the dying one still answers a moment)
                back = asyncio.create_task(_since(t_fault, _in_turn(
                    served, until_drafters(client, 1, timeout_s=600, besides=old_drafters)))) \
                    if re_add != "draft" else None
                results = await asyncio.gather(*requests, return_exceptions=True)
                done_s = time.monotonic() - t_fault
                served_s = await served if served is not None else None
                after_add_s = None
                if back is None:
                    hosts.add(re_add)  # a new host joins once the requests are over
                    t_add = time.monotonic()
                    await until_drafters(client, 1, timeout_s=600, besides=old_drafters)
                    after_add_s = time.monotonic() - t_add
                    back_s = time.monotonic() - t_fault
                else:
                    back_s = await back
                if re_add == "target" and re_add not in hosts.nodes:
                    hosts.add(re_add)  # the spare target host for later runs of the loop
                row = {"scenario": name, "requests": len(results),
                       "failed": sum(isinstance(r, BaseException) for r in results),
                       "wrong_tokens": sum(not isinstance(r, BaseException) and r.token_ids != ref
                                           for r, ref in zip(results, reference)),
                       "requests_done_s": done_s, "served_again_s": served_s, "drafter_back_s": back_s,
                       "drafter_back_after_host_added_s": after_add_s,
                       "verifier_moved": client.address != before}
                log(f"{name}: {row['failed']} of {row['requests']} requests failed, {row['wrong_tokens']} wrong; "
                    f"served again after {_fmt(served_s)} s, drafter in the pool after {back_s:.1f} s")
                out["scenarios"].append(row)
            out["events"] = client.cluster.status()["events"]
    finally:
        hosts.shutdown()
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def write(out_dir: Path, result: dict[str, Any], args: argparse.Namespace, command: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ray_faults.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    m = result["machine"]
    lines = ["# pipespec on Ray: placement and failure costs", "",
             f"- date: {result['date']}; machine: {m.get('cpu')}, {m.get('cores')} cores; models: target "
             f"`{result['target']}`, drafter `{result['drafter']}`, {args.dtype}, {args.threads} thread(s) per node",
             f"- command: `{command}`",
             f"- Ray cluster (head + 3 hosts) up in {result['cluster_up_s']:.1f} s; placement group reserved in "
             f"{result['placement_group_s'] * 1000:.1f} ms; every node serving {result['ready_s']:.1f} s after the "
             "start (actor processes, imports, model load)",
             f"- each scenario: {args.requests} greedy requests of {args.max_new_tokens} tokens in flight, the fault "
             f"{args.fault_after_s} s after they start; seconds counted from the fault, each measured beside the "
             "requests in flight; served again: after a verifier fault (a drafter fault never stops serving); "
             "a removed drafter host: a new one joins once the requests ended", ""]
    columns = ["scenario", "requests failed", "tokens differ", "requests ended after s", "served again after s",
               "drafter in the pool after s", "… after a new host joined, s", "verifier address moved"]
    rows = [[r["scenario"], f"{r['failed']} of {r['requests']}", str(r["wrong_tokens"]), _fmt(r["requests_done_s"]),
             _fmt(r["served_again_s"]), _fmt(r["drafter_back_s"]), _fmt(r["drafter_back_after_host_added_s"]),
             _fmt(r["verifier_moved"])] for r in result["scenarios"]]
    lines += md_table(columns, rows, "lrrrrrrl")
    (out_dir / "ray_faults.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model (default: a tiny random model built here)")
    p.add_argument("--drafter", help="draft model (default: a tiny random model built here)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=3, choices=range(1, len(PROMPTS) + 1), metavar="N")
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--fault-after-s", type=float, default=0.3)
    p.add_argument("--out", default="results/ray_faults")
    args = p.parse_args(argv)
    target, drafter = args.target, args.drafter
    if target is None or drafter is None:
        from testkit.tiny_models import build_model, build_tokenizer

        root = Path(tempfile.mkdtemp(prefix="pipespec-ray-faults-"))
        build_tokenizer(root / "tok")
        target = target or str(build_model(root / "target", "llama", root / "tok", seed=1, layers=2))
        drafter = drafter or str(build_model(root / "drafter", "llama", root / "tok", seed=2, layers=1))
    result = asyncio.run(measure(args, target, drafter))
    result.update(date=utc_now(), machine=machine_info(), target=target, drafter=drafter)
    write(Path(args.out), result, args, " ".join(["python scripts/ray_faults.py", *(argv or sys.argv[1:])]))
    log(f"wrote {args.out}/ray_faults.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
