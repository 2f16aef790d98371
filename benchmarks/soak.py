"""A soak with faults: mixed HTTP load on pipespec running on a Ray cluster of several nodes on this machine, while
the drafter and then the verifier are killed (SIGKILL of the actor's process; Ray restarts it, the controller
serves the node again) every ``--fault-every-s`` seconds.

The cluster: ``ray.cluster_utils.Cluster`` (:class:`testkit.ray_hosts.RayHosts`): a head with no CPUs, a target host
and a drafter host. pipespec is started as a user starts it (``python -m runtime.launch --config X --http ...``
with ``launch.backend: ray`` and the cluster's address) with an API keys file naming two tenants. The load, each
client a thread looping until the end, every request with a client-side deadline (``--deadline-s``) so that a
request never answered is seen as lost:

- ``plain`` (tenant alpha): non-streamed completions;
- ``stream`` (one per tenant): streamed completions, their gaps between events timed;
- ``structured`` (tenants alternate): chat with a ``json_schema`` response format, a new schema each time;
- ``long`` (tenant alpha): a long prompt (``--long-words`` words), few new tokens;
- ``cancel`` (tenant beta): a stream hung up after a few events;
- ``slow`` (tenant alpha): a stream read one event per ``--slow-read-s`` on a small receive buffer.

Measured: each request's end (:mod:`benchmarks.soak_books`: completed, failed with a clear error, cancelled,
unclear, lost), each stream's longest gap, the resident memory of every process of the run every
``--sample-s`` (per process life: a restarted node is a new process), and per fault when the node served again.

    PYTHONPATH=. .venv/bin/python scripts/soak.py --duration-s 1800                 # tiny random models, 30 min
    PYTHONPATH=. .venv/bin/python scripts/soak.py --duration-s 240 --fault-every-s 80   # a short check

Writes ``--out`` (default ``results/soak``): ``soak.md`` and ``soak.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import random
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.progress import log
from benchmarks.soak_books import Outcome, classify_answer, classify_stream

#: The hosts of the Ray cluster (besides the head, which has no CPUs).
HOSTS = {
    "target": {"num_cpus": 1, "resources": {"target_host": 1}},
    "draft": {"num_cpus": 1, "resources": {"draft_host": 1}},
}
TENANTS = ("alpha", "beta")
PROMPTS = ["def fibonacci(n):\n    ", "The quick brown fox", "import numpy as np\n", "Once upon a time",
           "SELECT * FROM", "class Stack:\n    def push(self, x):"]
#: Seconds between the requests of one client (a little air, so the 2-core host is not only load).
PAUSE_S = (0.05, 0.4)


@dataclass
class Load:
    """What the clients share: where the server is, the tenants' keys, the clock, the outcomes."""

    port: int
    model: str
    keys: dict[str, str]
    t0: float
    until: float
    deadline_s: float
    long_words: int
    slow_read_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)


