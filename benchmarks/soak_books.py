"""The soak's bookkeeping (:mod:`benchmarks.soak`): what each request's end counts as, memory slopes, stalls, and
the report. Pure functions over plain data, so the unit tests can check every rule without a cluster.

Every request ends as exactly one of:

- ``completed``: 200 with a finish reason (``stop`` / ``length``); a stream also ended with ``[DONE]``; a structured
  answer that finished with ``stop`` parses as JSON with the schema's keys;
- ``failed``: a clear error: a 4xx/5xx whose body is an OpenAI-shaped error with a message, or a stream that
  ended with such an error event;
- ``cancelled``: the client hung up on purpose (a cancel client) after the stream had started;
- ``unclear``: an answer that is neither (a 5xx without an error body, a 200 without a finish reason, a stream cut
  without an error, a structured answer that breaks its schema);
- ``lost``: no answer before the client's deadline, or the connection dropped before any answer.

``unclear`` and ``lost`` must both stay 0.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

RESULTS = ("completed", "failed", "cancelled", "unclear", "lost")
#: Samples of one process a memory slope needs (fewer: no slope).
MIN_SLOPE_SAMPLES = 6


@dataclass
class Outcome:
    """One request's end. ``gaps``: the seconds between its SSE events (streams only); ``start``/``end``: seconds
    since the soak began."""

    kind: str
    tenant: str
    result: str
    status: int | None = None
    detail: str = ""
    start: float = 0.0
    end: float = 0.0
    gaps: list[float] = field(default_factory=list)

    @property
    def max_gap(self) -> float | None:
        return max(self.gaps) if self.gaps else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("gaps")
        d["max_gap_s"] = self.max_gap
        return d


def error_message(body: bytes | str | dict | None) -> tuple[str, str] | None:
    """(code, message) of an OpenAI-shaped error body (``{"error": {"message": ..., "code": ...}}``), else None."""
    doc = body
    if isinstance(body, (bytes, str)):
        try:
            doc = json.loads(body)
        except ValueError:
            return None
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"].strip():
        return None
    return str(error.get("code") or error.get("type") or "error"), error["message"]


def check_structured(content: Any, keys: Iterable[str] | None) -> str | None:
    """Why a structured answer that finished with ``stop`` breaks its schema (an object with exactly ``keys``),
    else None."""
    if keys is None:
        return None
    try:
        value = json.loads(content)
    except (TypeError, ValueError):
        return f"not JSON: {str(content)[:120]!r}"
    if not isinstance(value, dict) or set(value) != set(keys):
        return f"keys {sorted(value) if isinstance(value, dict) else type(value).__name__} != {sorted(keys)}"
    return None


def classify_answer(status: int | None, body: bytes, keys: Iterable[str] | None = None) -> tuple[str, str]:
    """(result, detail) of a non-streamed answer (``status`` None: none came); ``keys``: a structured request's
    schema keys."""
    if status is None:
        return "lost", "no answer"
    if status != 200:
        err = error_message(body)
        if err is None:
            return "unclear", f"status {status} without an error body: {body[:160]!r}"
        return "failed", f"{status} {err[0]}"
    try:
        choice = (json.loads(body).get("choices") or [{}])[0]
    except (ValueError, AttributeError):
        return "unclear", f"200 but not JSON: {body[:160]!r}"
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        return "unclear", f"200 without a finish reason: {str(choice)[:160]}"
    if finish == "stop" and keys is not None:
        content = (choice.get("message") or {}).get("content", choice.get("text"))
        broken = check_structured(content, keys)
        if broken:
            return "unclear", f"breaks its schema: {broken}"
    return "completed", finish


def classify_stream(status: int | None, events: list[Any], done: bool, *, body: bytes = b"",
                    hung_up: bool = False, timed_out: bool = False) -> tuple[str, str]:
    """(result, detail) of a streamed request: ``events`` the parsed ``data:`` events before ``[DONE]``, ``done``
    whether ``[DONE]`` came, ``body`` a non-200 answer's body, ``hung_up`` whether the client closed it on purpose,
    ``timed_out`` whether its deadline passed first."""
    if status is None:
        return "lost", "no answer" + (" within the deadline" if timed_out else "")
    if status != 200:
        return classify_answer(status, body)
    for event in events:
        err = error_message(event)
        if err is not None:
            return "failed", f"stream error {err[0]}"
    if hung_up:
        return ("cancelled", f"after {len(events)} events") if events else ("lost", "no event before the hang-up")
    if timed_out:
        return "lost", f"deadline passed after {len(events)} events"
    finishes = [(e.get("choices") or [{}])[0].get("finish_reason") for e in events if isinstance(e, dict)]
    if not done:
        return "unclear", f"stream cut after {len(events)} events without [DONE] or an error"
    if not any(f in ("stop", "length") for f in finishes):
        return "unclear", "[DONE] without a finish reason"
    return "completed", next(f for f in finishes if f in ("stop", "length"))


def slope_mib_per_h(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) samples, in MiB per hour; None with too few samples or no time span."""
    if len(points) < MIN_SLOPE_SAMPLES:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if max(xs) - min(xs) <= 0:
        return None
    return statistics.linear_regression(xs, ys).slope * 3600


