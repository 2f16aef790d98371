"""A load test of the OpenAI-compatible HTTP server: many concurrent clients with a mix of plain, streamed,
structured, never-reading and hostile requests, for a set time, against one launcher started the way a user starts
it (``python -m runtime.launch --config X --http 127.0.0.1:PORT``).

It runs a **quiet phase** (the plain streams alone) and then a **mixed phase** (everything at once) and reports:

- **stalls**: the gaps between the SSE events of the plain streams, quiet against mixed. The aim is no stall of a
  plain stream longer than one round plus one forward; the report takes the quiet phase's longest gap as a round
  (worst case) and its median gap as a forward, and says whether the mixed phase's longest gap stayed within their
  sum;
- **memory**: the resident memory of every node process and of the launcher, sampled each second after the
  warm-up; the growth over the mixed phase (first against last quarter) is what "flat" is judged by;
- **outcomes**: every request is *served* (200 with a finish reason), *refused* (a 4xx with an OpenAI-shaped error
  body carrying a code, as docs/http.md lists them) or *lost* (anything else: a 5xx, a broken connection, a timeout,
  a 200 without a finish, a hostile request answered in a way its case does not allow). Nothing may be lost.

The hostile cases are listed in :data:`HOSTILE` with the statuses each may get. Never-reading clients open a
streamed request on a socket with a small receive buffer, never read it and hang up after ``--hold-s``.

    .venv/bin/python scripts/load_test.py --tiny                      # tiny random models, 3 minutes
    .venv/bin/python scripts/load_test.py --tiny --duration 20 --quiet-s 5

Outputs ``--out`` (default ``results/``) ``load.json`` and ``load.md``.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.http_overhead import free_port, start_launcher, tiny_config
from benchmarks.machine import machine_info
from benchmarks.progress import log, utc_now
from benchmarks.results import write_result
from benchmarks.tables import header_lines, md_table
from runtime.launchers.process import stop_process

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Seconds any one HTTP exchange of the test may take before it counts as lost (a stall of the server).
REQUEST_TIMEOUT_S = 120.0
PROMPTS = ["def fibonacci(n):\n    ", "The quick brown fox", "import numpy as np\n", "Once upon a time",
           "SELECT * FROM", "class Stack:\n    def push(self, x):"]


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: no HTTP answer at all
    result: str  # served | refused | lost
    detail: str = ""


@dataclass
class Tally:
    """Every request's outcome and every plain stream's event gaps, shared by the worker threads."""

    outcomes: list[Outcome] = field(default_factory=list)
    gaps: dict[str, list[float]] = field(default_factory=lambda: {"quiet": [], "mixed": []})
    #: the mixed phase's gaps with the time each ended, and what the other clients were doing when: (name, start,
    #: end) of every non-stream request, so the longest stalls can be set against what ran during them
    ends: list[tuple[float, float]] = field(default_factory=list)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def add_gaps(self, phase: str, gaps: list[tuple[float, float]]) -> None:
        with self.lock:
            self.gaps[phase].extend(g for g, _ in gaps)
            if phase == "mixed":
                self.ends.extend(gaps)

    def span(self, name: str, start: float) -> None:
        with self.lock:
            self.spans.append((name, start, time.monotonic()))

    def during(self, start: float, end: float) -> list[str]:
        """The requests (other than plain streams) in flight at some time in [start, end]."""
        with self.lock:
            return sorted({n for n, a, b in self.spans if a <= end and b >= start})


class Server:
    """Where the server is and what model it serves; each exchange opens its own connection."""

    def __init__(self, port: int, model: str):
        self.port = port
        self.model = model

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)

    def exchange(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = self.connect()
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


def judge(kind: str, status: int, body: bytes, allowed: set[int] | None = None) -> Outcome:
    """served / refused / lost for a non-streamed answer; ``allowed``: the statuses this case may get (None: 200 or
    any documented 4xx)."""
    if allowed is not None and status not in allowed:
        return Outcome(kind, status, "lost", f"status {status} not in {sorted(allowed)}: {body[:200]!r}")
    try:
        doc = json.loads(body)
    except ValueError:
        return Outcome(kind, status, "lost", f"not JSON: {body[:200]!r}")
    if status == 200:
        choices = doc.get("choices") or [{}]
        if choices[0].get("finish_reason") not in ("stop", "length"):
            return Outcome(kind, status, "lost", f"no finish reason: {str(doc)[:200]}")
        return Outcome(kind, status, "served")
    error = doc.get("error") if isinstance(doc, dict) else None
    if 400 <= status < 500 and isinstance(error, dict) and error.get("message"):
        return Outcome(kind, status, "refused", str(error.get("code")))
    return Outcome(kind, status, "lost", f"status {status}: {body[:200]!r}")


def completion(server: Server, prompt: str, max_tokens: int, **extra: Any) -> bytes:
    return json.dumps({"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       **extra}).encode()


def stream_once(server: Server, body: bytes) -> tuple[int, list[tuple[float, float]], str | None, bytes]:
    """One streamed request: its status, the gaps between its SSE events (seconds, each with the monotonic time it
    ended), its finish reason, and the body of a refusal."""
    conn = server.connect()
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, [], None, r.read()
        marks, finish = [], None
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            marks.append(time.monotonic())
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                return 200, [], None, json.dumps(event).encode()
            finish = (event.get("choices") or [{}])[0].get("finish_reason") or finish
        return 200, [(b - a, b) for a, b in itertools.pairwise(marks)], finish, b""
    finally:
        conn.close()


def plain_stream_worker(server: Server, tally: Tally, phase: Callable[[], str], until: float, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        try:
            status, gaps, finish, body = stream_once(server, completion(server, rng.choice(PROMPTS), 48,
                                                                        stream=True))
        except Exception as exc:  # any failure of a plain stream is a lost request
            tally.add(Outcome("stream", None, "lost", repr(exc)[:200]))
            continue
        if status != 200:
            tally.add(judge("stream", status, body))
        elif finish in ("stop", "length"):
            tally.add(Outcome("stream", 200, "served"))
            tally.add_gaps(phase(), gaps)
        else:
            tally.add(Outcome("stream", 200, "lost", f"stream ended without a finish reason {body[:200]!r}"))


def plain_worker(server: Server, tally: Tally, until: float, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        start = time.monotonic()
        try:
            status, body = server.exchange("POST", "/v1/completions", completion(server, rng.choice(PROMPTS), 32))
            tally.add(judge("plain", status, body))
        except Exception as exc:
            tally.add(Outcome("plain", None, "lost", repr(exc)[:200]))
        tally.span("plain", start)


def structured_worker(server: Server, tally: Tally, until: float, seed: int) -> None:
    """JSON-schema requests, each with a schema never seen before (distinct property names): compile-cache churn."""
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < until:
        n += 1
        names = [f"f{seed}_{n}_{i}" for i in range(rng.randint(1, 3))]
        schema = {"type": "object", "properties": {k: {"type": rng.choice(["integer", "boolean"])} for k in names},
                  "required": names, "additionalProperties": False}
        body = json.dumps({"model": server.model, "messages": [{"role": "user", "content": "JSON please"}],
                           "max_tokens": 64, "temperature": 0,
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": schema}}}).encode()
        start = time.monotonic()
        try:
            status, raw = server.exchange("POST", "/v1/chat/completions", body)
        except Exception as exc:
            tally.add(Outcome("structured", None, "lost", repr(exc)[:200]))
            continue
        finally:
            tally.span("structured", start)
        outcome = judge("structured", status, raw)
        if outcome.result == "served":
            choice = json.loads(raw)["choices"][0]
            if choice["finish_reason"] == "stop":
                try:
                    value = json.loads(choice["message"]["content"])
                    assert set(value) == set(names)
                except (ValueError, AssertionError):
                    outcome = Outcome("structured", 200, "lost", f"output breaks its schema: {choice!r:.200}")
        tally.add(outcome)


def never_reading_worker(server: Server, tally: Tally, until: float, hold_s: float) -> None:
    """A streamed request on a socket that never reads its answer, held ``hold_s`` then closed. Its own outcome
    cannot be seen (it never reads); what it may not do is harm the others, which the other workers see."""
    while time.monotonic() < until:
        body = completion(server, "Tell me a long story.", 400, stream=True)
        start = time.monotonic()
        try:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                sock.connect(("127.0.0.1", server.port))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                time.sleep(min(hold_s, max(0.0, until - time.monotonic())))
            tally.add(Outcome("never_reading", None, "served", "held and closed"))
        except OSError as exc:
            tally.add(Outcome("never_reading", None, "lost", repr(exc)[:200]))
        tally.span("never-reading", start)


def raw_exchange(server: Server, head: bytes, pieces: Any) -> tuple[int, bytes]:
    """Send ``head`` and then each of ``pieces`` on a raw socket, stopping as soon as the server answers (a server
    may answer an over-size body before reading it); return the answer's status and body (status 0: none)."""
    import select

    with socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT_S) as sock:
        sock.sendall(head)
        try:
            for piece in pieces:
                if select.select([sock], [], [], 0)[0]:
                    break  # it answered already
                sock.sendall(piece)
        except OSError:
            pass  # it closed on us: the answer may already be in our receive buffer
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < _content_end(data):
                more = sock.recv(65536)
                if not more:
                    break
                data += more
        except OSError as exc:
            if not data:
                raise ConnectionError(f"no answer before the connection broke: {exc!r}") from None
        head_out, _, rest = data.partition(b"\r\n\r\n")
        status = int(head_out.split(b" ", 2)[1]) if head_out.startswith(b"HTTP/") else 0
        return status, rest