class _Deadline:
    """A request's client-side deadline: the socket timeout of each read is what is left of it."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("client deadline passed")
        return left


def _open(load: Load, path: str, body: dict[str, Any], tenant: str, deadline: _Deadline,
          rcvbuf: int | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", load.port, timeout=deadline.left())
    if rcvbuf:
        conn.connect()
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {load.keys[tenant]}"})
    return conn, conn.getresponse()


def one_answer(load: Load, kind: str, tenant: str, path: str, body: dict[str, Any],
               keys: list[str] | None = None) -> Outcome:
    """A non-streamed request, judged by :func:`classify_answer`."""
    start, deadline = load.now(), _Deadline(load.deadline_s)
    status, raw, note = None, b"", ""
    conn = None
    try:
        conn, resp = _open(load, path, body, tenant, deadline)
        status = resp.status
        conn.sock.settimeout(deadline.left())
        raw = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        note = f" ({type(exc).__name__})"
        if status is not None:  # answered, then cut
            raw = b""
    finally:
        if conn is not None:
            conn.close()
    result, detail = classify_answer(status, raw, keys)
    return Outcome(kind, tenant, result, status, detail + note, start, load.now())


def one_stream(load: Load, kind: str, tenant: str, body: dict[str, Any], *, hang_up_after: int | None = None,
               read_delay_s: float = 0.0, rcvbuf: int | None = None) -> Outcome:
    """A streamed request, judged by :func:`classify_stream`; its gaps between events kept."""
    start, deadline = load.now(), _Deadline(load.deadline_s + 200 * read_delay_s)
    status, events, done, raw, marks = None, [], False, b"", []
    hung_up = timed_out = False
    note = ""
    conn = None
    try:
        conn, resp = _open(load, "/v1/completions", {**body, "stream": True}, tenant, deadline, rcvbuf)
        status = resp.status
        if status != 200:
            conn.sock.settimeout(deadline.left())
            raw = resp.read()
        else:
            while True:
                conn.sock.settimeout(deadline.left())
                line = resp.readline()
                if not line:
                    break
                text = line.decode(errors="replace").strip()
                if not text.startswith("data:"):
                    continue
                marks.append(time.monotonic())
                data = text[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                events.append(json.loads(data))
                if hang_up_after is not None and len(events) >= hang_up_after:
                    hung_up = True
                    break
                if read_delay_s:
                    time.sleep(read_delay_s)
    except TimeoutError:
        timed_out = True
    except (OSError, http.client.HTTPException, ValueError) as exc:
        note = f" ({type(exc).__name__}: {str(exc)[:80]})"
    finally:
        if conn is not None:
            conn.close()
    result, detail = classify_stream(status, events, done, body=raw, hung_up=hung_up, timed_out=timed_out)
    gaps = [b - a for a, b in itertools.pairwise(marks)] if kind == "stream" else []  # a slow reader's gaps are its own
    return Outcome(kind, tenant, result, status, detail + note, start, load.now(), gaps)


def _completion(load: Load, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": load.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def _structured(load: Load, n: int, rng: random.Random) -> tuple[dict[str, Any], list[str]]:
    names = [f"k{n}_{i}" for i in range(rng.randint(1, 3))]
    schema = {"type": "object", "properties": {k: {"type": rng.choice(["integer", "boolean"])} for k in names},
              "required": names, "additionalProperties": False}
    return ({"model": load.model, "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 48,
             "temperature": 0, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": schema}}}, names)


def request(load: Load, kind: str, tenant: str, n: int, rng: random.Random) -> Outcome:
    """The ``n``-th request of a client of ``kind``."""
    prompt = rng.choice(PROMPTS)
    if kind == "plain":
        return one_answer(load, kind, tenant, "/v1/completions", _completion(load, prompt, 24))
    if kind == "structured":
        body, names = _structured(load, n, rng)
        return one_answer(load, kind, tenant, "/v1/chat/completions", body, names)
    if kind == "long":
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(load.long_words))
        return one_answer(load, kind, tenant, "/v1/completions", _completion(load, words, 8))
    if kind == "stream":
        return one_stream(load, kind, tenant, _completion(load, prompt, 48))
    if kind == "cancel":
        return one_stream(load, kind, tenant, _completion(load, prompt, 200), hang_up_after=3)
    if kind == "slow":
        return one_stream(load, kind, tenant, _completion(load, prompt, 32), read_delay_s=load.slow_read_s,
                          rcvbuf=4096)
    raise ValueError(kind)


#: The clients: (kind, tenant; None: the tenants alternate).
CLIENTS: list[tuple[str, str | None]] = [("plain", "alpha"), ("stream", "alpha"), ("stream", "beta"),
                                         ("structured", None), ("long", "alpha"), ("cancel", "beta"),
                                         ("slow", "alpha")]


def client_loop(load: Load, kind: str, tenant: str | None, seed: int) -> None:
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < load.until:
        n += 1
        who = tenant or TENANTS[n % 2]
        try:
            outcome = request(load, kind, who, n, rng)
        except Exception as exc:  # a bug of the soak itself: counted, never silent
            outcome = Outcome(kind, who, "unclear", None, f"soak client error {exc!r:.160}", load.now(), load.now())
        load.add(outcome)
        time.sleep(rng.uniform(*PAUSE_S))


# ------------------------------------------------------------------------------------------------ memory


def _rss_mib(proc: Any) -> float | None:
    with contextlib.suppress(Exception):
        return proc.memory_info().rss / 2**20
    return None


def process_names(root_pids: list[int], labels: dict[int, str]) -> list[tuple[str, int, float]]:
    """(name, pid, MiB) of every process at or below ``root_pids``: ``labels`` names some pids; Ray's own are
    named by their command (gcs_server, raylet, the controller actor); the rest summed as ``other ray`` (pid 0)."""
    import psutil

    seen: dict[int, Any] = {}
    for pid in root_pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                seen[p.pid] = p
    rows, other = [], 0.0
    for pid, proc in seen.items():
        mib = _rss_mib(proc)
        if mib is None:
            continue
        if pid in labels:
            rows.append((labels[pid], pid, mib))
            continue
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.cmdline())
            exe = os.path.basename(proc.cmdline()[0]) if proc.cmdline() else ""
            for name, match in (("ray gcs_server", exe == "gcs_server"), ("ray raylet", exe == "raylet"),
                                ("pipespec controller", cmd.startswith("ray::Controller"))):
                if match and pid != os.getpid():
                    rows.append((f"{name} {pid}" if name == "ray raylet" else name, pid, mib))
                    break
            else:
                if pid != os.getpid():
                    other += mib
    rows.append(("other ray processes (sum)", 0, other))
    return rows


def sample_memory(load: Load, launcher_pid: int, node_pids: Any, stop: threading.Event, every_s: float,
                  samples: list[dict[str, Any]]) -> None:
    """Every ``every_s``: the resident MiB of each process of the run (``node_pids()``: {pid: node name})."""
    while not stop.is_set():
        labels = {launcher_pid: "launcher (HTTP + client)"}
        with contextlib.suppress(Exception):
            labels.update(node_pids())
        t = load.now()
        for name, pid, mib in process_names([os.getpid(), launcher_pid], labels):
            samples.append({"t": round(t, 1), "name": name, "pid": pid, "mib": round(mib, 1)})
        stop.wait(every_s)


# ------------------------------------------------------------------------------------------------ faults


class Faults:
    """Kills a node's actor process and waits until the controller serves it again in a new process."""

    def __init__(self, ray: Any, ray_name: str):
        self.ray = ray
        self.controller = ray.get_actor(ray_name, namespace="pipespec")
        self.last_pids: dict[int, str] = {}

    def status(self) -> dict[str, Any]:
        return self.ray.get(self.controller.status.remote(), timeout=30)

    def node_pids(self) -> dict[int, str]:
        with contextlib.suppress(Exception):
            self.last_pids = {n["pid"]: name for name, n in self.status()["nodes"].items() if n.get("pid")}
        return self.last_pids

    def kill(self, load: Load, name: str, back_timeout_s: float) -> dict[str, Any]:
        node = self.status()["nodes"][name]
        old = node["pid"]
        t_fault = load.now()
        os.kill(old, signal.SIGKILL)  # a crash: no clean stop, Ray sees the process die
        log(f"fault at {t_fault:.0f} s: killed the {name} (pid {old})")
        deadline = time.monotonic() + back_timeout_s
        back, new = None, None
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                now = self.status()["nodes"][name]
                if now["state"] == "serving" and now.get("pid") not in (None, old):
                    back, new = load.now() - t_fault, now["pid"]
                    break
            time.sleep(0.5)
        log(f"  the {name} serves again in pid {new} after " + (f"{back:.1f} s" if back else "— (not back)"))
        return {"node": name, "at_s": round(t_fault, 1), "killed_pid": old, "new_pid": new,
                "back_after_s": None if back is None else round(back, 1)}