def memory_summary(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Per process name: one entry per process life (a restarted node has a new pid): first and last MiB after
    ``warmup_s`` seconds of that life, max, and slope; ``samples``: ``{t, name, pid, mib}`` rows."""
    lives: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in samples:
        lives.setdefault((s["name"], s["pid"]), []).append((s["t"], s["mib"]))
    out: dict[str, dict[str, Any]] = {}
    for (name, pid), points in sorted(lives.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        born = points[0][0]
        steady = [p for p in points if p[0] - born >= warmup_s] or points[-1:]
        slope = slope_mib_per_h(steady)
        life = {"pid": pid, "from_s": round(points[0][0], 1), "to_s": round(points[-1][0], 1),
                "samples": len(points), "steady_s": round(steady[-1][0] - steady[0][0], 1),
                "first_mib": round(steady[0][1], 1), "last_mib": round(steady[-1][1], 1),
                "max_mib": round(max(p[1] for p in points), 1),
                "slope_mib_per_h": None if slope is None else round(slope, 1)}
        out.setdefault(name, {"lives": []})["lives"].append(life)
    for entry in out.values():
        longest = max(entry["lives"], key=lambda life: life["to_s"] - life["from_s"])
        entry["longest_life"] = longest
    return out


def flat(summary: dict[str, dict[str, Any]], max_slope_mib_per_h: float, min_steady_s: float) -> dict[str, bool | None]:
    """Per process name: whether every life with at least ``min_steady_s`` seconds after its warm-up stayed under
    ``max_slope_mib_per_h``; None where no life was that long, or for a sum over a changing set of processes
    (pid 0): a slope there says nothing about a leak."""
    out: dict[str, bool | None] = {}
    for name, entry in summary.items():
        judged = [life for life in entry["lives"] if life["pid"] != 0 and life["slope_mib_per_h"] is not None
                  and life["steady_s"] >= min_steady_s]
        out[name] = all(life["slope_mib_per_h"] <= max_slope_mib_per_h for life in judged) if judged else None
    return out


def in_fault(start: float, end: float, windows: list[tuple[float, float]]) -> bool:
    """Whether [start, end] overlaps any (from, to) window."""
    return any(start <= b and end >= a for a, b in windows)


def _pct(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))], 3) if xs else None


def stall_summary(outcomes: list[Outcome], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Each stream's longest gap between events (its stall), split by whether a fault window overlapped it."""
    out: dict[str, Any] = {}
    for label, keep in (("quiet", False), ("during a fault", True)):
        stalls = [o.max_gap for o in outcomes
                  if o.max_gap is not None and in_fault(o.start, o.end, windows) == keep]
        out[label] = {"streams": len(stalls), "p50_s": _pct(stalls, 0.5), "p99_s": _pct(stalls, 0.99),
                      "max_s": _pct(stalls, 1.0)}
    return out


def outcome_table(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Per client kind (and ``all``): how many requests ended as each of :data:`RESULTS`."""
    table: dict[str, Counter] = {}
    for o in outcomes:
        if o.result not in RESULTS:
            raise ValueError(f"unknown result {o.result!r}")
        table.setdefault(o.kind, Counter())[o.result] += 1
        table.setdefault("all", Counter())[o.result] += 1
    return {k: {r: c[r] for r in RESULTS} for k, c in sorted(table.items(), key=lambda kv: (kv[0] == "all", kv[0]))}


def failure_reasons(outcomes: list[Outcome], limit: int = 12) -> list[tuple[str, int]]:
    """The most common details of failed, unclear and lost requests."""
    return Counter(f"{o.result}: {o.detail}" for o in outcomes
                   if o.result in ("failed", "unclear", "lost")).most_common(limit)


def summarise(outcomes: list[Outcome], faults: list[dict[str, Any]], samples: list[dict[str, Any]], *,
              warmup_s: float, fault_window_s: float, max_slope_mib_per_h: float,
              min_steady_s: float = 0.0) -> dict[str, Any]:
    """The soak's figures: outcomes per client kind, the stalls, memory per process, and whether the aims held
    (0 lost, 0 unclear, memory flat)."""
    windows = [(f["at_s"], f["at_s"] + (f.get("back_after_s") or 0) + fault_window_s) for f in faults]
    table = outcome_table(outcomes)
    memory = memory_summary(samples, warmup_s)
    flatness = flat(memory, max_slope_mib_per_h, min_steady_s)
    total = table.get("all", dict.fromkeys(RESULTS, 0))
    return {"outcomes": table, "reasons": failure_reasons(outcomes), "stalls": stall_summary(outcomes, windows),
            "memory": memory, "flat": flatness,
            "aims": {"lost": total["lost"], "unclear": total["unclear"], "memory_flat": False not in flatness.values(),
                     "held": total["lost"] == 0 and total["unclear"] == 0 and False not in flatness.values()}}


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report_lines(result: dict[str, Any]) -> list[str]:
    """The markdown tables of a summarised soak (``result["summary"]``, ``result["faults"]``)."""
    from benchmarks.tables import md_table

    s = result["summary"]
    lines = ["Requests, by client (each with a client-side deadline; lost: no answer by then):", "",
             *md_table(["client", *RESULTS], [[k, *(str(c[r]) for r in RESULTS)] for k, c in s["outcomes"].items()],
                       "lrrrrr"), ""]
    if s["reasons"]:
        lines += ["Why requests failed (the error each got):", "",
                  *[f"- {n} × {reason}" for reason, n in s["reasons"]], ""]
    lines += ["Faults (SIGKILL of the node's actor process; Ray restarts it, the controller serves it again):", "",
              *md_table(["at s", "node", "killed pid", "new pid", "serve call restarted after s",
                         "last failed request begun after s", "first new request completed after s"],
                        [[_f(f["at_s"]), f["node"], str(f["killed_pid"]), str(f["new_pid"]), _f(f["back_after_s"]),
                          _f(f.get("last_failure_begun_s")), _f(f.get("served_again_after_s"))]
                         for f in result["faults"]], "rlrrrrr"),
              "", "(The controller restarts a node's serve call before the new process has loaded its model and "
              "bound its sockets: the outage a client sees is the last two columns.)", ""]
    lines += ["Stall per stream (its longest gap between SSE events), streams overlapping a fault apart:", "",
              *md_table(["streams", "count", "p50 s", "p99 s", "max s"],
                        [[k, str(v["streams"]), _f(v["p50_s"], 3), _f(v["p99_s"], 3), _f(v["max_s"], 3)]
                         for k, v in s["stalls"].items()], "lrrrr"), ""]
    rows = []
    for name, entry in s["memory"].items():
        life = entry["longest_life"]
        rows.append([name, str(len(entry["lives"])), f"{_f(life['from_s'], 0)}–{_f(life['to_s'], 0)}",
                     _f(life["first_mib"]), _f(life["last_mib"]), _f(life["max_mib"]), _f(life["slope_mib_per_h"]),
                     {True: "yes", False: "**no**", None: "not judged"}[s["flat"][name]]])
    lines += ["Resident memory per process (its longest life; a killed node's next process is a new life; "
              "slope by least squares after the warm-up):", "",
              *md_table(["process", "lives", "longest life s", "first MiB", "last MiB", "max MiB", "MiB/h",
                         "flat"], rows, "lrlrrrrl")]
    return lines
