"""Pass planning: setups (a persistent transformers worker, a pipespec cluster, a llama.cpp server or an OpenVINO
GenAI worker) and the table
rows run in them, packed into passes that fit the memory budget; the rows chosen on the command line and their order
per prompt."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.models import DTYPE_TAGS
from benchmarks.progress import log
from runtime.paths import results_dir

PROCESS_GIB = 0.5  # resident memory of one Python process with torch and transformers, before any model (measured)


@dataclass
class HFSetup:
    """One persistent transformers worker: the target at one dtype and thread count, assistants loaded on demand."""

    key: str
    dtype: str
    threads: int
    device: str
    target_path: str
    target_gib: float
    curves: list[tuple[str, str, list[int]]] = field(default_factory=list)  # (name, "target" or a path, sizes)
    curve_models: dict[str, float] = field(default_factory=dict)  # GiB of the models the curves need

    processes = 1

    @property
    def base_models(self) -> dict[str, float]:
        return {"target": self.target_gib}

    @property
    def threads_label(self) -> str:
        return "GPU" if self.device == "cuda" else f"{self.threads} thread" + ("s" if self.threads > 1 else "")


@dataclass
class ClusterSetup:
    """One pipespec cluster (a verifier and a drafter process) of ``config`` with ``overrides``."""

    key: str
    config: str | dict[str, Any]
    overrides: dict[str, Any]
    models: dict[str, float]
    processes: int = 2
    curves: list[tuple[str, str, list[int]]] = field(default_factory=list)
    curve_models: dict[str, float] = field(default_factory=dict)

    @property
    def base_models(self) -> dict[str, float]:
        return self.models


@dataclass
class LlamaSetup:
    """One ``llama-server`` process (:mod:`benchmarks.llama_server`): ``target`` GGUF, and ``draft`` GGUF for
    llama.cpp's speculative decoding (``draft_max`` / ``draft_min`` drafted tokens per step), ``threads`` for
    generation and prompt processing, a ``ctx_size``-token context. ``convert_from`` (a transformers folder): make
    ``target`` from it when it is missing (``convert_src``: the llama.cpp source tree with the converter; default
    the one beside ``bin_dir``); ``missing_hint``: what to run when a GGUF is missing and cannot be made."""

    key: str
    bin_dir: Path
    target: Path
    models: dict[str, float]
    threads: int
    ctx_size: int = 4096
    draft: Path | None = None
    draft_max: int = 3
    draft_min: int = 0
    convert_from: str | None = None
    convert_src: Path | None = None
    missing_hint: str = ""
    curves: list[tuple[str, str, list[int]]] = field(default_factory=list)  # none: no cost curves in llama.cpp
    curve_models: dict[str, float] = field(default_factory=dict)

    processes = 1  # not a Python process, but a server's buffers and its draft context: budget the same

    @property
    def base_models(self) -> dict[str, float]:
        return self.models


@dataclass
class OVSetup:
    """One OpenVINO GenAI worker (:mod:`benchmarks.ov_genai`): an ``LLMPipeline`` of the target (the transformers
    folder ``target_path``, exported once), with ``draft_path``'s export as its draft model (``draft_tokens``
    drafted tokens per step) when set; ``threads`` and the ``precision`` hint for the CPU plugin; ``venv``: the
    OpenVINO environment (None: the default one, made when missing). ``curves``: (name, ``"target"`` or
    ``"draft"``, sizes) measured by the worker on its own compiled model, released before the pipeline loads (so
    no ``curve_models`` beside the pipeline's)."""

    key: str
    target_path: str
    models: dict[str, float]
    threads: int
    draft_path: str | None = None
    draft_tokens: int = 5
    precision: str = "bf16"
    venv: Path | None = None
    curves: list[tuple[str, str, list[int]]] = field(default_factory=list)
    curve_models: dict[str, float] = field(default_factory=dict)

    processes = 1

    @property
    def base_models(self) -> dict[str, float]:
        return self.models

    @property
    def threads_label(self) -> str:
        return f"{self.threads} thread" + ("s" if self.threads > 1 else "")


Setup = HFSetup | ClusterSetup | LlamaSetup | OVSetup


@dataclass
class Row:
    """A table row. ``strategy`` (transformers rows): the worker's generate request; ``anchor``: the row whose
    same-pass speed this row's ratio is taken against; ``models``: GiB this row needs loaded in its setup;
    ``curves_only``: no generations, the row only brings its setup (and its cost curves) into a pass."""

    key: str
    label: str
    setup: str
    prompt_set: str = "default"
    strategy: dict[str, Any] | None = None
    anchor: str | None = None
    models: dict[str, float] = field(default_factory=dict)
    curves_only: bool = False


@dataclass
class Pass:
    rows: list[str] = field(default_factory=list)  # keys, in the order the rows were added
    owned: set[str] = field(default_factory=set)  # rows measured for the table here (the others repeat an anchor)
    curves: set[str] = field(default_factory=set)  # setups whose cost curves are measured in this pass
    estimated_gib: float = 0.0


def pass_gib(keys: list[str], curves: set[str], rows: dict[str, Row], setups: dict[str, Setup]) -> float:
    need: dict[str, dict[str, float]] = {}
    for key in keys:
        s = setups[rows[key].setup]
        models = need.setdefault(s.key, dict(s.base_models))
        models.update(rows[key].models)
        if s.key in curves:
            models.update(s.curve_models)
    return sum(setups[s].processes * PROCESS_GIB + sum(m.values()) for s, m in need.items())


def plan_passes(units: list[list[str]], rows: dict[str, Row], setups: dict[str, Setup],
                budget_gib: float) -> list[Pass]:
    """Pack units (lists of row keys that must share a pass, e.g. the rows of one setup, or a pipespec row with
    transformers' same strategy) into passes that fit ``budget_gib``, first fit in the given order; each pass
    also gets the anchors of its rows. A unit too large for any pass gets a pass of its own (and a warning)."""
    passes: list[Pass] = []
    curved: set[str] = set()
    for unit in units:
        for p in [*passes, None]:
            new = [k for k in unit if p is None or k not in p.rows]
            anchors = [rows[k].anchor for k in unit if rows[k].anchor]
            keys = (p.rows if p else []) + new + [a for a in dict.fromkeys(anchors)
                                                  if a not in new and (p is None or a not in p.rows)]
            unit_setups = {rows[k].setup for k in unit} - curved
            curves = (p.curves if p else set()) | {s for s in unit_setups if setups[s].curves}
            gib = pass_gib(keys, curves, rows, setups)
            if p is None or gib <= budget_gib:
                if p is None:
                    p = Pass()
                    passes.append(p)
                    if gib > budget_gib:
                        log(f"WARNING: {', '.join(unit)} need about {gib:.1f} GiB, more than the budget of "
                            f"{budget_gib:.1f} GiB; running them anyway")
                p.rows, p.curves, p.estimated_gib = keys, curves, gib
                p.owned.update(unit)
                curved |= curves
                break
    return passes


def plan_text(passes: list[Pass], rows: dict[str, Row], setups: dict[str, Setup], budget_gib: float) -> str:
    """The passes, their setups and estimated memory, for ``--dry-run``."""
    lines = [f"{len(passes)} pass(es) within a memory budget of {budget_gib:.1f} GiB:"]
    for i, p in enumerate(passes, 1):
        lines.append(f"pass {i}: estimated {p.estimated_gib:.1f} GiB")
        for skey in dict.fromkeys(rows[k].setup for k in p.rows):
            keys = [k for k in p.rows if rows[k].setup == skey]
            shown = ", ".join(k + ("" if k in p.owned else " (reference repeat)") for k in keys)
            curves = " + cost curves" if skey in p.curves else ""
            lines.append(f"  {skey}: {shown}{curves}")
    return "\n".join(lines)


def select_rows(spec: str, keys: list[str], script: str) -> list[str]:
    """``"hf-target-bf16,pipespec"`` → the matching ``keys`` in their order; a token matches a key or a
    ``-``-separated prefix of keys."""
    wanted = set()
    for token in filter(None, (t.strip() for t in spec.split(","))):
        hits = [k for k in keys if k == token or k.startswith(token + "-")]
        if not hits:
            raise SystemExit(f"{script}: unknown row {token!r} (rows: {', '.join(keys)})")
        wanted.update(hits)
    return [k for k in keys if k in wanted]


def rotated(items: list[Any], i: int) -> list[Any]:
    """``items`` rotated left by ``i`` (the row order for prompt ``i``)."""
    if not items:
        return []
    i %= len(items)
    return items[i:] + items[:i]


def pass_parser(doc: str, rows: list[str], dtype_help: str) -> argparse.ArgumentParser:
    """The options every pass-planned benchmark takes (``--out``, ``--rows``, ``--hf-threads``, ``--dtype``,
    ``--memory-gib``, ``--dry-run``); the script adds its own. ``doc``: the module docstring (its first paragraph is
    the description)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="rows: " + ", ".join(rows))
    p.add_argument("--out", type=Path, default=results_dir(), help="output folder (default: results/)")
    p.add_argument("--rows", default=",".join(rows), help="comma list of row keys or key prefixes (default: all)")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="threads of the transformers worker (default: all usable, the affinity count)")
    p.add_argument("--dtype", choices=list(DTYPE_TAGS), default=None, help=dtype_help)
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory the setups of one pass may use together (default: 90%% of MemAvailable at start)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the rows, the passes and their estimated memory, and exit without running")
    return p