def after_fault(outcomes: list[dict[str, Any]], fault: dict[str, Any]) -> dict[str, float | None]:
    """From a fault (``outcomes``: :meth:`Outcome.as_dict` rows): seconds until the first request begun after it
    completed, and until the last request that failed began before that."""
    at = fault["at_s"]
    ends = [o["end"] for o in outcomes if o["result"] == "completed" and o["start"] >= at]
    served = min(ends) - at if ends else None
    failed = [o["start"] - at for o in outcomes if o["result"] == "failed" and o["start"] >= at
              and (served is None or o["start"] - at <= served)]
    return {"served_again_after_s": None if served is None else round(served, 1),
            "last_failure_begun_s": round(max(failed), 1) if failed else None}


def keys_file(folder: Path) -> tuple[Path, dict[str, str]]:
    """An API keys file (0600) naming the two tenants; returns it and tenant → key."""
    keys = {t: secrets.token_urlsafe(24) for t in TENANTS}
    path = folder / "api_keys"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{t}:{k}\n" for t, k in keys.items()))
    return path, keys


# ------------------------------------------------------------------------------------------------ the run


def launcher_config(args: argparse.Namespace, target: str, drafter: str, address: str, keys: Path,
                    ray_name: str) -> dict[str, Any]:
    """The config of the run: the nodes on their hosts, restarts without limit, HTTP with the two tenants' keys."""
    node = {"dtype": "float32", "threads": 1, "profile_s": 0}
    # the hosts run Ray's token authentication (testkit.ray_hosts), which the launcher checks: no ray_insecure
    launch = {"backend": "ray", "ray_address": address, "ray_name": ray_name, "ready_timeout_s": 600,
              "max_restarts": -1}
    return {"verifier": {"model": target, **node, "placement": {"num_cpus": 1, "resources": {"target_host": 1}}},
            "drafter": {"model": drafter, **node, "draft_schedule": "constant", "num_draft_tokens": 3,
                        "placement": {"num_cpus": 1, "resources": {"draft_host": 1}}},
            "client": {"timeout_s": args.client_timeout_s}, "launch": launch,
            "http": {"api_keys_file": str(keys), "send_timeout_s": 10}}