def _content_end(data: bytes) -> int:
    """Bytes of a whole answer whose head is in ``data`` (head + Content-Length), else a large number."""
    head, sep, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + len(sep) + int(line.split(b":", 1)[1])
    return 1 << 62


def _oversize(server: Server, chunked: bool) -> tuple[int, bytes]:
    """12.5 MiB offered in 64 KiB pieces, past any ``http.max_body_bytes`` the test uses: announced by
    Content-Length, or chunked (no length)."""
    piece, n = b"x" * 65536, 200
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if chunked:
        return raw_exchange(server, head + b"Transfer-Encoding: chunked\r\n\r\n",
                            (b"%x\r\n" % len(piece) + piece + b"\r\n" for _ in range(n)))
    return raw_exchange(server, head + f"Content-Length: {n * len(piece)}\r\n\r\n".encode(),
                        (piece for _ in range(n)))


def _hostile_cases(server: Server) -> list[tuple[str, set[int], Callable[[], tuple[int, bytes]]]]:
    """(name, statuses it may get, the exchange): each case a client may send to a shared server."""
    post = server.exchange
    deep: Any = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    chat = "/v1/chat/completions"

    def chat_body(**extra: Any) -> bytes:
        return json.dumps({"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                           "temperature": 0, **extra}).encode()

    return [
        ("invalid JSON", {400, 422}, lambda: post("POST", "/v1/completions", b"{not json")),
        ("lone surrogate", {400}, lambda: post("POST", "/v1/completions",
                                                b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 4}'
                                                % server.model.encode())),
        ("max_tokens 1,000,000", {400}, lambda: post("POST", "/v1/completions",
                                                     completion(server, "hi", 1_000_000))),
        ("prompt past the context", {400}, lambda: post("POST", "/v1/completions",
                                                        completion(server, "word " * 60_000, 4))),
        ("unknown model", {404}, lambda: post("POST", "/v1/completions",
                                              json.dumps({"model": "nope", "prompt": "x"}).encode())),
        ("over-size body", {413}, lambda: _oversize(server, chunked=False)),
        ("chunked over-size body", {413}, lambda: _oversize(server, chunked=True)),
        ("schema nested 300 deep", {400}, lambda: post("POST", chat, chat_body(response_format={
            "type": "json_schema", "json_schema": {"name": "d", "schema": deep}}))),
        ("slow regex", {200, 400}, lambda: post("POST", "/v1/completions", completion(
            server, "x", 8, structured_outputs={"regex": "[a-z]{1,20000}"}))),
        ("unsupported schema keyword", {400}, lambda: post("POST", chat, chat_body(response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {"type": "string"}}}}))),
        ("foreign Host header", {400, 421}, lambda: post("POST", "/v1/completions", completion(server, "hi", 4),
                                                         headers={"Host": "attacker.example:8000"})),
        ("emoji choice", {200}, lambda: post("POST", "/v1/completions", json.dumps({
            "model": server.model, "prompt": "pick", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"choice": ["\U0001F600", "no"]}}).encode())),
        ("named chat message", {200, 400}, lambda: post("POST", chat, json.dumps({
            "model": server.model, "messages": [{"role": "user", "content": "hi", "name": "bob"}],
            "max_tokens": 4, "temperature": 0}).encode())),
    ]


