"""Profile a config's nodes: ``python -m runtime.profile --config cpu.yaml`` measures how long one forward of the
verifier's and the drafter's model takes for n new tokens, at the configured thread count (and, on a CPU, at all
cores), prints a table and writes ``profile.json`` and ``profile.png`` into ``--out`` (default ``results/profile/``).

``dtype: auto`` (in the config or ``--set verifier.dtype=auto``) picks the dtype as a node would
(:func:`shared.costs.dtype_choice.resolve_auto_dtype`) and shows both candidates' scores. Profiles are cached on
disk (:func:`shared.costs.cache.profile_cache_dir`); ``--fresh`` measures again. Progress goes to stderr, the table
to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drafter_node.types import drafter_spec
from runtime.config import ConfigError, load_config, typed
from runtime.paths import results_dir
from shared.costs.cache import profile_cache_dir
from shared.costs.curve import NodeProfile, verify_score
from shared.costs.dtype_choice import resolve_auto_dtype
from shared.costs.hardware import cpu_model_name, hardware_flags
from shared.costs.measure import load_or_measure
from shared.models import ModelLoadError, ThreadPlan, load_causal_lm, profile_sizes
from shared.named_models import RegistryError
from weights import resolve_model

DEFAULT_OUT = results_dir() / "profile"
DEFAULT_BUDGET_S = 20.0


class ProfileOutputError(RuntimeError):
    """The output folder or its files cannot be written."""


def _label(model: str) -> str:
    """A short name for the table: a local folder's base name, a named model or hub id as is."""
    path = Path(model).expanduser()
    return path.name if path.is_dir() else model


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Node:
    """One model to profile, as its node would load it."""

    role: str  # "verifier" | "drafter"
    label: str  # shown in the table
    path: str  # what from_pretrained gets
    device: str
    dtype: str  # a dtype name or "auto"
    threads: list[int]
    sizes: list[int]
    max_memory: dict | None = None
    model_config: Any = None  # an architecture replacing the checkpoint's (the spec's profile_model)
    variant: str = ""


def _threads(config: dict[str, Any], role: str) -> list[int]:
    """The thread counts the node measures at start-up (its share and, with ``threads: auto``, every core)."""
    other = "drafter" if role == "verifier" else "verifier"
    return ThreadPlan.for_node(config[role]["threads"], config[role]["device"], config[other]["device"]).counts()


def plan_nodes(config: dict[str, Any]) -> tuple[list[Node], str | None]:
    """The models to profile (verifier first) and, when the drafter has none to profile, the reason.

    What to profile of the drafter comes from its type's spec: none (``needs_model`` false, or ``profile_skip``
    says why), the checkpoint as a causal LM, or a reshaped one (``profile_model``), under the cache variant the
    node uses (``profile_variant``)."""
    v, d = config["verifier"], config["drafter"]
    sizes = profile_sizes(d["max_draft_tokens"])
    target = resolve_model(v["model"], progress=_progress)
    nodes = [Node("verifier", _label(v["model"]), target, v["device"], v["dtype"], _threads(config, "verifier"), sizes,
                  v["max_memory"])]
    kind = d["type"]
    spec = drafter_spec(kind)
    if not spec.needs_model:
        return nodes, f"{kind} holds no model (no drafter curve)"
    if spec.profile_skip is not None:
        return nodes, spec.profile_skip
    path = resolve_model(d["model"], progress=_progress)
    node = Node("drafter", _label(d["model"]), path, d["device"], d["dtype"], _threads(config, "drafter"), sizes,
                d["max_memory"])
    if spec.profile_model is not None:
        try:
            node.model_config, note = spec.profile_model(d, path)
        except ValueError as exc:  # a spec hook's error names the key (drafter_node/spec.py)
            raise ConfigError(str(exc)) from None
        node.label = f"{node.label} ({note})" if note else node.label
    sections = typed(config)  # the node's own cache key (drafter_node/type_specs)
    node.variant = spec.profile_variant(sections.drafter, sections.drafter_type)
    nodes.append(node)
    return nodes, None


def profile_node(node: Node, budget_s: float, fresh: bool) -> NodeProfile:
    def load(dtype: str):
        return load_causal_lm(node.path, node.device, dtype, node.max_memory, config=node.model_config)

    if node.dtype == "auto":
        model, profile = resolve_auto_dtype(load, node.path, node.device, node.threads, node.sizes, budget_s,
                                            _progress, variant=node.variant, fresh=fresh,
                                            score=verify_score if node.role == "verifier" else None)
    else:
        model = load(node.dtype)
        profile = load_or_measure(model, node.path, node.device, node.dtype, node.threads, node.sizes, budget_s,
                                  _progress, variant=node.variant, fresh=fresh)
    del model
    gc.collect()  # the next node's model must not share memory with this one
    return profile