def tiny_models(root: Path, max_positions: int) -> tuple[str, str]:
    """A random Qwen2-style target (2 layers, hidden 64) and its 1-layer cut as the drafter."""
    from benchmarks.models import build_random_pair

    target, drafter = build_random_pair(root, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                                        max_positions=max_positions, deep_scale=0.3, seed=0)
    return str(target), str(drafter)


def soak(args: argparse.Namespace, load: Load, faults: Faults, launcher_pid: int) -> dict[str, Any]:
    """Run the clients, the memory sampler and the fault schedule until ``load.until``; the raw results."""
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_memory, daemon=True,
                               args=(load, launcher_pid, faults.node_pids, stop, args.sample_s, samples))
    sampler.start()
    clients = [threading.Thread(target=client_loop, args=(load, kind, tenant, i), daemon=True)
               for i, (kind, tenant) in enumerate(CLIENTS)]
    for t in clients:
        t.start()
    fault_log: list[dict[str, Any]] = []
    order = ["drafter", "verifier"]
    at = args.fault_every_s / 2
    while at < args.duration_s - args.quiet_end_s:
        time.sleep(max(0.0, load.t0 + at - time.monotonic()))
        fault_log.append(faults.kill(load, order[len(fault_log) % 2], args.back_timeout_s))
        at += args.fault_every_s
    time.sleep(max(0.0, load.until - time.monotonic()))
    log("load ends; waiting for the requests in flight (each bounded by its deadline)")
    for t in clients:
        t.join(args.deadline_s + 200 * args.slow_read_s + 30)
    stuck = sum(t.is_alive() for t in clients)
    stop.set()
    sampler.join(args.sample_s + 30)
    events = []
    with contextlib.suppress(Exception):
        events = faults.status()["events"]
    rows = [o.as_dict() for o in load.outcomes]
    for fault in fault_log:
        fault.update(after_fault(rows, fault))
    return {"faults": fault_log, "memory_samples": samples, "events": events, "stuck_clients": stuck}


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import yaml

    from benchmarks.http_overhead import free_port, start_launcher
    from runtime.launchers.process import stop_process
    from testkit.ray_hosts import RayHosts

    target, drafter = (args.target, args.drafter) if args.target else tiny_models(root, args.max_positions)
    keys_path, keys = keys_file(root)
    hosts = RayHosts(HOSTS)
    log(f"Ray cluster: head + {len(HOSTS)} hosts at {hosts.address}, up in {hosts.up_s:.1f} s")
    ray_name = f"soak-{secrets.token_hex(3)}"
    config = launcher_config(args, target, drafter, hosts.address, keys_path, ray_name)
    config_path = root / "soak.yaml"
    config_path.write_text(yaml.safe_dump(config))
    proc = None
    try:
        port = free_port()
        proc, _, ready = start_launcher(config_path, port)
        log(ready)
        t0 = time.monotonic()
        load = Load(port=port, model=ready.rsplit("(model ", 1)[1].rstrip(")"), keys=keys, t0=t0,
                    until=t0 + args.duration_s, deadline_s=args.deadline_s, long_words=args.long_words,
                    slow_read_s=args.slow_read_s)
        raw = soak(args, load, Faults(hosts.ray, ray_name), proc.pid)
    finally:
        if proc is not None:
            stop_process(proc)
        hosts.shutdown()
    return {"target": target, "drafter": drafter, "config": {k: v for k, v in config.items() if k != "http"},
            "outcomes": [o.as_dict() for o in load.outcomes], "_outcomes": load.outcomes, **raw}


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """The result file's form: every request that did not complete (or was not cancelled) in full, each stream's
    (start, end, longest gap), the memory samples per process name as (t, pid, MiB) rows: the counts are in the
    summary, and a 30-minute soak's every request would be megabytes."""
    out = dict(result)
    if isinstance(out.get("outcomes"), list):
        rows = out.pop("outcomes")
        out["requests_not_completed"] = [o for o in rows if o["result"] not in ("completed", "cancelled")]
        out["stream_stalls"] = [[o["start"], o["end"], o["max_gap_s"]] for o in rows
                                if o["kind"] == "stream" and o["max_gap_s"] is not None]
    if isinstance(out.get("memory_samples"), list):
        by_name: dict[str, list[list[float]]] = {}
        for x in out.pop("memory_samples"):
            by_name.setdefault(x["name"], []).append([x["t"], x["pid"], x["mib"]])
        out["memory_samples"] = by_name
    return out


