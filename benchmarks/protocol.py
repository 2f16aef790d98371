"""Micro-benchmark of the wire codec: encode and decode of the messages a verifier round handles.

Times, per message, ``encode`` and ``decode`` of a typical draft (8 tokens, sparse q 8×16, the drafter's stats), a
commit (9 tokens, no extras) and a chunk (9 tokens, a few words of text), and the verifier's share of one round:
decode the draft, encode the commit and the chunk (sending costs the same either way and is left out). With
``--baseline REF`` it also times ``shared/protocol.py`` as it is at git revision REF (a version before the typed
messages, which took ``encode(type, tensors, **fields)``) and prints both side by side.

    python scripts/bench_protocol.py                      # this tree only
    python scripts/bench_protocol.py --baseline 04b41d4   # against the untyped codec
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent

#: A drafter's stats as it sends them with each block (every DrafterStats field set).
STATS = {"busy_s": 0.8123, "blocks": 41, "predraft_hits": 12, "rolled_back": 30, "idle_blocks": 0, "batch_steps": 52,
         "batch_rows": 60, "tree_blocks": 0, "side_accepted": 0, "plans": {"overlap": 30, "sync": 11},
         "dtype": "float32",
         "timing": {"step_s": 0.61, "send_s": 0.004, "commit_s": 0.01, "roundtrip_s": 0.9, "roundtrips": 40,
                    "forward_s": 0.5, "profile_s": 0.45},
         "plan_rates": {"overlap k=4 rows=2": [30, 112, 3.1, 1080.0], "sync k=2": [11, 25, 1.2, 230.0]},
         "plan_check": {"startup": "overlap k=4 rows=2", "realised_best": "overlap k=4 rows=2",
                        "verdict": "confirmed"},
         "ceiling_tokens_per_second": 41.5}


def _fields() -> dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    q_idx = torch.randint(0, 151_936, (8, 16), generator=g)
    q_prob = torch.rand(8, 16, generator=g)
    tokens = [int(t) for t in torch.randint(0, 151_936, (9,), generator=g)]
    return {
        "draft": ({"session": 3, "base_len": 517, "tokens": tokens[:8], "idle_rounds": 0,
                   "overlap": True, "sent_at": time.time(), "stats": STATS},
                  {"q_idx": q_idx, "q_prob": q_prob}),
        "commit": ({"session": 3, "base_len": 517, "tokens": tokens, "drafted": 8, "accepted": 8,
                    "verify_s": 0.0213, "threads": 2}, {}),
        "chunk": ({"request_id": 7, "token_ids": tokens, "text": " return a + b\n\ndef sub(a, b):"}, {}),
    }


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def _for_version(module: ModuleType, msg_type: str, fields: dict) -> dict:
    """The same message in a codec version's fields: before schema 2, a draft's ``epoch`` and a commit's
    ``new_len`` were required and the stats a plain map; from 2 on, the stats are a ``DrafterStats``."""
    fields = dict(fields)
    if getattr(module, "SCHEMA_VERSION", 1) < 2:
        if msg_type == "draft":
            fields["epoch"] = fields["stats"]["blocks"]
        elif msg_type == "commit":
            fields["new_len"] = fields["base_len"] + len(fields["tokens"])
    elif msg_type == "draft":
        s = dict(fields["stats"])
        s["timing"] = module.DrafterTiming(**s["timing"])
        s["plan_check"] = module.PlanCheck(**s["plan_check"])
        fields["stats"] = module.DrafterStats(**s)
    return fields


def _encoder(module: ModuleType, msg_type: str, fields: dict, tensors: dict) -> Callable[[], list]:
    types = getattr(module, "MESSAGE_TYPES", None)
    fields = _for_version(module, msg_type, fields)
    if types is None:  # the untyped codec: encode(type, tensors, **fields)
        return lambda: module.encode(msg_type, tensors or None, **fields)
    msg = types[msg_type](**fields, **({"tensors": tensors} if tensors else {}))
    return lambda: module.encode(msg)


def _per_call_us(fn: Callable[[], Any], loops: int) -> float:
    t0 = time.perf_counter()
    for _ in range(loops):
        fn()
    return (time.perf_counter() - t0) / loops * 1e6


def measure(modules: dict[str, ModuleType], loops: int, repeats: int) -> dict[str, dict[str, dict[str, float]]]:
    """µs per call of encode and decode for each message and codec, and the verifier's part of one round. The
    codecs take turns within every repeat (best of the repeats), so load from other processes hits them alike."""
    calls = {}
    for name, module in modules.items():
        for msg_type, (fields, tensors) in _fields().items():
            enc = _encoder(module, msg_type, fields, tensors)
            frames = [memoryview(f).tobytes() if not isinstance(f, bytes) else f for f in enc()]
            assert module.decode(frames) is not None
            calls[(name, msg_type, "encode")] = enc
            calls[(name, msg_type, "decode")] = lambda m=module, f=frames: m.decode(f)
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for key, fn in calls.items():
            best[key] = min(best[key], _per_call_us(fn, loops))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (name, msg_type, op), us in best.items():
        out.setdefault(name, {}).setdefault(msg_type, {})[op] = us
    for r in out.values():
        r["round"] = {"encode": r["commit"]["encode"] + r["chunk"]["encode"], "decode": r["draft"]["decode"]}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REF", help="also time shared/protocol.py at this git revision")
    ap.add_argument("--loops", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    modules = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            source = subprocess.run(["git", "show", f"{args.baseline}:shared/protocol.py"], cwd=ROOT, check=True,
                                    capture_output=True, text=True).stdout
            path = Path(tmp) / "baseline_protocol.py"
            path.write_text(source)
            modules[args.baseline] = _load(path, "baseline_protocol")
        from shared import protocol

        modules["this tree"] = protocol
        runs = measure(modules, args.loops, args.repeats)
    names = list(runs)
    print(f"µs per call (best of {args.repeats} runs of {args.loops} calls, codecs in turn, one thread)")
    head = " | ".join(f"{op} {n}" for op in ("encode", "decode") for n in names)
    print(f"| message | {head} |")
    print("|---" * (1 + 2 * len(names)) + "|")
    labels = {"draft": "draft (8 tokens, q 8×16, stats)", "commit": "commit (9 tokens)",
              "chunk": "chunk (9 tokens, text)", "round": "verifier round (decode draft; encode commit + chunk)"}
    for key, label in labels.items():
        cells = " | ".join(f"{runs[n][key][op]:.1f}" for op in ("encode", "decode") for n in names)
        print(f"| {label} | {cells} |")
    for n in names:
        r = runs[n]["round"]
        print(f"{n}: {r['encode'] + r['decode']:.1f} µs of codec work per verifier round")


if __name__ == "__main__":
    main()
