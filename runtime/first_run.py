"""What the launcher tells a person at start-up and after a generation, in words: what each node chose and why
(dtype, threads), the measured costs, the plan the drafter's cost model implies, and afterwards what the run did.

Everything comes from the drafter's :class:`shared.protocol.StartReport` (listed in ``pong.reports``; built by
:mod:`drafter_node.start_report` from the cost model the schedule runs) and the request's metrics: no second
estimate. The functions take plain dicts (a pong's and a done's, as :class:`runtime.client.AsyncClient` returns
them) and return lines without the ``[pipespec]`` prefix.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.spec_rates import mean_block
from weights.progress import is_terminal

#: How long the launcher waits, once the nodes are ready, for each drafter's start-up report (sent right after the
#: welcome, so it normally comes within milliseconds; an older drafter sends none).
REPORT_WAIT_S = 5.0


async def with_reports(client: Any, pong: dict[str, Any], drafters: int,
                       wait_s: float = REPORT_WAIT_S) -> dict[str, Any]:
    """``pong``, or a later one, once it lists a start-up report for each of the ``drafters`` the launcher started
    (or after ``wait_s``): the verifier's ready answer can come before the drafter's report does."""
    deadline = time.monotonic() + wait_s
    while len(pong.get("reports") or []) < drafters and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        pong = await client.ping(timeout_s=max(0.5, deadline - time.monotonic()))
    return pong


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.0095 else f"{seconds * 1e3:.1f} ms"


def _threads(threads: dict[str, int] | None) -> str:
    if not threads:
        return "threads ?"
    share, full = threads.get("share", 0), threads.get("full", 0)
    if share == full:
        return f"{full} thread{'s' if full != 1 else ''}"
    return f"{share} thread{'s' if share != 1 else ''} while both nodes compute, {full} while the other waits"


def _node_line(role: str, dtype: str, why: str, threads: dict[str, int] | None) -> str:
    return f"{role}: {dtype or 'dtype ?'} ({why or 'unknown'}), {_threads(threads)}"


def costs_words(report: dict[str, Any]) -> str:
    """The measured costs the plan rests on: "draft step 92 ms, verify 1 token 290 ms, 5 tokens 310 ms"."""
    parts = []
    if report.get("draft_s"):
        parts.append(f"draft step {_ms(report['draft_s'])}")
    elif report.get("drafter_dtype_why", "").startswith("no model"):
        parts.append("draft step free (no model)")
    if report.get("verify_1_s"):
        parts.append(f"verify 1 token {_ms(report['verify_1_s'])}")
    if report.get("verify_k_s") and report.get("verify_k"):
        parts.append(f"{report['verify_k'] + 1} tokens {_ms(report['verify_k_s'])}")
    return ", ".join(parts)


def plan_words(report: dict[str, Any]) -> str:
    """The plan a start-up report implies, in one sentence."""
    decision = report.get("decision", "unmeasured")
    k, speedup, alpha = report.get("k", 0), report.get("speedup", 0.0), report.get("alpha", 0.0)
    shape = f"{'overlap' if report.get('overlap') else 'sync'} k = {k}"
    if decision == "pays":
        return (f"speculation pays here: {shape}, expected {speedup:.1f}× the target alone (at acceptance "
                f"{alpha:.2f} per token, adjusted as the run goes)")
    if decision == "cannot_pay":
        return ("speculation cannot pay on this hardware: running the target alone, expected 1.0× (not even a "
                "drafter whose every token is accepted would beat it)")
    if decision == "unsure":
        if k == 0:
            return (f"speculation does not pay at acceptance {alpha:.2f}: running the target alone, expected 1.0×, "
                    "with a probe block now and then in case acceptance is higher")
        return (f"speculation may pay: trying {shape} while acceptance is uncertain (at {alpha:.2f} per token it "
                f"would not: expected {speedup:.1f}×)")
    if decision == "fixed":
        return (f"k fixed by the {report.get('schedule')} schedule: {shape}, expected {speedup:.1f}× the target "
                f"alone at acceptance {alpha:.2f}")
    return "costs not measured yet (no profile): the plan is learned from the first rounds"


def type_line(config: dict[str, Any]) -> str:
    """Which drafter type ``drafter.type: auto`` chose and why: "drafter type gguf (auto: llama.cpp runs ...)"."""
    return f"drafter type {config['drafter']['type']} ({config['drafter']['type_reason']})"


def startup_lines(pong: dict[str, Any]) -> list[str]:
    """A few lines on what the nodes chose and the plan, from a pong (one block per drafter's report)."""
    reports = pong.get("reports") or []
    if not reports:
        if pong.get("drafter_connected"):
            return [f"target {pong.get('target')}: the drafter sent no start-up report (an older version?)"]
        return [f"target {pong.get('target')} alone: no drafter connected, every token from the target"]
    lines = []
    for i, r in enumerate(reports):
        if i == 0:
            lines.append(_node_line("verifier", r.get("verifier_dtype", ""), r.get("verifier_dtype_why", ""),
                                    r.get("verifier_threads")))
        who = "drafter" if len(reports) == 1 else f"drafter {r.get('drafter') or i + 1}"
        lines.append(_node_line(who, r.get("drafter_dtype", ""), r.get("drafter_dtype_why", ""),
                                r.get("drafter_threads")))
        costs = costs_words(r)
        lines.append(f"plan: {plan_words(r)}" + (f"; measured {costs}" if costs else ""))
    return lines


def run_summary(metrics: dict[str, Any], reports: list[dict[str, Any]] | None = None) -> str:
    """What a generation did, in the start-up lines' words: how many tokens came from drafts (or why none did),
    the acceptance, τ, the block lengths and plans, and the speed against the target alone's."""
    reports = reports or []
    report = reports[0] if reports else {}
    new, drafted, accepted = metrics.get("new_tokens", 0), metrics.get("draft_tokens", 0), \
        metrics.get("accepted_tokens", 0)
    rounds, solo, drafts = metrics.get("rounds", 0), metrics.get("solo_rounds", 0), metrics.get("drafts", 0)
    rate = metrics.get("tokens_per_second", 0.0)
    solo_rate = 1.0 / report["verify_1_s"] if report.get("verify_1_s") else 0.0
    speed = f"{new} tokens in {metrics.get('elapsed_s', 0.0):.1f} s ({rate:.2f} tok/s"
    speed += f"; the target alone: {solo_rate:.2f} tok/s measured at start-up)" if solo_rate else ")"
    costs = costs_words(report)
    if drafted == 0:
        if report.get("decision") == "cannot_pay":
            why = f"the cost model found speculation cannot pay ({costs})" if costs else \
                "the cost model found speculation cannot pay"
        elif solo:
            why = f"the cost model chose k = 0 for all {solo} rounds" + (f" ({costs})" if costs else "")
        elif not reports:
            why = "no drafter served the request"
        else:
            why = "the drafter sent no block in time (the verifier stepped alone)"
        return f"target alone for all {new} tokens: {why}; {speed}{ceiling_words(metrics)}"
    k_mean = mean_block(drafted, drafts, empty=0.0)
    schedule = report.get("schedule") or "?"
    out = (f"speculated: {accepted} of {new} tokens from drafts, acceptance {metrics.get('acceptance_rate', 0.0):.2f} "
           f"({accepted}/{drafted}), τ {metrics.get('mean_accepted_length', 1.0):.2f}, k {k_mean:.1f} on average "
           f"({schedule} schedule)")
    if report.get("decision") in ("pays", "unsure", "fixed") and report.get("speedup"):
        out += f"; {report['speedup']:.1f}× the target alone expected at start-up"
    if solo:
        out += f"; {solo} of {rounds} rounds the target alone (k = 0: drafting stopped paying at the acceptance seen)"
    return f"{out}; {speed}{ceiling_words(metrics)}"


def ceiling_words(metrics: dict[str, Any]) -> str:
    """"; decoding 5.1 tok/s = 83 % of the ceiling 6.2 tok/s (...)", or "" without a ceiling."""
    ceiling, fraction = metrics.get("ceiling_tokens_per_second"), metrics.get("ceiling_fraction")
    if not ceiling or fraction is None:
        return ""
    return (f"; decoding {metrics['decode_tokens_per_second']:.2f} tok/s = {100 * fraction:.0f} % of the ceiling "
            f"{ceiling:.2f} tok/s (the cost model's best plan at the acceptance realised, measured forward costs, "
            "no overhead)")


#: Node log messages the launcher relays while it waits for the nodes (profiling is their long start-up step).
_RELAYED = re.compile(r"\(budget (?P<budget>[\d.]+) s\) \.\.\.$|: cached$|^dtype auto for |busy|"
                      r"waiting for another node")
_LOG_LINE = re.compile(r"^\S+ \S+ (?P<role>\S+) INFO (?P<msg>.*)$")


class ProfileRelay:
    """Follows the nodes' logs while the launcher waits for them and relays their profiling progress: on a
    terminal a bar per measurement (seconds of its budget), elsewhere the few lines as they are."""

    def __init__(self, logs: dict[str, Path], emit: Callable[[str], None], terminal: bool | None = None):
        self.logs = logs
        self.emit = emit
        self.terminal = is_terminal() if terminal is None else terminal
        self.offsets = dict.fromkeys(logs, 0)
        self.bars: dict[str, tuple[Any, float]] = {}  # role -> (tqdm bar, monotonic start)

    def _lines(self, name: str) -> list[str]:
        try:
            with open(self.logs[name], "rb") as fh:
                fh.seek(self.offsets[name])
                data = fh.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # complete lines only; the rest is read next time
        self.offsets[name] += end
        return data[:end].decode(errors="replace").splitlines()

    def poll(self) -> None:
        """Relay what the logs gained since the last call; advance the bars."""
        now = time.monotonic()
        for name in self.logs:
            for line in self._lines(name):
                m = _LOG_LINE.match(line)
                if m is None:
                    continue
                msg = m["msg"].removeprefix(f"{m['role']}: ").replace("dtype auto: dtype auto for", "dtype auto for")
                hit = _RELAYED.search(msg)
                if hit is None:
                    continue
                self._close(name)
                if hit["budget"] and self.terminal:
                    from tqdm import tqdm

                    bar = tqdm(total=float(hit["budget"]), desc=f"[pipespec] {name}: {msg[:60]}", unit="s",
                               bar_format="{desc} {bar} {n:.0f}/{total:.0f} s", leave=False)
                    self.bars[name] = (bar, now)
                else:
                    self.emit(f"{name}: {msg}")
        for bar, started in self.bars.values():
            bar.n = min(bar.total, now - started)
            bar.refresh()

    def _close(self, name: str) -> None:
        if name in self.bars:
            self.bars.pop(name)[0].close()

    def close(self) -> None:
        for name in list(self.bars):
            self._close(name)