def write(out: Path, result: dict[str, Any]) -> None:
    from benchmarks.results import write_result

    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "soak.json", compact(result))
    write_report(out, result)


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``soak.md`` of a result (also from a saved ``soak.json``: ``--report-from``)."""
    from benchmarks.soak_books import report_lines

    m = result["meta"]
    a = result["summary"]["aims"]
    both = "both tenants"
    lines = ["# Soak with faults: pipespec on a Ray cluster on one host", "",
             f"- date (UTC): {m['start']} – {m['end']}; machine: {m['machine']['cpu']}, {m['machine']['cores']} "
             "cores, shared with other jobs while it ran (figures from a busy machine)",
             f"- command: `{m['command']}`",
             f"- models: target `{result['target']}`, drafter `{result['drafter']}` (float32, 1 thread each)",
             f"- cluster: `ray.cluster_utils.Cluster`, a head with no CPUs + {', '.join(HOSTS)} hosts; "
             f"Ray token authentication: {'off' if result['config']['launch'].get('ray_insecure') else 'on'}",
             f"- load: {', '.join(f'{k} ({t or both})' for k, t in CLIENTS)}; deadline "
             f"{m['deadline_s']:.0f} s per request; a fault every {m['fault_every_s']:.0f} s, drafter and verifier "
             "in turn", "",
             f"**Lost: {a['lost']}; unclear: {a['unclear']}; memory flat: {'yes' if a['memory_flat'] else 'no'}.**",
             ""]
    (out / "soak.md").write_text("\n".join(lines + report_lines(result)) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    import sys
    import tempfile

    from benchmarks.machine import machine_info
    from benchmarks.progress import utc_now
    from benchmarks.soak_books import summarise

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=1800.0, help="seconds of load")
    p.add_argument("--fault-every-s", type=float, default=240.0, help="seconds between faults (drafter, verifier, …)")
    p.add_argument("--quiet-end-s", type=float, default=60.0, help="no fault in the last this many seconds")
    p.add_argument("--deadline-s", type=float, default=150.0, help="client-side deadline of each request")
    p.add_argument("--client-timeout-s", type=float, default=60.0, help="the launcher's client.timeout_s")
    p.add_argument("--back-timeout-s", type=float, default=300.0, help="bound on waiting for a killed node")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--warmup-s", type=float, default=120.0, help="memory of a process life before this is warm-up")
    p.add_argument("--max-slope", type=float, default=50.0, help="MiB per hour a process may grow and count flat")
    p.add_argument("--min-steady-s", type=float, default=240.0,
                   help="a process life is judged flat or not only with this many seconds after its warm-up")
    p.add_argument("--long-words", type=int, default=300, help="words of a long prompt")
    p.add_argument("--max-positions", type=int, default=2048, help="context of the tiny models")
    p.add_argument("--slow-read-s", type=float, default=0.25, help="a slow reader's pause per event")
    p.add_argument("--target", help="target model (default: a tiny random model built here)")
    p.add_argument("--drafter", help="draft model (with --target)")
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    p.add_argument("--report-from", type=Path, metavar="SOAK_JSON",
                   help="only write soak.md (into --out) again from a saved soak.json (compacting the file too)")
    args = p.parse_args(argv)
    if args.report_from:
        saved = json.loads(args.report_from.read_text(encoding="utf-8"))
        for fault in saved["faults"] if isinstance(saved.get("outcomes"), list) else []:
            fault.update(after_fault(saved["outcomes"], fault))  # a file written before after_fault existed
        write(args.out, saved)  # compact() leaves a compacted file as it is
        return 0
    if args.duration_s <= 0 or args.fault_every_s <= 0 or bool(args.target) != bool(args.drafter):
        p.error("--duration-s and --fault-every-s must be > 0; give --target and --drafter together")
    start = utc_now()
    with tempfile.TemporaryDirectory(prefix="pipespec-soak-") as tmp:
        result = run(args, Path(tmp))
    outcomes = result.pop("_outcomes")
    result["summary"] = summarise(outcomes, result["faults"], result["memory_samples"], warmup_s=args.warmup_s,
                                  fault_window_s=10.0, max_slope_mib_per_h=args.max_slope,
                                  min_steady_s=args.min_steady_s)
    result["meta"] = {"start": start, "end": utc_now(), "machine": machine_info(),
                      **{k: v for k, v in vars(args).items() if k != "out"},
                      "command": "python scripts/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    write(args.out, result)
    a = result["summary"]["aims"]
    log(f"{len(outcomes)} requests: lost {a['lost']}, unclear {a['unclear']}, memory flat {a['memory_flat']}; "
        f"wrote {args.out / 'soak.md'}")
    return 0 if a["held"] else 1