def hardware_line(flags: dict) -> str:
    yes = {True: "yes", False: "no"}
    return (f"hardware: {cpu_model_name()} ({os.cpu_count()} cores); avx2 {yes[flags['avx2']]}, "
            f"avx512_bf16 {yes[flags['avx512_bf16']]}, amx {yes[flags['amx']]}; GPU {flags['gpu'] or 'none'}")


def format_table(results: list[tuple[Node, NodeProfile]], skipped: str | None, flags: dict) -> str:
    sizes = sorted({n for node, _ in results for n in node.sizes})
    header = ["node", "model", "dtype", "threads", *[f"{n} tok" for n in sizes], "ctx µs/tok", "source"]
    rows = []
    for node, profile in results:
        for threads, curve in sorted(profile.curves.items()):
            cells = []
            for n in sizes:
                mark = "" if n in curve.sizes else "*"
                cells.append(f"{curve.cost(n) * 1e3:.1f}{mark}")
            source = "cached" if profile.cached else f"measured {profile.measured_s:.1f} s"
            rows.append([node.role, node.label, profile.dtype, str(threads) if threads else node.device, *cells,
                         f"{curve.per_context_token_s * 1e6:.2f}", source])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [hardware_line(flags), "ms per forward of n new tokens on a cached prefix "
           f"of {results[0][1].curve(0).prefix_len} tokens (* interpolated: not measured within the budget)", "",
           line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out.append("")
    for node, profile in results:
        if node.dtype == "auto":
            scores = ", ".join(f"{d} {s * 1e3:.1f} ms" for d, s in profile.candidates.items())
            measure = ("seconds per committed token at its best block size, α 0.7" if node.role == "verifier"
                       else "geometric mean per forward")
            out.append(f"{node.role} dtype auto → {profile.dtype} ({measure}: {scores})")
        else:
            out.append(f"{node.role} dtype {profile.dtype} (explicit)")
    if skipped:
        out.append(f"drafter: {skipped}")
    return "\n".join(out)


def write_plot(path: Path, results: list[tuple[Node, NodeProfile]], title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        _progress("matplotlib is not installed: no profile.png (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for node, profile in results:
        for threads, curve in sorted(profile.curves.items()):
            xs = list(range(1, max(node.sizes) + 1))
            where = f"{threads} thread{'s' if threads != 1 else ''}" if threads else node.device
            line, = ax.plot(xs, [curve.cost(n) * 1e3 for n in xs], label=f"{node.role} {profile.dtype} {where}")
            ax.plot(curve.sizes, [s * 1e3 for s in curve.seconds], "o", color=line.get_color())
    ax.set_xlabel("new tokens n in one forward")
    ax.set_ylabel("ms per forward")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(config: dict[str, Any], config_name: str, out: Path, budget_s: float, fresh: bool) -> tuple[str, list[Path]]:
    """Profile the nodes of ``config``, write ``profile.json`` / ``profile.png`` into ``out``; return the table and
    the files written."""
    import torch
    import transformers

    nodes, skipped = plan_nodes(config)
    flags = hardware_flags()
    results = []
    for node in nodes:
        results.append((node, profile_node(node, budget_s, fresh)))
    table = format_table(results, skipped, flags)
    report = {
        "config": config_name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "hardware": {"cpu": cpu_model_name(), "cpu_count": os.cpu_count(), "machine": platform.machine(), **flags},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "budget_s": budget_s,
        "cache": str(profile_cache_dir()),
        "nodes": {node.role: {"model": node.label, "dtype_setting": node.dtype, "sizes": node.sizes,
                              "threads": node.threads, "profile": profile.to_dict()} for node, profile in results},
        "drafter_skipped": skipped,
    }
    written = [out / "profile.json"]
    try:
        out.mkdir(parents=True, exist_ok=True)
        written[0].write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        if write_plot(out / "profile.png", results, hardware_line(flags)):
            written.append(out / "profile.png")
        else:
            (out / "profile.png").unlink(missing_ok=True)  # never leave an earlier run's plot next to this json
    except OSError as exc:
        raise ProfileOutputError(f"cannot write into {out}: {exc}") from None
    return table, written


def _parser(prog: str = "python -m runtime.profile") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu.yaml", help="config file, or a bare name looked up in configs/")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: results/profile/)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds of measuring per node (split over thread counts and auto candidates; "
                        f"default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--fresh", action="store_true", help="measure again even where a cached profile exists")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m runtime.profile") -> int:
    args = _parser(prog).parse_args(argv)
    try:
        if not args.budget > 0 or args.budget > 3600:
            raise ConfigError(f"--budget: must be a number of seconds in (0, 3600], got {args.budget}")
        config = load_config(args.config, args.set)
        table, written = run(config, str(args.config), args.out, args.budget, args.fresh)
    except (ConfigError, ModelLoadError, RegistryError, ProfileOutputError) as exc:
        print(f"profile: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(table)
    print(f"\nwrote {' and '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
