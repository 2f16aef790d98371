"""What a request through the OpenAI-compatible HTTP server costs over :class:`runtime.client.AsyncClient`, on the
same running cluster.

One launcher is started the way a user starts it (``python -m runtime.launch --config X --http 127.0.0.1:PORT``);
this script then sends the same greedy request ``--reps`` times through each path, alternating (so drift in the
host's speed hits both alike): ``AsyncClient`` on the cluster's client address, and plain HTTP (the standard
library's client on a kept-alive connection, so the numbers are the server's cost, not an SDK's).

- **non-streamed**: request latency; added = median(HTTP) − median(AsyncClient);
- **streamed**: the arrival time of every text chunk; for each HTTP chunk, the time the AsyncClient stream had
  reached the same text (chunks aligned by text length, since HTTP skips chunks with no text); added per chunk =
  the median of those differences; also time to first chunk and the median gap between chunks on each path.

Both paths must produce the same text (checked). Outputs: ``--out`` (default ``results/``) ``http_overhead.json``
and ``http_overhead.md``.

    .venv/bin/python scripts/bench_http.py --tiny                 # tiny random models built on the spot, seconds
    .venv/bin/python scripts/bench_http.py --config cpu.yaml --reps 20 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_info
from benchmarks.models import build_random_pair
from benchmarks.progress import log, utc_now
from benchmarks.results import write_result
from benchmarks.tables import header_lines, md_table
from runtime.client import AsyncClient, Chunk
from runtime.launchers.process import stop_process

REPO_ROOT = Path(__file__).resolve().parent.parent

PROMPT = "def fibonacci(n):\n    "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_launcher(config_path: Path, port: int, timeout_s: float = 600.0) -> tuple[subprocess.Popen, str, str]:
    """``python -m runtime.launch --config X --http 127.0.0.1:PORT`` as a subprocess; returns it with the cluster's
    client address and its serving line once HTTP is up (``RuntimeError`` with its output if it is not in time)."""
    proc = subprocess.Popen([sys.executable, "-m", "runtime.launch", "--config", str(config_path), "--http",
                             f"127.0.0.1:{port}"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    address = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if line.startswith("client address:"):
            address = line.split(":", 1)[1].strip()
        if "serving OpenAI-compatible HTTP on" in line and address:
            return proc, address, line.strip()
    stop_process(proc)
    raise RuntimeError("the launcher did not start HTTP in time:\n" + "".join(seen[-40:]))


class HttpPath:
    """Greedy completions over one kept-alive HTTP connection."""

    def __init__(self, port: int, model: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        self.model = model

    def _post(self, body: dict[str, Any]) -> http.client.HTTPResponse:
        self.conn.request("POST", "/v1/completions", body=json.dumps(body),
                          headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
        return r

    def generate(self, prompt: str, max_tokens: int) -> tuple[float, str]:
        t0 = time.perf_counter()
        r = self._post({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        text = json.loads(r.read())["choices"][0]["text"]
        return time.perf_counter() - t0, text

    def stream(self, prompt: str, max_tokens: int) -> tuple[list[tuple[float, int]], str]:
        """(seconds since the request, text length so far) per text chunk, and the text."""
        t0 = time.perf_counter()
        r = self._post({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "stream": True})
        marks, text = [], ""
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece:
                text += piece
                marks.append((time.perf_counter() - t0, len(text)))
        r.read()  # the end of the chunked body, so the connection can carry the next request
        return marks, text


async def client_generate(client: Any, prompt: str, max_tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = await client.generate(prompt, max_new_tokens=max_tokens)
    return time.perf_counter() - t0, r.text


async def client_stream(client: Any, prompt: str, max_tokens: int) -> tuple[list[tuple[float, int]], str]:
    t0 = time.perf_counter()
    marks, text = [], ""
    async for item in client.stream(prompt, max_new_tokens=max_tokens, include_result=True):
        # chunks hold back a trailing half character; the final result has all of the text (as HTTP sends it)
        piece = item.text if isinstance(item, Chunk) else item.text[len(text):]
        if piece:
            text += piece
            marks.append((time.perf_counter() - t0, len(text)))
    return marks, text


def aligned_differences(http_marks: list[tuple[float, int]], client_marks: list[tuple[float, int]]) -> list[float]:
    """For each HTTP chunk: its time minus the time the AsyncClient stream first had at least as much text."""
    diffs = []
    for t, length in http_marks:
        reached = next((tc for tc, lc in client_marks if lc >= length), None)
        if reached is not None:
            diffs.append(t - reached)
    return diffs


def gaps(marks: list[tuple[float, int]]) -> list[float]:
    return [b[0] - a[0] for a, b in itertools.pairwise(marks)]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


async def measure(address: str, port: int, model: str, args: argparse.Namespace) -> dict[str, Any]:

    http_path = HttpPath(port, model)
    lat = {"http": [], "client": []}
    streamed = {"per_chunk": [], "ttfc_http": [], "ttfc_client": [], "gap_http": [], "gap_client": [], "chunks": []}
    mismatches = 0
    async with AsyncClient(address, timeout_s=600) as client:
        await client_generate(client, args.prompt, args.max_tokens)  # warm-up, both paths
        await asyncio.to_thread(http_path.generate, args.prompt, args.max_tokens)
        for rep in range(args.reps):
            order = ("client", "http") if rep % 2 == 0 else ("http", "client")
            texts = {}
            for path in order:
                if path == "http":
                    seconds, texts[path] = await asyncio.to_thread(http_path.generate, args.prompt, args.max_tokens)
                else:
                    seconds, texts[path] = await client_generate(client, args.prompt, args.max_tokens)
                lat[path].append(seconds)
            marks = {}
            for path in order:
                if path == "http":
                    marks[path], text = await asyncio.to_thread(http_path.stream, args.prompt, args.max_tokens)
                else:
                    marks[path], text = await client_stream(client, args.prompt, args.max_tokens)
                mismatches += text != texts[path]
            mismatches += texts["http"] != texts["client"]
            streamed["per_chunk"] += aligned_differences(marks["http"], marks["client"])
            if marks["http"] and marks["client"]:
                streamed["ttfc_http"].append(marks["http"][0][0])
                streamed["ttfc_client"].append(marks["client"][0][0])
            streamed["gap_http"] += gaps(marks["http"])
            streamed["gap_client"] += gaps(marks["client"])
            streamed["chunks"].append(len(marks["http"]))
            log(f"rep {rep + 1}/{args.reps}: non-streamed HTTP {1000 * lat['http'][-1]:.1f} ms, "
                f"AsyncClient {1000 * lat['client'][-1]:.1f} ms")
    http_path.conn.close()
    med = statistics.median
    return {
        "non_streamed": {"median_http_ms": ms(med(lat["http"])), "median_client_ms": ms(med(lat["client"])),
                         "added_ms": ms(med(lat["http"]) - med(lat["client"])),
                         "http_ms": [ms(x) for x in lat["http"]], "client_ms": [ms(x) for x in lat["client"]]},
        "streamed": {
            "added_per_chunk_ms": ms(med(streamed["per_chunk"])) if streamed["per_chunk"] else None,
            "added_first_chunk_ms": ms(med(streamed["ttfc_http"]) - med(streamed["ttfc_client"]))
            if streamed["ttfc_http"] else None,
            "median_gap_http_ms": ms(med(streamed["gap_http"])) if streamed["gap_http"] else None,
            "median_gap_client_ms": ms(med(streamed["gap_client"])) if streamed["gap_client"] else None,
            "chunks_per_request": med(streamed["chunks"]) if streamed["chunks"] else 0,
            "aligned_chunks": len(streamed["per_chunk"]),
        },
        "text_mismatches": mismatches,
    }


def tiny_config(root: Path) -> dict[str, Any]:
    target, assistant = build_random_pair(root, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                                          max_positions=512, deep_scale=0.3, seed=0)
    node = {"dtype": "float32", "threads": 1, "profile_s": 0}
    return {"verifier": {"model": str(target), **node},
            "drafter": {"model": str(assistant), **node, "draft_schedule": "constant", "num_draft_tokens": 3},
            "client": {"timeout_s": 120}, "launch": {"ready_timeout_s": 300}}


def _version(pkg: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write_report(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "http_overhead.json", report)
    r, s = report["results"]["non_streamed"], report["results"]["streamed"]

    def f(v: Any) -> str:
        return "—" if v is None else f"{v:.2f}"

    lines = ["# HTTP overhead over AsyncClient", "", *header_lines(report["meta"]),
             "- HTTP: " + ", ".join(f"{k} {v}" for k, v in report["meta"]["http_software"].items()),
             f"- request: greedy, `max_tokens` {report['meta']['max_tokens']}, {report['meta']['reps']} repetitions "
             "per path, alternating; HTTP via the standard library's client on a kept-alive connection", "",
             *md_table(["measure", "HTTP", "AsyncClient", "added by HTTP"], [
                 ["non-streamed request, median (ms)", f(r["median_http_ms"]), f(r["median_client_ms"]),
                  f(r["added_ms"])],
                 ["streamed: time to first chunk, median (ms)", "", "", f(s["added_first_chunk_ms"])],
                 ["streamed: gap between chunks, median (ms)", f(s["median_gap_http_ms"]),
                  f(s["median_gap_client_ms"]), ""],
                 ["streamed: each chunk, aligned by text, median (ms)", "", "", f(s["added_per_chunk_ms"])],
             ], "lrrr"), "",
             f"Text identical on both paths: {'yes' if report['results']['text_mismatches'] == 0 else 'NO'} "
             f"({report['results']['text_mismatches']} mismatches); {s['aligned_chunks']} aligned chunks, "
             f"{s['chunks_per_request']} text chunks per streamed request (median)."]
    (out / "http_overhead.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu.yaml", help="the cluster's config (ignored with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny random models built on the spot (seconds, no download)")
    p.add_argument("--reps", type=int, help="repetitions per path (default 20, 10 with --tiny)")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 32, 16 with --tiny)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    args = p.parse_args(argv)
    args.reps = args.reps or (10 if args.tiny else 20)
    args.max_tokens = args.max_tokens or (16 if args.tiny else 32)
    if args.reps < 1 or args.max_tokens < 1:
        p.error("--reps and --max-tokens must be ≥ 1")

    from runtime.config import load_config

    start = utc_now()
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        if args.tiny:
            import yaml

            config_path = Path(tmp) / "tiny.yaml"
            config_path.write_text(yaml.safe_dump(tiny_config(Path(tmp))))
        else:
            config_path = Path(args.config)
        cfg = load_config(str(config_path))
        port = free_port()
        log(f"starting the launcher with --http 127.0.0.1:{port}")
        proc, address, ready = start_launcher(config_path, port)
        log(ready)
        try:
            model = ready.rsplit("(model ", 1)[1].rstrip(")")
            results = asyncio.run(measure(address, port, model, args))
        finally:
            stop_process(proc)
    v, d = cfg["verifier"], cfg["drafter"]
    meta = {"start": start, "end": utc_now(), "machine": machine_info(), "reps": args.reps,
            "max_tokens": args.max_tokens, "tiny": args.tiny,
            "models": ("tiny random Qwen2-style target (hidden 64, 2 layers), drafter assistant: its 1-layer cut"
                       if args.tiny else f"target {v['model']}, drafter {d['type']} {d['model']}"),
            "http_software": {pkg: _version(pkg) for pkg in ("fastapi", "uvicorn", "starlette")},
            "dtypes": f"verifier {v['dtype']}, drafter {d['dtype']}",
            "threads": f"verifier {v['threads']}, drafter {d['threads']} (one launcher; HTTP server in its process)"}
    report = {"meta": meta, "results": results}
    write_report(args.out, report)
    log(f"wrote {args.out / 'http_overhead.json'} and .md")
    print((args.out / "http_overhead.md").read_text())
    return 0 if results["text_mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