def hostile_worker(server: Server, tally: Tally, until: float) -> None:
    cases = _hostile_cases(server)
    i = 0
    while time.monotonic() < until:
        name, allowed, send = cases[i % len(cases)]
        i += 1
        start = time.monotonic()
        try:
            status, body = send()
        except Exception as exc:
            tally.add(Outcome(f"hostile: {name}", None, "lost", repr(exc)[:200]))
            continue
        finally:
            tally.span(f"hostile: {name}", start)
        tally.add(judge(f"hostile: {name}", status, body, allowed))


def _proc_fields(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, command line, resident MiB) of a live process, from /proc (Linux); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[1]), cmd, rss_kib / 1024


def process_memory(launcher_pid: int) -> dict[str, float]:
    """Resident MiB of the launcher and of every process below it, by a short name (verifier / drafter / pid)."""
    table = {int(d.name): f for d in Path("/proc").iterdir() if d.name.isdigit()
             if (f := _proc_fields(int(d.name))) is not None}
    below, grew = {launcher_pid}, True
    while grew:
        more = {pid for pid, (ppid, _, _) in table.items() if ppid in below} - below
        below |= more
        grew = bool(more)
    out = {}
    for pid in below & table.keys():
        cmd = table[pid][1]
        name = ("launcher" if pid == launcher_pid else f"verifier ({pid})" if "verifier" in cmd
                else f"drafter ({pid})" if "drafter" in cmd else f"pid {pid}")
        out[name] = table[pid][2]
    return out


