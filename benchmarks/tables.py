"""The text of benchmark reports: the header every report starts with (times, machine, software, passes),
markdown tables and number formatting, and the cost-curve table."""

from __future__ import annotations

import datetime as dt
from typing import Any

from benchmarks.models import DTYPE_TAGS
from benchmarks.runner import WARMUP_TOKENS


def header_lines(meta: dict[str, Any]) -> list[str]:
    """The lines every benchmark report starts with: times, machine, software, models, dtypes, threads, passes."""
    m = meta["machine"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["flags"].items())
    memory = f"{m['memory_gib']:.1f} GiB memory" if m.get("memory_gib") else "memory unknown"
    end = f"{meta['end'][11:19]} UTC ({_duration(meta['start'], meta['end'])})" if meta.get("end") else "not finished"
    lines = [f"- date (UTC): {meta['start'][:10]}; run {meta['start'][11:19]} – {end}",
             f"- machine: {m['cpu']}; {m['cores']} cores usable ({m['logical_cpus']} logical CPUs); {flags}; "
             f"{memory}; GPU: {m['gpu'] or 'none'}",
             f"- software: python {m['python']}, " + ", ".join(f"{k} {v}" for k, v in m["versions"].items())]
    git = meta.get("git")
    if git and git.get("revision"):
        lines.append(f"- revision: {git['revision'][:12]}" + (" with uncommitted changes" if git.get("dirty") else ""))
    for name in ("models", "dtypes", "threads"):
        if meta.get(name):
            lines.append(f"- {name}: {meta[name]}")
    passes = meta.get("passes") or []
    if passes:
        lines.append(f"- interleaving: every row decodes prompt i before any row starts prompt i + 1, the row order "
                     f"rotated by one per prompt; one warm-up generation of {WARMUP_TOKENS} tokens per row first")
    if len(passes) > 1:
        lines.append(f"- {len(passes)} passes (not all setups fit in the memory budget of "
                     f"{meta['memory_budget_gib']:.1f} GiB at once); rows are interleaved within a pass only, and "
                     "each row's ratios are taken against the reference measured in its own pass:")
        for p in passes:
            times = f"{p['start'][11:19]} – {(p.get('end') or '')[11:19] or 'not finished'} UTC" if p.get("start") \
                else "not started"
            lines.append(f"  - pass {p['index']} ({times}, estimated {p['estimated_gib']:.1f} GiB): "
                         + ", ".join(f"`{k}`" for k in p["rows"]))
    return lines


def _duration(start: str, end: str) -> str:
    seconds = (dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)).total_seconds()
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def md_table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    """A markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    rule = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(r) + " |" for r in [header, rule, *rows]]


def curve_table_lines(curves: dict[str, dict[str, Any]], source: str = "the transformers workers",
                      sizes: list[int] | None = None) -> list[str]:
    """One table row per (model, dtype, threads): forward ms over n new tokens on a cached prefix, measured inside
    ``source``, one column per n in ``sizes`` (default 1 to the largest measured). A dtype that is not a torch one
    (an OpenVINO worker's resolved precision) is shown as it is."""
    entries = [(setup, name, c) for setup, info in curves.items() for name, c in info["curves"].items()]
    if not entries:
        return []
    columns = sizes or list(range(1, max(max(c["sizes"]) for _, _, c in entries) + 1))
    rows = []
    for setup, name, c in entries:
        info = curves[setup]
        ms = dict(zip(c["sizes"], c["seconds"]))
        rows.append([f"{name} `{info['models'][name]}`", DTYPE_TAGS.get(info["dtype"], info["dtype"]),
                     info["threads_label"],
                     *(fmt(1000 * ms[n], ".0f") if n in ms else "" for n in columns)])
    prefix = entries[0][2]["prefix_len"]
    return [f"Forward cost, ms, of n new tokens on a cached {prefix}-token prefix (fastest of the repeats; measured "
            f"inside {source}; blank: not measured, the time budget ran out):", "",
            *md_table(["model", "dtype", "threads", *(str(n) for n in columns)], rows, "lll" + "r" * len(columns))]
