"""What a report computes from raw per-prompt results: a row's totals, tokens/s, speed ratios against its anchor
measured in the same pass, and prompts whose tokens differ from a reference."""

from __future__ import annotations

from typing import Any


def start_row(row: dict[str, Any], raw: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Fill a summary row's error and totals (prompts, new tokens, time, tokens/s) from one row's raw results;
    return its per-prompt records (empty: nothing finished, and the row says so)."""
    raw = raw or {"per_prompt": [], "pass": None}
    row["pass"] = raw["pass"]
    if raw.get("error"):
        row["error"] = raw["error"]
    pp = raw["per_prompt"]
    if not pp:
        row.setdefault("error", "no prompt finished")
        return pp
    row |= {"prompts": len(pp), "new_tokens": sum(p["new_tokens"] for p in pp),
            "time_s": sum(p["time_s"] for p in pp), "tokens_per_s": tps(pp)}
    return pp


def tps(per_prompt: list[dict[str, Any]]) -> float | None:
    time_s = sum(p["time_s"] for p in per_prompt)
    return sum(p["new_tokens"] for p in per_prompt) / time_s if time_s else None


def speed_ratio(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float | None:
    """tokens/s of ``a`` ÷ tokens/s of ``b`` over the prompts both have (a run cut short compares what it has)."""
    n = min(len(a), len(b))
    ta, tb = tps(a[:n]), tps(b[:n])
    return ta / tb if n and ta and tb else None


def token_mismatches(pp: list[dict[str, Any]], ref: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Prompts whose token ids differ from ``ref``'s, with the first differing position."""
    out = []
    for i, (p, r) in enumerate(zip(pp, ref)):
        a, b = p["token_ids"], r["token_ids"]
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"prompt": i, "first_diff": first})
    return out


def anchor_run(data: dict[str, Any], anchor: str, pass_index: int) -> list[dict[str, Any]] | None:
    """The anchor row's per-prompt results measured in pass ``pass_index`` (its own run or a repeat)."""
    own = data["raw"].get(anchor)
    if own and own["pass"] == pass_index:
        return own["per_prompt"]
    repeat = data.get("anchor_runs", {}).get(anchor, {}).get(str(pass_index))
    return repeat["per_prompt"] if repeat else None


def vs_anchor(data: dict[str, Any], key: str, anchor: str | None) -> float | None:
    """A row's tokens/s ÷ its anchor's in the same pass (1.0 for the anchor itself)."""
    raw = data["raw"].get(key)
    if not anchor or not raw or not raw["per_prompt"]:
        return None
    if key == anchor:
        return 1.0
    ref = anchor_run(data, anchor, raw["pass"])
    return speed_ratio(raw["per_prompt"], ref) if ref else None