def sample_memory(launcher_pid: int, samples: dict[str, list[tuple[float, float]]], stop: threading.Event,
                  t0: float) -> None:
    """Every second: each process's resident memory in MiB, as (seconds since ``t0``, MiB)."""
    while not stop.is_set():
        for name, mib in process_memory(launcher_pid).items():
            samples.setdefault(name, []).append((time.monotonic() - t0, mib))
        stop.wait(1.0)


def run_load(server: Server, launcher_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    t0 = time.monotonic()
    mixed_from = t0 + args.quiet_s
    end = mixed_from + args.duration
    phase = lambda: "quiet" if time.monotonic() < mixed_from else "mixed"  # noqa: E731
    memory: dict[str, list[tuple[float, float]]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample_memory, args=(launcher_pid, memory, stop, t0), daemon=True)
    sampler.start()
    threads = [threading.Thread(target=plain_stream_worker, args=(server, tally, phase, end, i))
               for i in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(args.quiet_s)
    log(f"quiet phase done ({len(tally.gaps['quiet'])} gaps); mixed phase for {args.duration:.0f} s")
    mixed = [threading.Thread(target=plain_worker, args=(server, tally, end, 100 + i)) for i in range(args.plain)]
    mixed += [threading.Thread(target=structured_worker, args=(server, tally, end, 200 + i))
              for i in range(args.structured)]
    mixed += [threading.Thread(target=never_reading_worker, args=(server, tally, end, args.hold_s))
              for _ in range(args.never_reading)]
    mixed += [threading.Thread(target=hostile_worker, args=(server, tally, end)) for _ in range(args.hostile)]
    for t in mixed:
        t.start()
    for t in threads + mixed:
        t.join(args.duration + args.quiet_s + 2 * REQUEST_TIMEOUT_S)
    stop.set()
    sampler.join(5)
    return summarise(tally, memory, args.quiet_s)


def _growth(points: list[tuple[float, float]], since: float) -> dict[str, Any] | None:
    """Resident memory over the mixed phase: the mean of each quarter (a cache filling up grows, then levels off),
    the growth from the first quarter to the last, and the maximum."""
    xs = [mib for t, mib in points if t >= since]
    if len(xs) < 4:
        return None
    q = len(xs) / 4
    quarters = [round(statistics.mean(xs[int(i * q):max(int(i * q) + 1, int((i + 1) * q))]), 1) for i in range(4)]
    return {"quarters_mib": quarters, "first_mib": quarters[0], "last_mib": quarters[-1],
            "growth_mib": round(quarters[-1] - quarters[0], 1), "max_mib": round(max(xs), 1)}


def summarise(tally: Tally, memory: dict[str, list[tuple[float, float]]], quiet_s: float) -> dict[str, Any]:
    by_kind: dict[str, Counter] = {}
    for o in tally.outcomes:
        by_kind.setdefault(o.kind, Counter())[o.result if o.result != "refused" else f"refused {o.status}"] += 1
    lost = [o.__dict__ for o in tally.outcomes if o.result == "lost"]
    quiet, mixed = sorted(tally.gaps["quiet"]), sorted(tally.gaps["mixed"])

    def pct(xs: list[float], p: float) -> float | None:
        return round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 2) if xs else None

    bound = (pct(quiet, 1.0) or 0) + (pct(quiet, 0.5) or 0) if quiet else None
    stalls = {"quiet_gaps": len(quiet), "mixed_gaps": len(mixed),
              "quiet_ms": {"p50": pct(quiet, 0.5), "p99": pct(quiet, 0.99), "max": pct(quiet, 1.0)},
              "mixed_ms": {"p50": pct(mixed, 0.5), "p99": pct(mixed, 0.99), "max": pct(mixed, 1.0)},
              "bound_ms": bound,
              "within_bound": bool(mixed) and bound is not None and pct(mixed, 1.0) <= bound,
              "longest": [{"ms": round(1000 * g, 1), "during": tally.during(end - g, end)}
                          for g, end in sorted(tally.ends, reverse=True)[:8]]}
    return {"outcomes": {k: dict(v) for k, v in sorted(by_kind.items())}, "requests": len(tally.outcomes),
            "lost": lost, "stalls": stalls,
            "memory": {name: _growth(points, quiet_s) for name, points in sorted(memory.items())}}


def write_report(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "load.json", report)
    r, m = report["results"], report["meta"]
    s = r["stalls"]
    lines = ["# Load test: many clients on one HTTP server", "", *header_lines(m),
             f"- load: {m['streams']} plain streams throughout; {m['quiet_s']:.0f} s quiet, then "
             f"{m['duration']:.0f} s mixed with {m['plain']} plain, {m['structured']} structured (a new schema each "
             f"time), {m['never_reading']} never-reading (held {m['hold_s']:.0f} s each) and {m['hostile']} hostile "
             "client(s) added", f"- command: `{m['command']}`", "",
             "## Outcomes", "", *md_table(["client", "outcomes"], [
                 [kind, ", ".join(f"{k} {v}" for k, v in sorted(c.items()))] for kind, c in r["outcomes"].items()],
                 "ll"), "",
             f"Requests: {r['requests']}; lost: **{len(r['lost'])}**.", ""]
    lines += [f"- lost: {x['kind']}: {x['detail']}" for x in r["lost"][:20]]
    lines += ["", "## Stalls of the plain streams (gap between SSE events)", "",
              *md_table(["phase", "gaps", "p50 (ms)", "p99 (ms)", "max (ms)"], [
                  ["quiet", str(s["quiet_gaps"]), *(str(s["quiet_ms"][k]) for k in ("p50", "p99", "max"))],
                  ["mixed", str(s["mixed_gaps"]), *(str(s["mixed_ms"][k]) for k in ("p50", "p99", "max"))]], "lrrrr"),
              "", f"Bound (one round, the quiet phase's longest gap, plus one forward, its median gap): "
              f"{s['bound_ms']} ms; the mixed phase's longest gap is {'within' if s['within_bound'] else 'PAST'} it.",
              "", "The longest gaps of the mixed phase, and the other requests in flight during each:", "",
              *[f"- {x['ms']} ms: {', '.join(x['during']) or 'nothing else'}" for x in s["longest"]],
              "", "## Resident memory over the mixed phase (mean of each quarter)", "",
              *md_table(["process", "1st (MiB)", "2nd", "3rd", "4th", "growth 1st→4th", "max"], [
                  [name, *(str(x) for x in g["quarters_mib"]), str(g["growth_mib"]), str(g["max_mib"])]
                  for name, g in r["memory"].items() if g], "lrrrrrr")]
    (out / "load.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu.yaml", help="the cluster's config (ignored with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny random models built on the spot (seconds, no download)")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of the mixed phase")
    p.add_argument("--quiet-s", type=float, default=20.0, help="seconds of the quiet phase first")
    p.add_argument("--streams", type=int, default=3, help="plain streamed clients, throughout")
    p.add_argument("--plain", type=int, default=2, help="plain non-streamed clients in the mixed phase")
    p.add_argument("--structured", type=int, default=2, help="structured-output clients in the mixed phase")
    p.add_argument("--never-reading", type=int, default=3, help="clients that never read, in the mixed phase")
    p.add_argument("--hold-s", type=float, default=10.0, help="seconds a never-reading client holds its socket")
    p.add_argument("--hostile", type=int, default=1, help="hostile clients in the mixed phase")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for the run (e.g. verifier.grammar_cache_bytes=4194304)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.quiet_s <= 0 or args.streams < 1:
        p.error("--duration and --quiet-s must be > 0, --streams ≥ 1")

    start = utc_now()
    with tempfile.TemporaryDirectory(prefix="load-") as tmp:
        import yaml

        if args.tiny:
            config = tiny_config(Path(tmp))
        else:
            config = yaml.safe_load((REPO_ROOT / "configs" / args.config).read_text()
                                    if not Path(args.config).exists() else Path(args.config).read_text())
        from runtime.config_schema import HttpConfig

        if hasattr(HttpConfig, "send_timeout_s"):  # short enough that never-reading clients are cancelled in the run
            config.setdefault("http", {}).setdefault("send_timeout_s", 5)
        for item in args.set:
            key, sep, value = item.partition("=")
            section, dot, name = key.partition(".")
            if not (sep and dot):
                p.error(f"--set {item!r}: give SECTION.KEY=VALUE")
            config.setdefault(section, {})[name] = yaml.safe_load(value)
        config_path = Path(tmp) / "load.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        log(f"starting the launcher with --http 127.0.0.1:{port}")
        proc, _, ready = start_launcher(config_path, port)
        log(ready)
        model = ready.rsplit("(model ", 1)[1].rstrip(")")
        try:
            results = run_load(Server(port, model), proc.pid, args)
        finally:
            stop_process(proc)
    meta = {"start": start, "end": utc_now(), "machine": machine_info(), **{k: v for k, v in vars(args).items()
                                                                           if k not in ("out",)},
            "command": "python scripts/load_test.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    report = {"meta": meta, "results": results}
    write_report(args.out, report)
    log(f"{results['requests']} requests, {len(results['lost'])} lost; mixed max gap "
        f"{results['stalls']['mixed_ms']['max']} ms (bound {results['stalls']['bound_ms']} ms); "
        f"wrote {args.out / 'load.md'}")
    return 1 if results["lost"] else 0
